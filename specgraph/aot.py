"""Ahead-of-time compiled directories: AOTInductor packages, ONNX graphs and a JSON manifest.

``compile_dir(model, "out/", draft="ngram", ...)`` (CLI ``specgraph compile``) writes everything a
later process needs to generate without compiling; ``load_dir("out/")`` reads it back into a
:class:`SpecGraphModel` whose generation loop is the one ``specgraph.compile`` runs (prompt lookup,
depth ladder, host sync per round), with every compiled graph served by a loaded package::

    out/
      manifest.json          format, versions, platform, model fingerprint, settings, graphs,
                             sha256 + size of every file
      model/                 config.json, generation_config.json, model.safetensors (the weights,
                             once; tied tensors once), tokenizer files
      pt2/<graph>.pt2        one AOTInductor package per shape, code only (no weights)
      onnx/                  specgraph.export_onnx output (its own manifest.json), with --format onnx

Graphs. One package per graph of the engine's graph set (:func:`specgraph.graphset.plan`): per
batch bucket and mode, the chain rounds of depth 0 and every rung of the prompt-lookup ladder (or
the tree shapes), plus per batch bucket a prefill chunk (C = 16 prompt tokens per call). A chain
or tree package is ``torch.export`` of the engine's own round function
(``SpecGraphModel.round_function`` / ``tree_round_function``: the captured, pass-rewritten step,
mask, verification and, for trees, KV compaction), whose first input is the attended cache slots
[W] with W a dynamic dimension (2 .. slots - 1): one package serves every prompt length, as one
JIT graph does. Lowered by ``torch._inductor.aoti_compile_and_package`` with the JIT path's
Inductor settings (single-threaded elementwise kernels on CPU; GEMMs use torch's threads).
Sampling rounds take the temperature as an input (logits / temperature, then the warp at
temperature 1 with top-k / top-p / min-p baked in; the JIT path does the same): one package serves
every temperature. The prefill package is the captured step at query length C with the
causal-by-position mask the compiler's eager prefill uses (:func:`specgraph.rounds.prefill_logits`).

KV caches. Rounds write K/V into the cache tensors in place (``index_put_``). AOTInductor keeps
in-place mutation of user inputs (the tests compare the cache after a packaged round with the
eager round's), so the packages take the compiler's cache tensors as they are: no cache copies.

Weights. By default packages are compiled with ``aot_inductor.package_constants_in_so=False``:
the ``.so`` holds code only; its constants (the model's tensors, named ``step.model.<HF name>``)
are bound at load time with ``load_constants(..., user_managed=True)`` to the tensors of
``model.safetensors``, memory-mapped: one copy on disk, one in memory, shared by every package,
nothing copied at load. Such packages run plain GEMMs, like ``specgraph.compile(freeze=False)``.
``compile_dir(..., freeze=True)`` (CLI ``--freeze``) folds the weights into every package instead,
prepacked and autotuned as the JIT's frozen graphs: about 2x faster rounds on CPU, one weight copy
per package (the persistent graph cache, :mod:`specgraph.graphcache`, builds its packages so).

Cold start. ``load_dir`` imports no transformers modeling code: ``fast.model`` is a stand-in
(:class:`_PackagedModel`: config.json, generation_config.json, the mapped weights), the prompt is
prefilled by the prefill package and the tokenizer is read from tokenizer.json when that was
checked at compile time to behave exactly like the original. ``load_hf_model`` gives the HF model.

Safety. Nothing is unpickled: the manifest is JSON, weights are safetensors, packages are opened
by the C++ AOTInductor package loader after a check that the archive holds only code, JSON and
version files. Every file's size and sha256 are checked against the manifest before a package is
opened or a weight used (a truncated or modified file is refused with its name); the manifest's
torch / specgraph / transformers versions must equal the running ones; the CPU must support the
instruction set the packages were built for; the model must have the manifest's fingerprint
(configuration + embedding weights + dtype). The hashes are an integrity check, not a signature
(see :mod:`specgraph.artifacts`); so a directory, or a file of it, that every local user can
write is refused (whoever can rewrite a file can rewrite the manifest too). Other owners and
group write access are allowed: pointing specgraph at a shared directory trusts its writers.

Compiler hooks used: :meth:`SpecGraphModel.use_graphs` (round lookups answered by packages, the
prompt prefill by the chunked prefill package) and :meth:`SpecGraphModel.set_depths` (the chain
ladder from the manifest).
"""
from __future__ import annotations

import contextlib
import json
import platform
import shutil
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specgraph.artifacts import (
    ArtifactError, FileVerifier, check_listed, check_versions, cpu_capability, file_entry, fingerprint_mismatch,
    model_fingerprint, safe_path, verify_files, versions, writable_by_others,
)
from specgraph.capture import kv_layout
from specgraph.compiler import SpecGraphModel, resolve_attention, resolve_autotune
from specgraph.graphset import GraphSpec, MODES, Progress, batch_buckets
from specgraph.graphset import plan as plan_graph_set
from specgraph.limits import resolve_max_seq_len
from specgraph.packages import PT2_SUBDIR, Package, model_tensors, package_graph, package_key, width_range
from specgraph.warping import SamplingParams, check_sampling_params, normalize_filters

FORMAT = "specgraph-aot"
FORMAT_VERSION = 3  # one round package per shape (the attended width a dynamic input); race-verified deterministic drafts
MANIFEST = "manifest.json"
MODEL_SUBDIR = "model"
ONNX_SUBDIR = "onnx"
FORMATS = ("pt2", "onnx")
# what an AOTInductor package may contain (anything else, e.g. pickled weights, is refused)
_ISA_ORDER = ["DEFAULT", "AVX2", "AVX512"]
DIR_MAX_SEQ_LEN = 1024  # a directory's max_seq_len unless given (capped at the model's maximum positions)
PREFILL_CHUNK = 16  # prompt tokens per prefill package call (the last chunk is padded)
WEIGHTS_FILE = "model.safetensors"
EXTRA_CONSTANTS_FILE = "extra_constants.safetensors"

__all__ = ["compile_dir", "load_dir", "load_hf_model", "check_model_files", "read_manifest", "plan_graphs", "GraphSpec", "LoadedDir", "is_compiled_dir",
           "ArtifactError"]


