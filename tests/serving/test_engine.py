"""The continuous-batching engine without HTTP: rows joining and leaving (cache rows moved on
retire), chunked prefill, per-row greedy exactness, seeded sampling independent of the batch,
and the load-aware depth policy."""
from __future__ import annotations

import pytest
import torch

import specgraph
from specgraph.serving import LoadAwareDepth, ServeRequest, ServingEngine
from specgraph.serving.engine import position_noise
from specgraph.verify import combine_chain, verify_chain_with_noise
from specgraph.warping import warp_logits
from tiny_models import EOS, run_all, tiny

def prompts(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        base = torch.randint(6, 120, (2 + 7 * i % 40,), generator=g).tolist()
        out.append(base * 3 if i % 2 else base)  # repetition: prompt lookup matches
    return out


@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
def test_more_requests_than_rows_equal_generate(arch):
    model = tiny(arch)
    fast = specgraph.compile(model, "ngram", max_batch_size=3, max_seq_len=256, backend="eager")
    engine = ServingEngine(fast, prefill_chunk=5)  # long prompts take several passes
    ps = prompts(9)
    outs, ends = run_all(engine, [ServeRequest(p, 24, eos=(EOS,)) for p in ps])
    for p, o, e in zip(ps, outs, ends):
        want = model.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False)[0, len(p):].tolist()
        assert o == want[: len(o)] and e in ("stop", "length")
        assert (e == "length") == (len(o) == 24 and EOS not in o)
    assert engine.occupancy == 0 and engine.stats.finished["length"] + engine.stats.finished["stop"] == 9


def test_retire_moves_the_cache_rows():
    """Negative control: rows retired without moving the last row's cache slots give wrong text."""
    model = tiny()
    fast = specgraph.compile(model, None, max_batch_size=2, max_seq_len=256, backend="eager")
    ps = [list(range(10, 40)), list(range(50, 53)), list(range(60, 90))]
    lens = [3, 20, 20]  # the first row leaves early: the second moves into its place
    want = [model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)[0, len(p):].tolist()
            for p, n in zip(ps, lens)]
    good = ServingEngine(fast)
    assert run_all(good, [ServeRequest(p, n) for p, n in zip(ps, lens)])[0] == want

    class NoMove(ServingEngine):
        def _retire(self, i):
            last = len(self.rows) - 1
            if i != last:
                self.hist[i], self.L[i], self.root[i] = self.hist[last], self.L[last], self.root[last]
                self.rows[i] = self.rows[last]
            self.rows.pop()

    bad = NoMove(specgraph.compile(model, None, max_batch_size=2, max_seq_len=256, backend="eager"))
    assert run_all(bad, [ServeRequest(p, n) for p, n in zip(ps, lens)])[0] != want


def test_seeded_sampling_independent_of_batch_and_drafting():
    model = tiny()
    fast = specgraph.compile(model, "ngram", max_batch_size=4, max_seq_len=256, backend="eager")
    p = [7, 8, 9, 10] * 5
    req = ServeRequest(p, 30, temperature=0.9, seed=42)
    alone = run_all(ServingEngine(fast), [req])[0][0]
    others = [ServeRequest(q, 30, temperature=0.7, seed=i) for i, q in enumerate(prompts(3, seed=5))]
    crowd = run_all(ServingEngine(fast), [*others, req])[0][-1]
    assert crowd == alone
    plain = specgraph.compile(model, None, max_batch_size=4, max_seq_len=256, backend="eager")
    assert run_all(ServingEngine(plain), [req])[0][0] == alone  # no drafts at all: the same tokens
    other_seed = run_all(ServingEngine(fast), [ServeRequest(p, 30, temperature=0.9, seed=43)])[0][0]
    assert other_seed != alone


def test_race_verification_emits_the_race_winner_whatever_was_drafted():
    """Deterministic drafts: the emitted token at each position is argmax p / E there, so the
    output does not depend on the draft; the accept/residual rule it replaces does (control)."""
    from specgraph.kernels import chain_outcomes_reference

    g = torch.Generator().manual_seed(0)
    B, K, V = 64, 4, 12
    logits = torch.randn(B, K + 1, V, generator=g) * 2
    u = torch.rand(B, K, generator=g)
    E = -torch.log(torch.rand(B, K + 1, V, generator=g))
    winner = (torch.softmax(logits, -1) / E).argmax(-1)  # [B, K+1]
    drafts = torch.where(torch.rand(B, K, generator=g) < 0.6, winner[:, :K], torch.randint(0, V, (B, K), generator=g))
    tokens, n = verify_chain_with_noise(logits, None, drafts, (u, E), 1.0)
    for b in range(B):
        assert tokens[b, : n[b]].tolist() == winner[b, : n[b]].tolist()
        assert n[b] == K + 1 or drafts[b, n[b] - 1] != winner[b, n[b] - 1]
    acc, rec = chain_outcomes_reference(warp_logits(logits, 1.0), None, drafts, u, E)
    old, _ = combine_chain(acc, rec, drafts)
    assert not torch.equal(old, tokens)  # the general rule's tokens depend on u and the drafts


