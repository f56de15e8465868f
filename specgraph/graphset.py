"""The graph set: every graph a compiled object's ``generate`` can ask for, named and enumerable.

One compiled object serves a bounded set of graphs, fixed by its compile settings: per batch
bucket (powers of two up to ``max_batch_size``) and sampling mode, a chain round per depth the
loop can choose (0 = a plain step, the drafter's ladder or the adaptive policy's depths), a tree
round per tree shape, and for draft models the draft's own steps. The attended cache width is not
part of a graph's identity: a round takes the attended slots as an input whose length is a
dynamic dimension (see :func:`specgraph.passes.attend_mask_width_pass`), so the set does not grow
with ``max_seq_len``.

:meth:`specgraph.compiler.SpecGraphModel.warmup` builds the whole set before the first request;
:mod:`specgraph.aot` and :mod:`specgraph.graphcache` package the same graphs (the width a dynamic
input of each AOTInductor package).
"""
from __future__ import annotations

import dataclasses
import hashlib

import sys
from dataclasses import dataclass

import torch

from specgraph.processors import bitmask_words

MODES = ("greedy", "sample")


@dataclass(frozen=True)
class GraphSpec:
    """One graph. ``kind``: "round" (chain of ``depth`` drafts), "tree" (``tree`` = (N nodes,
    C max children, D depth), ``depth`` = D), "draft" (a draft-model step feeding ``depth`` tokens),
    "draft_tree" (draft-model tree level ``depth``), "compact" (draft-cache compaction after a
    tree round), "prefill" (a chunk of ``depth`` prompt tokens), "packed" (prompt chunks of
    several rows packed into one sequence: :meth:`SpecGraphModel.prefill_packed`, its token count
    and packed cache width dynamic) or "learned" (a head drafter's graphs, built by a short
    generation). ``width``: the attended cache slots for a graph built
    per width, None for the engine's dynamic-width graphs. ``batches``: (lo, hi) for a graph
    whose batch is a dynamic dimension, serving every batch bucket from lo to hi (traced at
    ``batch``); None: the graph serves batch ``batch`` only."""

    kind: str
    batch: int
    width: int | None
    mode: str  # "greedy", "sample", or "any" (greedy and sampled rows: with_merged_modes)
    depth: int
    tree: tuple | None = None
    logits: object = None  # a round's logits processors (specgraph.processors.LogitsSpec), None: none
    batches: tuple | None = None  # (lo, hi): a dynamic batch serving buckets lo .. hi

    @property
    def name(self) -> str:
        if self.kind == "prefill":
            return f"prefill_b{self.batch}_c{self.depth}"
        if self.kind == "packed":
            return "packed_prefill"
        shape = "n{}_c{}_d{}".format(*self.tree) if self.kind == "tree" else f"k{self.depth}"
        if self.kind in ("draft", "draft_tree"):
            shape = f"q{self.depth}" if self.kind == "draft" else f"d{self.depth}"
        if self.kind in ("compact", "learned"):
            return f"{self.kind}_b{self.batch}" + ("" if self.kind == "compact" else f"_{self.mode}")
        width = "" if self.width is None else f"_w{self.width}"
        procs = "" if self.logits is None else "_lp" + hashlib.sha256(repr(self.logits).encode()).hexdigest()[:10]
        batch = self.batch if self.batches is None else "{}-{}".format(*self.batches)
        return f"{self.kind}_b{batch}_{shape}{width}_{self.mode}{procs}"

    def key(self) -> tuple:
        return (self.kind, self.batch, self.width, self.tree if self.kind == "tree" else self.depth, self.mode,
                self.logits, self.batches)

    def served_batches(self, max_batch: int) -> list[int]:
        """The batch buckets this graph serves."""
        if self.batches is None:
            return [self.batch]
        lo, hi = self.batches
        return [b for b in batch_buckets(max_batch) if lo <= b <= hi]


