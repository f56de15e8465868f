"""ONNX export of the compiled speculative step and generation with onnxruntime.

Tiny random models (as in test_compile.py): llama (batch 2, n-gram drafts, greedy and sampling
graphs, weights in a shared external file), qwen2 (batch 1, n-gram drafts, greedy graphs), gpt2
(plain decoding, ``draft=None``), and on llama: a static prompt-lookup tree (greedy and sampling
tree graphs), suffix decoding with dynamic trees (greedy) and a smaller draft model (chain, greedy
and sampling draft-step graphs). Greedy output must equal ``model.generate`` and the compiled torch
path token for token; given the same random inputs a graph must accept exactly the tokens the
compiler's own round function (and ``verify_chain_with_noise`` / ``verify_tree_with_noise`` on the
graph's logits) accepts; the graph's logits must match the torch step within 1e-4.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxscript")

from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

import specgraph  # noqa: E402
from specgraph.capture import capture_step  # noqa: E402
from specgraph.onnx import OnnxSpecGenerator, load_manifest  # noqa: E402
from specgraph.onnx_export import PrefillChunk, VerifyRound, export_onnx, tree_graph_name  # noqa: E402
from specgraph.passes import run_step_pipeline  # noqa: E402
from specgraph.trees import tree_buffers  # noqa: E402
from specgraph.verify import verify_chain_with_noise, verify_tree_with_noise  # noqa: E402
from specgraph.warping import SamplingParams  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:.*past_key_values.*deprecated:FutureWarning")

PAD = 127
MAX_NEW = 20
TINY = dict(
    llama=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=128, max_position_embeddings=256),
    qwen2=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=128, max_position_embeddings=256),
    gpt2=dict(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=256, bos_token_id=0, eos_token_id=0),
)


# a smaller draft for the tiny llama: same vocabulary, one layer, its own KV layout
TINY_DRAFT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, vocab_size=128, max_position_embeddings=256)
# a static tree: two candidates at depth 1, three under the best one, depth 3 (7 nodes, C = 2)
TREE = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]


def tiny_model(arch, seed=0, overrides=None):
    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(arch, **(overrides or TINY[arch]))
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # as in test_compile: EOS only when a test passes one
    return model


def repeated(pattern, length):
    return (pattern * (length // len(pattern) + 1))[:length]


def left_pad(rows):
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), PAD, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, T - len(r):] = torch.tensor(r)
        mask[b, T - len(r):] = 1
    return ids, mask


# 37 tokens (two prefill chunks of 16 + a partial one) and 5 tokens, both periodic: drafts get accepted
ROWS_2 = [repeated([17, 64, 3, 88, 25], 37), repeated([50, 9], 5)]
ROW_1 = [repeated([11, 42, 7, 93], 13)]
ROW_LADDER = [repeated([50, 9], 30)]  # on the tiny qwen2, a copy long enough to climb the depth ladder to 6


class Exported:
    def __init__(self, arch, draft, k, batch, chunk, modes, external, tmp, tree=None):
        self.model = tiny_model(arch)
        if draft == "model":
            draft = tiny_model(arch, seed=1, overrides=TINY_DRAFT)
        self.fast = specgraph.compile(self.model, draft, num_speculative_tokens=k, tree=tree, backend="eager",
                                      max_batch_size=batch, max_seq_len=96)
        self.dir = tmp / arch
        self.manifest = export_onnx(self.fast, self.dir, batch_size=batch, progress=False, modes=modes,
                                    prefill_chunk=chunk, external_data=external)

    def generator(self, **kw):
        return OnnxSpecGenerator(self.dir, num_threads=1, **kw)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return Exported("llama", "ngram", 4, 2, 16, ("greedy", "sample"), True, tmp_path_factory.mktemp("onnx"))


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    # K = 6: prompt lookup climbs the compiler's depth ladder 4 -> 6 (graphs verify_k0, _k4, _k6)
    return Exported("qwen2", "ngram", 6, 1, 8, ("greedy",), None, tmp_path_factory.mktemp("onnx"))


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    return Exported("gpt2", None, 4, 1, 8, ("greedy",), None, tmp_path_factory.mktemp("onnx"))


@pytest.fixture(scope="module")
def ngram_tree(tmp_path_factory):
    return Exported("llama", "ngram", 4, 2, 16, ("greedy", "sample"), None, tmp_path_factory.mktemp("onnx"), tree=TREE)


@pytest.fixture(scope="module")
def suffix_tree(tmp_path_factory):
    # K = 4: tree shapes (5 nodes, 4 children, depth 4) and (17, 4, 4), as the compiler packs them
    return Exported("llama", "suffix", 4, 2, 16, ("greedy",), None, tmp_path_factory.mktemp("onnx"), tree="dynamic")


@pytest.fixture(scope="module")
def suffix_chain(tmp_path_factory):
    # the best path of the suffix tree as a chain, on the depth ladder (verify_k0, _k4)
    return Exported("llama", "suffix", 4, 2, 16, ("greedy", "sample"), None, tmp_path_factory.mktemp("onnx"))


@pytest.fixture(scope="module")
def draft_chain(tmp_path_factory):
    return Exported("llama", "model", 3, 2, 16, ("greedy", "sample"), None, tmp_path_factory.mktemp("onnx"))


# ----------------------------------------------------------------------------------------------
# the files


def test_manifest_checker_and_external_weights(llama):
    man = load_manifest(llama.dir)
    assert man["opset"] == 18 and man["depths"] == [0, 4] and man["batch_size"] == 2
    assert man["slots"] == 97 and man["model"]["vocab_size"] == 128 and man["kv"]["dtype"] == "float32"
    names = {g["name"] for g in man["graphs"]}
    assert names == {"verify_k0", "verify_k4", "verify_k0_sample", "verify_k4_sample", "prefill_c16"}
    assert set(man["files"]) == {g["file"] for g in man["graphs"]} | {"weights.bin"}
    for g in man["graphs"]:
        path = llama.dir / g["file"]
        onnx.checker.check_model(str(path), full_check=True)
        m = onnx.load(str(path), load_external_data=False)
        assert [i.name for i in m.graph.input] == [i["name"] for i in g["inputs"]]
        assert [o.name for o in m.graph.output] == [o["name"] for o in g["outputs"]]
        assert {o.domain: o.version for o in m.opset_import}[""] == 18
        ext = {e.value for t in m.graph.initializer for e in t.external_data if e.key == "location"}
        assert ext == {"weights.bin"}
    k4 = next(g for g in man["graphs"] if g["name"] == "verify_k4_sample")
    assert [i["name"] for i in k4["inputs"][:7]] == ["root", "L", "active", "drafts", "accept_u", "expo", "temperature"]
    assert k4["inputs"][5]["shape"] == [2, 5, 128]
    assert [o["name"] for o in k4["outputs"][:4]] == ["tokens", "num_emitted", "logits", "present_key_0"]
    # five graphs, one copy of the weights (stored by content)
    params = sum(p.numel() * 4 for p in llama.model.parameters())
    assert man["files"]["weights.bin"]["bytes"] < 1.5 * params


def test_tampered_or_truncated_file_is_refused(llama, qwen2, tmp_path):
    d = tmp_path / "q"
    shutil.copytree(qwen2.dir, d)
    OnnxSpecGenerator(d)  # intact copy loads
    p = d / "verify_k4.onnx"
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x01
    p.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="verify_k4.onnx: sha256 does not match"):
        OnnxSpecGenerator(d)
    d2 = tmp_path / "l"
    shutil.copytree(llama.dir, d2)
    w = d2 / "weights.bin"
    w.write_bytes(w.read_bytes()[:-100])
    with pytest.raises(ValueError, match="weights.bin: .* bytes.*truncated"):
        OnnxSpecGenerator(d2)
    w.unlink()
    with pytest.raises(ValueError, match="weights.bin: listed in the manifest but missing"):
        OnnxSpecGenerator(d2)
    man = json.loads((d / "manifest.json").read_text())
    del man["files"]["prefill_c8.onnx"]
    (d / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(ValueError, match="'prefill_c8.onnx' is not listed in its files"):
        OnnxSpecGenerator(d)


@pytest.mark.parametrize("field,value", [("graph", "../outside.onnx"), ("graph", "/tmp/outside.onnx"),
                                         ("external", "../weights.bin"), ("files", "../weights.bin")])
def test_manifest_paths_outside_the_export_are_refused(llama, tmp_path, field, value):
    """Every path the ONNX manifest names is a listed file inside the directory: a graph or
    weights path pointing elsewhere is refused before any session opens it (negative control:
    the unedited copy loads)."""
    d = tmp_path / "x"
    shutil.copytree(llama.dir, d)
    OnnxSpecGenerator(d, check_files=False)
    man = json.loads((d / "manifest.json").read_text())
    if field == "graph":
        man["files"][value] = man["files"][man["graphs"][0]["file"]]
        man["graphs"][0]["file"] = value
    elif field == "external":  # listed too: the path itself is what is refused
        man["files"][value] = man["files"]["weights.bin"]
        man["external_data"] = value
    else:
        man["files"][value] = man["files"]["weights.bin"]
    (d / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(ValueError, match="outside the directory"):
        OnnxSpecGenerator(d)


def test_symbolic_link_in_an_export_is_refused(llama, tmp_path):
    d = tmp_path / "x"
    shutil.copytree(llama.dir, d)
    real = tmp_path / "weights.bin"
    (d / "weights.bin").rename(real)
    (d / "weights.bin").symlink_to(real)
    with pytest.raises(ValueError, match="symbolic link"):
        OnnxSpecGenerator(d)


# ----------------------------------------------------------------------------------------------
# one graph against the torch step


@torch.no_grad()
def test_graph_logits_cache_and_verification_match_torch(llama):
    """Random cache state, two rows at different lengths: ORT logits and caches vs the same round in
    torch within 1e-4; ORT's emitted tokens equal verify_chain_with_noise on ORT's logits given
    the same noise (greedy and sampled, with accept-u scaled so accepts happen at every depth)."""
    man, fast, B, k, S, V = llama.manifest, llama.fast, 2, 4, 97, 128
    g = llama.generator()
    step = run_step_pipeline(capture_step(llama.model, B, k + 1, S))[0]
    gen = torch.Generator().manual_seed(0)
    shape = man["kv"]["shape"]
    kv = [torch.randn(shape, generator=gen) for _ in man["kv"]["past"]]
    root, L = torch.tensor([5, 77]), torch.tensor([30, 61])
    active = torch.tensor([True, True])
    drafts = torch.randint(0, V, (B, k), generator=gen)
    base = dict(root=root, L=L, active=active, drafts=drafts, **dict(zip(man["kv"]["past"], kv)))

    torch_greedy = VerifyRound(step, k, S, fast.window, sample=False)
    ref = torch_greedy(root, L, active, drafts, *[t.clone() for t in kv])
    out = g.run("verify_k4", base)
    logits = torch.from_numpy(out["logits"])
    assert (logits - ref[2]).abs().max() < 1e-4
    for name, want in zip(man["kv"]["present"], ref[3:]):
        assert (torch.from_numpy(out[name]) - want).abs().max() < 1e-4
    tok, n = verify_chain_with_noise(logits, None, drafts, None, 0.0)
    assert torch.equal(torch.from_numpy(out["tokens"]), tok) and torch.equal(torch.from_numpy(out["num_emitted"]), n)
    assert torch.equal(tok, ref[0])

    torch_sample = VerifyRound(step, k, S, fast.window, sample=True)
    seen = set()
    for trial in range(12):
        scale = [1.0, 0.05, 0.01, 0.002][trial % 4]
        accept_u = torch.rand(B, k, generator=gen) * scale
        expo = -torch.log(torch.rand(B, k + 1, V, generator=gen).clamp_min(1e-38))
        temp = torch.full((B,), [1.0, 0.7, 1.3][trial % 3])
        d = torch.randint(0, V, (B, k), generator=gen)
        for _ in range(trial % (k + 1)):  # make the first drafts the race's winners: acceptance at several depths
            r_tok, r_n = torch_sample(root, L, active, d, accept_u, expo, temp, *[t.clone() for t in kv])[:2]
            for b in range(B):
                if r_n[b] <= k:
                    d[b, r_n[b] - 1] = r_tok[b, r_n[b] - 1]
        out = g.run("verify_k4_sample", {**base, "drafts": d, "accept_u": accept_u, "expo": expo, "temperature": temp})
        logits = torch.from_numpy(out["logits"])
        tok, n = verify_chain_with_noise(logits, None, d, (accept_u, expo), float(temp[0]))
        assert torch.equal(torch.from_numpy(out["tokens"]), tok), trial
        assert torch.equal(torch.from_numpy(out["num_emitted"]), n), trial
        ref = torch_sample(root, L, active, d, accept_u, expo, temp, *[t.clone() for t in kv])
        assert (logits - ref[2]).abs().max() < 1e-4
        assert torch.equal(tok, ref[0])
        seen.update(n.tolist())
    assert len(seen) >= 3, seen  # rejections at several depths were exercised

    # depth 0 (plain step) and the prefill chunk
    out = g.run("verify_k0_sample", {"root": root, "L": L, "active": active, **dict(zip(man["kv"]["past"], kv)),
                                     "expo": expo[:, :1], "temperature": torch.ones(B)})
    tok, n = verify_chain_with_noise(torch.from_numpy(out["logits"]), None, drafts[:, :0], (accept_u[:, :0], expo[:, :1]), 1.0)
    assert torch.equal(torch.from_numpy(out["tokens"]), tok) and n.tolist() == [1, 1]
    C = man["prefill_chunk"]
    pre = PrefillChunk(run_step_pipeline(capture_step(llama.model, B, C, S))[0], C, S, fast.window)
    ids, start, nv = torch.randint(0, V, (B, C), generator=gen), torch.tensor([16, 0]), torch.tensor([16, 3])
    ref = pre(ids, start, nv, *[t.clone() for t in kv])
    out = g.run(f"prefill_c{C}", {"input_ids": ids, "start": start, "num_valid": nv, **dict(zip(man["kv"]["past"], kv))})
    for name, want in zip(man["kv"]["present"], ref):
        assert (torch.from_numpy(out[name]) - want).abs().max() < 1e-4


# ----------------------------------------------------------------------------------------------
# generation


@torch.no_grad()
def test_greedy_batch_equals_hf_generate_and_torch_path_llama(llama):
    ids, mask = left_pad(ROWS_2)
    ref = llama.model.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=PAD)
    g = llama.generator()
    out = g.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, pad_token_id=PAD)
    assert torch.equal(out, ref), (out[:, ids.shape[1]:], ref[:, ids.shape[1]:])
    assert g.stats.accepted > 0  # drafts were accepted, so verify_k4 emitted several tokens
    fast = llama.fast.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, pad_token_id=PAD)
    assert torch.equal(out, fast)
    assert g.stats.rounds == llama.fast.stats.rounds  # same depth chosen every round
    # a single row on a batch-2 export (padded with an inactive row), and EOS stops + pads
    one = g.generate(ids[:1], attention_mask=mask[:1], max_new_tokens=MAX_NEW, pad_token_id=PAD)
    assert torch.equal(one, ref[:1])
    eos = int(ref[1, ids.shape[1] + 3])
    ref_eos = llama.model.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False,
                                   pad_token_id=PAD, eos_token_id=eos)
    out_eos = g.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, pad_token_id=PAD, eos_token_id=eos)
    assert torch.equal(out_eos, ref_eos)


@torch.no_grad()
@pytest.mark.parametrize("which", ["qwen2", "gpt2"])
def test_greedy_equals_hf_generate(which, request):
    ex = request.getfixturevalue(which)
    ids = torch.tensor(ROW_LADDER)
    ref = ex.model.generate(ids, max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=PAD)
    g = ex.generator()
    out = g.generate(ids, max_new_tokens=MAX_NEW, pad_token_id=PAD)
    assert torch.equal(out, ref), (out[:, ids.shape[1]:], ref[:, ids.shape[1]:])
    if ex.manifest["draft"] == "ngram":
        assert ex.manifest["depths"] == [0, 4, 6] and ex.manifest["k_ladder"] == [4, 6]
        assert g.stats.accepted > 0 and len(g.stats.accepted_at) == 6  # the depth-6 graph ran
    else:
        assert ex.manifest["depths"] == [0] and g.stats.rounds == MAX_NEW and g.stats.drafted == 0
    fast = ex.fast.generate(ids, max_new_tokens=MAX_NEW, pad_token_id=PAD)
    assert torch.equal(out, fast)
    assert (g.stats.rounds, g.stats.drafted, g.stats.accepted) == (ex.fast.stats.rounds, ex.fast.stats.drafted,
                                                                   ex.fast.stats.accepted)  # same depth every round


@torch.no_grad()
def test_sampled_generation_reproducible_and_equal_to_torch_path(llama):
    ids, mask = left_pad(ROWS_2)
    g = llama.generator()
    kw = dict(attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=True, temperature=0.8, top_k=None, pad_token_id=PAD)
    a = g.generate(ids, generator=torch.Generator().manual_seed(7), **kw)
    b = g.generate(ids, generator=torch.Generator().manual_seed(7), **kw)
    c = g.generate(ids, generator=torch.Generator().manual_seed(8), **kw)
    assert torch.equal(a, b) and not torch.equal(a, c)
    # the compiled torch path draws the same noise in the same order: same tokens
    t = llama.fast.generate(ids, generator=torch.Generator().manual_seed(7), **kw)
    assert torch.equal(a, t)
    # explicit uniforms: a callable handing out the same draws reproduces the generator's output
    src = torch.Generator().manual_seed(7)
    d = g.generate(ids, uniforms=lambda B, k, V: specgraph.verify.chain_noise(B, k, V, "cpu", src), **kw)
    assert torch.equal(a, d)


def test_refusals(llama, qwen2):
    ids = torch.tensor(ROW_1)
    g = llama.generator(check_files=False)
    with pytest.raises(ValueError, match="exported with top_k=None"):
        g.generate(ids, do_sample=True, top_k=5)
    g.generate(ids, max_new_tokens=2, do_sample=True, top_k=1000, top_p=1.0)  # no-op filters are the baked ones
    with pytest.raises(ValueError, match="exceeds the exported batch size 2"):
        g.generate(torch.ones(3, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="exceeds the exported max_seq_len"):
        g.generate(ids, max_new_tokens=90)
    with pytest.raises(ValueError, match="no sample graphs"):
        qwen2.generator().generate(ids, do_sample=True)
    with pytest.raises(NotImplementedError, match="draft-model trees"):
        export_onnx(specgraph.compile(llama.model, tiny_model("llama", seed=1), tree=[(0,), (1,), (0, 0)],
                                      backend="eager"), "unused")
    with pytest.raises(NotImplementedError, match="weights='int8'"):
        export_onnx(specgraph.compile(llama.model, "ngram", weights="int8", backend="eager"), "unused")


@torch.no_grad()
def test_broken_prefill_breaks_greedy_equality(llama, monkeypatch):
    """Negative control: the equality test has power (a cache missing all but the first prefill
    chunk changes the output)."""
    ids, mask = left_pad(ROWS_2)
    ref = llama.model.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=PAD)
    orig = OnnxSpecGenerator.prefill
    monkeypatch.setattr(OnnxSpecGenerator, "prefill", lambda self, rows, kv: orig(self, [r[:17] for r in rows], kv))
    out = llama.generator().generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, pad_token_id=PAD)
    assert not torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])


# ----------------------------------------------------------------------------------------------
# trees and draft models: graphs against the compiler's own round functions


def random_parents(B, N, C, gen):
    """[B, N] topologies, a different random tree per row, at most C children per node."""
    out = torch.full((B, N), -1, dtype=torch.long)
    for b in range(B):
        kids = [0] * N
        for i in range(1, N):
            free = [j for j in range(i) if kids[j] < C]
            p = free[int(torch.randint(len(free), (1,), generator=gen))]
            out[b, i] = p
            kids[p] += 1
    return out


def random_cache(names, shape, gen):
    return [torch.randn(shape, generator=gen) for _ in names]


def assert_caches_close(out, present, want, scratch):
    """ORT's present caches vs the torch round's in-place updated ones, within 1e-4; the scratch slot
    is left out (batch padding and rejected tree nodes all write there, in no defined order)."""
    for name, w in zip(present, want):
        got = torch.from_numpy(out[name])
        assert (got[:, :, :scratch] - w[:, :, :scratch]).abs().max() < 1e-4, name


@torch.no_grad()
def test_tree_graph_matches_compiler_tree_round(ngram_tree):
    """Random cache, a different random topology per row (the topology is an input), rows at
    different lengths, one round with an inactive row: ORT's logits and compacted caches match
    the compiler's ``_tree_round_fn`` (same step, mask, verification and in-graph compaction)
    within 1e-4, and given identical uniforms (greedy and sampled) ORT emits exactly the tokens
    and keeps exactly the path nodes the torch round does, and that verify_tree_with_noise gives
    on ORT's logits."""
    ex, B, V = ngram_tree, 2, 128
    man, fast, S = ex.manifest, ex.fast, ex.fast.slots
    shape = tuple(man["tree"]["shapes"][0])
    N, C, D = shape
    assert shape == (7, 2, 3) and man["tree"]["kind"] == "static" and man["tree"]["rank"] == fast.tree_rank
    g = ex.generator()
    gen = torch.Generator().manual_seed(0)
    past, present = man["kv"]["past"], man["kv"]["present"]
    seen = set()
    for trial in range(10):
        sample = trial >= 2
        kv = random_cache(past, man["kv"]["shape"], gen)
        root, L = torch.randint(0, V, (B,), generator=gen), torch.tensor([30, 61])
        active = torch.tensor([True, trial != 3])
        parents = random_parents(B, N, C, gen)
        tree_tokens = torch.randint(0, V, (B, N), generator=gen)
        feeds = dict(root=root, L=L, active=active, tree_tokens=tree_tokens, parents=parents, **dict(zip(past, kv)))
        params = SamplingParams(1.0 if sample else 0.0)
        fn = fast._tree_round_fn(B, params, S, shape)
        ref_kv = [t.clone() for t in kv]
        if sample:
            # accept_u scaled down so that acceptances happen at every depth
            accept_u = torch.rand(B, N, C, generator=gen) * [1.0, 0.05, 0.01, 0.002][trial % 4]
            expo = -torch.log(torch.rand(B, N, V, generator=gen).clamp_min(1e-38))
            temp = torch.full((B,), [1.0, 0.7, 1.3][trial % 3])
            out = g.run(tree_graph_name(shape, True), {**feeds, "accept_u": accept_u, "expo": expo, "temperature": temp})
            ref = fn(root, L, active, accept_u, expo, tree_tokens, parents, temp, *ref_kv)
            noise, t = (accept_u, expo), float(temp[0])
        else:
            out = g.run(tree_graph_name(shape, False), feeds)
            ref = fn(root, L, active, torch.zeros(B, N, C), torch.ones(B, N, 1), tree_tokens, parents, *ref_kv)
            noise, t = None, 0.0
        logits = torch.from_numpy(out["logits"])
        # the graph's logits against the same step run by torch (the compiler's tree round computes them inside)
        step = fast._step(B, N)
        from specgraph.rounds import tree_logits
        want_logits = tree_logits(step, root, L, active, tree_tokens, parents, C, [x.clone() for x in kv], S, S, fast.window)[0]
        assert (logits - want_logits).abs().max() < 1e-4, trial
        children = tree_buffers(parents, C)[2]
        ids = torch.cat([root.unsqueeze(1), tree_tokens[:, 1:]], dim=1)
        tok, n, nodes = verify_tree_with_noise(logits if not sample else logits / temp.view(-1, 1, 1), None, ids,
                                               children, D, noise, 1.0 if sample else 0.0)
        for name, want in (("tokens", ref[0]), ("num_emitted", ref[1]), ("path_nodes", ref[2])):
            assert torch.equal(torch.from_numpy(out[name]), want), (trial, name)
        assert torch.equal(ref[0], tok) and torch.equal(ref[1], n) and torch.equal(ref[2], nodes), trial
        assert_caches_close(out, present, ref_kv, S - 1)
        seen.update(n[active].tolist())
    assert len(seen) >= 3, seen  # paths of several lengths were accepted and compacted


