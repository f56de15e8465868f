"""``fast.generate`` honours every generation setting of ``model.generate`` exactly, or refuses it.

Greedy output equals ``model.generate`` token for token under each setting (logits processors,
lengths, stop strings, model defaults), for chain and tree drafters, on several architectures, at
batch 1 and in left-padded batches; the processors' sampled law is checked by enumeration against
transformers' own processor objects, with a negative control (processors fed only the committed
prefix, not the drafted path) that the same test rejects. Refused settings raise naming them.
"""
from __future__ import annotations

import itertools

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, LlamaConfig
from transformers.generation.logits_process import (
    LogitsProcessorList, NoRepeatNGramLogitsProcessor, RepetitionPenaltyLogitsProcessor,
)
from transformers.generation.streamers import BaseStreamer, TextStreamer

import specgraph
from heads_for_tests import random_head
from law import gof_pvalue
import specgraph.rounds as sg_rounds
from specgraph.generation import UnsupportedSetting
from specgraph.proposers.draft_model import DraftModelProposer
from specgraph.warping import warped_probs

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

PAD = 127
TINY = dict(
    llama=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=128, max_position_embeddings=256),
    qwen2=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=128, max_position_embeddings=256),
    gpt_neox=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  vocab_size=128, max_position_embeddings=256, rotary_pct=0.25),
    opt=dict(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=128,
             max_position_embeddings=256, word_embed_proj_dim=64, pad_token_id=1),
)
EOS = 5


def tiny_model(arch: str, seed: int = 0):
    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(arch, **TINY[arch])
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32).eval()
    model.generation_config.eos_token_id = EOS
    model.generation_config.pad_token_id = PAD
    return model


def left_pad(rows):
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), PAD, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, T - len(r):] = torch.tensor(r)
        mask[b, T - len(r):] = 1
    return ids, mask


