"""The speculative decoding loop, once, for every executor.

One ``generate`` call is a loop of rounds over the rows of :class:`specgraph.callrows.CallRows`:
the drafter proposes (a chain at the depth chosen for this round, or a tree), one round graph
verifies and emits, the host reads the emitted counts (its one sync per round), applies each row's
stops, tells the drafter and the depth chooser what happened, and commits what each row keeps.
Who runs the round graph is the executor's business: Inductor graphs and AOTInductor packages
(:class:`specgraph.compiler.CompiledRounds`) and onnxruntime sessions
(:class:`specgraph.onnx.OnnxRounds`) implement :class:`RoundExecutor`; the loop below is the same.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from specgraph.callrows import CallRows, StopRule
from specgraph.proposal import ChainProposal, Proposer, RoundOutcome, RoundView, TreeProposal
from specgraph.warping import SamplingParams

NGRAM_START_K = 4  # prompt lookup chains start at this depth and go up to K after a fully accepted round


@dataclass
class RoundResult:
    """What one round graph returned."""
    tokens: torch.Tensor  # [B, T] long: emitted tokens (-1 after the n emitted)
    n: torch.Tensor  # [B] long: tokens emitted per row (accepted drafts + 1)
    hidden: torch.Tensor | None = None  # [B, T, H] target features at the accepted path (head drafters)
    extra: tuple = ()  # the executor's own outputs (scores, log-probabilities), for its `record`


class RoundExecutor(Protocol):
    """Runs the round graphs of one call (one batch bucket, one cache)."""

    def width(self, state: CallRows) -> int:
        """Cache slots the next round attends."""

    def chain(self, view: RoundView, chain: ChainProposal) -> RoundResult:
        """Verify a chain of ``chain.k`` drafts (k = 0: a plain step)."""

    def tree(self, view: RoundView, tree: TreeProposal) -> RoundResult:
        """Verify a tree of drafts."""

    def record(self, result: RoundResult, state: CallRows, kept: list[list[int]], adv: list[int]) -> None:
        """After the rows kept ``kept`` of ``result`` and before they advance by ``adv``."""


def next_k(ladder: list[int], k_now: int, k: int, n_live: list[int]) -> int:
    """Model-free chain depth for the next round, given the depth ``k`` this round used and the
    tokens each live row emitted (``n_live``): one rung up the ladder after a round where some
    row accepted every draft (a long copy is running), one down when none accepted more than half;
    unchanged after a plain round. Decided from the round's counts, which the host reads anyway."""
    if k == 0 or k not in ladder or not n_live:
        return k_now
    i = ladder.index(k)
    if any(n == k + 1 for n in n_live) and i + 1 < len(ladder):
        return ladder[i + 1]
    if all(n - 1 <= k // 2 for n in n_live) and i > 0:
        return ladder[i - 1]
    return k


def default_ladder(k: int) -> list[int]:
    """The chain depths model-free drafters move between by default: min(k, NGRAM_START_K) and k."""
    return sorted({min(k, NGRAM_START_K), k})


class LadderDepth:
    """The chain depth of each round without a cost model: the ladder's first rung, then
    :func:`next_k` after each chain round (an empty ladder: plain steps). It has the hooks of the
    adaptive policy (:class:`specgraph.adaptive.AdaptivePolicy`), which the loop takes instead."""

    def __init__(self, ladder: list[int]):
        self.ladder = list(ladder)
        self.k = self.ladder[0] if self.ladder else 0

    def start(self, fast, rows, batch: int, device) -> None:
        self.k = self.ladder[0] if self.ladder else 0

    def choose(self, done: list[bool], L_host: list[int], hist: torch.Tensor, left: list[int] | None = None) -> int:
        return self.k

    def observe(self, k, n_emitted: list[int], done: list[bool], L_host: list[int]) -> None:
        if not isinstance(k, list) and self.ladder:  # (tree rounds: per-row drafted counts)
            self.k = next_k(self.ladder, self.k, k, [n for n, d in zip(n_emitted, done) if not d])


def decode(state: CallRows, proposer: Proposer, rounds: RoundExecutor, depth, *, params: SamplingParams,
           generator: torch.Generator | None, vocab: int, trees: bool, max_new_tokens: int, eos: list[int],
           stop: StopRule, stats, stream=None, grammar=None) -> None:
    """Run rounds until every row of ``state`` is done; ``state.new`` then holds each request
    row's tokens. ``depth`` chooses each chain round's depth (:class:`LadderDepth` or the adaptive
    policy); ``trees``: the drafter proposes trees (a round without one is a plain step);
    ``grammar`` (:class:`specgraph.grammar.GrammarRows`): each proposal gets its positions' masks
    and forced drafts, and the grammar advances by the tokens each row keeps."""
    n_rows, device = len(state.new), state.L.device
    while not all(state.done):
        live = state.live
        view = RoundView(len(state.done), params, rounds.width(state), state.hist, state.L, state.root,
                         torch.tensor(live, device=device), generator, vocab)
        tree = proposer.propose_tree(view) if trees else None
        if tree is not None:
            if grammar is not None:
                tree = grammar.tree(tree, live, stats)
            out = rounds.tree(view, tree)
            k, round_depth = tree.drafted, tree.shape[2]  # drafted nodes per row, depth
        else:
            chain = None
            if not trees:
                left = [max_new_tokens - len(state.new[b]) for b in range(n_rows)]
                k_now = depth.choose(state.done, state.L_host, state.hist, left)
                if k_now:  # depth 0: a plain step (what "auto" chooses when speculation would not pay)
                    chain = proposer.propose(view, k_now)
                    if chain is None and grammar is not None:  # no drafts: the grammar's forced strings, if any
                        chain = grammar.propose(k_now, live, stats)
            chain = chain or ChainProposal(0, state.hist[:, :0])
            if grammar is not None:
                chain = grammar.chain(chain, live, stats)
            out = rounds.chain(view, chain)
            k = round_depth = chain.k
        tokens_h, n_h = out.tokens.tolist(), out.n.tolist()  # the one host sync per round
        stats.rounds += 1
        depth.observe(k, n_h, state.done, state.L_host)
        kept = [[] for _ in range(len(state.done))]
        for b in range(n_rows):
            if not live[b]:
                continue
            kept[b] = state.keep(b, tokens_h[b][: n_h[b]], max_new_tokens, eos, stop)
            stats.record_row(k[b] if isinstance(k, list) else k, n_h[b], len(kept[b]), round_depth)
        if grammar is not None:
            grammar.advance(kept)
        proposer.observe(view, RoundOutcome(out.tokens, out.n, out.hidden, n_h, live, kept,
                                            None if isinstance(k, list) else k))
        if not state.end_when_all_finished() and stream is not None:
            stream.advance(state.new, state.done)
        adv = state.advances(n_h)  # the rows still running move on (rolled-back slots are just not counted)
        rounds.record(out, state, kept, adv)
        state.commit(out.tokens, adv)
