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
    (["generate", "default", "--prompt", "hi", "--draft", "medusa"], "invalid choice"),
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
