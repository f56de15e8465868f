"""Low-precision linear layers read their stored weight directly, dequantizing it in registers."""
from __future__ import annotations

import torch
import torch.fx as fx

from specgraph.kernels.dequant_linear import OPS, dense_form, rows_form

ROWS_MAX = 16  # up to this many rows the reduction form is faster than dequantize + GEMM (measured on CPU)


def _rows(node: fx.Node, max_rows: int | None) -> int | None:
    """The row count of the op's input ``x`` [M, K]: static, else ``max_rows`` (a dynamic batch)."""
    val = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
    M = val.shape[0] if isinstance(val, torch.Tensor) else None
    return M if isinstance(M, int) else max_rows


def dequant_linear_pass(gm: fx.GraphModule, max_rows: int | None = None) -> tuple[fx.GraphModule, int]:
    """Replace each quantized linear op (:mod:`specgraph.kernels.dequant_linear`) by an fp32
    form Inductor fuses with the dequantization: a per-output reduction for few rows, the
    dequantized weight and a GEMM for many. The ops' eager kernel (the reference ``generate``
    runs) dequantizes into a buffer first; both sum in fp32.

    Before::  y = specgraph.int8_linear(x, q, scale)                  # x [M, K], M <= ROWS_MAX
    After::   w = q.float()                                            # (dequant_linear.rows_form)
              y = stack([(w * x[m]).sum(-1) for m in range(M)]) * scale

    Before::  y = specgraph.int8_linear(x, q, scale)                  # M > ROWS_MAX
    After::   y = x @ (q.float() * scale[:, None]).t()

    ``max_rows``: the most rows ``x`` has when its row count is dynamic (unknown: the GEMM form).
    Returns (gm, number of ops replaced).
    """
    formats = {op: fmt for fmt, op in OPS.items()}
    replaced = 0
    g = gm.graph
    for node in list(g.nodes):
        fmt = formats.get(node.target) if node.op == "call_function" else None
        if fmt is None:
            continue
        rows = _rows(node, max_rows)
        form = rows_form(fmt) if rows is not None and rows <= ROWS_MAX else dense_form(fmt)
        with g.inserting_before(node):
            new = g.call_function(form, node.args, node.kwargs)
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        g.erase_node(node)
        replaced += 1
    g.lint()
    gm.recompile()
    return gm, replaced
