"""Per-round wall time by depth: ngram vs suffix vs a second ngram object (single workload, greedy, interleaved).

Times every compiled round call per depth k, and the rest of each generate call per round (host work +
eager prefill), for three objects in one process: it separates drafter quality from per-round cost
(the second ngram object shows how much two compiled objects of the same kind differ).

    OMP_WAIT_POLICY=PASSIVE MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=68719476736 \
    MALLOC_TOP_PAD_=1073741824 python benchmarks/round_profile.py --k 4 --out benchmarks/results/round_profile_k4.json
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

import torch

import specgraph
from specgraph.models import load_model
from specgraph.suffix import SuffixIndex

sys.path.insert(0, os.path.dirname(__file__))
from generate_bench import write_json  # noqa: E402
from suffix_bench import build_workloads  # noqa: E402


def time_rounds(fast, record):
    """Wrap ``fast``'s round functions so each call's seconds land in ``record[k]``."""
    orig = fast._round_fn

    def round_fn(B, params, width, k):
        fn = orig(B, params, width, k)

        def timed(*args):
            t0 = time.perf_counter()
            out = fn(*args)
            record[k].append(time.perf_counter() - t0)
            return out
        return timed
    fast._round_fn = round_fn


def run_workload(fast, calls, n_new, eos, pad):
    """All calls once (a fresh suffix index for suffix objects): (new tokens, rounds, seconds)."""
    if fast.draft == "suffix":
        fast.suffix_index = SuffixIndex()
    toks = rounds = 0
    t0 = time.perf_counter()
    for ids in calls:
        out = fast.generate(ids, max_new_tokens=n_new, eos_token_id=eos, pad_token_id=pad)
        toks += out.shape[1] - ids.shape[1]
        rounds += fast.stats.rounds
    return toks, rounds, time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", default="benchmarks/results/round_profile.json")
    args = ap.parse_args(argv)
    model, tok = load_model("default")
    eos = model.generation_config.eos_token_id
    pad = model.generation_config.pad_token_id or eos
    calls = build_workloads(model, tok, args.max_new_tokens, eos, pad)["single"]
    kw = dict(num_speculative_tokens=args.k, backend="inductor", max_batch_size=1, max_seq_len=1024, autotune=False)
    fasts = {"ngram": specgraph.compile(model, "ngram", **kw), "suffix": specgraph.compile(model, "suffix", **kw),
             "ngram_b": specgraph.compile(model, "ngram", **kw)}
    record = {n: collections.defaultdict(list) for n in fasts}
    for n, f in fasts.items():
        time_rounds(f, record[n])
    runs = {n: [] for n in fasts}
    with torch.no_grad():
        for n, f in fasts.items():  # warm-up: compiles every shape the workload needs
            print("warm", n, round(run_workload(f, calls, args.max_new_tokens, eos, pad)[2], 1), flush=True)
        for r in record.values():
            r.clear()
        for i in range(args.runs):
            for n, f in fasts.items():
                toks, rounds, dt = run_workload(f, calls, args.max_new_tokens, eos, pad)
                runs[n].append((toks / dt, rounds, dt))
                print(i + 1, n, f"{toks / dt:.1f} tok/s rounds {rounds}", flush=True)
    rows = []
    for n in fasts:
        r = record[n]
        n_rounds, round_s = sum(len(v) for v in r.values()), sum(sum(v) for v in r.values())
        other_ms = 1e3 * (sum(x[2] for x in runs[n]) - round_s) / n_rounds
        rows.append({"object": n, "tokens_per_s": [x[0] for x in runs[n]],
                     "round_ms_by_k": {k: [1e3 * t for t in v] for k, v in r.items()},
                     "host_prefill_ms_per_round": other_ms})
        print(n, "median tok/s %.2f" % statistics.median(x[0] for x in runs[n]),
              {k: (len(v), round(1e3 * statistics.median(v), 1)) for k, v in sorted(r.items())},
              "host+prefill ms/round %.2f" % other_ms)
    write_json(args.out, {"k": args.k, "runs": args.runs, "torch": torch.__version__, "autotune": False}, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
