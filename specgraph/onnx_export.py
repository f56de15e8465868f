"""Export a compiled speculative step to ONNX: one graph per round shape, KV cache explicit.

``export_onnx(fast, out_dir)`` writes, for a :class:`specgraph.SpecGraphModel` ``fast``:

* ``verify_k{k}.onnx`` (greedy) and ``verify_k{k}_sample.onnx`` (sampling) for each chain depth
  ``k``: the captured, pass-rewritten target step (:func:`specgraph.capture.capture_step` +
  :func:`specgraph.passes.run_step_pipeline`, the graph ``specgraph.compile`` runs) wrapped in the
  compiler's own chain round (:func:`specgraph.rounds.chain_round`, the one every compiled object
  runs): ids, positions, write slots and the additive mask are built in the graph from
  ``root``/``L``/``active``, then the chain is verified in the graph by
  :func:`specgraph.verify.verify_chain_with_noise`.
* trees (``draft="ngram", tree=[paths]`` or ``draft="suffix", tree="dynamic"``):
  ``tree_n{N}_c{C}_d{D}.onnx`` (+ ``_sample``) per compiled tree shape (N nodes, at most C children
  per node, depth at most D: the static tree's, or the suffix shapes 5 and 17 nodes), the round of
  :meth:`SpecGraphModel._tree_round_fn`: the topology is an input (``parents``), depth / ancestors /
  per-row children are built in the graph (:func:`specgraph.trees.tree_buffers`), then the tree
  mask (``rounds.tree_mask``), the step, :func:`specgraph.verify.verify_tree_with_noise` and the
  KV compaction of the accepted path (``rounds.compact_path``) on the output copies of the cache.
  Plus ``verify_k0``: the plain step taken when the drafter proposed nothing.
* a draft model (``specgraph.compile(target, draft=<smaller model>)``, chains): ``draft_q2`` /
  ``draft_q1`` (+ ``_sample``), the draft step of :meth:`SpecGraphModel.draft_graph` on the draft's
  own cache (the first step of a round feeds the previous token and the root, the K - 1 later ones
  the previous draft), ``verify_k{K}`` (+ ``_sample``, which takes the drafts' q rows) and
  ``draft_prefill_c{C}``.
* ``prefill_c{C}.onnx``: the target step at a fixed query length ``C`` (chunked prefill).
* ``manifest.json``: graphs, inputs/outputs, shapes, settings (tree shapes and static topology,
  suffix index settings, draft model layout), and the sha256 of every file.

Graph interfaces (B = ``batch_size``, S = ``fast.slots`` = max_seq_len + 1 with the last slot a
scratch slot, V = vocabulary, per layer i: ``past_key_i`` / ``past_value_i`` [B, H_kv, S, D] in,
``present_key_i`` / ``present_value_i`` out — ONNX has no in-place update, so the whole cache goes
in and the updated cache comes out; the runtime ping-pongs two buffers; the draft model's cache
is ``past_draft_*`` / ``present_draft_*`` with its own layout)::

    verify_k{k}:          root [B] int64, L [B] int64, active [B] bool, drafts [B, k] int64 (k > 0),
                          past...
        -> tokens [B, k+1] int64 (-1 after the emitted ones), num_emitted [B] int64, logits [B, k+1, V],
           present...
    verify_k{k}_sample:   the same, plus draft_probs [B, k, V] float32 (draft models only: the warped
                          draft distributions the drafts were drawn from), accept_u [B, k] float32
                          (k > 0), expo [B, k+1, V] float32 (Exp(1) draws, see
                          specgraph.verify.chain_noise), temperature [B] float32
    tree_n{N}_c{C}_d{D}:  root [B] int64, L [B] int64, active [B] bool, tree_tokens [B, N] int64 (column 0
                          ignored), parents [B, N] int64 (-1 at node 0, parent < index), past...
        -> tokens [B, D+1] int64 (-1 padded), num_emitted [B] int64, path_nodes [B, D+1] int64 (the root
           and the accepted nodes, -1 padded), logits [B, N, V], present... (accepted path compacted)
    tree_..._sample:      the same, plus accept_u [B, N, C] float32, expo [B, N, V] float32 (see
                          specgraph.verify.tree_noise), temperature [B] float32
    draft_q{Q}:           tokens [B, Q] int64, last [B] int64 (position of the last fed token), active [B]
                          bool, past_draft...
        -> token [B] int64, logits [B, V], present_draft...
    draft_q{Q}_sample:    the same, plus expo [B, V] float32, temperature [B] float32
        -> token [B] int64 (argmax of q / expo), q [B, V] float32, present_draft...
    prefill_c{C}:         input_ids [B, C] int64, start [B] int64, num_valid [B] int64, past...
        -> present...
    draft_prefill_c{C}:   the same on past_draft... -> present_draft...

``root`` is the last accepted token (position ``L``), ``L`` the number of committed tokens in the
cache (slots ``0 .. L-1``); the root and drafts are written at slots ``L .. L+k`` (tree node i at
slot ``L + i``, position ``L + depth(i)``; after verification the accepted nodes' K/V sit at
``L .. L + num_emitted - 1``, so the runtime advances ``L`` by ``num_emitted`` as for a chain). Rows
with ``active == False`` (batch padding, finished rows) write only to the scratch slot. A prefill
chunk writes ``input_ids[b, :num_valid[b]]`` at positions ``start[b] ..`` (the rest goes to the
scratch slot); the chunk attends to the committed slots ``< start`` and causally within itself.

Sampling: the temperature is a graph input (dividing by it is exact: ``warp_logits`` divides the
same way), while ``top_k`` / ``top_p`` / ``min_p`` change the graph's structure and are baked in
at export (default: none); the manifest records them and the runtime refuses other settings.
The random numbers are inputs, so a graph's outputs are reproducible given the same noise.
Draft-model trees are not exported (``NotImplementedError``).

Opset: 18 by default (``opset=``), exporter ``torch.onnx.export(..., dynamo=True)``. Two ops get
custom translations because onnxruntime's CPU provider or the exporter lack them: ``cumprod`` (no
ONNX op; unrolled over the static axis) and ``where`` on bool operands (no bool ``Where`` kernel
in onnxruntime; written as And/Or/Not).

Weights: embedded in each graph for models up to ``EXTERNAL_DATA_BYTES`` (100 MB, target and draft
together); above that (or with ``external_data=True``) every graph refers to one shared
``weights.bin`` (initializers stored once by content, so the graphs do not multiply the weights on
disk; tensors >= 1 MiB are 64 KiB-aligned so runtimes can map them).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
import warnings
from pathlib import Path

import torch

from specgraph.capture import capture_step, kv_layout, layer_windows, new_kv_cache
from specgraph.rounds import chain_round, compact_path, draft_logits, prefill_logits, scaled_logits, tree_logits
from specgraph.proposers.ngram import NGRAM_MAX, NGRAM_MIN
from specgraph.proposers.suffix import SUFFIX_CHILDREN, SUFFIX_MIN_SCORE, SUFFIX_TREE_SIZES
from specgraph.passes import run_step_pipeline
from specgraph.verify import verify_tree_with_noise
from specgraph.artifacts import sha256_file
from specgraph.warping import SamplingParams, normalize_filters, warped_probs

FORMAT = "specgraph-onnx"
FORMAT_VERSION = 2
DEFAULT_OPSET = 18
EXTERNAL_DATA_BYTES = 100 * 2**20
WEIGHTS_FILE = "weights.bin"
MANIFEST = "manifest.json"
DEFAULT_PREFILL_CHUNK = 32
_ALIGN_BYTES, _ALIGN_TO = 2**20, 2**16  # tensors >= 1 MiB start at 64 KiB multiples in weights.bin

__all__ = ["export_onnx", "VerifyRound", "TreeRound", "DraftStep", "PrefillChunk", "kv_names", "DEFAULT_OPSET"]


def kv_names(num_layers: int, prefix: str) -> list[str]:
    """``{prefix}_key_0, {prefix}_value_0, ...`` in the order of the step's ``kv`` arguments."""
    return [f"{prefix}_{kind}_{i}" for i in range(num_layers) for kind in ("key", "value")]


