"""Learned drafters in ``specgraph.compile`` (specgraph.learned, specgraph.drafters.layer_skip).

Tiny random llama targets (hidden 64, GQA, vocab 128) with randomly initialised heads:

* greedy ``fast.generate`` == ``model.generate`` token for token for every drafter (EAGLE chain,
  static and dynamic trees; Medusa chain and tree; layer-skip chain and tree), batch 1 and a
  left-padded batch of 3 (one single-token prompt), and under Inductor for EAGLE;
* the compiled EAGLE proposals equal a from-scratch reference (full target forward for the
  features, the head's cache-free ``forward_seq`` for the drafting) at every round: this is what
  checks that features, tokens, positions and the head's KV cache line up, which greedy equality
  alone cannot (verification makes any draft exact);
* forced acceptance: a target whose next token depends on the current token only, with an EAGLE
  head built to reproduce it, and a layer-skip draft with all layers, must accept every draft;
* ``draft="eagle"`` / ``"medusa"`` resolution through the head search path, and its errors.

The sampling law of these drafters is checked in tests/test_compile_sampling.py.
"""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import specgraph
import specgraph.compiler as sg_compiler
from specgraph.drafters import layer_skip
from specgraph.heads import EagleHead, HeadMismatchError, MedusaHeads, save_head
from specgraph.learned import select_tree
sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib: share test_compile's helpers
from test_compile import ARCHS, PAD, PROMPT_1, PROMPTS_4, assert_same, hf_generate, left_pad, sg_generate, tiny_model

pytestmark = pytest.mark.filterwarnings("ignore:.*past_key_values.*deprecated:FutureWarning")

TREE = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]  # depth 3, 7 nodes
PROMPTS_3 = [PROMPTS_4[0], PROMPTS_4[1], PROMPTS_4[3]]  # lengths 37, 5 and 1 (no prefill, no first feed)
MAX_NEW = 20
MAX_SEQ = 96
REDUCED = torch.tensor(sorted(set(range(0, 128, 3)) | set(range(2, 100))))  # a reduced draft vocabulary


def random_head(model, kind, draft_vocab=None, seed=1, scale=0.05, **kw):
    head = (EagleHead(model.config, draft_vocab) if kind == "eagle"
            else MedusaHeads.for_target(model.config, draft_vocab=draft_vocab, **kw)).bind(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # Medusa starts as the identity: perturb everything so heads differ
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return head.eval()


def make_fast(model, kind, backend="eager", k=3, max_batch_size=4):
    """kind: eagle | eagle-tree | eagle-dynamic | medusa | medusa-tree | layerskip | layerskip-tree."""
    base, _, shape = kind.partition("-")
    tree = {"": None, "tree": TREE, "dynamic": "dynamic"}[shape]
    if base == "layerskip":
        draft = layer_skip(model, 1)
    else:
        draft = random_head(model, base, REDUCED if base == "eagle" and tree == TREE else None)
    return specgraph.compile(model, draft, num_speculative_tokens=k, tree=tree, backend=backend,
                             max_batch_size=max_batch_size, max_seq_len=MAX_SEQ)


KINDS = ["eagle", "eagle-tree", "eagle-dynamic", "medusa", "medusa-tree", "layerskip", "layerskip-tree"]


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_equals_hf_generate(kind, monkeypatch):
    monkeypatch.setattr(sg_compiler, "MIN_ATTEND", 16)
    monkeypatch.setattr(sg_compiler, "WIDTH_STEP", 16)  # rounds cross attended-width buckets
    model = tiny_model("llama")
    fast = make_fast(model, kind)
    assert fast.fallback_reason is None
    for rows in (PROMPT_1, PROMPTS_3):
        ids, mask = left_pad(rows)
        ref = hf_generate(model, ids, mask, max_new_tokens=MAX_NEW)
        out = sg_generate(fast, ids, mask, max_new_tokens=MAX_NEW)
        assert_same(model, ids, mask, ref, out, f"{kind} B={len(rows)}")
        assert fast.stats.emitted == MAX_NEW * len(rows) and fast.stats.drafted > 0
    # EOS on the batch: rows stop at different rounds, the feed of stopped rows is ignored
    new = ref[:, ids.shape[1]:]
    eos = int(new[0, 5])
    ref_eos = hf_generate(model, ids, mask, eos_token_id=eos)
    assert_same(model, ids, mask, ref_eos, sg_generate(fast, ids, mask, eos_token_id=eos), f"{kind} eos={eos}")


@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "llama"])
def test_heads_on_every_architecture(arch):
    """The heads' feature flow does not depend on the architecture (final features of GPT-2, OPT,
    Gemma, ... are post-norm like Llama's): EAGLE dynamic trees and Medusa trees stay exact."""
    model = tiny_model(arch)
    ids, mask = left_pad(PROMPTS_3)
    ref = hf_generate(model, ids, mask, max_new_tokens=10)
    for kind, tree in (("eagle", "dynamic"), ("medusa", TREE)):
        fast = specgraph.compile(model, random_head(model, kind), num_speculative_tokens=3, tree=tree, backend="eager",
                                 max_batch_size=4, max_seq_len=MAX_SEQ)
        assert_same(model, ids, mask, ref, sg_generate(fast, ids, mask, max_new_tokens=10), f"{arch} {kind}")


