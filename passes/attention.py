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


def _layers(graph: fx.Graph) -> int:
    """The model's layer count: its K/V cache inputs come in pairs (placeholders kv_0, kv_1, ...)."""
    return sum(n.op == "placeholder" and n.name.startswith("kv") for n in graph.nodes) // 2


def _score_softmaxes(graph: fx.Graph) -> list[fx.Node]:
    """Softmaxes of ``scores + mask`` form (attention's; a MoE router's softmax reads its logits)."""
    return [n for n in graph.nodes if n.op == "call_function" and n.target in _SOFTMAX
            and isinstance(n.args[0], fx.Node) and n.args[0].target is aten.add.Tensor and len(n.args[0].args) == 2
            and isinstance(n.args[0].args[1], fx.Node)]


def mask_reaches_every_softmax(graph: fx.Graph, mask: fx.Node) -> bool:
    """Eager attention: every layer has one softmax reading scores to which the mask input (or a
    value computed from it, such as a sliding-window band) was added."""
    from_mask = {mask}
    for n in graph.nodes:  # topological order; only through what a mask goes through (not the layers)
        if n.op == "call_function" and n.target in _MASK_OPS and any(a in from_mask for a in n.all_input_nodes):
            from_mask.add(n)
    masked = [n for n in _score_softmaxes(graph) if any(a in from_mask for a in n.args[0].all_input_nodes)]
    return len(masked) == _layers(graph) > 0


def _point_score_masks(graph: fx.Graph, mask: fx.Node) -> int:
    """Eager attention whose mask the model built itself: ``softmax(scores + model_mask)`` becomes
    ``softmax(scores + mask)``. Returns the number of softmaxes rewired."""
    softmaxes = _score_softmaxes(graph)
    if len(softmaxes) != _layers(graph):  # which softmax is a layer's attention would be a guess
        return 0
    for node in softmaxes:
        node.args[0].args = (node.args[0].args[0], mask)
    return len(softmaxes)


_SOFTMAX = (aten.softmax.int, aten._softmax.default, torch.nn.functional.softmax)
# ops a prepared mask passes through on its way to the scores: slicing, views, dtype casts, and a
# sliding-window band (comparisons, where / masked_fill)
_MASK_OPS = {
    aten.slice.Tensor, aten.view.default, aten.reshape.default, aten.expand.default, aten.unsqueeze.default,
    aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout, aten.clone.default, aten.alias.default,
    aten.where.self, aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.isneginf.default, aten.all.dim,
    aten.all.default, aten.logical_not.default, aten.bitwise_not.default, aten.contiguous.default,
}


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
    SDPA call and the mask input does not already reach every attention softmax (transformers'
    eager attention adds a prepared float mask to the scores as it is: 0 calls rewritten).
    """
    mask = next((n for n in gm.graph.nodes if n.op == "placeholder" and n.name == mask_placeholder), None)
    if mask is None:
        names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        raise ValueError(f"no placeholder named {mask_placeholder!r} (placeholders: {names})")
    nodes = attention_nodes(gm.graph)
    if not nodes:
        if mask_reaches_every_softmax(gm.graph, mask):  # eager attention adds the mask input itself
            return gm, 0
        n = _point_score_masks(gm.graph, mask)  # eager attention with a model-built mask (ALiBi models)
        if n and mask_reaches_every_softmax(gm.graph, mask):
            gm.recompile()
            return gm, n
        raise ValueError("no scaled_dot_product_attention call in the graph, and the mask input does not reach "
                         "every attention softmax")
    for n in nodes:
        set_mask(n, mask)
    gm.recompile()
    return gm, len(nodes)
