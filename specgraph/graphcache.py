"""The persistent graph cache: a compiled object's graph set kept on disk, so that the same
``specgraph.compile(...)`` in a new process loads its graphs in seconds instead of building them.

Entries live under ``$SPECGRAPH_GRAPH_CACHE`` (default ``$SPECGRAPH_CACHE/graphs``, i.e.
``~/.cache/specgraph/graphs``), one folder per model and build settings, one package per graph::

    <key>/key.json                  what the folder's graphs were built for
    <key>/<graph>[.frozen].pt2      one AOTInductor package per graph (e.g. round_b1_k4_greedy)
    <key>/<graph>[.frozen].json     its spec, sha256 and size (written after the package)
    <key>/<graph>.static            a dynamic-batch graph that failed to export (see below)
    <key>/.lock                     the build lock (one process builds an entry at a time)

An entry is a folder whose name is the digest of its own ``key.json`` (a graph-cache key):
:func:`entries` lists those and :func:`clear` (``specgraph cache --clear``) removes those,
leaving anything else under the root, reported as skipped.

Batch buckets. The larger buckets of a round share one package whose batch is a dynamic
dimension (``round_b2-32_k4_greedy``: buckets 2 to 32), batch 1 and the smallest rounds keep
their own (:func:`specgraph.graphset.with_dynamic_batch`): per (mode, depth) two or three
packages instead of one per bucket. A model whose code fixes its batch fails that export; the
folder records it (``.static``) and holds a package per bucket instead.

Batch 1 first. The batch-1 packages alone can serve every request: a round of B rows is B
rounds of one row, each on its row of the cache (:class:`RowSplit`: the same graph, the same
inputs row by row, so the same tokens). So ``refine="background"`` builds the batch-1
packages, returns, and leaves the others to the helper process, at a lower CPU priority; each
is adopted between calls (:meth:`CachedGraphs.refresh`) as it arrives, and until then its
buckets run row by row. Nothing is compiled on the request path either way.

Modes. With both modes a chain round is one package for greedy and sampled rows
(``round_b1_k4_any``: a row at temperature 0 is verified greedily,
:func:`specgraph.graphset.with_merged_modes`), half the packages of one per mode.

Graphs are shared between objects: plain decoding, ``"ngram"`` and ``"suffix"`` with the same
model and build settings use the same ``round_b1_k0_any``; an object finds the graphs it needs
there and builds only the missing ones.

Key. sha256 over every weight of the model (names, dtypes, shapes, bytes), its canonical
configuration and dtype, the settings that shape a graph beyond its name (cache slots, sliding
window, GEMM autotuning), the specgraph / torch / transformers / Python versions, and the machine
(CPU model name, instruction set, device). A change to any of them is another folder: a cached
graph never serves a model or setting it was not built for. Weights are hashed in full because a
frozen package carries them.

Packages. ``torch.export`` of the engine's own round functions (the ones the JIT path compiles,
with the attended width a dynamic input), lowered by AOTInductor with the object's settings:
frozen (the weights prepacked inside each package, the fast CPU GEMMs) and autotuned when the
object is. A graph the process's freeze budget (:mod:`specgraph.freezing`) refuses is used (or
built) unfrozen, bound to the model's own tensors at load time.

Safety. A package is native code this process loads. Another local user can neither plant nor
read one: the cache root and the entry folder must be owned by this process's effective uid and
writable by neither group nor others (the rule ssh applies to its keys; a link to the root is
followed, the entry folder is no link), else the cache is not used (a warning names the path and
why, and the JIT builds the graphs instead); new folders are 0700 and files 0600 whatever the
umask (frozen packages hold the model's weights). A package is used only when its record and
itself pass the same rule, the record is readable and names this folder's key and graph, and the
package matches its size and sha256 (corruption: a truncated copy, an interrupted write);
anything else is removed and rebuilt, with a warning saying why. Files appear atomically (written
under a temporary name, then renamed). Not protected: a process running as this user (or root)
can rewrite the cache, as it can rewrite this user's Python packages; the sha256 records detect
corruption, not such a writer.

Concurrency. One process builds an entry at a time: :func:`load_or_build` holds the entry's lock
(``filelock``) while it checks and builds, and through the background builds of
``refine="background"`` or ``"auto"`` (released when the helper process ends); a second process
waits (saying so each minute; after LOCK_WAIT_SECONDS, an hour, it compiles without the cache),
then loads what the first built and builds only what is still missing. The lock is per process
(reentrant): a second build of the same entry in the same process does not wait. Temporary files
carry their writer's process id (``.build-<pid>-*``, ``.helper-model-<pid>-*``) and are removed
by the next build once that process has exited, or once the pid names a process that started
after the file was written (a restarted container's pid 1).

Only chain and tree rounds of model-free drafters (plain decoding, ``"ngram"``, ``"suffix"``) on
the CPU are packaged; other objects build their graphs with the JIT (:meth:`SpecGraphModel.warmup`).
"""
from __future__ import annotations

import atexit
import dataclasses
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import torch
from filelock import FileLock, Timeout

from specgraph.capture import UnsupportedModel
from specgraph.artifacts import (
    ArtifactError, canonical_config, cpu_capability, cpu_model, file_entry, verify_files, versions, weights_sha256,
    writable_by_others,
)
from specgraph.freezing import weight_bytes
from specgraph.graphset import MODES, Progress, packed_prefill_spec, with_dynamic_batch, with_logits, with_merged_modes
from specgraph.models import cache_dir, save_checkpoint
from specgraph.packages import PT2_SUBDIR, Package, model_tensors, package_graph, package_key
from specgraph.warping import SamplingParams

