"""One linear layer at each precision: the compiled forms of specgraph's low-precision ops against
fp32 GEMMs and the CPU's bf16-input weight-pack kernels.

For each weight shape (SmolLM2's MLP and LM head, a 1.1B Llama's MLP) and row count (1: a decode
step; 5: a verify round of 4 drafts; 32: a prefill chunk), the median time of:

- ``fp32 mkl``: ``x @ W.T`` with fp32 weights (what an unfrozen fp32 graph calls);
- ``int8 / int4 / bf16``: ``dequant_linear_pass``'s form for that row count, compiled by Inductor
  (fp32 activations and sums: the kernels ``weights=`` runs);
- ``aten int8 (bf16 in)`` / ``aten int4 (bf16 in)``: ``_weight_int8pack_mm`` and
  ``_weight_int4pack_mm_for_cpu`` on bf16-rounded activations (fast, but not exact: see docs/weights.md).

    OMP_WAIT_POLICY=PASSIVE python benchmarks/dequant_linear_bench.py --out benchmarks/results/dequant_linear.json
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from specgraph.kernels import dequant_linear as dq
from specgraph.passes.dequant import ROWS_MAX
from specgraph.precision import BF16Linear, Int4Linear, Int8Linear

sys.path.insert(0, os.path.dirname(__file__))
from batch_bench import _source_commit  # noqa: E402
from generate_bench import write_json  # noqa: E402
from width_profile import cpu_name  # noqa: E402

SHAPES = {"smollm2 mlp up": (1536, 576), "smollm2 lm head": (49152, 576), "1.1b mlp up": (5632, 2048)}


def median_ms(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def aten_kernels(int8: Int8Linear, int4: Int4Linear):
    """(int8, int4) callables of the CPU's bf16-input weight-pack kernels on the same layers' codes
    and scales (the int4 kernel's offset is that of code 8)."""
    scale8 = int8.scale.bfloat16()
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(dq.int4_codes(int4.codes).to(torch.int32), 8)
    sz = torch.stack([int4.scale.t(), (int4.low + 8 * int4.scale).t()], -1).bfloat16().contiguous()
    return (lambda x: torch.ops.aten._weight_int8pack_mm(x.bfloat16(), int8.qweight, scale8),
            lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x.bfloat16(), packed, dq.GROUP, sz))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,5,32")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch._dynamo.config.recompile_limit = 256  # one compiled form per (shape, rows)
    rows_out = []
    print(f"{'shape':<16} {'rows':>4}  " + "  ".join(f"{c:>18}" for c in
          ("fp32 mkl", "int8", "int4", "bf16", "aten int8 (bf16 in)", "aten int4 (bf16 in)")))
    for name, (N, K) in SHAPES.items():
        torch.manual_seed(0)
        w = torch.randn(N, K) * 0.02
        layers = {"int8": Int8Linear.quantize(w, None), "int4": Int4Linear.quantize(w, None), "bf16": BF16Linear(w, None)}
        aten8, aten4 = aten_kernels(layers["int8"], layers["int4"])
        for M in (int(r) for r in args.rows.split(",")):
            x = torch.randn(M, K)
            t = {"fp32 mkl": median_ms(lambda: x @ w.t(), args.reps)}
            for fmt, layer in layers.items():
                form = dq.rows_form(fmt) if M <= ROWS_MAX else dq.dense_form(fmt)
                fn = torch.compile(form, dynamic=False, fullgraph=True)
                t[fmt] = median_ms(lambda: fn(x, *layer.stored()), args.reps)
            t["aten int8 (bf16 in)"] = median_ms(lambda: aten8(x), args.reps)
            t["aten int4 (bf16 in)"] = median_ms(lambda: aten4(x), args.reps)
            print(f"{name:<16} {M:>4}  " + "  ".join(f"{v:>15.3f} ms" for v in t.values()), flush=True)
            rows_out.append({"shape": name, "N": N, "K": K, "rows": M, "ms": {k: round(v, 4) for k, v in t.items()}})
    if args.out:
        write_json(args.out, {"cpu": cpu_name(), "threads": torch.get_num_threads(), "rows_max": ROWS_MAX,
                              "torch": torch.__version__, "commit": _source_commit()}, rows_out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
