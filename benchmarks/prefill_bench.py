"""Prompt prefill: a call per row (eager) against one packed call (eager, and the packed graph).

A serving pass computes prompt chunks of several rows: some continue a prompt whose first part is
already in the cache, some start one. This script times such passes three ways, interleaved in
one process, on the same cache contents:

- ``per row``: a call of the eager model per row (``fast.prefill_chunk``), what a scheduler
  without packing does for rows whose chunk lengths differ;
- ``packed eager``: one call, the rows packed into one sequence (``fast.prefill_packed(...,
  compiled=False)``);
- ``packed graph``: the same call on the packed prefill graph (``compile(packed_prefill=True)``).

It checks that all three write the same KV (max abs difference), and also times the prompt
prefill of ``generate`` at batch 1 (time to first token less one round) both ways.

    OMP_WAIT_POLICY=PASSIVE MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=68719476736 \
    MALLOC_TOP_PAD_=1073741824 python benchmarks/prefill_bench.py --out benchmarks/results/prefill_smollm2.json
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

import specgraph
from specgraph.capture import new_kv_cache
from specgraph.models import load_model

sys.path.insert(0, os.path.dirname(__file__))
from batch_bench import _source_commit  # noqa: E402
from generate_bench import write_json  # noqa: E402
from width_profile import cpu_name  # noqa: E402

# (committed slots per row, new tokens per row): shapes a serving pass of 256-512 tokens meets
PASSES = {
    "one prompt, 256": ([0], [256]),
    "two prompts, 128 + 128": ([0, 0], [128, 128]),
    "a tail and a new prompt": ([300, 0], [6, 250]),
    "five short prompts": ([0] * 5, [42, 44, 51, 58, 61]),
    "three prompts, 512": ([0, 0, 0], [200, 150, 162]),
    "continuations": ([256, 256], [128, 128]),
}
METHODS = ("per row", "packed eager", "packed graph")


def run_pass(fast, method: str, kv, starts, chunks) -> None:
    rows = list(range(len(starts)))
    if method == "per row":
        for r, (s0, c) in enumerate(zip(starts, chunks)):
            fast.prefill_chunk([t[r:r + 1] for t in kv], c.view(1, -1), s0)
    else:
        fast.prefill_packed(kv, rows, starts, chunks, compiled=method == "packed graph")


def time_pass(fast, method, base, starts, chunks, repeats) -> tuple[float, list]:
    times, kv = [], None
    for _ in range(repeats + 1):  # the first call warms up
        kv = [t.clone() for t in base]
        t0 = time.perf_counter()
        with torch.no_grad():
            run_pass(fast, method, kv, starts, chunks)
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times[1:]), kv


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--max-batch-size", type=int, default=32, help="the compiled object's (the serving default set)")
    ap.add_argument("--repeats", type=int, default=3, help="timed calls per (method, pass) per round")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds over the methods")
    ap.add_argument("--prompt-lengths", default="100,500,1000", help="generate's prompt prefill at batch 1")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    model, _ = load_model(args.model)
    t0 = time.perf_counter()
    fast = specgraph.compile(model, "ngram", max_batch_size=args.max_batch_size, modes=("greedy",), refine="now",
                             packed_prefill=True)
    build_s = round(time.perf_counter() - t0, 1)
    if not fast.packed_prefill_compiled:
        raise SystemExit("no packed prefill graph was built (graph cache off, or a model that cannot pack)")
    g = torch.Generator().manual_seed(0)
    rows = []
    print(f"{'pass':<26} {'tokens':>6} {'per row ms':>10} {'packed eager':>12} {'packed graph':>12} {'graph vs per row':>16} max diff")
    for name, (starts, lengths) in PASSES.items():
        B = len(starts)
        base = new_kv_cache(model, B, fast.slots)
        with torch.no_grad():  # the committed prefixes
            for r, s0 in enumerate(starts):
                if s0:
                    fast.prefill_chunk([t[r:r + 1] for t in base], torch.randint(6, 40000, (1, s0), generator=g), 0)
        chunks = [torch.randint(6, 40000, (n,), generator=g) for n in lengths]
        times = {m: [] for m in METHODS}
        written = {}
        for _ in range(args.rounds):
            for m in METHODS:
                ms, written[m] = time_pass(fast, m, base, starts, chunks, args.repeats)
                times[m].append(ms)
        med = {m: statistics.median(v) for m, v in times.items()}
        diff = max((a[r, :, : s + n] - b[r, :, : s + n]).abs().max().item()
                   for m in METHODS[1:] for a, b in zip(written[m], written["per row"])
                   for r, (s, n) in enumerate(zip(starts, lengths)))
        rows.append(dict(name=name, starts=starts, lengths=lengths, per_row_ms=med["per row"],
                         packed_eager_ms=med["packed eager"], packed_graph_ms=med["packed graph"],
                         speedup=med["per row"] / med["packed graph"], max_abs_diff=diff, passes=times))
        print(f"{name:<26} {sum(lengths):>6} {med['per row']:>10.0f} {med['packed eager']:>12.0f} "
              f"{med['packed graph']:>12.0f} {med['per row'] / med['packed graph']:>15.2f}x {diff:.1e}", flush=True)
    print(f"{'generate prefill, batch 1':<26} {'tokens':>6} {'eager ms':>10} {'graph ms':>12}")
    prompts = []
    for P in (int(p) for p in args.prompt_lengths.split(",")):
        rows_ = [torch.randint(6, 40000, (P,), generator=g).tolist()]
        kv = new_kv_cache(model, 1, fast.slots)
        times = {"eager": [], "graph": []}
        for _ in range(args.rounds):
            for m in times:
                for i in range(args.repeats + 1):
                    t1 = time.perf_counter()
                    with torch.no_grad():
                        if m == "eager":
                            fast.prefill_chunk(kv, torch.tensor(rows_[0][:-1]).view(1, -1), 0)
                        else:
                            fast.prefill_packed(kv, [0], [0], [torch.tensor(rows_[0][:-1])])
                    if i:
                        times[m].append(time.perf_counter() - t1)
        med = {m: 1000 * statistics.median(v) for m, v in times.items()}
        prompts.append(dict(prompt_tokens=P, eager_ms=med["eager"], graph_ms=med["graph"],
                            speedup=med["eager"] / med["graph"]))
        print(f"{'':<26} {P:>6} {med['eager']:>10.0f} {med['graph']:>12.0f} {med['eager'] / med['graph']:>8.2f}x",
              flush=True)
    meta = dict(model=args.model, cpu=cpu_name(), torch=torch.__version__, repeats=args.repeats, rounds=args.rounds,
                build_seconds=build_s, graph_cache=fast.graph_cache, commit=_source_commit())
    if args.out:
        write_json(args.out, meta, {"passes": rows, "generate_prefill": prompts})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
