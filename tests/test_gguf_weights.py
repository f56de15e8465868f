"""``weights="native"``: a GGUF model's linear layers built from the file's own blocks.

A tiny Llama's linear weights are written to a GGUF file as Q4_0 / Q4_1 / Q8_0 / F16 / F32
tensors under names of no meaning and with the q projection's rows permuted (as llama.cpp's
converter permutes them); the model is given the file's dequantized values, as transformers'
GGUF loader gives them. :func:`specgraph.gguf_weights.native_model` must find each layer's
tensor by value and build the layer the file's type calls for; compiled greedy output equals
HF generate on that model.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import specgraph
from specgraph import gguf_weights
from specgraph.precision import BF16Linear, Int4Linear, Int8Linear, as_given
from test_architectures import tiny as tiny_family

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

TYPES = {"q_proj": "Q4_1", "k_proj": "Q4_0", "v_proj": "Q8_0", "o_proj": "F16", "gate_proj": "Q4_1",
         "up_proj": "Q4_1", "down_proj": "F32", "lm_head": "Q4_1"}
EXPECTED = {"Q4_1": Int4Linear, "Q4_0": Int4Linear, "Q8_0": Int8Linear, "F16": BF16Linear, "F32": nn.Linear}


def _file_values(w: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """(the tensor as stored, its dequantized values) for ``w`` [N, K] float32 as GGUF type ``kind``."""
    qtype = gguf.GGMLQuantizationType[kind]
    if kind == "F32":
        return w, w
    if kind == "F16":
        return w.astype(np.float16), w.astype(np.float16).astype(np.float32)
    raw = gguf.quants.quantize(w, qtype)
    return raw, gguf.quants.dequantize(raw, qtype).reshape(w.shape)


@pytest.fixture(scope="module")
def gguf_model(tmp_path_factory):
    """(a tiny Llama holding the file's values, the GGUF file's path)."""
    model = tiny_family("llama")
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    rng = np.random.default_rng(0)
    for i, (name, module) in enumerate(model.named_modules()):
        leaf = name.rsplit(".", 1)[-1]
        if type(module) is not nn.Linear:
            continue
        w = module.weight.detach().numpy().astype(np.float32)
        raw, values = _file_values(w, TYPES[leaf])
        perm = rng.permutation(w.shape[0]) if leaf == "q_proj" else np.arange(w.shape[0])
        kind = gguf.GGMLQuantizationType[TYPES[leaf]]
        writer.add_tensor(f"t{i}", np.ascontiguousarray(raw[perm]), raw_dtype=None if TYPES[leaf] in ("F32", "F16") else kind)
        with torch.no_grad():
            module.weight.copy_(torch.from_numpy(values))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    model.specgraph_gguf = str(path)
    return model, path


def test_each_layer_is_built_from_its_tensor_type(gguf_model):
    model, _ = gguf_model
    native = gguf_weights.native_model(model)
    assert as_given(native) == "native" and as_given(model) == "float32"
    for name, module in model.named_modules():
        if type(module) is nn.Linear:
            built = native.get_submodule(name)
            assert type(built) is EXPECTED[TYPES[name.rsplit(".", 1)[-1]]], name
            if type(built) is not nn.Linear:  # within half a step of the file's values (bf16 for floats)
                err = (built.dequantized() - module.weight).abs().max().item()
                assert err <= 0.6 * module.weight.abs().max().item() / (7 if type(built) is Int4Linear else 100), name


def test_compiled_native_model_equals_hf_generate(gguf_model):
    model, _ = gguf_model
    assert gguf_weights.default_weights(model) == "native"  # the command line's default for a GGUF model
    assert gguf_weights.default_weights(model, "eagle") is None  # heads are trained for the fp32 model
    assert gguf_weights.resolve(None, model) == "float32"  # compile keeps the model as given
    fast = specgraph.compile(model, "ngram", weights="native", backend="eager", max_seq_len=128)
    assert fast.weights == "native"
    ids = torch.tensor([[5, 9, 13, 9, 13, 9, 13, 21]])
    kw = dict(max_new_tokens=40, do_sample=False, eos_token_id=[], pad_token_id=0)
    assert torch.equal(fast.generate(ids, **kw), fast.model.generate(ids, **kw))


def test_a_weight_not_in_the_file_is_refused(gguf_model):
    model, path = gguf_model
    changed = tiny_family("llama")  # random weights: no row is in the file
    changed.specgraph_gguf = str(path)
    with pytest.raises(ValueError, match="not those of one tensor of the GGUF file"):
        gguf_weights.native_model(changed)
    plain = tiny_family("llama")
    with pytest.raises(ValueError, match="load the model with specgraph.load_model"):
        gguf_weights.native_model(plain)