FORMAT = "specgraph-graph-cache"
FORMAT_VERSION = 5
KEY_FILE = "key.json"
KEY_FIELDS = ("format_version", "config", "dtype", "versions", "machine")  # in every key format so far
KEY_MAX_BYTES = 1 << 20  # a key.json larger than this is no cache key
LOCK_FILE = ".lock"  # an entry's build lock (filelock): one process builds an entry's graphs at a time
ENV_ROOT = "SPECGRAPH_GRAPH_CACHE"
DISK_MARGIN_BYTES = 1 << 30  # left free on the cache's disk
ENV_HELPER = "SPECGRAPH_BUILD_HELPER"  # off: never build in a helper process; on: whenever possible
HELPER_MIN_PARAMS = 20_000_000  # by default a helper builds beside the process for models this large
REFINE_NICENESS = 10  # the helper's CPU priority (nice) once it builds refinements beside a serving process
_OFF = ("0", "off", "false", "no")  # values of $SPECGRAPH_GRAPH_CACHE that turn the default off


def cache_root(root=None) -> Path:
    """Where entries live: ``root``, else ``$SPECGRAPH_GRAPH_CACHE``, else ``$SPECGRAPH_CACHE/graphs``."""
    if root is not None:
        return Path(root).expanduser()
    env = os.environ.get(ENV_ROOT, "")
    return Path(env).expanduser() if env and env.lower() not in _OFF else cache_dir() / "graphs"


def enabled(cache) -> bool:
    """Whether ``compile(cache=...)`` uses the cache: ``False`` never; ``None`` (the default) unless
    ``$SPECGRAPH_GRAPH_CACHE`` is off; ``True`` or a folder always."""
    if cache is None:
        return os.environ.get(ENV_ROOT, "").lower() not in _OFF
    return cache is not False


def root_of(cache):
    """The ``root`` :func:`load_or_build` takes for ``compile(cache=...)``: a folder as given, else None."""
    return None if cache is None or cache is True else cache


def unsupported(fast) -> str | None:
    """Why ``fast``'s graph set cannot be cached (None when it can)."""
    if fast.fallback_reason is not None:
        return "the model runs on the eager fallback"
    if fast.backend != "inductor":
        return f"backend={fast.backend!r} compiles nothing"
    if next(fast.model.parameters()).device.type != "cpu":
        return "graphs on CUDA are recorded as CUDA graphs by the JIT"
    if fast.full_width:
        return "eager attention reads the whole cache: its rounds are static-width graphs, built by the JIT"
    if fast.learned is not None or fast.draft not in (None, "ngram", "suffix"):
        return f"the {fast.draft!r} drafter's graphs are built by the JIT"
    return None


def entry_key(fast) -> dict:
    """Everything a cached graph depends on beyond its name (see the module docstring)."""
    return {
        "format_version": FORMAT_VERSION,
        "weights_sha256": weights_sha256(fast.model),
        "config": canonical_config(fast.model),
        "dtype": str(next(fast.model.parameters()).dtype),
        "weights": fast.weights,
        "slots": fast.slots,
        "window": fast.window,
        "autotune": fast.autotune,
        "attention": fast.attention,
        "kernel_threads": fast.built_threads if fast.attention == "block_sparse" else None,
        "sampling": list(_filters(fast)),
        "versions": {**versions(), "python": platform.python_version()},
        "machine": {"cpu": cpu_model(), "isa": cpu_capability(), "arch": platform.machine(), "device": "cpu"},
    }


