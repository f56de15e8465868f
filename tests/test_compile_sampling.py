"""The law of sampled output of ``specgraph.compile`` equals the target's, by enumeration.

A tiny target (vocab 8) defines an exact law for the first three generated tokens: the product of
its (warped) next-token distributions, computed here for all 8^3 continuations with full forwards.
``fast.generate`` draws many independent three-token continuations (rows of big batches); a
chi-square goodness-of-fit test at significance ALPHA (cells with expected count < 5 pooled, fixed
seeds, so CI is deterministic) must not reject. A negative control (the draft model's
argmax drafts passed off as samples from q) must be rejected by the same test.
"""
from __future__ import annotations

import itertools

import pytest
import torch
from transformers import LlamaConfig, AutoModelForCausalLM

import specgraph
from heads_for_tests import random_head
from law import gof_pvalue
import specgraph.compiler as sg_compiler
import specgraph.proposers.draft_model as sg_draft_model
import specgraph.learned as sg_learned
from specgraph.drafters import layer_skip
from specgraph.warping import warped_probs

pytestmark = pytest.mark.filterwarnings("ignore:.*past_key_values.*deprecated:FutureWarning")

ALPHA = 1e-3
V = 8
PROMPT = [1, 2, 3]
BATCH = 256
N_CALLS = 63  # 16,128 samples
SETTINGS = [dict(temperature=1.0), dict(temperature=0.7, top_k=4)]


def tiny(seed: int, layers: int, sharpen: float):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                      tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    m = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    with torch.no_grad():  # random init is near-uniform; sharpen so the law has structure
        m.lm_head.weight.mul_(sharpen)
    return m


@pytest.fixture(scope="module")
def target():
    return tiny(0, 2, 40.0)


@pytest.fixture(scope="module")
def draft():
    return tiny(1, 1, 25.0)


@torch.no_grad()
def exact_law(model, settings) -> torch.Tensor:
    """P(t1, t2, t3 | PROMPT) as a [V, V, V] tensor."""
    seqs = torch.tensor([PROMPT + [a, b] for a, b in itertools.product(range(V), repeat=2)])
    logits = model(seqs).logits  # [V*V, T+2, V]
    dist = lambda x: warped_probs(x, **settings).double()  # noqa: E731
    p1 = dist(logits[0, len(PROMPT) - 1])  # [V]
    p2 = dist(logits[::V, len(PROMPT)])  # [V] rows: t1 = a
    p3 = dist(logits[:, len(PROMPT) + 1]).view(V, V, V)  # [a, b, t3]
    return p1[:, None, None] * p2[:, :, None] * p3


