"""Drafters behind one interface (:class:`Proposer`: start / propose / observe / finish), one
file each: prompt lookup (``ngram``), suffix decoding (``suffix``), a draft model
(``draft_model``), EAGLE / Medusa heads (``heads``) and host-side chain drafters (``custom``).
"""
from __future__ import annotations

from specgraph.drafters import ChainDrafter  # noqa: F401 (the interface of host-side chain drafters)
from specgraph.proposers.base import (CallStart, ChainProposal, Proposer, RoundOutcome, RoundView,  # noqa: F401
                                      TreeProposal)
from specgraph.proposers.custom import CustomChainProposer
from specgraph.proposers.draft_model import DraftModelProposer
from specgraph.proposers.heads import HeadProposer
from specgraph.proposers.ngram import NgramProposer
from specgraph.proposers.suffix import SuffixProposer
from specgraph.suffix import SuffixIndex  # noqa: F401 (what "suffix" drafts from)


def make_proposer(engine) -> Proposer:
    """The proposer of a compiled object (:class:`specgraph.compiler.SpecGraphModel`), from its
    resolved drafter."""
    if engine.learned is not None:
        return HeadProposer(engine.learned, engine.k)
    if engine.draft == "model":
        return DraftModelProposer(engine)
    if engine.draft == "custom":
        return CustomChainProposer(engine.chain_drafter)
    if engine.draft == "ngram":
        return NgramProposer(None if isinstance(engine.tree, str) else engine.tree, engine.tree_rank)
    if engine.draft == "suffix":
        return SuffixProposer(engine)
    return Proposer()
