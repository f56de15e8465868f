"""Ahead-of-time compiled directories (``specgraph compile`` / :mod:`specgraph.aot`).

One tiny random llama (2 layers, vocab 128) with a character-level tokenizer is saved as an HF
folder; ``specgraph compile`` (through ``subprocess``) writes a directory with 4 AOTInductor
packages (prompt lookup K = 2: depths 0 and 2, greedy and sampling, one attended width). The
tests then check, against that directory:

* round trip: loaded in a fresh process, greedy output equals ``model.generate`` token for token
  and sampled output equals the eager specgraph path given the same seed (same noise);
* the loaded package mutates the KV cache in place exactly like the eager round;
* refusals, each naming what is wrong: a modified / truncated file (sha256 / size), versions that
  differ from the running torch / transformers / specgraph, a model whose fingerprint differs
  (weights, configuration), a package archive holding anything but code and JSON (pickles), a
  request the directory was not compiled for;
* the CLI end to end: ``--help``, ``generate DIR --stream``, one-line error exits.

Compiling the 4 packages takes ~1-1.5 min on a 2-core CPU; everything else reuses them.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import specgraph
from specgraph import aot
from specgraph.artifacts import ArtifactError

pytestmark = pytest.mark.filterwarnings("ignore:.*past_key_values.*deprecated:FutureWarning")

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=1024)
MAX_SEQ = 64
PERIODIC = [17, 64, 3, 88, 25, 9, 41]


def tiny_model(seed=0, **overrides):
    torch.manual_seed(seed)
    cfg = AutoConfig.for_model("llama", **{**TINY, **overrides})
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # run to max_new_tokens
    return model


def cli(*args, timeout=900, env=None):
    return subprocess.run([sys.executable, "-m", "specgraph.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env)


def one_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, f"expected a one-line reason, got:\n{stderr}"
    return lines[0]


@pytest.fixture(scope="module")
def src(tmp_path_factory, char_tokenizer) -> Path:
    d = tmp_path_factory.mktemp("tiny_src")
    tiny_model().save_pretrained(d)
    char_tokenizer().save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def compiled(src, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("aot") / "dir"
    r = cli("compile", src, "--out", out, "--draft", "ngram", "--num-speculative-tokens", 2,
            "--max-seq-len", MAX_SEQ, "--modes", "greedy,sample", "--quiet")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "wrote" in r.stderr
    return out


def copy_dir(compiled: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(compiled, dst)
    return dst


def rewrite_manifest(d: Path, edit) -> None:
    man = json.loads((d / aot.MANIFEST).read_text())
    edit(man)
    (d / aot.MANIFEST).write_text(json.dumps(man))


# ----------------------------------------------------------------------------------------------
# planning (no compile)


def test_plan_covers_every_shape_the_loop_can_ask_for(monkeypatch):
    model = tiny_model()
    fast = specgraph.compile(model, "ngram", num_speculative_tokens=8, backend="eager", max_batch_size=3, max_seq_len=600)
    names = {g.name for g in aot.plan_graphs(fast, ("greedy",))}
    # buckets 1, 2, 3 x (a prefill chunk + depths 0 and the ladder 4 -> 8); the attended width is an input
    assert len(names) == 3 * (1 + 3)
    assert {"prefill_b1_c16", "prefill_b3_c16"} <= names
    assert {"round_b1_k0_greedy", "round_b3_k8_greedy", "round_b2_k4_greedy"} <= names
    # exactly the engine's graph set, plus the prefill chunks
    assert names - {n for n in names if n.startswith("prefill")} == {g.name for g in fast.graph_plan(("greedy",))}
    fast.set_depths([2, 4, 8])  # what --depths 2,4,8 sets
    assert {g.depth for g in aot.plan_graphs(fast, ("greedy", "sample")) if g.kind == "round"} == {0, 2, 4, 8}
    tree = specgraph.compile(model, "ngram", tree=[(0,), (1,), (0, 0)], backend="eager", max_batch_size=1, max_seq_len=64)
    plan = aot.plan_graphs(tree, ("greedy", "sample"))
    assert {(g.kind, g.mode, g.depth) for g in plan} == {("prefill", "greedy", 16), ("round", "greedy", 0),
                                                         ("tree", "greedy", 2), ("round", "sample", 0),
                                                         ("tree", "sample", 2)}
    suffix = specgraph.compile(model, "suffix", tree="dynamic", num_speculative_tokens=8, backend="eager",
                               max_batch_size=1, max_seq_len=64)
    assert sorted(g.tree for g in aot.plan_graphs(suffix, ("greedy",)) if g.kind == "tree") == [(5, 4, 4), (17, 4, 8)]


def test_compile_dir_argument_errors(tmp_path):
    model = tiny_model()
    with pytest.raises(ValueError, match="draft"):
        aot.compile_dir(model, tmp_path / "a", draft=model)
    with pytest.raises(ValueError, match="depths"):
        aot.compile_dir(model, tmp_path / "a", draft=None, depths=[2])
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        aot.compile_dir(model, tmp_path / "b", overwrite=True)  # not a compiled directory: never deleted
    assert (tmp_path / "b" / "notes.txt").exists()


# ----------------------------------------------------------------------------------------------
# the compiled directory


def test_manifest_lists_versions_fingerprint_shapes_and_every_file(compiled):
    man = json.loads((compiled / aot.MANIFEST).read_text())
    assert man["format"] == aot.FORMAT and man["format_version"] == aot.FORMAT_VERSION
    assert man["versions"]["torch"] == torch.__version__
    assert man["versions"]["specgraph"] == specgraph.__version__
    assert set(man["model"]["fingerprint"]) == {"sha256", "config", "embeddings", "dtype"}
    assert man["model"]["dtype"] == "float32"
    assert sorted(g["name"] for g in man["graphs"]) == [
        "prefill_b1_c16", "round_b1_k0_greedy", "round_b1_k0_sample", "round_b1_k2_greedy",
        "round_b1_k2_sample"]
    assert man["settings"]["k_ladder"] == [2] and man["settings"]["width"] == {"min": 2, "max": MAX_SEQ}
    assert "model/tokenizer.json" in man["tokenizer"]["files"]
    assert man["tokenizer"]["loader"] == "fast"  # tokenizer.json alone reproduces the tokenizer
    on_disk = {p.relative_to(compiled).as_posix() for p in compiled.rglob("*") if p.is_file()} - {aot.MANIFEST}
    assert set(man["files"]) == on_disk
    assert all(len(f["sha256"]) == 64 and f["bytes"] > 0 for f in man["files"].values())
    # weights stored once, as safetensors; the packages carry code only
    weights = man["files"]["model/model.safetensors"]["bytes"]
    assert all(man["files"][g["file"]]["bytes"] < 5 * 2**20 for g in man["graphs"])
    assert weights > 300_000
    for g in man["graphs"]:
        with zipfile.ZipFile(compiled / g["file"]) as z:
            assert not [n for n in z.namelist() if n.endswith((".pkl", ".pt", ".bin", ".safetensors"))]


ROUNDTRIP = textwrap.dedent("""
    import json, sys, warnings, torch
    warnings.simplefilter("ignore")
    from specgraph.aot import load_dir
    ld = load_dir(sys.argv[1], tokenizer=False)
    modeling = [m for m in sys.modules if m.startswith("transformers.models.llama")]
    ids = torch.tensor([json.loads(sys.argv[2])])
    greedy = ld.fast.generate(ids, max_new_tokens=20)
    stats = ld.fast.stats
    sampled = ld.fast.generate(ids, max_new_tokens=20, do_sample=True, temperature=0.8,
                               generator=torch.Generator().manual_seed(3))
    print(json.dumps({"greedy": greedy[0].tolist(), "sampled": sampled[0].tolist(), "drafted": stats.drafted,
                      "graphs": ld.loaded_graphs, "modeling": modeling}))
