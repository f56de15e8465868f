"""CUDA-only: compiled rounds recorded as CUDA graphs (one per shape) replay what eager computes.

Skipped without a GPU; ``scripts/gpu_check.sh`` runs it on a lent device machine.
"""
from __future__ import annotations

import pytest
import torch

import specgraph

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.filterwarnings("ignore:.*past_key_values.*deprecated:FutureWarning"),
]

TREE = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]


def _tiny_llama(seed=0):
    from transformers import LlamaConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").cuda().eval()


@pytest.mark.parametrize("kind", ["plain", "ngram", "ngram-tree", "self-tree", "self"])
def test_cuda_graph_replay_equals_eager_and_hf(kind):
    from torch._dynamo.utils import counters

    model = _tiny_llama()
    draft = {"plain": None, "ngram": "ngram", "ngram-tree": "ngram"}.get(kind, model)
    tree = TREE if kind.endswith("tree") else None
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], [9, 10, 11, 12, 13, 9, 10, 11, 12, 13, 9]], device="cuda")
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False, pad_token_id=0)
    counters.clear()
    fast = specgraph.compile(model, draft, tree=tree, backend="inductor", max_batch_size=2, max_seq_len=128)
    for _ in range(3):  # record, then replay twice
        out = fast.generate(ids, max_new_tokens=24, pad_token_id=0)
        assert torch.equal(out, ref), kind
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    eager = specgraph.compile(model, draft, tree=tree, backend="eager", max_batch_size=2, max_seq_len=128)
    g1, g2 = torch.Generator("cuda").manual_seed(3), torch.Generator("cuda").manual_seed(3)
    s1 = fast.generate(ids, max_new_tokens=24, pad_token_id=0, do_sample=True, temperature=0.8, generator=g1)
    s2 = eager.generate(ids, max_new_tokens=24, pad_token_id=0, do_sample=True, temperature=0.8, generator=g2)
    # same noise -> same tokens, unless a float rounding difference flips a near-tie
    assert (s1 == s2).float().mean() > 0.9
