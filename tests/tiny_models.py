"""Tiny random causal LMs for the serving tests (vocabulary 128: the character tokenizer's ids fit),
and a driver that runs requests through a serving engine to the end."""
from __future__ import annotations

import time

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


EOS = 5


def tiny(arch="llama", seed=0):
    """A tiny ``arch`` model whose EOS is :data:`EOS`."""
    return tiny_causal_lm(arch, eos=EOS, seed=seed)


def run_all(engine, reqs, timeout=300):
    """Submit every request, step the engine until all finished; returns each one's tokens."""
    outs = [[] for _ in reqs]
    ends = [None] * len(reqs)

    def sink(i):
        def put(ev):
            outs[i].extend(ev.tokens)
            if ev.finish or ev.error:
                ends[i] = ev.finish or ev.error
        return put

    for i, r in enumerate(reqs):
        engine.submit(r, sink(i))
    t0 = time.time()
    while any(e is None for e in ends):
        assert time.time() - t0 < timeout
        engine.step()
    return outs, ends