""")


def test_roundtrip_in_a_fresh_process_equals_the_model(compiled, src):
    prompt = (PERIODIC * 6)[:40]  # 39 prefill tokens: three calls of the 16-token prefill package
    r = subprocess.run([sys.executable, "-c", ROUNDTRIP, str(compiled), json.dumps(prompt)], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False, pad_token_id=0)
    assert got["greedy"] == ref[0].tolist()
    assert got["drafted"] > 0 and "round_b1_k2_greedy" in got["graphs"]  # the k=2 package ran
    assert "prefill_b1_c16" in got["graphs"]
    assert got["modeling"] == []  # no transformers modeling code: the packages did all the work
    # sampling: same noise as the eager specgraph path (same graphs, no compile) -> same tokens
    eager = specgraph.compile(model, "ngram", num_speculative_tokens=2, backend="eager", max_batch_size=1, max_seq_len=MAX_SEQ)
    ref_s = eager.generate(ids, max_new_tokens=20, do_sample=True, temperature=0.8, generator=torch.Generator().manual_seed(3))
    assert got["sampled"] == ref_s[0].tolist()


def test_frozen_directory_carries_its_weights_and_equals_the_model(src, tmp_path):
    """``--freeze``: the weights are inside every package (nothing bound at load), and a fresh
    process serving the directory gives ``model.generate``'s tokens."""
    out = tmp_path / "frozen"
    r = cli("compile", src, "--out", out, "--draft", "ngram", "--num-speculative-tokens", 2, "--max-seq-len", MAX_SEQ,
            "--modes", "greedy", "--freeze", "--quiet")
    assert r.returncode == 0, r.stderr[-3000:]
    man = json.loads((out / aot.MANIFEST).read_text())
    assert man["settings"]["freeze"] is True
    assert all(g["frozen"] and g["num_constants"] == 0 for g in man["graphs"])
    prompt = (PERIODIC * 6)[:40]
    r = subprocess.run([sys.executable, "-c", ROUNDTRIP.replace("do_sample=True", "do_sample=False"), str(out),
                        json.dumps(prompt)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False, pad_token_id=0)
    assert got["greedy"] == ref[0].tolist() and "round_b1_k2_greedy" in got["graphs"]


def test_loaded_package_mutates_the_kv_cache_in_place(compiled, src):
    ld = aot.load_dir(compiled, tokenizer=False)
    params = specgraph.SamplingParams(0.0)
    fn = ld.fast._round_fn(1, params, MAX_SEQ + 1, 2)  # served by the package
    assert ld.loaded_graphs == ["round_b1_k2_greedy"]
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    eager = specgraph.compile(model, "ngram", num_speculative_tokens=2, backend="eager", max_batch_size=1,
                              max_seq_len=MAX_SEQ)
    ref_fn = eager._round_fn(1, params, MAX_SEQ + 1, 2)
    torch.manual_seed(0)
    kv = [torch.randn_like(t) for t in ld.fast.kv_cache(1)]
    orig = [t.clone() for t in kv]
    kv_ref = [t.clone() for t in kv]
    args = (torch.tensor([5]), torch.tensor([9]), torch.tensor([True]), torch.zeros(1, 2), torch.ones(1, 3, 1),
            torch.tensor([[7, 8]]))
    with torch.no_grad():
        tokens, n = fn(*args, args[3], *kv)
        ref_tokens, ref_n = ref_fn(*args, args[3], *kv_ref)
    assert torch.equal(tokens, ref_tokens) and torch.equal(n, ref_n)
    for t, r, o in zip(kv, kv_ref, orig):
        torch.testing.assert_close(t, r)  # the same cache contents as the eager round
        assert not torch.equal(t[:, :, 9:12], o[:, :, 9:12])  # root + 2 drafts written at slots L = 9 ..
        assert torch.equal(t[:, :, :9], o[:, :, :9]) and torch.equal(t[:, :, 12:], o[:, :, 12:])  # nothing else


def test_request_outside_the_compiled_shapes_is_refused(compiled):
    ld = aot.load_dir(compiled, tokenizer=False)
    ids = torch.tensor([PERIODIC])
    with pytest.raises(ArtifactError, match="top_k=.*baked"):
        ld.check_request(ids.shape[1], 8, True, 5, None, None)
    with pytest.raises(ArtifactError, match="top_k"):  # and the loop itself refuses instead of compiling
        ld.fast.generate(ids, max_new_tokens=4, do_sample=True, temperature=1.0, top_k=5)
    with pytest.raises(ArtifactError, match="max_seq_len=64"):
        ld.check_request(ids.shape[1], 100, False)


# ----------------------------------------------------------------------------------------------
# refusals


def test_modified_file_is_refused(compiled, tmp_path):
    d = copy_dir(compiled, tmp_path)
    pkg = d / "pt2" / "round_b1_k2_greedy.pt2"
    data = bytearray(pkg.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one byte changed
    pkg.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=r"round_b1_k2_greedy\.pt2: sha256 does not match"):
        aot.load_dir(d, tokenizer=False)


def test_truncated_weights_are_refused(compiled, tmp_path):
    d = copy_dir(compiled, tmp_path)
    w = d / "model" / "model.safetensors"
    w.write_bytes(w.read_bytes()[:-100])
    with pytest.raises(ArtifactError, match=r"model\.safetensors: .* bytes, the manifest says .*truncated"):
        aot.load_dir(d, tokenizer=False)


def test_missing_file_and_broken_manifest_are_refused(compiled, tmp_path):
    d = copy_dir(compiled, tmp_path)
    (d / "pt2" / "round_b1_k0_sample.pt2").unlink()
    with pytest.raises(ArtifactError, match="round_b1_k0_sample.pt2: listed in the manifest but missing"):
        aot.load_dir(d, tokenizer=False)
    (d / aot.MANIFEST).write_text("{not json")
    with pytest.raises(ArtifactError, match="not valid JSON"):
        aot.load_dir(d)
    with pytest.raises(ArtifactError, match="no manifest"):
        aot.load_dir(tmp_path)


def _point(field, value):
    """A manifest edit that sets one path field to ``value``."""
    def edit(m):
        if field == "graphs[].file":
            m["graphs"][0]["file"] = value
        elif field == "model.weights":
            m["model"]["weights"] = value
        elif field == "model.dir":
            m["model"]["dir"] = value
        elif field == "extra_file":
            m["model"]["weights_map"] = {**(m["model"].get("weights_map") or {}), "extra_file": value}
        elif field == "files":
            m["files"][value] = {"sha256": "0" * 64, "bytes": 1}
    return edit


@pytest.mark.parametrize("field", ["graphs[].file", "model.weights", "model.dir", "extra_file", "files"])
@pytest.mark.parametrize("value", ["../outside.pt2", "pt2/../../outside.pt2", "/etc/passwd"])
def test_manifest_path_outside_the_directory_is_refused(compiled, tmp_path, field, value):
    d = copy_dir(compiled, tmp_path)
    (tmp_path / "outside.pt2").write_bytes(b"x")
    rewrite_manifest(d, _point(field, value))
    with pytest.raises(ArtifactError, match="outside the directory|not listed in its files"):
        aot.load_dir(d, tokenizer=False)


@pytest.mark.parametrize("field", ["graphs[].file", "model.weights", "extra_file"])
def test_manifest_path_missing_from_the_files_table_is_refused(compiled, tmp_path, field):
    d = copy_dir(compiled, tmp_path)
    name = "pt2/unlisted.pt2"
    shutil.copy(d / "pt2" / "round_b1_k0_greedy.pt2", d / name)
    rewrite_manifest(d, _point(field, name))
    with pytest.raises(ArtifactError, match=r"'pt2/unlisted\.pt2' is not listed in its files"):
        aot.load_dir(d, tokenizer=False)
    control = copy_dir(compiled, tmp_path / "control")  # negative control: the untouched copy loads
    assert aot.load_dir(control, tokenizer=False).fast.max_seq_len == MAX_SEQ


def test_deleted_files_entry_and_unlisted_files_are_refused(compiled, tmp_path):
    d = copy_dir(compiled, tmp_path)
    rewrite_manifest(d, lambda m: m["files"].pop("pt2/round_b1_k0_greedy.pt2"))
    with pytest.raises(ArtifactError, match="not listed in its files"):
        aot.load_dir(d, tokenizer=False)
    d2 = copy_dir(compiled, tmp_path / "b")
    (d2 / "model" / "extra.json").write_text("{}")  # from_pretrained would read it unchecked
    with pytest.raises(ArtifactError, match=r"extra\.json: not listed"):
        aot.load_dir(d2, tokenizer=False)


@pytest.mark.parametrize("target", ["pt2/round_b1_k0_greedy.pt2", "model/model.safetensors", "pt2"])
def test_symbolic_links_are_refused(compiled, tmp_path, target):
    d = copy_dir(compiled, tmp_path)
    real = d / target
    moved = tmp_path / ("moved_" + real.name)
    real.rename(moved)
    real.symlink_to(moved, target_is_directory=moved.is_dir())  # same bytes, same hash, through a link
    with pytest.raises(ArtifactError, match="symbolic link"):
        aot.load_dir(d, tokenizer=False)


# ----------------------------------------------------------------------------------------------
# replacing a compiled directory (--force) and failed compiles


def _snapshot(d: Path) -> dict:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_force_recompile_keeps_user_files_and_the_result_loads(compiled, tmp_path):
    """`--force` over a compiled directory: the files of the old compile go (the k=2 packages),
    the user's files beside them stay, and the new directory (plain decoding, K recorded as 0)
    loads and equals the model; no staging directory is left behind."""
    d = copy_dir(compiled, tmp_path)
    (d / "notes.txt").write_text("mine")
    (d / "runs").mkdir()
    (d / "runs" / "log.json").write_text("{}")
    model = tiny_model()
    aot.compile_dir(model, d, draft=None, modes=("greedy",), prefill_chunk=None, max_seq_len=MAX_SEQ,
                    overwrite=True, progress=False)
    assert (d / "notes.txt").read_text() == "mine" and (d / "runs" / "log.json").read_text() == "{}"
    man = json.loads((d / aot.MANIFEST).read_text())
    assert man["settings"]["draft"] is None and man["settings"]["num_speculative_tokens"] == 0
    assert sorted(p.name for p in (d / "pt2").iterdir()) == sorted(Path(g["file"]).name for g in man["graphs"])
    assert not any("k2" in g["file"] for g in man["graphs"])
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    ld = aot.load_dir(d, tokenizer=False)
    ids = torch.tensor([(PERIODIC * 4)[:20]])
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(ld.fast.generate(ids, max_new_tokens=12), ref)


def test_a_new_compiled_directory_has_the_default_permissions(compiled):
    """The staging directory is private (mkdtemp: 0700); the directory the user asked for is not."""
    import os

    mask = os.umask(0)
    os.umask(mask)
    assert compiled.stat().st_mode & 0o777 == 0o777 & ~mask
    assert not compiled.is_symlink()


@pytest.mark.parametrize("intruder", ["model/mine.txt", "pt2/mine.pt2", "onnx/keep/me.txt", "model/config.json"])
def test_force_refuses_files_it_did_not_write_and_touches_nothing(compiled, tmp_path, intruder):
    """A user file inside model/, pt2/ or onnx/, or a listed file the user edited (config.json),
    makes `--force` refuse, naming it, before anything is compiled or removed."""
    d = copy_dir(compiled, tmp_path)
    f = d / intruder
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(f.read_text() + " " if f.exists() else "mine")
    before = _snapshot(d)
    with pytest.raises(FileExistsError, match=Path(intruder).name):
        aot.compile_dir(tiny_model(), d, draft=None, modes=("greedy",), max_seq_len=MAX_SEQ, overwrite=True,
                        progress=False)
    assert _snapshot(d) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy"]


def test_force_over_the_users_model_folder_is_refused(src, tmp_path):
    """`specgraph compile proj/model --out proj --force`: proj holds no manifest, so it is not a
    compiled directory and nothing in it is removed."""
    proj = tmp_path / "proj"
    shutil.copytree(src, proj / "model")
    before = _snapshot(proj)
    r = cli("compile", proj / "model", "--out", proj, "--draft", "none", "--max-seq-len", MAX_SEQ, "--modes", "greedy",
            "--force", "--quiet")
    assert r.returncode != 0 and "not a compiled directory" in one_line(r.stderr)
    assert _snapshot(proj) == before


def test_failed_recompile_leaves_the_directory_working(compiled, tmp_path, monkeypatch):
    d = copy_dir(compiled, tmp_path)
    before = _snapshot(d)

    def fail(*a, **k):
        raise RuntimeError("compiler crashed")

    monkeypatch.setattr(aot, "package_graph", fail)
    with pytest.raises(RuntimeError, match="compiler crashed"):
        aot.compile_dir(tiny_model(), d, draft=None, modes=("greedy",), max_seq_len=MAX_SEQ, overwrite=True,
                        progress=False)
    assert _snapshot(d) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy"]  # the staging directory is gone
    aot.load_dir(d, tokenizer=False)  # still loads


@pytest.mark.parametrize("package, recorded", [("torch", "2.0.0"), ("transformers", "4.0.0"), ("specgraph", "0.0.1")])
def test_version_mismatch_is_refused_naming_it(compiled, tmp_path, package, recorded):
    d = copy_dir(compiled, tmp_path)
    rewrite_manifest(d, lambda m: m["versions"].update({package: recorded}))
    with pytest.raises(ArtifactError, match=f"compiled with {package} '{recorded}' \\(running"):
        aot.load_dir(d, tokenizer=False)


def test_model_fingerprint_mismatch_is_refused(compiled):
    with pytest.raises(ArtifactError, match="embedding weights"):
        aot.load_dir(compiled, tiny_model(seed=1), tokenizer=False)
    with pytest.raises(ArtifactError, match="configuration"):
        aot.load_dir(compiled, tiny_model(seed=0, rope_theta=1234.0), tokenizer=False)
    with pytest.raises(ArtifactError, match="dtype"):
        aot.load_dir(compiled, tiny_model(seed=0).to(torch.float64), tokenizer=False)
    same = aot.load_dir(compiled, tiny_model(seed=0), tokenizer=False)  # the same model, passed in: accepted
    assert same.fast.max_seq_len == MAX_SEQ


def test_package_holding_a_pickle_is_refused_even_with_a_matching_hash(compiled, tmp_path):
    d = copy_dir(compiled, tmp_path)
    name = "pt2/round_b1_k0_greedy.pt2"
    with zipfile.ZipFile(d / name, "a") as z:
        z.writestr("round_b1_k0_greedy/data/weights/payload.pkl", b"\x80\x04N.")
    from specgraph.artifacts import file_entry

    rewrite_manifest(d, lambda m: m["files"].update({name: file_entry(d / name)}))
    ld = aot.load_dir(d, tokenizer=False)  # hashes check out; the package is opened on first use
    with pytest.raises(ArtifactError, match="only code and JSON"):
        ld.fast.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2)


