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


@pytest.mark.parametrize("kind", ["ngram", "ngram-tree"])
def test_grammar_rounds_on_cuda_equal_hf_with_the_same_mask(kind):
    """The grammar's bitmask (host-computed, moved to the device) inside CUDA-graph rounds."""
    xgr = pytest.importorskip("xgrammar")
    from transformers import LogitsProcessorList

    from specgraph.grammar import GrammarLogitsProcessor, compile_grammar, grammar_spec

    model = _tiny_llama()
    model.generation_config.eos_token_id = 0
    vocab = ["<eos>"] + [chr(ord("a") + i % 26) * (1 + i // 26) for i in range(127)]
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=128, stop_token_ids=[0])
    regex = "[a-f]{3}(-[a-f]{2,3}){2,3}"
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]], device="cuda")
    g = compile_grammar(grammar_spec(regex=regex), info, 128, (0,))
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False, pad_token_id=0,
                         logits_processor=LogitsProcessorList([GrammarLogitsProcessor(g, ids.shape[1])]))
    fast = specgraph.compile(model, "ngram", tree=TREE if kind.endswith("tree") else None, max_batch_size=1,
                             max_seq_len=128, structured_output=True, warmup=True, progress=False)
    for _ in range(2):  # record, then replay
        assert torch.equal(fast.generate(ids, max_new_tokens=24, pad_token_id=0, regex=regex, tokenizer=info), ref)
