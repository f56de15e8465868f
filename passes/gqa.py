"""Grouped-query attention without copying the KV cache."""
from __future__ import annotations

import torch
import torch.fx as fx

from .attention import attention_nodes

aten = torch.ops.aten
_RESHAPES = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)


def _shape(node) -> tuple[int, ...] | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _repeated_kv_source(node):
    """If ``node`` is HF's repeat_kv (reshape(expand(unsqueeze(x, 2)))), return (x, n_rep)."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target in _RESHAPES):
        return None
    exp = node.args[0]
    if not (isinstance(exp, fx.Node) and exp.target == aten.expand.default):
        return None
    unsq = exp.args[0]
    if not (isinstance(unsq, fx.Node) and unsq.target == aten.unsqueeze.default and unsq.args[1] == 2):
        return None
    src = unsq.args[0]
    src_shape, out_shape = _shape(src), _shape(node)
    if src_shape is None or out_shape is None or len(src_shape) != 4:
        return None
    if out_shape[1] % src_shape[1] or out_shape[0] != src_shape[0] or out_shape[2:] != src_shape[2:]:
        return None
    return src, out_shape[1] // src_shape[1]


def gqa_fold_pass(gm: fx.GraphModule) -> tuple[fx.GraphModule, int]:
    """Fold the query-head groups into the query length instead of repeating K/V.

    HF's SDPA path with an explicit mask expands every cached K/V head ``n_rep`` times, copying the
    whole cache ([B, Hkv, S, D] -> [B, Hkv * n_rep, S, D]) in every layer of every step. Queries
    are few, so reshape *them* instead: heads ``kv * n_rep + r`` share K/V head ``kv``, and rows
    of attention are independent, so

    Before::

        k2 = reshape(expand(unsqueeze(k, 2), [B, Hkv, R, S, D]), [B, Hkv*R, S, D])     # same for v
        o  = sdpa(q, k2, v2, mask)                     # q [B, H, Q, D], mask [B, 1, Q, S]

    After::

        o2 = sdpa(reshape(q, [B, Hkv, R*Q, D]), k, v, repeat(mask, [1, 1, R, 1]))
        o  = reshape(o2, [B, H, Q, D])

    The result is the same attention (up to float summation order). Only applied when the mask
    broadcasts over heads. Returns (gm, number of attention calls folded).
    """
    folded = 0
    g = gm.graph
    for node in attention_nodes(g):
        q, k, v = node.args[:3]
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        src_k, src_v = _repeated_kv_source(k), _repeated_kv_source(v)
        q_shape, m_shape = _shape(q), _shape(mask)
        if src_k is None or src_v is None or src_k[1] != src_v[1] or q_shape is None:
            continue
        if mask is not None and (m_shape is None or len(m_shape) != 4 or m_shape[1] != 1):
            continue
        (kb, rep), (vb, _) = src_k, src_v
        B, H, Q, D = q_shape
        B = B if isinstance(B, int) else -1  # a dynamic batch: the reshape infers it
        hkv = H // rep
        with g.inserting_before(node):
            q2 = g.call_function(aten.reshape.default, (q, [B, hkv, rep * Q, D]))
            m2 = None if mask is None else g.call_function(aten.repeat.default, (mask, [1, 1, rep, 1]))
            args = (q2, kb, vb, m2) + tuple(node.args[4:])
            kwargs = {kk: vv for kk, vv in node.kwargs.items() if kk != "attn_mask"}
            att = g.call_function(node.target, args, kwargs)
        with g.inserting_after(att):
            out = g.call_function(aten.reshape.default, (att, [B, H, Q, D]))
        node.replace_all_uses_with(out)
        g.erase_node(node)
        folded += 1
    g.lint()
    gm.recompile()
    return gm, folded
