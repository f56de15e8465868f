"""The persistent graph cache: a compiled object's graph set kept on disk, so that the same
``specgraph.compile(...)`` in a new process loads its graphs in seconds instead of building them.

An entry is a folder ``<root>/<key>/`` (root: ``$SPECGRAPH_GRAPH_CACHE``, default
``$SPECGRAPH_CACHE/graphs``, i.e. ``~/.cache/specgraph/graphs``)::

    entry.json          the key's fields, the graphs, sha256 + size of every file (written last)
    pt2/<graph>.pt2     one AOTInductor package per graph of the object's graph set

Key. sha256 over every weight of the model (names, dtypes, shapes, bytes), its canonical
configuration, the settings that shape the graphs (drafter kind, chain depths, tree shapes, batch
buckets, cache slots, sliding window, modes, freezing, autotuning), the specgraph / torch /
transformers / Python versions, and the machine (CPU model name, instruction set, device). Any
change to one of them is another entry: a cached graph never serves a model or setting it was not
built for. Weights are hashed in full because a frozen package carries them.

Packages. ``torch.export`` of the engine's own round functions (the ones the JIT path compiles,
with the attended width a dynamic input), lowered by AOTInductor with the object's settings:
frozen (the weights prepacked inside each package, the fast CPU GEMMs) and autotuned when the
object is. A graph the process's freeze budget (:mod:`specgraph.freezing`) refuses is packaged
unfrozen and bound to the model's own tensors at load time.

Safety. An entry is used only when its entry.json is readable, records this key, and every file it
lists matches its size and sha256; anything else is removed and rebuilt, with a warning saying
why. Entries appear atomically: built in a temporary folder beside, then renamed.

Only chain and tree rounds of model-free drafters (plain decoding, ``"ngram"``, ``"suffix"``) on
the CPU are packaged; other objects build their graphs with the JIT (:meth:`SpecGraphModel.warmup`).
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import tempfile
import time
import warnings
from pathlib import Path

import torch

from specgraph.aot import PT2_SUBDIR, Package, package_graph
from specgraph.artifacts import ArtifactError, canonical_config, file_entry, verify_files, versions
from specgraph.graphset import MODES, Progress, batch_buckets
from specgraph.models import cache_dir

FORMAT = "specgraph-graph-cache"
FORMAT_VERSION = 1
ENTRY = "entry.json"
ENV_ROOT = "SPECGRAPH_GRAPH_CACHE"
DISK_MARGIN_BYTES = 1 << 30  # left free on the cache's disk


def cache_root(root=None) -> Path:
    """Where entries live: ``root``, else ``$SPECGRAPH_GRAPH_CACHE``, else ``$SPECGRAPH_CACHE/graphs``."""
    if root is not None:
        return Path(root).expanduser()
    env = os.environ.get(ENV_ROOT)
    return Path(env).expanduser() if env else cache_dir() / "graphs"


def unsupported(fast) -> str | None:
    """Why ``fast``'s graph set cannot be cached (None when it can)."""
    if fast.fallback_reason is not None:
        return "the model runs on the eager fallback"
    if fast.backend != "inductor":
        return f"backend={fast.backend!r} compiles nothing"
    if next(fast.model.parameters()).device.type != "cpu":
        return "graphs on CUDA are recorded as CUDA graphs by the JIT"
    if fast.learned is not None or fast.draft not in (None, "ngram", "suffix"):
        return f"the {fast.draft!r} drafter's graphs are built by the JIT"
    return None


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or the platform's processor string."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def weights_sha256(model) -> str:
    """sha256 over every distinct parameter and buffer of ``model``: name, dtype, shape and bytes."""
    h = hashlib.sha256()
    seen = set()
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for name, t in sorted(named, key=lambda nt: nt[0]):
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        ident = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        if ident in seen:  # a tied tensor: its name is hashed, its bytes were
            continue
        seen.add(ident)
        data = t.detach().to("cpu").contiguous().reshape(-1)
        h.update(memoryview(data.view(torch.uint8).numpy()))
    return h.hexdigest()


def entry_key(fast, modes) -> dict:
    """Everything a cached graph depends on (see the module docstring)."""
    cap = getattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")()
    return {
        "format_version": FORMAT_VERSION,
        "weights_sha256": weights_sha256(fast.model),
        "config": canonical_config(fast.model),
        "dtype": str(next(fast.model.parameters()).dtype),
        "drafter": fast.draft,
        "chain_depths": fast.chain_depths(),
        "tree_shapes": [list(t) for t in fast.tree_shapes()],
        "batch_buckets": batch_buckets(fast.max_batch_size),
        "slots": fast.slots,
        "window": fast.window,
        "modes": list(modes),
        "freeze": fast.freeze,
        "autotune": fast.autotune,
        "graphs": [g.name for g in fast.graph_plan(modes)],
        "versions": {**versions(), "python": platform.python_version()},
        "machine": {"cpu": cpu_model(), "isa": cap, "arch": platform.machine(), "device": "cpu"},
    }


def key_digest(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:32]


class CachedGraphs(dict):
    """A :meth:`SpecGraphModel.use_graphs` mapping answered by an entry's packages. Sampling
    packages serve temperature-only sampling (the temperature is an input); a request with
    top-k / top-p / min-p is left to the JIT, as it is after :meth:`SpecGraphModel.warmup`."""

    def __init__(self, packages: dict):
        super().__init__()
        self.packages = packages  # (kind, batch, depth or tree shape, mode) -> Package

    def __contains__(self, key) -> bool:
        if dict.__contains__(self, key):
            return True
        if key[0] not in ("round", "tree"):
            return False
        kind, batch, params, _, shape = key
        if not params.greedy and (params.top_k, params.top_p, params.min_p) != (None, None, None):
            return False
        pkg = self.packages.get((kind, batch, tuple(shape) if kind == "tree" else shape,
                                 "greedy" if params.greedy else "sample"))
        if pkg is None:
            return False
        self[key] = pkg
        return True


