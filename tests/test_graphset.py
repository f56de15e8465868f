"""The graph set: what warmup builds, and that generate builds nothing after it.

- the plan lists one graph per (batch bucket, depth or tree shape, mode) for each drafter kind,
  and never one per attended width;
- after ``specgraph.compile`` (warmup on by default), generate calls over many prompt lengths,
  batch sizes, greedy and sampling build no graph: the engine's own counter and Dynamo's counters
  stay put, and greedy output equals ``model.generate``. Negative control: a request outside the
  built set (sampling with top-k baked into a graph) is seen by both counters, with a warning;
- ``attend_mask_width_pass``: eager parity of a narrow mask against the full cache, plus its
  count of matches, and a control that the sliced attention really reads the slots it keeps.
"""
from __future__ import annotations

import copy
import dataclasses
import warnings

import pytest
import torch
import torch.fx as fx
from torch._dynamo.utils import counters
from transformers import AutoConfig, AutoModelForCausalLM

import specgraph
from specgraph.capture import capture_step, new_kv_cache
from specgraph.graphset import GraphSpec, batch_buckets
from specgraph.passes import attend_mask_width_pass, run_step_pipeline, safe_dce_pass, tree_attention_pass
from specgraph.passes.gqa import gqa_fold_pass

pytestmark = pytest.mark.filterwarnings("ignore:.*past_key_values.*deprecated:FutureWarning")

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=8192)
NEG = float("-inf")


def tiny_llama(seed: int = 0, layers: int = 2):
    torch.manual_seed(seed)
    cfg = AutoConfig.for_model("llama", **{**TINY, "num_hidden_layers": layers})
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module")
def llama():
    return tiny_llama()


def names(fast, modes=("greedy", "sample")):
    return [g.name for g in fast.graph_plan(modes)]


def test_batch_buckets_are_the_loops_buckets():
    from specgraph.compiler import _bucket

    for m in (1, 2, 3, 5, 8, 12, 32):
        assert batch_buckets(m) == sorted({_bucket(b, m) for b in range(1, m + 1)})


def test_plan_per_drafter(llama):
    plain = specgraph.compile(llama, backend="eager", max_batch_size=8, max_seq_len=4096)
    assert names(plain) == [f"round_b{b}_k0_{m}" for b in (1, 2, 4, 8) for m in ("greedy", "sample")]
    ngram = specgraph.compile(llama, "ngram", backend="eager", max_batch_size=2, depths=[2, 4, 8])
    assert names(ngram, ("greedy",)) == [f"round_b{b}_k{k}_greedy" for b in (1, 2) for k in (0, 2, 4, 8)]
    tree = specgraph.compile(llama, "ngram", tree=[(0,), (1,), (0, 0)], backend="eager", max_batch_size=1)
    assert names(tree, ("greedy",)) == ["round_b1_k0_greedy", "tree_b1_n4_c2_d2_greedy"]
    suffix = specgraph.compile(llama, "suffix", tree="dynamic", backend="eager", max_batch_size=1,
                               num_speculative_tokens=8)
    assert names(suffix, ("greedy",)) == ["round_b1_k0_greedy", "tree_b1_n5_c4_d4_greedy", "tree_b1_n17_c4_d8_greedy"]
    draft = specgraph.compile(llama, tiny_llama(seed=1, layers=1), backend="eager", max_batch_size=1,
                              num_speculative_tokens=3)
    assert names(draft) == ["round_b1_k3_greedy", "draft_b1_q2_greedy", "draft_b1_q1_greedy",
                            "round_b1_k3_sample", "draft_b1_q2_sample", "draft_b1_q1_sample"]
    auto = specgraph.compile(llama, "ngram", num_speculative_tokens="auto", depths=[2, 4], backend="eager",
                             max_batch_size=1)
    assert names(auto, ("greedy",)) == ["round_b1_k0_greedy", "round_b1_k2_greedy", "round_b1_k4_greedy"]
    draft_tree = specgraph.compile(llama, tiny_llama(seed=1, layers=1), tree=[(0,), (1,), (0, 0)], backend="eager",
                                   max_batch_size=1)
    assert names(draft_tree, ("greedy",)) == ["tree_b1_n4_c2_d2_greedy", "draft_tree_b1_d0_greedy",
                                              "draft_tree_b1_d1_greedy", "compact_b1"]


def test_plan_does_not_grow_with_the_cache(llama):
    short = specgraph.compile(llama, "ngram", backend="eager", max_batch_size=4, max_seq_len=300)
    long = specgraph.compile(llama, "ngram", backend="eager", max_batch_size=4, max_seq_len=8192)
    assert names(short) == names(long)
    assert all(g.width is None for g in long.graph_plan())