def key_digest(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _filters(fast) -> tuple:
    """(top_k, top_p, min_p) baked into the sampling packages: those of the model's default
    sampling request (:meth:`SpecGraphModel.default_sampling`)."""
    p = fast.default_sampling()
    return p.top_k, p.top_p, p.min_p


class CachedGraphs(dict):
    """A :meth:`SpecGraphModel.use_graphs` mapping answered by an entry's packages. Sampling
    packages serve the model's default filters at any temperature (an input); a request with
    other top-k / top-p / min-p, logits processors or score outputs is left to the JIT, as it is
    after :meth:`SpecGraphModel.warmup`."""

    def __init__(self, packages: dict, sampling: SamplingParams):
        super().__init__()
        self.packages = packages  # packages.package_key(...) -> Package
        self.sampling = sampling  # the filters baked into the sampling packages
        self.refiners: list[_Work] = []  # graphs being built in the background, adopted by refresh()
        self._answered: set = set()  # keys answered from self.packages (dropped when a graph arrives)

    def refresh(self) -> list[int]:
        """Adopt the graphs that background builds finished since the last call (each replaces
        the row-by-row rounds of its buckets); returns the batch buckets whose graphs changed
        (empty: none arrived). The caller drops what it bound to the old ones. Called by the
        engine between calls and rounds."""
        arrived = [staged for work in self.refiners for staged in work.arrived()]
        if not arrived:
            return []
        for staged in arrived:
            self.packages.update(staged)
        for key in self._answered:
            dict.pop(self, key, None)
        self._answered.clear()
        return sorted({key[1] for staged in arrived for key in staged if key[0] != "packed"})

    def packed_prefill(self):
        """The packed prefill package (:meth:`SpecGraphModel.prefill_packed`), None when this
        entry has none (not asked for, or still being built)."""
        return self.packages.get(package_key("packed", 1, 0, "greedy"))

    def refining(self) -> int:
        """Graphs still being built in the background (not counting those waiting for refresh())."""
        return sum(work.remaining() for work in self.refiners)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the background builds end (built, or given up with a warning); True when
        none is left. The engine adopts what they built at its next call (or :meth:`refresh`)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for work in self.refiners:
            if work.helper is not None:
                work.helper.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return all(work.helper is None or not work.helper.busy() for work in self.refiners)

    def __contains__(self, key) -> bool:
        if dict.__contains__(self, key):
            return True
        if key[0] not in ("round", "tree"):
            return False
        kind, batch, params, _, shape = key
        logits = None
        if not isinstance(params, SamplingParams):  # (settings, RoundExtras): processors are packaged, scores not
            params, extras = params
            if extras.scores or extras.logprobs >= 0:
                return False
            logits = extras.logits
        if not params.greedy and params != self.sampling:
            return False
        mode = "greedy" if params.greedy else "sample"
        pkg = self.packages.get(package_key(kind, batch, shape, mode, logits))
        if pkg is None and batch > 1 and self.refiners:  # built in the background (or given up): batch 1, row by row
            one = self.packages.get(package_key(kind, 1, shape, mode, logits))
            pkg = None if one is None else RowSplit(one)
        if pkg is None:
            return False
        self[key] = pkg
        self._answered.add(key)
        return True


REFINE = ("auto", "now", "background")


def load_or_build(fast, modes=MODES, progress: bool = True, root=None, logits=None,
                  dynamic_batch: bool = True, merge_modes: bool = True, refine: str = "now",
                  packed_prefill: bool = False) -> dict | None:
    """Serve ``fast``'s graph set (:meth:`SpecGraphModel.graph_plan`) from the cache, building the
    graphs it lacks (or holds corrupt) first, with the entry's lock held (another process building
    the same entry is waited for, then what it built is loaded: see "Concurrency" above). Returns
    what happened ({"path", "hit", "built", "helper_built" (of those, built by a helper process),
    "loaded", "frozen", "seconds"}), or None when the object cannot be cached, the disk has no room
    or the cache folder may hold another user's files (a warning says so).
    :meth:`SpecGraphModel.warmup` afterwards runs every graph once and
    builds with the JIT whatever the cache does not serve. ``logits`` (a
    :class:`specgraph.processors.LogitsSpec`): the plan's rounds with these logits processors
    instead, added to the packages the object is already served from. ``dynamic_batch``: batch
    buckets 2 and up share a package per round (:func:`specgraph.graphset.with_dynamic_batch`);
    False: a package per bucket. ``merge_modes``: with both modes, a chain round without logits
    processors is one package for greedy and sampled rows (:func:`specgraph.graphset.with_merged_modes`);
    False: a package per mode. ``refine`` (the packages of batch buckets above 1, which the
    batch-1 packages serve row by row meanwhile: :class:`RowSplit`): "now" builds them before
    returning; "background" after, in the helper process, adopted between calls as they arrive
    (where no helper process can build, "now", with a warning); "auto": "background" when a
    helper process builds beside this one, else "now". The result's "refining" counts the
    graphs still to come. ``packed_prefill``: the packed prefill graph too (a model that
    :attr:`SpecGraphModel.packs_prefill`), built with the graphs of the larger buckets."""
    if refine not in REFINE:
        raise ValueError(f"refine must be one of {REFINE}, got {refine!r}")
    if unsupported(fast) is not None:
        return None
    t0 = time.perf_counter()
    key = entry_key(fast)
    digest = key_digest(key)
    folder = _own_folder(cache_root(root), digest)
    if folder is None:
        return None
    lock = _acquire(folder, progress)
    if lock is None:
        return None
    handed_over = False  # the lock goes with the background builds, released when they end
    try:
        _sweep(folder)
        _write_key(folder, key)
        info, work = _load_or_build_locked(fast, folder, digest, t0, modes, progress, logits, dynamic_batch,
                                           merge_modes, refine, packed_prefill)
        if work is not None and work.background:
            work.helper.on_exit(lock.release)
            handed_over = True
        return info
    finally:
        if not handed_over:
            lock.release()


def _load_or_build_locked(fast, folder: Path, digest: str, t0: float, modes, progress: bool, logits,
                          dynamic_batch: bool, merge_modes: bool, refine: str, packed_prefill: bool) -> tuple:
    """:func:`load_or_build` in ``folder``, with its lock held: (its result, the build's
    :class:`_Work` or None)."""
    plan = fast.graph_plan(modes)
    if logits is not None:
        plan = with_logits(plan, logits)
    if merge_modes and not fast.draft_q:
        plan = with_merged_modes(plan)
    if dynamic_batch:
        plan = _batch_plan(fast, folder, digest, plan)
    if packed_prefill and logits is None and fast.packs_prefill:
        plan.append(packed_prefill_spec())
    packages, missing = {}, []
    for g in plan:
        frozen = fast.reserve_frozen_copy(g.name)
        pkg = _open_cached(fast, folder, g, frozen, digest)
        if pkg is None:
            missing.append((g, frozen))
        else:
            _register(fast, packages, g, pkg)
    if missing and not _room_for(fast, folder, sum(f for _, f in missing)):
        return None, None
    later = [m for m in missing if not _first(m[0])] if refine in ("auto", "background") else []
    if later and not _wants_helper(fast, missing):
        if refine == "background":
            warnings.warn("specgraph: no helper process can build this object's graphs (see SPECGRAPH_BUILD_HELPER); "
                          "building every batch bucket's graphs now", stacklevel=4)
        later = []
    # the dynamic-batch graphs first (they serve the most buckets), plain steps first among them (what a loaded server runs)
    later.sort(key=lambda m: (m[0].kind == "packed", m[0].batches is None, m[0].depth))
    now = [m for m in missing if m not in later]
    work = _build(fast, folder, digest, now, later, packages, progress) if missing else None
    served = fast.graphs_in_use()
    if isinstance(served, CachedGraphs):  # more packages for the same object (another processor setting)
        served.packages.update(packages)
    else:
        served = CachedGraphs(packages, fast.default_sampling())
        fast.use_graphs(served)
    refining = 0 if work is None else work.pending()
    if later:
        served.refiners.append(work)
    # a dynamic-batch package serves several buckets, a package of mode "any" both modes
    loaded = len({id(getattr(p, "package", p)) for p in packages.values()})
    return {"path": str(folder), "hit": not missing, "built": 0 if work is None else work.built,
            "helper_built": 0 if work is None else work.by_helper, "loaded": loaded, "refining": refining,
            "frozen": sum(fast.graph_frozen.get(g.name, False) for g in plan),
            "seconds": round(time.perf_counter() - t0, 2)}, work


def _first(g) -> bool:
    """Whether graph ``g`` is built before the object serves: the batch-1 rounds (the others'
    buckets run on them row by row until they arrive; the eager model prefills until the packed
    prefill graph arrives)."""
    return g.batches is None and g.batch == 1 and g.kind != "packed"


class RowSplit:
    """A round of B rows (a chain or tree round's inputs: the attended slots, then tensors whose
    first dimension is the batch, the KV caches last) run as B rounds of one row on a batch-1
    graph, each writing its own row of the cache (a view); the outputs are concatenated row by
    row. The graph and each row's inputs are those the batch-1 bucket runs, so a row gets the
    tokens it would get alone."""

    row_by_row = True  # what SpecGraphModel.row_by_row asks

    def __init__(self, one):
        self.one = one  # the batch-1 round (a Package, or GreedyRows over one)

    def __call__(self, cols, *args):
        rows = [self.one(cols, *(a[i:i + 1] for a in args)) for i in range(args[0].shape[0])]
        if isinstance(rows[0], torch.Tensor):
            return torch.cat(rows)
        return type(rows[0])(torch.cat(parts) for parts in zip(*rows))


def _untrusted(path: Path, follow_symlinks: bool = False) -> str | None:
    """Why ``path`` may hold what another local user wrote (None when it is this user's own and
    no one else can write it): a symbolic link, owned by another uid, or writable by group or
    others."""
    return writable_by_others(path, owners=(os.geteuid(),) if hasattr(os, "geteuid") else None,
                              follow_symlinks=follow_symlinks)


def _own_folder(root: Path, digest: str) -> Path | None:
    """The entry folder ``root/digest``, created (with the root) readable by this user only when
    missing; None, with a warning, when the root (a link to it is followed) or the folder may
    hold what another local user wrote: its graphs are native code this process would load. An
    entry made readable by others (by an older version) is made private (0700)."""
    _private_dir(root)
    place, why = root, _untrusted(root, follow_symlinks=True)
    if why is None:
        place = root / digest
        _private_dir(place)
        why = _untrusted(place)
    if why is not None:
        warnings.warn(f"specgraph: not using the graph cache at {place}: it is {why}, so another local user could "
                      f"have planted graphs in it; compiling without the cache (set {ENV_ROOT} to a folder of your "
                      "own, or fix its owner and mode: chown, chmod go-w)", stacklevel=4)
        return None
    if os.lstat(place).st_mode & 0o077:
        os.chmod(place, 0o700)
    return place


def _private_dir(path: Path) -> None:
    """Create folder ``path`` (its missing parents as the umask says) readable by this user only
    (0700, whatever the umask); an existing folder is left as it is."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        return
    os.chmod(path, 0o700)


def _lock(folder: Path) -> FileLock:
    """The build lock of entry ``folder``: one per process (reentrant, so a second build in the
    same process, e.g. the processor rounds after the plain ones, does not wait for the first's
    background builds), released from whichever thread ends the build."""
    return FileLock(folder / LOCK_FILE, mode=0o600, thread_local=False, is_singleton=True)


LOCK_WAIT_SECONDS = 3600  # the longest wait for another process's build of an entry
LOCK_REPORT_SECONDS = 60  # how often a waiting process says it is still waiting


def _acquire(folder: Path, progress: bool) -> FileLock | None:
    """Entry ``folder``'s build lock, held: waits while another process builds there (saying so
    every LOCK_REPORT_SECONDS); None, with a warning, after LOCK_WAIT_SECONDS (the other build
    hangs: this process compiles without the cache)."""
    lock, start, timeout = _lock(folder), time.monotonic(), 0.0
    while True:
        try:
            lock.acquire(timeout=timeout)
            return lock
        except Timeout:
            pass
        waited = time.monotonic() - start
        if waited >= LOCK_WAIT_SECONDS:
            warnings.warn(f"specgraph: another process has been building the graphs of {folder} for over "
                          f"{LOCK_WAIT_SECONDS / 60:.0f} minutes; compiling without the cache", stacklevel=4)
            return None
        if progress:
            print(f"specgraph: another process is building the graphs of {folder}; waiting for it"
                  + (f" ({waited:.0f} s so far)" if timeout else ""), file=sys.stderr)
        timeout = min(LOCK_REPORT_SECONDS, LOCK_WAIT_SECONDS - waited)


def _entry_problem(path: Path) -> str | None:
    """Why ``path`` is not a cache entry (None when it is): an entry is a folder, not a link,
    whose ``key.json`` is a graph-cache key (a ``format_version`` and the fields every key
    format has) and whose name is that key's digest."""
    key_file = path / KEY_FILE
    try:
        if path.is_symlink() or not path.is_dir():
            return "not a specgraph cache entry"
        if key_file.is_symlink() or key_file.stat().st_size > KEY_MAX_BYTES:
            return "not a specgraph cache entry (its key.json is not a cache key)"
        key = json.loads(key_file.read_text())
    except (OSError, ValueError):
        return "not a specgraph cache entry (no readable key.json)"
    if not isinstance(key, dict) or not isinstance(key.get("format_version"), int) or not set(KEY_FIELDS) <= key.keys():
        return "not a specgraph cache entry (its key.json is not a cache key)"
    if key_digest(key) != path.name:
        return "not a specgraph cache entry (its name is not its key's digest)"
    return None


