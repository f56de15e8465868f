"""Attend to a prefix of the static cache instead of all of it."""
from __future__ import annotations

import torch
import torch.fx as fx

from .attention import attention_nodes

aten = torch.ops.aten


def attend_prefix_pass(gm: fx.GraphModule, width: int) -> tuple[fx.GraphModule, int]:
    """Restrict every attention call to the first ``width`` cache slots.

    The cache is allocated for ``max_seq_len`` slots, but while every live row is shorter than
    ``width`` the later slots are all masked; attending to them costs time in proportion to the
    allocation, not the sequence. The step's mask input becomes [B, 1, Q, width].

    Before::   o = sdpa(q, k_cache, v_cache, mask)                  # k_cache [B, H, S, D]
    After::    o = sdpa(q, k_cache[:, :, :width], v_cache[:, :, :width], mask)

    The cache writes are untouched (they still index the full cache). Returns (gm, calls sliced).
    """
    return _slice_attention(gm, lambda g: width)


def attend_mask_width_pass(gm: fx.GraphModule, mask_placeholder: str = "mask") -> tuple[fx.GraphModule, int]:
    """Every attention call reads as many cache slots as the mask input has columns.

    One graph then serves every attended width: the caller passes a mask [B, 1, Q, W] for any
    W <= S, and attention reads the first W slots. Under ``torch.compile`` with W marked dynamic
    this is one compiled graph whose attention costs what the live prefix costs, where
    :func:`attend_prefix_pass` needs one graph per width.

    Before::   o = sdpa(q, k_cache, v_cache, mask)                  # mask [B, 1, Q, W], k_cache [B, H, S, D]
    After::    w = sym_size(mask, 3)
               o = sdpa(q, k_cache[:, :, :w], v_cache[:, :, :w], mask)

    The cache writes are untouched (they still index the full cache). Returns (gm, calls sliced).
    """
    mask = next((n for n in gm.graph.nodes if n.op == "placeholder" and n.name == mask_placeholder), None)
    if mask is None:
        names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        raise ValueError(f"no placeholder named {mask_placeholder!r} (placeholders: {names})")

    def width(g: fx.Graph) -> fx.Node:
        with g.inserting_after(mask):
            return g.call_function(aten.sym_size.int, (mask, 3))

    return _slice_attention(gm, width)


def _slice_attention(gm: fx.GraphModule, width) -> tuple[fx.GraphModule, int]:
    """Slice the K and V arguments of every attention call to ``width(graph)`` slots."""
    g = gm.graph
    nodes = attention_nodes(g)
    if nodes:
        w = width(g)
        for node in nodes:
            with g.inserting_before(node):
                k = g.call_function(aten.slice.Tensor, (node.args[1], 2, 0, w))
                v = g.call_function(aten.slice.Tensor, (node.args[2], 2, 0, w))
            node.args = (node.args[0], k, v) + tuple(node.args[3:])
    g.lint()
    gm.recompile()
    return gm, len(nodes)
