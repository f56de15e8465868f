"""What the compiled loop asks of a drafter, and what it tells it back: the interface the
drafters (:mod:`specgraph.proposers`) implement, kept beside the engine so the loop depends on the
interface and never on a drafter.

One proposer lives on one compiled object. Per ``generate`` call the loop calls
:meth:`Proposer.start` once, after the prompts are in the target's cache; per round
:meth:`Proposer.propose` (chains, at the depth the loop chose) or :meth:`Proposer.propose_tree`
(trees), then :meth:`Proposer.observe` with what the round emitted; and :meth:`Proposer.finish`
once the call has returned its tokens. Proposals are drafts only: verification (in the round
graph) decides what is emitted, so no proposer can change the output law.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specgraph.warping import SamplingParams


@dataclass
class CallStart:
    """The start of one ``generate`` call."""
    rows: list[list[int]]  # each row's prompt token ids (no padding)
    batch: int  # the batch bucket the call runs in (>= len(rows))
    device: torch.device
    prefill_hidden: torch.Tensor | None = None  # [B, P, H] target features of the prefill (head drafters)


@dataclass
class RoundView:
    """The loop's state at the start of a round, as a proposer reads it."""
    batch: int
    params: SamplingParams
    width: int  # cache slots the round attends
    hist: torch.Tensor  # [B, S] long: each row's tokens, root at L
    L: torch.Tensor  # [B] long: committed cache length (the root's slot)
    root: torch.Tensor  # [B] long: the last emitted token, not yet in the cache
    active: torch.Tensor  # [B] bool: rows still decoding
    generator: torch.Generator | None
    vocab: int


@dataclass
class ChainProposal:
    """Drafts of a chain round."""
    k: int  # the round's depth: which compiled round runs
    drafts: torch.Tensor  # [B, k] long
    probs: torch.Tensor | None = None  # [B, k, V] the q rows sampled drafts were drawn from (None: deterministic)
    allowed: torch.Tensor | None = None  # [B, k+1, ceil(V / 32)] int32: a grammar's mask at each position


@dataclass
class TreeProposal:
    """Drafts of a tree round."""
    tokens: torch.Tensor  # [B, N] long, column 0 = root
    parents: torch.Tensor  # [B, N] long, -1 at the root
    shape: tuple[int, int, int]  # (N nodes, C children per node, D depth): which compiled round runs
    drafted: list[int]  # drafted nodes per row
    allowed: torch.Tensor | None = None  # [B, N, ceil(V / 32)] int32: a grammar's mask at each node


@dataclass
class RoundOutcome:
    """What a round emitted, after the host read it."""
    tokens: torch.Tensor  # [B, T] long: emitted tokens (-1 after the n emitted)
    n: torch.Tensor  # [B] long
    hidden: torch.Tensor | None  # [B, T, H] target features at the accepted path (head drafters), else None
    emitted: list[int]  # n on the host
    live: list[bool]  # rows decoded this round
    kept: list[list[int]]  # the tokens each row keeps (its stop and max_new_tokens applied)
    chain_depth: int | None  # the chain round's depth; None for a tree round


class Proposer:
    """No drafts: every round is a plain step. Drafters override what they need."""

    # a drafter that reads the target's final features (EAGLE / Medusa heads, specgraph.learned):
    # the rounds then also return those features, and its trees set the slots a round writes
    head_drafter = None

    def start(self, call: CallStart) -> None:
        pass

    def propose(self, view: RoundView, k: int) -> ChainProposal | None:
        """Drafts for a chain round of depth ``k`` >= 1, or None for a plain step."""
        return None

    def propose_tree(self, view: RoundView) -> TreeProposal | None:
        """A tree round's drafts, or None for a plain step."""
        return None

    def observe(self, view: RoundView, outcome: RoundOutcome) -> None:
        pass

    def finish(self, rows: list[list[int]], new: list[list[int]]) -> None:
        """After a call that returned ``new`` tokens for its prompt ``rows``."""
        pass
