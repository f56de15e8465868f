"""Tiny random causal LMs for the serving tests (vocabulary 128: the character tokenizer's ids fit)."""
from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM


def tiny_causal_lm(arch: str = "llama", *, eos: int, pad: int = 0, seed: int = 0):
    """A 2-layer ``arch`` model (Llama with grouped KV heads), sdpa attention, fp32, eval mode,
    with ``eos`` / ``pad`` in its generation config."""
    torch.manual_seed(seed)
    kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=128,
              max_position_embeddings=1024)
    if arch == "llama":
        kw["num_key_value_heads"] = 2
    cfg = AutoConfig.for_model(arch, **kw)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32).eval()
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = pad
    return model