@torch.no_grad()
def test_draft_step_and_verify_graphs_match_compiler(draft_chain):
    """Draft-model graphs: draft_q2 / draft_q1 against the compiler's ``draft_graph`` (token, logits
    or q row within 1e-4, draft cache within 1e-4; greedy and sampled with identical Exp(1) noise),
    and verify_k3_sample with draft_probs against the compiler's ``_round_fn``: given identical
    uniforms, the same accepted tokens."""
    ex, B, V, K = draft_chain, 2, 128, 3
    man, fast, S = ex.manifest, ex.fast, ex.fast.slots
    dm = man["draft_model"]
    assert dm["num_layers"] == 1 and dm["kv"]["shape"] == [2, 1, 97, 16] and man["depths"] == [K]
    assert {g["name"] for g in man["graphs"]} == {
        "verify_k3", "verify_k3_sample", "draft_q2", "draft_q2_sample", "draft_q1", "draft_q1_sample",
        "prefill_c16", "draft_prefill_c16"}
    g = ex.generator()
    gen = torch.Generator().manual_seed(1)
    dpast, dpresent = dm["kv"]["past"], dm["kv"]["present"]
    for Q in (2, 1):
        for sample in (False, True):
            kv = random_cache(dpast, dm["kv"]["shape"], gen)
            tokens, last = torch.randint(0, V, (B, Q), generator=gen), torch.tensor([12, 40])
            active = torch.tensor([True, True])
            feeds = dict(tokens=tokens, last=last, active=active, **dict(zip(dpast, kv)))
            ref_kv = [t.clone() for t in kv]
            if sample:
                temp = 0.7
                expo = -torch.log(torch.rand(B, V, generator=gen).clamp_min(1e-38))
                out = g.run(f"draft_q{Q}_sample", {**feeds, "expo": expo, "temperature": torch.full((B,), temp)})
                tok, q = fast.draft_graph(B, Q, SamplingParams(temp), S)(tokens, last, active, expo, *ref_kv)
                assert (torch.from_numpy(out["q"]) - q).abs().max() < 1e-4
            else:
                out = g.run(f"draft_q{Q}", feeds)
                tok, logits = fast.draft_graph(B, Q, SamplingParams(0.0), S)(tokens, last, active, torch.ones(B, 1), *ref_kv)
                assert (torch.from_numpy(out["logits"]) - logits).abs().max() < 1e-4
            assert torch.equal(torch.from_numpy(out["token"]), tok), (Q, sample)
            assert_caches_close(out, dpresent, ref_kv, S - 1)

    past, present = man["kv"]["past"], man["kv"]["present"]
    fn = fast._round_fn(B, SamplingParams(1.0), S, K)
    seen = set()
    for trial in range(12):
        kv = random_cache(past, man["kv"]["shape"], gen)
        root, L, active = torch.randint(0, V, (B,), generator=gen), torch.tensor([20, 50]), torch.tensor([True, True])
        q = torch.softmax(3 * torch.randn(B, K, V, generator=gen), dim=-1)  # the draft's rows: peaked, not one-hot
        # drafts drawn from q (as the draft graph draws them), so q(draft) is large and rejections happen
        drafts = (q / -torch.log(torch.rand(B, K, V, generator=gen).clamp_min(1e-38))).argmax(-1)
        accept_u = torch.rand(B, K, generator=gen) * [1.0, 0.3, 0.05][trial % 3]
        expo = -torch.log(torch.rand(B, K + 1, V, generator=gen).clamp_min(1e-38))
        temp = torch.full((B,), [1.0, 0.6][trial % 2])
        out = g.run("verify_k3_sample", dict(root=root, L=L, active=active, drafts=drafts, draft_probs=q,
                                             accept_u=accept_u, expo=expo, temperature=temp, **dict(zip(past, kv))))
        ref_kv = [t.clone() for t in kv]
        tok, n = fn(root, L, active, accept_u, expo, drafts, q, temp, *ref_kv)
        assert torch.equal(torch.from_numpy(out["tokens"]), tok) and torch.equal(torch.from_numpy(out["num_emitted"]), n)
        logits = torch.from_numpy(out["logits"])
        want, _ = verify_chain_with_noise(logits / temp.view(-1, 1, 1), q, drafts, (accept_u, expo), 1.0)
        assert torch.equal(want, tok), trial
        assert_caches_close(out, present, ref_kv, S - 1)
        seen.update(n.tolist())
    assert len(seen) >= 3, seen


