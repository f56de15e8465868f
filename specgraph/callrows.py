"""The rows of one ``generate`` call, as the compiled loop advances them round by round.

A call runs in a batch bucket of B rows; rows past the request's are padding and done from the
start. The device tensors feed the round graphs; the host lists are what the host decides on
(stops, lengths, the attended width). A rolled-back draft is never written here: a row advances
by the tokens it keeps, and its cache slots past ``L`` are simply overwritten next round.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


def advanced_slots(L, tokens, adv):
    """Where a round's emitted tokens go in the history: pos [B, T] = L + 1 + j (the history holds
    L + 1 tokens) and write [B, T] bool, j < adv (the tokens a row keeps). L [B], tokens [B, T],
    adv [B] long (0 for rows not advanced)."""
    step = torch.arange(tokens.shape[1], device=tokens.device)
    return L.unsqueeze(1) + 1 + step, step.unsqueeze(0) < adv.unsqueeze(1)


def advance_rows(hist, L, root, tokens, adv):
    """Commit ``adv[b]`` of row b's emitted tokens: append them to the history hist [B, S] (in
    place; slots past a row's length are its scratch) and return the new (L [B], root [B]). A
    rolled-back draft's cache slot is simply not counted: the next round overwrites it."""
    S = hist.shape[1]
    pos, write = advanced_slots(L, tokens, adv)
    hist.scatter_(1, torch.where(write, pos, S - 1), torch.where(write, tokens, hist[:, S - 1:]))
    root = torch.where(adv > 0, tokens.gather(1, (adv - 1).clamp_min(0).unsqueeze(1)).squeeze(1), root)
    return L + adv, root


# (row, its emitted tokens, room left) -> (the tokens it keeps, whether a stop ended it)
StopRule = Callable[[int, list[int], int], tuple[list[int], bool]]


@dataclass
class CallRows:
    hist: torch.Tensor  # [B, S] long: each row's tokens (prompt, then emitted), its root at L
    L: torch.Tensor  # [B] long: committed cache length (the root's position)
    root: torch.Tensor  # [B] long: the last emitted token, not yet in the cache
    L_host: list[int]  # L on the host
    new: list[list[int]]  # the tokens each request row emitted so far
    done: list[bool]  # [B] rows no longer decoded
    finished: list[bool]  # request rows that have ended (a stop without EOS keeps decoding them)
    ended_at: list[int]  # a finished row's length when it ended

    @classmethod
    def start(cls, rows: list[list[int]], B: int, S: int, device) -> "CallRows":
        """Rows whose prompts (all but the last token) are in the cache: each one's root is its
        prompt's last token, at position len - 1."""
        n = len(rows)
        hist = torch.zeros(B, S, dtype=torch.long)
        for b, r in enumerate(rows):
            hist[b, : len(r)] = torch.tensor(r)
        hist = hist.to(device)
        L_host = [len(r) - 1 for r in rows] + [0] * (B - n)
        L = torch.tensor(L_host, device=device)
        root = hist.gather(1, L.unsqueeze(1)).squeeze(1)
        return cls(hist, L, root, L_host, [[] for _ in range(n)], [False] * n + [True] * (B - n), [False] * n, [0] * n)

    @property
    def live(self) -> list[bool]:
        return [not d for d in self.done]

    def need(self, span: int) -> int:
        """Cache slots the next round must attend: the longest live row's, plus the round's own."""
        return max(self.L_host[b] for b in range(len(self.done)) if not self.done[b]) + span

    def keep(self, b: int, emitted: list[int], max_new_tokens: int, eos, stop: StopRule) -> list[int]:
        """Row b's share of what a round emitted for it, as ``model.generate`` would end it: up to a
        stop (``stop``) or ``max_new_tokens``. A row ended by a stop without an EOS token keeps
        decoding (transformers pads only with EOS) until every row has ended."""
        room = max_new_tokens - len(self.new[b])
        if self.finished[b]:
            keep, stopped = emitted[:room], False
        else:
            keep, stopped = stop(b, emitted, room)
        self.new[b].extend(keep)
        if (stopped or len(self.new[b]) >= max_new_tokens) and not self.finished[b]:
            self.finished[b], self.ended_at[b] = True, len(self.new[b])
        if (stopped and eos) or len(self.new[b]) >= max_new_tokens:
            self.done[b] = True
        return keep

    def end_when_all_finished(self) -> bool:
        """When every request row has ended, so has the call: rows still decoding after a stop
        without EOS are cut at the longest ended row's length. Returns whether the call ended."""
        if not all(self.finished):
            return False
        steps = max(self.ended_at)
        self.new = [n[:steps] for n in self.new]
        self.done = [True] * len(self.done)
        return True

    def advances(self, emitted: list[int]) -> list[int]:
        """How far each row moves after a round: what it emitted, 0 once done."""
        return [0 if d else n for d, n in zip(self.done, emitted)]

    def commit(self, tokens: torch.Tensor, adv: list[int]) -> None:
        """Append each row's ``adv`` tokens of ``tokens`` [B, T] to its history; move L and root."""
        self.L_host = [x + a for x, a in zip(self.L_host, adv)]
        self.L, self.root = advance_rows(self.hist, self.L, self.root, tokens,
                                         torch.tensor(adv, device=self.L.device))