# ----------------------------------------------------------------------------------------------
# the shapes a compiled object uses


def plan_graphs(fast: SpecGraphModel, modes=MODES, prefill_chunk: int | None = PREFILL_CHUNK) -> list[GraphSpec]:
    """The graphs ``fast.generate`` can request: the engine's graph set (:func:`specgraph.graphset.plan`:
    per batch bucket and mode, chain depth 0 (plain step) and the prompt-lookup ladder, or the tree
    shapes; the attended width a dynamic input), plus per batch bucket a prefill chunk of
    ``prefill_chunk`` tokens (None: none)."""
    out = []
    for B in batch_buckets(fast.max_batch_size):
        if prefill_chunk:
            out.append(GraphSpec("prefill", B, fast.slots, "greedy", min(prefill_chunk, fast.slots - 1)))
    engine = plan_graph_set(fast, modes)
    unsupported = [g.name for g in engine if g.kind not in ("round", "tree")]
    if unsupported:
        raise ValueError(f"graphs {unsupported[:3]} cannot be compiled ahead of time (only chain and tree rounds)")
    return out + engine


# ----------------------------------------------------------------------------------------------
# compile


def _write_model_folder(model, tokenizer, dst: Path, weights: bool) -> list[str]:
    """config + generation config + tokenizer (+ safetensors weights): a folder from_pretrained reads.
    Written by hand: save_pretrained refuses models loaded from GGUF files. Returns the tokenizer
    files (paths relative to the compiled directory)."""
    from safetensors.torch import save_model

    dst.mkdir(parents=True, exist_ok=True)
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True, default=str) + "\n")
    model.generation_config.save_pretrained(dst)
    tok_files = []
    if tokenizer is not None:
        saved = tokenizer.save_pretrained(dst)
        tok_files = sorted({f"{dst.name}/{Path(f).name}" for f in saved if Path(f).is_file()})
    if weights:
        save_model(model, str(dst / WEIGHTS_FILE))  # tied tensors stored once
    return tok_files


def _parse_depths(depths) -> list[int]:
    try:
        out = sorted({int(d) for d in depths})
    except (TypeError, ValueError) as e:
        raise ValueError(f"depths must be integers, got {depths!r}") from e
    if any(d < 0 for d in out) or not any(d > 0 for d in out):
        raise ValueError(f"depths must be >= 0 with at least one >= 1, got {list(depths)!r}")
    return out


def compile_dir(
    model,
    out_dir,
    *,
    tokenizer=None,
    draft="ngram",
    num_speculative_tokens: int = 4,
    depths=None,
    tree=None,
    max_batch_size: int = 1,
    max_seq_len: int | None = None,
    formats=("pt2",),
    modes=MODES,
    top_k="model",
    top_p="model",
    min_p="model",
    prefill_chunk: int | None = PREFILL_CHUNK,
    freeze: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    source: str | None = None,
) -> dict:
    """Compile ``model`` ahead of time into ``out_dir``; returns the manifest (also written as
    ``out_dir/manifest.json``, last, so a directory without one is an unfinished compile).

    Args:
        draft: None (plain decoding), ``"ngram"`` (prompt lookup), ``"suffix"``, or a smaller draft
            model (chains; ``formats=("onnx",)`` only: its step graphs and weights are in the ONNX
            graphs, AOT packages of draft steps are not written yet).
        num_speculative_tokens: K, as in :func:`specgraph.compile`; ignored when ``depths`` is given.
        depths: chain depths of the prompt-lookup ladder (e.g. ``[2, 4, 8]``: start at 2, one rung
            up after a fully accepted round, one down after a poor one); K = max(depths). Default:
            the compiler's ladder for K. Depth 0 (a plain step) is always compiled.
        tree: as in :func:`specgraph.compile` (static trees of paths with ``"ngram"``, ``"dynamic"``
            with ``"suffix"``); greedy tree rounds are packaged.
        max_seq_len: the longest prompt + new tokens served (default: 1024, or the model's maximum
            positions when smaller; above that maximum it is refused).
        formats: ``"pt2"`` (AOTInductor packages) and/or ``"onnx"`` (:func:`specgraph.export_onnx`:
            chains, static prompt-lookup trees and suffix decoding, chains or dynamic trees).
        modes: ``"greedy"`` and/or ``"sample"`` graphs; ``top_k`` / ``top_p`` / ``min_p`` are baked
            into the sampling graphs (the temperature stays an input). ``"model"`` (default): those
            of a plain ``do_sample=True`` request on this model (its generation config, then
            transformers' defaults: top-k 50); None: off. A sampling request must resolve to them.
        freeze: fold the weights into every package, prepacked for the GEMMs and autotuned as
            ``specgraph.compile`` does for large CPU models: about 2x faster rounds on CPU, but each
            package holds its own weight copy (on disk and in memory). Default: packages hold code
            only and share the one weights file.
        prefill_chunk: prompt tokens per call of the packaged prefill (one package per batch bucket);
            with it a loaded directory needs no transformers modeling code at all (see ``load_dir``).
            None: no prefill package (the loader then builds the HF model and prefills eagerly).
        overwrite: replace an existing compiled directory. Only files its manifest lists that still
            match their sha256 are removed; anything else under ``model/``, ``pt2/`` or ``onnx/`` (a
            file of yours, or a listed file you edited) makes the compile refuse before it starts,
            and files of yours elsewhere in the directory are kept.

    The compile writes into a temporary directory beside ``out_dir`` and moves its files in only
    when every graph is built: a failed compile leaves an existing directory as it was.
    """
    t_start = time.perf_counter()
    formats = tuple(dict.fromkeys(formats))
    modes = tuple(dict.fromkeys(modes))
    if not formats or any(f not in FORMATS for f in formats):
        raise ValueError(f"formats must be a non-empty subset of {FORMATS}, got {formats!r}")
    if not modes or any(m not in MODES for m in modes):
        raise ValueError(f"modes must be a non-empty subset of {MODES}, got {modes!r}")
    draft_model = draft if isinstance(draft, torch.nn.Module) else None
    if draft_model is not None and formats != ("onnx",):
        # the ONNX graphs carry the draft's weights; AOT packages of draft steps are not written yet
        raise ValueError("a draft model is compiled ahead of time for the ONNX format only: pass formats=('onnx',)")
    if draft_model is None and draft not in (None, "ngram", "suffix"):
        raise ValueError(f"draft={draft!r} cannot be compiled ahead of time: use None, 'ngram', 'suffix' or a draft model "
                         "(ONNX format)")
    if depths is not None:
        if draft is None or tree is not None:
            raise ValueError("depths set the prompt-lookup chain ladder: they need draft='ngram' or 'suffix' and tree=None")
        depths = _parse_depths(depths)
        num_speculative_tokens = max(depths)
    out = Path(out_dir)
    with _staged_dir(out, overwrite) as work:
        return _compile_into(
            work, model, tokenizer, draft, draft_model, num_speculative_tokens, depths, tree, max_batch_size,
            max_seq_len, formats, modes, top_k, top_p, min_p, prefill_chunk, freeze, progress, source, t_start)


