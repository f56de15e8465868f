"""FX graph passes (GraphModule -> GraphModule) that turn a captured model step into a speculative step.

The pipeline, in order (see :func:`run_step_pipeline`):

1. ``tree_attention_pass`` - every SDPA call reads the explicit additive mask input (prefix + tree
   ancestors), replacing the model's own causal-mask construction.
   ``sliding_window_pass`` (models whose layers mix window and full attention only) - the
   sliding layers' calls read the window band of that mask.
2. ``gqa_fold_pass`` - grouped-query attention reads the cache once instead of repeating K/V heads.
3. ``safe_dce_pass`` - drop what steps 1-2 made dead, keeping the in-place KV cache writes.
4. ``attend_mask_width_pass`` - attention reads as many cache slots as the mask has columns, so
   one graph serves every attended width (W is a dynamic dimension under ``torch.compile``).

``attend_prefix_pass`` is the static form of step 4 (a copy of the graph per width).
``block_sparse_attention_pass`` (``compile(attention="block_sparse")``, the CPU default) follows
step 4: each row's attention reads only the cache blocks its mask shows, as flex attention.

``dequant_linear_pass`` (compiled graphs of a low-precision model) follows them: each
quantized linear layer reads its stored weight and dequantizes it inside the fused matmul.

Capture itself (the static KV cache with per-row write slots) is :mod:`specgraph.capture`.
"""
from __future__ import annotations

import torch.fx as fx

from .attend import attend_mask_width_pass, attend_prefix_pass
from .attention import attention_nodes, tree_attention_pass
from .dce import safe_dce_pass
from .dequant import dequant_linear_pass
from .gqa import gqa_fold_pass
from .sparse import block_sparse_attention_pass
from .window import banded_mask, sliding_window_pass

STEP_PIPELINE = (tree_attention_pass, gqa_fold_pass, safe_dce_pass, attend_mask_width_pass)


def run_step_pipeline(gm: fx.GraphModule, windows: tuple[list[str], int] | None = None
                      ) -> tuple[fx.GraphModule, dict[str, int]]:
    """Apply the passes in order; returns the graph and the match count of each pass.
    ``windows``: (layer types, window) of a model mixing window and full attention layers."""
    counts = {}
    for p in STEP_PIPELINE:
        gm, n = p(gm)
        counts[p.__name__] = n
        if p is tree_attention_pass and windows is not None:
            gm, counts["sliding_window_pass"] = sliding_window_pass(gm, *windows)
    return gm, counts


__all__ = ["STEP_PIPELINE", "run_step_pipeline", "tree_attention_pass", "gqa_fold_pass", "attend_prefix_pass", "attend_mask_width_pass", "safe_dce_pass", "attention_nodes", "block_sparse_attention_pass", "sliding_window_pass", "banded_mask", "dequant_linear_pass"]