def test_inductor_eagle_chain():
    """The head's chain proposal and the feature-returning round compiled by Inductor (one config:
    each compiled graph costs ~20 s on a 2-core CPU, so the tree forms are left to the eager tests)."""
    model = tiny_model("llama")
    ids, mask = left_pad([PROMPTS_4[0][:9], PROMPTS_4[1]])
    ref = hf_generate(model, ids, mask, max_new_tokens=12)
    fast = make_fast(model, "eagle", backend="inductor", max_batch_size=2)
    assert_same(model, ids, mask, ref, sg_generate(fast, ids, mask, max_new_tokens=12), "inductor eagle")
    assert torch.equal(sg_generate(fast, ids, mask, max_new_tokens=12), ref)  # graphs and caches reused


# ----------------------------------------------------------------------------------------------
# the proposals equal a from-scratch EAGLE reference


class Reference:
    """EAGLE drafting recomputed from scratch for one context (committed tokens + root): the target's
    features by a full forward, the head by its cache-free ``forward_seq`` over the whole sequence."""

    def __init__(self, model, head, ctx):
        self.head, self.ctx = head, ctx
        L = len(ctx) - 1
        self.feats = model(torch.tensor([ctx[:L]]), output_hidden_states=True).hidden_states[-1][0]  # [L, H]
        self.memo = {}

    def g(self, path=()):
        """Head output after the committed context and the drafted ``path`` (tokens after the root)."""
        if path not in self.memo:
            L = len(self.ctx) - 1
            tokens = self.ctx[1:] + list(path)
            feats = torch.cat([self.feats] + [self.g(path[:j]).unsqueeze(0) for j in range(len(path))])
            n = len(tokens)
            mask = torch.full((n, n), float("-inf")).triu(1).view(1, 1, n, n)
            out, _, _ = self.head.forward_seq(torch.tensor([tokens]), feats.unsqueeze(0),
                                              torch.arange(n).unsqueeze(0), mask)
            self.memo[path] = out[0, -1]
        return self.memo[path]

    def logp(self, path=()):  # [Vd] draft log-probabilities, and the target ids they stand for
        return torch.log_softmax(self.head.logits(self.g(path)), -1), self.head.d2t

    def top(self, path, r):
        lp, d2t = self.logp(path)
        return d2t[lp.topk(r).indices].tolist()

    def chain(self, k):
        path = ()
        for _ in range(k):
            path += (self.top(path, 1)[0],)
        return list(path)

    def static_tree(self, paths):
        """Token paths of every node (ranks -> tokens), as a set."""
        out = {(): ()}
        for ranks in sorted(paths, key=lambda t: (len(t), t)):
            parent = out[ranks[:-1]]
            out[ranks] = parent + (self.top(parent, ranks[-1] + 1)[ranks[-1]],)
        return {v for k, v in out.items() if k}

    def dynamic_tree(self, k, depth, nodes):
        """EAGLE-2's rule on the host: expand the top-k children of the k best nodes per depth (by
        cumulative log-probability), keep the best ``nodes`` of all candidates."""
        cands, level = [], [((), 0.0)]
        for d in range(depth):
            if d:
                level = sorted(level, key=lambda c: -c[1])[:k]
            nxt = []
            for path, s in level:
                lp, d2t = self.logp(path)
                top = lp.topk(k)
                nxt += [(path + (int(d2t[i]),), s + float(v)) for v, i in zip(top.values, top.indices)]
            cands += nxt
            level = nxt
        return {p for p, _ in sorted(cands, key=lambda c: -c[1])[:nodes]}


