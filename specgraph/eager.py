"""Eager speculative decoding on an unmodified HF model with its own DynamicCache.

This is the path that needs no graph capture: every round feeds the last accepted token plus the
drafts through ``model(...)``, verifies them with :func:`specgraph.verify_chain`, and crops the
cache back to the accepted prefix. It is slower than the compiled step (dynamic cache, one host
sync per round to decide what to crop) but works for any causal LM that supports
``DynamicCache.crop`` and is what specgraph falls back to when graph rewriting is not possible.
Batch size 1.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specgraph.lookup import ngram_propose
from specgraph.verify import verify_chain
from specgraph.warping import check_sampling_params


@dataclass
class GenerationStats:
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    seconds: float = 0.0
    accepted_at: list = field(default_factory=list)  # accepted_at[j]: rounds whose draft j was accepted
    # drafted_at[j]: row-rounds that drafted position j (accepted_at / drafted_at = survival at j + 1,
    # what the planner's acceptance profile reads: rounds at other depths or without drafts would
    # otherwise dilute it)
    drafted_at: list = field(default_factory=list)
    row_rounds: int = 0  # rounds x live rows (drafted or not)
    forced: int = 0  # drafts a grammar supplied (a token or string it forces where the drafter had none allowed)
    cut: int = 0  # drafts a grammar forbade (never accepted; verified positions past them are dead)

    @property
    def mean_emitted(self) -> float:
        return self.emitted / max(self.rounds, 1)

    @property
    def tokens_per_s(self) -> float:
        return self.emitted / self.seconds if self.seconds > 0 else 0.0

    def record_row(self, k: int, n_emitted: int, kept: int, depth: int | None = None) -> None:
        """One sequence's share of a round: k drafts (tree nodes), n_emitted tokens verified, kept
        of them used (fewer at EOS or max_new_tokens); ``depth`` = the tree's depth (default k, a
        chain). ``rounds`` is counted by the caller, once per round."""
        self.drafted += k
        self.row_rounds += 1
        reach = (k if depth is None else depth) if k > 0 else 0
        while len(self.drafted_at) < reach:
            self.drafted_at.append(0)
        for j in range(reach):
            self.drafted_at[j] += 1
        n_acc = n_emitted - 1
        self.accepted += n_acc
        self.emitted += kept
        while len(self.accepted_at) < (k if depth is None else depth):
            self.accepted_at.append(0)
        for j in range(n_acc):
            self.accepted_at[j] += 1

    def __repr__(self) -> str:
        return (f"Stats(rounds={self.rounds}, emitted={self.emitted}, mean_emitted_per_round={self.mean_emitted:.2f}, "
                f"accepted={self.accepted}/{self.drafted}, tokens_per_s={self.tokens_per_s:.1f})")

    def as_dict(self) -> dict:
        return {
            "rounds": self.rounds, "drafted": self.drafted, "accepted": self.accepted, "emitted": self.emitted,
            "mean_emitted_per_round": self.mean_emitted, "tokens_per_s": self.tokens_per_s,
            "acceptance_per_position": [a / max(self.rounds, 1) for a in self.accepted_at],
            "survival_per_position": [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)],
        }


def _forward(model, ids, cache):
    return model(input_ids=ids, past_key_values=cache, use_cache=True).logits


@torch.no_grad()
def eager_generate_ngram(
    model,
    input_ids: torch.Tensor,  # [1, T] long
    *,
    max_new_tokens: int = 128,
    num_speculative_tokens: int = 4,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    eos_token_id=None,
    generator: torch.Generator | None = None,
    max_ngram: int = 3,
) -> tuple[torch.Tensor, GenerationStats]:
    """Prompt-lookup speculative decoding; returns (prompt + new tokens [1, T+n], stats)."""
    from transformers import DynamicCache

    check_sampling_params(temperature, top_k, top_p, min_p)
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"the eager path takes one sequence [1, T], got {tuple(input_ids.shape)}")
    eos = set([eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []))
    k = num_speculative_tokens
    stats = GenerationStats()
    start = time.perf_counter()
    # full-length layers (no config): a sliding-window layer cannot be cropped back past its window,
    # and the model's own masks apply the window either way
    cache = DynamicCache()
    tokens = input_ids[0].tolist()
    if len(tokens) > 1:
        _forward(model, input_ids[:, :-1], cache)
    new = 0
    while new < max_new_tokens:
        hist = torch.tensor([tokens], dtype=torch.long, device=input_ids.device)
        drafts, _ = ngram_propose(hist, torch.tensor([len(tokens)], device=input_ids.device), k, max_ngram)
        cached = cache.get_seq_length()
        logits = _forward(model, torch.cat([hist[:, -1:], drafts], dim=1), cache)  # [1, K+1, V]
        emitted, n = verify_chain(
            logits, None, drafts, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
            generator=generator, validate=False,
        )
        n = int(n[0])
        out = emitted[0, :n].tolist()[: max_new_tokens - new]
        stop = next((i for i, t in enumerate(out) if t in eos), None)
        if stop is not None:
            out = out[: stop + 1]
        stats.rounds += 1
        stats.record_row(k, n, len(out))
        tokens.extend(out)
        new += len(out)
        surplus = cache.get_seq_length() - (cached + n)
        if surplus > 0:
            cache.crop(-surplus)  # transformers >= 5 removes -n tokens from the end
        if stop is not None:
            break
    stats.seconds = time.perf_counter() - start
    return torch.tensor([tokens], dtype=torch.long, device=input_ids.device), stats