def _write_key(folder: Path, key: dict) -> None:
    """``folder``'s key.json: kept when it is this user's and names the folder, else (re)written."""
    if _entry_problem(folder) is not None or _untrusted(folder / KEY_FILE) is not None:
        _write_atomic(folder / KEY_FILE, json.dumps(key, indent=1, sort_keys=True) + "\n")


STALE_SECONDS = 3600  # a build's temporary files without a process id, older than this, belong to a process that died
_OWNER_PID = re.compile(r"\.(?:build|helper-model|helper)-(\d+)-|\..*\.(\d+)\.tmp$")  # the writer's pid in a name


def _sweep(folder: Path) -> None:
    """Remove what killed builds left in ``folder``: stage folders (``.build-<pid>-*``), a helper's
    model copy and log (``.helper-model-<pid>-*``, ``.helper-<pid>-*.log``), unrenamed files
    (``.*.<pid>.tmp``), once the process named in them is gone; names without a process id (left
    by older versions) once older than STALE_SECONDS. Runs with the entry's lock held."""
    now = time.time()
    for p in [*folder.glob(".build-*"), *folder.glob(".helper-*"), *folder.glob(".*.tmp")]:
        try:
            if not _abandoned(p, now):
                continue
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        except OSError:  # another process removed it first
            pass