def tree_paths(tokens, parents):
    """Token paths of the drafted nodes of one row's tree."""
    paths = {0: ()}
    for i in range(1, len(parents)):
        paths[i] = paths[parents[i]] + (tokens[i],)
    return {p for i, p in paths.items() if i}


@pytest.mark.parametrize("target", ["random", "bigram"])
@pytest.mark.parametrize("kind", ["eagle", "eagle-tree", "eagle-dynamic"])
def test_eagle_proposals_equal_from_scratch_reference(kind, target, monkeypatch):
    """"random": a random target and a head with large random weights and a reduced vocabulary
    (peaked attention, so a wrong position, slot, mask or feature changes the drafts; nothing is
    accepted). "bigram": the forced-acceptance pair below, perturbed so the drafts depend on the
    features and the head's attention while many are still accepted (features along accepted tree
    paths are then checked too)."""
    monkeypatch.setattr(sg_compiler, "MIN_ATTEND", 16)
    monkeypatch.setattr(sg_compiler, "WIDTH_STEP", 16)
    tree = {"eagle": None, "eagle-tree": TREE, "eagle-dynamic": "dynamic"}[kind]
    if target == "random":
        model = tiny_model("llama")
        head = random_head(model, "eagle", REDUCED, seed=3, scale=0.5)
    else:
        model, head = bigram_target_and_head()
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for p in head.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    fast = specgraph.compile(model, head, num_speculative_tokens=3, tree=tree, backend="eager", max_batch_size=4,
                             max_seq_len=MAX_SEQ)
    seen = []
    for name in ("propose_chain", "propose_tree"):
        orig = getattr(fast.learned, name)

        def record(*a, _orig=orig, _name=name):
            out = _orig(*a)
            L, active = a[-3], a[-1]
            seen.append((_name, L.clone(), active.clone(), [o.clone() if torch.is_tensor(o) else o for o in out]))
            return out

        monkeypatch.setattr(fast.learned, name, record)
    ids, mask = left_pad(PROMPTS_3)
    out = sg_generate(fast, ids, mask, max_new_tokens=12)
    seqs = [r + out[b, ids.shape[1]:].tolist() for b, r in enumerate(PROMPTS_3)]
    checked = 0
    with torch.no_grad():
        for name, L, active, res in seen:
            for b in range(len(PROMPTS_3)):
                if not active[b] or L[b] < 1:  # a one-token prompt's first proposal has no feature to read
                    continue
                ref = Reference(model, head, seqs[b][: int(L[b]) + 1])
                if kind == "eagle":
                    assert res[0][b].tolist() == ref.chain(fast.k), (b, int(L[b]))
                elif kind == "eagle-tree":
                    assert tree_paths(res[0][b].tolist(), res[1][b].tolist()) == ref.static_tree(TREE), (b, int(L[b]))
                else:
                    N = res[2][0]
                    got = tree_paths(res[0][b].tolist(), res[1][b].tolist())
                    assert got == ref.dynamic_tree(fast.learned.topk, fast.k, N - 1), (b, int(L[b]))
                checked += 1
    assert checked >= 10
    if target == "bigram":
        assert fast.stats.accepted >= 10, fast.stats