def load_or_build(fast, modes=MODES, progress: bool = True, root=None) -> dict | None:
    """Serve ``fast``'s graph set from its cache entry, building the entry first when there is
    none (or it is corrupt or stale). Returns what happened ({"path", "hit", "seconds", "built",
    "loaded", "frozen"}), or None when the object or the disk cannot have an entry (a warning
    says why when it is the disk). :meth:`SpecGraphModel.warmup` afterwards builds whatever the
    entry does not serve (graphs the freeze budget refused at load) and checks every graph runs."""
    if unsupported(fast) is not None:
        return None
    t0 = time.perf_counter()
    key = entry_key(fast, modes)
    path = cache_root(root) / key_digest(key)
    why = _check_entry(path, key)
    built = 0
    if why is not None:
        if path.exists():
            warnings.warn(f"specgraph: graph cache entry {path} is not usable ({why}); rebuilding it", stacklevel=3)
            shutil.rmtree(path, ignore_errors=True)
        if not _room_for(fast, path.parent, len(key["graphs"])):
            return None
        built = _build_entry(fast, modes, key, path, progress)
    packages, frozen = open_entry(fast, path, reserve=built == 0)
    fast.use_graphs(CachedGraphs(packages))
    return {"path": str(path), "hit": built == 0, "seconds": round(time.perf_counter() - t0, 2), "built": built,
            "loaded": len(packages), "frozen": frozen}


def _check_entry(path: Path, key: dict) -> str | None:
    """None when the entry at ``path`` is complete, records ``key`` and every file checks out."""
    try:
        entry = json.loads((path / ENTRY).read_text())
    except FileNotFoundError:
        return "no entry"
    except (OSError, ValueError) as e:
        return f"unreadable {ENTRY}: {e}"
    if entry.get("format") != FORMAT or entry.get("key") != key:
        return "it was built for other settings"
    try:
        verify_files(path, entry["files"])
    except (ArtifactError, KeyError, OSError) as e:
        return str(e)
    return None


def _room_for(fast, root: Path, n_graphs: int) -> bool:
    """Whether the disk holding ``root`` has room for ``n_graphs`` frozen weight copies."""
    from specgraph.freezing import weight_bytes

    root.mkdir(parents=True, exist_ok=True)
    need = n_graphs * weight_bytes(fast.model) + DISK_MARGIN_BYTES
    free = shutil.disk_usage(root).free
    if free < need:
        warnings.warn(f"specgraph: not caching the graphs: they need ~{need / 2**30:.1f} GB and {root} has "
                      f"{free / 2**30:.1f} GB free (set {ENV_ROOT} elsewhere, or compile(..., cache=False))",
                      stacklevel=4)
        return False
    return True


def _build_entry(fast, modes, key: dict, path: Path, progress: bool) -> int:
    """Package every graph of ``fast``'s plan into a temporary folder beside ``path``, then rename
    it to ``path``. Returns the number of packages built."""
    plan = fast.graph_plan(modes)
    stage = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.tmp"))
    device = next(fast.model.parameters()).device
    vocab = fast.model.get_output_embeddings().weight.shape[0]
    bar = Progress(len(plan), progress, verb="building")
    graphs = []
    try:
        (stage / PT2_SUBDIR).mkdir()
        with torch.no_grad():
            for g in plan:
                bar.start(g.name)
                t1 = time.perf_counter()
                frozen = fast.reserve_frozen_copy(g.name)
                spec, _ = package_graph(fast, g, stage, device, vocab, (None, None, None), freeze=frozen,
                                        autotune=fast.autotune)
                spec["seconds"] = round(time.perf_counter() - t1, 2)
                graphs.append(spec)
                bar.advance(g.name, spec["seconds"])
        files = {p.relative_to(stage).as_posix(): file_entry(p) for p in sorted(stage.rglob("*")) if p.is_file()}
        entry = {"format": FORMAT, "key": key, "graphs": graphs, "files": files, "created_unix": int(time.time())}
        (stage / ENTRY).write_text(json.dumps(entry, indent=1) + "\n")
        try:
            stage.rename(path)
        except OSError:  # another process finished the same entry first: use theirs
            if _check_entry(path, key) is not None:
                raise
    finally:
        bar.close()
        shutil.rmtree(stage, ignore_errors=True)
    return len(graphs)


def open_entry(fast, path, reserve: bool = True) -> tuple[dict, int]:
    """Open the entry's packages. A frozen package holds its own weight copy: when ``reserve``,
    the freeze budget is asked for it first, and a package it refuses is not opened (the JIT then
    builds that graph unfrozen). Returns ({(kind, batch, shape, mode): Package}, frozen count)."""
    path = Path(path)
    entry = json.loads((path / ENTRY).read_text())
    tensors = dict(fast.model.named_parameters(remove_duplicate=False))
    tensors.update(dict(fast.model.named_buffers(remove_duplicate=False)))
    packages, frozen = {}, 0
    for spec in entry["graphs"]:
        if spec["frozen"] and reserve and not fast.reserve_frozen_copy(spec["name"]):
            continue
        frozen += bool(spec["frozen"])
        shape = tuple(spec["tree"]) if spec["tree"] else spec["depth"]
        packages[(spec["kind"], spec["batch"], shape, spec["mode"])] = Package(path / spec["file"], tensors, spec)
    return packages, frozen
