"""Helpers for compiled-artifact directories: file hashes, versions, model fingerprints.

Conventions shared with the ONNX exporter (:mod:`specgraph.onnx_export`): a ``manifest.json``
(plain JSON, never a pickle) lists every file of the directory as
``{"relative/path": {"sha256": ..., "bytes": ...}}`` and a loader refuses a missing, truncated
or modified file with its name before it reads anything from it.

The hashes check *integrity* (a truncated copy, a file edited or swapped by mistake or by someone
who did not also rewrite the manifest). They are not a signature: whoever can rewrite both a
file and the manifest can make a directory pass. Treat a compiled directory like any other
native code you run (its ``.so`` files are loaded into the process).
"""
from __future__ import annotations

import hashlib
import json
import os
import stat
import threading
from pathlib import Path


__all__ = [
    "ArtifactError", "sha256_file", "file_entry", "safe_path", "check_listed", "verify_files", "FileVerifier", "versions",
    "writable_by_others",
    "check_versions", "model_fingerprint", "fingerprint_mismatch", "canonical_config",
]

# config keys that do not change what the model computes (or that differ between a model and the
# same model saved and reloaded); the dtype is recorded separately
_CONFIG_VOLATILE = {
    "_name_or_path", "transformers_version", "_commit_hash", "_attn_implementation_autoset",
    "torch_dtype", "dtype", "quantization_config", "architectures", "use_cache", "_attn_implementation",
    "output_hidden_states", "output_attentions", "return_dict",
}


class ArtifactError(ValueError):
    """A compiled directory cannot be used: missing/modified file, version or model mismatch."""