def rep(pattern, n):
    return (pattern * (n // len(pattern) + 1))[:n]


PROMPTS = {1: [rep([11, 42, 7, 93], 13)], 3: [rep([17, 64, 3, 88, 25], 21), rep([50, 9], 5), [80, 81]]}
SETTINGS = {
    "repetition_penalty": dict(max_new_tokens=24, repetition_penalty=1.4),
    "no_repeat_ngram": dict(max_new_tokens=24, no_repeat_ngram_size=2),
    "bad_words+bias": dict(max_new_tokens=24, bad_words_ids=[[42], [7, 93]], sequence_bias={(11,): 4.0, (93, 11): -9.0}),
    "min_new_tokens": dict(max_new_tokens=24, min_new_tokens=12, suppress_tokens=[3, 4]),
    "begin_suppress+forced_eos": dict(max_new_tokens=24, begin_suppress_tokens=[11, 17, 50, 80],
                                      forced_eos_token_id=EOS),
    "max_length": dict(max_length=30),
    "everything": dict(max_new_tokens=24, repetition_penalty=1.2, no_repeat_ngram_size=3, bad_words_ids=[[42]],
                       min_length=25, suppress_tokens=[3]),
}
DRAFTS = ["ngram", "model", "self", "ngram-tree", "self-tree"]
TREE = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]


def compile_fast(model, arch, kind, **kw):
    draft, tree = kind, None
    if kind.endswith("-tree"):
        draft, tree = kind.removesuffix("-tree"), TREE
    if draft == "model":
        draft = tiny_model(arch, seed=1)
    elif draft == "self":
        draft = model
    return specgraph.compile(model, draft, num_speculative_tokens=4, tree=tree, backend="eager", max_batch_size=4,
                             max_seq_len=96, **kw)


@pytest.mark.parametrize("arch", sorted(TINY))
@pytest.mark.parametrize("kind", DRAFTS)
def test_greedy_equals_model_generate_under_every_setting(arch, kind):
    model = tiny_model(arch)
    fast = compile_fast(model, arch, kind)
    accepted = 0
    for B, rows in PROMPTS.items():
        ids, mask = left_pad(rows)
        for name, kw in SETTINGS.items():
            ref = model.generate(ids, attention_mask=mask, **kw)
            out = fast.generate(ids, attention_mask=mask, **kw)
            assert torch.equal(ref, out), f"{arch} {kind} B={B} {name}:\n{ref[:, ids.shape[1]:]}\n{out[:, ids.shape[1]:]}"
            accepted += fast.stats.accepted
    if kind.startswith("self"):
        assert accepted > 0


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def test_model_generation_config_defaults_are_read(llama):
    model = tiny_model("llama")
    model.generation_config.max_new_tokens = 7
    model.generation_config.repetition_penalty = 1.5
    fast = specgraph.compile(model, "ngram", backend="eager", max_seq_len=96)
    ids = torch.tensor([rep([11, 42, 7], 9)])
    assert torch.equal(fast.generate(ids), model.generate(ids))
    assert fast.generate(ids).shape[1] == 9 + 7
    # a passed GenerationConfig, then explicit keyword arguments (later wins)
    cfg = GenerationConfig(max_new_tokens=11, no_repeat_ngram_size=2)
    for kw in (dict(generation_config=cfg), dict(generation_config=cfg, max_new_tokens=4)):
        assert torch.equal(fast.generate(ids, **kw), model.generate(ids, **kw)), kw
    assert fast.generate(ids, generation_config=cfg, max_new_tokens=4).shape[1] == 9 + 4


def test_default_length_is_transformers_default(llama):
    fast = specgraph.compile(llama, "ngram", backend="eager", max_seq_len=96)
    ids = torch.tensor([rep([11, 42, 7], 9)])
    assert torch.equal(fast.generate(ids), llama.generate(ids))


@pytest.mark.parametrize("form", ["int", "list", "tensor"])
def test_eos_as_int_list_or_tensor(llama, form):
    fast = specgraph.compile(llama, "ngram", backend="eager", max_seq_len=96)
    ids = torch.tensor([[11, 42, 7]])
    hit = int(llama.generate(ids, max_new_tokens=30, eos_token_id=[])[0, 3 + 10])  # a token the model emits
    eos = {"int": hit, "list": [9, hit], "tensor": torch.tensor([hit, 9])}[form]
    ref = llama.generate(ids, max_new_tokens=30, eos_token_id=eos)
    assert ref.shape[1] <= 3 + 11
    assert torch.equal(fast.generate(ids, max_new_tokens=30, eos_token_id=eos), ref)


class Collect(BaseStreamer):
    def __init__(self):
        self.puts, self.ended = [], False

    def put(self, value):
        self.puts.append(value.clone())

    def end(self):
        self.ended = True


@pytest.mark.parametrize("B", [1, 3])
def test_streamers_receive_what_transformers_sends(llama, B):
    fast = specgraph.compile(llama, "ngram", backend="eager", max_batch_size=4, max_seq_len=96)
    ids, mask = left_pad(PROMPTS[B] if B in PROMPTS else PROMPTS[1])
    ref, out = Collect(), Collect()
    a = llama.generate(ids, attention_mask=mask, max_new_tokens=12, streamer=ref)
    b = fast.generate(ids, attention_mask=mask, max_new_tokens=12, streamer=out)
    assert torch.equal(a, b)
    assert out.ended and len(out.puts) == len(ref.puts)
    for x, y in zip(ref.puts, out.puts):
        assert torch.equal(x, y)


def test_text_streamer_at_batch_above_one_refuses_as_in_transformers(llama):
    fast = specgraph.compile(llama, "ngram", backend="eager", max_batch_size=4, max_seq_len=96)
    ids, mask = left_pad(PROMPTS[3])

    class Tok:
        def decode(self, *a, **k):
            return ""
    with pytest.raises(ValueError, match="TextStreamer only supports batch size 1"):
        llama.generate(ids, attention_mask=mask, max_new_tokens=3, streamer=TextStreamer(Tok()))
    with pytest.raises(ValueError, match="TextStreamer only supports batch size 1"):
        fast.generate(ids, attention_mask=mask, max_new_tokens=3, streamer=TextStreamer(Tok()))


def test_stopping_criteria_and_stop_strings(llama, char_tokenizer):
    from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList

    class StopAfter(StoppingCriteria):
        def __init__(self, token):
            self.token = token

        def __call__(self, input_ids, scores, **kw):
            return input_ids[:, -1] == self.token

    fast = specgraph.compile(llama, "ngram", backend="eager", max_seq_len=96)
    ids = torch.tensor([rep([11, 42, 7], 9)])
    free = llama.generate(ids, max_new_tokens=20)
    stop = int(free[0, 9 + 6])
    crit = StoppingCriteriaList([StopAfter(stop)])
    ref = llama.generate(ids, max_new_tokens=20, stopping_criteria=crit)
    assert ref.shape[1] < free.shape[1]
    assert torch.equal(fast.generate(ids, max_new_tokens=20, stopping_criteria=crit), ref)
    tok = char_tokenizer()
    text = tok.decode(free[0, 9 + 4: 9 + 6])
    if text.strip():
        ref = llama.generate(ids, max_new_tokens=20, stop_strings=[text], tokenizer=tok)
        assert torch.equal(fast.generate(ids, max_new_tokens=20, stop_strings=[text], tokenizer=tok), ref)
    with pytest.raises(ValueError, match="tokenizer"):
        fast.generate(ids, max_new_tokens=5, stop_strings=["x"])


@pytest.mark.parametrize("kind", ["self", "self-tree"])
def test_scores_and_logits_equal_transformers(llama, kind):
    fast = compile_fast(llama, "llama", kind)
    ids, mask = left_pad(PROMPTS[1])
    kw = dict(max_new_tokens=10, repetition_penalty=1.3, return_dict_in_generate=True, output_scores=True,
              output_logits=True)
    ref = llama.generate(ids, attention_mask=mask, **kw)
    out = fast.generate(ids, attention_mask=mask, **kw)
    assert torch.equal(ref.sequences, out.sequences)
    assert len(out.scores) == len(ref.scores) == len(out.logits) == 10
    for a, b in zip(ref.scores, out.scores):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    for a, b in zip(ref.logits, out.logits):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert fast.stats.accepted > 0


def test_num_return_sequences_with_sampling(llama):
    fast = specgraph.compile(llama, "ngram", backend="eager", max_batch_size=4, max_seq_len=96)
    ids = torch.tensor([[11, 42, 7]])
    out = fast.generate(ids, max_new_tokens=6, do_sample=True, num_return_sequences=3,
                        generator=torch.Generator().manual_seed(0))
    assert out.shape == (3, 9) and torch.equal(out[:, :3], ids.expand(3, 3))
    with pytest.raises(ValueError, match="num_return_sequences"):
        fast.generate(ids, max_new_tokens=6, num_return_sequences=2)


REFUSED = [
    (dict(num_beams=2), "num_beams"),
    (dict(penalty_alpha=0.6, top_k=4), "penalty_alpha"),
    (dict(dola_layers="high"), "dola_layers"),
    (dict(typical_p=0.5, do_sample=True), "typical_p"),
    (dict(epsilon_cutoff=0.1, do_sample=True), "epsilon_cutoff"),
    (dict(guidance_scale=1.5), "guidance_scale"),
    (dict(exponential_decay_length_penalty=(5, 1.1)), "exponential_decay_length_penalty"),
    (dict(output_attentions=True, return_dict_in_generate=True), "output_attentions"),
    (dict(prompt_lookup_num_tokens=3), "prompt_lookup_num_tokens"),
    (dict(logits_processor=LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.2)])), "RepetitionPenalty"),
    (dict(prefix_allowed_tokens_fn=lambda b, ids: [1]), "prefix_allowed_tokens_fn"),
    (dict(renormalize_logits=True, remove_invalid_values=True), "remove_invalid_values"),
]


