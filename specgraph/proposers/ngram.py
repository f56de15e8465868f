"""Prompt lookup: drafts copied from earlier in each row's own text."""
from __future__ import annotations

from specgraph.lookup import NGRAM_TREE_MATCHES, ngram_propose, ngram_tree_propose
from specgraph.proposal import ChainProposal, Proposer, RoundView, TreeProposal
from specgraph.trees import TreeSpec

NGRAM_MAX, NGRAM_MIN = 3, 2  # longest / shortest suffix n-gram to match


def propose_ngram_tree(spec: TreeSpec, rank: list[int], hist, L, active, max_ngram: int = NGRAM_MAX,
                       min_ngram: int = NGRAM_MIN):
    """Prompt-lookup tries on the static tree ``spec`` (node ranks ``rank``): (tree_tokens [B, N],
    parents [B, N], shape (N, C, D), drafted nodes per row), or None when no live row matched (the
    round is then a plain step). hist [B, S] long holding L + 1 tokens per row, L [B], active [B]
    bool. Shared by the compiled loop and the ONNX runtime (specgraph.onnx)."""
    B, N = hist.shape[0], spec.num_nodes
    tokens, matched = ngram_tree_propose(
        hist, L + 1, spec.parents.tolist(), rank, max_ngram, min_ngram, NGRAM_TREE_MATCHES)
    if not bool((matched * active).any()):
        return None
    parents = spec.parents.to(hist.device).expand(B, N)
    return tokens, parents, (N, spec.children.shape[1], spec.max_depth), [N - 1] * B


class NgramProposer(Proposer):
    """Chains: the continuation of the latest earlier occurrence of each row's last 2-3 tokens
    (:func:`specgraph.lookup.ngram_propose`); trees: the continuations of several matches merged
    on the static tree ``tree``. A round in which no live row matched an n-gram of at least
    ``NGRAM_MIN`` tokens is a plain step, so text without repetition costs what plain decoding
    costs. ``max_ngram`` / ``min_ngram``: the longest and shortest n-gram matched (an exported
    directory's own)."""

    def __init__(self, tree: TreeSpec | None = None, rank: list[int] | None = None, max_ngram: int = NGRAM_MAX,
                 min_ngram: int = NGRAM_MIN):
        self.tree, self.rank, self.max_ngram, self.min_ngram = tree, rank, max_ngram, min_ngram

    def propose(self, view: RoundView, k: int) -> ChainProposal | None:
        drafts, matched = ngram_propose(view.hist, view.L + 1, k, self.max_ngram, self.min_ngram)
        if bool((matched * view.active).any()):  # host sync: which graph runs depends on it
            return ChainProposal(k, drafts)
        return None

    def propose_tree(self, view: RoundView) -> TreeProposal | None:
        out = propose_ngram_tree(self.tree, self.rank, view.hist, view.L, view.active, self.max_ngram, self.min_ngram)
        return None if out is None else TreeProposal(*out)
