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
    g = gm.graph
    nodes = attention_nodes(g)
    for node in nodes:
        with g.inserting_before(node):
            k = g.call_function(aten.slice.Tensor, (node.args[1], 2, 0, width))
            v = g.call_function(aten.slice.Tensor, (node.args[2], 2, 0, width))
        node.args = (node.args[0], k, v) + tuple(node.args[3:])
    g.lint()
    gm.recompile()
    return gm, len(nodes)
