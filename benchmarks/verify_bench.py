"""Benchmark verify_chain / verify_tree on SmolLM2's vocabulary (V = 49152).

Compares, interleaved in one process (median of --repeats timed calls each):
  * reference   - the plain-torch reference, eager
  * compiled    - the same reference through torch.compile (Inductor; C++ on CPU)
  * triton      - the Triton kernels (only on CUDA)
for B in {1, 8}, K in {4, 8} (chains; trees use a static tree with K levels and 2 children at the
first level), greedy and T=1 sampling. Prints a table and writes JSON.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/verify_bench.py --out benchmarks/results/verify_cpu.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

import specgraph
from specgraph import TreeSpec, verify_chain, verify_tree


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _time(fn, device, repeats, warmup=2):
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times


def _tree_for_depth(k: int) -> TreeSpec:
    # two branches at depth 1, each continued as a chain to depth k: 2k nodes + root
    paths = [(0,) + (0,) * d for d in range(k)] + [(1,) + (0,) * d for d in range(k)]
    return TreeSpec.from_paths(paths)


def make_cases(device, V, batches, depths):
    g = torch.Generator(device="cpu").manual_seed(0)
    for B in batches:
        for K in depths:
            logits = torch.randn(B, K + 1, V, generator=g).to(device)
            q = torch.softmax(torch.randn(B, K, V, generator=g), -1).to(device)
            drafts = torch.multinomial(q.reshape(-1, V).cpu(), 1, generator=g).view(B, K).to(device)
            yield ("chain", B, K, K + 1, (logits, q, drafts))
            spec = _tree_for_depth(K).to(device)
            N = spec.num_nodes
            tlogits = torch.randn(B, N, V, generator=g).to(device)
            tq = torch.softmax(torch.randn(B, N, V, generator=g), -1).to(device)
            ttok = torch.randint(0, V, (B, N), generator=g).to(device)
            yield ("tree", B, K, N, (tlogits, tq, ttok, spec))


def runner(kind, args, temperature, use_q, compiled):
    def chain(logits, q, drafts):
        return verify_chain(logits, q if use_q else None, drafts, temperature=temperature, validate=False)

    def tree(logits, q, tok, spec):
        return verify_tree(logits, q if use_q else None, tok, spec, temperature=temperature, validate=False)

    fn = chain if kind == "chain" else tree
    if compiled:
        fn = torch.compile(fn, dynamic=False)
    return lambda: fn(*args)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--depths", default="4,8")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/verify_bench.json")
    args = ap.parse_args(argv)
    # every case compiles the same inner functions with new shapes/flags; without this, dynamo stops
    # compiling after 8 variants and silently runs the rest eagerly.
    torch._dynamo.config.recompile_limit = 1024
    torch._dynamo.config.accumulated_recompile_limit = 4096
    device = torch.device(args.device)
    batches = [int(x) for x in args.batches.split(",")]
    depths = [int(x) for x in args.depths.split(",")]
    methods = ["reference"] + ([] if args.no_compile else ["compiled"])
    if device.type == "cuda" and specgraph.kernels.HAS_TRITON:
        methods.append("triton")
    rows = []
    for kind, B, K, N, tensors in make_cases(device, args.vocab, batches, depths):
        for mode, temperature, use_q in (("greedy", 0.0, False), ("sampled q", 1.0, True), ("one-hot q", 1.0, False)):
            fns = {}
            for m in methods:
                if m == "triton":
                    fns[m] = runner(kind, tensors, temperature, use_q, compiled=False)
                else:
                    fns[m] = runner(kind, tensors, temperature, use_q, compiled=(m == "compiled"))
            times = {m: [] for m in methods}
            for m in methods:  # warm up (and compile) each method once before timing
                _set_triton(m)
                _time(fns[m], device, 1, warmup=2)
            for _ in range(args.repeats):  # interleave methods so machine noise hits all alike
                for m in methods:
                    _set_triton(m)
                    times[m] += _time(fns[m], device, 1, warmup=0)
            row = {"kind": kind, "B": B, "K": K, "nodes": N, "mode": mode}
            for m in methods:
                row[f"{m}_ms"] = 1e3 * statistics.median(times[m])
            rows.append(row)
            print(_fmt_row(row, methods), flush=True)
    meta = {
        "torch": torch.__version__, "device": str(device), "vocab": args.vocab, "repeats": args.repeats,
        "machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


def _set_triton(method):
    os.environ["SPECGRAPH_DISABLE_TRITON"] = "0" if method == "triton" else "1"


_HEADER_PRINTED = False


def _fmt_row(row, methods):
    global _HEADER_PRINTED
    head = f"{'kind':<6}{'B':>3}{'K':>3}{'nodes':>6}  {'mode':<10}" + "".join(f"{m + ' ms':>14}" for m in methods)
    if "compiled" in methods:
        head += f"{'ref/compiled':>14}"
    line = f"{row['kind']:<6}{row['B']:>3}{row['K']:>3}{row['nodes']:>6}  {row['mode']:<10}" + "".join(
        f"{row[m + '_ms']:>14.3f}" for m in methods
    )
    if "compiled" in methods:
        line += f"{row['reference_ms'] / row['compiled_ms']:>13.2f}x"
    if not _HEADER_PRINTED:
        _HEADER_PRINTED = True
        return head + "\n" + line
    return line


if __name__ == "__main__":
    raise SystemExit(main())
