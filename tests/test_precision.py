"""``compile(model, weights=...)``: the target is the model at that precision.

The quantized layers equal their dequantized reference; greedy output of the compiled object
equals HF ``generate`` on ``specgraph.quantize(model, weights)`` (``fast.model``) on tiny models
of several families, through the eager graphs and through Inductor; sampled output follows the
quantized model's law (chi-square by enumeration, significance ALPHA). Negative controls: the
greedy test fails for a layer whose rows depend on the batch and against the unquantized model,
and the law test rejects the full-precision model's law.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import specgraph
from specgraph import gguf_weights, precision
from specgraph.precision import BF16Linear, Int4Linear, Int8Linear, quantize
from test_architectures import tiny as tiny_family

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore:specgraph. weights=:UserWarning")

PROMPT = torch.tensor([[5, 9, 13, 9, 13, 9, 13, 21]])
NEW = 40


def greedy(model_or_fast, ids=PROMPT):
    return model_or_fast.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=[], pad_token_id=0)


# ---------------------------------------------------------------------------------------------
# the layers


@pytest.mark.parametrize("cls", [Int8Linear, Int4Linear, BF16Linear])
def test_quantized_layer_equals_its_dequantized_weight(cls):
    torch.manual_seed(0)
    w, b = torch.randn(64, 96) * 0.1, torch.randn(64)
    layer = BF16Linear(w, b) if cls is BF16Linear else cls.quantize(w, b)
    x = torch.randn(5, 3, 96)
    ref = x.bfloat16().float() @ layer.dequantized().t() + b
    y = layer(x)
    assert y.shape == (5, 3, 64) and y.dtype == torch.float32  # fp32 in, bf16 kernel, fp32 out
    torch.testing.assert_close(y, ref, atol=0.05, rtol=0.02)
    # and the dequantized weight is the weight, to within the format's step
    step = {Int8Linear: 2 * w.abs().max() / 127, Int4Linear: (w.max() - w.min()) / 15,
            BF16Linear: w.abs().max() * 2.0**-8}[cls]
    assert (layer.dequantized() - w).abs().max() <= step


@pytest.mark.parametrize("cls", [Int8Linear, Int4Linear, BF16Linear])
def test_quantized_layer_rows_do_not_depend_on_the_batch(cls):
    """A verify round computes K+1 positions in one call where ``generate`` computes one: the
    layer must give each row the same bits either way."""
    torch.manual_seed(1)
    w = torch.randn(64, 96)
    layer = BF16Linear(w, None) if cls is BF16Linear else cls.quantize(w, None)
    x = torch.randn(16, 96)
    assert torch.equal(layer(x), torch.cat([layer(x[i:i + 1]) for i in range(16)]))


def test_int4_weights_are_within_half_a_step():
    """The kernel reads scales and offsets in bf16: codes rounded against the rounded values keep
    every weight within half a step of the original, plus the bf16 rounding of its value."""
    torch.manual_seed(2)
    w = torch.randn(32, 64) * 0.02 + 0.3  # offsets far from 0: their bf16 rounding is large
    blocks = w.reshape(32, 2, 32)
    step = (blocks.amax(-1) - blocks.amin(-1))[..., None] / 15
    err = (Int4Linear.quantize(w, None).dequantized() - w).abs().reshape(32, 2, 32)
    assert (err <= step / 2 + blocks.abs() * 2.0**-8).all()


def test_quantize_leaves_the_model_alone_and_marks_the_copy():
    model = tiny_family("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    q = quantize(model, "int8")
    assert q is not model and precision.as_given(q) == "int8" and precision.as_given(model) == "float32"
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert type(model.lm_head) is nn.Linear and type(q.lm_head) is Int8Linear
    assert quantize(model, "float32") is model and quantize(q, "int8") is q
    with pytest.raises(ValueError, match="already at weights='int8'"):
        quantize(q, "int4")
    with pytest.raises(ValueError, match="weights must be one of"):
        gguf_weights.resolve("int3", model)
    with pytest.raises(ValueError, match="GGUF"):
        gguf_weights.model_at(model, "native")


def test_int4_leaves_layers_the_kernel_cannot_take_in_bf16():
    model = tiny_family("gpt2")  # Conv1D layers ([K, N] weights), 64 -> 192 / 256 / 64; vocab 128
    q = quantize(model, "int4")
    kinds = {type(m).__name__ for m in q.modules()}
    assert "Int4Linear" in kinds and "Conv1D" not in kinds and "Linear" not in kinds
    assert not Int4Linear.fits(24, 64) and not Int4Linear.fits(32, 48)  # 24 outputs; 48 inputs
    model = tiny_family("llama")
    model.model.layers[0].mlp.up_proj = nn.Linear(64, 24, bias=False)
    model.model.layers[0].mlp.down_proj = nn.Linear(24, 64, bias=False)
    model.model.layers[0].mlp.gate_proj = nn.Linear(64, 24, bias=False)
    q = quantize(model, "int4")
    assert type(q.model.layers[0].mlp.up_proj) is BF16Linear
    assert type(q.model.layers[1].mlp.up_proj) is Int4Linear


# ---------------------------------------------------------------------------------------------
# greedy output equals HF generate on the quantized model


@pytest.mark.parametrize("family, weights", [("llama", "bfloat16"), ("llama", "int8"), ("llama", "int4"),
                                             ("qwen2", "int8"), ("gpt_neox", "int4"), ("gpt2", "int8"),
                                             ("phi3", "int4")])
def test_greedy_equals_hf_on_the_quantized_model_eager(family, weights):
    model = tiny_family(family)
    ref = greedy(quantize(model, weights))
    fast = specgraph.compile(model, "ngram", weights=weights, backend="eager", max_seq_len=128)
    assert fast.weights == weights and precision.as_given(fast.model) == weights
    assert torch.equal(greedy(fast), ref)
    assert torch.equal(greedy(specgraph.compile(model, None, weights=weights, backend="eager", max_seq_len=128)), ref)


@pytest.mark.parametrize("weights", ["bfloat16", "int8", "int4"])
def test_greedy_equals_hf_on_the_quantized_model_inductor(weights):
    model = tiny_family("llama")
    fast = specgraph.compile(model, "ngram", weights=weights, cache=False, max_batch_size=2, max_seq_len=128,
                             modes=("greedy",), progress=False)
    assert not fast.freeze and not any(fast.graph_frozen.values())  # one copy of the weights
    q = fast.model
    ids = torch.tensor([[5, 9, 13, 9, 13, 9, 13, 21], [7, 7, 3, 8, 1, 2, 7, 7]])
    assert torch.equal(greedy(fast, ids), greedy(q, ids))


def test_negative_control_a_batch_dependent_layer_breaks_equality(monkeypatch):
    """The risk a low-precision kernel brings: rows that depend on how many rows share the call
    (a round verifies K+1 positions at once, ``generate`` decodes one). A layer that shifts its
    output when it sees several rows makes the equality test fail."""
    model = tiny_family("llama")
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 1, 2, 3, 4]])
    kw = dict(max_new_tokens=60, do_sample=False, eos_token_id=[], pad_token_id=0)
    forward = Int8Linear.forward

    def batch_dependent(self, x):
        y = forward(self, x)
        return y + 0.5 * (x.reshape(-1, x.shape[-1]).shape[0] in range(2, 6))  # a round's 2..5 positions

    monkeypatch.setattr(Int8Linear, "forward", batch_dependent)  # before the step is captured
    fast = specgraph.compile(model, "ngram", weights="int8", backend="eager", max_seq_len=128)
    assert fast.stats is not None
    assert not torch.equal(fast.generate(ids, **kw), fast.model.generate(ids, **kw))


def test_negative_control_the_unquantized_model_is_not_the_reference():
    model = tiny_family("llama")
    fast = specgraph.compile(model, "ngram", weights="int4", backend="eager", max_seq_len=256)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 1, 2, 3, 4]])
    kw = dict(max_new_tokens=120, do_sample=False, eos_token_id=[], pad_token_id=0)
    assert not torch.equal(fast.generate(ids, **kw), model.generate(ids, **kw))


# ---------------------------------------------------------------------------------------------
# sampled output follows the quantized model's law


def test_sampled_law_is_the_quantized_models():
    """Three-token continuations of a tiny int4 target (vocab 8) drafted by a draft model, against
    the law of ``quantize(target, "int4")`` enumerated with full forwards (chi-square, ALPHA).
    Negative control: the same counts against the fp32 target's law are rejected."""
    from law import gof_pvalue
    from test_compile_sampling import ALPHA, exact_law, sampled_counts, tiny as tiny_law

    target, draft = tiny_law(0, 2, 40.0), tiny_law(1, 1, 25.0)
    q = quantize(target, "int4")
    settings = dict(temperature=1.0)
    fast = specgraph.compile(target, draft, weights="int4", num_speculative_tokens=2, backend="eager",
                             max_batch_size=256, max_seq_len=32)
    counts = sampled_counts(fast, settings, seed=7)
    p = gof_pvalue(counts, exact_law(q, settings))
    assert p > ALPHA, f"int4 target: chi-square p = {p:.2e}"
    assert 0 < fast.stats.accepted < fast.stats.drafted
    p_fp32 = gof_pvalue(counts, exact_law(target, settings))
    assert p_fp32 < ALPHA, f"negative control not detected: p = {p_fp32:.3g}"


