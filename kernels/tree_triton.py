"""Triton kernel for tree verification; mirrors :func:`tree_outcomes_reference` node for node.

One program per (sequence b, node n) on a ``(B, N)`` grid; N and the children width C are runtime
arguments, so a new tree shape does not recompile (C only picks ``BLOCK_C``, its next power of two,
the size of a small register array, so a recompile happens when the width crosses a power of two). Each program streams its vocabulary row in blocks of ``BLOCK_V``:
an online max / sum pass gives the softmax statistics, and every later pass recomputes
``p = exp(l - m) / s`` blockwise.

The children are tried in order, with scalar state only:

* deterministic children (``draft_probs is None``): ``R(x)`` is ``p(x)``, or 0 if ``x`` is the
  token of an earlier valid child (it was removed after being tried). Test ``u * S < R(x)``, then
  ``S = max(S - R(x), 0)``. The final residual is p with every valid child's token zeroed.
* sampled children (SpecInfer): the residual after valid steps ``i < j`` is
  ``R_j = max(...max(max(p - S_0 q, 0) - S_1 q, 0)..., 0)``, a function of ``p(v)``, ``q(v)`` and the
  scalar history ``S_0..S_{j-1}``, which is kept in a ``BLOCK_C`` register vector (-1 marks an
  invalid child, whose step is skipped). ``R_j(x)`` is computed on scalars for the test
  ``u * S * q(x) < R_j(x)``; ``S_{j+1} = sum R_{j+1}`` is a blocked pass that recomputes
  ``R_{j+1}`` (skipped when no later valid child needs it).

A final pass forms the residual blockwise and runs the races ``argmax R / expo`` and
``argmax p / expo`` together; the residual's running max selects the fallback to p when it is zero
everywhere. Child indices are clamped to >= 0 before gathering tokens and tokens to >= 0, as in the
reference (the root's token and -1 padding are never used as real children).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .chain_triton import _num_warps, _race_update, _softmax_stats, default_block_v

__all__ = ["tree_outcomes_triton"]


@triton.jit
def _child_token(tok_ptr, child_ptr, tok_row, n, C, j, V):
    """(child node index, valid, token id, token in range) of child slot j of node n
    (``child_ptr`` already points at this row's [N, C] children)."""
    child = tl.load(child_ptr + n * C + j).to(tl.int64)
    valid = child >= 0
    x = tl.load(tok_ptr + tok_row + tl.maximum(child, 0)).to(tl.int64)
    x = tl.maximum(x, 0)
    x_ok = x < V
    return child, valid, x, x_ok


@triton.jit
def _s_at(s_hist, c_offs, i):
    """Entry i of the scalar history (exact: one value plus zeros)."""
    return tl.sum(tl.where(c_offs == i, s_hist, 0.0), axis=0)


@triton.jit
def _tree_kernel(
    logits_ptr,  # [B, N, V] f32
    q_ptr,  # [B, N, V] f32 (unused when HAS_Q is False)
    tok_ptr,  # [B, N] int
    child_ptr,  # [N, C] or [B, N, C] int, -1 padded
    u_ptr,  # [B, N, C] f32
    expo_ptr,  # [B, N, V] f32
    choice_ptr,  # [B, N] int64 out
    sampled_ptr,  # [B, N] int64 out
    N,
    C,
    V,
    child_stride_b,  # 0 when every row shares one [N, C] children table
    HAS_Q: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1)
    bn = b * N + n
    row = bn * V  # int64: B*N*V may exceed 2**31
    tok_row = b * N
    child_ptr += b * child_stride_b

    m, s = _softmax_stats(logits_ptr + row, V, BLOCK_V)

    # Last valid child slot: S after a step is only needed if a later valid child reads it.
    last_valid = tl.full([], -1, tl.int32)
    for j in range(C):
        cj = tl.load(child_ptr + n * C + j)
        last_valid = tl.where(cj >= 0, j, last_valid)

    offs0 = tl.arange(0, BLOCK_V)
    c_offs = tl.arange(0, BLOCK_C)
    s_hist = tl.full([BLOCK_C], -1.0, tl.float32)  # S_i used at step i; -1 = invalid child
    S = tl.full([], 1.0, tl.float32)
    choice = tl.full([], -1, tl.int64)
    for j in range(C):
        child, valid, x, x_ok = _child_token(tok_ptr, child_ptr, tok_row, n, C, j, V)
        l_x = tl.load(logits_ptr + row + x, mask=x_ok, other=float("-inf")).to(tl.float32)
        p_x = tl.exp(l_x - m) / s
        u = tl.load(u_ptr + bn * C + j)
        if HAS_Q:
            q_x = tl.load(q_ptr + row + x, mask=x_ok, other=0.0).to(tl.float32)
            r_x = p_x
            for i in range(j):
                s_i = _s_at(s_hist, c_offs, i)
                r_x = tl.where(s_i >= 0.0, tl.maximum(r_x - s_i * q_x, 0.0), r_x)
            passed = u * S * q_x < r_x
        else:
            r_x = p_x
            for i in range(j):
                _c_i, valid_i, x_i, _ok_i = _child_token(tok_ptr, child_ptr, tok_row, n, C, i, V)
                r_x = tl.where(valid_i & (x_i == x), 0.0, r_x)
            passed = u * S < r_x
        take = valid & (choice < 0) & passed
        choice = tl.where(take, child, choice)
        # Residual update after trying child j (also after a take: that residual is never used
        # by the walk, but the reference keeps updating it and so do we).
        if HAS_Q:
            s_hist = tl.where(c_offs == j, tl.where(valid, S, -1.0), s_hist)
            if valid & (j < last_valid):
                total = tl.full([], 0.0, tl.float32)
                for start in range(0, V, BLOCK_V):
                    offs = start + offs0
                    mask = offs < V
                    xv = tl.load(logits_ptr + row + offs, mask=mask, other=float("-inf")).to(tl.float32)
                    p = tl.exp(xv - m) / s
                    q = tl.load(q_ptr + row + offs, mask=mask, other=0.0).to(tl.float32)
                    R = p
                    for i in range(j + 1):
                        s_i = _s_at(s_hist, c_offs, i)
                        R = tl.where(s_i >= 0.0, tl.maximum(R - s_i * q, 0.0), R)
                    total += tl.sum(tl.where(mask, R, 0.0), axis=0)
                S = total
        else:
            S = tl.where(valid, tl.maximum(S - r_x, 0.0), S)
    tl.store(choice_ptr + bn, choice)

    # Final residual, its max, and the two races.
    r_max = tl.full([], 0.0, tl.float32)
    r_best = tl.full([], float("-inf"), tl.float32)
    r_idx = tl.full([], 0, tl.int32)
    p_best = tl.full([], float("-inf"), tl.float32)
    p_idx = tl.full([], 0, tl.int32)
    for start in range(0, V, BLOCK_V):
        offs = start + offs0
        mask = offs < V
        xv = tl.load(logits_ptr + row + offs, mask=mask, other=float("-inf")).to(tl.float32)
        p = tl.exp(xv - m) / s
        R = p
        if HAS_Q:
            q = tl.load(q_ptr + row + offs, mask=mask, other=0.0).to(tl.float32)
            for i in range(C):
                s_i = _s_at(s_hist, c_offs, i)
                R = tl.where(s_i >= 0.0, tl.maximum(R - s_i * q, 0.0), R)
        else:
            for i in range(C):
                _c_i, valid_i, x_i, x_ok_i = _child_token(tok_ptr, child_ptr, tok_row, n, C, i, V)
                x32 = tl.where(valid_i & x_ok_i, x_i, -1).to(tl.int32)
                R = tl.where(offs == x32, 0.0, R)
        e = tl.load(expo_ptr + row + offs, mask=mask, other=1.0).to(tl.float32)
        r_max = tl.maximum(r_max, tl.max(tl.where(mask, R, 0.0), axis=0))
        r_best, r_idx = _race_update(tl.where(mask, R / e, float("-inf")), offs, r_best, r_idx, 2147483647)
        p_best, p_idx = _race_update(tl.where(mask, p / e, float("-inf")), offs, p_best, p_idx, 2147483647)
    sampled = tl.where(r_max > 0.0, r_idx, p_idx)
    tl.store(sampled_ptr + bn, sampled.to(tl.int64))


def tree_outcomes_triton(
    warped_logits: torch.Tensor,  # [B, N, V] float32
    draft_probs: torch.Tensor | None,  # [B, N, V] float32 or None (deterministic children)
    tree_tokens: torch.Tensor,  # [B, N] long
    children: torch.Tensor,  # [N, C] or per row [B, N, C] long, -1 padded
    accept_u: torch.Tensor,  # [B, N, C] float32
    expo: torch.Tensor,  # [B, N, V] float32
    *,
    block_v: int | None = None,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`specgraph.kernels.tree_outcomes_reference`.

    ``block_v`` (a power of two) and ``num_warps`` are tuning knobs only.
    """
    B, N, V = warped_logits.shape
    C = children.shape[-1]
    child_stride_b = N * C if children.dim() == 3 else 0
    device = warped_logits.device
    choice = torch.empty((B, N), dtype=torch.long, device=device)
    sampled = torch.empty((B, N), dtype=torch.long, device=device)
    if B == 0 or N == 0 or V == 0:
        return choice, sampled
    block = default_block_v(V) if block_v is None else int(block_v)
    if block < 1 or block & (block - 1):
        raise ValueError(f"block_v must be a power of two, got {block_v}")

    logits = warped_logits.float().contiguous()
    has_q = draft_probs is not None
    q = draft_probs.float().contiguous() if has_q else logits
    tokens = tree_tokens.contiguous()
    kids = children.to(device).contiguous()
    expo_c = expo.float().contiguous()
    if C == 0:  # no children anywhere: slot arrays are never dereferenced
        kids = torch.full((1,), -1, dtype=torch.long, device=device)
        child_stride_b = 0
        u = torch.zeros(1, dtype=torch.float32, device=device)
    else:
        u = accept_u.float().contiguous()
    _tree_kernel[(B, N)](
        logits, q, tokens, kids, u, expo_c, choice, sampled, N, C, V, child_stride_b,
        HAS_Q=has_q, BLOCK_V=block, BLOCK_C=triton.next_power_of_2(max(C, 1)),
        num_warps=num_warps or _num_warps(block),
        enable_fp_fusion=False,  # S * q rounded before the subtraction, as in the reference
    )
    return choice, sampled
