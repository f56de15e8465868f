"""The EAGLE and Medusa heads shipped in ``specgraph/weights/`` for SmolLM2-135M-Instruct.

* they are found by fingerprint (``draft="eagle"`` / ``"medusa"``), are small safetensors files and
  carry their training record (held-out acceptance, the command's arguments);
* (slow) greedy output with each head, as a chain and as a tree, equals ``model.generate`` token for
  token on prompts that are not from the training sources, and the heads draft tokens that the
  target accepts (a head that never agrees would pass equality and be useless).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import specgraph
from specgraph.heads import read_head_metadata

WEIGHTS = Path(specgraph.__file__).parent / "weights"
SHIPPED = {"eagle": WEIGHTS / "smollm2-135m-instruct-eagle.safetensors",
           "medusa": WEIGHTS / "smollm2-135m-instruct-medusa.safetensors"}
PROMPTS = [  # not from the standard library or pydoc topics (the training sources), but code, which they teach
    "Write a Python function that reverses a string.",
    "Write a Python class for a bank account with deposit and withdraw methods.",
    "Explain what a Python list comprehension is, with an example.",
]


@pytest.mark.parametrize("kind", sorted(SHIPPED))
def test_shipped_head_file(kind):
    path = SHIPPED[kind]
    assert path.exists(), f"{path} is not shipped"
    assert path.stat().st_size < 25e6
    md = read_head_metadata(path)
    assert md["kind"] == kind and md["target"]
    ev = md["meta"]["final_eval"]["all"]
    assert ev["top1_depth1"] > 0.2  # a trained head (an initialisation agrees on ~0)
    assert md["meta"]["trained_by"] == "specgraph train-drafter"


def _ids(tok, text):
    enc = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt")
    return enc if isinstance(enc, torch.Tensor) else enc["input_ids"]


@pytest.mark.slow
@pytest.mark.parametrize("kind, tree", [("eagle", None), ("eagle", "dynamic"), ("medusa", None),
                                        ("medusa", [(0,), (1,), (0, 0), (1, 0), (0, 0, 0), (0, 0, 0, 0)])])
def test_shipped_heads_greedy_equal_hf(smollm2, kind, tree):
    model, tok = smollm2
    fast = specgraph.compile(model, kind, num_speculative_tokens=4, tree=tree, backend="eager", max_batch_size=1,
                             max_seq_len=256)
    eos = model.generation_config.eos_token_id
    accepted = rounds = 0
    for text in PROMPTS:
        ids = _ids(tok, text)
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False,
                             eos_token_id=eos, pad_token_id=eos)
        out = fast.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=eos, pad_token_id=eos)
        assert torch.equal(out, ref), (kind, tree, text)
        accepted += fast.stats.accepted
        rounds += fast.stats.rounds
    print(f"{kind} {tree}: {accepted / rounds:.2f} accepted drafts per round")
    assert accepted / rounds > 0.2, (kind, tree, accepted, rounds)  # a random head: ~0
