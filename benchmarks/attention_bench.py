"""Block-sparse against SDPA attention: round time of a batch whose rows have different lengths.

A round attends W cache slots, what its longest row needs. With ``attention="sdpa"`` every row
reads those W slots; with ``attention="block_sparse"`` each row reads only the 64-slot blocks its
own mask shows. This script compiles the same model both ways (graph cache on: a second run
loads them), then times greedy rounds (``--k`` drafts, default 0) at each batch size, with the
rows' committed lengths drawn uniformly from each ``--lengths`` range (one row at its top, so
every range attends the same width), the two settings interleaved in one process. It checks that
both emit the same tokens.

    OMP_WAIT_POLICY=PASSIVE MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=68719476736 \
    MALLOC_TOP_PAD_=1073741824 python benchmarks/attention_bench.py --out benchmarks/results/attention_smollm2.json
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

import specgraph
from specgraph.models import load_model
from specgraph.serving.engine import ServingEngine

sys.path.insert(0, os.path.dirname(__file__))
from batch_bench import _source_commit  # noqa: E402
from generate_bench import write_json  # noqa: E402
from width_profile import cpu_name  # noqa: E402

SETTINGS = ("sdpa", "block_sparse")


def round_ms(engine: ServingEngine, L: torch.Tensor, k: int, repeats: int) -> tuple[float, torch.Tensor]:
    """Median ms of a greedy round over rows with committed lengths L (every row live), and its tokens."""
    b = L.shape[0]
    width = engine.fast.round_width(int(L.max()) + k + 1)
    drafts, active = torch.zeros(b, k, dtype=torch.long), torch.ones(b, dtype=torch.bool)
    times = []
    for _ in range(repeats + 1):  # the first call of a (bucket, width) binds its slot input
        engine.L[:b], engine.root[:b] = L, 5
        t0 = time.perf_counter()
        out = engine._run_lane(b, k, width, drafts, active, True, L.tolist(), [t[:b] for t in engine.kv])
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times[1:]), out[0].clone()


@torch.no_grad()
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--batch-sizes", default="1,4,16,32")
    ap.add_argument("--lengths", default="50-700,600-700,50-100", help="ranges of the rows' committed lengths")
    ap.add_argument("--k", type=int, default=0, help="drafts per round (0: plain decoding)")
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds per (setting, shape) per pass")
    ap.add_argument("--passes", type=int, default=2, help="interleaved passes over the settings")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    model, _ = load_model(args.model)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    ranges = [tuple(int(v) for v in r.split("-")) for r in args.lengths.split(",")]
    engines, build_s = {}, {}
    for setting in SETTINGS:
        t0 = time.perf_counter()
        fast = specgraph.compile(model, "ngram" if args.k else None, num_speculative_tokens=max(args.k, 1),
                                 max_batch_size=max(batches), modes=("greedy",), refine="now", attention=setting)
        build_s[setting] = round(time.perf_counter() - t0, 1)
        engines[setting] = ServingEngine(fast)
    g = torch.Generator().manual_seed(0)
    rows = []
    print(f"{'B':>3} {'lengths':>9} {'width':>6} {'sdpa ms':>8} {'sparse ms':>10} {'speedup':>8} same")
    for b in batches:
        for lo, hi in ranges:
            L = torch.randint(lo, hi, (b,), generator=g)
            L[0] = hi
            times = {s: [] for s in SETTINGS}
            tokens = {}
            for _ in range(args.passes):
                for s, eng in engines.items():
                    ms, tokens[s] = round_ms(eng, L, args.k, args.repeats)
                    times[s].append(ms)
            med = {s: statistics.median(v) for s, v in times.items()}
            same = torch.equal(tokens["sdpa"], tokens["block_sparse"])
            width = engines["sdpa"].fast.round_width(hi + args.k + 1)
            rows.append(dict(batch=b, lengths=[lo, hi], width=width, k=args.k, sdpa_ms=med["sdpa"],
                             block_sparse_ms=med["block_sparse"], speedup=med["sdpa"] / med["block_sparse"],
                             same_tokens=same, sdpa_passes=times["sdpa"], block_sparse_passes=times["block_sparse"]))
            print(f"{b:>3} {f'{lo}-{hi}':>9} {width:>6} {med['sdpa']:>8.1f} {med['block_sparse']:>10.1f} "
                  f"{med['sdpa'] / med['block_sparse']:>7.2f}x {same}", flush=True)
    meta = dict(model=args.model, cpu=cpu_name(), torch=torch.__version__, k=args.k, repeats=args.repeats,
                passes=args.passes, build_seconds=build_s, commit=_source_commit(),
                graph_cache={s: e.fast.graph_cache for s, e in engines.items()})
    if args.out:
        write_json(args.out, meta, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
