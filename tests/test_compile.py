"""End-to-end tests of ``specgraph.compile`` against ``model.generate``, plus the step passes.

Greedy decoding has exactly one right answer, so every test compares token for token with
transformers' own ``generate`` (left-padded batches, explicit ``attention_mask``, a pad id that
never occurs in the prompts) on tiny randomly initialised models of eight architectures. Most
tests use ``backend="eager"`` (the same captured + rewritten graphs, without ``torch.compile``)
to stay fast; one test runs the inductor backend.

The equality tests are shown to have power: a deliberately broken step mask makes them fail.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
from transformers import AutoConfig, AutoModelForCausalLM

import specgraph
import specgraph.compiler as sg_compiler
import specgraph.rounds as sg_rounds
from specgraph.capture import capture_step, new_kv_cache
from specgraph.passes import run_step_pipeline, safe_dce_pass, tree_attention_pass

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*past_key_values.*deprecated:FutureWarning",  # transformers 5.x rename (cache=), harmless here
)

PAD = 127  # last id of the 128-token tiny vocabularies; prompts below only use ids 2..99
NEG = float("-inf")

# Tiny configs: 2 layers, hidden 64, vocab 128 (GQA where the architecture has it).
TINY = dict(
    llama=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=128, max_position_embeddings=2048),
    mistral=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=128, max_position_embeddings=256),
    qwen2=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=128, max_position_embeddings=256),
    gpt2=dict(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=256),
    gpt_neox=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  vocab_size=128, max_position_embeddings=256, rotary_pct=0.25),
    phi3=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=128, max_position_embeddings=256, pad_token_id=0),
    gemma=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=1, head_dim=16, vocab_size=128, max_position_embeddings=256),
    opt=dict(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=128,
             max_position_embeddings=256, word_embed_proj_dim=64, pad_token_id=1),
)
ARCHS = list(TINY)

MAX_NEW = 20
MAX_SEQ = 96  # longest prompt (37) + MAX_NEW + K + 1 fits




def tiny_model(arch: str, attn: str = "sdpa", seed: int = 0):
    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(arch, **TINY[arch])
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float32).eval()
    # No default EOS on either side: model.generate falls back to generation_config.eos_token_id when
    # none is passed, and so does SpecGraphModel.generate when eos_token_id=None. (Passing
    # eos_token_id=None explicitly to model.generate disables EOS, whereas specgraph reads None as
    # "use the config" - so the tests pass EOS explicitly when they want one.)
    model.generation_config.eos_token_id = None
    return model


def left_pad(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), PAD, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, T - len(r):] = torch.tensor(r)
        mask[b, T - len(r):] = 1
    return ids, mask


def repeated(pattern: list[int], length: int) -> list[int]:
    return (pattern * (length // len(pattern) + 1))[:length]


# B = 1: a repeated 4-token pattern. B = 4: different lengths (37, 5, 12 and 1: prefill pads rows to
# the longest, 1 = no prefill at all for that row), with repetitions so n-gram drafts
# get accepted some of the time.
PROMPT_1 = [repeated([11, 42, 7, 93], 13)]
PROMPTS_4 = [
    repeated([17, 64, 3, 88, 25], 37),
    repeated([50, 9], 5),
    repeated([71, 33, 71, 2, 98, 46], 12),
    [80],
]


def hf_generate(model, ids, mask, max_new_tokens=MAX_NEW, eos_token_id=None):
    kw = {} if eos_token_id is None else {"eos_token_id": eos_token_id}
    return model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                          pad_token_id=PAD, **kw)


def sg_generate(fast, ids, mask, max_new_tokens=MAX_NEW, eos_token_id=None):
    return fast.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=PAD, eos_token_id=eos_token_id)


@torch.no_grad()
def explain_mismatch(model, ids, mask, ref, out) -> str:
    """First diverging (row, step), and the reference logit gap there: a gap ~1e-6 means an fp32
    near-tie (both answers are 'right'), a large gap means a real bug (mask, positions, cache)."""
    if ref.shape != out.shape:
        return f"shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    T = ids.shape[1]
    diff = (ref != out).nonzero()
    b, t = (int(v) for v in diff[0])
    if t < T:
        return f"prompt part changed at row {b}, col {t}"
    prefix = ref[b:b + 1, :t]
    am = torch.cat([mask[b:b + 1], torch.ones(1, t - T, dtype=mask.dtype)], dim=1)
    pos = (am.cumsum(-1) - 1).clamp_min(0)
    logits = model(input_ids=prefix, attention_mask=am, position_ids=pos).logits[0, -1]
    top = logits.topk(2)
    return (f"row {b} diverges at new token {t - T}: reference {int(ref[b, t])}, specgraph {int(out[b, t])}; "
            f"reference logit top-2 gap {float(top.values[0] - top.values[1]):.3g}, "
            f"logit(specgraph's token) - max = {float(logits[out[b, t]] - top.values[0]):.3g}")


def assert_same(model, ids, mask, ref, out, what=""):
    if not torch.equal(ref, out):
        pytest.fail(f"{what}: specgraph != model.generate\n{explain_mismatch(model, ids, mask, ref, out)}\n"
                    f"reference:\n{ref[:, ids.shape[1]:]}\nspecgraph:\n{out[:, ids.shape[1]:]}")


def pick_eos_batch(new: torch.Tensor) -> int:
    """A generated token that stops some row early while another row runs on past it (so padding
    after EOS and per-row stopping are both exercised); first such token in row-major order."""
    n = new.shape[1]

    def first(row, tok):
        hits = (new[row] == tok).nonzero()
        return int(hits[0]) if len(hits) else n

    for tok in new.flatten().tolist():
        stops = [first(r, tok) for r in range(new.shape[0])]
        if tok != PAD and min(stops) < n - 1 and max(stops) > min(stops):
            return tok
    raise AssertionError(f"no usable EOS candidate in {new}")


def pick_eos_single(new: torch.Tensor) -> int:
    """The token whose first occurrence is latest (the longest run before stopping)."""
    row = new[0].tolist()
    return max(set(row), key=row.index)


# ----------------------------------------------------------------------------------------------
# 1. greedy equality with model.generate, 8 architectures x {plain, n-gram}, batch 1 and 4, EOS


# a static tree: two candidates at depth 1, three under the best one, depth 3 (7 nodes)
TREE = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]


@pytest.mark.parametrize("draft", [None, "ngram", "model", "self", "ngram-tree", "model-tree", "self-tree",
                                   "suffix", "suffix-tree"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_hf_generate(arch, draft, monkeypatch):
    # small attended widths so rounds cross several attend_prefix_pass buckets (32 -> 64 slots)
    monkeypatch.setattr(sg_compiler, "MIN_ATTEND", 16)
    monkeypatch.setattr(sg_compiler, "WIDTH_STEP", 16)
    model = tiny_model(arch)
    kind, tree = draft, None
    if draft is not None and draft.endswith("-tree"):
        draft, tree = draft.removesuffix("-tree"), TREE
        tree = "dynamic" if draft == "suffix" else TREE
    if draft == "model":  # another random model of the same family and vocab: mostly rejections
        draft = tiny_model(arch, seed=1)
    elif draft == "self":  # the target drafting for itself: a KV or mask bug shows as rejections
        draft = model
    fast = specgraph.compile(model, draft, num_speculative_tokens=4, tree=tree, backend="eager",
                             max_batch_size=4, max_seq_len=MAX_SEQ)
    assert fast.fallback_reason is None
    accepted = 0
    for rows in (PROMPT_1, PROMPTS_4):
        ids, mask = left_pad(rows)
        assert not (ids[mask.bool()] == PAD).any()
        ref = hf_generate(model, ids, mask)
        out = sg_generate(fast, ids, mask)
        assert_same(model, ids, mask, ref, out, f"{arch} draft={draft} B={len(rows)}")
        assert fast.stats.emitted == MAX_NEW * len(rows)
        accepted += fast.stats.accepted
        if draft is None:
            assert fast.stats.accepted == 0 and fast.stats.rounds == MAX_NEW
        if kind == "self":
            assert fast.stats.accepted == fast.stats.drafted, "draft = target must accept every draft"
        if kind == "self-tree":  # the top-1 path is the target's own choice at every depth
            assert fast.stats.accepted == fast.stats.rounds * len(rows) * fast.tree.max_depth, fast.stats

        # EOS: a token the model really generates; rows padded with PAD after their EOS, as HF does.
        new = ref[:, ids.shape[1]:]
        eos = pick_eos_single(new) if len(rows) == 1 else pick_eos_batch(new)
        ref_eos = hf_generate(model, ids, mask, eos_token_id=eos)
        out_eos = sg_generate(fast, ids, mask, eos_token_id=eos)
        assert_same(model, ids, mask, ref_eos, out_eos, f"{arch} draft={draft} B={len(rows)} eos={eos}")
        assert (ref_eos[:, ids.shape[1]:] == eos).any()
        if len(rows) > 1:
            assert (ref_eos[:, ids.shape[1]:] == PAD).any(), "EOS choice should leave padding in some row"
    if kind in ("ngram", "ngram-tree", "suffix", "suffix-tree"):
        assert accepted > 0, f"{arch}: no model-free draft was ever accepted"
    widths = {width for _, width in fast._bound if width < fast.slots}
    assert len(widths) >= 2, f"expected rounds on several attended widths, got {widths}"


# ----------------------------------------------------------------------------------------------
# 2. the inductor backend


def test_inductor_llama_ngram_batch2():
    model = tiny_model("llama")
    fast = specgraph.compile(model, "ngram", backend="inductor", max_batch_size=2, max_seq_len=64)
    ids, mask = left_pad([repeated([5, 6, 7], 8), repeated([124, 119], 10)])
    ref = hf_generate(model, ids, mask, max_new_tokens=16)
    out = sg_generate(fast, ids, mask, max_new_tokens=16)
    assert_same(model, ids, mask, ref, out, "inductor llama ngram B=2")
    assert fast.stats.accepted > 0
    out2 = sg_generate(fast, ids, mask, max_new_tokens=16)  # compiled graphs and KV cache reused
    assert torch.equal(out2, ref)


def test_inductor_autotune_plain_decoding_equals_hf():
    """autotune=True: Inductor's GEMM template competes with the library GEMMs; greedy stays exact."""
    model = tiny_model("llama")
    fast = specgraph.compile(model, backend="inductor", max_batch_size=1, max_seq_len=32, autotune=True)
    ids, mask = left_pad([[5, 6, 7, 8, 9, 10]])
    ref = hf_generate(model, ids, mask, max_new_tokens=8)
    assert_same(model, ids, mask, ref, sg_generate(fast, ids, mask, max_new_tokens=8), "inductor autotune")
    assert fast.inductor_config["max_autotune"] and "CPP" in fast.inductor_config["max_autotune_gemm_backends"]