def test_dynamic_tree_parents_are_a_topological_tree():
    model = tiny_model("llama")
    fast = make_fast(model, "eagle-dynamic")
    ids, mask = left_pad(PROMPTS_3)
    trees = []
    orig = fast.learned.propose_tree
    fast.learned.propose_tree = lambda *a: trees.append(orig(*a)) or trees[-1]
    sg_generate(fast, ids, mask, max_new_tokens=6)
    N, C, D = trees[0][2]
    assert N == fast.learned.tree_nodes == min(specgraph.learned.EAGLE_TREE_NODES, fast.learned.candidates) + 1
    for tokens, parents, shape, drafted in trees:
        assert shape == (N, C, D) and tokens.shape == parents.shape == (4, N)
        for row in parents.tolist():
            assert row[0] == -1 and all(0 <= p < i for i, p in enumerate(row) if i)
            depth = [0] * N
            for i in range(1, N):
                depth[i] = depth[row[i]] + 1
            assert max(depth) <= D and max(row[1:].count(p) for p in set(row[1:])) <= C


@st.composite
def candidate_forests(draw):
    """Candidates as the dynamic drafter makes them: depth by depth, each a child of a candidate of
    the previous depth (or of the root), score = parent's + log q <= parent's (log q = 0 included)."""
    B = draw(st.integers(1, 3))
    sizes = draw(st.lists(st.integers(1, 5), min_size=1, max_size=4))  # candidates per depth
    M = sum(sizes)
    n = draw(st.integers(1, M))
    parent = torch.empty(B, M, dtype=torch.long)
    scores = torch.empty(B, M, dtype=torch.float64)
    depth = torch.empty(M, dtype=torch.float64)
    start = 0
    for d, size in enumerate(sizes):
        for j in range(start, start + size):
            depth[j] = d + 1
            for b in range(B):
                p = -1 if d == 0 else draw(st.integers(start - sizes[d - 1], start - 1))
                logq = draw(st.one_of(st.just(0.0), st.floats(-8.0, 0.0)))
                parent[b, j] = p
                scores[b, j] = (0.0 if p < 0 else float(scores[b, p])) + logq
        start += size
    return scores, parent, depth, n


@settings(max_examples=200, deadline=None, derandomize=True)
@given(candidate_forests())
def test_select_tree_keeps_the_best_ancestor_closed_set(forest):
    scores, parent, depth, n = forest
    B, M = scores.shape
    # the reference ranking: score, then shallower first (a parent before a child of equal score)
    key = scores - 1e-6 * depth
    tokens = torch.arange(M).expand(B, M) + 1000  # the token names its candidate
    root = torch.full((B,), 7)
    tree_tokens, parents = select_tree(scores, tokens, parent, depth, n, root)
    assert tree_tokens.shape == parents.shape == (B, n + 1)
    for b in range(B):
        cand = [t - 1000 for t in tree_tokens[b, 1:].tolist()]
        assert len(set(cand)) == n
        # the n best keys (ties between unrelated candidates: any of them)
        assert sorted(key[b, cand].tolist()) == sorted(key[b].tolist())[M - n:]
        assert tree_tokens[b, 0] == 7 and parents[b, 0] == -1
        for i, c in enumerate(cand, start=1):
            p = int(parents[b, i])
            assert 0 <= p < i  # topological
            assert (cand[p - 1] if p else -1) == int(parent[b, c])  # each node hangs under its own parent


# ----------------------------------------------------------------------------------------------
# forced acceptance


