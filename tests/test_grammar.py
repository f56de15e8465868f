"""Structured output inside exact verification (:mod:`specgraph.grammar`).

* Greedy output equals ``model.generate`` with the same grammar as a logits processor (a reference
  written here against xgrammar directly), for every drafter (chains, static and dynamic trees,
  a draft model), every kind of constraint, padded batches, and through Inductor.
* Sampled output follows the masked, renormalised law: chi-square against enumeration on a tiny
  model (vocabulary 8) at significance ALPHA, and two negative controls fail the same test:
  every drafted position masked with the committed prefix's state, and a grammar state advanced
  by the drafted tokens instead of the kept ones.
* Every finished output parses: the regex matches, the JSON loads and has the schema's keys.
"""
from __future__ import annotations

import itertools
import json
import re

import pytest
import torch
import xgrammar as xgr
from transformers import LogitsProcessor, LogitsProcessorList

import specgraph
import specgraph.grammar as sg_grammar
from specgraph.generation import UnsupportedSetting
from specgraph.grammar import GrammarRows, compile_grammar, grammar_spec
from specgraph.processors import apply_token_bitmask
from tiny_models import tiny_causal_lm

EOS = 2  # the character tokenizer's </s>
REGEX = r"[a-z]{3}(-[a-z]{2,3}){2,4}\."
EBNF = 'root ::= "(" item ("," item)? ("," item)? ")"\nitem ::= [0-9] [0-9]? | "x"'
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "kind": {"enum": ["cat", "dog"]},
                                            "n": {"type": "integer"}}, "required": ["ok", "kind", "n"]}
CONSTRAINTS = {
    "regex": dict(regex=REGEX),
    "ebnf": dict(grammar=EBNF),
    "json_schema": dict(response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}}),
    "json_object": dict(response_format={"type": "json_object"}),
}
PROMPTS = ['abc-de-fgh. abc-de-fgh. {"ok": true, "kind": "cat", "n": 12} (1,x,23)', "(4,x) abc-de"]


class ReferenceGrammar(LogitsProcessor):
    """The constraint as transformers runs a logits processor: each row's matcher accepts the
    row's last token, then the scores are masked with xgrammar's own bitmask kernel."""

    def __init__(self, compiled, prompt_length: int, vocab: int, eos: int = EOS):
        self.compiled, self.T, self.V, self.eos = compiled, prompt_length, vocab, eos
        self.matchers = None

    def __call__(self, input_ids, scores):
        if self.matchers is None:
            self.matchers = [xgr.GrammarMatcher(self.compiled, override_stop_tokens=[self.eos]) for _ in input_ids]
        mask = xgr.allocate_token_bitmask(len(input_ids), self.V)
        for b, m in enumerate(self.matchers):
            if input_ids.shape[1] > self.T and not m.is_terminated():
                assert m.accept_token(int(input_ids[b, -1]))
            if not m.is_terminated():
                m.fill_next_token_bitmask(mask, b)
        scores = scores.clone()
        xgr.apply_token_bitmask_inplace(scores, mask)
        return scores


def reference_compiled(tok, vocab, constraint: dict):
    comp = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=[EOS]))
    if "regex" in constraint:
        return comp.compile_regex(constraint["regex"])
    if "grammar" in constraint:
        return comp.compile_grammar(constraint["grammar"])
    rf = constraint["response_format"]
    if rf["type"] == "json_object":
        return comp.compile_builtin_json_grammar()
    return comp.compile_json_schema(json.dumps(rf["json_schema"]["schema"]))


