"""Start-up of specgraph methods in fresh processes: the first against an empty graph cache, then again.

Each run is a new process (``stream_bench.py --startup-only``: load the model, then
``specgraph.compile`` with the stream benchmark's settings), timed from the outside, in the order
given: a method run after another that built the same graphs finds them in the cache (plain
decoding's depth-0 graph is also the first graph of ``"ngram"`` and ``"suffix"``). ``--defaults``
compiles at ``specgraph.compile``'s own defaults instead (batch up to 8, greedy and sampling).
Each process reports when ``compile`` returned (``build_s``: ready to serve) and when the graphs
it left to the background were all built (``refined_s``; the process waits for them, so its
wall time includes them).

    OMP_WAIT_POLICY=PASSIVE MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=68719476736 \\
    MALLOC_TOP_PAD_=1073741824 python benchmarks/startup_bench.py \\
        --order "specgraph ngram,specgraph ngram,specgraph plain,specgraph suffix" \\
        --out benchmarks/results/startup_smollm2_b1.json
    ... python benchmarks/startup_bench.py --defaults --order "specgraph ngram,specgraph ngram" \
        --out benchmarks/results/startup_smollm2_defaults.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from batch_bench import _source_commit  # noqa: E402
from generate_bench import write_json  # noqa: E402
from width_profile import cpu_name  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--order", default="specgraph ngram,specgraph ngram,specgraph plain,specgraph suffix")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--max-seq-len", type=int, default=2048)
    ap.add_argument("--cache", default=None, help="graph cache folder (default: a new empty one)")
    ap.add_argument("--defaults", action="store_true",
                    help="compile at specgraph.compile's defaults (only the drafter given) instead of the stream's "
                         "settings (--batch, greedy)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    cache = args.cache or tempfile.mkdtemp(prefix="specgraph-startup-")
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stream_bench.py")
    rows = []
    for i, method in enumerate(m.strip() for m in args.order.split(",")):
        cmd = [sys.executable, script, "--startup-only", method, "--model", args.model, "--batch", str(args.batch),
               "--max-seq-len", str(args.max_seq_len)] + ["--defaults"] * args.defaults
        t0 = time.perf_counter()
        res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "SPECGRAPH_GRAPH_CACHE": cache})
        wall = time.perf_counter() - t0
        if res.returncode != 0:
            print(res.stderr[-3000:], file=sys.stderr)
            return 1
        got = json.loads(res.stdout.strip().splitlines()[-1])
        gc = got.get("graph_cache") or {}
        rows.append({"run": i + 1, "method": method, "wall_s": wall, **got})
        print(f"{i + 1}. {method:<20} wall {wall:6.1f} s  load {got['load_s']:5.1f} s  compile {got['build_s']:6.1f} s  "
              f"cache: {'hit' if gc.get('hit') else 'built ' + str(gc.get('built'))} "
              f"(loaded {gc.get('loaded')}, {gc.get('refining', 0)} more in the background, all built at "
              f"{got.get('refined_s', got['build_s']):.1f} s)", flush=True)
    if args.out:
        write_json(args.out, dict(model=args.model, cpu=cpu_name(), batch=args.batch, max_seq_len=args.max_seq_len,
                                  order=args.order, defaults=args.defaults, commit=_source_commit()), rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
