"""Verify drafted chains against SmolLM2's real logits.

Drafts come from prompt lookup over the prompt; the target logits for the root plus the drafts come
from one forward pass; verify_chain decides what is kept, greedily and by sampling.

    python examples/verify_on_smollm2.py
"""
import torch

import specgraph
from specgraph.drafters import ngram_propose
from specgraph.models import load_model

model, tok = load_model("default")
text = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n    return a"
ids = tok(text, return_tensors="pt").input_ids
drafts, matched = ngram_propose(ids, torch.tensor([ids.shape[1]]), k=6)
with torch.no_grad():
    logits = model(torch.cat([ids, drafts], dim=1)).logits[:, ids.shape[1] - 1 :]  # [1, K+1, V]
print("drafts:", repr(tok.decode(drafts[0])), f"(matched a {int(matched[0])}-gram)")
tokens, n = specgraph.verify_chain(logits, None, drafts, temperature=0)
print("greedy keeps:", repr(tok.decode(tokens[0, : int(n[0])])))
g = torch.Generator().manual_seed(0)
tokens, n = specgraph.verify_chain(logits, None, drafts, temperature=0.7, top_k=50, generator=g)
print("T=0.7 keeps: ", repr(tok.decode(tokens[0, : int(n[0])])))
