"""Model-free replay: prompt lookup vs suffix-decoding chains on the same greedy text (no timing noise).

Greedy verification accepts exactly the longest prefix of the drafts that matches the target's own
greedy continuation, so given HF's greedy outputs for the suffix_bench workloads, every round of
``draft="ngram"`` and ``draft="suffix"`` (chains, the compiler's own proposal functions, depth ladder
and SUFFIX_* thresholds) can be replayed without the model: rounds, drafted tokens, accepted tokens,
the depth of each round, and the drafter's host time. ``--slope`` turns that into a speed estimate:
a round of depth k costs (1 + slope * k) plain steps (~0.1 for SmolLM2 on a 2-core CPU).

    python benchmarks/suffix_replay.py --max-new-tokens 96 --out benchmarks/results/suffix_replay.json
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from specgraph import compiler as C
from specgraph.drafters import ngram_propose
from specgraph.models import load_model
from specgraph.suffix import SuffixIndex

sys.path.insert(0, os.path.dirname(__file__))
from generate_bench import write_json  # noqa: E402
from suffix_bench import build_workloads  # noqa: E402


def replay(kind: str, prompt: list[int], cont: list[int], K: int, session=None, **thresholds) -> dict:
    """One greedy generation of ``cont`` after ``prompt``, round by round, as SpecGraphModel runs it."""
    ladder = C.default_ladder(K)
    k_now, hist, i = ladder[0], list(prompt), 0
    out = {"rounds": 0, "drafted": 0, "accepted": 0, "host_s": 0.0, "depths": {}}
    while i < len(cont):
        t0 = time.perf_counter()
        if kind == "ngram":
            d, m = ngram_propose(torch.tensor([hist]), torch.tensor([len(hist)]), k_now, C.NGRAM_MAX, C.NGRAM_MIN)
            drafts = d[0].tolist() if int(m[0]) else []
            k = k_now if drafts else 0
        else:
            drafts = C.suffix_chains([session], k_now, **thresholds)[0]
            k = C.chain_depth(C.rungs_upto(ladder, k_now), len(drafts)) if drafts else 0
        out["host_s"] += time.perf_counter() - t0
        a = 0
        while a < len(drafts) and i + a < len(cont) and drafts[a] == cont[i + a]:
            a += 1
        new = cont[i:i + a + 1]
        hist += new
        i += len(new)
        if session is not None:
            t0 = time.perf_counter()
            session.extend(new)
            out["host_s"] += time.perf_counter() - t0
        out["rounds"] += 1
        out["drafted"] += k
        out["accepted"] += a
        out["depths"][k] = out["depths"].get(k, 0) + 1
        if k:
            k_now = C.next_k(ladder, k_now, k, [len(new)])
    return out


def run_workload(kind: str, calls, K: int, slope: float, **thresholds) -> dict:
    """A workload's calls in order; suffix methods share one index across them (as one ``fast`` object)."""
    index = SuffixIndex() if kind == "suffix" else None
    tot = {"tokens": 0, "rounds": 0, "drafted": 0, "accepted": 0, "host_s": 0.0, "cost_steps": 0.0}
    for prompt, cont in calls:
        session = index.start(prompt) if index is not None else None
        r = replay(kind, prompt, cont, K, session, **thresholds)
        if index is not None:
            index.add_document(prompt + cont)
        tot["tokens"] += len(cont)
        for key in ("rounds", "drafted", "accepted", "host_s"):
            tot[key] += r[key]
        tot["cost_steps"] += sum(c * (1 + slope * k) for k, c in r["depths"].items())
    tot["tokens_per_round"] = tot["tokens"] / tot["rounds"]
    tot["tokens_per_step_cost"] = tot["tokens"] / tot["cost_steps"]
    return tot


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--slope", type=float, default=0.1,
                    help="cost of one drafted token, in plain steps (SmolLM2, 2-core CPU: a k=10 round ~2 steps)")
    ap.add_argument("--workloads", default="repeated,multiturn,single")
    ap.add_argument("--out", default="benchmarks/results/suffix_replay.json")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    eos = model.generation_config.eos_token_id
    pad = model.generation_config.pad_token_id or eos
    workloads = build_workloads(model, tok, args.max_new_tokens, eos, pad)
    variants = [("ngram", {}), ("suffix", {}), ("suffix", {"min_match": 1}), ("suffix", {"min_match": 3}),
                ("suffix", {"min_score": 0.3})]
    rows, greedy = [], {}  # prompt -> HF greedy continuation (the repeated workload asks each prompt 3 times)
    with torch.no_grad():
        for wname in args.workloads.split(","):
            calls = []
            for ids in workloads[wname]:
                key = tuple(ids[0].tolist())
                if key not in greedy:
                    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                                         do_sample=False, eos_token_id=eos, pad_token_id=pad)
                    greedy[key] = out[0, ids.shape[1]:].tolist()
                calls.append((list(key), greedy[key]))
            base = None
            for kind, thr in variants:
                r = run_workload(kind, calls, args.k, args.slope, **thr)
                base = base or r["tokens_per_step_cost"]
                name = kind + "".join(f" {k}={v}" for k, v in thr.items())
                rows.append({"workload": wname, "method": name, **r, "est_speed_vs_ngram": r["tokens_per_step_cost"] / base})
                print(f"{wname:<10} {name:<22} tokens/round {r['tokens_per_round']:.2f}  drafted/round "
                      f"{r['drafted'] / r['rounds']:.2f}  host {1e3 * r['host_s'] / r['rounds']:.2f} ms/round  "
                      f"est. speed vs ngram {rows[-1]['est_speed_vs_ngram']:.3f}", flush=True)
    meta = {"max_new_tokens": args.max_new_tokens, "k": args.k, "slope": args.slope,
            "suffix_min_score": C.SUFFIX_MIN_SCORE, "suffix_min_match": C.SUFFIX_MIN_MATCH}
    write_json(args.out, meta, rows)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
