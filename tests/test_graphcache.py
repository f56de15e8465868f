"""The persistent graph cache (specgraph.graphcache), on a tiny Llama (prompt lookup K = 2: depths
0 and 2, batch bucket 1, greedy and sampling: 2 packages of mode "any", each serving greedy and
sampled rows).

- a first compile builds the graphs (no JIT graph: Dynamo compiles nothing), and greedy output
  over several prompt lengths equals ``model.generate``; sampled output reproduces under a seed
  and equals the engine's eager round (negative control: the greedy lane of a package run with
  its rows at temperature 1 does not equal ``model.generate``);
- a second compile of the same model and settings loads them (builds nothing), and plain decoding
  finds its depth-0 graphs among them;
- a changed weight that the embedding-only fingerprint does not see, or a changed setting, is
  another key; served by its own graphs, output equals the changed model's ``model.generate``
  (negative control: serving the changed model from the first key's packages would not);
- a corrupt package is detected by its sha256, warned about and rebuilt alone;
- the larger batch buckets share one package per depth whose batch is a dynamic dimension (batch
  1 and buckets feeding fewer than 4 rows keep their own): batches of 1 to 8 rows equal
  ``model.generate`` row by row (negative control: the package bound to swapped cache rows does
  not), and a model that does not export with a dynamic batch gets a package per bucket, recorded
  so that the next compile does not try again.
"""
from __future__ import annotations

import json
import shutil
import time
import warnings
import zipfile
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import AutoConfig, AutoModelForCausalLM

import specgraph
from specgraph import graphcache
from specgraph.packages import Package, package_key
from specgraph.artifacts import model_fingerprint

pytestmark = pytest.mark.filterwarnings("ignore:.*past_key_values.*deprecated:FutureWarning")

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=512)
SETTINGS = dict(num_speculative_tokens=2, max_batch_size=1, max_seq_len=96, progress=False, warmup=True)


def tiny_llama(seed: int = 0):
    torch.manual_seed(seed)
    cfg = AutoConfig.for_model("llama", **TINY)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def prompts():
    g = torch.Generator().manual_seed(1)
    out = []
    for n in (3, 17, 40):
        motif = torch.randint(3, 128, (5,), generator=g)
        out.append(torch.cat([torch.randint(3, 128, (n,), generator=g), motif, motif])[None])  # lookups can match
    return out


def hf(model, ids, n=24):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)


def assert_greedy_equal(model, fast):
    for ids in prompts():
        ref = hf(model, ids)
        assert torch.equal(fast.generate(ids, max_new_tokens=24), ref), ids.shape


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("entries")


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture(scope="module")
def first(model, root):
    return specgraph.compile(model, "ngram", cache=root, **SETTINGS)


def test_first_compile_builds_the_graphs_and_generates_exactly(model, first, root):
    info = first.graph_cache
    assert info["hit"] is False and info["built"] == info["loaded"] == info["frozen"] == 2
    assert first.graphs_built == {}  # no JIT graph
    folder = Path(info["path"])
    assert sorted(p.name for p in folder.glob("*.pt2")) == ["round_b1_k0_any.frozen.pt2", "round_b1_k2_any.frozen.pt2"]
    assert json.loads((folder / graphcache.KEY_FILE).read_text()) == graphcache.entry_key(first)
    # Inductor's build folders (the wrapper .so, with the weights when frozen) are gone from its cache
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    for pkg in folder.glob("*.pt2"):
        with zipfile.ZipFile(pkg) as z:
            libs = [Path(n).name for n in z.namelist() if n.endswith(".wrapper.so")]
        assert libs and not list(Path(cache_dir()).glob(f"*/{libs[0]}")), pkg.name
    unique = counters["stats"]["unique_graphs"]  # (building a package may run Dynamo: flex attention's export)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="specgraph")  # nothing is built inside generate
        assert_greedy_equal(model, first)
        ids = prompts()[1]
        a = first.generate(ids, max_new_tokens=16, do_sample=True, temperature=0.8, generator=torch.Generator().manual_seed(3))
        b = first.generate(ids, max_new_tokens=16, do_sample=True, temperature=0.8, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b) and counters["stats"]["unique_graphs"] == unique  # the entry serves every graph
    jit = specgraph.compile(model, "ngram", cache=False, backend="eager", **{**SETTINGS, "warmup": False})
    c = jit.generate(ids, max_new_tokens=16, do_sample=True, temperature=0.8, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, c)  # the packaged sampling round is the engine's round