def sha256_file(path) -> str:
    """sha256 of a file, read in 4 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def file_entry(path) -> dict:
    p = Path(path)
    return {"sha256": sha256_file(p), "bytes": p.stat().st_size}


def safe_path(root, name, what: str = "file") -> Path:
    """``root / name`` for a manifest path ``name``, refused with :class:`ArtifactError` unless it is
    a relative POSIX path that stays inside ``root`` through no symbolic link (a manifest could
    otherwise point a loader at any file the process can read)."""
    root = Path(root)
    if not isinstance(name, str) or not name or "\\" in name or "\x00" in name:
        raise ArtifactError(f"{root}: manifest {what} {name!r} is not a relative path")
    rel = Path(name)
    if rel.is_absolute() or name.startswith("/") or any(part in ("..", "") for part in name.split("/")):
        raise ArtifactError(f"{root}: manifest {what} {name!r} is outside the directory")
    p = root
    for part in rel.parts:
        p = p / part
        if p.is_symlink():
            raise ArtifactError(f"{p}: a symbolic link; a compiled directory holds plain files only")
    try:
        p.resolve().relative_to(root.resolve())
    except ValueError:
        raise ArtifactError(f"{root}: manifest {what} {name!r} resolves outside the directory") from None
    return p


def check_listed(root, files: dict, name, what: str) -> None:
    """Refuse a manifest field naming a file that the manifest's ``files`` table does not list (an
    unlisted file would be opened without its size and hash checked)."""
    if not isinstance(name, str) or name not in files:
        raise ArtifactError(f"{root}: manifest {what} {name!r} is not listed in its files (not checked, refused)")
    safe_path(root, name, what)


def verify_files(root, files: dict, names=None) -> None:
    """Check size then sha256 of ``files`` (manifest entries, paths relative to ``root``).

    Raises :class:`ArtifactError` naming the first file that is outside the directory, reached
    through a symbolic link, missing, truncated or modified. The size is read from the path itself
    (``lstat``), before anything is opened."""
    root = Path(root)
    for name in (files if names is None else names):
        info = files[name]
        f = safe_path(root, name)
        if not isinstance(info, dict) or not isinstance(info.get("bytes"), int) or not isinstance(info.get("sha256"), str):
            raise ArtifactError(f"{root}: manifest entry for {name!r} has no bytes/sha256")
        if not f.is_file():
            raise ArtifactError(f"{f}: listed in the manifest but missing")
        size = f.lstat().st_size
        if size != info["bytes"]:
            raise ArtifactError(f"{f}: {size} bytes, the manifest says {info['bytes']} (truncated or modified); "
                                "recompile the directory")
        if sha256_file(f) != info["sha256"]:
            raise ArtifactError(f"{f}: sha256 does not match the manifest (file modified); recompile the directory")


def writable_by_others(path, owners=None, modes: int = 0o022, follow_symlinks: bool = False) -> str | None:
    """Why someone else than ``owners`` may have written ``path`` (None when no one could), the
    check ssh makes of its keys: ``path`` is a symbolic link (unless ``follow_symlinks``), is
    owned by a uid not in ``owners`` (None: any owner), or has a write bit of ``modes`` (0o020:
    group, 0o002: others). None where files have no POSIX owner (Windows)."""
    if not hasattr(os, "geteuid"):
        return None
    st = os.stat(path) if follow_symlinks else os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link"
    if owners is not None and st.st_uid not in owners:
        return f"owned by uid {st.st_uid}"
    if st.st_mode & modes & 0o020:
        return "writable by group"
    if st.st_mode & modes & 0o002:
        return "writable by others"
    return None


class FileVerifier:
    """:func:`verify_files` on a background thread (hashlib releases the GIL on large blocks, so
    hashing overlaps the imports and model construction of a cold start). :meth:`wait` re-raises
    the verification error, if any; call it before using any verified file."""

    def __init__(self, root, files: dict, names=None):
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(root, files, names), daemon=True,
                                        name="specgraph-verify")
        self._thread.start()

    def _run(self, root, files, names):
        try:
            verify_files(root, files, names)
        except BaseException as e:  # noqa: BLE001 - re-raised in wait()
            self._error = e

    def wait(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error


def versions() -> dict:
    import torch
    import transformers

    import specgraph

    return {"specgraph": specgraph.__version__, "torch": torch.__version__, "transformers": transformers.__version__}


def check_versions(recorded: dict, where: str = "manifest") -> None:
    """Refuse artifacts built by another specgraph / torch / transformers (AOTInductor packages
    link against this exact torch; the captured graphs come from this transformers' modeling code)."""
    now = versions()
    bad = [f"{k} {recorded.get(k)!r} (running {now[k]!r})" for k in ("torch", "specgraph", "transformers")
           if recorded.get(k) != now[k]]
    if bad:
        raise ArtifactError(f"{where}: compiled with " + ", ".join(bad) + "; recompile with this install "
                            "(specgraph compile MODEL --out DIR)")


def canonical_config(model_or_config) -> dict:
    """The configuration as plain JSON values (as config.json stores it), without the fields in
    ``_CONFIG_VOLATILE``; from a model, a config object or a config dict."""
    cfg = getattr(model_or_config, "config", model_or_config)
    cfg = cfg if isinstance(cfg, dict) else cfg.to_dict()
    cfg = json.loads(json.dumps(cfg, default=str))  # JSON types: int dict keys -> str, tuples -> lists
    return {k: v for k, v in cfg.items() if k not in _CONFIG_VOLATILE}


def _tensor_bytes(t) -> memoryview:
    """The bytes of tensor ``t`` (on the CPU, contiguous; no copy when it already is)."""
    import torch

    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().data


def _tensor_sha256(t) -> str:
    return hashlib.sha256(_tensor_bytes(t)).hexdigest()


def weights_sha256(model) -> str:
    """sha256 over every distinct parameter and buffer of ``model``: name, dtype, shape and bytes
    (a tied tensor's bytes once). Unlike :func:`model_fingerprint`, it sees every weight."""
    h = hashlib.sha256()
    seen = set()
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for name, t in sorted(named, key=lambda nt: nt[0]):
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        ident = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        if ident not in seen:
            seen.add(ident)
            h.update(_tensor_bytes(t))
    return h.hexdigest()


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else the platform's processor string."""
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            name = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
        if name:
            return name
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_capability() -> str:
    """The instruction set torch's CPU kernels use here (``DEFAULT``, ``AVX2``, ``AVX512``, ...)."""
    import torch

    try:
        return torch.backends.cpu.get_cpu_capability()
    except Exception:  # noqa: BLE001 - older builds
        return "DEFAULT"


def model_fingerprint(model, embeddings_sha256: str | None = None) -> dict:
    """What identifies a model for compiled graphs: its configuration (canonical JSON, without
    fields that do not change the computation), its parameter dtype and the bytes of its input
    embedding matrix. ``{"sha256": combined, "config": ..., "embeddings": ..., "dtype": ...}``.

    ``embeddings_sha256``: use this hash of the embedding matrix instead of hashing it (for a model
    just loaded from a weights file whose sha256 was checked)."""
    cfg = json.dumps(canonical_config(model), sort_keys=True, separators=(",", ":"), default=str)
    parts = {
        "config": hashlib.sha256(cfg.encode()).hexdigest(),
        "embeddings": embeddings_sha256 or _tensor_sha256(model.get_input_embeddings().weight),
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
    }
    combined = hashlib.sha256(f"{parts['config']}|{parts['embeddings']}|{parts['dtype']}".encode()).hexdigest()
    return {"sha256": combined, **parts}


def fingerprint_mismatch(recorded: dict, actual: dict) -> str | None:
    """None when the fingerprints agree, else which parts differ, in words."""
    if recorded.get("sha256") == actual.get("sha256"):
        return None
    what = {"config": "configuration", "embeddings": "embedding weights", "dtype": "dtype"}
    diff = [f"{what[k]} ({str(recorded.get(k))[:12]} vs {str(actual.get(k))[:12]})" for k in what
            if recorded.get(k) != actual.get(k)]
    return ", ".join(diff) or "fingerprint"