# ----------------------------------------------------------------------------------------------
# graph wrappers (what gets exported)


class VerifyRound(torch.nn.Module):
    """One verification round: the compiler's chain round (:func:`specgraph.rounds.chain_round`)
    over the whole cache, as a module with flat inputs.

    Inputs (flat): root, L, active, [drafts if k > 0], [draft_probs if use_q], [accept_u if k > 0
    and sampling], [expo, temperature if sampling], *kv.  Outputs: tokens, num_emitted, logits, *new kv.
    ``use_q`` (sampled draft-model drafts): verification uses the draft's q rows, as
    ``SpecGraphModel._round_fn`` does when the drafts were sampled from a draft model.
    """

    def __init__(self, step, k: int, slots: int, window, sample: bool, top_k=None, top_p=None, min_p=None,
                 use_q: bool = False):
        super().__init__()
        self.step = step  # a submodule: the round below calls it
        self.k, self.slots, self.sample = k, slots, sample
        self.use_q = bool(use_q and sample and k > 0)
        params = SamplingParams(1.0, top_k, top_p, min_p) if sample else SamplingParams(0.0)
        self.round = chain_round(step, k, slots, window, params, use_q=self.use_q, want_scores=True)

    def forward(self, *args):
        k = self.k
        root, L, active = args[:3]
        i = 3
        draft_probs = None
        if k > 0:
            drafts = args[i]
            i += 1
        else:
            drafts = root.unsqueeze(1)[:, :0]  # [B, 0]: static zero-size, only its shape is used
        if self.use_q:
            draft_probs = args[i]  # [B, k, V] the warped draft distributions the drafts were drawn from
            i += 1
        if self.sample:
            if k > 0:
                accept_u = args[i]
                i += 1
            else:
                accept_u = args[i].new_zeros(args[i].shape[0], 0)  # expo's batch; [B, 0]
            expo, temperature = args[i], args[i + 1]
            i += 2
        # ONNX has no in-place update of a graph input: the round writes into copies, returned.
        kv = [t.clone() for t in args[i:]]
        if self.sample:
            tokens, n, _, logits = self.round(self.slots, root, L, active, accept_u, expo, drafts, draft_probs,
                                              temperature, *kv)
        else:
            tokens, n, _, logits = self.round(self.slots, root, L, active, None, None, drafts, None, *kv)
        return (tokens, n, logits, *kv)  # logits [B, k+1, V]