# ----------------------------------------------------------------------------------------------
# CLI


def test_cli_help_lists_the_commands():
    r = cli("--help")
    assert r.returncode == 0
    for cmd in ("compile", "generate", "bench", "export-onnx"):
        assert cmd in r.stdout
    r = cli("compile", "--help")
    assert r.returncode == 0 and "--depths" in r.stdout and "--format" in r.stdout


def test_cli_generate_from_dir_streams_without_compiling(compiled):
    r = cli("generate", compiled, "--prompt", "abcabcabcabcabcabc", "--max-new-tokens", 12, "--stream")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip()
    assert "first token at" in r.stderr and "graphs loaded: " in r.stderr
    assert "compiling" not in r.stderr.lower()


def test_modified_weights_are_refused_before_they_are_mapped(compiled, tmp_path, monkeypatch):
    d = copy_dir(compiled, tmp_path)
    w = d / "model" / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[-1000] ^= 0x55  # inside a tensor: the file still parses
    w.write_bytes(bytes(data))
    opened = []
    real = aot._packaged_tensors
    monkeypatch.setattr(aot, "_packaged_tensors", lambda *a: opened.append(a) or real(*a))
    for background in (False, True):
        with pytest.raises(ArtifactError, match=r"model\.safetensors: sha256 does not match"):
            aot.load_dir(d, tokenizer=False, background_weights_check=background)
    assert opened == []
    aot.load_dir(compiled, tokenizer=False)  # negative control: intact weights are mapped
    assert len(opened) == 1
    r = cli("generate", d, "--prompt", "abcabc", "--max-new-tokens", 4, "--stream")
    assert r.returncode == 1 and r.stdout == ""
    assert "model.safetensors: sha256 does not match" in one_line(r.stderr)