# ----------------------------------------------------------------------------------------------
# trees and draft models: generation


def check_greedy(ex, rows_list):
    """ORT == fast.generate == model.generate for each batch; the same rounds and draft counts."""
    g = ex.generator()
    accepted = 0
    for rows in rows_list:
        ids, mask = left_pad(rows)
        ref = ex.model.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=PAD)
        out = g.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, pad_token_id=PAD)
        fast = ex.fast.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, pad_token_id=PAD)
        assert torch.equal(out, ref), (out[:, ids.shape[1]:], ref[:, ids.shape[1]:])
        assert torch.equal(fast, ref)
        assert (g.stats.rounds, g.stats.drafted, g.stats.accepted) == (ex.fast.stats.rounds, ex.fast.stats.drafted,
                                                                       ex.fast.stats.accepted), (g.stats, ex.fast.stats)
        accepted += g.stats.accepted
    return g, accepted


@torch.no_grad()
@pytest.mark.parametrize("which", ["ngram_tree", "suffix_tree", "suffix_chain"])
def test_tree_and_suffix_greedy_equals_hf_generate_and_torch_path(which, request):
    ex = request.getfixturevalue(which)
    g, accepted = check_greedy(ex, [ROWS_2, ROWS_2[:1], [ROWS_2[1]]])
    assert accepted > 0  # drafts were accepted (trees: compacted paths were exercised end to end)
    assert type(g.proposer) is type(ex.fast.proposer)  # the compiled loop's own drafter, not a twin
    if which == "suffix_chain":
        assert ex.manifest["depths"] == [0, 4] and ex.manifest["tree"] is None
        assert g.suffix_index.global_tokens == ex.fast.suffix_index.global_tokens > 0
    if which == "suffix_tree":
        # finished requests went into the generator's own index, as into the compiled object's
        assert g.suffix_index.global_tokens == ex.fast.suffix_index.global_tokens > 0
        shapes = {tuple(s) for s in ex.manifest["tree"]["shapes"]}
        assert shapes == {(5, 4, 4), (17, 4, 4)}