def test_position_noise_depends_on_seed_and_position_only():
    a = position_noise([3], [10], 4, 50)[0]
    b = position_noise([7, 3], [0, 12], 2, 50)[1]
    assert torch.equal(a[2:], b) and not torch.equal(position_noise([4], [10], 4, 50)[0], a)
    assert (a > 0).all() and torch.isfinite(a).all()


def test_position_noise_is_exponential():
    """Kolmogorov-Smirnov against Exp(1) over 200k draws (alpha = 1e-4), and uncorrelated
    neighbours; control: the same draws squared are rejected."""
    from scipy import stats

    x = position_noise(list(range(40)), list(range(0, 4000, 100)), 5, 1000).flatten().double()
    assert stats.kstest(x.numpy(), "expon").pvalue > 1e-4
    assert stats.kstest((x ** 2).numpy(), "expon").pvalue < 1e-4
    assert abs(torch.corrcoef(torch.stack([x[:-1], x[1:]]))[0, 1]) < 0.02


def test_depth_policy_follows_load_and_acceptance():
    pol = LoadAwareDepth([0, 4], probe_every=4)
    high = (torch.tensor([8.0, 8, 8, 8]), torch.tensor([8.0, 8, 8, 8]))  # accepts everything
    low = (torch.zeros(4), torch.tensor([8.0, 8, 8, 8]))  # accepts nothing
    pol.set_cost(1, 0, 1.0)
    pol.set_cost(1, 4, 1.3)
    pol.set_cost(16, 0, 2.0)
    pol.set_cost(16, 4, 6.0)
    assert pol.choose(1, [high], [True]) == 4  # one row, cheap verification: draft
    assert pol.choose(16, [high] * 16, [True] * 16) == 4  # ~4 tokens per row pay a 3x round
    assert pol.choose(16, [low] * 16, [True] * 16) == 0  # at load, a useless draft is off
    assert pol.choose(1, [high], [False]) == 0  # nothing drafted: plain
    picks = [pol.choose(16, [low] * 16, [True] * 16) for _ in range(8)]
    assert picks.count(4) == 2  # probes every 4 plain rounds
    pol.observe(16, 4, 4.0)
    assert 4.0 < pol.cost(16, 4) < 6.0  # round times keep the cost current


def test_refusals():
    model = tiny()
    fast = specgraph.compile(model, "ngram", max_batch_size=2, max_seq_len=64, backend="eager")
    engine = ServingEngine(fast, max_queue=1)
    with pytest.raises(ValueError, match="max_seq_len"):
        engine.submit(ServeRequest([1] * 30, 40), print)
    with pytest.raises(ValueError, match="log-probabilities"):
        engine.submit(ServeRequest([1, 2], 4, logprobs=1), print)
    with pytest.raises(ValueError, match="vocab|\\[0, 128\\)"):
        engine.submit(ServeRequest([1, 500], 4), print)
    engine.submit(ServeRequest([1, 2], 4), print)
    from specgraph.serving import QueueFull

    with pytest.raises(QueueFull):
        engine.submit(ServeRequest([1, 2], 4), print)
    with pytest.raises(ValueError, match="prompt-lookup chains"):
        ServingEngine(specgraph.compile(model, "suffix", max_batch_size=2, max_seq_len=64, backend="eager"))


def test_packages_of_mode_any_serve_both_lanes(tmp_path):
    """From the graph cache, both modes are one package per round (mode "any"): a batch mixing
    greedy and seeded sampled requests gives the greedy rows ``model.generate``'s text and the
    sampled rows what the engine's own sampling rounds give them, run eagerly. A round with both
    kinds of rows runs the package once, its greedy rows at temperature 0."""
    from pathlib import Path

    from specgraph import graphcache

    model = tiny()
    settings = dict(max_batch_size=2, max_seq_len=256, num_speculative_tokens=2)  # rounds mix greedy and sampled rows
    fast = specgraph.compile(model, "ngram", cache=tmp_path, warmup=True, progress=False, **settings)
    names = sorted(p.stem for p in Path(fast.graph_cache["path"]).glob("*.pt2"))
    assert names and all(n.endswith("_any.frozen") for n in names), names
    ps = prompts(5, seed=3)
    reqs = [ServeRequest(p, 20, eos=(EOS,)) if i % 2 == 0 else ServeRequest(p, 20, temperature=0.8, seed=i)
            for i, p in enumerate(ps)]
    engine = ServingEngine(fast)
    outs = run_all(engine, reqs)[0]
    assert engine.stats.joint_rounds > 0  # rounds with both kinds of rows ran as one graph call
    jit = specgraph.compile(model, "ngram", cache=False, warmup=False, backend="eager", **settings)
    ref_engine = ServingEngine(jit)
    ref = run_all(ref_engine, reqs)[0]
    assert ref_engine.stats.joint_rounds == 0  # graphs per mode: a call per lane
    for i, (p, o) in enumerate(zip(ps, outs)):
        if i % 2 == 0:
            want = model.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False)[0, len(p):].tolist()
            assert o == want[: len(o)], i
        assert o == ref[i], i
    assert isinstance(fast.graphs_in_use(), graphcache.CachedGraphs) and fast.graphs_built == {}