def test_autotune_auto_is_on_for_large_cpu_models_only(monkeypatch):
    from specgraph import compiler as sg_compiler

    model = tiny_model("llama")
    assert specgraph.compile(model, backend="eager").autotune is False  # tiny: only compile time would grow
    monkeypatch.setattr(sg_compiler, "AUTOTUNE_MIN_PARAMS", 1)
    assert specgraph.compile(model, backend="eager").autotune is True
    assert specgraph.compile(model, backend="eager", autotune=False).autotune is False
    with pytest.raises(ValueError, match="autotune must be"):
        specgraph.compile(model, backend="eager", autotune="yes")


# ----------------------------------------------------------------------------------------------
# 3. acceptance regression, and power of the equality test


def test_ngram_acceptance_on_periodic_continuation():
    """Tiny llama (seed 0) continues ``124 119 124 119 ...`` with the same period-2 pattern, so every
    valid n-gram draft is right. The drafter continues the latest earlier match, which here yields 2
    known tokens per round -> 3 emitted per round. A KV/mask bug would change the continuation or
    collapse acceptance toward 1 token per round."""
    model = tiny_model("llama")
    pattern = [124, 119]
    ids, mask = left_pad([pattern * 4])
    ref = hf_generate(model, ids, mask, max_new_tokens=24)
    assert ref[0, ids.shape[1]:].tolist() == pattern * 12, "precondition: the greedy continuation is periodic"
    fast = specgraph.compile(model, "ngram", backend="eager", max_batch_size=1, max_seq_len=64)
    out = sg_generate(fast, ids, mask, max_new_tokens=24)
    assert_same(model, ids, mask, ref, out, "periodic llama")
    d = fast.stats.as_dict()
    assert d["mean_emitted_per_round"] > 1.5, d
    assert d["acceptance_per_position"][0] > 0.9, d