def test_plan_refuses_unknown_modes(llama):
    fast = specgraph.compile(llama, backend="eager", max_batch_size=1)
    with pytest.raises(ValueError, match="modes"):
        fast.graph_plan(("greedy", "beam"))
    with pytest.raises(ValueError, match="modes"):
        specgraph.compile(llama, backend="eager", max_batch_size=1, warmup=True, modes=())


def test_graph_names_are_unique(llama):
    fast = specgraph.compile(llama, tiny_llama(seed=1, layers=1), tree=[(0,), (1,), (0, 0)], backend="eager",
                             max_batch_size=4)
    plan = fast.graph_plan()
    assert len({g.name for g in plan}) == len(plan)
    assert GraphSpec("round", 2, 512, "greedy", 4).name == "round_b2_k4_w512_greedy"


def test_warmup_builds_the_plan_eager(llama):
    fast = specgraph.compile(llama, "ngram", backend="eager", max_batch_size=2, max_seq_len=128, warmup=True,
                             progress=False)
    assert len(fast.graphs_built) == len(fast.graph_plan())


def _compiles() -> int:
    return counters["stats"]["unique_graphs"]


def test_generate_never_compiles_after_warmup(llama, monkeypatch):
    """Inductor, compile's default (warmup): 8 graphs (buckets 1, 2 x depths 0, 4 x greedy, sample);
    then 24 calls of prompt lengths 3..230, batch 1 and 2, greedy and sampling build none."""
    monkeypatch.setattr(specgraph.compiler, "WARMUP_BY_DEFAULT", True)  # the default (conftest turns it off)
    fast = specgraph.compile(llama, "ngram", max_batch_size=2, max_seq_len=300, progress=False, cache=False)
    assert len(fast.graphs_built) == len(fast.graph_plan()) == 8
    built, compiles = dict(fast.graphs_built), _compiles()
    g = torch.Generator().manual_seed(0)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="specgraph")
        for B in (1, 2):
            for P in (3, 17, 64, 120, 200, 230):
                pattern = torch.randint(2, 100, (B, 7), generator=g)
                ids = pattern.repeat(1, P // 7 + 1)[:, :P]  # repetition: prompt lookup drafts
                out = fast.generate(ids, max_new_tokens=40, do_sample=False, pad_token_id=127)
                ref = llama.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False,
                                     pad_token_id=127)
                assert torch.equal(out, ref), (B, P)
                fast.generate(ids, max_new_tokens=40, do_sample=True, temperature=0.7, generator=g, pad_token_id=127)
    assert fast.graphs_built == built
    assert _compiles() == compiles
    # negative control: top-k is baked into a sampling graph, so this request is outside the set
    with pytest.warns(UserWarning, match="building graph"):
        fast.generate(ids, max_new_tokens=4, do_sample=True, top_k=5, generator=g, pad_token_id=127)
    assert len(fast.graphs_built) > len(built)
    assert _compiles() > compiles


def test_fine_grained_widths_do_not_compile(llama, monkeypatch):
    """CPU widths grow by WIDTH_STEP past the minimum (here 16): six attended widths from 16 to
    the whole cache run on the one dynamic-width graph built by warmup, equal to generate, with
    no compile."""
    monkeypatch.setattr(specgraph.compiler, "WARMUP_BY_DEFAULT", True)
    monkeypatch.setattr(specgraph.compiler, "MIN_ATTEND", 16)
    fast = specgraph.compile(llama, None, max_batch_size=1, max_seq_len=300, modes=("greedy",), progress=False,
                             cache=False)
    built, compiles = dict(fast.graphs_built), _compiles()
    widths = set()
    for P in (3, 40, 70, 100, 140, 190, 230, 270):
        ids = torch.randint(2, 100, (1, P), generator=torch.Generator().manual_seed(P))
        widths |= {fast.round_width(P + j) for j in range(1, 22)}
        out = fast.generate(ids, max_new_tokens=20, do_sample=False, pad_token_id=127)
        ref = llama.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                             pad_token_id=127)
        assert torch.equal(out, ref), P
    assert {16, 64, 128, 192, 256} < widths and all(w % 64 == 0 or w in (16, fast.slots) for w in widths)
    assert fast.graphs_built == built and _compiles() == compiles


