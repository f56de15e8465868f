"""Triton kernel for chain verification; mirrors :func:`chain_outcomes_reference` token for token.

One program per (sequence b, position k) on a ``(B, K+1)`` grid; K is a runtime argument, so a new
chain length never recompiles (only the block size and the draft-probs flag are compile-time).
Each program streams its vocabulary row in blocks of ``BLOCK_V``:

1. an online max / sum pass over the warped logits (the softmax statistics ``m``, ``s``);
2. one pass that recomputes ``p = exp(l - m) / s`` blockwise, forms the residual
   ``max(0, p - q)`` (q one-hot on the draft token when ``draft_probs is None``; q = 0 at the
   bonus position, so the residual there is p itself), and runs two exponential races at once:
   ``argmax residual / expo`` and ``argmax p / expo`` (ties -> lowest index, like
   ``torch.argmax``). The residual's running max decides which one is returned, which is the
   reference's "all-zero residual -> sample from p" fallback without a third pass.

The accept test ``u * q_tok < p_tok`` reads ``l[tok]`` and ``q[tok]`` directly. Nothing here syncs
with the host: the wrapper only looks at shapes.

The helpers ``_softmax_stats`` and ``_race_update`` are shared with the tree kernel.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["chain_outcomes_triton", "default_block_v"]


def default_block_v(vocab: int) -> int:
    """Block over the vocabulary: a power of two, at most 2048 (a few registers per thread)."""
    return max(16, min(2048, triton.next_power_of_2(max(int(vocab), 1))))


def _num_warps(block_v: int) -> int:
    return 8 if block_v >= 2048 else 4


@triton.jit
def _softmax_stats(row_ptr, V, BLOCK_V: tl.constexpr):
    """Online (single pass) max and sum of exp over one row of logits; -inf entries count as 0."""
    offs0 = tl.arange(0, BLOCK_V)
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.full([], 0.0, tl.float32)
    for start in range(0, V, BLOCK_V):
        offs = start + offs0
        x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        # While everything seen so far is -inf, shift by 0 instead (exp(-inf - -inf) would be NaN).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe), axis=0)
        m = m_new
    return m, s


@triton.jit
def _race_update(val, offs, best, best_idx, BIG: tl.constexpr):
    """Fold one block into a running argmax. ``val`` is -inf on padding lanes. Within the block the
    lowest index among equal maxima wins; across blocks only a strictly larger maximum replaces the
    running one, so ties go to the lowest index overall (as ``torch.argmax``)."""
    bmax = tl.max(val, axis=0)
    bidx = tl.min(tl.where(val == bmax, offs, BIG), axis=0)
    upd = bmax > best
    return tl.where(upd, bmax, best), tl.where(upd, bidx, best_idx)


@triton.jit
def _chain_kernel(
    logits_ptr,  # [B, K+1, V] f32
    q_ptr,  # [B, K, V] f32 (unused when HAS_Q is False)
    tok_ptr,  # [B, K] int
    u_ptr,  # [B, K] f32
    expo_ptr,  # [B, K+1, V] f32
    acc_ptr,  # [B, K] int8 out
    rec_ptr,  # [B, K+1] int64 out
    K,
    V,
    HAS_Q: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1)
    row = (b * (K + 1) + k) * V  # int64: B*(K+1)*V may exceed 2**31
    is_draft = k < K
    d_idx = b * K + tl.where(is_draft, k, 0)  # [B, K] index (clamped for the bonus program)
    q_row = d_idx * V

    m, s = _softmax_stats(logits_ptr + row, V, BLOCK_V)

    # Draft token: -1 at the bonus position (q = 0 there) and for ids outside [0, V) (rejected).
    tok = tl.load(tok_ptr + d_idx, mask=is_draft, other=-1).to(tl.int64)
    tok_ok = is_draft & (tok >= 0) & (tok < V)
    tok = tl.where(tok_ok, tok, -1)
    tok32 = tok.to(tl.int32)

    # Accept test u * q_tok < p_tok (p_tok from the same formula as the blockwise p below).
    l_tok = tl.load(logits_ptr + row + tok, mask=tok_ok, other=float("-inf")).to(tl.float32)
    p_tok = tl.exp(l_tok - m) / s
    if HAS_Q:
        q_tok = tl.load(q_ptr + q_row + tok, mask=tok_ok, other=0.0).to(tl.float32)
    else:
        q_tok = tl.full([], 1.0, tl.float32)
    u = tl.load(u_ptr + d_idx, mask=is_draft, other=1.0)
    accepted = u * q_tok < p_tok
    tl.store(acc_ptr + d_idx, accepted.to(tl.int8), mask=is_draft)

    # Residual max(0, p - q) and the two races (residual, and p for the all-zero fallback).
    offs0 = tl.arange(0, BLOCK_V)
    q_len = tl.where(is_draft, V, 0)  # no q row at the bonus position
    r_max = tl.full([], 0.0, tl.float32)
    r_best = tl.full([], float("-inf"), tl.float32)
    r_idx = tl.full([], 0, tl.int32)
    p_best = tl.full([], float("-inf"), tl.float32)
    p_idx = tl.full([], 0, tl.int32)
    for start in range(0, V, BLOCK_V):
        offs = start + offs0
        mask = offs < V
        x = tl.load(logits_ptr + row + offs, mask=mask, other=float("-inf")).to(tl.float32)
        p = tl.exp(x - m) / s
        if HAS_Q:
            q = tl.load(q_ptr + q_row + offs, mask=offs < q_len, other=0.0).to(tl.float32)
        else:
            q = tl.where(offs == tok32, 1.0, 0.0)
        res = tl.maximum(p - q, 0.0)
        e = tl.load(expo_ptr + row + offs, mask=mask, other=1.0).to(tl.float32)
        r_max = tl.maximum(r_max, tl.max(tl.where(mask, res, 0.0), axis=0))
        r_best, r_idx = _race_update(tl.where(mask, res / e, float("-inf")), offs, r_best, r_idx, 2147483647)
        p_best, p_idx = _race_update(tl.where(mask, p / e, float("-inf")), offs, p_best, p_idx, 2147483647)
    rec = tl.where(r_max > 0.0, r_idx, p_idx)
    tl.store(rec_ptr + b * (K + 1) + k, rec.to(tl.int64))


def chain_outcomes_triton(
    warped_logits: torch.Tensor,  # [B, K+1, V] float32
    draft_probs: torch.Tensor | None,  # [B, K, V] float32 or None (one-hot drafts)
    draft_tokens: torch.Tensor,  # [B, K] long
    accept_u: torch.Tensor,  # [B, K] float32
    expo: torch.Tensor,  # [B, K+1, V] float32
    *,
    block_v: int | None = None,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`specgraph.kernels.chain_outcomes_reference`.

    ``block_v`` (a power of two) and ``num_warps`` are tuning knobs only; the result does not
    depend on them beyond float rounding of the softmax sum.
    """
    B, K1, V = warped_logits.shape
    K = draft_tokens.shape[1]
    if K1 != K + 1:
        raise ValueError(f"warped_logits must be [B, K+1, V] with K={K}, got {tuple(warped_logits.shape)}")
    device = warped_logits.device
    accepted = torch.empty((B, K), dtype=torch.int8, device=device)
    recovered = torch.empty((B, K1), dtype=torch.long, device=device)
    if B == 0 or V == 0:
        return accepted != 0, recovered  # not .view(torch.bool): Inductor cannot lower an int8 -> bool view
    block = default_block_v(V) if block_v is None else int(block_v)
    if block < 1 or block & (block - 1):
        raise ValueError(f"block_v must be a power of two, got {block_v}")

    logits = warped_logits.float().contiguous()
    expo_c = expo.float().contiguous()
    has_q = draft_probs is not None
    if K == 0:  # every program is the bonus program: draft-side pointers are never dereferenced
        tokens = torch.zeros(1, dtype=torch.long, device=device)
        u = q = torch.zeros(1, dtype=torch.float32, device=device)
        acc_out = torch.zeros(1, dtype=torch.int8, device=device)
    else:
        tokens = draft_tokens.contiguous()
        u = accept_u.float().contiguous()
        q = draft_probs.float().contiguous() if has_q else logits
        acc_out = accepted
    _chain_kernel[(B, K1)](
        logits, q, tokens, u, expo_c, acc_out, recovered, K, V,
        HAS_Q=has_q, BLOCK_V=block, num_warps=num_warps or _num_warps(block),
        enable_fp_fusion=False,  # products rounded before the subtraction, as in the reference
    )
    return accepted != 0, recovered  # not .view(torch.bool): Inductor cannot lower an int8 -> bool view