def _abandoned(path: Path, now: float) -> bool:
    """Whether temporary file ``path`` belongs to no running build: the process its name carries
    is gone, or (a name without one) it is older than STALE_SECONDS."""
    m = _OWNER_PID.match(path.name)
    if m is not None:
        pid = int(m.group(1) or m.group(2))
        if not _alive(pid):
            return True
        started = _process_start(pid)  # a pid reused since (a container's pid 1 restarted: this very process)
        return started is not None and started > path.lstat().st_mtime + 1.0
    return now - path.lstat().st_mtime >= STALE_SECONDS


def _process_start(pid: int) -> float | None:
    """When process ``pid`` started (seconds since the epoch; Linux's /proc), None where unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime, counted from the ")"
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process
        return True
    return True


def _register(fast, packages: dict, g, pkg: Package) -> None:
    """``pkg`` (graph ``g``) as the package of every batch bucket it serves; a graph of mode
    "any" serves the sampling rounds as it is and the greedy rounds through :class:`GreedyRows`."""
    shape = g.tree if g.kind == "tree" else g.depth
    lanes = {"greedy": GreedyRows(pkg, fast.vocab), "sample": pkg} if g.mode == "any" else {g.mode: pkg}
    for b in g.served_batches(fast.max_batch_size):
        for mode, fn in lanes.items():
            packages[package_key(g.kind, b, shape, mode, g.logits)] = fn


class GreedyRows:
    """A greedy round run on a package of mode "any" (:func:`specgraph.graphset.with_merged_modes`):
    takes the greedy round's inputs (``cols, root, L, active, accept_u, expo [B, K+1, 1], drafts,
    draft_probs, *kv``) and runs the package with every row at temperature 0 (verified greedily)
    and the race's noise, which greedy rows do not read, as ones [B, K+1, V]."""

    def __init__(self, package: Package, vocab: int):
        self.package, self.vocab = package, vocab
        self._ones: dict = {}  # K+1 -> (ones [B, K+1, V], zeros [B]) for the largest B seen

    def __call__(self, cols, root, L, active, accept_u, expo, drafts, draft_probs, *kv):
        B, q = expo.shape[:2]
        ones, zeros = self._ones.get(q, (None, None))
        if ones is None or ones.shape[0] < B or ones.device != expo.device:
            ones = torch.ones(B, q, self.vocab, device=expo.device)
            zeros = torch.zeros(B, device=expo.device)
            self._ones[q] = ones, zeros
        return self.package(cols, root, L, active, accept_u, ones[:B], drafts, draft_probs, zeros[:B], *kv)


def _batch_plan(fast, folder: Path, digest: str, plan: list) -> list:
    """``plan`` with the rounds of batches 2 and up as dynamic-batch graphs
    (:func:`specgraph.graphset.with_dynamic_batch`), except those this folder records as failing
    to export with a dynamic batch (a model whose code fixes its batch): those keep a graph per
    bucket."""
    out = []
    for g in with_dynamic_batch(plan, fast.max_batch_size):
        if g.batches is None or not (folder / f"{g.name}.static").exists():
            out.append(g)
            continue
        out += _per_bucket(fast, g)
    return out


def _per_bucket(fast, g) -> list:
    """Dynamic-batch graph ``g`` as one static graph per batch bucket it serves."""
    return [dataclasses.replace(g, batch=b, batches=None) for b in g.served_batches(fast.max_batch_size)]


def _stem(g, frozen: bool) -> str:
    return g.name + (".frozen" if frozen else "")


def _write_atomic(path: Path, text: str) -> None:
    """Write ``path`` readable by this user only (0600), under a temporary name, then rename it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with _private_file(tmp) as f:
        f.write(text)
    tmp.replace(path)


def _private_file(path: Path):
    """``path`` opened for writing (created, or truncated), readable by this user only (0600,
    whatever the umask); a symbolic link there is not followed."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o600)
    if hasattr(os, "fchmod"):
        os.fchmod(fd, 0o600)
    return os.fdopen(fd, "w")


def _open_cached(fast, folder: Path, g, frozen: bool, digest: str) -> Package | None:
    """The cached package of graph ``g`` (frozen or not), checked and opened; None when there is
    none, or when it does not check out (it is then removed, with a warning): its record or
    package is a link, another user's or writable by others, the record names another graph or
    key, or the package is not the recorded size and sha256."""
    stem = _stem(g, frozen)
    record, package = folder / f"{stem}.json", folder / f"{stem}.pt2"
    if not os.path.lexists(record):
        return None
    try:
        for f in (record, package):
            why = _untrusted(f) if os.path.lexists(f) else None
            if why is not None:
                raise ArtifactError(f"{f.name} is {why}")
        rec = json.loads(record.read_text())
        if rec.get("format") != FORMAT or rec.get("key") != digest or rec["spec"]["name"] != g.name:
            raise ArtifactError(f"{record.name} was recorded for another graph or key")
        verify_files(folder, {package.name: rec["file"]})
        return Package(package, model_tensors(fast.model), rec["spec"])
    except (ArtifactError, KeyError, OSError, ValueError, RuntimeError) as e:
        warnings.warn(f"specgraph: cached graph {package} is not usable ({e}); rebuilding it", stacklevel=5)
        record.unlink(missing_ok=True)
        package.unlink(missing_ok=True)
        return None


def _room_for(fast, folder: Path, n_frozen: int) -> bool:
    """Whether the disk holding ``folder`` has room for ``n_frozen`` frozen weight copies."""
    need = n_frozen * weight_bytes(fast.model) + DISK_MARGIN_BYTES
    free = shutil.disk_usage(folder).free
    if free < need:
        warnings.warn(f"specgraph: not caching the graphs: they need ~{need / 2**30:.1f} GB and {folder} has "
                      f"{free / 2**30:.1f} GB free (set {ENV_ROOT} elsewhere, or compile(..., cache=False))",
                      stacklevel=5)
        return False
    return True


