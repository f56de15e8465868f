"""Decoder families on the compiled path, greedy-equal to ``model.generate`` well past any sliding
window, with prompt lookup and with a draft model of the same family; the sliding-window pass
tested by parity, match count and a negative control (without it, mixed-window models differ)."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import specgraph
import specgraph.compiler as sg_compiler
from specgraph.capture import capture_step, layer_windows
from specgraph.passes import run_step_pipeline

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              vocab_size=128, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)
GQA = dict(num_key_value_heads=2, head_dim=16)  # families with grouped-query attention
NO_GQA = {"gpt_neox", "opt", "gpt2", "gptj", "gpt_bigcode", "falcon", "bloom"}
W = 8
FAMILIES = {
    "llama": {}, "qwen3": {}, "gemma": {}, "cohere": {}, "olmo": {}, "olmo2": {}, "granite": {}, "helium": {},
    "glm": {}, "smollm3": {}, "stablelm": {}, "phi": {},
    "gpt_neox": dict(rotary_pct=0.25), "opt": dict(ffn_dim=128, word_embed_proj_dim=64, pad_token_id=1),
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_positions=256), "falcon": dict(new_decoder_architecture=False, multi_query=False),
    "mistral": dict(sliding_window=W), "ministral": dict(sliding_window=W),
    "qwen2": dict(use_sliding_window=True, sliding_window=W, max_window_layers=1),
    "gemma3_text": dict(sliding_window=W, sliding_window_pattern=2), "cohere2": dict(sliding_window=W),
    "gemma2": dict(sliding_window=W),  # soft-capped attention: transformers runs it with eager attention
    "starcoder2": dict(sliding_window=W), "phi3": dict(sliding_window=W),
    "mixtral": dict(sliding_window=W, num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, decoder_sparse_step=1),
}
PROMPT = [[5, 9, 13, 9, 13, 9, 13, 21]]
NEW = 52  # past the window of 8 several times over


def tiny(family: str, seed: int = 0, attn: str = "sdpa"):
    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(family, **{**COMMON, **({} if family in NO_GQA else GQA), **FAMILIES[family]})
    try:
        return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float32).eval()
    except ValueError:  # no SDPA attention in this family (Gemma 2): transformers' eager attention
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32).eval()


def greedy(fast_or_model, ids):
    return fast_or_model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=[], pad_token_id=0)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_runs_compiled_and_equals_hf(family):
    model = tiny(family)
    ids = torch.tensor(PROMPT)
    ref = greedy(model, ids)
    for draft in ("ngram", tiny(family, seed=1)):
        fast = specgraph.compile(model, draft, backend="eager", max_seq_len=128)
        assert fast.fallback_reason is None, fast.fallback_reason
        assert torch.equal(greedy(fast, ids), ref), f"{family} draft={draft if isinstance(draft, str) else 'model'}"


@pytest.mark.parametrize("family", ["qwen2", "gemma3_text", "cohere2"])
def test_mixed_window_batch_and_tree_equal_hf(family):
    model = tiny(family)
    rows = [[5, 9, 13, 9, 13, 9, 13, 21, 30, 31, 32], [7, 7, 8]]
    ids = torch.full((2, 11), 0)
    mask = torch.zeros(2, 11, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, 11 - len(r):], mask[b, 11 - len(r):] = torch.tensor(r), 1
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, eos_token_id=[], pad_token_id=0)
    fast = specgraph.compile(model, "ngram", tree=[(0,), (1,), (0, 0)], backend="eager", max_batch_size=2, max_seq_len=96)
    out = fast.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, eos_token_id=[], pad_token_id=0)
    assert torch.equal(out, ref)


def test_sliding_window_pass_parity_and_count():
    model = tiny("qwen2")
    windows = layer_windows(model)
    assert windows == (["full_attention", "sliding_attention"], W) or windows[1] == W
    gm, counts = run_step_pipeline(capture_step(model, 1, 3, 64), windows)
    assert counts["sliding_window_pass"] == windows[0].count("sliding_attention") >= 1
    # parity with the unmodified model over a sequence longer than the window
    seq = torch.randint(3, 100, (1, 30))
    with torch.no_grad():
        full = model(seq).logits[0, -3:]
        from specgraph.capture import Step, new_kv_cache

        kv = new_kv_cache(model, 1, 64)
        pos = torch.arange(27).unsqueeze(0)
        s = torch.arange(64)
        mask = torch.where(s.view(1, 1, 1, -1) <= pos.view(1, 1, -1, 1), 0.0, float("-inf"))
        Step(model)(seq[:, :27], pos, mask, pos, *kv)
        pos = torch.arange(27, 30).unsqueeze(0)
        mask = torch.where(s.view(1, 1, 1, -1) <= pos.view(1, 1, -1, 1), 0.0, float("-inf"))
        logits, _ = gm(seq[:, 27:], pos, mask, pos, *kv)
    torch.testing.assert_close(logits[0], full, rtol=1e-4, atol=1e-4)


def test_negative_control_without_the_window_pass_mixed_models_differ(monkeypatch):
    """Mixed-window models attend full-width in every layer without the pass: past the window the
    output is no longer HF's."""
    monkeypatch.setattr(sg_compiler, "layer_windows", lambda model: None)
    model = tiny("qwen2")
    ids = torch.tensor(PROMPT)
    fast = specgraph.compile(model, "ngram", backend="eager", max_seq_len=128)
    assert not torch.equal(greedy(fast, ids), greedy(model, ids))