@pytest.mark.parametrize("kw,name", REFUSED, ids=[n for _, n in REFUSED])
def test_refused_settings_name_themselves(llama, kw, name):
    fast = specgraph.compile(llama, "ngram", backend="eager", max_seq_len=96)
    with pytest.raises(UnsupportedSetting, match=name):
        fast.generate(torch.tensor([[11, 42, 7]]), max_new_tokens=4, **kw)


def test_assistant_model_is_refused(llama):
    fast = specgraph.compile(llama, "ngram", backend="eager", max_seq_len=96)
    with pytest.raises(UnsupportedSetting, match="assistant"):
        fast.generate(torch.tensor([[11, 42, 7]]), max_new_tokens=4, assistant_model=llama)


def test_unknown_keyword_is_a_type_error(llama):
    fast = specgraph.compile(llama, "ngram", backend="eager", max_seq_len=96)
    with pytest.raises(TypeError, match="no_such_setting"):
        fast.generate(torch.tensor([[11, 42, 7]]), max_new_tokens=4, no_such_setting=3)


# ----------------------------------------------------------------------------------------------
# the sampled law with processors, by enumeration

ALPHA = 1e-3
V = 8
PROMPT = [1, 2, 3]
BATCH = 256
N_CALLS = 40  # 10,240 samples
LAW_SETTINGS = {
    "repetition_penalty": (dict(repetition_penalty=2.0), lambda: [RepetitionPenaltyLogitsProcessor(2.0)]),
    "no_repeat_ngram": (dict(no_repeat_ngram_size=2), lambda: [NoRepeatNGramLogitsProcessor(2)]),
}