def test_greedy_rows_of_a_merged_package_are_verified_greedily(model, first):
    """The greedy lane runs the "any" package with every row at temperature 0. Negative control:
    the same packages with the rows at temperature 1 (and exponential noise) are a sampling
    round, whose output is not ``model.generate``'s."""
    served = first.graphs_in_use().packages
    lane = served[package_key("round", 1, 2, "greedy")]
    assert isinstance(lane, graphcache.GreedyRows) and lane.package is served[package_key("round", 1, 2, "sample")]
    gen = torch.Generator().manual_seed(0)

    def at_temperature_one(fn):
        def run(cols, root, L, active, accept_u, expo, drafts, draft_probs, *kv):
            B, q = expo.shape[:2]
            noise = -torch.log(torch.rand(B, q, 128, generator=gen).clamp_min(1e-30))
            return fn.package(cols, root, L, active, accept_u, noise, drafts, draft_probs, torch.ones(B), *kv)
        return run

    control = specgraph.compile(model, "ngram", cache=False, backend="eager", **{**SETTINGS, "warmup": False})
    swapped = {key: (at_temperature_one(p) if isinstance(p, graphcache.GreedyRows) else p) for key, p in served.items()}
    control.use_graphs(graphcache.CachedGraphs(swapped, control.default_sampling()))
    with pytest.raises(AssertionError):
        assert_greedy_equal(model, control)


def test_second_compile_loads_the_graphs(model, first, root):
    again = specgraph.compile(model, "ngram", cache=root, **SETTINGS)
    assert again.graph_cache["hit"] is True and again.graph_cache["built"] == 0 and again.graph_cache["loaded"] == 2
    assert again.graph_cache["path"] == first.graph_cache["path"] and again.graphs_built == {}
    assert_greedy_equal(model, again)
    plain = specgraph.compile(model, None, cache=root, **SETTINGS)  # depth 0, greedy and sampling: already there
    assert plain.graph_cache["hit"] is True and plain.graph_cache["loaded"] == 1 and plain.graphs_built == {}
    assert_greedy_equal(model, plain)


def test_a_killed_builds_leftovers_are_swept(model, first, root):
    """Stage folders, a helper's model copy and temporary files whose names carry no process id
    (older versions wrote such names) are removed by the next compile once an hour old; younger
    ones (maybe a build in progress) stay. (Names with a process id: test_graphcache_safety.)"""
    import os
    import time

    folder = Path(first.graph_cache["path"])
    old = [folder / ".build-dead", folder / ".helper-model-dead", folder / ".x.json.tmp"]
    young = folder / ".build-running"
    for p in (*old[:2], young):
        p.mkdir()
        (p / "part.pt2").write_bytes(b"x" * 100)
    old[2].write_text("{}")
    stale = time.time() - graphcache.STALE_SECONDS - 60
    for p in old:
        os.utime(p, (stale, stale))
    again = specgraph.compile(model, "ngram", cache=root, **SETTINGS)
    assert again.graph_cache["hit"] is True
    assert not any(p.exists() for p in old) and young.exists()
    shutil.rmtree(young)


