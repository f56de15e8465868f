"""Dead-code elimination that keeps in-place writes (the KV cache updates)."""
from __future__ import annotations

import torch
import torch.fx as fx

aten = torch.ops.aten
_ASSERTS = (aten._assert_tensor_metadata.default, aten._assert_scalar.default)


def _mutates(node: fx.Node) -> bool:
    if node.op == "call_method":
        return node.target.endswith("_") and not node.target.endswith("__")
    if node.op == "call_function":
        if isinstance(node.target, torch._ops.OpOverload):
            return node.target._schema.is_mutable
        name = getattr(node.target, "__name__", "")
        return name.endswith("_") and not name.endswith("__")
    return False


def safe_dce_pass(gm: fx.GraphModule) -> tuple[fx.GraphModule, int]:
    """Remove nodes whose results are unused, never an in-place op.

    FX's default DCE treats ``x.scatter_(...)`` with no users as dead and deletes it (observed on
    dynamo graphs): the cache would silently never be written. Unused metadata asserts are dropped
    first, since they would otherwise keep the replaced mask construction alive.

    Before::  m = le(arange, ...); _assert_tensor_metadata(m); k.scatter_(2, idx, new_k)  # m unused
    After::   k.scatter_(2, idx, new_k)

    Returns (gm, number of nodes removed).
    """
    before = len(gm.graph.nodes)
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and n.target in _ASSERTS and not n.users:
            gm.graph.erase_node(n)
    gm.graph.eliminate_dead_code(is_impure_node=lambda n: n.is_impure() or _mutates(n))
    gm.graph.lint()
    gm.recompile()
    return gm, before - len(gm.graph.nodes)
