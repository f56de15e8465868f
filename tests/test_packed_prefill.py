"""Packed prefill (:meth:`SpecGraphModel.prefill_packed`): several rows' prompt chunks in one
call with no padding write the cache that a call per row writes; a control shows the comparison
catches a token seeing another row's segment; models whose attention depends on slots beyond the
mask are refused and served by calls per row; the serving engine's passes use it."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import specgraph
import specgraph.compiler as compiler
from specgraph.capture import new_kv_cache
from specgraph.serving import ServeRequest, ServingEngine
from tiny_models import run_all, tiny

pytestmark = pytest.mark.filterwarnings("ignore:.*past_key_values.*deprecated:FutureWarning")

STARTS = [10, 0, 33, 5]  # committed slots per row before the packed call
LENGTHS = [20, 9, 17, 12]  # its new tokens


def caches(arch):
    """The cache written by a packed call, and by a call per row, from the same committed
    prefixes (row r: STARTS[r] tokens, then LENGTHS[r] more)."""
    model = tiny(arch)
    fast = specgraph.compile(model, None, max_batch_size=4, max_seq_len=128, backend="eager")
    return packed_and_per_row(fast, model)


def packed_and_per_row(fast, model, before_packed=lambda: None):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(6, 120, (s + n,), generator=g) for s, n in zip(STARTS, LENGTHS)]
    kv = new_kv_cache(model, 4, fast.slots)
    with torch.no_grad():
        for r, (p, s0) in enumerate(zip(prompts, STARTS)):
            if s0:
                fast.prefill_chunk([t[r:r + 1] for t in kv], p[:s0].view(1, -1), 0)
        per_row = [t.clone() for t in kv]
        for r, (p, s0) in enumerate(zip(prompts, STARTS)):
            fast.prefill_chunk([t[r:r + 1] for t in per_row], p[s0:].view(1, -1), s0)
        before_packed()
        fast.prefill_packed(kv, [0, 1, 2, 3], STARTS, [p[s0:] for p, s0 in zip(prompts, STARTS)])
    return kv, per_row


def same_rows(a_kv, b_kv) -> bool:
    return all(torch.allclose(a[r, :, : s + n], b[r, :, : s + n], atol=1e-5, rtol=1e-5)
               for a, b in zip(a_kv, b_kv) for r, (s, n) in enumerate(zip(STARTS, LENGTHS)))


@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
def test_packed_prefill_writes_what_a_call_per_row_writes(arch):
    packed, per_row = caches(arch)
    assert same_rows(packed, per_row)


def test_control_a_token_seeing_other_rows_is_caught(monkeypatch):
    """Negative control: a layout whose mask is plain causal over the packed sequence (a token
    sees the rows packed before it) writes a different cache."""
    layout = compiler.packed_layout

    def leaky(starts, lengths, device=None):
        pos, slot, mask, offsets = layout(starts, lengths, device)
        s = torch.arange(mask.shape[-1])
        causal = torch.zeros(mask.shape).masked_fill(s > slot.view(-1, 1), float("-inf"))
        return pos, slot, causal, offsets

    monkeypatch.setattr(compiler, "packed_layout", leaky)
    packed, per_row = caches("llama")
    assert not same_rows(packed, per_row)


def test_layout_positions_slots_and_segments():
    pos, slot, mask, offsets = compiler.packed_layout([2, 0], [3, 2])
    assert offsets == [0, 5] and pos.tolist() == [[2, 3, 4, 0, 1]] and slot.tolist() == [[2, 3, 4, 5, 6]]
    seen = (mask[0, 0] == 0).int().tolist()
    assert seen[0] == [1, 1, 1, 0, 0, 0, 0] and seen[2] == [1, 1, 1, 1, 1, 0, 0] and seen[4] == [0] * 5 + [1, 1]


def test_a_sliding_window_model_is_refused_and_served_by_calls_per_row():
    torch.manual_seed(0)
    cfg = AutoConfig.for_model("mistral", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=128, sliding_window=8)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32).eval()
    fast = specgraph.compile(model, None, max_batch_size=3, max_seq_len=128, backend="eager")
    assert not fast.packs_prefill
    with pytest.raises(ValueError, match="sliding windows"):
        fast.prefill_packed(new_kv_cache(model, 1, fast.slots), [0], [0], [torch.tensor([7, 8])])
    ps = [list(range(10, 10 + n)) for n in (19, 7, 26)]
    engine = ServingEngine(fast, prefill_chunk=16)
    outs, _ = run_all(engine, [ServeRequest(p, 12) for p in ps])
    want = [model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[0, len(p):].tolist() for p in ps]
    assert outs == want and engine.stats.packed_prefills == 0


def test_engine_packs_rows_of_different_chunk_lengths():
    """Requests of different prompt lengths arriving together are prefilled in packed calls, and
    each output equals generate."""
    model = tiny()
    fast = specgraph.compile(model, "ngram", max_batch_size=4, max_seq_len=256, backend="eager")
    g = torch.Generator().manual_seed(3)
    ps = [torch.randint(6, 120, (n,), generator=g).tolist() for n in (5, 31, 12, 47, 8, 22)]
    engine = ServingEngine(fast, prefill_chunk=24)
    outs, _ = run_all(engine, [ServeRequest(p, 16) for p in ps])
    want = [model.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False)[0, len(p):].tolist() for p in ps]
    assert outs == want and engine.stats.packed_prefills > 0


def test_packed_prefill_graph_from_the_graph_cache(tmp_path, monkeypatch):
    """``compile(packed_prefill=True)``: the graph cache builds the packed prefill package; packed
    calls run it (the eager step is never called) and write what a call per row writes, and
    generate prefills its prompts through it, equal to HF greedy."""
    from specgraph.capture import Step

    model = tiny()
    fast = specgraph.compile(model, None, max_batch_size=1, max_seq_len=128, modes=("greedy",), cache=tmp_path,
                             refine="now", attention="sdpa", packed_prefill=True, progress=False, warmup=True)
    assert fast.packed_prefill_compiled
    eager_calls = []
    forward = Step.forward
    monkeypatch.setattr(Step, "forward", lambda self, *a: (eager_calls.append(a[0].shape), forward(self, *a))[1])
    kv, per_row = packed_and_per_row(fast, model, before_packed=eager_calls.clear)
    assert eager_calls == [] and same_rows(kv, per_row)
    g = torch.Generator().manual_seed(1)
    for n in (9, 40):
        p = torch.randint(6, 120, (1, n), generator=g)
        want = model.generate(p, max_new_tokens=12, do_sample=False)
        eager_calls.clear()
        assert torch.equal(fast.generate(p, max_new_tokens=12, do_sample=False), want) and eager_calls == []