def bigram_target_and_head():
    """A llama whose attention and MLP outputs are zero: its final feature is norm(embed(token)), so
    its next token depends on the current token only. The EAGLE head is set to reproduce it: fc
    passes the normalised token embedding through, the head's layer adds nothing, and the output
    norm has the target's final-norm weight, so the head's logits are the target's up to a positive
    factor (1 + O(eps)). Every greedy draft of a working pipeline must then be accepted."""
    model = tiny_model("llama")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    head = EagleHead(model.config).bind(model)
    H = model.config.hidden_size
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, :H] = torch.eye(H)
        head.layer.attn.o_proj.weight.zero_()
        head.layer.down_proj.weight.zero_()
        head.out_norm.weight.copy_(model.model.norm.weight)
    return model, head.eval()


@pytest.mark.parametrize("tree", [None, TREE])
def test_forced_acceptance_eagle(tree):
    model, head = bigram_target_and_head()
    fast = specgraph.compile(model, head, num_speculative_tokens=4, tree=tree, backend="eager",
                             max_batch_size=4, max_seq_len=MAX_SEQ)
    ids, mask = left_pad(PROMPTS_3)
    ref = hf_generate(model, ids, mask, max_new_tokens=MAX_NEW)
    assert_same(model, ids, mask, ref, sg_generate(fast, ids, mask, max_new_tokens=MAX_NEW), "bigram eagle")
    # the head ignores the feature, so even the one-token prompt's first (featureless) round is right
    if tree is None:
        assert fast.stats.accepted == fast.stats.drafted, fast.stats
    else:
        assert fast.stats.accepted == fast.stats.rounds * 3 * fast.tree.max_depth, fast.stats


@pytest.mark.parametrize("tree", [None, TREE])
def test_forced_acceptance_layer_skip_all_layers(tree):
    model = tiny_model("llama")
    fast = specgraph.compile(model, layer_skip(model, model.config.num_hidden_layers), num_speculative_tokens=4,
                             tree=tree, backend="eager", max_batch_size=4, max_seq_len=MAX_SEQ)
    ids, mask = left_pad(PROMPTS_3)
    ref = hf_generate(model, ids, mask, max_new_tokens=MAX_NEW)
    assert_same(model, ids, mask, ref, sg_generate(fast, ids, mask, max_new_tokens=MAX_NEW), "layer_skip(all)")
    if tree is None:
        assert fast.stats.accepted == fast.stats.drafted, fast.stats
    else:
        assert fast.stats.accepted == fast.stats.rounds * 3 * fast.tree.max_depth, fast.stats


# ----------------------------------------------------------------------------------------------
# layer_skip


@pytest.mark.parametrize("arch", ARCHS)
def test_layer_skip_shares_weights_and_truncates(arch):
    model = tiny_model(arch)
    ids = torch.tensor([[5, 6, 7, 8]])
    before = model(ids).logits
    one = layer_skip(model, 1)
    params = {p.data_ptr() for p in model.parameters()}
    assert all(p.data_ptr() in params for p in one.parameters())  # nothing copied
    assert sum(p.numel() for p in one.parameters()) < sum(p.numel() for p in model.parameters())
    assert one.config.get_text_config(decoder=True).num_hidden_layers == 1
    assert model.config.get_text_config(decoder=True).num_hidden_layers == 2
    assert torch.equal(model(ids).logits, before)  # the target keeps all its layers
    assert torch.equal(layer_skip(model, 2)(ids).logits, before)
    assert not torch.allclose(one(ids).logits, before)


def test_layer_skip_is_the_first_layers_plus_norm_and_head():
    model = tiny_model("llama")
    ids = torch.tensor([[5, 6, 7, 8]])
    h = model(ids, output_hidden_states=True).hidden_states[1]  # after layer 1, before the final norm
    torch.testing.assert_close(layer_skip(model, 1)(ids).logits, model.lm_head(model.model.norm(h)))
    assert layer_skip(model).config.num_hidden_layers == 1  # default: max(1, layers // 4)
    for bad in (0, 3, 1.5):
        with pytest.raises(ValueError, match="num_layers"):
            layer_skip(model, bad)