@torch.no_grad()
def test_suffix_tree_drafts_repeated_request_from_the_index(suffix_tree):
    """A request repeated on the same generator is drafted from its index of finished requests:
    far fewer rounds the second time, same output (as test_compile's suffix test for the torch path)."""
    ids = torch.tensor([repeated([3, 77, 41, 8, 120, 9, 66], 12)])
    g = suffix_tree.generator()
    first = g.generate(ids, max_new_tokens=24, pad_token_id=PAD)
    rounds_first = g.stats.rounds
    second = g.generate(ids, max_new_tokens=24, pad_token_id=PAD)
    ref = suffix_tree.model.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=PAD)
    assert torch.equal(first, ref) and torch.equal(second, ref)
    assert g.stats.rounds <= 6 < rounds_first, (rounds_first, g.stats)
    assert g.suffix_index.global_tokens == 2 * ref.shape[1]


@torch.no_grad()
def test_draft_model_greedy_equals_hf_generate_and_torch_path(draft_chain):
    from specgraph.onnx import OnnxDraftModelProposer

    g, _ = check_greedy(draft_chain, [ROWS_2, ROWS_2[:1]])
    assert isinstance(g.proposer, OnnxDraftModelProposer)  # the draft's steps: the exported graphs


@torch.no_grad()
@pytest.mark.parametrize("which", ["ngram_tree", "draft_chain"])
def test_sampled_tree_and_draft_generation_equal_torch_path(which, request):
    """Same seed, same draws in the same order (draft Exp(1) rows, then chain or tree noise): the
    ONNX generator emits exactly what the compiled torch path emits; acceptances and rejections
    both happen."""
    ex = request.getfixturevalue(which)
    ids, mask = left_pad(ROWS_2)
    g = ex.generator()
    drafted = accepted = 0
    for seed, temp in ((7, 0.8), (8, 0.3)):
        kw = dict(attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=True, temperature=temp, top_k=None, pad_token_id=PAD)
        a = g.generate(ids, generator=torch.Generator().manual_seed(seed), **kw)
        t = ex.fast.generate(ids, generator=torch.Generator().manual_seed(seed), **kw)
        assert torch.equal(a, t), (seed, a[:, ids.shape[1]:], t[:, ids.shape[1]:])
        assert (g.stats.rounds, g.stats.accepted) == (ex.fast.stats.rounds, ex.fast.stats.accepted)
        drafted += g.stats.drafted
        accepted += g.stats.accepted
    assert 0 < accepted < drafted, (accepted, drafted)