def _build(fast, folder: Path, digest: str, missing: list, later: list, packages: dict, progress: bool) -> "_Work":
    """Package each (graph, frozen) of ``missing`` into ``folder`` and open it into ``packages``,
    with a helper process building beside this one when :func:`_wants_helper` says it pays; then
    leave ``later`` (refinements) to the helper, which goes on after this returns (the returned
    work's :meth:`_Work.arrived` hands over what it builds). A dynamic-batch graph that fails to
    export is recorded as such (``<graph>.static``) and replaced by a graph per batch bucket,
    with a warning."""
    device = next(fast.model.parameters()).device
    work = _Work(missing, later, packages, Progress(len(missing), progress, verb="building"))
    helper = _start_helper(fast, folder, digest, work) if _wants_helper(fast, missing + later) else None
    work.helper = helper
    if helper is None:
        work.take_back_later()

    def build_here(g, frozen) -> None:
        work.bar.start(g.name)
        t1 = time.perf_counter()
        try:
            pkg = build_package(fast, folder, digest, g, frozen, device, fast.vocab)
        except (torch._dynamo.exc.UserError, UnsupportedModel) as e:  # the model's code fixes its batch
            if g.batches is None:
                raise
            _write_atomic(folder / f"{g.name}.static", f"{type(e).__name__}: {e}\n")
            warnings.warn(f"specgraph: {g.name} does not export with a dynamic batch ({type(e).__name__}); "
                          "building a graph per batch bucket instead", stacklevel=6)
            work.add([(s, fast.reserve_frozen_copy(s.name)) for s in _per_bucket(fast, g)])
            return
        work.done(fast, g, pkg, time.perf_counter() - t1)

    background = False
    try:
        with torch.no_grad():
            while True:
                item = work.take()
                if item is not None:
                    build_here(*item)
                elif helper is not None and helper.busy() and work.helper_holds():
                    helper.wait(0.5)  # the helper builds the last graphs, and may yet hand one back
                else:
                    break
            background = work.settle(helper)
            if not background:
                if helper is not None:
                    helper.close()
                work.take_back_later()  # the helper is gone: what it handed back, and any refinement left
                while (item := work.take()) is not None:
                    build_here(*item)
                for staged in work.arrived():  # refinements it built before stopping
                    packages.update(staged)
    finally:
        if helper is not None and not background:
            helper.close()
        work.bar.close()
    return work


class _Work:
    """The graphs still to build, shared by this process and its helper: this process takes from
    the front of ``todo``, the helper from the back, then (once ``todo`` is empty) the
    refinements of ``later`` in order; ``in_helper`` counts the ``todo`` graphs the helper holds.
    A refinement the helper builds is staged for :meth:`arrived`, not registered here: the
    engine's thread adopts it (:meth:`CachedGraphs.refresh`)."""

    def __init__(self, missing: list, later: list, packages: dict, bar: Progress):
        self.todo, self.later, self.packages, self.bar = list(missing), list(later), packages, bar
        self.lock = threading.Lock()
        self.in_helper = 0  # graphs of todo the helper is building
        self.refining = 0  # refinements the helper is building
        self.by_helper = 0  # graphs the helper built
        self.built = 0  # graphs of todo built (by either process)
        self.helper = None  # the _Helper, if any
        self._staged: list[dict] = []  # registrations of built refinements, not yet adopted
        self.settled = False  # this process has stopped building: refinements are the helper's alone
        self.background = False  # the helper goes on building refinements after load_or_build returns

    def take(self):
        """The next graph for this process (None: none left)."""
        with self.lock:
            return self.todo.pop(0) if self.todo else None

    def take_for_helper(self) -> tuple:
        """(the next graph for the helper, whether it is a refinement); (None, False): none left."""
        with self.lock:
            if self.todo:
                self.in_helper += 1
                return self.todo.pop(-1), False
            if self.later:
                self.refining += 1
                return self.later.pop(0), True
            return None, False

    def helper_holds(self) -> bool:
        with self.lock:
            return self.in_helper > 0

    def remaining(self) -> int:
        """Refinements not built yet (queued or in the helper)."""
        with self.lock:
            return len(self.later) + self.refining

    def pending(self) -> int:
        """Refinements not adopted yet: to build, building, or built and waiting for :meth:`arrived`."""
        with self.lock:
            return len(self.later) + self.refining + len(self._staged)

    def give_back(self, item, refinement: bool = False) -> None:
        """A graph the helper took and did not build: this process builds it next (a refinement
        goes back to the front of the refinements)."""
        with self.lock:
            if refinement:
                self.later.insert(0, item)
                self.refining -= 1
            else:
                self.todo.insert(0, item)
                self.in_helper -= 1

    def abandon(self) -> list:
        """The helper stopped: while this process still builds, it takes the refinements too;
        afterwards they are dropped (their buckets keep running row by row). Returns those dropped."""
        with self.lock:
            if not self.settled:
                self._later_to_todo()
                return []
            left, self.later = self.later, []
            return left

    def take_back_later(self) -> None:
        """The refinements not built yet, into this process's list."""
        with self.lock:
            self._later_to_todo()

    def _later_to_todo(self) -> None:  # with self.lock held
        self.todo += self.later
        self.bar.grow(len(self.later))
        self.later = []

    def settle(self, helper) -> bool:
        """This process is done building: whether the helper goes on with the refinements."""
        with self.lock:
            self.settled = True
            self.background = (helper is not None and helper.busy() and not self.todo
                               and bool(self.later or self.refining))
            return self.background

    def per_bucket(self, fast, folder: Path, g, error: str) -> None:
        """Refinement ``g``, a dynamic-batch graph, failed to export: recorded as such, and its
        buckets' static graphs queued in its place."""
        _write_atomic(folder / f"{g.name}.static", error + "\n")
        warnings.warn(f"specgraph: {g.name} does not export with a dynamic batch; building a graph per batch bucket "
                      "instead", stacklevel=2)
        with self.lock:
            self.refining -= 1
            self.later = [(s, fast.reserve_frozen_copy(s.name)) for s in _per_bucket(fast, g)] + self.later

    def add(self, items: list) -> None:
        with self.lock:
            self.todo += items
            self.bar.grow(len(items))

    def done(self, fast, g, pkg: Package, seconds: float, helper: bool = False, refinement: bool = False) -> None:
        with self.lock:
            if refinement:
                staged: dict = {}
                _register(fast, staged, g, pkg)
                self._staged.append(staged)
                self.refining -= 1
                self.by_helper += 1
                return
            _register(fast, self.packages, g, pkg)
            self.in_helper -= helper
            self.by_helper += helper
            self.built += 1
            self.bar.advance(g.name, seconds)

    def arrived(self) -> list[dict]:
        """The registrations of refinements built since the last call."""
        with self.lock:
            out, self._staged = self._staged, []
            return out


