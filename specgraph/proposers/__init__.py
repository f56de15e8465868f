"""Drafters behind one interface (:class:`specgraph.proposal.Proposer`: start / propose / observe /
finish), one file each: prompt lookup (``ngram``), suffix decoding (``suffix``), a draft model
(``draft_model``), EAGLE / Medusa heads (``heads``) and host-side chain drafters (``custom``).
:func:`resolve_draft` turns ``compile(draft=...)`` into the engine's :class:`specgraph.compiler.Draft`;
:func:`make_proposer` builds the drafter it names for a compiled object.
"""
from __future__ import annotations

import torch

from specgraph import learned
from specgraph.compiler import Draft
from specgraph.drafters import ChainDrafter  # noqa: F401 (the interface of host-side chain drafters)
from specgraph.proposal import (CallStart, ChainProposal, Proposer, RoundOutcome, RoundView,  # noqa: F401
                                TreeProposal)
from specgraph.proposers.custom import CustomChainProposer
from specgraph.proposers.draft_model import DraftModelProposer
from specgraph.proposers.heads import HeadProposer
from specgraph.proposers.ngram import NgramProposer
from specgraph.proposers.suffix import SuffixProposer
from specgraph.suffix import SuffixIndex  # noqa: F401 (what "suffix" drafts from)


def resolve_draft(model, draft) -> Draft:
    """``compile(draft=...)`` as the engine runs it. ``"layerskip"`` becomes a draft model and
    ``"eagle"`` / ``"medusa"`` the head matching ``model`` (:func:`specgraph.learned.resolve_draft`);
    a module is a draft model, a :class:`SuffixIndex` suffix decoding over that index, a
    :class:`ChainDrafter` host-side chains verified like prompt lookup."""
    draft, head = learned.resolve_draft(model, draft)
    if head is not None:
        return Draft(draft, head=head)
    if isinstance(draft, torch.nn.Module):
        return Draft("model", draft_model=draft)
    if isinstance(draft, SuffixIndex):
        return Draft("suffix", suffix_index=draft)
    if isinstance(draft, ChainDrafter):
        return Draft("custom", chain_drafter=draft)
    if draft == "suffix":
        return Draft("suffix", suffix_index=SuffixIndex())
    if draft not in (None, "ngram"):
        raise ValueError(
            f"draft={draft!r} is not supported: use None (compiled plain decoding), 'ngram' (prompt lookup), "
            "'suffix' (suffix decoding; or a specgraph.suffix.SuffixIndex to share one index), "
            "'eagle' / 'medusa' (the trained head matching this model, or a specgraph.heads.EagleHead / "
            "MedusaHeads bound to it), 'layerskip' (the model's first layers, specgraph.drafters.layer_skip), "
            "or a smaller PreTrainedModel with the same vocabulary"
        )
    return Draft(draft)


def make_proposer(engine) -> Proposer:
    """The proposer of a compiled object (:class:`specgraph.compiler.SpecGraphModel`), from the
    drafter its config names."""
    cfg = engine.config
    if cfg.head is not None:
        return HeadProposer(learned.make_drafter(engine, cfg.head), engine.k)
    if engine.draft == "model":
        return DraftModelProposer(engine)
    if engine.draft == "custom":
        return CustomChainProposer(engine.chain_drafter)
    if engine.draft == "ngram":
        return NgramProposer(None if isinstance(engine.tree, str) else engine.tree, engine.tree_rank)
    if engine.draft == "suffix":
        return SuffixProposer(engine)
    return Proposer()
