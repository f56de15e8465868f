"""Attended width: one dynamic-width graph against one static graph per width (compile time, round time).

A round attends the first W cache slots (W >= the longest live row plus the round's slots). The
engine compiles one graph per (batch bucket, depth, mode) whose W is a dynamic dimension
(``attend_mask_width_pass``); the alternative is a static graph per width bucket. This script
builds both for the same shapes and times plain rounds (k drafts, default 0) at each width,
interleaved, in one process: what a dynamic W costs per round, and what it saves in compiles.

    OMP_WAIT_POLICY=PASSIVE MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=68719476736 \
    MALLOC_TOP_PAD_=1073741824 python benchmarks/width_profile.py --out benchmarks/results/width_profile_smollm2.json
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

import specgraph
from specgraph.models import load_model
from specgraph.warping import SamplingParams

sys.path.insert(0, os.path.dirname(__file__))
from batch_bench import _source_commit  # noqa: E402
from generate_bench import write_json  # noqa: E402


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return platform.processor() or "unknown"


def round_inputs(fast, B: int, k: int, width: int):
    """Greedy round inputs with every row's committed length as long as ``width`` allows."""
    L = torch.full((B,), width - fast.span - 1, dtype=torch.long)
    return (torch.zeros(B, dtype=torch.long), L, torch.ones(B, dtype=torch.bool), torch.zeros(B, k),
            torch.ones(B, k + 1, 1), torch.zeros(B, k, dtype=torch.long), torch.zeros(B, k), *fast.kv_cache(B))


def static_graph(fast, B: int, k: int, width: int):
    """The same round compiled for one width only: its attended slots a constant of the graph."""
    fn, cols = fast.round_function(B, SamplingParams(0.0), k), torch.arange(min(width, fast.slots - 1))
    return fast._compiled("static_round", lambda *a: fn(cols, *a))


def timed(fn, args, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(*args)
        out.append(time.perf_counter() - t0)
    return out


@torch.no_grad()
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--widths", default="256,2048")
    ap.add_argument("--k", type=int, default=0, help="drafts per round (0: plain decoding)")
    ap.add_argument("--max-seq-len", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=10, help="timed calls per (method, width) per pass")
    ap.add_argument("--passes", type=int, default=3, help="interleaved passes over the methods")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    model, _ = load_model(args.model)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    widths = [int(w) for w in args.widths.split(",")]
    fast = specgraph.compile(model, max_batch_size=max(batches), max_seq_len=args.max_seq_len, warmup=False)
    params = SamplingParams(0.0)
    rows = []
    for B in batches:
        fns = {("dynamic", w): fast._round_fn(B, params, w, args.k) for w in widths}
        fns.update({("static", w): static_graph(fast, B, args.k, w) for w in widths})
        compile_s = {}
        for (method, w), fn in fns.items():  # first call = build
            t0 = time.perf_counter()
            fn(*round_inputs(fast, B, args.k, w))
            compile_s[(method, w)] = time.perf_counter() - t0
            print(f"B={B} {method} W={w}: first call {compile_s[(method, w)]:.1f} s", file=sys.stderr, flush=True)
        times = {key: [] for key in fns}
        for _ in range(args.passes):
            for key, fn in fns.items():
                times[key] += timed(fn, round_inputs(fast, B, args.k, key[1]), args.repeats)
        for (method, w), ts in times.items():
            rows.append(dict(batch=B, k=args.k, method=method, width=w, first_call_s=compile_s[(method, w)],
                             round_ms_median=1e3 * statistics.median(ts), round_ms_min=1e3 * min(ts)))
    print(f"{'B':>3} {'width':>6} {'static ms':>10} {'dynamic ms':>11} {'dyn/static':>10}")
    for B in batches:
        for w in widths:
            st = next(r for r in rows if r["batch"] == B and r["width"] == w and r["method"] == "static")
            dy = next(r for r in rows if r["batch"] == B and r["width"] == w and r["method"] == "dynamic")
            print(f"{B:>3} {w:>6} {st['round_ms_median']:>10.1f} {dy['round_ms_median']:>11.1f} "
                  f"{dy['round_ms_median'] / st['round_ms_median']:>10.2f}")
    meta = dict(model=args.model, cpu=cpu_name(), torch=torch.__version__, k=args.k, max_seq_len=args.max_seq_len,
                autotune=fast.autotune, freeze=fast.freeze, repeats=args.repeats, passes=args.passes,
                graphs_built=fast.graphs_built, commit=_source_commit())
    if args.out:
        write_json(args.out, meta, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