def _hide_in_step_ancestors(orig):
    """A broken mask: queries do not see the earlier tokens of their own step (root / previous drafts)."""
    def broken(L, q_pos, valid, S, window):
        m = orig(L, q_pos, valid, S, window)
        s = sg_rounds.slot_index(S, L.device)  # S: an int, or the round's attended-slots input
        tree = (s >= L.view(-1, 1, 1)) & (s < q_pos.unsqueeze(-1))
        return m.masked_fill(tree.unsqueeze(1), NEG)
    return broken


def _hide_last_committed(orig):
    """Off-by-one in the committed length: slot L-1 is hidden from every query."""
    def broken(L, q_pos, valid, S, window):
        m = orig(L, q_pos, valid, S, window)
        s = sg_rounds.slot_index(S, L.device)  # S: an int, or the round's attended-slots input
        return m.masked_fill((s == L.view(-1, 1, 1) - 1).unsqueeze(1), NEG)
    return broken


@pytest.mark.parametrize("breakage", [_hide_in_step_ancestors, _hide_last_committed])
def test_broken_mask_breaks_greedy_equality(monkeypatch, breakage):
    model = tiny_model("llama")
    ids, mask = left_pad(PROMPTS_4)
    ref = hf_generate(model, ids, mask)
    fast = specgraph.compile(model, "ngram", backend="eager", max_batch_size=4, max_seq_len=MAX_SEQ)
    assert torch.equal(sg_generate(fast, ids, mask), ref)  # control: the real mask
    monkeypatch.setattr(sg_rounds, "step_mask", breakage(sg_rounds.step_mask))
    out = sg_generate(fast, ids, mask)  # same captured graphs; only the mask input differs
    assert out.shape == ref.shape
    assert not torch.equal(out, ref), f"{breakage.__name__} went unnoticed"


# ----------------------------------------------------------------------------------------------
# 4. passes


