import subprocess
import sys

import pytest


def run(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "specgraph.cli", *args], capture_output=True, text=True, timeout=timeout)


def test_help_lists_generate():
    r = run("--help")
    assert r.returncode == 0 and "generate" in r.stdout


@pytest.mark.parametrize("args, message", [
    (["generate", "default", "--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["generate", "/nonexistent/model", "--prompt", "hi"], "neither 'default'"),
    (["generate", "default", "--prompt", "hi", "--draft", "bogus"], "invalid choice"),
    (["generate", "default", "--prompt", "hi", "--tree", "[[0], 1]"], "--tree must be"),
    (["generate", "default", "--prompt", "hi", "--draft", "suffix", "--tree", "[[0]]", "--backend", "eager"],
     "draft='suffix' builds its own trees"),
    (["generate", "default"], "--prompt"),
])
def test_bad_arguments_exit_nonzero_with_a_reason(args, message):
    r = run(*args)
    assert r.returncode != 0
    assert message in r.stderr


@pytest.mark.slow
def test_generate_on_default_model_prints_text_and_speed_table():
    r = run("generate", "default", "--prompt", "Write a Python function that adds two numbers.",
            "--max-new-tokens", "24", "--backend", "eager", timeout=1200)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "HF generate (plain)" in r.stdout
    row = next(line for line in r.stdout.splitlines() if line.startswith("specgraph ngram"))
    assert row.split()[-1] == "True"  # greedy output equals HF generate


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
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "specgraph.cli", "train-drafter", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--kind" in out.stdout and "--resume" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "specgraph.cli", "train-drafter", "--kind", "bogus", "--out", "x"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0