@torch.no_grad()
def test_sampled_suffix_chain_is_calibrated_like_the_torch_path(suffix_chain, monkeypatch):
    """Sampled suffix chains scale their drafting threshold by each row's observed acceptance
    (specgraph.proposers.suffix.calibrate_suffix): the ONNX generator must do the same, or its rounds draft
    other chains and, same seed, emit other tokens than the compiled torch path. A calibration that
    forgets at once (DECAY 0.01) makes one rejected round stop a row's drafting, so the difference
    shows on a tiny random model (without it in the generator, seed 8 below differs)."""
    from specgraph.suffix import AcceptanceCalibration, SuffixIndex

    monkeypatch.setattr(AcceptanceCalibration, "DECAY", 0.01)
    ex = suffix_chain
    ex.fast.suffix_index = SuffixIndex()  # both start from an empty index
    g = ex.generator()
    # "17 64" continues three ways: suffix scores below 1, which a calibrated threshold cuts
    ids, mask = left_pad([repeated([17, 64, 3, 17, 64, 88, 17, 64, 25], 37), repeated([50, 9, 50, 11], 9)])
    for seed in (7, 8, 9):
        kw = dict(attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=True, temperature=0.3, top_k=None, pad_token_id=PAD)
        a = g.generate(ids, generator=torch.Generator().manual_seed(seed), **kw)
        t = ex.fast.generate(ids, generator=torch.Generator().manual_seed(seed), **kw)
        assert torch.equal(a, t), (seed, a[:, ids.shape[1]:], t[:, ids.shape[1]:])
        assert (g.stats.rounds, g.stats.drafted, g.stats.accepted) == (
            ex.fast.stats.rounds, ex.fast.stats.drafted, ex.fast.stats.accepted)
