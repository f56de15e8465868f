"""Host-side chain drafters (:class:`specgraph.drafters.ChainDrafter`), verified like prompt lookup."""
from __future__ import annotations

from specgraph.drafters import ChainDrafter
from specgraph.proposal import CallStart, ChainProposal, Proposer, RoundView


class CustomChainProposer(Proposer):
    """A user's :class:`~specgraph.drafters.ChainDrafter`: it sees each call's prompts, then
    proposes ``k`` tokens per row each round (or None for a plain step)."""

    def __init__(self, drafter: ChainDrafter):
        self.drafter = drafter

    def start(self, call: CallStart) -> None:
        self.drafter.start(call.rows, call.batch, call.device)

    def propose(self, view: RoundView, k: int) -> ChainProposal | None:
        drafts = self.drafter.propose(view.hist, view.L, k, view.active)
        return None if drafts is None else ChainProposal(k, drafts)
