"""Sliding-window layers of a model whose layers mix window and full attention."""
from __future__ import annotations

import torch
import torch.fx as fx

from .attention import attention_nodes, set_mask

aten = torch.ops.aten
NEG_INF = float("-inf")


def banded_mask(mask: torch.Tensor, position_ids: torch.Tensor, window: int) -> torch.Tensor:
    """``mask`` [B, 1, Q, W] additive, restricted to keys at slot > position - window (slot =
    position for every committed key; drafted keys sit at slots >= their positions, within any
    window wider than the round). A query whose row the band empties (padding, which sees slot 0
    only) keeps its row: its output is ignored, a fully masked row would be NaN."""
    cols = torch.arange(mask.shape[3], device=mask.device).view(1, 1, 1, -1)
    keep = cols > (position_ids.unsqueeze(1).unsqueeze(-1) - window)
    banded = mask.masked_fill(~keep, NEG_INF)
    dead = torch.isneginf(banded).all(dim=-1, keepdim=True)
    return torch.where(dead, mask, banded)


def sliding_window_pass(gm: fx.GraphModule, layer_types: list[str], window: int, mask_placeholder: str = "mask",
                        positions_placeholder: str = "position_ids") -> tuple[fx.GraphModule, int]:
    """Give the attention calls of the sliding layers the window band of the step's mask.

    Runs after ``tree_attention_pass`` (every attention call reads the mask input). Attention calls
    appear in layer order; the i-th reads layer i's kind from ``layer_types``.

    Before::   o_i = sdpa(q, k, v, mask)                      # every layer
    After::    band = banded_mask(mask, position_ids, window)  # once
               o_i = sdpa(q, k, v, band)                      # layer_types[i] == "sliding_attention"

    Eager attention (no SDPA call) keeps the band the step itself computed: 0 calls. Returns (gm,
    attention calls banded). Raises ``ValueError`` when the number of attention calls
    is not the number of layers (the layer of a call would be a guess).
    """
    g = gm.graph
    ph = {n.name: n for n in g.nodes if n.op == "placeholder"}
    if mask_placeholder not in ph or positions_placeholder not in ph:
        raise ValueError(f"placeholders {mask_placeholder!r} and {positions_placeholder!r} are needed, got {list(ph)}")
    nodes = attention_nodes(g)
    if not nodes:  # eager attention: tree_attention_pass left the step's per-kind masks (banded) in place
        return gm, 0
    if len(nodes) != len(layer_types):
        raise ValueError(f"{len(nodes)} attention calls for {len(layer_types)} layers: cannot tell the sliding ones")
    sliding = [n for n, t in zip(nodes, layer_types) if t == "sliding_attention"]
    if sliding:
        last_ph = [n for n in g.nodes if n.op == "placeholder"][-1]
        with g.inserting_after(last_ph):
            band = g.call_function(banded_mask, (ph[mask_placeholder], ph[positions_placeholder], window))
        for n in sliding:
            set_mask(n, band)
    g.lint()
    gm.recompile()
    return gm, len(sliding)
