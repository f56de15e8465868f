"""Batch buckets: one dynamic-batch round package against one static package per bucket.

The graph cache packages batch 1 on its own and batch buckets 2 .. max_batch_size as one round
per (mode, depth) whose batch is a dynamic dimension (``specgraph.graphset.with_dynamic_batch``).
This script loads (or builds) both layouts of the same graph set from the graph cache and times
greedy rounds at each bucket, interleaved in one process, on the same cache contents, checking
that both give the same tokens. It reports the packages each layout holds, their build seconds
(from the cache's records) and bytes, and the median round time per (bucket, depth).

    OMP_WAIT_POLICY=PASSIVE MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=68719476736 \\
    MALLOC_TOP_PAD_=1073741824 python benchmarks/batch_graph_bench.py \\
        --out benchmarks/results/batch_graphs_smollm2_amd-epyc-2c.json

``--min-rows 1`` shares every bucket from 2 up (the smallest rounds too): what the default
layout's static packages for the smallest rounds avoid.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

import specgraph
from specgraph import graphcache, graphset
from specgraph.graphset import GraphSpec, batch_buckets, example_inputs
from specgraph.models import load_model
from specgraph.warping import SamplingParams

sys.path.insert(0, os.path.dirname(__file__))
from batch_bench import _source_commit  # noqa: E402
from generate_bench import write_json  # noqa: E402
from width_profile import cpu_name  # noqa: E402


def served(fast, root, dynamic: bool) -> dict:
    """Serve ``fast`` from the cache in one layout; returns its packages' names, seconds, bytes."""
    info = graphcache.load_or_build(fast, ("greedy",), progress=True, root=root, dynamic_batch=dynamic)
    if info is None:
        raise SystemExit("the graph cache cannot serve this object")
    pkgs = {id(p): p for p in fast.graphs_in_use().packages.values()}.values()
    out = {}
    for p in pkgs:
        rec = json.loads(Path(str(p.path)[: -len(".pt2")] + ".json").read_text())
        out[p.name] = {"build_s": rec["seconds"], "bytes": rec["file"]["bytes"]}
    return out


def round_inputs(fast, B: int, k: int, width: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    args, _ = example_inputs(fast, GraphSpec("round", B, None, "greedy", k), fast.vocab)
    args[0] = torch.randint(0, fast.vocab, (B,), generator=g)  # root
    args[1] = torch.randint(width // 2, width - k - 2, (B,), generator=g)  # L: committed slots
    args[5] = torch.randint(0, fast.vocab, (B, k), generator=g)  # drafts
    return args


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--max-batch-size", type=int, default=32)
    ap.add_argument("--max-seq-len", type=int, default=2048)
    ap.add_argument("--k", type=int, default=4, help="prompt lookup depth: rounds at depths 0 and k")
    ap.add_argument("--width", type=int, default=384, help="attended cache slots")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--graph-cache", default=None, help="cache root (default: the user's graph cache)")
    ap.add_argument("--min-rows", type=int, default=graphset.DYNAMIC_MIN_ROWS,
                    help="buckets whose round feeds fewer GEMM rows keep a static package (1: every bucket from 2 "
                         "shares the dynamic one)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    graphset.DYNAMIC_MIN_ROWS = args.min_rows
    model, _ = load_model(args.model)
    objs, layouts = {}, {}
    for name, dynamic in (("static", False), ("dynamic", True)):
        fast = specgraph.compile(model, "ngram", num_speculative_tokens=args.k, max_batch_size=args.max_batch_size,
                                 max_seq_len=args.max_seq_len, warmup=False)
        layouts[name] = served(fast, args.graph_cache, dynamic)
        objs[name] = fast
    greedy = SamplingParams(0.0)
    kv = objs["static"].kv_cache(args.max_batch_size)
    g = torch.Generator().manual_seed(0)
    for t in kv:
        t.copy_(torch.randn(t.shape, generator=g))
    rows = []
    with torch.no_grad():
        for B in batch_buckets(args.max_batch_size):
            for k in (0, args.k):
                inputs = round_inputs(objs["static"], B, k, args.width, seed=B * 100 + k)
                fns = {n: f.round_graph(B, greedy, args.width, k) for n, f in objs.items()}
                times, outs = {n: [] for n in fns}, {}
                for rep in range(args.reps + 2):
                    for n, fn in fns.items():  # interleaved; the same cache rows (writes land on the same slots)
                        t0 = time.perf_counter()
                        outs[n] = fn(*inputs, *[t[:B] for t in kv])
                        if rep >= 2:
                            times[n].append(time.perf_counter() - t0)
                same = all(torch.equal(a, b) for a, b in zip(outs["static"], outs["dynamic"]))
                row = {"batch": B, "k": k, "static_ms": round(1e3 * statistics.median(times["static"]), 2),
                       "dynamic_ms": round(1e3 * statistics.median(times["dynamic"]), 2), "same_tokens": same}
                row["ratio"] = round(row["dynamic_ms"] / row["static_ms"], 3)
                rows.append(row)
                print(f"B={B:<3} k={k}  static {row['static_ms']:7.1f} ms  dynamic {row['dynamic_ms']:7.1f} ms  "
                      f"x{row['ratio']:.2f}  {'same tokens' if same else 'DIFFERENT TOKENS'}", flush=True)
    for name, pkgs in layouts.items():
        total = sum(p["bytes"] for p in pkgs.values())
        print(f"{name}: {len(pkgs)} packages, {sum(p['build_s'] for p in pkgs.values()):.0f} s to build, "
              f"{total / 2**30:.1f} GB", flush=True)
    if args.out:
        write_json(args.out, dict(model=args.model, cpu=cpu_name(), max_batch_size=args.max_batch_size,
                                  max_seq_len=args.max_seq_len, width=args.width, k=args.k, reps=args.reps,
                                  min_rows=args.min_rows,
                                  layouts=layouts, commit=_source_commit()), rows)
    return 0 if all(r["same_tokens"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
