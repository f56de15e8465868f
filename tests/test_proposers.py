"""The proposer interface (specgraph/proposers): the compiled loop reaches every drafter through
start / propose / observe / finish, and whatever a proposer drafts, the output is the target's.

Compiled with ``backend="eager"`` (the captured, rewritten rounds without Inductor) on a tiny Llama.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import specgraph
from specgraph.proposers import (CallStart, ChainProposal, CustomChainProposer, NgramProposer, Proposer, RoundView,
                                 SuffixProposer)
from specgraph.proposal import RoundOutcome
from specgraph.suffix import SuffixIndex
from specgraph.drafters import ReplayDrafter
from specgraph.warping import SamplingParams
from tiny_models import tiny

PROMPTS = [[1, 9, 10, 11, 12, 9, 10, 11], [1, 40, 41, 42, 43, 44]]


@pytest.fixture(scope="module")
def llama():
    return tiny("llama")


def batch(prompts):
    T = max(map(len, prompts))
    ids = torch.zeros(len(prompts), T, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, T - len(p):], mask[b, T - len(p):] = torch.tensor(p), 1
    return ids, mask


def reference(model, ids, mask, n):
    return model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, eos_token_id=[], pad_token_id=0)


def test_each_drafter_gets_its_proposer(llama):
    kw = dict(backend="eager", max_seq_len=64, cache=False)
    assert type(specgraph.compile(llama, None, **kw).proposer) is Proposer
    assert isinstance(specgraph.compile(llama, "ngram", **kw).proposer, NgramProposer)
    assert isinstance(specgraph.compile(llama, "suffix", **kw).proposer, SuffixProposer)
    rd = ReplayDrafter({(1, 2): [3, 4]}, beta=1.0, vocab_size=128)
    assert isinstance(specgraph.compile(llama, rd, **kw).proposer, CustomChainProposer)


def test_draft_is_resolved_above_the_engine_into_a_kind_and_its_objects(llama):
    """proposers.resolve_draft turns each accepted ``draft=`` into the engine's Draft; the engine,
    given a config and no proposer factory, drafts nothing (it never names a drafter itself)."""
    from specgraph.compiler import SpecGraphModel, engine_config
    from specgraph.proposers import resolve_draft

    assert resolve_draft(llama, None).kind is None and resolve_draft(llama, "ngram").kind == "ngram"
    fresh = resolve_draft(llama, "suffix")
    assert fresh.kind == "suffix" and isinstance(fresh.suffix_index, SuffixIndex)
    index = SuffixIndex()
    assert resolve_draft(llama, index).suffix_index is index
    rd = ReplayDrafter({(1, 2): [3, 4]}, beta=1.0, vocab_size=128)
    assert (resolve_draft(llama, rd).kind, resolve_draft(llama, rd).chain_drafter) == ("custom", rd)
    small = tiny("llama", seed=1)
    assert (resolve_draft(llama, small).kind, resolve_draft(llama, small).draft_model) == ("model", small)
    with pytest.raises(ValueError, match="draft='lookahead' is not supported"):
        resolve_draft(llama, "lookahead")
    config = engine_config(llama, resolve_draft(llama, "ngram"), 4, None, "eager", 1, 64)
    assert type(SpecGraphModel(llama, config).proposer) is Proposer
    assert isinstance(SpecGraphModel(llama, config, specgraph.proposers.make_proposer).proposer, NgramProposer)


class Recorder(Proposer):
    """Passes every call to ``inner`` and logs it."""

    def __init__(self, inner):
        self.inner, self.log = inner, []

    def start(self, call):
        self.log.append(("start", len(call.rows), call.batch))
        self.inner.start(call)

    def propose(self, view, k):
        self.log.append(("propose", k))
        return self.inner.propose(view, k)

    def propose_tree(self, view):
        self.log.append(("propose_tree",))
        return self.inner.propose_tree(view)

    def observe(self, view, outcome):
        self.log.append(("observe", outcome.chain_depth))
        self.inner.observe(view, outcome)

    def finish(self, rows, new):
        self.log.append(("finish", len(rows), [len(n) for n in new]))
        self.inner.finish(rows, new)


def test_the_loop_calls_its_proposer_through_the_interface(llama):
    fast = specgraph.compile(llama, "suffix", num_speculative_tokens=4, backend="eager", max_batch_size=2,
                             max_seq_len=64, cache=False)
    fast.proposer = rec = Recorder(fast.proposer)
    ids, mask = batch(PROMPTS)
    out = fast.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=[], pad_token_id=0)
    assert torch.equal(out, reference(llama, ids, mask, 12))
    kinds = [e[0] for e in rec.log]
    assert kinds[0] == "start" and rec.log[0][1:] == (2, 2)
    assert rec.log[-1] == ("finish", 2, [12, 12])
    assert kinds.count("observe") == fast.stats.rounds  # once per round, after the host read it
    assert set(kinds[1:-1]) <= {"propose", "observe"}
    # the suffix index learnt the call: the same request now drafts from its own earlier output
    fast.proposer = rec.inner
    fast.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=[], pad_token_id=0)
    assert fast.stats.accepted > 0


class RandomDrafts(Proposer):
    """Proposes k random tokens per row every round (mostly wrong)."""

    def __init__(self, vocab, seed=0):
        self.vocab, self.gen = vocab, torch.Generator().manual_seed(seed)

    def propose(self, view, k):
        return ChainProposal(k, torch.randint(0, self.vocab, (view.batch, k), generator=self.gen))


class Oracle(Proposer):
    """Proposes the reference continuation (every draft right)."""

    def __init__(self, ref):
        self.ref = ref

    def propose(self, view, k):
        rows = []
        for b in range(view.batch):
            pos = int(view.L[b]) + 1  # the index of the row's next token in the reference
            row = self.ref[min(b, self.ref.shape[0] - 1), pos: pos + k].tolist()
            rows.append(row + [0] * (k - len(row)))
        return ChainProposal(k, torch.tensor(rows))


def test_any_proposal_is_verified_to_the_target_output(llama):
    ids = torch.tensor([PROMPTS[0]])
    ref = reference(llama, ids, torch.ones_like(ids), 16)
    fast = specgraph.compile(llama, "ngram", num_speculative_tokens=4, backend="eager", max_batch_size=1,
                             max_seq_len=64, cache=False)
    fast.proposer = RandomDrafts(128)
    assert torch.equal(fast.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=[], pad_token_id=0), ref)
    assert fast.stats.drafted > 0
    fast.proposer = Oracle(ref)
    assert torch.equal(fast.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=[], pad_token_id=0), ref)
    assert fast.stats.rounds == 4  # every round kept its 4 right drafts and the target's next token: 16 in 4


def test_negative_control_a_round_that_emits_its_drafts_unverified_is_caught(llama, monkeypatch):
    """If the loop emitted a proposal as it came (no verification), random drafts would show."""
    ids = torch.tensor([PROMPTS[0]])
    ref = reference(llama, ids, torch.ones_like(ids), 16)
    fast = specgraph.compile(llama, "ngram", num_speculative_tokens=4, backend="eager", max_batch_size=1,
                             max_seq_len=64, cache=False)
    fast.proposer = RandomDrafts(128)
    import specgraph.rounds as sg_rounds

    real = sg_rounds.verify_chain_with_noise

    def accept_all(logits, q, drafts, *args, **kw):  # every draft accepted, then the target's next token
        tokens, n, *more = real(logits, q, drafts, *args, **kw)
        K = drafts.shape[1]
        return (torch.cat([drafts, logits[:, K].argmax(-1, keepdim=True)], 1), torch.full_like(n, K + 1), *more)
    monkeypatch.setattr(sg_rounds, "verify_chain_with_noise", accept_all)
    out = fast.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=[], pad_token_id=0)
    assert not torch.equal(out, ref)


def view_of(rows, k=4):
    B, S = len(rows), 64
    hist = torch.zeros(B, S, dtype=torch.long)
    for b, r in enumerate(rows):
        hist[b, : len(r)] = torch.tensor(r)
    L = torch.tensor([len(r) - 1 for r in rows])
    return RoundView(B, SamplingParams(0.0), S, hist, L, hist.gather(1, L[:, None])[:, 0],
                     torch.ones(B, dtype=torch.bool), None, 128)


def test_suffix_proposer_drafts_from_what_it_observed():
    """A session grows with what each round kept: after observing a repeat, the proposer continues
    it; a proposer that observed nothing has no match (negative control)."""
    seen, blind = (SuffixProposer(SimpleNamespace(suffix_index=SuffixIndex(), k_ladder=[4], k=4)) for _ in range(2))
    row = [1, 20, 21, 22, 23]
    for p in (seen, blind):
        p.start(CallStart([row], 1, torch.device("cpu")))
    kept = [20, 21]
    seen.observe(view_of([row]), RoundOutcome(torch.tensor([kept]), torch.tensor([2]), None, [2], [True], [kept], 1))
    grown = row + kept
    got = seen.propose(view_of([grown]), 4)
    assert got is not None and got.drafts[0, :2].tolist() == [22, 23]
    assert blind.propose(view_of([grown]), 4) is None
