"""Plain-torch reference for chain verification (Leviathan et al. 2023, Alg. 1; Chen et al. 2023).

Every position is decided independently and in parallel (static shapes, no host sync); the
sequential "stop at the first rejection" is a prefix product done afterwards by the caller
(:func:`specgraph.verify.combine_chain`). Randomness comes in as tensors so that the Triton kernel
beside this file can be checked token for token against it.

Sampling uses the exponential race: ``argmax_v w[v] / E[v]`` with ``E ~ Exp(1)`` i.i.d. draws ``v``
with probability ``w[v] / sum(w)``. It needs no normalisation of ``w``, so the residual
``max(0, p - q)`` is used unnormalised.
"""
from __future__ import annotations

import torch


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Unnormalised residual distribution max(0, p - q) (Leviathan et al., eq. after Thm. 1)."""
    return torch.clamp(p - q, min=0.0)


def race_sample(weights: torch.Tensor, expo: torch.Tensor) -> torch.Tensor:
    """Exponential race: index of argmax weights / expo over the last dim (ties -> lowest index)."""
    return torch.argmax(weights / expo, dim=-1)


def accept_test(u: torch.Tensor, p_tok: torch.Tensor, q_tok: torch.Tensor) -> torch.Tensor:
    """Accept with probability min(1, p/q), written without a division: u * q < p."""
    return u * q_tok < p_tok


def chain_outcomes_reference(
    warped_logits: torch.Tensor,  # [B, K+1, V] float32 target logits after warping (-inf = filtered)
    draft_probs: torch.Tensor | None,  # [B, K, V] float32 q rows, or None for one-hot drafts
    draft_tokens: torch.Tensor,  # [B, K] long
    accept_u: torch.Tensor,  # [B, K] float32 uniforms in [0, 1)
    expo: torch.Tensor,  # [B, K+1, V] float32 Exp(1) draws, > 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position outcomes.

    Returns ``accepted`` [B, K] bool (the draft token at k passes its test) and ``recovered``
    [B, K+1] long: for k < K a sample from normalize(max(0, p_k - q_k)), for k = K a sample from
    p_K (the bonus token).
    """
    K = draft_tokens.shape[1]
    p = torch.softmax(warped_logits.float(), dim=-1)  # [B, K+1, V]
    p_draft = p[:, :K]
    tok = draft_tokens.unsqueeze(-1)
    p_tok = p_draft.gather(-1, tok).squeeze(-1)
    if draft_probs is None:
        q_tok = torch.ones_like(p_tok)
        q = torch.zeros_like(p_draft).scatter(-1, tok, 1.0)
    else:
        q = draft_probs.float()
        q_tok = q.gather(-1, tok).squeeze(-1)
    accepted = accept_test(accept_u, p_tok, q_tok)
    weights = torch.cat([residual(p_draft, q), p[:, K:]], dim=1)  # [B, K+1, V]
    # A residual that is zero everywhere (p == q up to rounding) is never needed exactly; fall back
    # to p so the returned token is still a valid sample rather than index 0.
    empty = weights.amax(dim=-1, keepdim=True) <= 0
    weights = torch.where(empty, p, weights)
    recovered = race_sample(weights, expo)
    return accepted, recovered