class TreeRound(torch.nn.Module):
    """One tree verification round (``SpecGraphModel._tree_round_fn``) as a module with flat inputs.

    The tree's topology is an input (``parents``), so one graph serves every tree of its shape
    (N nodes, at most C children per node, depth at most D): depth, ancestors and per-row children
    come from :func:`specgraph.trees.tree_buffers`, the mask from ``rounds.tree_mask``, then
    :func:`specgraph.verify.verify_tree_with_noise` and the KV compaction of the accepted path
    (``rounds.compact_path``), applied to the output copies of the cache.

    Inputs (flat): root, L, active, tree_tokens, parents, [accept_u, expo, temperature if
    sampling], *kv.  Outputs: tokens, num_emitted, path_nodes, logits, *new kv.
    """

    def __init__(self, step, shape: tuple[int, int, int], slots: int, window, sample: bool,
                 top_k=None, top_p=None, min_p=None):
        super().__init__()
        self.step = step
        self.shape, self.slots, self.window, self.sample = tuple(shape), slots, window, sample
        self.top_k, self.top_p, self.min_p = top_k, top_p, min_p

    def forward(self, *args):
        N, C, D = self.shape
        # root [B], L [B], active [B] bool, tree_tokens [B, N] (root entry ignored), parents [B, N] (-1 root)
        root, L, active, tree_tokens, parents = args[:5]
        i = 5
        if self.sample:
            # accept_u [B, N, C], expo [B, N, V], temperature [B]
            accept_u, expo, temperature = args[i: i + 3]
            i += 3
        kv = [t.clone() for t in args[i:]]  # no in-place update of graph inputs: the copies are the outputs
        S = self.slots
        # logits [B, N, V], ids [B, N] (root in column 0), children [B, N, C] per row
        logits, ids, children = tree_logits(self.step, root, L, active, tree_tokens, parents, C, kv, S, S, self.window)
        if self.sample:  # temperature as in VerifyRound: the same division warp_logits does
            tokens, n, path_nodes = verify_tree_with_noise(scaled_logits(logits, temperature), None, ids, children, D,
                                                           (accept_u, expo), 1.0, self.top_k, self.top_p, self.min_p)
        else:
            tokens, n, path_nodes = verify_tree_with_noise(logits, None, ids, children, D, None, 0.0)
        compact_path(kv, L, path_nodes, n, active, S - 1)
        return (tokens, n, path_nodes, logits, *kv)


