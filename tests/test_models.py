"""Models as specgraph loads and saves them (specgraph.models).

A model loaded from a GGUF file (its weights dequantized at load) carries transformers' GGUF
quantizer, and ``save_pretrained`` refuses it; the build helper process
(:mod:`specgraph.buildworker`) needs the model saved. :func:`specgraph.models.save_checkpoint`
writes it anyway: the helper's copy has the same logits and the same graph-cache key as the
original, so the helper builds for it."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import specgraph
from specgraph import buildworker, graphcache
from specgraph.models import loaded_from_gguf, save_checkpoint


def _as_if_loaded_from_gguf(model):
    """``model`` marked as transformers marks a model it loaded from a GGUF file."""
    from transformers.quantizers.quantizer_gguf import GgufHfQuantizer
    from transformers.utils.quantization_config import GgufConfig

    model.hf_quantizer = GgufHfQuantizer(GgufConfig())
    model.config.quantization_config = GgufConfig()
    model.config.architectures = None
    return model


@pytest.fixture
def gguf_model():
    torch.manual_seed(0)
    cfg = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                               max_position_embeddings=256, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32).eval()
    return _as_if_loaded_from_gguf(model)


def _helper_model(folder):
    """The model the build helper loads from ``folder``."""
    return buildworker._load_model({"model_dir": str(folder), "model_class": "transformers.LlamaForCausalLM",
                                    "dtype": "float32", "attn_implementation": "sdpa"})


def _digest(model) -> str:
    fast = specgraph.compile(model, "ngram", max_batch_size=1, max_seq_len=64, warmup=False)
    return graphcache.key_digest(graphcache.entry_key(fast))


def test_save_pretrained_refuses_a_model_loaded_from_gguf(gguf_model, tmp_path):
    """The negative control: without save_checkpoint the helper cannot have the model."""
    assert loaded_from_gguf(gguf_model)
    with pytest.raises(ValueError, match="gguf"):
        gguf_model.save_pretrained(tmp_path)


def test_a_model_loaded_from_gguf_is_saved_for_the_build_helper(gguf_model, tmp_path):
    save_checkpoint(gguf_model, tmp_path)
    back = _helper_model(tmp_path)
    assert not loaded_from_gguf(back)
    assert back.lm_head.weight.data_ptr() == back.model.embed_tokens.weight.data_ptr()  # tied again
    ids = torch.tensor([[5, 17, 33, 2, 90, 41]])
    with torch.no_grad():
        assert torch.equal(back(ids).logits, gguf_model(ids).logits)
    assert _digest(back) == _digest(gguf_model)


def test_other_models_are_saved_by_save_pretrained(tmp_path, monkeypatch):
    torch.manual_seed(0)
    cfg = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    calls = []
    monkeypatch.setattr(type(model), "save_pretrained", lambda self, folder: calls.append(folder))
    save_checkpoint(model, tmp_path)
    assert calls == [tmp_path]
