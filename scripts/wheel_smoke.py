"""Smoke test of an installed specgraph wheel, as a user gets it (``.ci/run`` runs it in a fresh
venv, from outside the source tree): the package comes from site-packages, every module imports
(those of an extra may lack only that extra's own dependencies), ``specgraph --version``
answers, and a compiled greedy ``generate`` on a tiny model equals ``model.generate``."""
from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys
from pathlib import Path

# what the extras bring (pyproject's optional-dependencies): a module needing one of these may
# fail to import without it; any other import error is a broken install
EXTRA_DEPENDENCIES = {"fastapi", "uvicorn", "prometheus_client", "starlette", "ray", "onnx", "onnxruntime", "onnxscript",
                      "gguf", "accelerate", "triton", "matplotlib", "scipy", "openai"}


def check_installed_not_editable(pkg) -> None:
    where = Path(pkg.__file__).resolve()
    assert "site-packages" in where.parts, f"specgraph imported from {where}, not from an installed wheel"


def import_every_module(pkg) -> list[str]:
    """Import each module of ``pkg``; returns those skipped for a missing extra's dependency."""
    skipped = []
    for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".", onerror=lambda name: None):
        try:
            importlib.import_module(info.name)
        except ImportError as e:
            root = (e.name or "").split(".")[0]
            if root not in EXTRA_DEPENDENCIES:
                raise
            skipped.append(f"{info.name} (needs {root})")
    for sub in ("proposers", "serving", "passes", "kernels"):
        importlib.import_module(f"specgraph.{sub}")
    return skipped


def check_version_command(pkg) -> str:
    exe = Path(sys.executable).parent / "specgraph"
    out = subprocess.run([str(exe), "--version"], capture_output=True, text=True, check=True).stdout
    assert out.startswith(f"specgraph {pkg.__version__}"), out
    return out.strip()


def check_greedy_equals_generate() -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import specgraph

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None
    ids = torch.tensor([[3, 9, 27, 4, 3, 9, 27, 4, 3, 9, 27, 4, 3, 9]])
    want = model.generate(ids, max_new_tokens=24, do_sample=False)
    fast = specgraph.compile(model, "ngram", max_batch_size=1, max_seq_len=128, modes=("greedy",), cache=False,
                             progress=False)
    got = fast.generate(ids, max_new_tokens=24, do_sample=False)
    assert got.shape == want.shape == (1, ids.shape[1] + 24), (got.shape, want.shape)
    assert torch.equal(got, want), f"compiled greedy output differs from model.generate:\n{got}\n{want}"
    return got.shape[1] - ids.shape[1]


def main() -> None:
    import specgraph

    check_installed_not_editable(specgraph)
    skipped = import_every_module(specgraph)
    version = check_version_command(specgraph)
    n = check_greedy_equals_generate()
    print(f"wheel smoke test passed: {version}; {len(skipped)} modules need an extra ({', '.join(skipped) or 'none'}); "
          f"{n} greedy tokens equal to model.generate")


if __name__ == "__main__":
    main()