@pytest.fixture(scope="module")
def sharp():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=0,
                      eos_token_id=0)
    m = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(40.0)
    return m


@torch.no_grad()
def processed_law(model, procs) -> torch.Tensor:
    """P(t1, t2, t3 | PROMPT) [V, V, V], each step through transformers' processor objects."""
    law = torch.zeros(V, V, V, dtype=torch.float64)

    def dist(prefix):
        ids = torch.tensor([prefix])
        x = model(ids).logits[:, -1].float()
        return warped_probs(LogitsProcessorList(procs())(ids, x), temperature=1.0)[0].double()
    p1 = dist(PROMPT)
    for a in range(V):
        p2 = dist(PROMPT + [a])
        for b in range(V):
            law[a, b] = p1[a] * p2[b] * dist(PROMPT + [a, b])
    return law


def sampled_counts(fast, kw, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.tensor([PROMPT] * BATCH)
    counts = torch.zeros(V, V, V, dtype=torch.float64)
    for _ in range(N_CALLS):
        new = fast.generate(ids, max_new_tokens=3, do_sample=True, top_k=None, generator=g, eos_token_id=[],
                            pad_token_id=0, **kw)[:, len(PROMPT):]
        counts.view(-1).index_add_(0, new[:, 0] * V * V + new[:, 1] * V + new[:, 2], torch.ones(BATCH, dtype=torch.float64))
    return counts


@pytest.mark.parametrize("kind", ["self", "self-tree"])
@pytest.mark.parametrize("name", sorted(LAW_SETTINGS))
def test_sampled_law_with_processors_matches_transformers(sharp, name, kind):
    kw, procs = LAW_SETTINGS[name]
    fast = specgraph.compile(sharp, sharp, num_speculative_tokens=2, tree=[(0,), (1,), (0, 0)] if kind == "self-tree"
                             else None, backend="eager", max_batch_size=BATCH, max_seq_len=32)
    counts = sampled_counts(fast, kw, seed=1)
    assert fast.stats.accepted > 0
    p = gof_pvalue(counts, processed_law(sharp, procs))
    assert p > ALPHA, f"{name} {kind}: p = {p:.2e}"


def test_negative_control_processors_on_the_committed_prefix_only_are_rejected(sharp, monkeypatch):
    """Processors that see only the committed prefix at every drafted position (what a round that
    ignored its drafted path would apply) give another law: the same test rejects it."""
    def committed_only(drafts):
        B, K = drafts.shape
        return drafts.unsqueeze(1).expand(B, K + 1, K), torch.zeros(B, K + 1, dtype=torch.long)
    monkeypatch.setattr(sg_rounds, "chain_paths", committed_only)
    kw, procs = LAW_SETTINGS["repetition_penalty"]
    fast = specgraph.compile(sharp, sharp, num_speculative_tokens=2, backend="eager", max_batch_size=BATCH,
                             max_seq_len=32)
    p = gof_pvalue(counts := sampled_counts(fast, kw, seed=1), processed_law(sharp, procs))
    assert counts.sum() > 0 and p < ALPHA, f"the control was not rejected: p = {p:.2e}"


def test_negative_control_greedy(monkeypatch):
    """The greedy matrix fails too when the drafted path is hidden from the processors."""
    monkeypatch.setattr(sg_rounds, "chain_paths", lambda d: (d.unsqueeze(1).expand(d.shape[0], d.shape[1] + 1, d.shape[1]),
                                                              torch.zeros(d.shape[0], d.shape[1] + 1, dtype=torch.long)))
    model = tiny_model("llama")
    fast = compile_fast(model, "llama", "self")
    ids, mask = left_pad(PROMPTS[1])
    kw = SETTINGS["no_repeat_ngram"]
    assert not torch.equal(model.generate(ids, attention_mask=mask, **kw), fast.generate(ids, attention_mask=mask, **kw))


# ----------------------------------------------------------------------------------------------
# models refused at compile


def test_encoder_decoder_models_are_refused_at_compile():
    from transformers import BartConfig, BartForConditionalGeneration, T5Config, T5ForConditionalGeneration

    t5 = T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16))
    bart = BartForConditionalGeneration(BartConfig(vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1,
                                                   encoder_attention_heads=2, decoder_attention_heads=2,
                                                   encoder_ffn_dim=64, decoder_ffn_dim=64))
    for m in (t5, bart):
        with pytest.raises(ValueError, match="encoder-decoder"):
            specgraph.compile(m.eval(), "ngram", backend="eager")


