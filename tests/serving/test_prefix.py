"""Prompt prefix reuse: the pool's keys (tokens after the same parent), eviction, and requests
that share prefixes through the engine, each equal to ``model.generate`` (with a negative control
whose pool holds the wrong KV)."""
from __future__ import annotations

import torch

import specgraph
from specgraph.serving import ServeRequest, ServingEngine
from specgraph.serving.prefix import PrefixCache
from tiny_models import EOS, run_all, tiny


def cache_tensors(B=2, H=2, S=64, D=4, n=3):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, H, S, D, generator=g) for _ in range(n)]


def test_load_copies_the_stored_blocks_and_stops_at_the_first_miss():
    kv = cache_tensors()
    pc = PrefixCache(kv, block=4, capacity=8)
    toks = list(range(100, 111))  # 11 tokens: 2 whole blocks
    assert pc.store(toks, kv, row=0) == 2 and pc.used == 2
    assert pc.store(toks, kv, row=0) == 0  # already held
    n = pc.load(toks[:9] + [7, 7], kv, row=1)
    assert n == 8
    for t in kv:
        assert torch.equal(t[1, :, :8], t[0, :, :8])
    assert pc.load(toks[:4] + [0] + toks[5:], kv, row=1) == 4  # a miss in block 2 ends the match
    assert pc.load([1] + toks[1:], kv, row=1) == 0
    assert pc.load(toks[:7], kv, row=1) == 4  # only whole blocks
    kv[0][1].zero_()
    assert pc.load(toks, kv, row=1, have=5) == 8  # copies block 1 (from slot 4) and block 2
    assert kv[0][1, :, :4].abs().sum() == 0 and torch.equal(kv[0][1, :, 4:8], kv[0][0, :, 4:8])
    assert pc.load(toks, kv, row=1, have=9) == 9  # holds more than the cache has: nothing copied


def test_a_block_matches_only_after_the_same_parent():
    kv = cache_tensors()
    pc = PrefixCache(kv, block=2, capacity=8)
    pc.store([1, 2, 3, 4], kv, row=0)
    assert pc.load([9, 9, 3, 4], kv, row=1) == 0  # block [3, 4] at the same place, after other tokens
    assert pc.load([1, 2, 3, 4], kv, row=1) == 4


def test_eviction_is_lru_and_takes_the_children_with_a_block():
    kv = cache_tensors()
    pc = PrefixCache(kv, block=2, capacity=3)
    pc.store([1, 2, 3, 4], kv, row=0)  # blocks A=[1,2], A/B=[3,4]
    pc.store([5, 6], kv, row=0)  # C
    pc.load([1, 2, 3, 4], kv, row=1)  # A and B more recent than C
    pc.store([7, 8], kv, row=0)  # evicts C
    assert pc.load([5, 6], kv, row=1) == 0 and pc.load([1, 2, 3, 4], kv, row=1) == 4
    # A chain longer than the pool keeps what fits; a block's id reused never revives an orphan
    pc = PrefixCache(kv, block=2, capacity=2)
    assert pc.store([1, 2, 3, 4, 5, 6], kv, row=0) == 2
    pc.store([9, 9], kv, row=0)  # evicts the leaf [3, 4] (A is more recent)
    pc._evict(pc.index[(-1, (1, 2))])
    assert pc.used == 1 and len(pc.free) == 1
    assert pc.load([1, 2, 3, 4], kv, row=1) == 0


def shared_prefix_prompts():
    g = torch.Generator().manual_seed(3)
    system = torch.randint(6, 120, (45,), generator=g).tolist()  # a "system prompt": 5 blocks of 8 and 5 tokens
    doc = torch.randint(6, 120, (30,), generator=g).tolist()
    asks = [torch.randint(6, 120, (n,), generator=g).tolist() for n in (3, 9, 1, 14, 6)]
    return [system + a for a in asks] + [system + doc + a for a in asks[:3]] + [system + doc]


def test_requests_sharing_prefixes_equal_generate():
    """Prefixes come from the pool (prefill skips them) and every output equals generate; the
    control fills the pool with noise after it is stored, and the outputs change."""
    model = tiny()
    ps = shared_prefix_prompts()
    want = [model.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False)[0, len(p):].tolist() for p in ps]
    reqs = [ServeRequest(p, 16, eos=(EOS,)) for p in ps]
    fast = specgraph.compile(model, "ngram", max_batch_size=3, max_seq_len=256, backend="eager")
    engine = ServingEngine(fast, prefill_chunk=7, prefix_block=8)
    outs, _ = run_all(engine, reqs)
    for o, w in zip(outs, want):
        assert o == w[: len(o)] and len(o) >= 1
    prompt_tokens = sum(len(p) - 1 for p in ps)
    assert engine.stats.prefix_tokens >= 40 * 5  # the shared system blocks, at least, were copied
    assert engine.stats.prefix_tokens + engine.stats.prefill_tokens == prompt_tokens
    off = ServingEngine(fast, prefill_chunk=7, prefix_cache_bytes=0)
    assert run_all(off, reqs)[0] == outs and off.stats.prefix_tokens == 0

    class NoisyPool(ServingEngine):
        def _prefill(self):
            super()._prefill()
            for p in self.prefix.pool:
                p.normal_()

    bad = NoisyPool(fast, prefill_chunk=7, prefix_block=8)
    assert run_all(bad, reqs)[0] != outs


def test_identical_prompts_arriving_together_are_computed_once():
    """The second row waits behind the first (oldest first) and copies its blocks as they are
    computed: of its 59 prompt tokens only the 3 after the last whole block are computed."""
    model = tiny()
    p = torch.randint(6, 120, (60,), generator=torch.Generator().manual_seed(4)).tolist()
    want = model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[0, len(p):].tolist()
    fast = specgraph.compile(model, None, max_batch_size=2, max_seq_len=256, backend="eager")
    engine = ServingEngine(fast, prefill_chunk=16, prefix_block=8)
    outs, _ = run_all(engine, [ServeRequest(p, 12), ServeRequest(p, 12)])
    assert outs == [want, want]
    assert engine.stats.prefill_tokens == 59 + 3 and engine.stats.prefix_tokens == 56


def test_short_chunks_of_neighbouring_rows_share_one_call():
    """Four prompts sharing 40 tokens arrive together: the first computes the shared blocks, the
    others wait a pass, copy them and compute their own tails together in one packed call (no
    padding); every output equals generate."""
    model = tiny()
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(6, 120, (40,), generator=g).tolist()
    ps = [shared + torch.randint(6, 120, (n,), generator=g).tolist() for n in (5, 3, 7, 4)]
    want = [model.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False)[0, len(p):].tolist() for p in ps]
    fast = specgraph.compile(model, None, max_batch_size=4, max_seq_len=256, backend="eager")
    calls = []
    prefill = fast.prefill_chunk
    fast.prefill_chunk = lambda kv, ids, *a: (calls.append(tuple(ids.shape)), prefill(kv, ids, *a))
    packed = fast.prefill_packed
    fast.prefill_packed = lambda kv, rows, starts, chunks: (
        calls.append(("packed", starts, [len(c) for c in chunks])), packed(kv, rows, starts, chunks))
    engine = ServingEngine(fast, prefill_chunk=64, prefix_block=8)
    outs, _ = run_all(engine, [ServeRequest(p, 10, eos=(EOS,)) for p in ps])
    assert outs == want
    assert calls == [(1, 44), ("packed", [40] * 3, [2, 6, 3])]  # the tails, after the copied blocks
    assert engine.stats.prefix_tokens == 3 * 40 and engine.stats.prefill_tokens == 44 + 2 + 6 + 3
