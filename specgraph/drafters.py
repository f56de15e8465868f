"""Model-free drafters that run as tensor ops (on the device that holds the history)."""
from __future__ import annotations

import torch


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