def _prefill_tree_step(tree, P: int, S: int, B: int, seed: int = 1):
    """Inputs of one step = P prefix tokens (causal) followed by the N tree nodes (prefix + ancestors)."""
    N = tree.num_nodes
    Q = P + N
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 100, (B, Q), generator=g)
    pos = torch.cat([torch.arange(P), P + tree.depth]).expand(B, Q).contiguous()
    vis = torch.zeros(Q, S, dtype=torch.bool)
    vis[:P, :P] = torch.ones(P, P, dtype=torch.bool).tril()
    vis[P:, :P] = True
    vis[P:, P:Q] = tree.ancestors
    mask = torch.zeros(B, 1, Q, S).masked_fill(~vis, NEG)
    slots = torch.arange(Q).expand(B, Q).contiguous()
    return ids, pos, mask, slots


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gpt_neox"])
@torch.no_grad()
def test_tree_attention_pass_parity_with_full_forward(arch):
    model = tiny_model(arch)
    tree = specgraph.TreeSpec.from_paths([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
    P, S, B = 5, 16, 2
    Q = P + tree.num_nodes
    gm = capture_step(model, B, Q, S)
    gm, n = tree_attention_pass(gm)
    assert n == model.config.num_hidden_layers
    gm, _ = safe_dce_pass(gm)
    ids, pos, mask, slots = _prefill_tree_step(tree, P, S, B)
    kv = new_kv_cache(model, B, S)
    logits, _ = gm(ids, pos, mask, slots, *kv)
    for b in range(B):
        ref = model(input_ids=ids[b:b + 1, :P]).logits[0]
        torch.testing.assert_close(logits[b, :P], ref, atol=1e-5, rtol=0)
        for i in range(tree.num_nodes):
            path = P + tree.ancestors[i].nonzero().flatten()  # root .. node i
            full = torch.cat([ids[b, :P], ids[b, path]])
            ref = model(input_ids=full[None]).logits[0, -1]
            torch.testing.assert_close(logits[b, P + i], ref, atol=1e-5, rtol=0, msg=f"row {b}, tree node {i}")
    # the cache writes survived the pipeline: slots 0..Q-1 written, the rest untouched
    for t in kv:
        written = t.abs().sum(dim=(1, 3)) > 0  # [B, S]
        assert written[:, :Q].all() and not written[:, Q:].any()


def test_tree_attention_pass_rewires_model_built_mask():
    """On a graph whose SDPA call uses its own causal masking, the pass substitutes the mask input."""
    g = fx.Graph()
    q, k, v, mask = (g.placeholder(n) for n in ("q", "k", "v", "mask"))
    out = g.call_function(torch.nn.functional.scaled_dot_product_attention, (q, k, v), {"is_causal": True})
    g.output(out)
    gm, n = tree_attention_pass(fx.GraphModule(torch.nn.Module(), g))
    assert n == 1
    q_, k_, v_ = (torch.randn(1, 2, 4, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    m = torch.zeros(1, 1, 4, 4).masked_fill(~specgraph.ancestor_mask([-1, 0, 0, 1]), NEG)
    expect = torch.nn.functional.scaled_dot_product_attention(q_, k_, v_, attn_mask=m)
    torch.testing.assert_close(gm(q_, k_, v_, m), expect)
    with pytest.raises(ValueError, match="no scaled_dot_product_attention"):
        g2 = fx.Graph()
        x = g2.placeholder("mask")
        g2.output(g2.call_function(torch.relu, (x,)))
        tree_attention_pass(fx.GraphModule(torch.nn.Module(), g2))


def test_safe_dce_keeps_unused_inplace_scatter():
    g = fx.Graph()
    x, idx, src = (g.placeholder(n) for n in ("x", "idx", "src"))
    g.call_method("scatter_", (x, 0, idx, src))  # result unused: only its side effect matters
    dead = g.call_function(torch.mul, (x, 3.0))  # truly dead
    g.output(g.call_function(torch.add, (x, 1.0)))
    del dead
    gm = fx.GraphModule(torch.nn.Module(), g)

    plain = copy.deepcopy(gm)
    plain.graph.eliminate_dead_code()
    assert not any(n.target == "scatter_" for n in plain.graph.nodes), "FX DCE now keeps it: update this test"

    safe, removed = safe_dce_pass(copy.deepcopy(gm))
    assert removed == 1
    assert any(n.target == "scatter_" for n in safe.graph.nodes)
    assert not any(n.target is torch.mul for n in safe.graph.nodes)
    buf = torch.zeros(4)
    res = safe(buf, torch.tensor([2]), torch.tensor([5.0]))
    assert buf.tolist() == [0.0, 0.0, 5.0, 0.0]
    assert res.tolist() == [1.0, 1.0, 6.0, 1.0]


@torch.no_grad()
def test_pipeline_keeps_kv_writes_of_captured_step():
    model = tiny_model("llama")
    B, Q, S = 1, 3, 8
    gm, counts = run_step_pipeline(capture_step(model, B, Q, S))
    assert counts["tree_attention_pass"] == model.config.num_hidden_layers
    # tiny llama has grouped-query attention (4 query heads, 2 KV heads): every layer is folded
    assert counts["gqa_fold_pass"] == model.config.num_hidden_layers
    # ... so no 5-D expand of the cache (HF's repeat_kv) is left for the KV heads
    assert not any(n.target == torch.ops.aten.expand.default and len(n.args[1]) == 5 for n in gm.graph.nodes)
    assert sum(n.target == torch.ops.aten.index_put_.default for n in gm.graph.nodes) == 2 * model.config.num_hidden_layers
    ids = torch.tensor([[5, 6, 7]])
    pos = torch.arange(Q)[None]
    mask = torch.zeros(B, 1, Q, S).masked_fill(~torch.ones(Q, S, dtype=torch.bool).tril(), NEG)
    kv = new_kv_cache(model, B, S)
    gm(ids, pos, mask, pos.clone(), *kv)
    ref = model(input_ids=ids, use_cache=True)
    cache = getattr(ref, "cache", None) or ref.past_key_values
    for layer in range(model.config.num_hidden_layers):
        torch.testing.assert_close(kv[2 * layer][:, :, :Q], cache.layers[layer].keys, atol=1e-6, rtol=0)
        torch.testing.assert_close(kv[2 * layer + 1][:, :, :Q], cache.layers[layer].values, atol=1e-6, rtol=0)
        assert not kv[2 * layer][:, :, Q:].any()


# ----------------------------------------------------------------------------------------------
# 5. bad input, and the eager fallback


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def _ids(*rows):
    return torch.tensor(rows)


def test_rejects_batch_above_max_batch_size(llama):
    fast = specgraph.compile(llama, backend="eager", max_batch_size=2, max_seq_len=64)
    with pytest.raises(ValueError, match="max_batch_size"):
        fast.generate(_ids([5, 6], [7, 8], [9, 10]), max_new_tokens=2)


def test_rejects_too_long_for_max_seq_len(llama):
    fast = specgraph.compile(llama, "ngram", backend="eager", max_seq_len=16)
    with pytest.raises(ValueError, match="max_seq_len"):
        fast.generate(_ids(list(range(2, 12))), max_new_tokens=10)


@pytest.mark.parametrize("kwargs, match", [
    (dict(draft="medusa"), "draft"),
    (dict(draft="ngram", num_speculative_tokens=0), "num_speculative_tokens"),
])
def test_rejects_bad_compile_arguments(llama, kwargs, match):
    with pytest.raises(ValueError, match=match):
        specgraph.compile(llama, backend="eager", **kwargs)


def test_rejects_model_in_training_mode():
    model = tiny_model("llama").train()
    with pytest.raises(ValueError, match="eval"):
        specgraph.compile(model, backend="eager")


@pytest.mark.parametrize("bad", [128, -1])
def test_rejects_token_ids_outside_vocab(llama, bad):
    fast = specgraph.compile(llama, backend="eager", max_seq_len=64)
    with pytest.raises(ValueError, match="vocabulary"):
        fast.generate(_ids([5, bad, 7]), max_new_tokens=2)


def test_generate_from_inside_its_own_streamer_raises_and_the_object_stays_usable(llama):
    """A streamer calling back into generate on the same object would share its KV caches with the
    outer call: the inner call raises; afterwards the object still equals HF (negative control:
    another object may be called from the streamer)."""
    fast = specgraph.compile(llama, "ngram", num_speculative_tokens=2, backend="eager", max_seq_len=64)
    other = specgraph.compile(llama, backend="eager", max_seq_len=64)
    ids = _ids([5, 6, 7, 5, 6, 7])
    seen = []

    class Streamer:
        def __init__(self, target):
            self.target = target

        def put(self, value):
            try:
                self.target.generate(ids, max_new_tokens=2)
                seen.append("ok")
            except RuntimeError as e:
                seen.append(str(e))
                raise

        def end(self):
            pass

    with pytest.raises(RuntimeError, match="inside a running generate"):
        fast.generate(ids, max_new_tokens=4, streamer=Streamer(fast))
    ref = llama.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(fast.generate(ids, max_new_tokens=4), ref)
    seen.clear()
    assert torch.equal(fast.generate(ids, max_new_tokens=4, streamer=Streamer(other)), ref)
    assert seen and all(s == "ok" for s in seen)


def test_rejects_temperature_that_overflows_the_logits(llama):
    """HF's sampler raises on the NaN that logits / 1e-39 produce; so does compile, before any
    round (a float32 quotient would be inf); 1e-30 is the smallest accepted temperature."""
    ids = _ids([5, 6, 7])
    with pytest.raises(RuntimeError):
        llama.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=True, temperature=1e-39,
                       pad_token_id=0)
    fast = specgraph.compile(llama, backend="eager", max_seq_len=64)
    with pytest.raises(ValueError, match="overflow"):
        fast.generate(ids, max_new_tokens=2, do_sample=True, temperature=1e-39)
    out = fast.generate(ids, max_new_tokens=3, do_sample=True, temperature=1e-30)  # argmax in effect
    assert torch.equal(out, fast.generate(ids, max_new_tokens=3))


def test_eager_attention_runs_compiled_and_stays_exact():
    """transformers' eager attention reads the step's prepared float mask: no fallback, rounds at
    full width, equal to HF (a padded batch included)."""
    model = tiny_model("llama", attn="eager")
    fast = specgraph.compile(model, "ngram", backend="eager", max_batch_size=4, max_seq_len=64)
    assert fast.fallback_reason is None and fast.full_width
    for rows in (PROMPT_1, PROMPTS_4):
        ids, mask = left_pad(rows)
        ref = hf_generate(model, ids, mask)
        out = sg_generate(fast, ids, mask)
        assert_same(model, ids, mask, ref, out, "eager attention")


@torch.no_grad()
def test_attend_prefix_pass_matches_full_width():
    from specgraph.passes import attend_prefix_pass

    model = tiny_model("llama")
    B, Q, S, W = 2, 3, 40, 16
    full, _ = run_step_pipeline(capture_step(model, B, Q, S))
    narrow, n = attend_prefix_pass(fx.GraphModule(full, copy.deepcopy(full.graph)), W)
    assert n == model.config.num_hidden_layers
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    L = torch.tensor([4, 9])  # committed prefix lengths; slots [L, L+Q) get the new tokens
    pos = L[:, None] + torch.arange(Q)
    kv_full = [t.normal_() for t in new_kv_cache(model, B, S)]  # garbage beyond L must stay invisible
    kv_narrow = [t.clone() for t in kv_full]
    s = torch.arange(S)
    vis = (s[None, None] < L[:, None, None]) | ((s[None, None] >= L[:, None, None]) & (s[None, None] <= pos[..., None]))
    mask = torch.zeros(B, 1, Q, S).masked_fill(~vis[:, None], NEG)
    out_full = full(ids, pos, mask, pos.clone(), *kv_full)[0]
    out_narrow = narrow(ids, pos, mask[..., :W].contiguous(), pos.clone(), *kv_narrow)[0]
    torch.testing.assert_close(out_narrow, out_full, atol=1e-5, rtol=1e-5)
    for a, b in zip(kv_full, kv_narrow):
        assert torch.equal(a, b)  # writes still land in the full cache


def test_rejects_draft_model_with_other_vocabulary(llama):
    other = AutoModelForCausalLM.from_config(
        AutoConfig.for_model("llama", **{**TINY["llama"], "vocab_size": 96}), attn_implementation="sdpa").eval()
    with pytest.raises(ValueError, match="vocabulary mismatch"):
        specgraph.compile(llama, other, backend="eager")


def test_rejects_draft_model_in_training_mode(llama):
    with pytest.raises(ValueError, match="eval"):
        specgraph.compile(llama, tiny_model("llama", seed=1).train(), backend="eager")


# ----------------------------------------------------------------------------------------------
# trees: power of the equality test, the inductor backend, and the prompt-lookup depth ladder


def _siblings_visible(orig):
    """Every tree node sees every earlier tree slot (a chain mask on a tree): siblings leak in."""
    def broken(L, q_pos, anc, valid, width, window):
        B, Q, N = anc.shape
        return orig(L, q_pos, torch.ones_like(anc).tril(), valid, width, window)
    return broken


def _no_compaction(orig):
    def broken(kv, L, path_nodes, n, active, scratch):
        return None
    return broken


@pytest.mark.parametrize("breakage", [_siblings_visible, _no_compaction])
def test_broken_tree_round_breaks_greedy_equality(monkeypatch, breakage):
    model = tiny_model("llama")
    ids, mask = left_pad(PROMPTS_4)
    ref = hf_generate(model, ids, mask)
    fast = specgraph.compile(model, model, tree=TREE, backend="eager", max_batch_size=4, max_seq_len=MAX_SEQ)
    assert torch.equal(sg_generate(fast, ids, mask), ref)  # control
    name = "tree_mask" if breakage is _siblings_visible else "compact_path"
    for module in (sg_rounds, sg_compiler):  # the target's round, and the draft model's tree steps
        monkeypatch.setattr(module, name, breakage(getattr(sg_rounds, name)))
    fast = specgraph.compile(model, model, tree=TREE, backend="eager", max_batch_size=4, max_seq_len=MAX_SEQ)
    out = sg_generate(fast, ids, mask)
    assert out.shape == ref.shape
    assert not torch.equal(out, ref), f"{breakage.__name__} went unnoticed"


def test_inductor_tree_rounds_with_compaction():
    """Self-drafted tree under Inductor: the in-graph KV compaction (index_put_ on graph inputs
    after the step's own cache writes) must keep every round fully accepted and the text exact."""
    model = tiny_model("llama")
    fast = specgraph.compile(model, model, tree=TREE, backend="inductor", max_batch_size=2, max_seq_len=64)
    ids, mask = left_pad([PROMPTS_4[0][:9], PROMPTS_4[1]])
    ref = hf_generate(model, ids, mask, max_new_tokens=16)
    out = sg_generate(fast, ids, mask, max_new_tokens=16)
    assert_same(model, ids, mask, ref, out, "inductor llama self-tree B=2")
    assert fast.stats.accepted == fast.stats.rounds * 2 * fast.tree.max_depth, fast.stats


def test_ngram_depth_ladder_goes_up_on_long_copies():
    """K=8 prompt lookup starts at depth 4 and moves to 8 after a fully accepted round."""
    model = tiny_model("llama")
    pattern = [124, 119]
    ids, mask = left_pad([pattern * 8])
    ref = hf_generate(model, ids, mask, max_new_tokens=40)
    fast = specgraph.compile(model, "ngram", num_speculative_tokens=8, backend="eager", max_batch_size=1, max_seq_len=96)
    assert fast.k_ladder == [4, 8]
    used = []
    orig = fast._round_fn
    fast._round_fn = lambda B, params, width, k, *rest: used.append(k) or orig(B, params, width, k, *rest)
    out = sg_generate(fast, ids, mask, max_new_tokens=40)
    assert_same(model, ids, mask, ref, out, "periodic llama K=8")
    assert used[0] == 4 and 8 in used, used
    assert fast.stats.mean_emitted > 5, fast.stats


def test_compile_depths_sets_the_ladder_and_stays_exact():
    """``depths=`` replaces the default ladder (min(K, 4), K): rounds use only those depths."""
    model = tiny_model("llama")
    ids, mask = left_pad([[124, 119] * 8])
    ref = hf_generate(model, ids, mask, max_new_tokens=40)
    fast = specgraph.compile(model, "ngram", backend="eager", max_batch_size=1, max_seq_len=96, depths=[6, 2, 3])
    assert (fast.k_ladder, fast.k, fast.span) == ([2, 3, 6], 6, 7)
    used = []
    orig = fast._round_fn
    fast._round_fn = lambda B, params, width, k, *rest: used.append(k) or orig(B, params, width, k, *rest)
    out = sg_generate(fast, ids, mask, max_new_tokens=40)
    assert_same(model, ids, mask, ref, out, "periodic llama depths 2,3,6")
    assert used[0] == 2 and set(used) <= {0, 2, 3, 6} and 6 in used, used


@pytest.mark.parametrize("draft, kwargs, depths, match", [
    (None, {}, [2], "model-free chains"), ("ngram", {"tree": [(0,), (0, 0)]}, [2], "model-free chains"),
    ("ngram", {}, [0, 2], "positive"), ("ngram", {}, [], "positive"), ("ngram", {}, ["x"], "positive"),
])
def test_compile_rejects_bad_depths(llama, draft, kwargs, depths, match):
    with pytest.raises(ValueError, match=match):
        specgraph.compile(llama, draft, backend="eager", depths=depths, **kwargs)


def test_use_graphs_serves_rounds_and_prefill_from_the_given_graphs(llama):
    """The public hook AOT loading uses: rounds are looked up in the given mapping by their key
    without a width (a miss compiles as usual; a mapping may refuse), served with the attended
    slots first, and the prompt prefill runs the given prefill graph."""
    ids, mask = left_pad([[5, 6, 7, 8, 9, 10]])
    ref = hf_generate(llama, ids, mask, max_new_tokens=6)
    donor = specgraph.compile(llama, backend="eager", max_batch_size=1, max_seq_len=64)
    served, prefills = [], []

    class Graphs(dict):
        def __contains__(self, key):
            if key[0] != "round":
                raise LookupError(f"refused {key[0]}")
            served.append(key)
            self[key] = donor.round_function(key[1], key[2], key[4])  # the attended slots come first
            return True

    def prefill(ids, pos, valid, *kv):
        prefills.append(tuple(ids.shape))
        sg_rounds.prefill_logits(donor._eager_step, ids, pos, valid, kv, fast.slots, fast.window)

    fast = specgraph.compile(llama, backend="eager", max_batch_size=1, max_seq_len=64)
    fast.use_graphs(Graphs(), prefill=prefill)
    assert_same(llama, ids, mask, ref, sg_generate(fast, ids, mask, max_new_tokens=6), "use_graphs")
    assert prefills == [(1, 5)] and served[0] == fast.graph_key("round", 1, sg_compiler.SamplingParams(0.0), None, 0)
    with pytest.raises(ValueError, match="kind"):
        fast.graph_key("draft", 1, sg_compiler.SamplingParams(0.0), 65, 0)


def test_cache_fill_step_writes_the_same_cache_without_the_prompt_logits(llama):
    """Prefill only writes the cache: the step it runs computes the last column's logits alone and
    no features, and leaves every K/V entry exactly as the full step does."""
    from specgraph.capture import Step

    fast = specgraph.compile(llama, backend="eager", max_batch_size=2, max_seq_len=64)
    ids = torch.tensor([[5, 6, 7, 8, 9], [11, 12, 13, 0, 0]])
    valid = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    pos = torch.arange(5).expand(2, 5).contiguous()
    caches, outs = [], []
    for step in (Step(llama), fast._fill_step):
        kv = [torch.zeros_like(t) for t in fast.kv_cache(2)]
        with torch.no_grad():
            outs.append(sg_rounds.prefill_logits(step, ids, pos, valid, kv, fast.slots, fast.window, hidden=True))
        caches.append(kv)
    assert all(torch.equal(a, b) for a, b in zip(*caches))
    (full, feats), (last, none) = outs
    assert full.shape[1] == 5 and last.shape[1] == 1 and none is None and feats.shape[:2] == (2, 5)
    torch.testing.assert_close(last[:, 0], full[:, -1])
    # the prompt prefill attends the prompt's slots and one scratch slot, not the whole cache: the
    # prompt slots read as with the whole cache attended
    rows = [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14]]
    attended = []
    step = fast._fill_step
    fast._fill_step = lambda ids, pos, mask, slots, *kv: attended.append(mask.shape[-1]) or step(ids, pos, mask, slots, *kv)
    kv = [torch.zeros_like(t) for t in fast.kv_cache(2)]
    fast.prefill_rows(2, rows, kv, "cpu", "target")
    assert attended == [6] and fast.slots > 6
    for a, b in zip(kv, caches[0]):
        torch.testing.assert_close(a[:, :, :5], b[:, :, :5])


@pytest.mark.parametrize("tree, match", [
    ("dynamic", "draft='suffix'"), ("bushy", "list of paths"), ([(0,), (0,)], "duplicate"), ([(0, 0)], "prefix"),
    ([(0,), (9,)], "rank at most"),
])
def test_rejects_bad_trees(llama, tree, match):
    with pytest.raises(ValueError, match=match):
        specgraph.compile(llama, "ngram", tree=tree, backend="eager")


def test_rejects_tree_without_draft(llama):
    with pytest.raises(ValueError, match="needs a draft"):
        specgraph.compile(llama, None, tree=[(0,)], backend="eager")


# ----------------------------------------------------------------------------------------------
# suffix decoding: the global index of earlier outputs, and concurrent calls


@pytest.mark.parametrize("tree", [None, "dynamic"])
def test_suffix_repeated_request_is_drafted_from_the_global_index(tree):
    model = tiny_model("llama")
    ids, mask = left_pad([PROMPTS_4[2]])
    ref = hf_generate(model, ids, mask, max_new_tokens=24)
    fast = specgraph.compile(model, "suffix", num_speculative_tokens=8, tree=tree, backend="eager",
                             max_batch_size=2, max_seq_len=96)
    first = sg_generate(fast, ids, mask, max_new_tokens=24)
    rounds_first = fast.stats.rounds
    second = sg_generate(fast, ids, mask, max_new_tokens=24)
    assert torch.equal(first, ref) and torch.equal(second, ref)
    assert fast.suffix_index.global_tokens == 2 * ref.shape[1]
    # the second answer is a copy of the first one: nearly every draft is right
    assert fast.stats.rounds <= 6 < rounds_first, (rounds_first, fast.stats)


def test_concurrent_generate_calls_on_one_object_are_exact():
    import threading

    model = tiny_model("llama")
    fast = specgraph.compile(model, "suffix", tree="dynamic", backend="eager", max_batch_size=4, max_seq_len=MAX_SEQ)
    cases = [left_pad(PROMPT_1), left_pad(PROMPTS_4), left_pad([PROMPTS_4[1]])]
    refs = [hf_generate(model, ids, mask) for ids, mask in cases]
    outs, errors = {}, []

    def work(i):
        try:
            for _ in range(2):
                outs[i] = sg_generate(fast, *cases[i])
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i, ref in enumerate(refs):
        assert torch.equal(outs[i], ref), i


def test_rejects_suffix_with_static_tree(llama):
    with pytest.raises(ValueError, match="tree='dynamic'"):
        specgraph.compile(llama, "suffix", tree=[(0,)], backend="eager")


def test_many_compiled_shapes_in_one_process_do_not_hit_dynamo_recompile_limit(monkeypatch):
    """Each (shape, width, depth) is its own compiled function: a process serving more shapes
    than torch._dynamo's recompile_limit must keep compiling, not fail."""
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 1)
    model = tiny_model("llama")
    ids, mask = left_pad([repeated([5, 6, 7], 8)])
    ref = hf_generate(model, ids, mask, max_new_tokens=12)
    for k in (1, 2):  # 2 objects x (k=0 plain, k) round graphs = 4 > 1 shape
        fast = specgraph.compile(model, "ngram", num_speculative_tokens=k, backend="inductor", max_batch_size=1,
                                 max_seq_len=48, freeze=False)
        assert torch.equal(sg_generate(fast, ids, mask, max_new_tokens=12), ref), k


def test_attended_width_minimum_is_per_device(llama):
    from specgraph import compiler as sg_compiler

    assert sg_compiler.attend_width(300, 2048) == 512  # CPU buckets: powers of two from MIN_ATTEND
    assert sg_compiler.attend_width(300, 2048, sg_compiler.MIN_ATTEND_CUDA) == 1024  # CUDA: one width up to 1024
    assert sg_compiler.attend_width(300, 600, sg_compiler.MIN_ATTEND_CUDA) == 600  # never past the cache
    assert specgraph.compile(llama, backend="eager").min_attend == sg_compiler.MIN_ATTEND  # a CPU model
    # CPU: past the minimum, the live slots rounded up to WIDTH_STEP (one dynamic-width graph serves all)
    assert sg_compiler.attend_width(300, 2048, 256, 64) == 320 and sg_compiler.attend_width(200, 2048, 256, 64) == 256
    fast = specgraph.compile(llama, backend="eager", max_seq_len=1024)
    assert fast.width_step == sg_compiler.WIDTH_STEP and fast.round_width(300) == 320


def test_compile_resolves_its_settings_into_one_config(llama):
    """resolve_config: compile's arguments resolved once (fast.config); bad ones refused there."""
    fast = specgraph.compile(llama, "suffix", num_speculative_tokens=6, backend="eager", max_batch_size=2,
                             max_seq_len=64, cache=False)
    c = fast.config
    assert (c.draft, c.k, c.k_ladder, fast.span, c.slots, c.max_batch_size) == ("suffix", 6, [4, 6], 7, 65, 2)
    assert c.suffix_index is fast.suffix_index and c.suffix_index is not None and c.chain_drafter is None
    assert (fast.k, fast.k_ladder, fast.slots) == (c.k, c.k_ladder, c.slots)
    tree = specgraph.api.resolve_config(llama, "ngram", 4, [(0,), (1,), (0, 0)], "eager", 1, 64)
    assert (tree.k, tree.tree.num_nodes, tree.tree_rank) == (2, 4, [-1, 0, 1, 0])
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        specgraph.api.resolve_config(llama, "ngram", 0, None, "eager", 1, 64)
    with pytest.raises(ValueError, match="draft='suffix' builds its own trees"):
        specgraph.api.resolve_config(llama, "suffix", 4, [(0,)], "eager", 1, 64)


# ----------------------------------------------------------------------------------------------
# block-sparse attention


def test_block_sparse_attention_equals_hf_on_rows_of_very_different_lengths(monkeypatch):
    """attention="block_sparse" (Inductor: flex attention's kernel, which skips unlisted blocks): a
    long row (three 64-slot blocks) beside short ones, each reading only the blocks it sees, equal
    to model.generate. Negative control: a plan that lists one block fewer per row (some slots a
    row sees go unread) does not equal it."""
    import specgraph.passes.sparse as sparse

    model = tiny_model("llama")
    rows = [repeated([17, 64, 3, 88, 25], 150), repeated([50, 9], 5), repeated([71, 33, 71, 2, 98, 46], 70)]
    ids, mask = left_pad(rows)
    ref = hf_generate(model, ids, mask)
    fast = specgraph.compile(model, attention="block_sparse", max_batch_size=4, max_seq_len=256, cache=False,
                             warmup=False)
    out = sg_generate(fast, ids, mask)
    assert fast.attention == "block_sparse"
    assert {c["block_sparse_attention_pass"] for c in fast.pass_counts.values()} == {model.config.num_hidden_layers}
    assert_same(model, ids, mask, ref, out, "block-sparse attention")

    listed = sparse._listed
    monkeypatch.setattr(sparse, "_listed", lambda blocks: (lambda c, o: ((c - 1).clamp_min(0), o))(*listed(blocks)))
    broken = specgraph.compile(model, attention="block_sparse", max_batch_size=4, max_seq_len=256, cache=False,
                               warmup=False)  # built anew, with the patched plan
    assert not torch.equal(sg_generate(broken, ids, mask), ref)


def test_attention_setting_resolves_and_is_checked(llama):
    from specgraph.compiler import kernel_threads, resolve_attention

    assert resolve_attention("auto", llama, "inductor") == "block_sparse"
    assert resolve_attention("auto", llama, "eager") == "sdpa"
    assert resolve_attention("sdpa", llama, "inductor") == "sdpa"
    with pytest.raises(ValueError, match="attention must be"):
        specgraph.compile(llama, backend="eager", attention="flash")
    fast = specgraph.compile(llama, attention="block_sparse", warmup=False, max_seq_len=64)
    threads = torch.get_num_threads()
    try:  # more threads than the graphs' attention kernel was built for: refused, not run
        torch.set_num_threads(kernel_threads() + 1)
        with pytest.raises(RuntimeError, match="block-sparse attention graphs are built for"):
            fast.check_threads()
    finally:
        torch.set_num_threads(threads)
    fast.check_threads()
