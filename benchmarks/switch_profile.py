"""Does switching between compiled graphs cost a round? Times one plain step (depth 0) and one depth-k
round of SmolLM2 at batch B in three orders: each graph run back to back ("steady"), the two
alternating ("alternate"), and one depth-k round after every 7 plain steps ("probe", what auto's
re-probes look like).

Why: in session 11's batch_bench run (frozen graphs, B=16) auto's plain rounds took 234 ms against
129 ms for the same graph run by "off", and auto's rare probe rounds ran 2-4x a warm round in
session 10. Frozen graphs each hold their own prepacked weight copy, so a switch may pay for bringing
another copy's pages back; unfrozen graphs share the model's weights. This script measures it in
isolation, frozen and unfrozen (--freeze / --no-freeze), with the same inputs every call.

    OMP_WAIT_POLICY=PASSIVE MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=68719476736 \
    MALLOC_TOP_PAD_=1073741824 python benchmarks/switch_profile.py --batch 16 --depth 2 --freeze \
    --out benchmarks/results/switch_profile.json
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import specgraph
from specgraph.compiler import attend_width
from specgraph.models import load_model
from specgraph.warping import SamplingParams


def round_call(fast, B: int, k: int, context: int, width: int):
    """A closure running one greedy round at depth k (random drafts) on ``fast``'s batch-B cache."""
    V = fast.model.get_output_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(k)
    fn = fast._round_fn(B, SamplingParams(0.0), width, k)
    kv = fast._cache(B)
    args = (torch.randint(V, (B,), generator=g), torch.full((B,), context, dtype=torch.long),
            torch.ones(B, dtype=torch.bool), torch.zeros(B, k), torch.ones(B, k + 1, 1),
            torch.randint(V, (B, k), generator=g))
    return lambda: fn(*args, args[3], *kv)


def timed_pattern(calls: dict, order: list[int]) -> dict[int, list[float]]:
    """Runs ``calls[k]`` in ``order``; seconds of each call, by k."""
    out = {k: [] for k in calls}
    for k in order:
        t0 = time.perf_counter()
        calls[k]()
        out[k].append(time.perf_counter() - t0)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=32, help="calls per pattern")
    ap.add_argument("--freeze", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.batch < 1 or args.depth < 1 or args.rounds < 8:
        ap.error("need --batch >= 1, --depth >= 1, --rounds >= 8")
    model, _ = load_model("default")
    fast = specgraph.compile(model, "ngram", num_speculative_tokens=args.depth, max_batch_size=args.batch,
                             max_seq_len=256, freeze=args.freeze, autotune=False)
    context = 96
    width = attend_width(context + args.depth + 1, fast.slots, fast.min_attend)
    calls = {k: round_call(fast, args.batch, k, context, width) for k in (0, args.depth)}
    for k, call in calls.items():  # compile, then warm
        t0 = time.perf_counter()
        call()
        print(f"[switch_profile] depth {k}: first call {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        call()
    d, n = args.depth, args.rounds
    patterns = {
        "steady": [0] * n + [d] * n,
        "alternate": [0, d] * (n // 2),
        "probe": ([0] * 7 + [d]) * (n // 8),
    }
    rows = []
    for rep in range(2):  # the patterns twice, in turn: the second pass shows what the first one's order did
        for name, order in patterns.items():
            times = timed_pattern(calls, order)
            for k, ts in times.items():
                rows.append({"pass": rep, "pattern": name, "depth": k, "calls": len(ts),
                             "median_ms": 1e3 * statistics.median(ts), "max_ms": 1e3 * max(ts)})
    print(f"\nB={args.batch} freeze={args.freeze}")
    print(f"{'pass':>4} {'pattern':<10} {'depth':>5} {'calls':>5} {'median ms':>10} {'max ms':>8}")
    for r in rows:
        print(f"{r['pass']:>4} {r['pattern']:<10} {r['depth']:>5} {r['calls']:>5} {r['median_ms']:>10.1f} "
              f"{r['max_ms']:>8.1f}")
    if args.out:
        sys.path.insert(0, __file__.rsplit("/", 1)[0])
        from generate_bench import write_json

        write_json(args.out, {"batch": args.batch, "depth": args.depth, "freeze": args.freeze,
                              "torch": torch.__version__, "threads": torch.get_num_threads()}, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
