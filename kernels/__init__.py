"""Verification kernels: each Triton kernel beside its plain-torch reference (and, in
:mod:`.dequant_linear`, the low-precision linear ops with their compiled forms).

``chain_outcomes`` / ``tree_outcomes`` dispatch on the device: CUDA tensors (with Triton available)
take the Triton kernels, everything else the reference. Both consume the same random tensors, so
they agree token for token (checked in CI under ``TRITON_INTERPRET=1``).
"""
from __future__ import annotations

import os

import torch

from .chain_reference import chain_outcomes_reference
from .tree_reference import tree_outcomes_reference

try:  # Triton is optional: absent on some platforms, and never needed on CPU.
    from .chain_triton import chain_outcomes_triton
    from .tree_triton import tree_outcomes_triton

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is missing
    HAS_TRITON = False

__all__ = [
    "chain_outcomes", "tree_outcomes", "chain_outcomes_reference", "tree_outcomes_reference", "HAS_TRITON",
    "use_triton",
]
if HAS_TRITON:
    __all__ += ["chain_outcomes_triton", "tree_outcomes_triton"]


def use_triton(t: torch.Tensor) -> bool:
    """Triton runs on CUDA tensors; SPECGRAPH_DISABLE_TRITON=1 forces the reference."""
    return HAS_TRITON and t.is_cuda and os.environ.get("SPECGRAPH_DISABLE_TRITON", "0") != "1"


def chain_outcomes(warped_logits, draft_probs, draft_tokens, accept_u, expo):
    if use_triton(warped_logits):
        return chain_outcomes_triton(warped_logits, draft_probs, draft_tokens, accept_u, expo)
    return chain_outcomes_reference(warped_logits, draft_probs, draft_tokens, accept_u, expo)


def tree_outcomes(warped_logits, draft_probs, tree_tokens, children, accept_u, expo):
    if use_triton(warped_logits):
        return tree_outcomes_triton(warped_logits, draft_probs, tree_tokens, children, accept_u, expo)
    return tree_outcomes_reference(warped_logits, draft_probs, tree_tokens, children, accept_u, expo)