# ---------------------------------------------------------------------------------------------
# draft="self-int4": the target's own weights at int4 draft for it


@pytest.mark.parametrize("weights, backend", [("float32", "eager"), ("int8", "eager"), ("bfloat16", "inductor")])
def test_self_int4_drafts_for_the_model_at_its_precision(weights, backend):
    model = tiny_family("llama")
    kw = dict(cache=False, modes=("greedy",), progress=False) if backend == "inductor" else {}
    fast = specgraph.compile(model, "self-int4", weights=weights, backend=backend, max_batch_size=1,
                             max_seq_len=128, **kw)
    assert fast.draft == "model" and as_int4(fast.draft_model)
    target_tensors = {t.data_ptr() for t in (*fast.model.parameters(), *fast.model.buffers())}
    assert fast.draft_model.model.embed_tokens.weight.data_ptr() in target_tensors  # shared, not copied
    assert torch.equal(greedy(fast), greedy(fast.model))
    assert 0 < fast.stats.accepted <= fast.stats.drafted


def as_int4(model) -> bool:
    return precision.as_given(model) == "int4" and any(isinstance(m, Int4Linear) for m in model.modules())


def test_self_int4_needs_a_target_above_int4():
    model = tiny_family("llama")
    with pytest.raises(ValueError, match="int4 already"):
        specgraph.compile(model, "self-int4", weights="int4", backend="eager", max_seq_len=128)


def test_graph_cache_packages_read_the_one_copy(tmp_path, monkeypatch):
    """Unfrozen packages of an int4 object: code only, bound at load to ``fast.model``'s buffers;
    a second compile loads them, and both equal HF generate on the quantized model."""
    monkeypatch.setenv("SPECGRAPH_BUILD_HELPER", "off")
    model = tiny_family("llama")
    kw = dict(weights="int4", cache=tmp_path / "graphs", max_batch_size=1, max_seq_len=128, modes=("greedy",), progress=False,
              warmup=True)
    fast = specgraph.compile(model, "ngram", **kw)
    assert not fast.graph_cache["hit"] and fast.graph_cache["built"] >= 1 and fast.graph_cache["frozen"] == 0
    again = specgraph.compile(model, "ngram", **kw)
    assert again.graph_cache["hit"] and again.graph_cache["loaded"] == fast.graph_cache["loaded"]
    ref = greedy(fast.model)
    assert torch.equal(greedy(fast), ref) and torch.equal(greedy(again), ref)
