"""Suffix decoding: drafts from a suffix tree over earlier outputs (:mod:`specgraph.suffix`).

Chains take the tree's best path; dynamic trees take its most frequent continuations, packed into
the smallest compiled tree shape that holds them. Sampled chain rounds calibrate each row's
threshold from how many of its drafts were accepted.
"""
from __future__ import annotations

import torch

from specgraph.proposal import CallStart, ChainProposal, Proposer, RoundOutcome, RoundView, TreeProposal
from specgraph.trees import SUFFIX_CHILDREN, SUFFIX_TREE_SIZES  # noqa: F401 (the compiled suffix-tree shapes)
# Suffix drafts keep only nodes whose estimated path probability (count / root count) is at least
# this: on a CPU a drafted token costs ~10% of a plain step, so a node below that loses on average.
SUFFIX_MIN_SCORE = 0.1
# ... and only after a match of at least this many context tokens: a one-token match speculates where
# prompt lookup (which needs a 2-gram) takes a plain step, and loses (multi-turn chat, SmolLM2 on a
# 2-core CPU: benchmarks/suffix_min_match_bench.py)
SUFFIX_MIN_MATCH = 2


def rungs_upto(ladder: list[int], k: int) -> list[int]:
    """The ladder's depths up to ``k``, and ``k``: the graphs a round capped at depth ``k`` may use."""
    return sorted({d for d in ladder if d <= k} | {k})


def suffix_chains(sessions, k: int, min_score: float = SUFFIX_MIN_SCORE, min_match: int = SUFFIX_MIN_MATCH,
                  calibrated: bool = False) -> list[list[int]]:
    """Per row (a :class:`SuffixSession` or None), the suffix tree's best path as a chain of at most
    k tokens, cut where its estimated probability drops below ``min_score``; nothing when the
    matched context suffix is shorter than ``min_match`` tokens. ``calibrated`` (sampled rounds):
    the threshold is divided by the session's observed acceptance scale
    (:class:`specgraph.suffix.AcceptanceCalibration`). Each session keeps its chain's node scores
    in ``drafted_scores`` for :func:`calibrate_suffix`."""
    out = []
    for s in sessions:
        p = None if s is None else s.propose(k, 1, depth_limit=k)
        if p is None or p.match_len < min_match:
            chain, scores = [], []
        else:
            chain, scores = p.best_path(k, min_score / s.calibration.scale if calibrated else min_score)
        if s is not None:
            s.drafted_scores = scores
        out.append(chain)
    return out


def calibrate_suffix(sessions, n_emitted: list[int], live: list[bool]) -> None:
    """After a sampled suffix-chain round: each live row's calibration sees its drafted chain's
    scores and how many of those drafts were accepted (``n_emitted`` - 1; padding never counts)."""
    for s, n, a in zip(sessions, n_emitted, live):
        if a and s is not None and s.drafted_scores:
            s.calibration.observe(s.drafted_scores, n - 1)


def chain_depth(ladder: list[int], need: int) -> int:
    """The compiled chain depth that holds ``need`` drafts: the smallest rung >= need (else the top)."""
    return next((d for d in ladder if d >= need), ladder[-1])