@torch.no_grad()
def test_attend_mask_width_pass_matches_full_width():
    model = tiny_llama()
    B, Q, S, W = 2, 3, 40, 16
    gm = capture_step(model, B, Q, S)
    for p in (tree_attention_pass, gqa_fold_pass, safe_dce_pass):
        gm, _ = p(gm)
    full = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    narrow, n = attend_mask_width_pass(gm)
    assert n == model.config.num_hidden_layers
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    L = torch.tensor([4, 9])
    pos = L[:, None] + torch.arange(Q)
    kv = [t.normal_() for t in new_kv_cache(model, B, S)]  # garbage beyond L must stay invisible
    s = torch.arange(S)
    vis = (s[None, None] < L[:, None, None]) | ((s[None, None] >= L[:, None, None]) & (s[None, None] <= pos[..., None]))
    mask = torch.zeros(B, 1, Q, S).masked_fill(~vis[:, None], NEG)
    kv_full, kv_narrow = [t.clone() for t in kv], [t.clone() for t in kv]
    out_full = full(ids, pos, mask, pos.clone(), *kv_full)[0]
    out_narrow = narrow(ids, pos, mask[..., :W].contiguous(), pos.clone(), *kv_narrow)[0]
    torch.testing.assert_close(out_narrow, out_full, atol=1e-5, rtol=1e-5)
    for a, b in zip(kv_full, kv_narrow):
        assert torch.equal(a, b)  # writes still land in the full cache
    # control: the kept slots are read (a visible slot's garbage changes the output)
    kv_bad = [t.clone() for t in kv]
    for t in kv_bad:
        t[:, :, 0] += 5.0
    out_bad = narrow(ids, pos, mask[..., :W].contiguous(), pos.clone(), *kv_bad)[0]
    assert not torch.allclose(out_bad, out_full, atol=1e-3)


def test_the_pipeline_ends_with_the_mask_width_pass():
    model = tiny_llama()
    _, counts = run_step_pipeline(capture_step(model, 1, 2, 24))
    assert counts["attend_mask_width_pass"] == model.config.num_hidden_layers


def test_dynamic_batch_plan_keeps_small_rounds_static():
    """The graph cache's layout: batch 1 and buckets feeding fewer than DYNAMIC_MIN_ROWS GEMM rows
    keep their own graph; the larger buckets of each (mode, depth) share one dynamic-batch graph,
    traced at the largest bucket below the top of its range."""
    from specgraph.graphset import GraphSpec, with_dynamic_batch

    plan = [GraphSpec("round", b, None, m, k) for b in (1, 2, 4, 8, 16, 32) for m in ("greedy", "sample") for k in (0, 4)]
    out = with_dynamic_batch(plan, 32)
    assert sorted(g.name for g in out) == sorted(
        f"round_{s}_{m}" for s in ("b1_k0", "b2_k0", "b4-32_k0", "b1_k4", "b2-32_k4") for m in ("greedy", "sample"))
    dyn = next(g for g in out if g.name == "round_b4-32_k0_greedy")
    assert dyn.batch == 16 and dyn.served_batches(32) == [4, 8, 16, 32]
    tree = GraphSpec("tree", 2, None, "greedy", 3, (8, 2, 3))
    assert [g.name for g in with_dynamic_batch([tree, dataclasses.replace(tree, batch=4)], 4)] == ["tree_b2-4_n8_c2_d3_greedy"]
    assert with_dynamic_batch(plan[:4], 2) == plan[:4]  # buckets 1 and 2: nothing to share


def test_merged_modes_pair_chain_rounds_only():
    """A chain round planned in both modes becomes one graph of mode "any"; a round in one mode,
    a tree round and a round with logits processors keep their modes. With the dynamic batch
    after it, ``max_batch_size=8`` prompt lookup at K = 4 is 5 packages instead of 10."""
    from specgraph.graphset import GraphSpec, with_dynamic_batch, with_merged_modes

    plan = [GraphSpec("round", b, None, m, k) for b in (1, 2, 4, 8) for m in ("greedy", "sample") for k in (0, 4)]
    merged = with_merged_modes(plan)
    assert [g.name for g in merged] == [f"round_b{b}_k{k}_any" for b in (1, 2, 4, 8) for k in (0, 4)]
    assert sorted(g.name for g in with_dynamic_batch(merged, 8)) == sorted(
        f"round_{s}_any" for s in ("b1_k0", "b2_k0", "b4-8_k0", "b1_k4", "b2-8_k4"))
    tree = GraphSpec("tree", 1, None, "greedy", 3, (8, 2, 3))
    lone = GraphSpec("round", 1, None, "greedy", 2)
    procs = [GraphSpec("round", 1, None, m, 0, logits="lp") for m in ("greedy", "sample")]
    kept = [tree, dataclasses.replace(tree, mode="sample"), lone, *procs]
    assert with_merged_modes(kept) == kept