@contextlib.contextmanager
def _staged_dir(out: Path, overwrite: bool):
    """Yield a fresh directory beside ``out`` (beside what it links to) to compile into. A failed
    compile removes it and leaves ``out`` untouched; a finished one has its files moved into ``out``
    (see :func:`replaceable_files`, :func:`_swap_in`). Should that move fail, the finished compile
    stays in the staging directory, named in the error."""
    removable = replaceable_files(out, overwrite)
    if out.is_symlink() and not out.exists():
        raise FileExistsError(f"{out} is a broken symbolic link")
    target = out.resolve()  # the staging directory on the target's own filesystem
    target.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{target.name}.compiling-", dir=target.parent))
    try:
        yield stage
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    try:
        _swap_in(stage, out, removable)
    except Exception as e:
        raise OSError(f"moving the finished compile into {out} failed ({e}); it is complete in {stage}") from e
    shutil.rmtree(stage, ignore_errors=True)


def replaceable_files(out, overwrite: bool) -> list[Path]:
    """The files of an existing ``out`` that a new compile may remove: those its manifest lists,
    inside it through no symbolic link, still matching their size and sha256, and the manifest.
    Refuses (``FileExistsError``, naming the files) a non-empty ``out`` without ``overwrite``,
    one that is not a compiled directory, and one holding any other file under model/, pt2/ or
    onnx/ (the new compile writes there: whatever is there must be ours to remove)."""
    out = Path(out)
    if not out.exists():
        return []
    if not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a directory")
    if not any(out.iterdir()):
        return []
    if not overwrite:
        raise FileExistsError(f"{out} is not empty; pass overwrite=True (CLI: --force) to replace a compiled directory")
    try:
        old = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        old = None
    if not isinstance(old, dict) or old.get("format") != FORMAT or not isinstance(old.get("files"), dict):
        raise FileExistsError(f"{out} is not empty and not a compiled directory (no readable {MANIFEST}); "
                              "refusing to write into it")
    removable = [out / MANIFEST]
    for name, info in old["files"].items():
        try:
            verify_files(out, {name: info})
        except ArtifactError:
            continue  # outside, a link, missing or modified: never removed
        removable.append(out / name)
    keep = set(removable)
    foreign = [p for sub in (MODEL_SUBDIR, PT2_SUBDIR, ONNX_SUBDIR) if (out / sub).exists()
               for p in [out / sub, *sorted((out / sub).rglob("*"))]
               if (p.is_symlink() or not p.is_dir()) and p not in keep]
    if foreign:
        shown = ", ".join(str(p.relative_to(out)) for p in foreign[:5]) + (" ..." if len(foreign) > 5 else "")
        raise FileExistsError(f"{out}: refusing to replace it: {len(foreign)} file(s) under {MODEL_SUBDIR}/, "
                              f"{PT2_SUBDIR}/ or {ONNX_SUBDIR}/ that its manifest does not list or that were "
                              f"modified ({shown}); move them away or compile into another directory")
    return removable