def test_changed_weights_or_settings_are_another_entry(model, first, root):
    changed = tiny_llama()
    with torch.no_grad():
        changed.model.layers[1].mlp.down_proj.weight.mul_(-1.0)
    # the embedding-only fingerprint cannot tell the two apart; the cache key can
    assert model_fingerprint(changed) == model_fingerprint(model)
    assert graphcache.key_digest(graphcache.entry_key(first)) != graphcache.key_digest(
        graphcache.entry_key(specgraph.compile(changed, "ngram", cache=False, **{**SETTINGS, "warmup": False})))
    fast = specgraph.compile(changed, "ngram", cache=root, **{**SETTINGS, "modes": ("greedy",)})
    assert fast.graph_cache["hit"] is False and fast.graph_cache["path"] != first.graph_cache["path"]
    assert_greedy_equal(changed, fast)
    # negative control: the first entry's frozen packages carry the first model's weights
    stale = specgraph.compile(changed, "ngram", cache=False, backend="eager", **{**SETTINGS, "warmup": False})
    folder = Path(first.graph_cache["path"])
    tensors = dict(changed.named_parameters())
    packages = {}
    for record in folder.glob("round_*_any.frozen.json"):
        spec = json.loads(record.read_text())["spec"]
        pkg = graphcache.GreedyRows(Package(folder / spec["file"], tensors, spec), 128)
        packages[package_key("round", spec["batch"], spec["depth"], "greedy")] = pkg
    stale.use_graphs(graphcache.CachedGraphs(packages, stale.default_sampling()))
    ids = prompts()[2]
    assert not torch.equal(stale.generate(ids, max_new_tokens=24), hf(changed, ids))
    # other settings are another entry too (an entry's folder is its key's digest)
    longer = specgraph.compile(model, "ngram", cache=False, **{**SETTINGS, "max_seq_len": 128, "warmup": False})
    assert graphcache.key_digest(graphcache.entry_key(longer)) not in (Path(first.graph_cache["path"]).name,
                                                                      Path(fast.graph_cache["path"]).name)


def test_a_corrupt_package_is_rebuilt_not_trusted(model, first, root, tmp_path):
    src = Path(first.graph_cache["path"])
    copy_root = tmp_path / "c"
    shutil.copytree(src, copy_root / src.name)
    pkg = copy_root / src.name / "round_b1_k2_any.frozen.pt2"
    data = bytearray(pkg.read_bytes())
    data[len(data) // 2] ^= 0xFF
    pkg.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="round_b1_k2_any.frozen.pt2 is not usable.*sha256"):
        fast = specgraph.compile(model, "ngram", cache=copy_root, **SETTINGS)
    assert fast.graph_cache["hit"] is False and fast.graph_cache["built"] == 1 and fast.graph_cache["loaded"] == 2
    assert_greedy_equal(model, fast)


def test_processor_rounds_are_cached_too(model, root):
    """``compile(..., generation_config=...)``: the rounds of that processor setting are packaged into
    the entry beside the plain ones; a second process (here: object) loads them, Dynamo compiles
    nothing, and output equals ``model.generate`` with the setting. Scores (not packaged) and other
    settings still go to the JIT."""
    from transformers import GenerationConfig

    cfg = GenerationConfig(repetition_penalty=1.3, no_repeat_ngram_size=3)
    settings = {**SETTINGS, "modes": ("greedy",)}
    built = specgraph.compile(model, "ngram", cache=root, generation_config=cfg, **settings)
    assert built.graph_cache["loaded"] == 4  # 2 plain + 2 processor rounds (depths 0 and 2)
    unique = counters["stats"]["unique_graphs"]
    again = specgraph.compile(model, "ngram", cache=root, generation_config=cfg, **settings)
    assert again.graph_cache["hit"] is True and again.graph_cache["built"] == 0 and again.graph_cache["loaded"] == 4
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="specgraph")  # nothing is built inside generate
        for ids in prompts():
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                                 repetition_penalty=1.3, no_repeat_ngram_size=3)
            out = again.generate(ids, max_new_tokens=24, repetition_penalty=1.3, no_repeat_ngram_size=3)
            assert torch.equal(out, ref)
    assert counters["stats"]["unique_graphs"] == unique and again.graphs_built == {}
    names = {p.name for p in Path(again.graph_cache["path"]).glob("round_*_lp*.pt2")}
    assert len(names) == 2, names


def test_unsupported_objects_use_the_jit(model, root):
    draft = specgraph.compile(model, tiny_llama(seed=2), cache=root, backend="eager", **{**SETTINGS, "modes": ("greedy",)})
    assert draft.graph_cache is None
    assert graphcache.unsupported(draft) is not None