@torch.no_grad()
def sampled_counts(fast, settings, seed: int, calls: int = N_CALLS, **generate_kw) -> torch.Tensor:
    """Counts [V, V, V] of ``calls`` x BATCH sampled three-token continuations of PROMPT
    (``generate_kw``: further generate arguments, which may replace the EOS)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.tensor([PROMPT] * BATCH)
    counts = torch.zeros(V, V, V, dtype=torch.float64)
    kw = {"eos_token_id": [], "pad_token_id": 0, **settings, **generate_kw}
    for _ in range(calls):
        out = fast.generate(ids, max_new_tokens=3, do_sample=True, generator=g, **kw)
        new = out[:, len(PROMPT):]
        assert new.shape[1] == 3
        counts.view(-1).index_add_(0, (new[:, 0] * V * V + new[:, 1] * V + new[:, 2]), torch.ones(BATCH, dtype=torch.float64))
    return counts


TREE = [(0,), (1,), (0, 0), (1, 0)]  # depth 2: two candidates, each with one child
KINDS = [None, "ngram", "model", "self", "ngram-tree", "model-tree", "self-tree", "suffix", "suffix-tree",
         "eagle", "eagle-tree", "eagle-dynamic", "medusa", "medusa-tree", "layerskip", "layerskip-tree",
         "model-auto"]
# num_speculative_tokens="auto": the depth of each round (0, 1 or 2) depends on the acceptance seen
# in earlier rounds; this cost curve (at the 64-row bucket) puts the choice between the depths
# within reach of the random draft's acceptance, so the law is checked while the depth moves
AUTO_COST = specgraph.perfmodel.CostModel(specgraph.perfmodel.CostCurve({BATCH: {1: 1.0, 2: 1.25, 3: 1.45}}))


def compile_fast(target, draft_kind, draft_model):
    tree = None
    auto = draft_kind is not None and draft_kind.endswith("-auto")
    if auto:
        draft_kind = draft_kind.removesuffix("-auto")
    if draft_kind is not None and draft_kind.endswith(("-tree", "-dynamic")):
        draft_kind, shape = draft_kind.rsplit("-", 1)
        tree = "dynamic" if draft_kind == "suffix" or shape == "dynamic" else TREE
    if draft_kind in ("eagle", "medusa"):
        draft = random_head(target, draft_kind)
    elif draft_kind == "layerskip":  # the target's first layer: shares its weights
        draft = layer_skip(target, 1)
    else:
        draft = draft_model if draft_kind == "model" else draft_kind
    if auto:
        fast = specgraph.compile(target, draft, num_speculative_tokens="auto", depths=[1, 2], backend="eager",
                                 max_batch_size=BATCH, max_seq_len=32)
        fast.policy.cost = AUTO_COST
        # choices from the counts alone (no round times): a fixed seed gives the same counts, and
        # the p-value, on every run
        fast.policy.learn_cost = False
        return fast
    return specgraph.compile(target, draft, num_speculative_tokens=2, tree=tree, backend="eager",
                             max_batch_size=BATCH, max_seq_len=32)


@pytest.mark.parametrize("settings", SETTINGS, ids=["T1", "T0.7-top4"])
@pytest.mark.parametrize("draft_kind", KINDS)
def test_sampled_law_of_three_tokens_matches_target(target, draft, draft_kind, settings):
    self_draft = draft_kind in ("self", "self-tree")
    fast = compile_fast(target, {"self": "model", "self-tree": "model-tree"}.get(draft_kind, draft_kind),
                        target if self_draft else draft)
    seed = 10 * SETTINGS.index(settings) + KINDS.index(draft_kind)  # fixed per case
    seen = []
    if fast.policy is not None:  # record every round's depth across all calls
        choose = fast.policy.choose
        fast.policy.choose = lambda *a: seen.append(choose(*a)) or seen[-1]
    counts = sampled_counts(fast, settings, seed=seed)
    p = gof_pvalue(counts, exact_law(target, settings))
    assert p > ALPHA, f"draft={draft_kind} {settings}: chi-square p = {p:.2e}"
    # both verification branches (accept, residual resample) were exercised; the random draft
    # model's top-2 children almost never hold the target's likely tokens, the target's own do
    if draft_kind in ("model", "ngram-tree", "self-tree", "suffix", "suffix-tree", "eagle", "eagle-tree", "eagle-dynamic",
                      "medusa", "medusa-tree", "layerskip", "layerskip-tree"):
        assert 0 < fast.stats.accepted < fast.stats.drafted
    if draft_kind == "self":  # the draft is the target: every sampled draft must be accepted
        assert fast.stats.accepted == fast.stats.drafted
    if draft_kind is not None and draft_kind.endswith("-auto"):  # the depth really moved, as a function of earlier acceptance
        assert len(set(seen)) >= 2, sorted(set(seen))


def test_negative_control_argmax_drafts_reported_as_sampled_is_rejected(target, draft, monkeypatch):
    """Drafts taken as the argmax of q while verification is told they were sampled from q."""
    settings = dict(temperature=0.7, top_k=4)
    calls = []

    def no_noise(B, V_, device, generator, greedy):
        calls.append(1)
        return torch.ones(B, V_, device=device)  # the exponential race degenerates to argmax q

    monkeypatch.setattr(sg_draft_model, "race_noise", no_noise)
    fast = compile_fast(target, "model", draft)
    counts = sampled_counts(fast, settings, seed=7)
    assert calls, "the mutation was not exercised"
    p = gof_pvalue(counts, exact_law(target, settings))
    assert p < ALPHA, f"negative control not detected: p = {p:.3g}"


def test_negative_control_eagle_argmax_drafts_reported_as_sampled_is_rejected(target, monkeypatch):
    """The same mutation for an EAGLE head: its drafts are the argmax of q, its q rows still go to
    verification as the distribution they were sampled from."""
    settings = dict(temperature=0.7, top_k=4)
    calls = []

    def no_noise(B, K, V_, device, generator, greedy):
        calls.append(1)
        return torch.ones(B, K, V_, device=device)

    monkeypatch.setattr(sg_learned, "draft_noise", no_noise)
    fast = compile_fast(target, "eagle", None)
    counts = sampled_counts(fast, settings, seed=8)
    assert calls, "the mutation was not exercised"
    p = gof_pvalue(counts, exact_law(target, settings))
    assert p < ALPHA, f"negative control not detected: p = {p:.3g}"


@pytest.mark.parametrize("draft_kind, settings", [("model", SETTINGS[1]), ("ngram-tree", SETTINGS[0])],
                         ids=["model-T0.7-top4", "ngram-tree-T1"])
def test_sampled_law_with_the_inductor_backend(target, draft, draft_kind, settings):
    """The same law through torch.compile'd rounds (fused warping + verification lowered by
    Inductor, temperature a graph input), not only the eager graphs above."""
    kind, tree = (draft_kind, None) if draft_kind == "model" else ("ngram", TREE)
    fast = specgraph.compile(target, draft if kind == "model" else kind, num_speculative_tokens=2, tree=tree,
                             backend="inductor", max_batch_size=BATCH, max_seq_len=32)
    counts = sampled_counts(fast, settings, seed=100 + len(draft_kind))
    p = gof_pvalue(counts, exact_law(target, settings))
    assert p > ALPHA, f"inductor draft={draft_kind} {settings}: chi-square p = {p:.2e}"
    assert 0 < fast.stats.accepted < fast.stats.drafted