def test_meta_device_models_are_refused_at_compile():
    cfg = AutoConfig.for_model("llama", **TINY["llama"])
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ValueError, match="meta"):
        specgraph.compile(m.eval(), "ngram", backend="eager")
    with pytest.raises(ValueError, match="meta"):
        specgraph.compile(tiny_model("llama"), m.eval(), backend="eager")


@pytest.mark.parametrize("kind", ["self", "self-tree"])
@pytest.mark.parametrize("sample", [False, True])
def test_output_logprobs_are_the_log_softmax_of_the_scores(llama, kind, sample):
    """``output_logprobs=n``: each emitted token's log-probability and the top-n of its position,
    computed in the round, equal the log-softmax of the scores transformers reports."""
    fast = compile_fast(llama, "llama", kind)
    ids, mask = left_pad(PROMPTS[3])
    kw = dict(max_new_tokens=8, repetition_penalty=1.3, output_logprobs=3, output_scores=True)
    if sample:
        kw.update(do_sample=True, temperature=0.7, top_k=20, generator=torch.Generator().manual_seed(0))
    out = fast.generate(ids, attention_mask=mask, **kw)
    new = out.sequences[:, ids.shape[1]:]
    for s, (score, lp, top, top_ids) in enumerate(zip(out.scores, out.logprobs, out.top_logprobs, out.top_tokens)):
        ref = torch.log_softmax(score, dim=-1)
        live = ~torch.isnan(lp)
        assert live.any()
        torch.testing.assert_close(lp[live], ref[live].gather(1, new[live, s:s + 1]).squeeze(1), rtol=1e-5, atol=1e-5)
        want = ref[live].topk(3, dim=-1)
        torch.testing.assert_close(top[live], want.values, rtol=1e-5, atol=1e-5)
    if not sample:  # greedy: the chosen token is the most likely one
        assert torch.equal(out.top_tokens[0][:, 0], new[:, 0])