class DraftStep(torch.nn.Module):
    """One draft-model step (``SpecGraphModel.draft_graph``): feed Q tokens ending at position
    ``last``, propose the next token.

    Inputs (flat): tokens [B, Q], last [B], active [B], [expo [B, V], temperature [B] if sampling],
    *draft kv.  Outputs: token [B], then ``logits`` [B, V] (greedy: the argmax is the draft) or
    ``q`` [B, V] (sampling: the warped distribution the token was drawn from, by the exponential
    race ``argmax(q / expo)``; verification needs these exact rows), then the new draft kv.
    """

    def __init__(self, step, Q: int, slots: int, window, sample: bool, top_k=None, top_p=None, min_p=None):
        super().__init__()
        self.step = step
        self.Q, self.slots, self.window, self.sample = Q, slots, window, sample
        self.top_k, self.top_p, self.min_p = top_k, top_p, min_p

    def forward(self, *args):
        S = self.slots
        tokens, last, active = args[:3]
        i = 3
        if self.sample:
            expo, temperature = args[3], args[4]
            i = 5
        kv = [t.clone() for t in args[i:]]
        logits = draft_logits(self.step, tokens, last, active, kv, S, S, self.window)
        if not self.sample:
            return (logits.argmax(dim=-1), logits, *kv)
        # warped_probs(logits, T) = softmax(filters(logits.float() / T)): the division done here
        scaled = logits.float() / temperature.view(-1, 1)
        q = warped_probs(scaled, 1.0, self.top_k, self.top_p, self.min_p)
        return ((q / expo).argmax(dim=-1), q, *kv)


class PrefillChunk(torch.nn.Module):
    """Write up to C prompt tokens per row at positions start .. start+num_valid-1."""

    def __init__(self, step, chunk: int, slots: int, window):
        super().__init__()
        self.step, self.chunk, self.slots, self.window = step, chunk, slots, window

    def forward(self, input_ids, start, num_valid, *kv):
        # input_ids [B, C], start [B], num_valid [B]
        kv = [t.clone() for t in kv]
        offs = torch.arange(self.chunk, device=start.device)
        pos = start.unsqueeze(1) + offs
        valid = offs.unsqueeze(0) < num_valid.unsqueeze(1)
        prefill_logits(self.step, input_ids, pos, valid, kv, self.slots, self.window, start=start)
        return tuple(kv)


# ----------------------------------------------------------------------------------------------
# custom translations (onnxscript, traced at export time)


def _translations():
    import onnx_ir as ir
    from onnxscript import opset18 as op

    def cumprod(self, dim: int, dtype=None):
        # ONNX has CumSum but no CumProd; the axis is static here, so unroll the running product.
        rank = len(self.shape)
        dim = dim % rank
        n = self.shape[dim]
        if not isinstance(n, int):
            raise NotImplementedError("cumprod over a dynamic axis")
        axes = op.Constant(value_ints=[dim])
        acc, parts = None, []
        for j in range(n):
            s = op.Slice(self, op.Constant(value_ints=[j]), op.Constant(value_ints=[j + 1]), axes)
            acc = s if acc is None else op.Mul(acc, s)
            parts.append(acc)
        if not parts:
            return op.Identity(self)
        out = parts[0] if len(parts) == 1 else op.Concat(*parts, axis=dim)
        return out if dtype is None else op.Cast(out, to=ir.DataType(_onnx_dtype(dtype)))

    def where(cond, a, b):
        # onnxruntime has no Where kernel for bool operands.
        if a.dtype == ir.DataType.BOOL and b.dtype == ir.DataType.BOOL:
            return op.Or(op.And(cond, a), op.And(op.Not(cond), b))
        return op.Where(cond, a, b)

    return {torch.ops.aten.cumprod.default: cumprod, torch.ops.aten.where.self: where}


def _onnx_dtype(dtype) -> int:
    import onnx

    return {
        torch.float32: onnx.TensorProto.FLOAT, torch.float16: onnx.TensorProto.FLOAT16,
        torch.bfloat16: onnx.TensorProto.BFLOAT16, torch.float64: onnx.TensorProto.DOUBLE,
        torch.int64: onnx.TensorProto.INT64, torch.int32: onnx.TensorProto.INT32, torch.bool: onnx.TensorProto.BOOL,
    }[dtype]


# ----------------------------------------------------------------------------------------------
# weights