def _swap_in(stage: Path, out: Path, removable: list[Path]) -> None:
    """Move a finished compile from ``stage`` into ``out``: the old manifest goes first and the new
    one last, so ``out`` is never a directory whose manifest describes files it does not hold."""
    out.mkdir(parents=True, exist_ok=True)  # an existing directory keeps its own mode and owner
    new = [p for p in sorted(stage.rglob("*")) if p.is_file() and p != stage / MANIFEST]
    keep = set(removable)
    late = [out / p.relative_to(stage) for p in new
            if (out / p.relative_to(stage)).exists() and out / p.relative_to(stage) not in keep]
    if late:
        raise FileExistsError(f"{late[0]}: appeared while compiling; {out} was left as it was")
    for p in removable:
        p.unlink(missing_ok=True)
    for sub in (MODEL_SUBDIR, PT2_SUBDIR, ONNX_SUBDIR):  # folders left empty by the removal
        for d in sorted((p for p in (out / sub).rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            with contextlib.suppress(OSError):
                d.rmdir()
        with contextlib.suppress(OSError):
            (out / sub).rmdir()
    for p in new:
        dst = out / p.relative_to(stage)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(p, dst)
    shutil.move(stage / MANIFEST, out / MANIFEST)


def _compile_into(out: Path, model, tokenizer, draft, draft_model, num_speculative_tokens, depths, tree,
                  max_batch_size, max_seq_len, formats, modes, top_k, top_p, min_p, prefill_chunk, freeze, progress,
                  source, t_start) -> dict:
    """The body of :func:`compile_dir`, writing into ``out`` (a fresh staging directory)."""
    import specgraph

    top_vocab = model.get_output_embeddings().out_features
    fast = specgraph.compile(model, draft, num_speculative_tokens=num_speculative_tokens, tree=tree, backend="eager",
                             max_batch_size=max_batch_size,
                             max_seq_len=resolve_max_seq_len(model, max_seq_len, default=DIR_MAX_SEQ_LEN), warmup=False,
                             attention=resolve_attention("auto", model, "inductor"))  # the JIT's attention
    default = fast.default_sampling()
    top_k, top_p, min_p = (default.top_k if top_k == "model" else top_k, default.top_p if top_p == "model" else top_p,
                           default.min_p if min_p == "model" else min_p)
    top_k, top_p, min_p = normalize_filters(top_vocab, top_k, top_p, min_p)
    if "sample" in modes:
        check_sampling_params(1.0, top_k, top_p, min_p)
    if fast.fallback_reason is not None:
        raise ValueError(f"this model cannot be compiled ahead of time: {fast.fallback_reason}")
    if fast.full_width and "pt2" in formats:
        raise ValueError("this model's eager attention reads the whole cache (its rounds have no dynamic width); "
                         "AOT packages need SDPA attention: load it with attn_implementation='sdpa'")
    autotune = resolve_autotune("auto", model, freeze)
    if depths is not None and any(d > 0 for d in depths):
        fast.set_depths([d for d in depths if d > 0])
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    fingerprint = model_fingerprint(model)

    # the model folder: weights once (pt2 binds them at load), tokenizer files, configs
    tok_files = _write_model_folder(model, tokenizer, out / MODEL_SUBDIR, weights="pt2" in formats)
    files: dict[str, dict] = {}
    graphs: list[dict] = []
    tensors = model_tensors(model)
    emb_names = {"input": _tensor_name(tensors, model.get_input_embeddings().weight),
                 "output": _tensor_name(tensors, model.get_output_embeddings().weight)}
    weights_map = None
    if "pt2" in formats:
        specs = plan_graphs(fast, modes, prefill_chunk)
        (out / PT2_SUBDIR).mkdir(exist_ok=True)
        needed: set[str] = set()
        bar = Progress(len(specs), progress)
        try:
            for g in specs:
                bar.start(g.name)
                t0 = time.perf_counter()
                entry, names = package_graph(fast, g, out, device, top_vocab, (top_k, top_p, min_p), tensors,
                                             freeze=freeze, autotune=autotune)
                needed |= names
                graphs.append(entry)
                graphs[-1]["seconds"] = round(time.perf_counter() - t0, 2)
                bar.advance(g.name, graphs[-1]["seconds"])
        finally:
            bar.close()
        weights_map = _weights_map(tensors, out / MODEL_SUBDIR, needed | set(emb_names.values()))
    onnx_info = None
    if "onnx" in formats:
        from specgraph.onnx_export import export_onnx

        # chains: the plain step and the ladder; trees and draft models: export_onnx's default (the
        # tree shapes + the plain step; depth K)
        ladder = [k for k in fast.k_ladder if k > 0] if draft is not None else []
        default = tree is not None or draft_model is not None
        ox = export_onnx(fast, out / ONNX_SUBDIR, depths=None if default else sorted({0, *ladder}),
                         batch_size=max_batch_size,
                         modes=modes, top_k=top_k, top_p=top_p, min_p=min_p, progress=progress)
        onnx_info = {"dir": ONNX_SUBDIR, "manifest": f"{ONNX_SUBDIR}/manifest.json",
                     "graphs": [g["name"] for g in ox["graphs"]], "opset": ox["opset"]}

    for p in sorted(out.rglob("*")):
        if p.is_file() and p != out / MANIFEST:
            files[p.relative_to(out).as_posix()] = file_entry(p)
    layers, kv_heads, head_dim = kv_layout(model)
    gc = model.generation_config
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "created_unix": int(time.time()),
        "versions": {**versions(), "python": platform.python_version()},
        "platform": {"machine": platform.machine(), "system": platform.system(), "cpu_capability": cpu_capability(),
                     "device": device.type},
        "source": source,
        "model": {
            "class": type(model).__name__,
            "model_type": getattr(model.config, "model_type", None),
            "fingerprint": fingerprint,
            "dtype": str(dtype).replace("torch.", ""),
            "vocab_size": top_vocab,
            "num_layers": layers, "num_kv_heads": kv_heads, "head_dim": head_dim,
            "dir": MODEL_SUBDIR,
            "weights": f"{MODEL_SUBDIR}/{WEIGHTS_FILE}" if "pt2" in formats else None,
            "embeddings": emb_names,
            "weights_map": weights_map,
        },
        "tokenizer": {"files": tok_files, "loader": _tokenizer_loader(tokenizer, out / MODEL_SUBDIR)} if tok_files else None,
        "generation": {"eos_token_id": gc.eos_token_id, "pad_token_id": gc.pad_token_id, "bos_token_id": gc.bos_token_id},
        "settings": {
            "draft": "model" if draft_model is not None else draft,
            "draft_model": None if draft_model is None else {
                "class": type(draft_model).__name__, "fingerprint": model_fingerprint(draft_model)},
            "num_speculative_tokens": fast.k,
            "k_ladder": list(fast.k_ladder) if draft is not None else [],
            "tree": _tree_json(tree),
            "max_batch_size": max_batch_size,
            "max_seq_len": fast.max_seq_len,
            "slots": fast.slots,
            "batch_buckets": batch_buckets(max_batch_size),
            "width": dict(zip(("min", "max"), width_range(fast))),
            "modes": list(modes),
            "freeze": freeze,
            "autotune": autotune,
            "attention": fast.attention,
            "kernel_threads": fast.built_threads if fast.attention == "block_sparse" else None,
            "sampling": {"temperature": "input", "top_k": top_k, "top_p": top_p, "min_p": min_p},
        },
        "kv": {"shape_per_layer": ["batch", kv_heads, fast.slots, head_dim], "tensors": 2 * layers,
               "dtype": str(dtype).replace("torch.", "")},
        "formats": list(formats),
        "graphs": graphs,
        "onnx": onnx_info,
        "compile_seconds": round(time.perf_counter() - t_start, 1),
        "files": files,
    }
    tmp = out / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    tmp.replace(out / MANIFEST)
    return manifest


def _tree_json(tree):
    if tree is None or isinstance(tree, str):
        return tree
    return [list(p) for p in tree]


def _tensor_name(tensors: dict, t) -> str:
    return next(n for n, v in tensors.items() if v is t)


def _weights_map(tensors: dict, mdir: Path, needed: set) -> dict:
    """How to find every tensor the packages (and the stand-in model) need from the files alone:
    names stored in the weights file are found under themselves; tied copies (``lm_head.weight``
    and the embedding) under the stored name they share memory with (``aliases``); anything else
    (a buffer the weights file does not hold) goes to ``extra_constants.safetensors``."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(mdir / WEIGHTS_FILE), "pt") as f:
        stored = set(f.keys())

    def sig(t):
        return (t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))

    by_sig = {sig(tensors[k]): k for k in sorted(stored) if k in tensors}
    aliases, extra = {}, {}
    for n in sorted(needed):
        if n in stored:
            continue
        k = by_sig.get(sig(tensors[n]))
        if k is not None:
            aliases[n] = k
        else:
            extra[n] = tensors[n].detach().contiguous().clone()
    if extra:
        save_file(extra, str(mdir / EXTRA_CONSTANTS_FILE))
    return {"aliases": aliases, "extra_file": f"{mdir.name}/{EXTRA_CONSTANTS_FILE}" if extra else None}


_TOKENIZER_PROBES = ["Hello, world! It's 2026: naïve café, 東京, emoji 🙂.\n  def f(x):\n\treturn x ** 2  # done",
                     " leading space, trailing space ", "<|im_start|>user\nhi<|im_end|>"]


def _tokenizer_loader(tokenizer, mdir: Path) -> str:
    """"fast" when ``PreTrainedTokenizerFast.from_pretrained(model/)`` (tokenizer.json, no model
    config, no transformers modeling imports) encodes, decodes and applies the chat template exactly
    like ``tokenizer``; else "auto" (AutoTokenizer)."""
    if tokenizer is None or not (mdir / "tokenizer.json").is_file():
        return "auto"
    try:
        from transformers import PreTrainedTokenizerFast

        fast = PreTrainedTokenizerFast.from_pretrained(mdir)
        for p in _TOKENIZER_PROBES:
            ids = tokenizer(p).input_ids
            if fast(p).input_ids != ids or fast.decode(ids) != tokenizer.decode(ids):
                return "auto"
        if getattr(tokenizer, "chat_template", None):
            chat = [{"role": "user", "content": _TOKENIZER_PROBES[0]}]
            a = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
            if not getattr(fast, "chat_template", None) or fast.apply_chat_template(
                    chat, add_generation_prompt=True, tokenize=False) != a:
                return "auto"
        for attr in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if getattr(fast, attr, None) != getattr(tokenizer, attr, None):
                return "auto"
    except Exception:  # noqa: BLE001 - anything unusual: the general loader
        return "auto"
    return "fast"


# ----------------------------------------------------------------------------------------------
# load


def is_compiled_dir(path) -> bool:
    p = Path(path)
    if not (p / MANIFEST).is_file():
        return False
    try:
        return json.loads((p / MANIFEST).read_text()).get("format") == FORMAT
    except (OSError, ValueError):
        return False


def read_manifest(path) -> dict:
    """Read and check the manifest of a compiled directory (format, versions, platform); files are
    checked separately (:func:`load_dir`)."""
    d = Path(path)
    mpath = d / MANIFEST
    if not d.is_dir():
        raise ArtifactError(f"{d}: no such directory")
    if not mpath.is_file():
        raise ArtifactError(f"{mpath}: no manifest (not a directory written by specgraph compile, or an unfinished one)")
    try:
        man = json.loads(mpath.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{mpath}: not valid JSON ({e})") from e
    if not isinstance(man, dict) or man.get("format") != FORMAT:
        fmt = man.get("format") if isinstance(man, dict) else None
        hint = " (an ONNX export: load it with specgraph.onnx.OnnxSpecGenerator)" if fmt == "specgraph-onnx" else ""
        raise ArtifactError(f"{mpath}: format {fmt!r}, expected {FORMAT!r}{hint}")
    if man.get("format_version") != FORMAT_VERSION:
        raise ArtifactError(f"{mpath}: format version {man.get('format_version')!r}, this specgraph reads {FORMAT_VERSION}")
    for key in ("versions", "platform", "model", "settings", "graphs", "files"):
        if key not in man:
            raise ArtifactError(f"{mpath}: no {key!r} entry")
    check_manifest_paths(d, man)
    check_versions(man["versions"], str(mpath))
    plat = man["platform"]
    if plat.get("machine") != platform.machine():
        raise ArtifactError(f"{mpath}: compiled for {plat.get('machine')}, this machine is {platform.machine()}")
    isa, have = plat.get("cpu_capability", "DEFAULT"), cpu_capability()
    if isa in _ISA_ORDER and have in _ISA_ORDER and _ISA_ORDER.index(have) < _ISA_ORDER.index(isa):
        raise ArtifactError(f"{mpath}: packages were built for {isa} CPUs, this CPU supports {have}; recompile here")
    return man


def check_manifest_paths(d: Path, man: dict) -> None:
    """Every path the manifest makes a loader open is a key of its ``files`` table (so its size and
    hash are checked before use) and stays inside ``d`` through no symbolic link; ``model/`` and
    ``pt2/`` hold no file the table does not list (``from_pretrained`` reads whatever is there)."""
    files = man["files"]
    if not isinstance(files, dict):
        raise ArtifactError(f"{d / MANIFEST}: 'files' is not a table")
    for name in files:
        safe_path(d, name)
    if not isinstance(man["graphs"], list) or not isinstance(man["model"], dict):
        raise ArtifactError(f"{d / MANIFEST}: 'graphs' must be a list and 'model' a table")
    for g in man["graphs"]:
        check_listed(d, files, g.get("file") if isinstance(g, dict) else None, "graphs[].file")
    m = man["model"]
    mdir = m.get("dir")
    safe_path(d, mdir, "model.dir")
    if m.get("weights") is not None or "pt2" in man.get("formats", []):
        check_listed(d, files, m.get("weights"), "model.weights")
    extra = (m.get("weights_map") or {}).get("extra_file")
    if extra is not None:
        check_listed(d, files, extra, "model.weights_map.extra_file")
    for sub in {mdir, PT2_SUBDIR}:
        root = d / sub
        if not root.is_dir():
            continue
        for p in sorted(root.rglob("*")):
            rel = p.relative_to(d).as_posix()
            if p.is_symlink():
                raise ArtifactError(f"{p}: a symbolic link; a compiled directory holds plain files only")
            if p.is_file() and rel not in files:
                raise ArtifactError(f"{p}: not listed in {d / MANIFEST} (an unlisted file is never loaded); "
                                    "remove it or recompile the directory")


class _PackagedGraphs(dict):
    """Stands in for ``SpecGraphModel._fns``: a compiled-graph lookup that the compiler did not
    find is answered from the directory's packages (loaded on first use). Shapes the directory
    lacks raise (``missing="error"``) or are left to the compiler (``"jit"``: compiled on first use)."""

    def __init__(self, base: dict, loaded: "LoadedDir", missing: str):
        super().__init__(base)
        self._dir = loaded
        self._missing = missing

    def __contains__(self, key) -> bool:
        if dict.__contains__(self, key):
            return True
        fn, why = self._dir._resolve(key)
        if fn is not None:
            dict.__setitem__(self, key, fn)
            return True
        if self._missing == "error":
            raise ArtifactError(f"{self._dir.path}: {why}")
        warnings.warn(f"specgraph: {why}; compiling it now (JIT)", stacklevel=3)
        return False


@dataclass
class LoadedDir:
    """What :func:`load_dir` returns: ``fast`` is a :class:`SpecGraphModel` (call ``fast.generate``)."""

    path: Path
    manifest: dict = field(repr=False)
    fast: SpecGraphModel = field(repr=False)
    model: object = field(repr=False)
    tokenizer: object = field(repr=False)
    timings: dict = field(default_factory=dict)
    _packages: dict = field(default_factory=dict, repr=False)
    _specs: dict = field(default_factory=dict, repr=False)
    _prefill_specs: dict = field(default_factory=dict, repr=False)
    _tensors: dict = field(default_factory=dict, repr=False)

    @property
    def loaded_graphs(self) -> list[str]:
        return sorted(self._packages)

    def wait_verified(self) -> None:
        """Kept for compatibility: :func:`load_dir` checks every file before it returns, so there is
        nothing left to wait for."""

    def check_request(self, prompt_len: int, max_new_tokens: int, do_sample: bool = False,
                      top_k=None, top_p=None, min_p=None) -> None:
        """Raise :class:`ArtifactError` (before generating) when a request needs graphs the
        directory does not have: a longer sequence than it was compiled for, sampling without
        sampling graphs, or top-k / top-p / min-p other than the ones baked in."""
        s = self.manifest["settings"]
        need = prompt_len + max_new_tokens + self.fast.span
        if need > s["max_seq_len"]:
            raise ArtifactError(f"{self.path}: prompt ({prompt_len} tokens) + {max_new_tokens} new tokens + "
                                f"{self.fast.span} speculative slots = {need} exceeds the compiled max_seq_len="
                                f"{s['max_seq_len']} (recompile with a larger --max-seq-len)")
        if not do_sample:
            if "greedy" not in s["modes"]:
                raise ArtifactError(f"{self.path}: no greedy graphs were compiled (modes {s['modes']})")
            return
        if "sample" not in s["modes"]:
            raise ArtifactError(f"{self.path}: no sampling graphs were compiled (modes {s['modes']}); "
                                "recompile with --modes greedy,sample")
        want = normalize_filters(self.manifest["model"]["vocab_size"], top_k, top_p, min_p)
        baked = (s["sampling"]["top_k"], s["sampling"]["top_p"], s["sampling"]["min_p"])
        if want != baked:
            raise ArtifactError(f"{self.path}: the sampling graphs have top_k={baked[0]}, top_p={baked[1]}, "
                                f"min_p={baked[2]} baked in; asked for top_k={top_k}, top_p={top_p}, min_p={min_p} "
                                "(recompile with --top-k/--top-p/--min-p; the temperature is free)")

    def _package(self, spec: dict) -> Package:
        name = spec["name"]
        if name not in self._packages:
            self._packages[name] = Package(self.path / spec["file"], self._tensors, spec)
        return self._packages[name]

    def _resolve(self, key) -> tuple:
        """(callable, None) for a compiler graph key served by a package, else (None, why)."""
        s = self.manifest["settings"]
        kind = key[0]
        if kind not in ("round", "tree"):
            return None, f"graph {key[0]!r} is not in the compiled directory"
        _, B, params, width, shape = key
        if not isinstance(params, SamplingParams):
            return None, ("the compiled directory has no graphs with logits processors or score outputs "
                          f"({', '.join(params[1].logits.names()) if params[1].logits else 'scores'})")
        mode = "greedy" if params.greedy else "sample"
        spec = self._specs.get(package_key(kind, B, shape, mode))
        what = f"{kind} batch={B} {'depth' if kind == 'round' else 'tree'}={shape} {mode}"
        if spec is None:
            if mode not in s["modes"]:
                return None, f"no {mode} graphs were compiled (modes {s['modes']}; recompile with --modes greedy,sample)"
            return None, f"no package for the {what} round (compiled: batch buckets {s['batch_buckets']})"
        if mode == "greedy":
            return self._package(spec), None
        vocab = self.manifest["model"]["vocab_size"]
        want = normalize_filters(vocab, params.top_k, params.top_p, params.min_p)
        baked = (s["sampling"]["top_k"], s["sampling"]["top_p"], s["sampling"]["min_p"])
        if want != baked:
            return None, (f"the sampling graphs have top_k={baked[0]}, top_p={baked[1]}, min_p={baked[2]} baked in; "
                          f"asked for top_k={params.top_k}, top_p={params.top_p}, min_p={params.min_p}")
        return self._package(spec), None  # the temperature is the graph's input after the drafts


class _JsonConfig:
    """A model configuration read from config.json as plain attributes, with the two methods the
    compiler calls (``get_text_config``, ``to_dict``); the graphs were captured with SDPA."""

    def __init__(self, raw: dict):
        self.__dict__.update(raw)
        self._raw = raw
        self._attn_implementation = "sdpa"

    def get_text_config(self, decoder=False, **kwargs):
        sub = self._raw.get("text_config")
        return _JsonConfig(sub) if isinstance(sub, dict) else self

    def to_dict(self) -> dict:
        return dict(self._raw)


class _Weight(torch.nn.Module):
    def __init__(self, t):
        super().__init__()
        self.weight = torch.nn.Parameter(t, requires_grad=False)

    @property
    def out_features(self) -> int:  # as nn.Linear says it (the output embedding's vocabulary)
        return self.weight.shape[0]


class _PackagedModel(torch.nn.Module):
    """Stands in for the HF model when every graph, the prefill included, comes from packages:
    what the compiler reads of a model (config, generation config, embeddings' shape, parameter
    dtype and device) from config.json, generation_config.json and the memory-mapped weights. It
    has no forward: building it imports no transformers modeling code and copies no weights."""

    def __init__(self, config: dict, generation: dict, tensors: dict, embeddings: dict):
        super().__init__()
        self.config = _JsonConfig(config)
        from transformers import GenerationConfig

        self.generation_config = GenerationConfig.from_dict(generation)
        self._in = _Weight(tensors[embeddings["input"]])
        self._out = self._in if embeddings["output"] == embeddings["input"] else _Weight(tensors[embeddings["output"]])
        self.tensors = tensors
        self.eval()

    def get_input_embeddings(self):
        return self._in

    def get_output_embeddings(self):
        return self._out

    def forward(self, *args, **kwargs):
        raise RuntimeError("this model is served by AOTInductor packages only (load_dir(..., missing='jit') "
                           "or load_hf_model() give the HF model)")


def _packaged_tensors(mdir_root: Path, man: dict) -> dict:
    """Every tensor the packages bind, by HF name, memory-mapped from the safetensors files."""
    from safetensors.torch import load_file

    m = man["model"]
    tensors = load_file(str(mdir_root / m["weights"]))  # memory-mapped, no copy, no code execution
    wm = m.get("weights_map") or {}
    if wm.get("extra_file"):
        tensors.update(load_file(str(mdir_root / wm["extra_file"])))
    for name, stored in (wm.get("aliases") or {}).items():
        tensors[name] = tensors[stored]
    return tensors


class _ChunkedPrefill:
    """Replaces the compiler's eager prefill step (``Step(model)``, called once per prompt by
    :meth:`SpecGraphModel._prefill` with ids / positions / causal mask / slots for the whole prompt)
    by the prefill packages, C tokens per call. Padding columns (slot = scratch) stay invalid; the
    packaged chunk rebuilds the same causal-by-position mask, so the given mask is not needed."""

    def __init__(self, loaded: "LoadedDir"):
        self.loaded = loaded

    def __call__(self, ids, pos, valid, *kv):
        B, P = ids.shape
        spec = self.loaded._prefill_specs.get(B)
        if spec is None:
            raise ArtifactError(f"{self.loaded.path}: no prefill package for batch bucket {B}")
        pkg = self.loaded._package(spec)
        C = spec["depth"]
        for c0 in range(0, P, C):
            n = min(C, P - c0)
            ids_c = ids.new_zeros(B, C)
            pos_c = ids.new_zeros(B, C)
            val_c = torch.zeros(B, C, dtype=torch.bool, device=ids.device)
            ids_c[:, :n], pos_c[:, :n], val_c[:, :n] = ids[:, c0:c0 + n], pos[:, c0:c0 + n], valid[:, c0:c0 + n]
            pkg(ids_c, pos_c, val_c, *kv)


def load_dir(
    path,
    model=None,
    *,
    tokenizer: bool = True,
    missing: str = "error",
    check_files: bool = True,
    background_weights_check: bool = False,
) -> LoadedDir:
    """Load a directory written by :func:`compile_dir` (CLI ``specgraph compile``).

    By default no transformers modeling code is imported and no weight is copied: ``fast.model``
    is a stand-in built from config.json and the memory-mapped weights, the prompt is prefilled by
    the prefill packages and every round by the round packages (the loop is
    ``SpecGraphModel.generate``). :func:`load_hf_model` gives the HF model when you need it.

    Args:
        model: bind the packages to this HF model instead (its fingerprint must match the manifest's).
        tokenizer: also load the tokenizer from ``path/model``.
        missing: what a request for a shape the directory lacks does: ``"error"`` (raise) or
            ``"jit"`` (compile it with torch.compile on first use, with a warning; builds the HF model).
        check_files: check every file's size and sha256 before it is opened or parsed (default;
            the weights hash on a thread of their own while the tokenizer loads), after refusing a
            directory that every local user can write (:func:`check_writers`).
        background_weights_check: deprecated, warns and has no effect: the weights are always
            checked before they are mapped (so :meth:`LoadedDir.wait_verified` returns at once).
    """
    from specgraph import compile as sg_compile

    if missing not in ("error", "jit"):
        raise ValueError(f"missing must be 'error' or 'jit', got {missing!r}")
    if background_weights_check:
        warnings.warn("load_dir(background_weights_check=True) has no effect: every file, the weights included, is "
                      "checked before it is opened", DeprecationWarning, stacklevel=2)
    t0 = time.perf_counter()
    d = Path(path)
    man = read_manifest(d)
    timings = {"manifest": time.perf_counter() - t0}
    if "pt2" not in man.get("formats", []):
        raise ArtifactError(f"{d}: no AOTInductor packages (formats {man.get('formats')}); use the ONNX runtime")
    files = man["files"]
    needed = [f for f in files if not f.startswith(ONNX_SUBDIR + "/")]
    if check_files:
        check_writers(d, [MANIFEST, *needed])
    # every file is checked before it is opened or parsed: the weights (most of the bytes) on one
    # thread, the rest on another, so the tokenizer loads while the weights are still hashing
    weights = [man["model"]["weights"]] if man["model"].get("weights") in needed else []
    verifier = FileVerifier(d, files, [f for f in needed if f not in weights]) if check_files else None
    weights_verifier = FileVerifier(d, files, weights) if check_files and weights else None
    mdir = d / man["model"]["dir"]
    dtype = getattr(torch, man["model"]["dtype"])
    device = man["platform"].get("device", "cpu")
    given = model is not None
    has_prefill = any(g["kind"] == "prefill" for g in man["graphs"])
    tok, tensors = None, None
    t1 = time.perf_counter()
    if verifier is not None:
        verifier.wait()
    timings["verify_wait"] = time.perf_counter() - t1
    t1 = time.perf_counter()
    if tokenizer:
        tok = load_tokenizer(mdir, man)
    timings["tokenizer"] = time.perf_counter() - t1
    t1 = time.perf_counter()
    if weights_verifier is not None:
        weights_verifier.wait()
    timings["weights_check_wait"] = time.perf_counter() - t1
    t1 = time.perf_counter()
    if model is None and (missing == "jit" or not has_prefill):
        model = _load_model(mdir, dtype, device)  # the HF model: JIT fallback / eager prefill need it
    elif model is None:
        tensors = _packaged_tensors(d, man)
        if device != "cpu":
            tensors = {k: v.to(device) for k, v in tensors.items()}
        model = _PackagedModel(json.loads((mdir / "config.json").read_text()),
                               json.loads((mdir / "generation_config.json").read_text()), tensors,
                               man["model"]["embeddings"])
    timings["model"] = time.perf_counter() - t1
    # the running model must be the one the graphs were compiled for (a model read from the checked
    # weights file has the manifest's embeddings: they are not hashed again)
    rec = man["model"]["fingerprint"]
    diff = fingerprint_mismatch(rec, model_fingerprint(model, None if given else rec.get("embeddings")))
    if diff is not None:
        raise ArtifactError(f"{d / MANIFEST}: the model does not match the one the graphs were compiled for: {diff} differ")
    s = man["settings"]
    tree = s["tree"] if s["tree"] is None or isinstance(s["tree"], str) else [tuple(p) for p in s["tree"]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        k = s["num_speculative_tokens"] if s["draft"] is not None else 1  # plain decoding records K = 0
        fast = sg_compile(model, s["draft"], num_speculative_tokens=k, tree=tree,
                          backend="inductor", max_batch_size=s["max_batch_size"], max_seq_len=s["max_seq_len"],
                          warmup=False, attention=s.get("attention", "sdpa"))  # the directory's packages serve the rounds
    if s.get("kernel_threads"):
        fast.built_threads = s["kernel_threads"]
    if fast.fallback_reason is not None:
        raise ArtifactError(f"{d}: the model cannot be served by the compiled graphs here: {fast.fallback_reason}")
    if s["draft"] is not None and s["tree"] is None and s["k_ladder"]:
        fast.set_depths(s["k_ladder"])
    loaded = LoadedDir(path=d, manifest=man, fast=fast, model=model, tokenizer=tok, timings=timings)
    loaded._tensors = tensors if tensors is not None else model_tensors(model)
    loaded._specs = {package_key(g["kind"], g["batch"], g["tree"] or g["depth"], g["mode"]): g
                     for g in man["graphs"]}
    loaded._prefill_specs = {g["batch"]: g for g in man["graphs"] if g["kind"] == "prefill"}
    # Hooks into the compiler (see the report in the module docstring): compiled-graph lookups are
    # answered from the packages, and the prompt prefill runs the prefill packages.
    fast.use_graphs(_PackagedGraphs({}, loaded, missing), prefill=_ChunkedPrefill(loaded) if has_prefill else None)
    timings["total"] = time.perf_counter() - t0
    return loaded


def load_dir_for_serving(path) -> tuple:
    """What ``specgraph serve DIR`` serves (:func:`specgraph.serving.launch.build_server`'s
    ``compiled``): (fast, tokenizer, the sampling filters baked into the sampling packages as a
    temperature-1 :class:`SamplingParams`). The packages are bound to the directory's own HF
    model (:func:`load_hf_model`), whose kernels prefill the prompts as for a served MODEL; a
    round the directory lacks raises (``missing="error"``)."""
    loaded = load_dir(path, model=load_hf_model(path))
    if loaded.tokenizer is None:
        raise ArtifactError(f"{path}: the directory holds no tokenizer (compile it with one to serve it)")
    s = loaded.manifest["settings"]["sampling"]
    return loaded.fast, loaded.tokenizer, SamplingParams(1.0, s["top_k"], s["top_p"], s["min_p"])


def check_writers(d: Path, names) -> None:
    """Refuse compiled directory ``d`` when it, a folder of it or one of its files ``names`` is
    writable by every local user: its sha256s would check nothing (the manifest can be rewritten
    too)."""
    paths = [safe_path(d, n) for n in names]
    for p in [d, *sorted({p.parent for p in paths} - {d}), *paths]:
        why = writable_by_others(p, modes=0o002, follow_symlinks=True) if p.exists() else None
        if why is not None:
            raise ArtifactError(f"{p} is {why}: any local user could have replaced it; refusing to load it (chmod o-w)")


def load_hf_model(path):
    """The HF model of a compiled directory (``path/model``; safetensors only), after checking its files."""
    d = Path(path)
    man = read_manifest(d)
    check_model_files(d, man, weights=True)
    return _load_model(d / man["model"]["dir"], getattr(torch, man["model"]["dtype"]),
                       man["platform"].get("device", "cpu"))


def load_tokenizer(mdir: Path, man: dict):
    tk = man.get("tokenizer") or {}
    if not tk.get("files"):
        return None
    if tk.get("loader") == "fast":  # checked at compile time to behave exactly like the original
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(mdir)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(mdir)


def check_model_files(path, manifest: dict, weights: bool = True) -> None:
    """Check the size and sha256 of the files under ``model/`` (optionally without the weights)."""
    files = manifest["files"]
    prefix = manifest["model"]["dir"] + "/"
    skip = None if weights else manifest["model"].get("weights")
    verify_files(path, files, [f for f in files if f.startswith(prefix) and f != skip])


def _load_model(mdir: Path, dtype, device: str):
    from transformers import AutoModelForCausalLM

    with _quiet_transformers():
        model = AutoModelForCausalLM.from_pretrained(mdir, dtype=dtype, use_safetensors=True, attn_implementation="sdpa")
    if device != "cpu":
        model = model.to(device)
    return model.eval()


@contextlib.contextmanager
def _quiet_transformers():
    """No "Loading weights" progress bar on stderr."""
    try:
        from transformers.utils import logging as hf_logging

        was = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
    except Exception:  # noqa: BLE001 - logging helpers moved
        yield
        return
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()
