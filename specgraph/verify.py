"""Exact speculative verification of drafted chains and trees.

``verify_chain`` and ``verify_tree`` are batched, static-shaped and free of host syncs on their
hot path (validation of *values* syncs and can be turned off with ``validate=False``; it is skipped
automatically under ``torch.compile``). Per-position / per-node decisions come from the kernels in
:mod:`specgraph.kernels` (Triton on CUDA, the plain-torch reference elsewhere); the sequential part
(stop at the first rejection, walk the tree) is a short static loop here.
"""
from __future__ import annotations

import torch

from specgraph.kernels import chain_outcomes, tree_outcomes
from specgraph.kernels.chain_reference import race_sample
from specgraph.trees import TreeSpec
from specgraph.warping import check_sampling_params, is_greedy, warp_logits

_PROB_ATOL = 1e-3


def prob_tolerance(dtype: torch.dtype, vocab: int = 1) -> float:
    """How far from 1 a row of ``vocab`` probabilities of ``dtype`` may sum: rounding each
    (positive) entry to ``dtype`` moves it by at most eps/2 of itself, or by half the subnormal step
    below the smallest normal, so a row rounded from an exact distribution is within
    ``eps + vocab * tiny * eps / 2`` of 1 (bf16: 2^-7; float16 adds up to 3e-8 per entry for its
    long subnormal range); never tighter than 1e-3."""
    fi = torch.finfo(dtype)
    return max(_PROB_ATOL, fi.eps) + vocab * fi.tiny * fi.eps / 2

# ----------------------------------------------------------------------------------------------
# validation


def _is_compiling() -> bool:
    return torch.compiler.is_compiling()


def _check_logits_values(name: str, logits: torch.Tensor) -> None:
    if torch.isnan(logits).any():
        raise ValueError(f"{name} contains NaN")
    if torch.isposinf(logits).any():
        raise ValueError(f"{name} contains +inf")
    if torch.isneginf(logits).all(dim=-1).any():
        raise ValueError(f"{name} has a row that is -inf everywhere (no token is possible)")


def _check_probs_values(name: str, probs: torch.Tensor) -> None:
    if not torch.isfinite(probs).all():
        raise ValueError(f"{name} contains NaN or inf")
    if (probs < 0).any():
        raise ValueError(f"{name} has negative probabilities")
    sums = probs.sum(dim=-1, dtype=torch.float32)  # no further rounding of the sum itself
    if ((sums - 1.0).abs() > prob_tolerance(probs.dtype, probs.shape[-1])).any():
        flat = sums.flatten()
        worst = flat[(flat - 1.0).abs().argmax()]
        raise ValueError(f"{name} rows must sum to 1 (warped probabilities, not logits); found a row summing to {float(worst):.6g}")


def _check_tokens(name: str, tokens: torch.Tensor, vocab: int) -> None:
    if tokens.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{name} must be an integer tensor, got {tokens.dtype}")
    if ((tokens < 0) | (tokens >= vocab)).any():
        raise ValueError(f"{name} has token ids outside [0, {vocab})")


def _check_float(name: str, t: torch.Tensor) -> None:
    if not t.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")


# ----------------------------------------------------------------------------------------------
# randomness


def _uniform(shape, device, generator) -> torch.Tensor:
    return torch.rand(shape, device=device, dtype=torch.float32, generator=generator)


def exponential_noise(shape, device, generator) -> torch.Tensor:
    # -log(u) with u clamped away from 0 so no draw is exactly 0 or inf.
    u = torch.rand(shape, device=device, dtype=torch.float32, generator=generator)
    return -torch.log(u.clamp_min(torch.finfo(torch.float32).tiny))


# ----------------------------------------------------------------------------------------------
# chain