def batch(tok, texts):
    rows = [tok.encode(t) for t in texts]
    T = max(map(len, rows))
    ids = torch.tensor([[0] * (T - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (T - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def hf_greedy(model, tok, ids, mask, constraint, max_new_tokens):
    proc = ReferenceGrammar(reference_compiled(tok, 128, constraint), ids.shape[1], 128)
    return model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                          logits_processor=LogitsProcessorList([proc]), pad_token_id=0)


@pytest.fixture(scope="module")
def tok(char_tokenizer):
    return char_tokenizer()


@pytest.fixture(scope="module")
def target():
    return tiny_causal_lm(eos=EOS)


DRAFTERS = ["plain", "ngram", "suffix", "model", "ngram-tree", "suffix-tree"]


@pytest.fixture(scope="module")
def compiled(target):
    cache = {}

    def get(kind):
        if kind not in cache:
            draft = {"plain": None, "model": tiny_causal_lm(eos=EOS, seed=1)}.get(kind, kind.removesuffix("-tree"))
            tree = ("dynamic" if kind == "suffix-tree" else [(0,), (1,), (0, 0), (0, 0, 0)]) \
                if kind.endswith("-tree") else None
            cache[kind] = specgraph.compile(target, draft, tree=tree, backend="eager", max_batch_size=2,
                                            max_seq_len=256)
        return cache[kind]
    return get


@pytest.mark.parametrize("constraint", list(CONSTRAINTS))
@pytest.mark.parametrize("drafter", DRAFTERS)
def test_greedy_equals_generate_with_the_grammar_as_a_processor(target, tok, compiled, drafter, constraint):
    ids, mask = batch(tok, PROMPTS)
    c = CONSTRAINTS[constraint]
    fast = compiled(drafter)
    out = fast.generate(ids, attention_mask=mask, max_new_tokens=48, do_sample=False, tokenizer=tok, **c)
    ref = hf_greedy(target, tok, ids, mask, c, 48)
    assert torch.equal(out, ref), (tok.batch_decode(out[:, ids.shape[1]:]), tok.batch_decode(ref[:, ids.shape[1]:]))
    if drafter != "plain":
        assert fast.stats.drafted > 0


@pytest.mark.parametrize("drafter", ["ngram", "suffix-tree"])
def test_a_batch_smaller_than_its_bucket(target, tok, drafter):
    """Three rows run in the bucket of 4: the padding row has no grammar."""
    ids, mask = batch(tok, PROMPTS + ["x"])
    draft = drafter.removesuffix("-tree")
    fast = specgraph.compile(target, draft, tree="dynamic" if drafter.endswith("tree") else None, backend="eager",
                             max_batch_size=4, max_seq_len=256)
    out = fast.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False, tokenizer=tok, regex=REGEX)
    assert torch.equal(out, hf_greedy(target, tok, ids, mask, dict(regex=REGEX), 32))


def test_greedy_equals_generate_through_inductor(target, tok):
    ids, mask = batch(tok, PROMPTS)
    fast = specgraph.compile(target, "ngram", max_batch_size=2, max_seq_len=256, modes=("greedy",), cache=False,
                             progress=False)
    out = fast.generate(ids, attention_mask=mask, max_new_tokens=48, do_sample=False, tokenizer=tok, regex=REGEX)
    assert torch.equal(out, hf_greedy(target, tok, ids, mask, dict(regex=REGEX), 48))
    assert fast.stats.forced > 0 and fast.stats.accepted > 0


def test_forced_tokens_replace_drafts_and_are_accepted(target, tok, compiled, monkeypatch):
    """The fixed parts of a grammar (JSON keys, punctuation) are drafted for free: the same output,
    in fewer rounds than with the drafter's own drafts there."""
    ids, mask = batch(tok, PROMPTS[1:])
    c = dict(grammar='root ::= "{\\"name\\": \\"" [a-z] [a-z]? "\\", \\"kind\\": \\"" ("cat" | "dog") "\\"}"')
    fast = compiled("ngram")
    out = fast.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, tokenizer=tok, **c)
    with_forced = fast.stats
    monkeypatch.setattr(sg_grammar, "FORCED_DRAFTS", False)
    assert torch.equal(fast.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, tokenizer=tok,
                                     **c), out)
    assert with_forced.forced > 0 and fast.stats.forced == 0
    assert with_forced.rounds < fast.stats.rounds