def test_draft_layerskip_string():
    model = tiny_model("llama")
    fast = specgraph.compile(model, "layerskip", backend="eager", max_batch_size=1, max_seq_len=MAX_SEQ)
    assert fast.draft == "model" and fast.draft_model.config.num_hidden_layers == 1
    ids, mask = left_pad(PROMPT_1)
    assert torch.equal(sg_generate(fast, ids, mask), hf_generate(model, ids, mask))


# ----------------------------------------------------------------------------------------------
# draft= names and errors


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_draft_name_finds_the_matching_head(kind, tmp_path, monkeypatch):
    model = tiny_model("llama")
    monkeypatch.setenv("SPECGRAPH_HEADS", str(tmp_path))
    monkeypatch.setenv("SPECGRAPH_CACHE", str(tmp_path / "cache"))
    with pytest.raises(HeadMismatchError, match=f"no {kind} head matches this model") as e:
        specgraph.compile(model, kind, backend="eager")
    assert "train-drafter" in str(e.value)
    save_head(random_head(tiny_model("llama", seed=1), kind), tmp_path / "other.safetensors")
    with pytest.raises(HeadMismatchError, match="other.safetensors"):  # names the heads it saw
        specgraph.compile(model, kind, backend="eager")
    head = random_head(model, kind)
    save_head(head, tmp_path / "mine.safetensors", dtype=None)
    fast = specgraph.compile(model, kind, num_speculative_tokens=3, backend="eager", max_batch_size=1, max_seq_len=MAX_SEQ)
    assert fast.draft == kind and fast.learned.head.kind == kind
    ids, mask = left_pad(PROMPT_1)
    assert torch.equal(sg_generate(fast, ids, mask), hf_generate(model, ids, mask))


def test_rejects_bad_heads():
    model = tiny_model("llama")
    other = tiny_model("llama", seed=1)
    with pytest.raises(HeadMismatchError, match="bound to another model"):
        specgraph.compile(model, random_head(other, "eagle"), backend="eager")
    with pytest.raises(ValueError, match="not bound"):
        specgraph.compile(model, EagleHead(model.config).eval(), backend="eager")
    with pytest.raises(ValueError, match="eval mode"):
        specgraph.compile(model, random_head(model, "eagle").train(), backend="eager")
    medusa = random_head(model, "medusa", num_heads=2)
    with pytest.raises(ValueError, match="at most 2 tokens"):
        specgraph.compile(model, medusa, num_speculative_tokens=3, backend="eager")
    with pytest.raises(ValueError, match="dynamic"):
        specgraph.compile(model, medusa, tree="dynamic", backend="eager")
    with pytest.raises(ValueError, match="dynamic"):
        specgraph.compile(model, "ngram", tree="dynamic", backend="eager")


# ----------------------------------------------------------------------------------------------
# tree_nodes="auto": the dynamic tree's size from measured costs and recorded acceptance


def _brute_best_tree(rows, num_nodes, max_depth, topk):
    """Max over all ancestor-closed node sets of size <= num_nodes of the full topk-ary tree."""
    import itertools

    paths = [p for d in range(1, max_depth + 1) for p in itertools.product(range(topk), repeat=d)]

    def reach(p):
        out = 1.0
        for d, r in enumerate(p):
            out *= rows[min(d, len(rows) - 1)][r]
        return out

    best = 1.0
    for n in range(1, num_nodes + 1):
        for subset in itertools.combinations(paths, n):
            s = set(subset)
            if all(p[:-1] in s for p in subset if len(p) > 1):
                best = max(best, 1.0 + sum(reach(p) for p in subset))
    return best


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.floats(0.0, 0.45), min_size=2, max_size=2), min_size=1, max_size=3),
       st.integers(0, 5), st.integers(1, 3))
