"""Prompt lookup on token tensors: the drafts an n-gram match in a row's own history proposes
(chains, and trees of several matches). Pure tensor ops, on the device that holds the history."""
from __future__ import annotations

import torch

NGRAM_TREE_MATCHES = 8  # prompt-lookup trees merge the continuations of this many latest matches


def ngram_propose(
    history: torch.Tensor,  # [B, L] long, valid tokens in [:, :lengths[b]], anything after
    lengths: torch.Tensor,  # [B] long, number of valid tokens per row (>= 1)
    k: int,
    max_ngram: int = 3,
    min_ngram: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt lookup: continue the most recent earlier occurrence of the longest matching suffix.

    For n = max_ngram .. min_ngram, the last n tokens of each row are searched for in the row's
    history; the latest occurrence followed by k known tokens wins (else the latest followed by at
    least one), and the k tokens after it are proposed. Rows with no match (or positions past the known history) are
    filled with the row's last token, which verification simply rejects.

    Returns ``drafts`` [B, k] long and ``matched`` [B] long: the n-gram length that matched (0 = none).
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if not 1 <= min_ngram <= max_ngram:
        raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
    B, L = history.shape
    device = history.device
    idx = torch.arange(L, device=device)
    last = history.gather(1, (lengths - 1).clamp_min(0).unsqueeze(1))  # [B, 1]
    best_start = torch.full((B,), -1, dtype=torch.long, device=device)  # start of the continuation
    matched = torch.zeros(B, dtype=torch.long, device=device)
    for n in range(min_ngram, max_ngram + 1):  # longer n overrides shorter
        if n >= L:
            break
        suffix_pos = (lengths.unsqueeze(1) - n + torch.arange(n, device=device)).clamp_min(0)  # [B, n]
        suffix = history.gather(1, suffix_pos)  # [B, n]
        windows = history.unfold(1, n, 1)  # [B, L-n+1, n]
        starts = idx[: L - n + 1]
        # a match must be followed by a known token; this also excludes the suffix itself
        ok = (windows == suffix.unsqueeze(1)).all(-1) & (starts.unsqueeze(0) + n < lengths.unsqueeze(1))
        ok &= (lengths >= n + 1).unsqueeze(1)
        latest = torch.where(ok, starts.unsqueeze(0), -1).amax(dim=1)
        # prefer the latest match followed by k known tokens (on short periodic text the very latest
        # match runs into the end of the history after a token or two)
        full = ok & (starts.unsqueeze(0) + n + k <= lengths.unsqueeze(1))
        latest_full = torch.where(full, starts.unsqueeze(0), -1).amax(dim=1)
        cand = torch.where(latest_full >= 0, latest_full, latest)
        found = cand >= 0
        best_start = torch.where(found, cand + n, best_start)
        matched = torch.where(found, n, matched)
    pos = best_start.unsqueeze(1) + torch.arange(k, device=device)  # [B, k]
    valid = (best_start.unsqueeze(1) >= 0) & (pos < lengths.unsqueeze(1))
    drafts = history.gather(1, pos.clamp(0, L - 1))
    drafts = torch.where(valid, drafts, last)
    return drafts, matched


def _latest_matches(history, lengths, n, m):
    """Starts of the continuations after the ``m`` latest earlier occurrences of each row's last
    ``n`` tokens: [B, m] long, latest first, -1 where there are fewer matches."""
    B, L = history.shape
    device = history.device
    suffix_pos = (lengths.unsqueeze(1) - n + torch.arange(n, device=device)).clamp_min(0)  # [B, n]
    suffix = history.gather(1, suffix_pos)
    windows = history.unfold(1, n, 1)  # [B, L-n+1, n]
    starts = torch.arange(L - n + 1, device=device).unsqueeze(0)
    ok = (windows == suffix.unsqueeze(1)).all(-1) & (starts + n < lengths.unsqueeze(1))
    ok &= (lengths >= n + 1).unsqueeze(1)
    top = torch.where(ok, starts, -1).topk(min(m, L - n + 1), dim=1).values  # latest first
    if top.shape[1] < m:
        top = torch.cat([top, top.new_full((B, m - top.shape[1]), -1)], dim=1)
    return torch.where(top >= 0, top + n, -1)


def ngram_tree_propose(
    history: torch.Tensor,  # [B, L] long, valid tokens in [:, :lengths[b]]
    lengths: torch.Tensor,  # [B] long (>= 1)
    parents: list[int],  # [N] static tree shape, topological, parents[0] = -1
    rank: list[int],  # [N] rank of each node among its siblings' candidate tokens (root: -1)
    max_ngram: int = 3,
    min_ngram: int = 1,
    num_matches: int = 8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt lookup with several matches forming a tree.

    The continuations after the ``num_matches`` latest occurrences of the longest matching suffix
    n-gram are merged into a trie: a node of rank r gets the r-th most frequent next token among
    the continuations that agree with its path (ties: the most recent). A node with no such
    token repeats its first sibling's token (a repeated sibling can never be accepted: recursive
    rejection removed that token, greedy took the first), or, as the first child, the last token.
    Any deterministic proposal keeps verification lossless; these rules only avoid wasted nodes.

    Returns ``tree_tokens`` [B, N] (the root's entry is the last token) and ``matched`` [B]: the
    n-gram length that matched (0 = none).
    """
    B, L = history.shape
    N, M = len(parents), num_matches
    device = history.device
    depth = [0] * N
    first_child: dict[int, int] = {}
    for i in range(1, N):
        depth[i] = depth[parents[i]] + 1
        first_child.setdefault(parents[i], i)
    D = max(depth)
    if max(rank) >= M:
        raise ValueError(f"tree rank {max(rank)} needs num_matches > {max(rank)}, got {M}")
    starts = torch.full((B, M), -1, dtype=torch.long, device=device)
    matched = torch.zeros(B, dtype=torch.long, device=device)
    for n in range(min_ngram, max_ngram + 1):  # longer n overrides shorter
        if n >= L:
            break
        top = _latest_matches(history, lengths, n, M)
        found = top[:, 0] >= 0
        starts = torch.where(found.unsqueeze(1), top, starts)
        matched = torch.where(found, n, matched)
    last = history.gather(1, (lengths - 1).clamp_min(0).unsqueeze(1)).squeeze(1)  # [B]
    if D == 0:
        return last.unsqueeze(1), matched
    pos = starts.unsqueeze(2) + torch.arange(D, device=device)  # [B, M, D]
    known = (starts.unsqueeze(2) >= 0) & (pos < lengths.view(B, 1, 1))
    cont = torch.where(known, history.gather(1, pos.clamp(0, L - 1).view(B, M * D)).view(B, M, D), -1)
    recency = torch.arange(M, 0, -1, device=device)  # earlier candidate = more recent match
    earlier = torch.ones(M, M, dtype=torch.bool, device=device).tril(-1)
    agree = [torch.ones(B, M, dtype=torch.bool, device=device)]  # per node: candidates on its path
    tokens = [last]
    for i in range(1, N):
        tok = cont[:, :, depth[i] - 1]  # [B, M]
        cand = agree[parents[i]] & (tok >= 0)
        same = (tok.unsqueeze(2) == tok.unsqueeze(1)) & cand.unsqueeze(2) & cand.unsqueeze(1)  # [B, M, M]
        rep = cand & ~(same & earlier).any(-1)  # first (most recent) candidate of each distinct token
        key = torch.where(rep, same.sum(-1) * (M + 1) + recency, -1)
        best = key.topk(rank[i] + 1, dim=1)
        ok = best.values[:, rank[i]] >= 0
        pick = tok.gather(1, best.indices[:, rank[i] : rank[i] + 1]).squeeze(1)
        sib = first_child[parents[i]]
        fallback = last if sib == i else tokens[sib]
        tokens.append(torch.where(ok, pick, fallback))
        agree.append(cand & (tok == tokens[i].unsqueeze(1)) & ok.unsqueeze(1))
    return torch.stack(tokens, dim=1), matched


# ----------------------------------------------------------------------------------------------
# layer-skip self-drafting
