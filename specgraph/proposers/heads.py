"""EAGLE / Medusa heads (:mod:`specgraph.learned`) behind the proposer interface."""
from __future__ import annotations

from specgraph.proposal import CallStart, ChainProposal, Proposer, RoundOutcome, RoundView, TreeProposal


class HeadProposer(Proposer):
    """A head drafter reads the target's final features: its first feed comes from the prompt's
    prefill, each later one from the features at the round's accepted path. Chains are always
    ``k`` deep (the head's depth)."""

    def __init__(self, drafter, k: int):
        self.drafter, self.k = drafter, k
        self.head_drafter = drafter  # the rounds return the target's features for it

    def start(self, call: CallStart) -> None:
        self.drafter.start(call.batch, call.rows, call.prefill_hidden, call.device)

    def propose(self, view: RoundView, k: int) -> ChainProposal:
        drafts, probs = self.drafter.propose_chain(view.batch, view.params, view.generator, view.L, view.root,
                                                   view.active)
        return ChainProposal(self.k, drafts, probs)

    def propose_tree(self, view: RoundView) -> TreeProposal | None:
        out = self.drafter.propose_tree(view.batch, view.L, view.root, view.active)
        return None if out is None else TreeProposal(*out)

    def observe(self, view: RoundView, outcome: RoundOutcome) -> None:
        self.drafter.observe(view.L, outcome.tokens, outcome.n, outcome.hidden)  # the next round's feed