def test_best_tree_is_the_best_ancestor_closed_tree(rows, num_nodes, max_depth):
    from specgraph.perfmodel import best_tree

    emitted, parents = best_tree(rows, num_nodes, max_depth)
    assert len(parents) - 1 == min(num_nodes, sum(2 ** d for d in range(1, max_depth + 1)))
    assert emitted == pytest.approx(_brute_best_tree(rows, num_nodes, max_depth, 2), abs=1e-9)
    depth = [0]
    for i, p in enumerate(parents[1:], start=1):
        assert 0 <= p < i  # topological
        depth.append(depth[p] + 1)
    assert max(depth) <= max_depth and all(parents[1:].count(p) <= 2 for p in set(parents[1:]))


def test_plan_dynamic_tree_follows_the_cost_curve():
    from specgraph.learned import plan_dynamic_tree

    accept = [[0.7, 0.1, 0.05, 0.03], [0.6, 0.1, 0.05, 0.03], [0.55, 0.1, 0.05, 0.03]]
    grid = (4, 8, 16, 32, 48)
    head = {q: 1e-4 for q in (2, 3, 4)}
    flat = {"target": {n: 0.01 for n in [1, *(g + 1 for g in grid)]}, "head": head}  # verification free (GPU-like)
    steep = {"target": {n: 0.01 * (1 + 0.5 * (n - 1)) for n in [1, *(g + 1 for g in grid)]}, "head": head}
    a = plan_dynamic_tree(accept, flat, 3, grid=grid)
    b = plan_dynamic_tree(accept, steep, 3, grid=grid)
    assert (a["depth"], a["nodes"]) == (3, 32)  # the largest size a depth-3 expansion scores (4 + 2 x 16 = 36)
    assert b["nodes"] <= 8 and b["predicted_speedup"] < a["predicted_speedup"]
    assert all(c["nodes"] <= 4 + (c["depth"] - 1) * 16 for c in a["candidates"])


def test_tree_nodes_auto_measures_and_stays_exact():
    """A head carrying its held-out evaluation (as train-drafter's files do) gets a measured size;
    the tree it implies is verified like any other: greedy output == HF."""
    model = tiny_model("llama")
    head = random_head(model, "eagle")
    head.file_meta = {"meta": {"final_eval": {"all": {"top1_depth1": 0.6, "top4_depth1": 0.8, "top1_depth2": 0.5,
                                                      "top4_depth2": 0.7}}}}
    fast = specgraph.compile(model, head, num_speculative_tokens=3, tree="dynamic", backend="eager",
                             max_batch_size=4, max_seq_len=MAX_SEQ)
    ch = fast.tree_choice
    assert ch is not None and fast.k == ch["depth"] <= 3 and ch["nodes"] in specgraph.learned.TREE_NODE_GRID
    assert fast.learned.tree_nodes == min(ch["nodes"], fast.learned.candidates) + 1
    assert ch["rank_acceptance"][0][0] == 0.6 and len(ch["rank_acceptance"]) == 2
    best = max(ch["candidates"], key=lambda c: c["speedup"])
    assert (best["depth"], best["nodes"]) == (ch["depth"], ch["nodes"])
    ids, mask = left_pad(PROMPTS_3)
    assert_same(model, ids, mask, hf_generate(model, ids, mask, MAX_NEW), sg_generate(fast, ids, mask, MAX_NEW),
                "eagle-dynamic tree_nodes=auto")
    fixed = specgraph.compile(model, head, num_speculative_tokens=3, tree="dynamic", tree_nodes=5, backend="eager",
                              max_batch_size=4, max_seq_len=MAX_SEQ)
    assert fixed.tree_choice is None and fixed.learned.tree_nodes == 6 and fixed.k == 3
    with pytest.raises(ValueError, match="tree_nodes"):
        specgraph.compile(model, "ngram", tree_nodes=8, backend="eager")
    with pytest.raises(ValueError, match="tree_nodes"):
        specgraph.compile(model, head, tree="dynamic", tree_nodes=0, backend="eager")


