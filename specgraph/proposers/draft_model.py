"""A smaller model with the target's vocabulary as the drafter (chains and static trees).

Its steps are graphs of the compiled object (``draft_graph``, ``draft_tree_graph``), over the
draft's own KV cache, which holds the same committed tokens as the target's: the prompt is
prefilled into it at the start of a call, and each round's first step feeds the token the draft
has not seen yet.
"""
from __future__ import annotations

import torch

from specgraph.proposal import CallStart, ChainProposal, Proposer, RoundView, TreeProposal
from specgraph.verify import exponential_noise


def race_noise(B: int, V: int, device, generator, greedy: bool) -> torch.Tensor:
    """Exp(1) draws [B, V] for one sampled draft token (``argmax q / E`` samples q), or ones [B, 1]
    when drafting greedily (the argmax of q)."""
    if greedy:
        return torch.ones(B, 1, device=device)
    return exponential_noise((B, V), device, generator)


class DraftModelProposer(Proposer):
    """Drafts from ``engine.draft_model``, whose graphs ``engine`` (a
    :class:`specgraph.compiler.SpecGraphModel`) builds."""

    def __init__(self, engine):
        self.engine = engine

    def start(self, call: CallStart) -> None:
        e = self.engine
        e.prefill_rows(call.batch, call.rows, e.kv_cache(call.batch, "draft"), call.device, "draft")

    def propose(self, view: RoundView, k: int) -> ChainProposal:
        """k draft-model steps: drafts [B, k] and, when sampling, the q rows they were drawn from [B, k, V]."""
        e, B, device = self.engine, view.batch, view.hist.device
        kv = e.kv_cache(B, "draft")
        prev = view.hist.gather(1, (view.L - 1).clamp_min(0).unsqueeze(1)).squeeze(1)
        tokens, last = torch.stack([prev, view.root], dim=1), view.L
        drafts, probs = [], []
        spec, proc = e.draft_processors
        path = torch.zeros(B, 1, e.k, dtype=torch.long, device=device)  # this round's drafts so far
        for j in range(k):
            expo = race_noise(B, view.vocab, device, view.generator, view.params.greedy)
            fn = e.draft_graph(B, 2 if j == 0 else 1, view.params, view.width, spec)
            extra = () if spec is None else (*proc, path, torch.full((B, 1), j, dtype=torch.long, device=device))
            tok, q = fn(tokens, last, view.active, expo, *extra, *kv)
            drafts.append(tok)
            probs.append(q)
            if spec is not None:
                path = path.clone()
                path[:, 0, j] = tok
            tokens, last = tok.unsqueeze(1), last + 1
        return ChainProposal(k, torch.stack(drafts, dim=1), None if view.params.greedy else torch.stack(probs, dim=1))

    def propose_tree(self, view: RoundView) -> TreeProposal:
        """The static tree, level by level: each level's fed nodes take the draft's top tokens at
        their children's ranks (deterministic children: verified by recursive rejection)."""
        e, B = self.engine, view.batch
        spec = e.tree
        N = spec.num_nodes
        shape = (N, spec.children.shape[1], spec.max_depth)
        device = view.hist.device
        parents = spec.parents.to(device).expand(B, N)
        kv = e.kv_cache(B, "draft")
        prev = view.hist.gather(1, (view.L - 1).clamp_min(0).unsqueeze(1)).squeeze(1)
        tokens = torch.zeros(B, N, dtype=torch.long, device=device)
        tokens[:, 0] = view.root
        kids = spec.children.tolist()
        for d, fed in enumerate(e.tree_levels):
            top = e.draft_tree_graph(B, d, view.width)(tokens, prev, view.L, view.active, *kv)  # [B, Qd, R]
            for q, node in enumerate(fed):
                for c in kids[node]:
                    if c >= 0:
                        tokens[:, c] = top[:, q, e.tree_rank[c]]
        return TreeProposal(tokens, parents, shape, [N - 1] * B)