def test_inductor_mixed_windows_equal_hf():
    model = tiny("qwen2")
    ids = torch.tensor(PROMPT)
    fast = specgraph.compile(model, "ngram", backend="inductor", max_seq_len=128, modes=("greedy",), cache=False)
    assert fast.fallback_reason is None
    assert torch.equal(greedy(fast, ids), greedy(model, ids))


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2", "mistral"])
def test_eager_attention_runs_compiled_and_equals_hf(family):
    """transformers' eager attention adds the step's prepared float mask to its scores: compiled,
    every round attending the whole cache (its key length is fixed in the graph)."""
    model = tiny(family, attn="eager")
    assert model.config._attn_implementation == "eager"
    ids = torch.tensor(PROMPT)
    ref = greedy(model, ids)
    for draft in ("ngram", tiny(family, seed=1, attn="eager"), tiny(family, seed=1)):
        fast = specgraph.compile(model, draft, backend="eager", max_seq_len=96)
        assert fast.fallback_reason is None and fast.full_width
        assert torch.equal(greedy(fast, ids), ref), family


def bloom(seed: int = 0):
    torch.manual_seed(seed)
    cfg = AutoConfig.for_model("bloom", hidden_size=64, n_layer=2, n_head=4, vocab_size=128, initializer_range=0.2)
    return AutoModelForCausalLM.from_config(cfg).eval()


def test_alibi_runs_compiled_chains_and_equals_hf():
    """Bloom's ALiBi biases count cache slots, which are positions for committed keys and chain
    drafts: compiled chains (prompt lookup, a draft model, the target drafting for itself) equal HF
    in a left-padded batch; trees are refused."""
    model = bloom()
    rows = [[5, 9, 13, 9, 13, 9, 13, 21, 30, 40, 50], [7, 8, 9]]
    ids = torch.zeros(2, 11, dtype=torch.long)
    mask = torch.zeros(2, 11, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, 11 - len(r):], mask[b, 11 - len(r):] = torch.tensor(r), 1
    kw = dict(max_new_tokens=40, do_sample=False, eos_token_id=[], pad_token_id=0)
    ref = model.generate(ids, attention_mask=mask, **kw)
    for draft in ("ngram", bloom(1), model):
        fast = specgraph.compile(model, draft, backend="eager", max_batch_size=2, max_seq_len=96)
        assert fast.fallback_reason is None and fast.full_width
        assert torch.equal(fast.generate(ids, attention_mask=mask, **kw), ref)
    assert fast.stats.accepted == fast.stats.drafted > 0  # self-drafting: a bias or mask bug shows as rejections
    with pytest.raises(ValueError, match="ALiBi"):
        specgraph.compile(model, "ngram", tree=[(0,), (1,)], backend="eager", max_seq_len=96)


