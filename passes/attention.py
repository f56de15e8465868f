"""Tree-attention pass: every attention call reads the step's explicit mask input."""
from __future__ import annotations

import torch
import torch.fx as fx

aten = torch.ops.aten

# attention op -> (positional index of the mask, its keyword name)
_MASK_ARG = {
    aten.scaled_dot_product_attention.default: (3, "attn_mask"),
    torch.nn.functional.scaled_dot_product_attention: (3, "attn_mask"),
    torch._C._nn.scaled_dot_product_attention: (3, "attn_mask"),
}
_IS_CAUSAL_POS = 5


def attention_nodes(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op == "call_function" and n.target in _MASK_ARG]


def set_mask(node: fx.Node, mask: fx.Node) -> None:
    """Make attention call ``node`` read ``mask`` (and not also causal)."""
    pos, kw = _MASK_ARG[node.target]
    if kw in node.kwargs or len(node.args) <= pos:
        node.kwargs = {**node.kwargs, kw: mask}
        if len(node.args) > pos:
            node.args = node.args[:pos] + (mask,) + node.args[pos + 1:]
    else:
        node.args = node.args[:pos] + (mask,) + node.args[pos + 1:]
    # SDPA rejects is_causal=True together with a mask; the mask already encodes causality.
    if node.kwargs.get("is_causal"):
        node.kwargs = {**node.kwargs, "is_causal": False}
    if len(node.args) > _IS_CAUSAL_POS and node.args[_IS_CAUSAL_POS] is True:
        node.args = node.args[:_IS_CAUSAL_POS] + (False,) + node.args[_IS_CAUSAL_POS + 1:]


def tree_attention_pass(gm: fx.GraphModule, mask_placeholder: str = "mask") -> tuple[fx.GraphModule, int]:
    """Point the mask argument of every SDPA call at the step's mask input.

    Before::

        m0 = placeholder[mask]
        m1 = slice(m0, ...); m2 = <model-built causal mask from arange/le/expand>
        o  = scaled_dot_product_attention(q, k, v, m2, is_causal=True)

    After::

        o  = scaled_dot_product_attention(q, k, v, m0, is_causal=False)

    so each query sees exactly the slots the mask allows (committed prefix + tree ancestors).
    Returns (gm, number of attention calls rewritten). Raises ``ValueError`` when the graph has no
    SDPA call (eager attention cannot be rewritten safely: a bool mask through it is silently wrong).
    """
    mask = next((n for n in gm.graph.nodes if n.op == "placeholder" and n.name == mask_placeholder), None)
    if mask is None:
        names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        raise ValueError(f"no placeholder named {mask_placeholder!r} (placeholders: {names})")
    nodes = attention_nodes(gm.graph)
    if not nodes:
        raise ValueError("no scaled_dot_product_attention call in the graph")
    for n in nodes:
        set_mask(n, mask)
    gm.recompile()
    return gm, len(nodes)