def test_finished_outputs_satisfy_their_constraint(target, tok, compiled):
    ids, mask = batch(tok, ["(1,2) (3,x)", "abc-de-fg. xyz-ab-cd."])
    fast = compiled("ngram")
    for c, check in ((dict(grammar=EBNF), lambda s: re.fullmatch(r"\((\d\d?|x)(,(\d\d?|x)){0,2}\)", s)),
                     (dict(regex=REGEX), lambda s: re.fullmatch(REGEX, s))):
        out = fast.generate(ids, attention_mask=mask, max_new_tokens=200, do_sample=False, tokenizer=tok, **c)
        for row in out[:, ids.shape[1]:].tolist():
            assert EOS in row, "every row finishes within the budget (the grammar forces its end eventually)"
            assert check(tok.decode(row[:row.index(EOS)])), tok.decode(row)


def test_sampled_rows_stay_inside_the_grammar(target, tok, compiled):
    ids, mask = batch(tok, PROMPTS)
    fast = compiled("ngram")
    g = torch.Generator().manual_seed(0)
    out = fast.generate(ids, attention_mask=mask, max_new_tokens=64, do_sample=True, generator=g, tokenizer=tok,
                        **CONSTRAINTS["ebnf"])
    m = xgr.GrammarMatcher(reference_compiled(tok, 128, dict(grammar=EBNF)), override_stop_tokens=[EOS])
    for row in out[:, ids.shape[1]:].tolist():
        m.reset()
        for t in row:
            if m.is_terminated():
                assert t == 0  # padding after the end
            else:
                assert m.accept_token(t), tok.decode(row)


def test_bitmask_equals_xgrammar_kernel():
    g = torch.Generator().manual_seed(0)
    for V in (8, 37, 128, 49152):
        words = (V + 31) // 32
        allowed = torch.randint(-2**31, 2**31 - 1, (3, 2, words), generator=g, dtype=torch.int64).to(torch.int32)
        scores = torch.randn(3, 2, V, generator=g)
        ref = scores.clone().view(6, V)
        xgr.apply_token_bitmask_inplace(ref, allowed.view(6, words))
        assert torch.equal(apply_token_bitmask(scores, allowed), ref.view(3, 2, V))


def test_requests_that_cannot_be_honoured_are_refused(target, tok, compiled):
    fast = compiled("plain")
    ids = torch.tensor([tok.encode("abc")])
    with pytest.raises(ValueError, match="tokenizer"):
        fast.generate(ids, max_new_tokens=4, regex="a+")
    with pytest.raises(ValueError, match="one of"):
        fast.generate(ids, max_new_tokens=4, regex="a+", grammar=EBNF, tokenizer=tok)
    with pytest.raises(ValueError, match="json_schema"):
        fast.generate(ids, max_new_tokens=4, response_format={"type": "json_schema", "json_schema": SCHEMA},
                      tokenizer=tok)
    with pytest.raises(ValueError, match="type"):
        fast.generate(ids, max_new_tokens=4, response_format={"type": "yaml"}, tokenizer=tok)
    with pytest.raises(ValueError, match="cannot compile"):
        fast.generate(ids, max_new_tokens=4, grammar="root ::= ", tokenizer=tok)
    with pytest.raises(ValueError, match="eos_token_id"):
        fast.generate(ids, max_new_tokens=4, regex="a+", tokenizer=tok, eos_token_id=[])
    assert grammar_spec({"type": "text"}) is None


def test_eager_fallback_refuses_a_grammar(tok):
    model = tiny_causal_lm(eos=EOS)
    fast = specgraph.compile(model, "ngram", backend="eager", max_batch_size=1, max_seq_len=64)
    fast.fallback_reason = "a model the capture cannot run"
    with pytest.raises(UnsupportedSetting, match="grammar"):
        fast.generate(torch.tensor([tok.encode("abc")]), max_new_tokens=4, regex="a+", tokenizer=tok)