def _wants_helper(fast, missing: list) -> bool:
    """Whether a helper process builds beside this one: ``$SPECGRAPH_BUILD_HELPER`` off never, on
    whenever the object allows it; by default when the machine has a second core, there are at
    least two graphs to build and the model has HELPER_MIN_PARAMS parameters (a helper's start,
    ~15 s, pays for itself only when a graph takes longer than that). The helper rebuilds the
    object from the saved model, so it serves chains and plain decoding of a model whose class
    it can import, without logits processors."""
    env = os.environ.get(ENV_HELPER, "").lower()
    if env in _OFF or len(missing) < 2:
        return False
    if _helper_model(fast) is None:
        return False
    cls = type(fast.model)
    if (fast.tree is not None or fast.draft not in (None, "ngram", "suffix") or cls.__module__ == "__main__"
            or not hasattr(cls, "from_pretrained") or any(g.logits is not None for g, _ in missing)):
        return False
    if env in ("1", "on", "true", "yes"):
        return True
    size = sum(t.numel() for t in (*fast.model.parameters(), *fast.model.buffers()))  # quantized weights are buffers
    return (os.cpu_count() or 1) >= 2 and size >= HELPER_MIN_PARAMS


def _helper_model(fast):
    """The model a helper loads: the one ``compile`` was given (``fast.source_model``, kept while
    the graph set builds), from which the helper derives ``fast.weights`` again as ``compile``
    did; None when only a model at a low precision is known (its layers are specgraph's, which
    ``from_pretrained`` does not build)."""
    model = fast.source_model if fast.source_model is not None else fast.model
    return None if hasattr(model, "specgraph_weights") else model


def _start_helper(fast, folder: Path, digest: str, work: _Work) -> "_Helper | None":
    """A :class:`_Helper`, or None (with a warning) when the model cannot be saved for it."""
    try:
        return _Helper(fast, folder, digest, work)
    except (OSError, RuntimeError, ValueError) as e:
        warnings.warn(f"specgraph: no build helper process ({type(e).__name__}: {e}); building every graph in this "
                      "process", stacklevel=4)
        return None