def test_tree_nodes_auto_warns_when_no_tree_is_predicted_to_pay(monkeypatch):
    model = tiny_model("llama")
    head = random_head(model, "eagle")
    choice = {"depth": 1, "nodes": 4, "predicted_speedup": 0.97, "expected_emitted": 1.5, "candidates": []}
    monkeypatch.setattr(specgraph.learned, "choose_dynamic_tree", lambda *a, **k: dict(choice))
    with pytest.warns(UserWarning, match="predicted at 0.97x a plain step"):
        fast = specgraph.compile(model, head, num_speculative_tokens=3, tree="dynamic", backend="eager",
                                 max_batch_size=1, max_seq_len=MAX_SEQ)
    assert fast.k == 1 and fast.tree_choice["predicted_speedup"] == 0.97
    choice["predicted_speedup"] = 1.3
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        specgraph.compile(model, head, num_speculative_tokens=3, tree="dynamic", backend="eager", max_batch_size=1,
                          max_seq_len=MAX_SEQ)


def test_tree_costs_cache_is_keyed_and_survives_a_bad_file(tmp_path, monkeypatch):
    from specgraph.learned import cached_tree_costs

    monkeypatch.setenv("SPECGRAPH_CACHE", str(tmp_path))
    calls = []

    def measure(v):
        def run():
            calls.append(v)
            return {"target": {1: v, 5: 2 * v}, "head": {2: v / 10}, "context": 128}
        return run

    (tmp_path / "tree_costs.json").write_text("{not json")  # a corrupt cache is measured over, not fatal
    a, hit_a = cached_tree_costs({"autotune": True}, measure(0.01))
    b, hit_b = cached_tree_costs({"autotune": True}, measure(0.5))  # same key: read back, not measured
    c, hit_c = cached_tree_costs({"autotune": False}, measure(0.02))  # another configuration: measured
    assert (hit_a, hit_b, hit_c) == (False, True, False) and calls == [0.01, 0.02]
    assert b["target"] == {1: 0.01, 5: 0.02} and b["head"] == {2: 0.001} and c["target"][5] == 0.04


def test_tree_nodes_auto_times_compiled_rounds_once(tmp_path, monkeypatch):
    """Compiled objects size their trees from compiled rounds (the eager proxy misjudged them), and a
    second object with the same settings reads the cached costs instead of compiling them again."""
    import specgraph.learned as lrn

    monkeypatch.setenv("SPECGRAPH_CACHE", str(tmp_path))
    model = tiny_model("llama")
    head = random_head(model, "eagle")
    head.file_meta = {"meta": {"final_eval": {"all": {"top1_depth1": 0.6, "top4_depth1": 0.8, "top1_depth2": 0.5,
                                                      "top4_depth2": 0.7}}}}
    ch = lrn.choose_dynamic_tree(model, head, 2, grid=(4, 8), backend="inductor", freeze=False, progress=False)
    assert ch["cost_source"] == "compiled" and ch["costs"]["points"] == [1, 5, 9]
    assert set(ch["costs"]["target"]) == {"1", "5", "9"} and set(ch["costs"]["head"]) == {"2", "3", "4"}
    monkeypatch.setattr(lrn, "measure_compiled_tree_costs", lambda *a, **k: pytest.fail("costs were cached"))
    again = lrn.choose_dynamic_tree(model, head, 2, grid=(4, 8), backend="inductor", freeze=False, progress=False)
    assert again["cost_source"] == "compiled (cached)" and again["costs"] == ch["costs"]
    assert (again["depth"], again["nodes"]) == (ch["depth"], ch["nodes"])
    with pytest.raises(pytest.fail.Exception, match="cached"):  # other compile settings: measured again
        lrn.choose_dynamic_tree(model, head, 2, grid=(4, 8), backend="inductor", freeze=True, progress=False)