def test_cli_lists_and_clears_the_cache(first, root, tmp_path):
    import subprocess
    import sys

    copy = tmp_path / "listed"
    shutil.copytree(root, copy)
    r = subprocess.run([sys.executable, "-m", "specgraph.cli", "cache", "--dir", str(copy)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "round_b1_k2_any.frozen" in r.stdout and "llama float32" in r.stdout.replace("torch.", "")
    r = subprocess.run([sys.executable, "-m", "specgraph.cli", "cache", "--dir", str(copy), "--clear"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "removed" in r.stdout
    assert graphcache.entries(copy) == []


def test_cache_switch_and_root(monkeypatch, tmp_path):
    monkeypatch.setenv(graphcache.ENV_ROOT, "off")
    assert not graphcache.enabled(None) and not graphcache.enabled(False)
    assert graphcache.enabled(True) and graphcache.enabled(tmp_path)
    assert graphcache.cache_root(graphcache.root_of(True)).name == "graphs"  # the default folder, not "off"
    monkeypatch.setenv(graphcache.ENV_ROOT, str(tmp_path))
    assert graphcache.enabled(None) and graphcache.cache_root(graphcache.root_of(None)) == tmp_path
    assert graphcache.cache_root(graphcache.root_of(tmp_path / "x")) == tmp_path / "x"


def batch_of(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of different lengths, left-padded: (input_ids, attention_mask) [B, T]."""
    T = max(r.shape[1] for r in rows)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, T - r.shape[1]:], mask[i, T - r.shape[1]:] = r[0], 1
    return ids, mask


def assert_rows_equal(model, fast, B: int, seed: int = 3) -> None:
    g = torch.Generator().manual_seed(seed + B)
    rows = [prompts()[i % 3][:, int(torch.randint(0, 3, (1,), generator=g)):] for i in range(B)]
    ids, mask = batch_of(rows)
    out = fast.generate(ids, attention_mask=mask, max_new_tokens=20)
    for i, r in enumerate(rows):
        ref = hf(model, r, 20)[0, r.shape[1]:]
        assert torch.equal(out[i, ids.shape[1]:ids.shape[1] + len(ref)], ref), (B, i)


def test_batches_above_one_share_a_dynamic_batch_package(model, tmp_path):
    # SDPA attention: this tiny model's block-sparse round over batches 2-8 does not export with a
    # dynamic batch (a guard ties the batch to its 2 K/V heads), and falls back to a graph per bucket
    settings = {**SETTINGS, "max_batch_size": 8, "modes": ("greedy",), "attention": "sdpa"}
    fast = specgraph.compile(model, "ngram", cache=tmp_path, **settings)
    info = fast.graph_cache
    unique = counters["stats"]["unique_graphs"]  # from here on (the requests), Dynamo compiles nothing
    assert info["built"] == info["loaded"] == 5
    names = sorted(p.name for p in Path(info["path"]).glob("*.pt2"))
    # depth 0 feeds 1 token per row: batches 1 and 2 alone, 4-8 shared; depth 2 feeds 3: 1 alone, 2-8 shared
    assert names == sorted(f"round_{s}_greedy.frozen.pt2" for s in ("b1_k0", "b2_k0", "b4-8_k0", "b1_k2", "b2-8_k2"))
    served = fast.graphs_in_use().packages
    assert served[package_key("round", 2, 2, "greedy")] is served[package_key("round", 8, 2, "greedy")]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="specgraph")  # nothing is built inside generate
        for B in (1, 2, 3, 6, 8):
            assert_rows_equal(model, fast, B)
    assert counters["stats"]["unique_graphs"] == unique and fast.graphs_built == {}

    # negative control: the same package run on a cache whose rows 0 and 1 were swapped after prefill
    pkg = served[package_key("round", 4, 0, "greedy")]
    swapped = {key: (_swapping(p) if p is pkg else p) for key, p in served.items()}
    control = specgraph.compile(model, None, cache=False, backend="eager", **{**settings, "warmup": False})
    control.use_graphs(graphcache.CachedGraphs(swapped, control.default_sampling()))
    with pytest.raises(AssertionError):
        assert_rows_equal(model, control, 3)


def _swapping(pkg):
    def run(*args):  # cols, root, L, active, accept_u, expo, drafts, draft_probs, *kv
        kv = args[8:]
        for t in kv:
            t[[0, 1]] = t[[1, 0]]
        return pkg(*args)
    return run


def test_a_model_that_fixes_its_batch_gets_a_package_per_bucket(model, tmp_path, monkeypatch):
    from specgraph import compiler
    from specgraph.capture import UnsupportedModel, capture_step

    def static_only(m, batch, q_len, slots, max_batch=None):
        if max_batch is not None:
            raise UnsupportedModel("the batch is fixed")
        return capture_step(m, batch, q_len, slots)

    monkeypatch.setattr(compiler, "capture_step", static_only)
    settings = {**SETTINGS, "max_batch_size": 8, "modes": ("greedy",), "attention": "sdpa"}  # quicker builds
    with pytest.warns(UserWarning, match="round_b4-8_k0_greedy does not export with a dynamic batch"):
        fast = specgraph.compile(model, None, cache=tmp_path, **settings)
    folder = Path(fast.graph_cache["path"])
    assert sorted(p.name for p in folder.glob("*.pt2")) == sorted(f"round_b{b}_k0_greedy.frozen.pt2" for b in (1, 2, 4, 8))
    assert (folder / "round_b4-8_k0_greedy.static").exists()
    for B in (3, 6):
        assert_rows_equal(model, fast, B)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="specgraph")  # the record is read: no second attempt
        again = specgraph.compile(model, None, cache=tmp_path, **settings)
    assert again.graph_cache["hit"] is True and again.graph_cache["loaded"] == 4


def _records(folder: Path) -> dict:
    return {p.name: json.loads(p.read_text()) for p in folder.glob("*.frozen.json")}


def test_a_helper_process_builds_beside_the_compiling_one(model, tmp_path, monkeypatch):
    import os
    import time

    monkeypatch.setenv(graphcache.ENV_HELPER, "on")
    real = graphcache.build_package
    first = []

    def after_the_helper_started(fast, folder, *args):
        # this process waits, on its first graph, until the helper is building one: on a tiny model
        # it would otherwise build every graph before the helper's interpreter is up
        deadline = time.monotonic() + 180
        while not first and time.monotonic() < deadline and not any(folder.glob(".build-*")):
            time.sleep(0.2)
        first.append(True)
        return real(fast, folder, *args)

    monkeypatch.setattr(graphcache, "build_package", after_the_helper_started)
    settings = {**SETTINGS, "max_batch_size": 2, "modes": ("greedy",), "attention": "sdpa"}  # quicker builds
    fast = specgraph.compile(model, "ngram", cache=tmp_path, refine="now", **settings)
    info = fast.graph_cache
    unique = counters["stats"]["unique_graphs"]  # from here on (the requests), Dynamo compiles nothing
    folder = Path(info["path"])
    assert info["built"] == info["loaded"] == 4 and info["helper_built"] >= 1 and info["refining"] == 0
    pids = {r["pid"] for r in _records(folder).values()}
    assert os.getpid() in pids and len(pids) == 2  # both processes built packages
    assert not list(folder.glob(".helper-*")) and not list(folder.glob(".build-*"))  # its files are gone
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="specgraph")
        for B in (1, 2):
            assert_rows_equal(model, fast, B)
    assert counters["stats"]["unique_graphs"] == unique and fast.graphs_built == {}


def test_the_helper_refuses_another_model(model, tmp_path):
    import io

    from specgraph import buildworker, compiler

    fast = specgraph.compile(model, "ngram", cache=False, **{**SETTINGS, "warmup": False})
    other = tiny_llama(seed=1)  # same architecture and settings, other weights
    other.save_pretrained(tmp_path / "model")
    job = {"model_dir": str(tmp_path / "model"), "model_class": "transformers.LlamaForCausalLM", "dtype": "float32",
           "attn_implementation": "sdpa", "folder": str(tmp_path), "min_attend": compiler.MIN_ATTEND,
           "digest": graphcache.key_digest(graphcache.entry_key(fast)),
           "settings": {"draft": "ngram", "num_speculative_tokens": 2, "max_batch_size": 1, "max_seq_len": 96,
                        "freeze": True, "autotune": False}}
    out = io.StringIO()
    assert buildworker.serve(io.StringIO(json.dumps(job) + "\n"), out) == 1
    assert "is not the parent's" in json.loads(out.getvalue())["error"]
    # control: the parent's own model passes the check
    model.save_pretrained(tmp_path / "same")
    out = io.StringIO()
    assert buildworker.serve(io.StringIO(json.dumps({**job, "model_dir": str(tmp_path / "same")}) + "\n"), out) == 0
    assert json.loads(out.getvalue()) == {"ready": True}


def test_a_helper_that_fails_leaves_the_graphs_to_this_process(model, tmp_path, monkeypatch):
    monkeypatch.setenv(graphcache.ENV_HELPER, "on")
    monkeypatch.setattr(graphcache.sys, "executable", "/bin/false")  # the helper exits at once
    settings = {**SETTINGS, "max_batch_size": 2, "modes": ("greedy",), "attention": "sdpa"}  # quicker builds
    with pytest.warns(UserWarning, match="build helper process stopped"):
        fast = specgraph.compile(model, None, cache=tmp_path, **settings)
    info = fast.graph_cache
    assert info["built"] == info["loaded"] == 2 and info["helper_built"] == 0
    assert {r["pid"] for r in _records(Path(info["path"])).values()} == {__import__("os").getpid()}
    assert_rows_equal(model, fast, 2)


def test_batch_one_first_and_the_rest_in_the_background(model, tmp_path, monkeypatch):
    """``refine="background"``: compile returns once the batch-1 packages are built; until the
    helper's packages arrive, a round of B rows runs as B batch-1 rounds, each on its own cache
    row (:class:`specgraph.graphcache.RowSplit`), and output equals ``model.generate``; each
    package is adopted between calls, and nothing is compiled in this process on the way.
    Negative control: row-by-row rounds fed their neighbour's cache row do not equal it."""
    from specgraph.warping import SamplingParams

    monkeypatch.setenv(graphcache.ENV_HELPER, "on")
    settings = {**SETTINGS, "max_batch_size": 8, "modes": ("greedy",), "attention": "sdpa"}  # quicker builds
    fast = specgraph.compile(model, "ngram", cache=tmp_path, refine="background", **settings)
    info = fast.graph_cache
    unique = counters["stats"]["unique_graphs"]  # from here on (the requests), Dynamo compiles nothing
    # batch 1 at depths 0 and 2 first; then b4-8_k0, b2-8_k2 and b2_k0 from the helper
    assert info["built"] + info["refining"] == 5 and info["refining"] >= 1 and info["loaded"] >= 2
    served = fast.graphs_in_use()
    key = fast.graph_key("round", 4, SamplingParams(0.0), None, 2)
    assert key in served and isinstance(dict.__getitem__(served, key), graphcache.RowSplit)
    assert fast.row_by_row(4, SamplingParams(0.0), 2) and not fast.row_by_row(1, SamplingParams(0.0), 2)
    with warnings.catch_warnings(), monkeypatch.context() as m:
        warnings.filterwarnings("error", message="specgraph")  # nothing is built inside generate
        m.setattr(fast, "refresh_graphs", lambda: [])  # nothing adopted yet: every bucket row by row
        for B in (2, 3, 6):
            assert_rows_equal(model, fast, B)
        kv = 2 * model.config.num_hidden_layers

        def neighbours_row(self, cols, *args):
            B = args[0].shape[0]
            rows = [self.one(cols, *(a[i:i + 1] for a in args[:-kv]),
                             *(t[(i + 1) % B:(i + 1) % B + 1] for t in args[-kv:])) for i in range(B)]
            return type(rows[0])(torch.cat(p) for p in zip(*rows))

        m.setattr(graphcache.RowSplit, "__call__", neighbours_row)
        with pytest.raises(AssertionError):
            assert_rows_equal(model, fast, 3)
    assert served.wait(timeout=600) and served.refining() == 0
    assert fast.refresh_graphs() == [2, 4, 8]
    assert not isinstance(dict.get(served, key), graphcache.RowSplit) and key in served
    assert not fast.row_by_row(4, SamplingParams(0.0), 2)
    assert served.packages[package_key("round", 4, 2, "greedy")] is served.packages[package_key("round", 8, 2, "greedy")]
    assert len(list(Path(info["path"]).glob("*.pt2"))) == 5
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="specgraph")
        for B in (1, 2, 3, 8):
            assert_rows_equal(model, fast, B)
    assert counters["stats"]["unique_graphs"] == unique and fast.graphs_built == {}
    again = specgraph.compile(model, "ngram", cache=tmp_path, refine="background", **settings)
    assert again.graph_cache["hit"] is True and again.graph_cache["refining"] == 0


def test_background_without_a_helper_builds_now_and_says_so(model, tmp_path, monkeypatch):
    monkeypatch.setenv(graphcache.ENV_HELPER, "off")
    settings = {**SETTINGS, "max_batch_size": 2, "modes": ("greedy",), "attention": "sdpa"}  # quicker builds
    with pytest.warns(UserWarning, match="no helper process can build"):
        fast = specgraph.compile(model, None, cache=tmp_path, refine="background", **settings)
    assert fast.graph_cache["built"] == 2 and fast.graph_cache["refining"] == 0
    with pytest.raises(ValueError, match="refine must be one of"):
        specgraph.compile(model, None, cache=tmp_path, refine="later", **settings)


def test_stopping_a_background_build_leaves_no_files_and_keeps_serving(model, tmp_path, monkeypatch):
    """The helper stopped mid-build (as at this process's exit): its build folder and model copy
    are removed, and the buckets it did not deliver keep running row by row, equal to HF."""
    monkeypatch.setenv(graphcache.ENV_HELPER, "on")
    settings = {**SETTINGS, "max_batch_size": 4, "modes": ("greedy",)}
    fast = specgraph.compile(model, None, cache=tmp_path, refine="background", **settings)
    folder = Path(fast.graph_cache["path"])
    served = fast.graphs_in_use()
    deadline = time.monotonic() + 120
    while not list(folder.glob(".build-*")) and time.monotonic() < deadline:
        time.sleep(0.1)  # the helper is building a refinement
    for work in served.refiners:
        work.helper.close()
    assert not list(folder.glob(".build-*")) and not list(folder.glob(".helper-*"))
    fast.refresh_graphs()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="specgraph")
        for B in (2, 3):
            assert_rows_equal(model, fast, B)


def test_a_refinement_the_helper_cannot_export_is_given_up_not_retried(tmp_path):
    """A static refinement whose export fails in the helper stops the helper (its buckets stay
    row by row) instead of being taken again and again. Negative control: the answer for a
    graph this process must build (not a refinement) is handed back and the helper goes on."""
    import threading

    from specgraph.graphset import GraphSpec

    def helper_on(work, answers):
        h = graphcache._Helper.__new__(graphcache._Helper)
        h.fast, h.folder, h.digest, h.work, h.stopping = None, tmp_path, "d", work, threading.Event()
        h._send = lambda obj: None
        h._receive = lambda: answers.pop(0)
        return h

    static = GraphSpec("round", 2, None, "greedy", 0)
    work = graphcache._Work([], [(static, True)], {}, graphcache.Progress(0, False))
    failed = {"error": "UserError: fixed batch", "export": True}
    with pytest.raises(RuntimeError, match="fixed batch"):
        helper_on(work, [failed, failed, failed])._serve()  # before: asked again until the answers ran out
    assert work.later == [(static, True)] and work.refining == 0

    work = graphcache._Work([(static, True)], [], {}, graphcache.Progress(1, False))
    h = helper_on(work, [failed])
    h._receive = lambda: (h.stopping.set(), failed)[1]  # one answer, then this process stops the helper
    h._serve()
    assert work.todo == [(static, True)] and work.in_helper == 0