def pack_suffix_trees(sessions, B: int, k: int, active: list[bool], min_score: float = SUFFIX_MIN_SCORE,
                      min_match: int = SUFFIX_MIN_MATCH):
    """Suffix-decoding trees, one per row, pruned to nodes of estimated path probability >=
    ``min_score`` and packed into the smallest compiled shape (``SUFFIX_TREE_SIZES``) that holds
    the largest: (tokens [B, N], parents [B, N] on the CPU, shape (N, C, D), drafted per row), or
    None when no live row drafted. Padding nodes hang under the root and repeat its first child's
    token: a repeated sibling is never accepted (greedy takes the first, recursive rejection zeroed
    that token), so padding costs compute, never exactness."""
    sessions = list(sessions) + [None] * (B - len(sessions))
    props = [s.propose(max(SUFFIX_TREE_SIZES), SUFFIX_CHILDREN, depth_limit=k) if s is not None else None
             for s in sessions]
    # nodes come in non-increasing count order (a child never outcounts its parent): a prefix
    # of the node list is a tree
    keep = [0 if p is None or p.match_len < min_match else
            next((i for i, sc in enumerate(p.scores) if sc < min_score), len(p.scores)) for p in props]
    drafted = [max(0, m - 1) for m in keep]
    if not any(d > 0 for d, a in zip(drafted, active) if a):
        return None
    n = next(size for size in SUFFIX_TREE_SIZES if size >= max(drafted))
    N, C = n + 1, SUFFIX_CHILDREN
    tokens = torch.zeros(B, N, dtype=torch.long)
    parents = torch.zeros(B, N, dtype=torch.long)
    parents[:, 0] = -1
    for b, (p, m) in enumerate(zip(props, keep)):
        if m <= 1:
            continue
        tokens[b, 1:m] = torch.tensor(p.tokens[1:m])
        parents[b, 1:m] = torch.tensor(p.parents[1:m])
        tokens[b, m:] = p.tokens[1]
    return tokens, parents, (N, C, min(k, n)), drafted


def suffix_chain_drafts(chains: list[list[int]], ladder: list[int], root, active: list[bool]):
    """Suffix chains (:func:`suffix_chains`) as one round's drafts: (k, drafts [B, k]) in the
    smallest ladder depth that holds the longest live chain, or None when no live row has one (then
    a plain step). Short rows are padded with repeats of the root (just rejected). root [B] long."""
    live = [len(c) for c, a in zip(chains, active) if a]
    if not any(live):
        return None
    k = chain_depth(ladder, max(live))
    drafts = root.unsqueeze(1).repeat(1, k).cpu()
    for b, c in enumerate(chains):
        if c:
            drafts[b, : len(c)] = torch.tensor(c[:k])
    return k, drafts.to(root.device)


class SuffixProposer(Proposer):
    """Suffix decoding over ``engine.suffix_index`` (read at each call, so a new index can be
    assigned between calls; each finished call's prompts and outputs are added to it). Chains move
    between the depths of ``engine.k_ladder`` (a round capped at depth k takes the smallest depth
    that holds its longest chain); trees go up to depth ``engine.k``. ``engine``: what holds those
    three (a compiled object, or the ONNX runtime's generator); ``min_score``: the pruning of
    drafts by estimated path probability."""

    def __init__(self, engine, min_score: float = SUFFIX_MIN_SCORE):
        self.engine, self.min_score = engine, min_score
        self.sessions = None

    def start(self, call: CallStart) -> None:
        self.sessions = [self.engine.suffix_index.start(r) for r in call.rows]

    def propose(self, view: RoundView, k: int) -> ChainProposal | None:
        # the round's depth k (the ladder's current rung, or the policy's choice) caps the chain: a
        # suffix seen once scores 1.0 all along, so its length alone would always ask for the
        # deepest graph; the ladder's depths below k hold shorter chains
        chains = suffix_chains(self.sessions, k, self.min_score, calibrated=not view.params.greedy)
        out = suffix_chain_drafts(chains, rungs_upto(self.engine.k_ladder, k), view.root, view.active.tolist())
        return None if out is None else ChainProposal(*out)

    def propose_tree(self, view: RoundView) -> TreeProposal | None:
        packed = pack_suffix_trees(self.sessions, view.batch, self.engine.k, view.active.tolist(), self.min_score)
        if packed is None:
            return None
        tokens, parents, shape, drafted = packed
        return TreeProposal(tokens.to(view.root.device), parents.to(view.root.device), shape, drafted)

    def observe(self, view: RoundView, outcome: RoundOutcome) -> None:
        if outcome.chain_depth and not view.params.greedy:
            calibrate_suffix(self.sessions, outcome.emitted, outcome.live)
        for session, kept, live in zip(self.sessions, outcome.kept, outcome.live):
            if live:
                session.extend(kept)

    def finish(self, rows: list[list[int]], new: list[list[int]]) -> None:
        self.sessions = None
        for r, n in zip(rows, new):  # later requests may repeat this one
            self.engine.suffix_index.add_document(r + n)
