"""``compile(model, weights=...)``: the target is the model at that precision.

The quantized layers are fp32 math on their dequantized weights, and the compiled forms of
:mod:`specgraph.kernels.dequant_linear` equal it to fp32 rounding; greedy output of the compiled object
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
from specgraph.kernels import dequant_linear
from specgraph.precision import BF16Linear, Int4Linear, Int8Linear, quantize
from test_architectures import tiny as tiny_family

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

PROMPT = torch.tensor([[5, 9, 13, 9, 13, 9, 13, 21]])
NEW = 40


def greedy(model_or_fast, ids=PROMPT):
    return model_or_fast.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=[], pad_token_id=0)


# ---------------------------------------------------------------------------------------------
# the layers


def layer_of(cls, w, b):
    return BF16Linear(w, b) if cls is BF16Linear else cls.quantize(w, b)


@pytest.mark.parametrize("cls", [Int8Linear, Int4Linear, BF16Linear])
def test_quantized_layer_is_fp32_math_on_its_dequantized_weight(cls):
    """The layer (the op's eager kernel, what ``generate`` runs) is exactly ``F.linear`` of the fp32
    input with the dequantized weight: no activation is rounded."""
    torch.manual_seed(0)
    w, b = torch.randn(64, 128) * 0.1, torch.randn(64)
    layer = layer_of(cls, w, b)
    x = torch.randn(5, 3, 128)
    y = layer(x)
    assert y.shape == (5, 3, 64) and y.dtype == torch.float32
    assert torch.equal(y, nn.functional.linear(x, layer.dequantized()) + b)
    # negative control: rounding the input to bf16 (the CPU's bf16-input kernels) is detected
    assert not torch.equal(y, nn.functional.linear(x.bfloat16().float(), layer.dequantized()) + b)
    # and the dequantized weight is the weight, to within the format's step
    step = {Int8Linear: 2 * w.abs().max() / 127, Int4Linear: (w.max() - w.min()) / 15,
            BF16Linear: w.abs().max() * 2.0**-8}[cls]
    assert (layer.dequantized() - w).abs().max() <= step


@pytest.mark.parametrize("fmt", dequant_linear.FORMATS)
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_compiled_forms_equal_the_reference_to_fp32_rounding(fmt, rows):
    """The rows form (a reduction per output) and the dense form (dequantize, then a GEMM) compute
    the op in fp32: equal to the fp64 product of the same numbers to fp32 rounding, in eager and
    through Inductor. Negative control: the bf16-input product is outside that tolerance."""
    torch.manual_seed(3)
    cls = {"int8": Int8Linear, "int4": Int4Linear, "bf16": BF16Linear}[fmt]
    layer = layer_of(cls, torch.randn(48, 192), None)
    x = torch.randn(rows, 192)
    exact = (x.double() @ layer.dequantized().double().t()).float()
    tol = dict(atol=1e-4, rtol=1e-5)
    for form in (dequant_linear.rows_form(fmt), dequant_linear.dense_form(fmt)):
        torch.testing.assert_close(form(x, *layer.stored()), exact, **tol)
        torch.testing.assert_close(torch.compile(form, dynamic=False)(x, *layer.stored()), exact, **tol)
    if rows > 1:  # a dynamic row count (a dynamic-batch graph): the broadcast rows form
        dynamic = torch.compile(dequant_linear.rows_form(fmt), dynamic=True)
        torch.testing.assert_close(dynamic(x, *layer.stored()), exact, **tol)
    rounded = (x.bfloat16().double() @ layer.dequantized().double().t()).float()
    assert not torch.allclose(rounded, exact, **tol)


def test_dequant_linear_pass_counts_and_parity():
    """The pass replaces every quantized linear of a captured int8 step (7 per layer + the head on
    the tiny Llama) by the rows form at a decode shape and the dense form past ROWS_MAX rows; the
    rewritten step equals the captured one to fp32 rounding."""
    from specgraph.capture import capture_step, new_kv_cache
    from specgraph.passes import dequant_linear_pass
    from specgraph.passes.dequant import ROWS_MAX

    model = quantize(tiny_family("llama"), "int8")
    n_linear = sum(isinstance(m, Int8Linear) for m in model.modules())
    for Q in (1, ROWS_MAX + 1):
        gm = capture_step(model, 1, Q, 32)
        args = (torch.tensor([[3] * Q]), torch.arange(Q)[None], torch.zeros(1, 1, Q, 32), torch.arange(Q)[None])
        ref = gm(*args, *new_kv_cache(model, 1, 32))[0]
        gm, n = dequant_linear_pass(gm)
        assert n == n_linear
        forms = {getattr(node.target, "__name__", "") for node in gm.graph.nodes if node.op == "call_function"}
        assert ("_rows_int8" in forms) == (Q <= ROWS_MAX) and ("_dense_int8" in forms) == (Q > ROWS_MAX)
        torch.testing.assert_close(gm(*args, *new_kv_cache(model, 1, 32))[0], ref, atol=1e-4, rtol=1e-5)


def test_int4_packs_codes_by_halves():
    torch.manual_seed(2)
    codes = torch.randint(0, 16, (8, 128), dtype=torch.uint8)
    packed = dequant_linear.pack_int4(codes)
    assert packed.shape == (8, 64) and torch.equal(dequant_linear.int4_codes(packed), codes)
    assert torch.equal(packed[:, 0] & 15, codes[:, 0]) and torch.equal(packed[:, 0] >> 4, codes[:, 64])


def test_int4_weights_are_within_half_a_step():
    """Scales and offsets are fp32: every weight is within half a step of the original."""
    torch.manual_seed(2)
    w = torch.randn(32, 64) * 0.02 + 0.3  # offsets far from 0
    blocks = w.reshape(32, 2, 32)
    step = (blocks.amax(-1) - blocks.amin(-1))[..., None] / 15
    err = (Int4Linear.quantize(w, None).dequantized() - w).abs().reshape(32, 2, 32)
    assert (err <= step / 2 * (1 + 1e-5) + 1e-7).all()


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
    assert Int4Linear.fits(24, 64) and not Int4Linear.fits(32, 96)  # 96 inputs: halves of 48, not whole groups
    model = tiny_family("llama")
    model.model.layers[0].mlp.up_proj = nn.Linear(64, 96, bias=False)
    model.model.layers[0].mlp.down_proj = nn.Linear(96, 64, bias=False)
    model.model.layers[0].mlp.gate_proj = nn.Linear(64, 96, bias=False)
    q = quantize(model, "int4")
    assert type(q.model.layers[0].mlp.down_proj) is BF16Linear and type(q.model.layers[0].mlp.up_proj) is Int4Linear
    assert type(q.model.layers[1].mlp.down_proj) is Int4Linear


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


def law_target():
    """The sampling tests' tiny Llama (vocab 8) at width 64, so that every layer takes int4."""
    from test_compile_sampling import V
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                      tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    m = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(40.0)
    return m


def test_sampled_law_is_the_quantized_models():
    """Three-token continuations of a tiny int4 target (vocab 8) drafted by a draft model, against
    the law of ``quantize(target, "int4")`` enumerated with full forwards (chi-square, ALPHA).
    Negative control: the same counts against the fp32 target's law are rejected."""
    from law import gof_pvalue
    from test_compile_sampling import ALPHA, exact_law, sampled_counts, tiny as tiny_law

    target, draft = law_target(), tiny_law(1, 1, 25.0)
    q = quantize(target, "int4")
    assert all(isinstance(m, Int4Linear) for m in q.modules() if hasattr(m, "stored"))
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