def test_warmup_with_a_generation_config_builds_the_processor_rounds(llama):
    """After ``fast.warmup(generation_config=...)`` requests with those processors build nothing
    (a build inside generate would warn: here that warning is an error)."""
    import warnings

    fast = specgraph.compile(llama, "ngram", backend="eager", max_seq_len=96, modes=("greedy",))
    fast.warmup(("greedy",), progress=False, generation_config=GenerationConfig(repetition_penalty=1.3))
    built = dict(fast.graphs_built)
    ids = torch.tensor([rep([11, 42, 7], 9)])
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*inside generate.*")
        out = fast.generate(ids, max_new_tokens=20, repetition_penalty=1.3)
    assert torch.equal(out, llama.generate(ids, max_new_tokens=20, repetition_penalty=1.3))
    assert fast.graphs_built == built


@pytest.mark.parametrize("tree", [None, [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]], ids=["chain", "tree"])
def test_eagle_greedy_equals_model_generate_under_processors(tree):
    model = tiny_model("llama")
    fast = specgraph.compile(model, random_head(model, "eagle"), num_speculative_tokens=3, tree=tree, backend="eager",
                             max_batch_size=4, max_seq_len=96)
    for B, rows in PROMPTS.items():
        ids, mask = left_pad(rows)
        for name in ("repetition_penalty", "no_repeat_ngram", "everything"):
            kw = SETTINGS[name]
            ref = model.generate(ids, attention_mask=mask, **kw)
            assert torch.equal(fast.generate(ids, attention_mask=mask, **kw), ref), f"EAGLE B={B} {name}"


@pytest.mark.parametrize("name", ["repetition_penalty", "no_repeat_ngram", "everything"])
def test_draft_model_proposals_go_through_the_processors(name, monkeypatch):
    """The target drafting for itself accepts every draft under logits processors: its proposals
    are processed with the prefix each assumes, as the target's verification is. Negative control:
    unprocessed proposals are rejected where the processors change the argmax (output still exact)."""
    model = tiny_model("llama")
    fast = compile_fast(model, "llama", "self")
    ids, mask = left_pad(PROMPTS[3])
    kw = SETTINGS[name]
    ref = model.generate(ids, attention_mask=mask, **kw)
    assert torch.equal(fast.generate(ids, attention_mask=mask, **kw), ref)
    assert fast.stats.accepted == fast.stats.drafted > 0, fast.stats

    orig = DraftModelProposer.propose

    def unprocessed(self, *args):
        self.engine.draft_processors = (None, ())
        return orig(self, *args)
    monkeypatch.setattr(DraftModelProposer, "propose", unprocessed)
    assert torch.equal(fast.generate(ids, attention_mask=mask, **kw), ref)
    assert fast.stats.accepted < fast.stats.drafted, fast.stats


def test_custom_entries_of_a_model_generation_config_are_ignored_as_transformers_does():
    model = tiny_model("llama")
    model.generation_config.update(my_custom_entry=3, allow_custom_entries=True)
    fast = specgraph.compile(model, "ngram", backend="eager", max_seq_len=96)
    ids = torch.tensor([[11, 42, 7]])
    assert torch.equal(fast.generate(ids, max_new_tokens=5), model.generate(ids, max_new_tokens=5))