# ---------------------------------------------------------------------------------------------
# the sampled law, by enumeration (vocabulary 8)

ALPHA = 1e-3
V8 = ["<eos>", "a", "b", "c", "d", "e", "f", "g"]
LAW_REGEX = "[b-g][a-c]a[a-g]*"  # three positions with different masks; the third forces "a"
MASKS = [[2, 3, 4, 5, 6, 7], [1, 2, 3], [1]]


def law_info():
    return xgr.TokenizerInfo(V8, xgr.VocabType.RAW, vocab_size=8, stop_token_ids=[0])


@torch.no_grad()
def masked_law(model, settings) -> torch.Tensor:
    """P(t1, t2, t3 | prompt) under the grammar: each position's logits masked to MASKS[j] and
    warped (generate's order: the processor, then temperature / top-k)."""
    from test_compile_sampling import PROMPT, V
    from specgraph.warping import warped_probs

    seqs = torch.tensor([PROMPT + [a, b] for a, b in itertools.product(range(V), repeat=2)])
    logits = model(seqs).logits

    def dist(x, j):
        keep = torch.full((V,), float("-inf"))
        keep[MASKS[j]] = 0.0
        return warped_probs(x + keep, **settings).double()
    p1 = dist(logits[0, len(PROMPT) - 1], 0)
    p2 = dist(logits[::V, len(PROMPT)], 1)
    p3 = dist(logits[:, len(PROMPT) + 1], 2).view(V, V, V)
    return p1[:, None, None] * p2[:, :, None] * p3


def grammar_counts(fast, settings, seed: int) -> torch.Tensor:
    from test_compile_sampling import N_CALLS, sampled_counts

    return sampled_counts(fast, settings, seed, N_CALLS // 3, eos_token_id=[0], regex=LAW_REGEX,
                          tokenizer=law_info())


@pytest.fixture(scope="module")
def law_models():
    from test_compile_sampling import tiny

    return tiny(0, 2, 40.0), tiny(1, 1, 25.0)


def law_fast(law_models, kind):
    from test_compile_sampling import BATCH, TREE

    target, draft = law_models
    base = kind.removesuffix("-tree")
    d = {"model": draft, "plain": None}.get(base, base)
    return specgraph.compile(target, d, num_speculative_tokens=2, tree=TREE if kind.endswith("-tree") else None,
                             backend="eager", max_batch_size=BATCH, max_seq_len=32)


@pytest.mark.parametrize("settings", [dict(temperature=1.0), dict(temperature=0.7, top_k=2)], ids=["T1", "T0.7-top2"])
@pytest.mark.parametrize("kind", ["plain", "ngram", "model", "model-tree"])
def test_sampled_law_is_the_masked_renormalised_law(law_models, kind, settings):
    fast = law_fast(law_models, kind)
    counts = grammar_counts(fast, settings, seed=3)
    p = sg_pvalue(counts, masked_law(law_models[0], settings))
    assert p > ALPHA, f"{kind} {settings}: chi-square p = {p:.2e}"
    if kind != "plain" and settings["temperature"] == 1.0:  # (the draft model's own top-2 misses the mask)
        assert 0 < fast.stats.accepted < fast.stats.drafted


def sg_pvalue(counts, law):
    from law import gof_pvalue

    return gof_pvalue(counts, law)


def lenient_advance(self, kept):
    """advance without the desync check, so the chi-square is what catches a control."""
    for m, toks in zip(self.matchers, kept):
        for t in toks:
            if not m.is_terminated():
                m.accept_token(int(t))


def committed_prefix_masks(original):
    """Control: every drafted position masked with the committed prefix's state."""
    def chain(self, chain, live, stats):
        out = original(self, chain, live, stats)
        return out if out.allowed is None else \
            type(out)(out.k, out.drafts, out.probs, out.allowed[:, :1].expand_as(out.allowed).contiguous())
    return chain


