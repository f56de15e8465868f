"""Plain-torch reference for tree verification, one independent decision per node.

At each node the children are tried in order against a residual distribution R (unnormalised,
with mass S); the first child that passes is the node's ``choice``; if none passes, ``sampled`` is
drawn from what is left of R. The root-to-leaf walk that strings these decisions together is done
afterwards by :func:`specgraph.verify.walk_tree` (a static loop over depth).

Two child schemes, both lossless:

* **Deterministic children** (``draft_probs is None``: top-k, n-gram, static trees): recursive
  rejection sampling. Child x is accepted with probability R(x) / S; on rejection x is removed
  (R(x) = 0, S -= R(x)) and the next child is tried; finally sample from R.
* **Sampled children** (i.i.d. draws from the node's draft distribution q): multi-step speculative
  sampling of SpecInfer (Miao et al., 2024, "SpecInfer", Alg. 2 / Thm. 4.2). Child x is accepted
  with probability min(1, r(x) / q(x)) where r = R / S; on rejection R <- max(0, R - S q),
  S <- sum(R).
"""
from __future__ import annotations

import torch

from .chain_reference import race_sample


def tree_outcomes_reference(
    warped_logits: torch.Tensor,  # [B, N, V] float32 target logits at each node after warping
    draft_probs: torch.Tensor | None,  # [B, N, V] float32 q each node's children were drawn from, or None
    tree_tokens: torch.Tensor,  # [B, N] long
    children: torch.Tensor,  # [N, C] or per row [B, N, C] long child node indices in trial order, -1 padded
    accept_u: torch.Tensor,  # [B, N, C] float32 uniforms in [0, 1)
    expo: torch.Tensor,  # [B, N, V] float32 Exp(1) draws
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``choice`` [B, N] long (accepted child node index, -1 if none) and ``sampled`` [B, N]
    long (the token drawn from the final residual at each node)."""
    B, N, V = warped_logits.shape
    if children.dim() == 2:
        children = children.unsqueeze(0).expand(B, N, children.shape[1])
    C = children.shape[2]
    p = torch.softmax(warped_logits.float(), dim=-1)  # [B, N, V]
    q = None if draft_probs is None else draft_probs.float()
    R = p.clone()
    S = torch.ones(B, N, dtype=torch.float32, device=p.device)
    choice = torch.full((B, N), -1, dtype=torch.long, device=p.device)
    for j in range(C):
        child = children[:, :, j]  # [B, N]
        valid = child >= 0
        x = tree_tokens.gather(1, child.clamp_min(0)).clamp_min(0)  # [B, N]
        r_x = R.gather(-1, x.unsqueeze(-1)).squeeze(-1)
        if q is None:
            passed = accept_u[:, :, j] * S < r_x
        else:
            q_x = q.gather(-1, x.unsqueeze(-1)).squeeze(-1)
            passed = accept_u[:, :, j] * S * q_x < r_x
        take = valid & (choice < 0) & passed
        choice = torch.where(take, child, choice)
        # Residual update after a rejection of child j (harmless where a child was already taken:
        # the residual of such a node is never sampled).
        if q is None:
            S = torch.where(valid, torch.clamp(S - r_x, min=0.0), S)
            R = R.scatter(-1, x.unsqueeze(-1), torch.where(valid, 0.0, r_x).unsqueeze(-1))
        else:
            R_new = torch.clamp(R - S.unsqueeze(-1) * q, min=0.0)
            R = torch.where(valid.unsqueeze(-1), R_new, R)
            S = torch.where(valid, R.sum(dim=-1), S)
    empty = R.amax(dim=-1, keepdim=True) <= 0
    sampled = race_sample(torch.where(empty, p, R), expo)
    return choice, sampled