class _WeightStore:
    """Initializers stored once by content in one external file shared by every graph."""

    def __init__(self, path: Path):
        self.path = path
        self.f = open(path, "wb")
        self.offsets: dict[str, tuple[int, int]] = {}
        self.size = 0

    def externalize(self, model_proto, min_bytes: int = 1024) -> None:
        import onnx
        from onnx import numpy_helper

        for t in model_proto.graph.initializer:
            if t.data_location == onnx.TensorProto.EXTERNAL:
                continue
            data = numpy_helper.to_array(t).tobytes() if not t.HasField("raw_data") else t.raw_data
            if len(data) < min_bytes:
                continue
            key = hashlib.sha256(f"{t.data_type}:{list(t.dims)}:".encode() + data).hexdigest()
            if key not in self.offsets:
                if len(data) >= _ALIGN_BYTES and self.size % _ALIGN_TO:
                    pad = _ALIGN_TO - self.size % _ALIGN_TO
                    self.f.write(b"\0" * pad)
                    self.size += pad
                self.f.write(data)
                self.offsets[key] = (self.size, len(data))
                self.size += len(data)
            offset, length = self.offsets[key]
            for field in ("raw_data", "float_data", "int32_data", "int64_data", "double_data", "uint64_data", "string_data"):
                t.ClearField(field)
            del t.external_data[:]
            for key, value in (("location", self.path.name), ("offset", str(offset)), ("length", str(length))):
                entry = t.external_data.add()
                entry.key, entry.value = key, value
            t.data_location = onnx.TensorProto.EXTERNAL

    def close(self):
        self.f.close()


# ----------------------------------------------------------------------------------------------
# export


@contextlib.contextmanager
def _export_env():
    # Trace the plain-torch verification kernels (not Triton) whatever device the model is on, and
    # keep the exporter's chatter out of the caller's output.
    old = os.environ.get("SPECGRAPH_DISABLE_TRITON")
    os.environ["SPECGRAPH_DISABLE_TRITON"] = "1"
    log = logging.getLogger("torch.onnx")
    level = log.level
    log.setLevel(logging.ERROR)  # e.g. "torchvision is not installed. Skipping torchvision::nms"
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            yield
    finally:
        log.setLevel(level)
        if old is None:
            os.environ.pop("SPECGRAPH_DISABLE_TRITON", None)
        else:
            os.environ["SPECGRAPH_DISABLE_TRITON"] = old


def _value_info(names, tensors) -> list[dict]:
    return [{"name": n, "shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")} for n, t in zip(names, tensors)]


def tree_graph_name(shape, sample: bool) -> str:
    N, C, D = shape
    return f"tree_n{N}_c{C}_d{D}" + ("_sample" if sample else "")