def test_prompt_by_either_name(llama):
    fast = specgraph.compile(llama, "ngram", backend="eager", max_seq_len=96)
    ids = torch.tensor([[11, 42, 7]])
    ref = llama.generate(inputs=ids, max_new_tokens=5)
    assert torch.equal(fast.generate(inputs=ids, max_new_tokens=5), ref)
    assert torch.equal(fast.generate(input_ids=ids, max_new_tokens=5), ref)
    with pytest.raises(ValueError, match="input_ids"):
        fast.generate(max_new_tokens=5)


# ----------------------------------------------------------------------------------------------
# inputs as transformers sees them


def test_processors_and_criteria_see_the_input_rows_as_given():
    """Padding tokens other than the configured pad id, a left-padded input without an attention
    mask (transformers infers it from the pad id), and a batch whose rows end by a criterion with
    no EOS (transformers keeps decoding them until every row has ended): all equal HF."""
    from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList

    model = tiny_model("llama")
    fast = specgraph.compile(model, "ngram", backend="eager", max_batch_size=4, max_seq_len=96)
    rows = [rep([11, 42, 7, 93], 10), [50, 9, 50, 9, 60]]
    ids, mask = left_pad(rows)
    zeros = ids.masked_fill(mask == 0, 0)  # padded with 0, the model's pad id is PAD
    for kw in (dict(no_repeat_ngram_size=1), dict(sequence_bias={(0, 0, 60): 20.0})):
        assert torch.equal(fast.generate(zeros, attention_mask=mask, max_new_tokens=12, **kw),
                           model.generate(zeros, attention_mask=mask, max_new_tokens=12, **kw)), kw
    assert torch.equal(fast.generate(ids, max_new_tokens=12), model.generate(ids, max_new_tokens=12))

    class StopOn(StoppingCriteria):
        def __call__(self, input_ids, scores, **kw):
            return input_ids[:, -1] == 105

    crit = StoppingCriteriaList([StopOn()])
    kw = dict(attention_mask=mask, max_new_tokens=12, eos_token_id=None, stopping_criteria=crit)
    assert torch.equal(fast.generate(ids, **kw), model.generate(ids, **kw))


def test_streamer_gets_the_expanded_prompt_with_num_return_sequences(llama):
    fast = specgraph.compile(llama, "ngram", backend="eager", max_batch_size=4, max_seq_len=96)
    ids = torch.tensor([[11, 42, 7, 93, 11]])
    shapes = {}
    for name, gen in (("hf", llama), ("sg", fast)):
        s = Collect()
        gen.generate(ids, max_new_tokens=3, do_sample=True, num_return_sequences=2, streamer=s,
                     **({"generator": torch.Generator().manual_seed(0)} if name == "sg" else {}))
        shapes[name] = [tuple(p.shape) for p in s.puts]
    assert shapes["sg"] == shapes["hf"]


def test_processor_graphs_do_not_depend_on_the_prompt_or_unrelated_eos(llama):
    from specgraph.generation import resolve

    fast = specgraph.compile(llama, "ngram", backend="eager", max_seq_len=96)
    cfg = GenerationConfig(repetition_penalty=1.2, forced_bos_token_id=3, min_new_tokens=4)
    spec = fast.logits_spec(cfg)
    for T in (2, 7, 30):
        assert resolve(llama, torch.ones(1, T, dtype=torch.long), cfg).logits == spec
    no_min = GenerationConfig(repetition_penalty=1.2)
    assert resolve(llama, torch.ones(1, 5, dtype=torch.long), no_min, eos_token_id=9).logits == fast.logits_spec(no_min)


def test_quantized_cache_is_refused(llama):
    fast = specgraph.compile(llama, "ngram", backend="eager", max_seq_len=96)
    with pytest.raises(UnsupportedSetting, match="quantized"):
        fast.generate(torch.tensor([[11, 42, 7]]), max_new_tokens=4, cache_implementation="quantized")