def combine_chain(
    accepted: torch.Tensor,  # [B, K] bool
    recovered: torch.Tensor,  # [B, K+1] long
    draft_tokens: torch.Tensor,  # [B, K] long
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stop at the first rejection: tokens [B, K+1] (-1 padded) and num_emitted [B] in 1..K+1."""
    B, K = draft_tokens.shape
    n_acc = accepted.long().cumprod(dim=1).sum(dim=1)  # [B] accepted prefix length
    pos = torch.arange(K + 1, device=draft_tokens.device).unsqueeze(0)  # [1, K+1]
    drafts = torch.cat([draft_tokens, draft_tokens.new_full((B, 1), -1)], dim=1)
    final = recovered.gather(1, n_acc.unsqueeze(1))  # [B, 1]
    tokens = torch.where(pos < n_acc.unsqueeze(1), drafts, torch.where(pos == n_acc.unsqueeze(1), final, -1))
    return tokens, n_acc + 1


def verify_chain(
    target_logits: torch.Tensor,  # [B, K+1, V]
    draft_probs: torch.Tensor | None,  # [B, K, V] or None (deterministic drafts)
    draft_tokens: torch.Tensor,  # [B, K] long
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    generator: torch.Generator | None = None,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Leviathan/Chen speculative sampling for a batch of draft chains.

    Args:
        target_logits: ``[B, K+1, V]`` raw target logits at the K draft positions plus the bonus
            position. They are warped here with the given settings.
        draft_probs: ``[B, K, V]`` the warped distribution each draft token was sampled from (use
            :func:`specgraph.warped_probs` with the *same* settings), or ``None`` when drafts are
            deterministic (q is one-hot on the draft token).
        draft_tokens: ``[B, K]`` long.
        temperature: 0 = greedy: accept while the draft equals the target argmax, then emit the argmax.
        validate: check values (NaN/inf logits, probabilities, token range). This syncs with the
            device; it is skipped under ``torch.compile``.

    Returns:
        ``tokens`` ``[B, K+1]`` long, the emitted tokens then -1; ``num_emitted`` ``[B]`` long in 1..K+1.
    """
    check_sampling_params(temperature, top_k, top_p, min_p)
    if target_logits.dim() != 3:
        raise ValueError(f"target_logits must be [B, K+1, V], got shape {tuple(target_logits.shape)}")
    if draft_tokens.dim() != 2:
        raise ValueError(f"draft_tokens must be [B, K], got shape {tuple(draft_tokens.shape)}")
    B, K1, V = target_logits.shape
    K = draft_tokens.shape[1]
    if draft_tokens.shape[0] != B or K1 != K + 1:
        raise ValueError(
            f"shape mismatch: target_logits {tuple(target_logits.shape)} needs draft_tokens [B={B}, K={K1 - 1}], "
            f"got {tuple(draft_tokens.shape)}"
        )
    _check_float("target_logits", target_logits)
    if draft_probs is not None:
        if draft_probs.dim() != 3 or draft_probs.shape[:2] != (B, K):
            raise ValueError(f"draft_probs must be [B={B}, K={K}, V], got {tuple(draft_probs.shape)}")
        if draft_probs.shape[2] != V:
            raise ValueError(f"vocab mismatch: target has V={V}, draft_probs has V={draft_probs.shape[2]}")
        _check_float("draft_probs", draft_probs)
    if validate and not _is_compiling():
        _check_logits_values("target_logits", target_logits)
        _check_tokens("draft_tokens", draft_tokens, V)
        if draft_probs is not None:
            _check_probs_values("draft_probs", draft_probs)

    noise = None if is_greedy(temperature) else chain_noise(B, K, V, target_logits.device, generator)
    return verify_chain_with_noise(target_logits, draft_probs, draft_tokens, noise, temperature, top_k, top_p, min_p)


def chain_noise(B: int, K: int, V: int, device, generator=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The random inputs of one chain verification: accept_u [B, K] and expo [B, K+1, V]."""
    return _uniform((B, K), device, generator), exponential_noise((B, K + 1, V), device, generator)


def verify_chain_with_noise(
    target_logits: torch.Tensor,  # [B, K+1, V]
    draft_probs: torch.Tensor | None,  # [B, K, V] or None
    draft_tokens: torch.Tensor,  # [B, K] long
    noise: tuple[torch.Tensor, torch.Tensor] | None,  # (accept_u [B, K], expo [B, K+1, V]); None if greedy
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`verify_chain` with the random numbers as inputs and no checks: the form traced into
    compiled and exported graphs (reproducible given the same noise).

    Deterministic drafts (``draft_probs`` None) are verified by the exponential race: position j
    emits ``argmax_v p_j[v] / expo[j, v]`` (a sample of p_j), and the draft is accepted iff it is
    that token. The accept test of the general rule reduces to this coupling when q is one-hot
    (accepted with probability p_j(x); otherwise the race winner among the other tokens, a
    sample of the residual p_j with x removed), so the law is the same, and the emitted token
    at each position depends on that position's noise alone: what was drafted there, and how
    the rounds were cut, change only how many rounds a text takes (seeded serving requests
    reproduce whatever shares their batch). ``accept_u`` is then unused."""
    K = draft_tokens.shape[1]
    if is_greedy(temperature):
        target = target_logits.argmax(dim=-1)  # [B, K+1]
    else:
        accept_u, expo = noise
        warped = warp_logits(target_logits, temperature, top_k, top_p, min_p)
        if draft_probs is not None:
            accepted, recovered = chain_outcomes(warped, draft_probs, draft_tokens, accept_u, expo)
            return combine_chain(accepted, recovered, draft_tokens)
        target = race_sample(torch.softmax(warped.float(), dim=-1), expo)  # [B, K+1]
    # greedy and the race: one token per position whatever was drafted; accept while the draft is it
    return combine_chain(draft_tokens == target[:, :K], target, draft_tokens)


def verify_chain_rows(
    target_logits: torch.Tensor,  # [B, K+1, V]
    draft_tokens: torch.Tensor,  # [B, K] long
    noise: tuple[torch.Tensor, torch.Tensor],  # (accept_u [B, K], expo [B, K+1, V])
    temperature: torch.Tensor,  # [B] float32; 0 marks a greedy row
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`verify_chain_with_noise` for deterministic drafts with greedy and sampled rows in one
    batch: a row whose temperature is 0 takes the greedy verification (``argmax`` of its logits,
    its noise unused), every other row the exponential race at its temperature. Each row's
    tokens are exactly what the single-mode verification would give it."""
    K = draft_tokens.shape[1]
    greedy = temperature <= 0  # [B]
    scale = torch.where(greedy, torch.ones_like(temperature), temperature)
    warped = warp_logits(target_logits.float() / scale.view(-1, 1, 1), 1.0, top_k, top_p, min_p)
    raced = race_sample(torch.softmax(warped, dim=-1), noise[1])  # [B, K+1]
    target = torch.where(greedy.unsqueeze(1), target_logits.argmax(dim=-1), raced)
    return combine_chain(draft_tokens == target[:, :K], target, draft_tokens)


# ----------------------------------------------------------------------------------------------
# tree


def walk_tree(
    choice: torch.Tensor,  # [B, N] long accepted child per node, -1 if none
    sampled: torch.Tensor,  # [B, N] long token drawn at each node's final residual
    tree_tokens: torch.Tensor,  # [B, N] long
    max_depth: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Follow accepted children from the root: path_tokens [B, D+1], num_emitted [B], path_nodes [B, D+1].

    ``path_nodes`` lists the nodes whose K/V stay in the cache (the root, then each accepted node);
    ``path_tokens[:, j]`` is the token emitted after ``path_nodes[:, j]``.
    """
    B = choice.shape[0]
    node = torch.zeros(B, dtype=torch.long, device=choice.device)
    alive = torch.ones(B, dtype=torch.bool, device=choice.device)
    tokens, nodes = [], [node]
    for _ in range(max_depth + 1):
        nxt = choice.gather(1, node.unsqueeze(1)).squeeze(1)
        step = alive & (nxt >= 0)
        nxt_tok = tree_tokens.gather(1, nxt.clamp_min(0).unsqueeze(1)).squeeze(1)
        stop_tok = sampled.gather(1, node.unsqueeze(1)).squeeze(1)
        tokens.append(torch.where(step, nxt_tok, torch.where(alive, stop_tok, -1)))
        node = torch.where(step, nxt, node)
        nodes.append(torch.where(step, nxt, -1))
        alive = step
    path_tokens = torch.stack(tokens, dim=1)
    path_nodes = torch.stack(nodes[: max_depth + 1], dim=1)
    num_emitted = (path_tokens >= 0).sum(dim=1)
    return path_tokens, num_emitted, path_nodes


def _greedy_tree_outcomes(target_logits, tree_tokens, children):
    # children [N, C] shared by every row, or [B, N, C] per row
    B, N, _ = target_logits.shape
    target = target_logits.argmax(dim=-1)  # [B, N]
    choice = torch.full((B, N), -1, dtype=torch.long, device=target.device)
    if children.dim() == 2:
        children = children.unsqueeze(0).expand(B, N, children.shape[1])
    for j in reversed(range(children.shape[2])):  # reversed: the first matching child wins
        child = children[:, :, j]
        child_tok = tree_tokens.gather(1, child.clamp_min(0))
        choice = torch.where((child >= 0) & (child_tok == target), child, choice)
    return choice, target


def verify_tree(
    target_logits: torch.Tensor,  # [B, N, V]
    draft_probs: torch.Tensor | None,  # [B, N, V] or None (deterministic children)
    tree_tokens: torch.Tensor,  # [B, N] long
    parents,  # [N] long tensor / list, or a TreeSpec
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    generator: torch.Generator | None = None,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lossless verification of a token tree in one call.

    Args:
        target_logits: ``[B, N, V]`` raw target logits at every node (node 0 = root = the last
            accepted token).
        draft_probs: ``[B, N, V]`` the warped distribution each node's children were drawn from
            (i.i.d.; SpecInfer multi-step speculative sampling, Miao et al. 2024), or ``None`` when
            children were chosen deterministically (top-k, n-gram matches; recursive rejection
            sampling, as in Chen et al. 2023's multi-draft extension and SpecTr's K-SEQ baseline).
        tree_tokens: ``[B, N]`` long token at each node (the root's entry is ignored).
        parents: ``[N]`` parent indices (-1 for the root, topological order), or a
            :class:`specgraph.TreeSpec` built once per shape (avoids re-deriving buffers).

    Returns:
        ``path_tokens`` ``[B, D+1]`` (-1 padded), ``num_emitted`` ``[B]``, ``path_nodes`` ``[B, D+1]``
        node indices of the root and the accepted nodes (-1 padded). D is the tree's depth.
    """
    check_sampling_params(temperature, top_k, top_p, min_p)
    spec = parents if isinstance(parents, TreeSpec) else TreeSpec.from_parents(parents)
    if target_logits.dim() != 3:
        raise ValueError(f"target_logits must be [B, N, V], got shape {tuple(target_logits.shape)}")
    B, N, V = target_logits.shape
    if N != spec.num_nodes:
        raise ValueError(f"shape mismatch: target_logits has N={N} nodes, the tree has {spec.num_nodes}")
    if tree_tokens.shape != (B, N):
        raise ValueError(f"tree_tokens must be [B={B}, N={N}], got {tuple(tree_tokens.shape)}")
    _check_float("target_logits", target_logits)
    if draft_probs is not None:
        if draft_probs.dim() != 3 or draft_probs.shape[:2] != (B, N):
            raise ValueError(f"draft_probs must be [B={B}, N={N}, V], got {tuple(draft_probs.shape)}")
        if draft_probs.shape[2] != V:
            raise ValueError(f"vocab mismatch: target has V={V}, draft_probs has V={draft_probs.shape[2]}")
        _check_float("draft_probs", draft_probs)
    device = target_logits.device
    children = spec.children.to(device)
    if validate and not _is_compiling():
        _check_logits_values("target_logits", target_logits)
        _check_tokens("tree_tokens", tree_tokens[:, 1:], V)
        if draft_probs is not None:
            has_children = (spec.children[:, 0] >= 0).to(device)
            _check_probs_values("draft_probs (rows of nodes with children)", draft_probs[:, has_children])

    # The root's token is documented as ignored (and not validated), but the kernels gather the
    # token of the -1 padding children through index 0; zero it so an out-of-range root entry can
    # never become an out-of-bounds vocab index.
    tree_tokens = torch.cat([torch.zeros_like(tree_tokens[:, :1]), tree_tokens[:, 1:]], dim=1)
    if is_greedy(temperature):
        choice, sampled = _greedy_tree_outcomes(target_logits, tree_tokens, children)
    else:
        warped = warp_logits(target_logits, temperature, top_k, top_p, min_p)
        accept_u = _uniform((B, N, children.shape[1]), device, generator)
        expo = exponential_noise((B, N, V), device, generator)
        choice, sampled = tree_outcomes(warped, draft_probs, tree_tokens, children, accept_u, expo)
    return walk_tree(choice, sampled, tree_tokens, spec.max_depth)


def tree_noise(B: int, N: int, C: int, V: int, device, generator=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The random inputs of one tree verification: accept_u [B, N, C] and expo [B, N, V]."""
    return _uniform((B, N, C), device, generator), exponential_noise((B, N, V), device, generator)


def verify_tree_with_noise(
    target_logits: torch.Tensor,  # [B, N, V]
    draft_probs: torch.Tensor | None,  # [B, N, V] or None (deterministic children)
    tree_tokens: torch.Tensor,  # [B, N] long, the root's entry is ignored
    children: torch.Tensor,  # [N, C] or per row [B, N, C] long, -1 padded
    max_depth: int,
    noise: tuple[torch.Tensor, torch.Tensor] | None,  # (accept_u [B, N, C], expo [B, N, V]); None if greedy
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`verify_tree` with the random numbers and the children table as inputs and no checks:
    the form traced into compiled graphs, where a tree's shape may change per row and per round
    (see :func:`specgraph.trees.tree_buffers`). Returns path_tokens, num_emitted, path_nodes."""
    tree_tokens = torch.cat([torch.zeros_like(tree_tokens[:, :1]), tree_tokens[:, 1:]], dim=1)
    if is_greedy(temperature):
        choice, sampled = _greedy_tree_outcomes(target_logits, tree_tokens, children)
    else:
        accept_u, expo = noise
        warped = warp_logits(target_logits, temperature, top_k, top_p, min_p)
        choice, sampled = tree_outcomes(warped, draft_probs, tree_tokens, children, accept_u, expo)
    return walk_tree(choice, sampled, tree_tokens, max_depth)