class _Helper:
    """A :mod:`specgraph.buildworker` process fed from a thread of this one: it takes graphs from
    the back of the shared work, builds them into the cache folder, and this process checks and
    opens each package. A graph it fails on goes back to this process; a helper that fails to
    start, or fails on anything but a dynamic-batch export, stops (with a warning) and leaves the
    rest to this process, except refinements, which are dropped. It builds refinements at a
    lower CPU priority (the process it serves is answering requests by then), and is killed
    when this process exits."""

    def __init__(self, fast, folder: Path, digest: str, work: _Work):
        self.fast, self.folder, self.digest, self.work = fast, folder, digest, work
        self.proc, self.stopping = None, threading.Event()
        self._exit_lock, self._exited, self._on_exit = threading.Lock(), False, []
        # the model is saved here, before this process starts exporting it: torch.export swaps the
        # module's parameters while it traces, which a save from another thread would see
        self.model_dir = Path(tempfile.mkdtemp(dir=folder, prefix=f".helper-model-{os.getpid()}-"))  # 0700
        try:
            save_checkpoint(_helper_model(fast), self.model_dir)  # a GGUF-loaded model too
        except BaseException:
            shutil.rmtree(self.model_dir, ignore_errors=True)
            raise
        self.thread = threading.Thread(target=self._run, name="specgraph-build-helper", daemon=True)
        self.thread.start()
        atexit.register(self._at_exit)

    def busy(self) -> bool:
        return self.thread.is_alive()

    def on_exit(self, fn) -> None:
        """Call ``fn`` once the helper's thread ends (now, if it has)."""
        with self._exit_lock:
            if not self._exited:
                self._on_exit.append(fn)
                return
        fn()

    def wait(self, seconds: float | None) -> None:
        self.thread.join(seconds)

    def close(self, timeout: float | None = None) -> None:
        """Stop the helper process and its thread (``timeout``: wait at most that long for the
        thread, which may still be starting the process)."""
        self.stopping.set()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # it removes its build folder on the way out
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.thread.join(timeout)

    def _at_exit(self) -> None:
        """This process exits: stop the helper (building in the background)."""
        self.close(timeout=30)

    def _run(self) -> None:
        model_dir = self.model_dir
        log = self.folder / f".helper-{os.getpid()}-{id(self):x}.log"
        try:
            with _private_file(log) as err:
                self._start(model_dir, err)
                self._serve()
        except Exception as e:  # noqa: BLE001 - this process builds what the helper did not
            if not self.stopping.is_set():
                tail = log.read_text()[-2000:] if log.exists() else ""
                dropped = self.work.abandon()
                rest = (f"{len(dropped)} graphs of batch buckets above 1 are not built: those buckets run row by row on "
                        "the batch-1 graphs (compile(..., refine='now') builds them in this process)" if dropped
                        else "building the remaining graphs in this process")
                warnings.warn(f"specgraph: the build helper process stopped ({type(e).__name__}: {e}); {rest}\n{tail}",
                              stacklevel=2)
        finally:
            if self.proc is not None:
                try:
                    self.proc.stdin.close()  # the helper's end of the work: it exits
                except OSError:  # it has already exited
                    pass
                try:
                    self.proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
            shutil.rmtree(model_dir, ignore_errors=True)
            log.unlink(missing_ok=True)
            atexit.unregister(self._at_exit)  # nothing left to stop: let the object go
            with self._exit_lock:
                self._exited, done = True, self._on_exit
            for fn in done:
                fn()

    def _start(self, model_dir: Path, err) -> None:
        import specgraph.compiler as compiler

        model = _helper_model(self.fast)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.proc = subprocess.Popen([sys.executable, "-m", "specgraph.buildworker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        cls = type(model)
        self._send({"model_dir": str(model_dir), "model_class": f"{cls.__module__}.{cls.__qualname__}",
                    "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
                    "attn_implementation": model.config._attn_implementation, "folder": str(self.folder),
                    "digest": self.digest, "min_attend": compiler.MIN_ATTEND,
                    "gguf": getattr(model, "specgraph_gguf", None),
                    "settings": {"draft": self.fast.draft, "num_speculative_tokens": max(self.fast.k, 1),
                                 "max_batch_size": self.fast.max_batch_size, "max_seq_len": self.fast.max_seq_len,
                                 "freeze": self.fast.freeze, "autotune": self.fast.autotune,
                                 "attention": self.fast.attention, "weights": self.fast.weights}})
        reply = self._receive()
        if not reply.get("ready"):
            raise RuntimeError(reply.get("error", "no answer"))

    def _serve(self) -> None:
        while not self.stopping.is_set():
            item, refinement = self.work.take_for_helper()
            if item is None:
                return
            g, frozen = item
            try:
                self._send({"graph": dataclasses.asdict(g), "frozen": frozen, "nice": REFINE_NICENESS * refinement})
                reply = self._receive()
                pkg = _open_cached(self.fast, self.folder, g, frozen, self.digest) if "built" in reply else None
            except BaseException:
                self.work.give_back(item, refinement)
                raise
            if pkg is None and reply.get("export") and refinement and g.batches is not None:  # its code fixes the batch
                self.work.per_bucket(self.fast, self.folder, g, reply.get("error", ""))
                continue
            if pkg is None:
                self.work.give_back(item, refinement)
                if reply.get("export") and not refinement:
                    continue  # this process meets the same export error and records it (a refinement stops here)
                raise RuntimeError(reply.get("error", f"{g.name}: no usable package"))
            self.work.done(self.fast, g, pkg, reply["seconds"], helper=True, refinement=refinement)

    def _send(self, obj: dict) -> None:
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def _receive(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the helper exited (code {self.proc.wait()})")
        return json.loads(line)


def build_package(fast, folder: Path, digest: str, g, frozen: bool, device, vocab) -> Package:
    """Build graph ``g`` into ``folder`` (:func:`write_package`) and open it."""
    spec = write_package(fast, folder, digest, g, frozen, device, vocab)
    return Package(folder / spec["file"], model_tensors(fast.model), spec)


def write_package(fast, folder: Path, digest: str, g, frozen: bool, device, vocab) -> dict:
    """Build graph ``g`` into ``folder``, written atomically with its record; returns its spec.
    The helper process writes packages without opening them: the compiling process opens each
    after checking it."""
    t1 = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=folder, prefix=f".build-{os.getpid()}-") as stage:
        (Path(stage) / PT2_SUBDIR).mkdir()
        spec, _ = package_graph(fast, g, Path(stage), device, vocab, _filters(fast), freeze=frozen,
                                autotune=fast.autotune)
        stem = _stem(g, frozen)
        built = Path(stage) / spec["file"]
        spec["file"] = f"{stem}.pt2"
        rec = {"format": FORMAT, "key": digest, "spec": spec, "file": file_entry(built),
               "seconds": round(time.perf_counter() - t1, 2), "pid": os.getpid()}
        os.chmod(built, 0o600)
        built.replace(folder / spec["file"])
    _write_atomic(folder / f"{stem}.json", json.dumps(rec, indent=1) + "\n")
    return spec


def entries(root=None) -> list[dict]:
    """The cache's entries (:func:`_entry_problem`; anything else under the root is left out, see
    :func:`others`): {"path", "graphs" (names), "bytes", "model_type", "dtype", "torch"}."""
    out = []
    for folder in _children(cache_root(root)):
        if _entry_problem(folder) is not None:
            continue
        key = json.loads((folder / KEY_FILE).read_text())
        files = [p for p in folder.rglob("*") if p.is_file()]
        out.append({"path": str(folder), "graphs": sorted(p.stem for p in folder.glob("*.pt2")),
                    "bytes": sum(p.stat().st_size for p in files),
                    "model_type": (key.get("config") or {}).get("model_type"), "dtype": key.get("dtype"),
                    "torch": (key.get("versions") or {}).get("torch")})
    return out


def others(root=None) -> list[tuple[str, str]]:
    """What the cache root holds beside its entries (hidden names aside): (path, why it is not an
    entry) each. :func:`clear` leaves them."""
    return [(str(p), why) for p in _children(cache_root(root)) if (why := _entry_problem(p)) is not None]


def _children(base: Path) -> list[Path]:
    return sorted(p for p in base.glob("*") if not p.name.startswith(".")) if base.is_dir() else []


@dataclasses.dataclass
class Cleared:
    """What :func:`clear` did."""

    freed: int = 0  # bytes
    removed: list = dataclasses.field(default_factory=list)  # the entries' paths
    skipped: list = dataclasses.field(default_factory=list)  # (path, why) of what the root holds beside


def clear(root=None) -> Cleared:
    """Remove the cache's entries (:func:`entries`) and nothing else: a folder that is not an
    entry, or an entry another process is building (its lock is held), is skipped and reported."""
    out = Cleared(skipped=others(root))
    for entry in entries(root):
        lock = _lock(Path(entry["path"]))
        if lock.is_locked:  # this process builds there (the lock is reentrant within a process)
            out.skipped.append((entry["path"], "this process is building its graphs"))
            continue
        try:
            lock.acquire(timeout=0)
        except Timeout:
            out.skipped.append((entry["path"], "another process is building its graphs"))
            continue
        except OSError as e:  # e.g. another user's entry
            out.skipped.append((entry["path"], f"cannot lock it ({e.strerror or e})"))
            continue
        try:
            shutil.rmtree(entry["path"], ignore_errors=True)
        finally:
            lock.release()
        out.freed += entry["bytes"]
        out.removed.append(entry["path"])
    return out