class NoRollback:
    """A matcher whose rollback does nothing."""

    def __init__(self, m):
        self.m = m

    def rollback(self, n):
        pass

    def __getattr__(self, name):
        return getattr(self.m, name)


def advanced_by_drafts(original):
    """Control: the grammar state advanced by the drafted tokens (no rollback after masking)."""
    def chain(self, chain, live, stats):
        matchers, self.matchers = self.matchers, [NoRollback(m) for m in self.matchers]
        try:
            return original(self, chain, live, stats)
        finally:
            self.matchers = matchers
    return chain


@pytest.mark.parametrize("control", ["committed-prefix masks", "advanced by drafts"])
def test_negative_controls_fail_the_law(law_models, monkeypatch, control):
    monkeypatch.setattr(GrammarRows, "advance", lenient_advance)
    make = committed_prefix_masks if control == "committed-prefix masks" else advanced_by_drafts
    monkeypatch.setattr(GrammarRows, "chain", make(GrammarRows.chain))
    settings = dict(temperature=1.0)
    counts = grammar_counts(law_fast(law_models, "model"), settings, seed=3)
    law = masked_law(law_models[0], settings)
    if counts[law == 0].sum() > 0:
        return  # detected outright: a continuation the grammar forbids was emitted
    p = sg_pvalue(counts, law)
    assert p < ALPHA, f"{control}: not detected (p = {p:.3g})"


def test_structured_output_rounds_are_built_and_cached_at_compile(target, tok):
    """``compile(structured_output=True)`` packages the grammar's rounds in the graph cache: a
    request with a grammar then builds nothing, and a second object loads them."""
    ids, mask = batch(tok, PROMPTS[:1])
    kw = dict(max_batch_size=1, max_seq_len=256, modes=("greedy",), structured_output=True, warmup=True,
              progress=False)
    for _ in range(2):
        fast = specgraph.compile(target, "ngram", **kw)
        built = len(fast.graphs_built)
        out = fast.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, tokenizer=tok, regex=REGEX)
        assert len(fast.graphs_built) == built
        assert torch.equal(out, hf_greedy(target, tok, ids, mask, dict(regex=REGEX), 40))
    assert fast.graph_cache["hit"]


# ---------------------------------------------------------------------------------------------
# the real model: SmolLM2's BPE vocabulary (49,152 tokens), JSON answers


@pytest.mark.slow
def test_smollm2_json_answers_equal_generate_and_validate(smollm2):
    import jsonschema

    model, tok = smollm2
    V, eos = model.get_output_embeddings().out_features, model.generation_config.eos_token_id
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                               "city": {"type": "string"}}, "required": ["name", "age", "city"]}
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}
    fast = specgraph.compile(model, "ngram", backend="eager", max_batch_size=1, max_seq_len=512)
    comp = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=V, stop_token_ids=[eos]))
    for text in ("Maria Lopez, 34, is an architect in Valencia. Give her name, age and city as JSON.",
                 "Tom Becker (41) moved here from Hamburg. Give his name, age and city as JSON."):
        enc = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                      return_tensors="pt")
        ids = enc if isinstance(enc, torch.Tensor) else enc["input_ids"]
        out = fast.generate(ids, max_new_tokens=64, do_sample=False, tokenizer=tok, response_format=rf)
        ref_proc = ReferenceGrammar(comp.compile_json_schema(json.dumps(schema)), ids.shape[1], V, eos)
        ref = model.generate(ids, max_new_tokens=64, do_sample=False, logits_processor=LogitsProcessorList([ref_proc]))
        assert torch.equal(out, ref)
        new = out[0, ids.shape[1]:].tolist()
        assert eos in new
        jsonschema.validate(json.loads(tok.decode(new[:new.index(eos)])), schema)