def export_onnx(
    fast,
    out_dir,
    depths=None,
    batch_size: int = 1,
    opset: int = DEFAULT_OPSET,
    progress: bool = True,
    *,
    modes=("greedy", "sample"),
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
    external_data: bool | None = None,
) -> dict:
    """Export ``fast`` (from :func:`specgraph.compile`) to ONNX graphs in ``out_dir``; returns the manifest.

    Args:
        depths: chain depths to export (default: 0 and the compiler's prompt-lookup / suffix depth
            ladder, e.g. ``[0, 4]`` for K = 4 and ``[0, 4, 8]`` for K = 8; 0 = a plain decoding step,
            used when no n-gram matched; ``[K]`` for a draft model; ``[0]`` with a tree, where the
            plain step is the round taken when the drafter found nothing). The runtime moves between
            the exported depths of the ladder the way the compiler does.
        batch_size: the static batch of every graph (the runtime pads smaller batches).
        modes: ``"greedy"`` and/or ``"sample"`` graphs.
        top_k, top_p, min_p: warping baked into the sampling graphs (temperature stays an input).
        prefill_chunk: query length C of the prefill graph (prompts are written C tokens per call).
        external_data: store weights in a shared ``weights.bin``; default: when the parameters
            (target and draft) exceed 100 MB.
    """
    import onnx

    draft = getattr(fast, "draft", None)
    if getattr(fast, "learned", None) is not None or draft not in (None, "ngram", "suffix", "model"):
        raise NotImplementedError(f"ONNX export of draft={draft!r} (a learned head drafter) is not supported yet: "
                                  "use None, 'ngram', 'suffix' or a draft model")
    if draft == "model" and fast.tree is not None:
        raise NotImplementedError("ONNX export of draft-model trees is not supported yet: compile the draft model "
                                  "with tree=None (chains), or use draft='ngram' / 'suffix' for trees")
    if getattr(fast, "weights", "float32") != "float32":
        raise NotImplementedError(f"ONNX export of weights={fast.weights!r} is not supported: its linear layers are "
                                  "specgraph ops ONNX has no kernel for; compile with weights='float32' to export")
    model, S, window = fast.model, fast.slots, fast.window
    draft_model = fast.draft_model if draft == "model" else None
    shapes = fast.tree_shapes()
    # prompt lookup / suffix chains move between the depths of the compiler's ladder (next_k)
    ladder = sorted(getattr(fast, "k_ladder", None) or [fast.k])
    modes = tuple(modes)
    if not modes or any(m not in ("greedy", "sample") for m in modes):
        raise ValueError(f"modes must be a non-empty subset of ('greedy', 'sample'), got {modes!r}")
    if depths is None:
        depths = [0] if shapes else ([fast.k] if draft == "model" else sorted({0, *ladder}))
    depths = sorted({int(d) for d in depths})
    if any(d < 0 for d in depths):
        raise ValueError(f"depths must be >= 0, got {depths}")
    if draft == "model" and fast.k not in depths:
        raise ValueError(f"a draft model drafts K={fast.k} tokens every round: depths must include {fast.k}, got {depths}")
    if batch_size < 1 or prefill_chunk < 1:
        raise ValueError("batch_size and prefill_chunk must be >= 1")
    if prefill_chunk > S - 1:
        prefill_chunk = S - 1
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    p = next(model.parameters())
    vocab = model.get_output_embeddings().out_features
    top_k, top_p, min_p = normalize_filters(vocab, top_k, top_p, min_p)
    if "sample" in modes:  # validate through the library's own checks
        from specgraph.warping import check_sampling_params
        check_sampling_params(1.0, top_k, top_p, min_p)
    layers, kv_heads, head_dim = kv_layout(model)
    models = [model] + ([draft_model] if draft_model is not None else [])
    param_bytes = sum(t.numel() * t.element_size() for m in models for t in m.parameters())
    if external_data is None:
        external_data = param_bytes > EXTERNAL_DATA_BYTES
    B = batch_size
    past, present = kv_names(layers, "past"), kv_names(layers, "present")
    if draft_model is not None:
        d_layers, d_kv_heads, d_head_dim = kv_layout(draft_model)
        d_past, d_present = kv_names(d_layers, "past_draft"), kv_names(d_layers, "present_draft")
        d_dtype = next(draft_model.parameters()).dtype
    dev = p.device
    translations = _translations()

    def ints(*shape, fill=0):
        return torch.full(shape, fill, dtype=torch.long, device=dev)

    def floats(*shape, fill=1.0):
        return torch.full(shape, fill, dtype=torch.float32, device=dev)

    jobs = [("verify", k, m) for k in depths for m in ("greedy", "sample") if m in modes]
    jobs += [("tree", s, m) for s in shapes for m in ("greedy", "sample") if m in modes]
    if draft_model is not None:  # first step of a round feeds (previous token, root), later ones one token
        jobs += [("draft", q, m) for q in (2, 1) for m in ("greedy", "sample") if m in modes]
    jobs.append(("prefill", prefill_chunk, None))
    if draft_model is not None:
        jobs.append(("draft_prefill", prefill_chunk, None))
    it, bar = _progress(jobs, progress)
    store = _WeightStore(out / WEIGHTS_FILE) if external_data else None
    graphs, files, steps = [], {}, {}
    try:
        for kind, q, mode in it:
            t0 = time.perf_counter()
            sample = mode == "sample"
            which = "draft" if kind in ("draft", "draft_prefill") else "target"
            src_model = draft_model if which == "draft" else model
            Q = {"verify": lambda: q + 1, "tree": lambda: q[0]}.get(kind, lambda: q)()
            if (which, Q) not in steps:  # greedy and sampling graphs of one query length share the captured step
                with _export_env():
                    gm, counts = run_step_pipeline(capture_step(src_model, B, Q, S), layer_windows(src_model))
                steps[which, Q] = gm
            step = steps[which, Q]
            kv = new_kv_cache(src_model, B, S)
            kv_in, kv_out = (d_past, d_present) if which == "draft" else (past, present)
            entry = {"kind": kind, "mode": mode, "query_len": Q, "model": which}
            if kind == "verify":
                name = f"verify_k{q}" + ("_sample" if sample else "")
                use_q = draft == "model" and sample and q > 0
                module = VerifyRound(step, q, S, window, sample, top_k, top_p, min_p, use_q=use_q)
                names, ex = ["root", "L", "active"], [ints(B), ints(B), torch.ones(B, dtype=torch.bool, device=dev)]
                if q > 0:
                    names.append("drafts")
                    ex.append(ints(B, q))
                if use_q:
                    names.append("draft_probs")
                    ex.append(floats(B, q, vocab, fill=1.0 / vocab))
                if sample:
                    if q > 0:
                        names.append("accept_u")
                        ex.append(floats(B, q, fill=0.5))
                    names += ["expo", "temperature"]
                    ex += [floats(B, q + 1, vocab), floats(B)]
                out_names = ["tokens", "num_emitted", "logits", *present]
                out_ex = [ints(B, q + 1), ints(B), torch.zeros(B, q + 1, vocab, dtype=p.dtype), *kv]
                entry.update(depth=q, chunk=None)
            elif kind == "tree":
                N, C, D = q
                name = tree_graph_name(q, sample)
                module = TreeRound(step, q, S, window, sample, top_k, top_p, min_p)
                chain = torch.arange(-1, N - 1, device=dev).expand(B, N).contiguous()  # a valid example topology
                names = ["root", "L", "active", "tree_tokens", "parents"]
                ex = [ints(B), ints(B), torch.ones(B, dtype=torch.bool, device=dev), ints(B, N), chain]
                if sample:
                    names += ["accept_u", "expo", "temperature"]
                    ex += [floats(B, N, C, fill=0.5), floats(B, N, vocab), floats(B)]
                out_names = ["tokens", "num_emitted", "path_nodes", "logits", *present]
                out_ex = [ints(B, D + 1), ints(B), ints(B, D + 1), torch.zeros(B, N, vocab, dtype=p.dtype), *kv]
                entry.update(depth=D, shape=[N, C, D], chunk=None)
            elif kind == "draft":
                name = f"draft_q{q}" + ("_sample" if sample else "")
                module = DraftStep(step, q, S, fast.draft_window, sample, top_k, top_p, min_p)
                names = ["tokens", "last", "active"]
                ex = [ints(B, q), ints(B, fill=q), torch.ones(B, dtype=torch.bool, device=dev)]
                if sample:
                    names += ["expo", "temperature"]
                    ex += [floats(B, vocab), floats(B)]
                out_names = ["token", "q" if sample else "logits", *d_present]
                out_ex = [ints(B), torch.zeros(B, vocab, dtype=torch.float32 if sample else d_dtype), *kv]
                entry.update(depth=None, chunk=None)
            else:
                name = f"prefill_c{q}" if kind == "prefill" else f"draft_prefill_c{q}"
                module = PrefillChunk(step, q, S, fast.draft_window if which == "draft" else window)
                names = ["input_ids", "start", "num_valid"]
                ex = [ints(B, q), ints(B), ints(B, fill=q)]
                out_names, out_ex = list(kv_out), list(kv)
                entry.update(depth=None, chunk=q)
            if bar is not None:
                bar.set_description(f"exporting {name}")
            elif progress:
                print(f"specgraph.export_onnx: exporting {name} ...", flush=True)
            args = (*ex, *kv)
            with _export_env():
                prog = torch.onnx.export(
                    module, args, dynamo=True, opset_version=opset, input_names=names + kv_in,
                    output_names=out_names, custom_translation_table=translations, verbose=False,
                    optimize=True, report=False,
                )
            proto = prog.model_proto
            got_in = [i.name for i in proto.graph.input]
            got_out = [o.name for o in proto.graph.output]
            if got_in != names + kv_in or got_out != out_names:
                raise RuntimeError(f"{name}: exported graph has inputs {got_in} / outputs {got_out}, "
                                   f"expected {names + kv_in} / {out_names}")
            if store is not None:
                store.externalize(proto)
            path = out / f"{name}.onnx"
            onnx.save_model(proto, str(path))
            del proto, prog
            graphs.append({
                "name": name, "file": path.name, **entry,
                "inputs": _value_info(names + kv_in, args), "outputs": _value_info(out_names, out_ex),
                "seconds": round(time.perf_counter() - t0, 2),
            })
            if progress and bar is None:
                print(f"specgraph.export_onnx: {name} done ({graphs[-1]['seconds']} s)", flush=True)
    finally:
        if bar is not None:
            bar.close()
        if store is not None:
            store.close()
    for g in graphs:  # after the weights file is complete: the checker reads external data
        onnx.checker.check_model(str(out / g["file"]))
    for f in [g["file"] for g in graphs] + ([WEIGHTS_FILE] if store is not None else []):
        files[f] = {"sha256": sha256_file(out / f), "bytes": (out / f).stat().st_size}

    gc = model.generation_config
    import specgraph

    def dtype_name(t):
        return str(t).replace("torch.", "")

    chain_ladder = [k for k in ladder if k in depths and k > 0] or ([max(depths)] if max(depths) > 0 else [])
    tree_info = None
    if shapes:
        tree_info = {"kind": "dynamic" if fast.dynamic_tree else "static", "shapes": [list(s) for s in shapes]}
        if fast.dynamic_tree:  # suffix trees are packed into the smallest shape that holds them
            tree_info.update(sizes=list(SUFFIX_TREE_SIZES), children=SUFFIX_CHILDREN, depth_limit=fast.k)
        else:  # the static tree: its topology and each node's rank (what prompt lookup fills in)
            tree_info.update(parents=fast.tree.parents.tolist(), rank=list(fast.tree_rank))
    suffix_info = None
    if draft == "suffix":  # the runtime builds its own index with the same settings
        idx = fast.suffix_index
        suffix_info = {"max_depth": idx.max_depth, "max_match": idx.max_match, "global_budget": idx.global_budget,
                       "min_score": getattr(fast, "suffix_min_score", SUFFIX_MIN_SCORE)}
    draft_info = None
    if draft_model is not None:
        draft_info = {
            "class": type(draft_model).__name__,
            "model_type": getattr(draft_model.config, "model_type", None),
            "num_layers": d_layers, "num_kv_heads": d_kv_heads, "head_dim": d_head_dim,
            "dtype": dtype_name(d_dtype), "sliding_window": fast.draft_window,
            "parameter_bytes": sum(t.numel() * t.element_size() for t in draft_model.parameters()),
            "kv": {"past": d_past, "present": d_present, "shape": [B, d_kv_heads, S, d_head_dim], "dtype": dtype_name(d_dtype)},
        }
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "specgraph_version": specgraph.__version__,
        "torch_version": torch.__version__,
        "onnx_version": onnx.__version__,
        "opset": opset,
        "exporter": "torch.onnx.export(dynamo=True)",
        "model": {
            "class": type(model).__name__,
            "model_type": getattr(model.config, "model_type", None),
            "vocab_size": vocab,
            "num_layers": layers, "num_kv_heads": kv_heads, "head_dim": head_dim,
            "dtype": dtype_name(p.dtype),
            "parameter_bytes": param_bytes,
        },
        "batch_size": B,
        "slots": S,
        "scratch_slot": S - 1,
        "max_seq_len": fast.max_seq_len,
        "span": fast.span,
        "sliding_window": window,
        "draft": draft,
        "num_speculative_tokens": fast.k,
        "k_ladder": chain_ladder if draft in ("ngram", "suffix") and not shapes else [],
        "ngram": {"max": NGRAM_MAX, "min": NGRAM_MIN},
        "depths": depths,
        "tree": tree_info,
        "suffix": suffix_info,
        "draft_model": draft_info,
        "modes": list(modes),
        "prefill_chunk": prefill_chunk,
        "sampling": {"temperature": "input", "top_k": top_k, "top_p": top_p, "min_p": min_p},
        "generation": {
            "eos_token_id": gc.eos_token_id, "pad_token_id": gc.pad_token_id, "bos_token_id": gc.bos_token_id,
        },
        "kv": {"past": past, "present": present, "shape": [B, kv_heads, S, head_dim], "dtype": dtype_name(p.dtype)},
        "external_data": WEIGHTS_FILE if store is not None else None,
        "graphs": graphs,
        "files": files,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _progress(jobs, enabled):
    """(iterable, tqdm bar or None): a tqdm bar when enabled and tqdm is installed."""
    if not enabled:
        return jobs, None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm comes with transformers
        return jobs, None
    bar = tqdm(jobs, unit="graph", desc="export_onnx")
    return bar, bar