def batch_buckets(max_batch: int) -> list[int]:
    """The batch sizes graphs are built for: powers of two below ``max_batch``, and ``max_batch``."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return out + [max_batch]


def plan(fast, modes=MODES) -> list[GraphSpec]:
    """Every graph ``fast.generate`` can request, for the given sampling modes (dynamic width)."""
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ValueError(f"modes must be a non-empty subset of {MODES}, got {tuple(modes)!r}")
    out = []
    for B in batch_buckets(fast.max_batch_size):
        for mode in modes:
            if fast.learned is not None:  # head graphs are shaped inside the head drafter: a short generation builds them
                out.append(GraphSpec("learned", B, None, mode, fast.k))
            out += [GraphSpec("round", B, None, mode, k) for k in fast.chain_depths()]
            out += [GraphSpec("tree", B, None, mode, t[2], t) for t in fast.tree_shapes()]
            if fast.draft == "model" and fast.tree is None:
                out += [GraphSpec("draft", B, None, mode, q) for q in ((2, 1) if fast.k > 1 else (2,))]
        if fast.draft == "model" and fast.tree is not None:
            out += [GraphSpec("draft_tree", B, None, "greedy", d) for d in range(fast.tree.max_depth)]
            out.append(GraphSpec("compact", B, None, "greedy", 0))
    return out


PACKED_EXAMPLE = ((11, 0), (13, 6))  # the packed prefill graph's trace: committed slots, new tokens per row


def packed_prefill_spec() -> GraphSpec:
    """The packed prefill graph (one per compiled object: batch 1, any token count and width)."""
    return GraphSpec("packed", 1, None, "greedy", 0)


DYNAMIC_MIN_ROWS = 4  # a bucket whose round feeds fewer GEMM rows (batch x fed tokens) keeps a static graph


def with_dynamic_batch(plan: list[GraphSpec], max_batch: int) -> list[GraphSpec]:
    """``plan`` with the rounds (chain and tree) of the larger batch buckets merged into one graph
    per (kind, mode, depth or tree, processors) whose batch is a dynamic dimension.

    Why: a frozen graph carries its own copy of the weights and takes minutes to build, so per
    (mode, depth) six static buckets (max_batch_size 32) cost six builds and six weight copies.
    The dynamic graph's GEMM kernels are autotuned at the batch it is traced at (the largest
    bucket below the top of its range), and below about 4 GEMM rows they cost a floor that a
    static graph does not (a plain step at batch 2 ran ~1.5x slower, at batch 8 and up as fast:
    docs/architecture.md, "Batch buckets"). So batch 1, and every bucket whose round feeds fewer
    than DYNAMIC_MIN_ROWS rows in all (batch x tokens per row), keep a static graph each; the
    buckets above share one. Groups with fewer than two buckets to share stay as they are."""
    buckets = batch_buckets(max_batch)
    out, merged = [], set()
    for g in plan:
        if g.kind not in ("round", "tree") or g.batches is not None:
            out.append(g)
            continue
        fed = g.tree[0] if g.kind == "tree" else g.depth + 1
        share = [b for b in buckets if b >= 2 and b * fed >= DYNAMIC_MIN_ROWS]
        if g.batch not in share or len(share) < 2:
            out.append(g)
            continue
        dyn = dataclasses.replace(g, batch=share[-2], batches=(share[0], share[-1]))
        if dyn.key() not in merged:
            merged.add(dyn.key())
            out.append(dyn)
    return out


def with_merged_modes(plan: list[GraphSpec]) -> list[GraphSpec]:
    """``plan`` with each pair of chain rounds that differ only in mode (greedy and sample, no
    logits processors) as one graph of mode "any": the sampling round in which rows at
    temperature 0 are verified greedily (:func:`specgraph.verify.verify_chain_rows`).

    Why: a graph takes minutes to build and holds a weight copy, and the two rounds share
    everything up to the verification. The greedy rows of the merged graph also compute the
    sampling race they then discard (a softmax over [B, K+1, V]); on SmolLM2 at batch 8 a round
    cost the same with greedy rows, sampled rows, or a sampling-only graph. Only
    for deterministic drafts (prompt lookup, suffix, plain decoding): model drafts read their
    draft probabilities in sampled rounds."""
    modes: dict = {}
    for g in plan:
        if g.kind == "round" and g.logits is None:
            modes.setdefault(dataclasses.replace(g, mode="any").key(), set()).add(g.mode)
    out, seen = [], set()
    for g in plan:
        merged = dataclasses.replace(g, mode="any")
        if g.kind != "round" or g.logits is not None or modes[merged.key()] != {"greedy", "sample"}:
            out.append(g)
        elif merged.key() not in seen:
            seen.add(merged.key())
            out.append(merged)
    return out


def with_logits(plan: list[GraphSpec], logits) -> list[GraphSpec]:
    """The rounds of ``plan`` (what logits processors change) with processors ``logits`` (a
    :class:`specgraph.processors.LogitsSpec`, or None: the plain rounds)."""
    return [dataclasses.replace(g, logits=logits) for g in plan if g.kind in ("round", "tree")]


def example_inputs(fast, g: GraphSpec, vocab: int) -> tuple[list, list[str]]:
    """The non-cache inputs of graph ``g``, with the shapes and dtypes the generation loop passes
    (any values: the loop prefills the cache again before every request)."""
    dev = next(fast.model.parameters()).device
    B = g.batch
    long = dict(dtype=torch.long, device=dev)
    sample = g.mode != "greedy"
    if g.kind == "packed":  # traced at sizes unlike any other dimension (they are dynamic)
        from specgraph.packing import packed_layout

        pos, slot, mask, _ = packed_layout(list(PACKED_EXAMPLE[0]), list(PACKED_EXAMPLE[1]), dev)
        dtype = next(fast.model.parameters()).dtype
        return [torch.zeros_like(pos), pos, mask.to(dtype), slot], ["ids", "pos", "mask", "slot"]
    if g.kind == "prefill":
        C = g.depth
        return ([torch.zeros(B, C, **long), torch.arange(C, **long).expand(B, C).contiguous(),
                 torch.ones(B, C, dtype=torch.bool, device=dev)], ["ids", "pos", "valid"])
    root, L, active = torch.zeros(B, **long), torch.ones(B, **long), torch.ones(B, dtype=torch.bool, device=dev)
    temperature = ([torch.ones(B, device=dev)], ["temperature"]) if sample else ([], [])
    if g.logits is not None:  # the processors' state (specgraph.processors): rows as generate sees them, lengths
        S = fast.slots
        temperature = ([*temperature[0], torch.zeros(B, 2 * S, **long), torch.tensor([[0, 1, S, 0]] * B, **long)],
                       [*temperature[1], "seq", "meta"])
    def grammar(Q):  # a grammar's token bitmask per position: every token allowed
        if g.logits is None or not g.logits.grammar:
            return [], []
        return [torch.full((B, Q, bitmask_words(vocab)), -1, dtype=torch.int32, device=dev)], ["allowed"]
    if g.kind == "round":
        k = g.depth
        accept_u = torch.zeros(B, k, device=dev)
        expo = torch.ones(B, k + 1, vocab if sample else 1, device=dev)
        drafts = torch.zeros(B, k, **long)
        draft_probs = torch.full((B, k, vocab), 1.0 / vocab, device=dev) if sample and fast.draft_q else accept_u
        mask, mask_name = grammar(k + 1)
        return ([root, L, active, accept_u, expo, drafts, draft_probs, *temperature[0], *mask],
                ["root", "L", "active", "accept_u", "expo", "drafts", "draft_probs", *temperature[1], *mask_name])
    if g.kind == "tree":
        N, C, _ = g.tree
        parents = torch.arange(-1, N - 1, **long).expand(B, N).contiguous()  # a chain: any valid tree traces the same graph
        mask, mask_name = grammar(N)
        return ([root, L, active, torch.zeros(B, N, C, device=dev),
                 torch.ones(B, N, vocab if sample else 1, device=dev), torch.zeros(B, N, **long), parents,
                 *temperature[0], *mask],
                ["root", "L", "active", "accept_u", "expo", "tree_tokens", "parents", *temperature[1], *mask_name])
    if g.kind == "draft":
        Q = g.depth
        return ([torch.zeros(B, Q, **long), L + Q, active, torch.ones(B, vocab if sample else 1, device=dev)],
                ["tokens", "last", "active", "expo"])
    if g.kind == "draft_tree":
        return ([torch.zeros(B, fast.tree.num_nodes, **long), root, L, active], ["tree_tokens", "prev", "L", "active"])
    if g.kind == "compact":
        D = fast.tree.max_depth
        return ([L, torch.zeros(B, D + 1, **long), torch.ones(B, **long), active], ["L", "path_nodes", "n", "active"])
    raise ValueError(f"graph kind {g.kind!r} has no example inputs")


class Progress:
    """A progress bar on stderr (graphs done / total, elapsed, ETA): rich when it is installed,
    else one line per graph. ``verb`` names the work ("compiling", "building")."""

    def __init__(self, total: int, enabled: bool, verb: str = "compiling"):
        self.enabled, self.total, self.done, self.verb = enabled, total, 0, verb
        self._bar = None
        if enabled:
            try:
                from rich.console import Console
                from rich.progress import BarColumn, Progress as RichProgress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

                self._bar = RichProgress(TextColumn("{task.description}"), BarColumn(),
                                         TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                                         TextColumn("eta"), TimeRemainingColumn(), console=Console(stderr=True),
                                         transient=False)
                self._task = self._bar.add_task(verb, total=total)
                self._bar.start()
            except ImportError:  # pragma: no cover - rich is a dependency
                self._bar = None

    def start(self, name: str) -> None:
        if self._bar is not None:
            self._bar.update(self._task, description=f"{self.verb} {name}")
        elif self.enabled:
            print(f"specgraph: {self.verb} [{self.done + 1}/{self.total}] {name} ...", file=sys.stderr, flush=True)

    def grow(self, n: int) -> None:
        """``n`` more graphs to do."""
        self.total += n
        if self._bar is not None:
            self._bar.update(self._task, total=self.total)

    def advance(self, name: str, seconds: float) -> None:
        self.done += 1
        if self._bar is not None:
            self._bar.update(self._task, advance=1)
        elif self.enabled:
            print(f"specgraph: {name} done ({seconds:.1f} s)", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
