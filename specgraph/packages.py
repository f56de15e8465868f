"""AOTInductor packages of the engine's graphs: export, build, check and load one graph.

A package is ``torch.export`` of one graph of the graph set (:mod:`specgraph.graphset`): the
engine's own chain or tree round function (``SpecGraphModel.round_function`` /
``tree_round_function``), whose first input is the attended cache slots [W] with W a dynamic
dimension (:func:`width_range`), or a prefill chunk; lowered by
``torch._inductor.aoti_compile_and_package``. Unfrozen packages hold code only and bind the model's
tensors (constant names ``step.model.<HF name>``) at load time; frozen ones carry their prepacked
weights inside the ``.so``. Used by compiled directories (:mod:`specgraph.aot`) and the graph cache
(:mod:`specgraph.graphcache`).
"""
from __future__ import annotations

import shutil
import time
import warnings
import zipfile
from pathlib import Path

import torch

from specgraph.artifacts import ArtifactError
from specgraph.capture import Step, new_kv_cache
from specgraph.compiler import RoundExtras, SpecGraphModel, inductor_settings, kernel_threads
from specgraph.rounds import prefill_logits
from specgraph.graphset import GraphSpec, example_inputs
from specgraph.warping import SamplingParams

PT2_SUBDIR = "pt2"
CONST_PREFIX = "step.model."  # package constant names: the wrapper's .step (Step) -> .model (the HF model)
_PACKAGE_NAMES = {"archive_format", "archive_version", "version", "byteorder", "serialization_id", ".format_version"}
_PACKAGE_SUFFIXES = (".so", ".cpp", ".json", ".h", ".hpp", ".txt", ".o", ".ld", ".cubin", ".fatbin", ".spv")
def package_key(kind: str, batch: int, shape, mode: str, logits=None) -> tuple:
    """How a loaded package is looked up: (kind, batch bucket, chain depth or tree shape (N, C, D)
    as a tuple, "greedy" / "sample", the round's logits processors or None), from an engine graph
    key, a GraphSpec or a manifest entry."""
    return (kind, batch, tuple(shape) if kind == "tree" else shape, mode, logits)


def width_range(fast: SpecGraphModel) -> tuple[int, int]:
    """The attended widths a round package accepts (its dynamic dimension): 2 .. slots - 1."""
    return 2, fast.slots - 1


class _Graph(torch.nn.Module):
    """A compiler round function as a module, so ``torch.export`` lifts the step's parameters
    (``self.step``; constant names ``step.model.<HF name>``). Inputs: the attended slots [W],
    then the round's inputs and caches."""

    def __init__(self, fn, step):
        super().__init__()
        self.step = step
        self._fn = fn

    def forward(self, *args):
        return self._fn(*args)


class _PrefillChunk(torch.nn.Module):
    """C prompt tokens per row into the cache: what :meth:`SpecGraphModel._prefill` does with the
    eager model (query at position p sees the slots <= p; padding columns write to the scratch slot),
    on the captured, pass-rewritten step at query length C. Inputs: ids, pos, valid [B, C], *kv.
    The cache writes are the point: the logits are dead code."""

    def __init__(self, step, slots, window):
        super().__init__()
        self.step, self.slots, self.window = step, slots, window

    def forward(self, ids, pos, valid, *kv):
        prefill_logits(self.step, ids, pos, valid, kv, self.slots, self.window)
        return valid.sum(dim=1)


class _PackedPrefill(torch.nn.Module):
    """:meth:`SpecGraphModel.prefill_packed`'s model call: the unmodified model's step (``self.step``,
    logits at the last position only) over one packed sequence. Inputs: ids, pos, slot [1, T],
    the packed mask [1, 1, T, Wp], then the packed cache [1, H, Wp, D] per tensor; T and Wp are
    dynamic. The cache writes are the point."""

    def __init__(self, step):
        super().__init__()
        self.step = step

    def forward(self, ids, pos, mask, slot, *kv):
        self.step(ids, pos, mask, slot, *kv)
        return slot[:, -1]