@pytest.mark.parametrize("args, message", [
    (["compile", "SRC", "--out", "OUT", "--depths", "2,x"], "--depths must be comma-separated integers"),
    (["compile", "SRC", "--out", "OUT", "--depths", "0"], "at least one >= 1"),
    (["compile", "SRC", "--out", "OUT", "--format", "pt2,tflite"], "unknown tflite"),
    (["compile", "SRC", "--out", "OUT", "--draft", "none", "--depths", "2,4"], "--depths sets the prompt-lookup"),
    (["compile", "SRC", "--out", "OUT", "--tree", "[[0], [1,"], "--tree must be"),
    (["export-onnx", "SRC", "--out", "OUT", "--draft", "ngram", "--tree", "dynamic"], "--tree dynamic needs --draft suffix"),
    (["compile", "SRC", "--out", "OUT", "--draft-model", "SRC"], "--draft-model needs --format onnx"),
    (["compile", "SRC", "--out", "DIR"], "is not empty"),
    (["compile", "SRC"], "--out"),
    (["generate", "/nonexistent/compiled/dir", "--prompt", "hi"], "neither 'default'"),
    (["generate", "DIR", "--prompt", "hi", "--draft", "ngram"], "--draft applies to MODEL"),
    (["generate", "DIR", "--prompt", "hi", "--max-new-tokens", "8", "--temperature", "0.7", "--top-k", "5"], "baked in"),
    (["generate", "DIR", "--prompt", "hi", "--max-new-tokens", "500"], "exceeds the compiled max_seq_len=64"),
    (["generate", "DIR", "--prompt", "hi", "--runtime", "onnx"], "has no onnx graphs"),
    (["bench", "DIR", "--prompts", "poetry"], "unknown poetry"),
    (["bench", "DIR", "--prompts", "chat", "--max-new-tokens", "4"], "exceeds the compiled max_seq_len=64"),
])
def test_cli_bad_arguments_exit_nonzero_with_one_line(compiled, src, tmp_path, capsys, args, message):
    subst = {"SRC": str(src), "OUT": str(tmp_path / "out"), "DIR": str(compiled)}
    argv = [subst.get(a, a) for a in args]
    from specgraph.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code != 0
    line = one_line(capsys.readouterr().err)
    assert message in line and "error" in line
    assert not (tmp_path / "out").exists()


