"""``compile``'s limits, checked before anything is allocated: ``max_seq_len`` against the
model's maximum positions (the default capped at it, a larger value refused), and the static KV
cache against the memory available (refused with the numbers, not a raw allocation error)."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import specgraph
from specgraph import limits


def _model(arch="llama", **kw):
    torch.manual_seed(0)
    base = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=64)
    if arch == "gpt2":
        base = dict(n_embd=32, n_layer=2, n_head=4, vocab_size=64, bos_token_id=0, eos_token_id=0)
    cfg = AutoConfig.for_model(arch, **{**base, **kw})
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32).eval()


def test_default_max_seq_len_is_capped_at_the_model_positions():
    short = specgraph.compile(_model(max_position_embeddings=300), backend="eager", warmup=False)
    assert short.max_seq_len == 300
    long = specgraph.compile(_model(max_position_embeddings=8192), backend="eager", warmup=False)
    assert long.max_seq_len == limits.DEFAULT_MAX_SEQ_LEN


@pytest.mark.parametrize("arch,field", [("llama", "max_position_embeddings"), ("gpt2", "n_positions")])
def test_max_seq_len_above_the_model_positions_is_refused(arch, field):
    model = _model(arch, **{field: 128})
    with pytest.raises(ValueError, match=r"max_seq_len=129 exceeds the model.s maximum positions \(\w+=128"):
        specgraph.compile(model, backend="eager", max_seq_len=129, warmup=False)
    assert specgraph.compile(model, backend="eager", max_seq_len=128, warmup=False).max_seq_len == 128


def test_learned_positions_past_the_maximum_fail_in_the_model_itself():
    """Why the limit holds: a GPT-2 has no position embedding past n_positions (the negative control
    of the refusal: the same length the check refuses breaks the model's own forward)."""
    model = _model("gpt2", n_positions=16)
    model(torch.zeros(1, 16, dtype=torch.long))
    with pytest.raises((IndexError, RuntimeError)):
        model(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.parametrize("bad", [0, 1, 2.5, True, "long"])
def test_max_seq_len_must_be_an_int_of_two_or_more(bad):
    with pytest.raises(ValueError, match="max_seq_len must be an int >= 2"):
        specgraph.compile(_model(max_position_embeddings=64), backend="eager", max_seq_len=bad, warmup=False)


def test_kv_cache_bytes_matches_the_allocated_cache():
    model = _model(max_position_embeddings=256, num_key_value_heads=2)
    fast = specgraph.compile(model, backend="eager", max_batch_size=3, max_seq_len=100, warmup=False)
    allocated = sum(t.numel() * t.element_size() for t in fast.kv_cache(3))
    assert limits.kv_cache_bytes(model, 3, fast.slots) == allocated


def test_a_kv_cache_larger_than_memory_is_refused_with_the_numbers():
    """A model without a position limit and a sequence far past this machine's memory: refused at
    compile time, naming the cache's size and the memory available."""
    model = _model(max_position_embeddings=1 << 40)
    with pytest.raises(ValueError, match=r"KV cache .* needs [0-9.]+ GiB on cpu and [0-9.]+ GiB are available"):
        specgraph.compile(model, backend="eager", max_batch_size=8, max_seq_len=1 << 30, warmup=False)


def test_kv_fit_uses_the_memory_available():
    model = _model(max_position_embeddings=4096)
    need = limits.kv_cache_bytes(model, 4, 1025)
    limits.check_kv_fits(model, None, 4, 1025, available=need)  # exactly fits
    with pytest.raises(ValueError, match="lower max_seq_len or max_batch_size"):
        limits.check_kv_fits(model, None, 4, 1025, available=need - 1)
    with pytest.raises(ValueError):  # a draft model's cache counts too
        limits.check_kv_fits(model, model, 4, 1025, available=need + 1)


def test_engines_sized_inside_specgraph_stay_within_the_model_positions():
    """train-drafter's answer engine asks for 1024 slots; a model of 256 positions gets 256."""
    from specgraph.train import GEN_MAX_SEQ, answer_engine

    assert answer_engine(_model(max_position_embeddings=256), "specgraph", 2).max_seq_len == 256
    assert answer_engine(_model(max_position_embeddings=4096), "specgraph", 2).max_seq_len == GEN_MAX_SEQ


def test_a_draft_model_bounds_max_seq_len_too():
    target, draft = _model(max_position_embeddings=4096), _model(max_position_embeddings=200)
    assert specgraph.compile(target, draft, backend="eager", warmup=False).max_seq_len == 200
    with pytest.raises(ValueError, match=r"max_seq_len=300 exceeds the draft model.s maximum positions"):
        specgraph.compile(target, draft, backend="eager", max_seq_len=300, warmup=False)