def module_for(fast: SpecGraphModel, g: GraphSpec, filters) -> torch.nn.Module:
    if g.kind == "packed":
        return _PackedPrefill(Step(fast.model, all_logits=False))
    if g.kind == "prefill":
        return _PrefillChunk(fast._step(g.batch, g.depth), fast.slots, fast.window)
    params = SamplingParams(0.0) if g.mode == "greedy" else SamplingParams(1.0, *filters)
    extras = None if g.logits is None else RoundExtras(g.logits)
    top = None if g.batches is None else g.batches[1]  # a dynamic batch: the step is captured with one
    # the engine's round: its first input is the attended slots [W], W a dynamic dimension
    if g.kind == "tree":
        return _Graph(fast.tree_round_function(g.batch, params, g.tree, extras, max_batch=top),
                      fast._step(g.batch, g.tree[0], max_batch=top))
    return _Graph(fast.round_function(g.batch, params, g.depth, extras, max_batch=top, greedy_rows=g.mode == "any"),
                  fast._step(g.batch, g.depth + 1, max_batch=top))


def export_graph(fast: SpecGraphModel, g: GraphSpec, module, args: list, kv: list):
    """``torch.export`` of graph ``g``: a round's attended slots (its first input) have a dynamic
    length W in :func:`width_range`; with ``g.batches`` every other input's first dimension is a
    dynamic batch in that range; every other dimension is static."""
    if g.kind == "prefill":
        return torch.export.export(module, (*args, *kv), strict=False)
    if g.kind == "packed":
        tokens = torch.export.Dim("tokens", min=2, max=fast.slots)
        width = torch.export.Dim("width", min=2, max=fast.max_batch_size * fast.slots)
        shapes = {"ids": {1: tokens}, "pos": {1: tokens}, "mask": {2: tokens, 3: width}, "slot": {1: tokens},
                  "kv": ({2: width},) * len(kv)}
        return torch.export.export(module, (*args, *kv), dynamic_shapes=shapes, strict=False)
    lo, hi = width_range(fast)
    width = torch.export.Dim("width", min=lo, max=hi)
    batch = None if g.batches is None else {0: torch.export.Dim("batch", min=g.batches[0], max=g.batches[1])}
    shapes = ({0: width},) + (batch,) * (len(args) - 1 + len(kv))
    return torch.export.export(module, (*args, *kv), dynamic_shapes={"args": shapes}, strict=False)


def inductor_configs(device, freeze: bool = False, autotune: bool = False, attention: str = "sdpa",
                     low_precision: bool = False) -> dict:
    """AOTInductor settings. ``freeze``: the weights become constants inside the package's .so,
    prepacked for the GEMMs (a private copy per package); else the .so holds code only and its
    constants are bound at load time. ``autotune``: Inductor's GEMM template against the library
    call per shape; otherwise as the JIT (:func:`specgraph.compiler.inductor_settings`)."""
    return {**inductor_settings(device, freeze, autotune, attention, low_precision),
            "aot_inductor.package_constants_in_so": freeze}


def model_tensors(model) -> dict:
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(dict(model.named_buffers(remove_duplicate=False)))
    return named


def package_graph(fast, g: GraphSpec, out: Path, device, vocab, filters, tensors=None, freeze: bool = False,
                  autotune: bool = False) -> tuple[dict, set]:
    """Export and package graph ``g`` into ``out/pt2/``; returns (manifest entry, the model tensors
    the package binds at load time: none when ``freeze``, its weights are inside it)."""
    tensors = model_tensors(fast.model) if tensors is None else tensors
    args, names = example_inputs(fast, g, vocab)
    shapes = [list(a.shape) if g.batches is None else ["batch", *a.shape[1:]] for a in args]
    low = fast.weights != "float32"
    configs = inductor_configs(device, freeze, autotune, fast.attention, low)
    if g.kind == "packed":  # tokens and packed width dynamic; many rows' worth of tokens: every thread
        shapes = [[1, "tokens"], [1, "tokens"], [1, 1, "tokens", "width"], [1, "tokens"]]
        configs = {**inductor_configs(device, freeze, autotune, "sdpa", low), "cpp.threads": kernel_threads()}
    elif g.kind != "prefill":  # the attended slots come first; traced at the engine's smallest width
        args = [torch.arange(min(fast.min_attend, fast.slots - 1), device=device), *args]
        names, shapes = ["cols", *names], [["width"], *shapes]
    kv = new_kv_cache(fast.model, g.batch, args[2].shape[-1] if g.kind == "packed" else fast.slots)
    module = module_for(fast, g, filters)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ep = export_graph(fast, g, module, args, kv)
        rel = f"{PT2_SUBDIR}/{g.name}.pt2"
        torch._inductor.aoti_compile_and_package(ep, package_path=str(out / rel), inductor_configs=configs)
    del ep
    drop_build_folder(out / rel)
    # every constant an unfrozen package expects must be a tensor of the model (bound at load time)
    fqns = [] if freeze else open_package(out / rel).get_constant_fqns()
    unbound = [n for n in fqns if not n.startswith(CONST_PREFIX) or n[len(CONST_PREFIX):] not in tensors]
    if unbound:
        raise RuntimeError(f"{g.name}: the package expects constants that are not model tensors: {unbound[:5]}")
    return ({
        "name": g.name, "file": rel, "kind": g.kind, "batch": g.batch, "width": g.width, "mode": g.mode,
        "depth": g.depth, "tree": list(g.tree) if g.tree else None,
        "batches": list(g.batches) if g.batches else None,
        "inputs": [{"name": n, "shape": shape, "dtype": str(a.dtype).replace("torch.", "")}
                   for n, shape, a in zip(names, shapes, args)],
        "num_constants": len(fqns), "frozen": freeze,
    }, {n[len(CONST_PREFIX):] for n in fqns})