def test_cli_bench_prints_the_speed_table_against_hf(compiled, capsys):
    from specgraph.cli import main

    assert main(["bench", str(compiled), "--prompt", "abcabcabcabcabc", "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    hf = next(ln for ln in out.splitlines() if "HF generate (plain)" in ln)
    aot_row = next(ln for ln in out.splitlines() if "(AOT packages)" in ln)
    assert hf.split()[-1] == "True" and aot_row.split()[-1] == "True"  # greedy equal to HF


def test_cli_bad_arguments_through_subprocess(compiled):
    r = cli("compile", "default", "--out", compiled / "x", "--depths", "4,-1")
    assert r.returncode == 2 and "--depths" in one_line(r.stderr)
    r = cli("generate", compiled, "--prompt", "hi", "--max-new-tokens", "0")
    assert r.returncode == 2 and "--max-new-tokens must be >= 1" in one_line(r.stderr)


# ----------------------------------------------------------------------------------------------
# every directory `specgraph compile` writes loads


@pytest.mark.parametrize("draft, fmt", [
    ("none", "pt2"),
    pytest.param("suffix", "pt2", marks=pytest.mark.slow),
    pytest.param("none", "onnx", marks=pytest.mark.slow),
    pytest.param("ngram", "onnx", marks=pytest.mark.slow),
    pytest.param("suffix", "onnx", marks=pytest.mark.slow),
])  # ngram / pt2 is the `compiled` fixture, loaded by the tests above
def test_every_compiled_directory_loads_and_generates(src, tmp_path, draft, fmt):
    """`specgraph compile --draft D --format F --modes greedy,sample` writes a directory that
    loads: greedy equals `model.generate`, sampling runs from the same directory, and
    `specgraph generate DIR` prints text."""
    out = tmp_path / "dir"
    r = cli("compile", src, "--out", out, "--draft", draft, "--format", fmt, "--num-speculative-tokens", 2,
            "--max-seq-len", MAX_SEQ, "--modes", "greedy,sample", "--quiet")
    assert r.returncode == 0, r.stderr[-3000:]
    ids = torch.tensor([(PERIODIC * 4)[:24]])
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False, pad_token_id=0)
    if fmt == "pt2":
        gen = aot.load_dir(out, tokenizer=False).fast
    else:
        pytest.importorskip("onnxruntime")
        from specgraph.onnx import OnnxSpecGenerator

        gen = OnnxSpecGenerator(out / "onnx")
    assert torch.equal(gen.generate(ids, max_new_tokens=12, pad_token_id=0), ref)
    sampled = gen.generate(ids, max_new_tokens=12, do_sample=True, temperature=0.8,
                           generator=torch.Generator().manual_seed(1), pad_token_id=0)
    assert sampled.shape == ref.shape and torch.equal(sampled[:, :24], ids)
    r = cli("generate", out, "--prompt", "abcabcabc", "--max-new-tokens", 6)
    assert r.returncode == 0 and r.stdout.strip(), r.stderr[-3000:]


# ----------------------------------------------------------------------------------------------
# slow


@pytest.mark.slow
def test_tree_rounds_roundtrip(tmp_path):
    """Static prompt-lookup trees: the greedy tree package (with in-graph KV compaction) equals HF;
    the sampling tree package equals the eager specgraph path given the same seed."""
    model = tiny_model()
    out = tmp_path / "tree"
    tree = [(0,), (1,), (0, 0), (0, 0, 0)]
    aot.compile_dir(model, out, draft="ngram", tree=tree, max_seq_len=MAX_SEQ, modes=("greedy", "sample"), progress=False)
    ld = aot.load_dir(out, tokenizer=False)
    ids = torch.tensor([(PERIODIC * 5)[:30]])
    got = ld.fast.generate(ids, max_new_tokens=20)
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False, pad_token_id=0)
    assert torch.equal(got, ref)
    sampled = ld.fast.generate(ids, max_new_tokens=20, do_sample=True, temperature=0.7,
                               generator=torch.Generator().manual_seed(5))
    assert ld.fast.stats.drafted > 0
    eager = specgraph.compile(model, "ngram", tree=tree, backend="eager", max_batch_size=1, max_seq_len=MAX_SEQ)
    ref_s = eager.generate(ids, max_new_tokens=20, do_sample=True, temperature=0.7,
                           generator=torch.Generator().manual_seed(5))
    assert torch.equal(sampled, ref_s)
    assert any(n.startswith("tree_") and n.endswith("_sample") for n in ld.loaded_graphs)