def test_negative_control_alibi_with_the_model_built_mask_differs(monkeypatch):
    """Keeping the model's own causal mask (built for a fresh sequence: it knows nothing of the
    committed slots) instead of pointing the score masks at the step's mask: output leaves HF's."""
    import specgraph.passes.attention as attention

    monkeypatch.setattr(attention, "mask_reaches_every_softmax", lambda graph, mask: True)
    model = bloom()
    fast = specgraph.compile(model, "ngram", backend="eager", max_seq_len=96)
    kw = dict(max_new_tokens=30, do_sample=False, eos_token_id=[], pad_token_id=0)
    ids = torch.tensor([[5, 9, 13, 9, 13, 9, 13, 21, 30, 40, 50]])
    assert not torch.equal(fast.generate(ids, **kw), model.generate(ids, **kw))


def test_eager_fallback_runs_past_the_window(monkeypatch):
    """The eager fallback crops a full-length cache: past a sliding window it runs and equals HF
    (a cache of sliding layers cannot be cropped back past its window)."""
    from specgraph.capture import UnsupportedModel

    def refuse(model):
        raise UnsupportedModel("forced fallback")
    monkeypatch.setattr(sg_compiler, "check_supported", refuse)
    model = tiny("qwen2")
    fast = specgraph.compile(model, "ngram", backend="eager", max_seq_len=128)
    assert fast.fallback_reason == "forced fallback"
    ids = torch.tensor(PROMPT)
    assert torch.equal(greedy(fast, ids), greedy(model, ids))


def test_inductor_eager_attention_equals_hf():
    """Gemma 2 (eager attention, soft-capping, mixed windows) under Inductor: full-width rounds."""
    model = tiny("gemma2")
    ids = torch.tensor(PROMPT)
    fast = specgraph.compile(model, "ngram", backend="inductor", max_seq_len=96, modes=("greedy",), cache=False)
    assert fast.fallback_reason is None and fast.full_width and fast.graph_cache is None
    assert torch.equal(greedy(fast, ids), greedy(model, ids))


def test_eager_attention_with_a_router_softmax_runs_compiled():
    """Mixtral with eager attention: the MoE router's softmax is not a layer's attention; the check
    finds one masked score softmax per layer and the model runs compiled, equal to HF."""
    model = tiny("mixtral", attn="eager")
    fast = specgraph.compile(model, "ngram", backend="eager", max_seq_len=96)
    assert fast.fallback_reason is None and fast.full_width
    ids = torch.tensor(PROMPT)
    assert torch.equal(greedy(fast, ids), greedy(model, ids))


def test_eager_attention_whose_mask_cannot_be_traced_falls_back(monkeypatch):
    """When the check cannot see the step's mask reach every layer's scores, compile falls back to
    the eager path with the reason (exact), instead of failing later."""
    import specgraph.passes.attention as attention

    monkeypatch.setattr(attention, "mask_reaches_every_softmax", lambda graph, mask: False)
    monkeypatch.setattr(attention, "_point_score_masks", lambda graph, mask: 0)
    model = tiny("llama", attn="eager")
    with pytest.warns(UserWarning, match="falling back"):
        fast = specgraph.compile(model, "ngram", backend="eager", max_seq_len=96)
    assert "softmax" in fast.fallback_reason
    ids = torch.tensor(PROMPT)
    assert torch.equal(greedy(fast, ids), greedy(model, ids))