def drop_build_folder(package: Path) -> None:
    """Delete the folder Inductor compiled ``package`` in, inside its cache directory (a folder
    per build, named by a hash of the build's code): its wrapper .so is now inside the package and
    is never read there again, and for a frozen package it carries a copy of the weights (about
    620 MB for SmolLM2 fp32 per graph)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    with zipfile.ZipFile(package) as z:
        libs = {Path(n).name for n in z.namelist() if n.endswith(".wrapper.so")}
    for name in libs:
        for lib in Path(cache_dir()).glob(f"*/{name}"):
            shutil.rmtree(lib.parent, ignore_errors=True)


def check_package_archive(path: Path) -> None:
    """Refuse an archive with anything but code, JSON and version files (no pickles, no weights)."""
    try:
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
    except zipfile.BadZipFile as e:
        raise ArtifactError(f"{path}: not a readable AOTInductor package ({e})") from e
    for n in names:
        base = n.rsplit("/", 1)[-1]
        if n.endswith("/") or base in _PACKAGE_NAMES or base.endswith(_PACKAGE_SUFFIXES):
            continue
        raise ArtifactError(f"{path}: unexpected member {n!r} in the package (only code and JSON are allowed)")


def open_package(path: Path):
    check_package_archive(Path(path))
    # the C++ loader: unzips, dlopens the .so, reads JSON metadata (no Python unpickling anywhere)
    return torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)


class Package:
    """One loaded AOTInductor package with its constants bound to the model's tensors."""

    def __init__(self, path: Path, tensors: dict, spec: dict):
        self.path = path
        t0 = time.perf_counter()
        self.loader = open_package(path)
        fqns = [] if spec.get("frozen") else self.loader.get_constant_fqns()  # frozen: the weights are in the .so
        try:
            consts = {n: tensors[n[len(CONST_PREFIX):]] for n in fqns}
        except KeyError as e:
            raise ArtifactError(f"{path}: the package expects constant {e.args[0]!r}, which the model does not have") from e
        # user_managed: the package reads the model's own tensors (no copy); the model outlives it
        if consts:
            try:
                self.loader.load_constants(consts, False, True, True, False)
            except TypeError:  # torch < 2.13: no allow_h2d_copy argument
                self.loader.load_constants(consts, False, True, True)
        self._consts = consts  # keep the bound tensors alive with the package
        self.inputs = [(tuple(i["shape"]), getattr(torch, i["dtype"])) for i in spec["inputs"]]
        self.name = spec["name"]
        self.load_seconds = time.perf_counter() - t0

    def __call__(self, *args):
        n = len(self.inputs)
        small = []
        for a, (shape, dtype), i in zip(args[:n], self.inputs, range(n)):
            fits = a.dim() == len(shape) and all(isinstance(d, str) or d == s for d, s in zip(shape, a.shape))
            if not fits or a.dtype != dtype:
                raise RuntimeError(f"{self.name}: input {i} is {tuple(a.shape)} {a.dtype}, the package was compiled "
                                   f"for {shape} {dtype}")
            small.append(a if a.is_contiguous() else a.contiguous())
        return self.loader.boxed_run(small + list(args[n:]))  # caches are mutated in place