@pytest.mark.slow
@pytest.mark.parametrize("flags, graphs", [
    ([], ["verify_k0", "verify_k2"]),
    # suffix trees: tree graphs + the plain step; a round writes up to 17 slots, hence the longer cache
    (["--draft", "suffix", "--tree", "dynamic", "--max-seq-len", "96"], ["verify_k0", "tree_n5_c4_d2"]),
    # the model drafting for itself (a draft model of the same vocabulary): every draft is accepted
    (["--draft-model", "SRC"], ["verify_k2", "draft_q2", "draft_q1", "draft_prefill_c32"]),
])
def test_export_onnx_dir_generates_with_onnx_runtime(src, tmp_path, flags, graphs):
    """`specgraph export-onnx` writes a DIR whose ONNX graphs `generate --runtime onnx` runs; the
    ONNX generator's greedy output equals HF generate."""
    pytest.importorskip("onnxruntime")
    out = tmp_path / "onnx_dir"
    flags = [str(src) if f == "SRC" else f for f in flags]
    r = cli("export-onnx", src, "--out", out, "--num-speculative-tokens", 2, "--max-seq-len", MAX_SEQ,
            "--modes", "greedy", "--quiet", *flags)
    assert r.returncode == 0, r.stderr[-3000:]
    man = json.loads((out / aot.MANIFEST).read_text())
    assert man["formats"] == ["onnx"] and man["graphs"] == [] and man["model"]["weights"] is None
    assert set(graphs) <= set(man["onnx"]["graphs"]), man["onnx"]["graphs"]
    r = cli("generate", out, "--prompt", "abcabcabcabc", "--max-new-tokens", 8)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "ONNX Runtime" in r.stderr
    from specgraph.onnx import OnnxSpecGenerator

    gen = OnnxSpecGenerator(out / "onnx")
    ids = torch.tensor([(PERIODIC * 6)[:40]])
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False, pad_token_id=0)
    assert torch.equal(gen.generate(ids, max_new_tokens=20, pad_token_id=0), ref)
    if "--draft-model" in flags:
        assert man["settings"]["draft"] == "model" and gen.stats.accepted == gen.stats.drafted > 0


@pytest.mark.slow
def test_smollm2_compile_then_generate_from_dir_equals_hf(tmp_path):
    """SmolLM2: `specgraph compile default` (greedy), then `generate DIR --compare` in a
    fresh process: greedy output equals HF generate; the cold start is reported."""
    out = tmp_path / "smol"
    r = cli("compile", "default", "--out", out, "--max-seq-len", 255, "--modes", "greedy", "--quiet", timeout=3000)
    assert r.returncode == 0, r.stderr[-3000:]
    r = cli("generate", out, "--prompt", "Write a Python function that adds two numbers.", "--max-new-tokens", 48,
            "--compare", timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    row = next(line for line in r.stderr.splitlines() if line.startswith("specgraph ngram"))  # the table: stderr
    assert row.split()[-1] == "True"
    assert "first token at" in r.stderr
