"""Export a compiled speculative step to ONNX: one graph per speculation depth, KV cache explicit.

``export_onnx(fast, out_dir)`` writes, for a :class:`specgraph.SpecGraphModel` ``fast``:

* ``verify_k{k}.onnx`` (greedy) and ``verify_k{k}_sample.onnx`` (sampling) for each depth ``k``:
  the captured, pass-rewritten target step (:func:`specgraph.capture.capture_step` +
  :func:`specgraph.passes.run_step_pipeline`, the graph ``specgraph.compile`` runs) wrapped in the
  round of :meth:`SpecGraphModel._round_fn`: ids, positions, write slots and the additive mask are
  built in the graph from ``root``/``L``/``active`` exactly as the compiler builds them
  (:func:`specgraph.compiler._step_mask`), then the chain is verified in the graph by
  :func:`specgraph.verify.verify_chain_with_noise`.
* ``prefill_c{C}.onnx``: the same step at a fixed query length ``C`` (chunked prefill).
* ``manifest.json``: graphs, inputs/outputs, shapes, settings, and the sha256 of every file.

Graph interfaces (B = ``batch_size``, S = ``fast.slots`` = max_seq_len + 1 with the last slot a
scratch slot, V = vocabulary, per layer i: ``past_key_i`` / ``past_value_i`` [B, H_kv, S, D] in,
``present_key_i`` / ``present_value_i`` out — ONNX has no in-place update, so the whole cache goes
in and the updated cache comes out; the runtime ping-pongs two buffers)::

    verify_k{k}:          root [B] int64, L [B] int64, active [B] bool, drafts [B, k] int64 (k > 0),
                          past...
        -> tokens [B, k+1] int64 (-1 after the emitted ones), num_emitted [B] int64, logits [B, k+1, V],
           present...
    verify_k{k}_sample:   the same, plus accept_u [B, k] float32 (k > 0), expo [B, k+1, V] float32
                          (Exp(1) draws, see specgraph.verify.chain_noise), temperature [B] float32
    prefill_c{C}:         input_ids [B, C] int64, start [B] int64, num_valid [B] int64, past...
        -> present...

``root`` is the last accepted token (position ``L``), ``L`` the number of committed tokens in the
cache (slots ``0 .. L-1``); the root and drafts are written at slots ``L .. L+k``. Rows with
``active == False`` (batch padding, finished rows) write only to the scratch slot. A prefill chunk
writes ``input_ids[b, :num_valid[b]]`` at positions ``start[b] ..`` (the rest goes to the scratch
slot); the chunk attends to the committed slots ``< start`` and causally within itself.

Sampling: the temperature is a graph input (dividing by it is exact: ``warp_logits`` divides the
same way), while ``top_k`` / ``top_p`` / ``min_p`` change the graph's structure and are baked in
at export (default: none); the manifest records them and the runtime refuses other settings.
The random numbers are inputs, so a graph's outputs are reproducible given the same noise.

Opset: 18 by default (``opset=``), exporter ``torch.onnx.export(..., dynamo=True)``. Two ops get
custom translations because onnxruntime's CPU provider or the exporter lack them: ``cumprod`` (no
ONNX op; unrolled over the static axis) and ``where`` on bool operands (no bool ``Where`` kernel
in onnxruntime; written as And/Or/Not).

Weights: embedded in each graph for models up to ``EXTERNAL_DATA_BYTES`` (100 MB); above that
(or with ``external_data=True``) every graph refers to one shared ``weights.bin`` (initializers
stored once by content, so the graphs do not multiply the weights on disk; tensors >= 1 MiB are
64 KiB-aligned so runtimes can map them).
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

from specgraph.capture import capture_step, kv_layout, new_kv_cache
from specgraph.compiler import NGRAM_MAX, NGRAM_MIN, _step_mask
from specgraph.passes import run_step_pipeline
from specgraph.verify import verify_chain_with_noise

FORMAT = "specgraph-onnx"
FORMAT_VERSION = 1
DEFAULT_OPSET = 18
EXTERNAL_DATA_BYTES = 100 * 2**20
WEIGHTS_FILE = "weights.bin"
MANIFEST = "manifest.json"
DEFAULT_PREFILL_CHUNK = 32
_ALIGN_BYTES, _ALIGN_TO = 2**20, 2**16  # tensors >= 1 MiB start at 64 KiB multiples in weights.bin

__all__ = ["export_onnx", "VerifyRound", "PrefillChunk", "kv_names", "DEFAULT_OPSET"]


def kv_names(num_layers: int, prefix: str) -> list[str]:
    """``{prefix}_key_0, {prefix}_value_0, ...`` in the order of the step's ``kv`` arguments."""
    return [f"{prefix}_{kind}_{i}" for i in range(num_layers) for kind in ("key", "value")]


# ----------------------------------------------------------------------------------------------
# graph wrappers (what gets exported)


class VerifyRound(torch.nn.Module):
    """One verification round: the compiler's round function as a module with flat inputs.

    Inputs (flat): root, L, active, [drafts if k > 0], [accept_u if k > 0 and sampling],
    [expo, temperature if sampling], *kv.  Outputs: tokens, num_emitted, logits, *new kv.
    """

    def __init__(self, step, k: int, slots: int, window, sample: bool, top_k=None, top_p=None, min_p=None):
        super().__init__()
        self.step = step
        self.k, self.slots, self.window, self.sample = k, slots, window, sample
        self.top_k, self.top_p, self.min_p = top_k, top_p, min_p

    def forward(self, *args):
        k = self.k
        root, L, active = args[:3]
        i = 3
        if k > 0:
            drafts = args[i]
            i += 1
        else:
            drafts = root.unsqueeze(1)[:, :0]  # [B, 0]: static zero-size, only its shape is used
        if self.sample:
            if k > 0:
                accept_u = args[i]
                i += 1
            else:
                accept_u = args[i].new_zeros(args[i].shape[0], 0)  # expo's batch; [B, 0]
            expo, temperature = args[i], args[i + 1]
            i += 2
        # ONNX has no in-place update of a graph input: write into copies, return them.
        kv = [t.clone() for t in args[i:]]
        S = self.slots
        ids = torch.cat([root.unsqueeze(1), drafts], dim=1)  # [B, k+1]
        pos = L.unsqueeze(1) + torch.arange(k + 1, device=L.device)
        valid = active.unsqueeze(1).expand_as(pos)
        slots = torch.where(valid, pos, S - 1)
        mask = _step_mask(L, pos, valid, S, self.window).to(kv[0].dtype)
        logits, _ = self.step(ids, pos, mask, slots, *kv)
        if self.sample:
            # warp_logits computes logits.float() / temperature first; doing that division here with
            # a tensor temperature and verifying at temperature 1.0 is the same computation.
            scaled = logits.float() / temperature.view(-1, 1, 1)
            tokens, n = verify_chain_with_noise(scaled, None, drafts, (accept_u, expo), 1.0,
                                                self.top_k, self.top_p, self.min_p)
        else:
            tokens, n = verify_chain_with_noise(logits, None, drafts, None, 0.0)
        return (tokens, n, logits, *kv)


class PrefillChunk(torch.nn.Module):
    """Write up to C prompt tokens per row at positions start .. start+num_valid-1."""

    def __init__(self, step, chunk: int, slots: int, window):
        super().__init__()
        self.step, self.chunk, self.slots, self.window = step, chunk, slots, window

    def forward(self, input_ids, start, num_valid, *kv):
        kv = [t.clone() for t in kv]
        S = self.slots
        offs = torch.arange(self.chunk, device=start.device)
        pos = start.unsqueeze(1) + offs
        valid = offs.unsqueeze(0) < num_valid.unsqueeze(1)
        mask = _step_mask(start, pos, valid, S, self.window).to(kv[0].dtype)
        self.step(input_ids, torch.where(valid, pos, 0), mask, torch.where(valid, pos, S - 1), *kv)
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


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


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


def _norm_filter(vocab, top_k, top_p, min_p):
    """Warping settings normalised so that no-op values compare equal (None = off)."""
    top_k = None if top_k is None or top_k >= vocab else int(top_k)
    top_p = None if top_p is None or top_p >= 1.0 else float(top_p)
    min_p = None if min_p is None or min_p <= 0.0 else float(min_p)
    return top_k, top_p, min_p


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
        depths: speculation depths to export (default: 0 and the compiler's prompt-lookup depth
            ladder, e.g. ``[0, 4]`` for K = 4 and ``[0, 4, 8]`` for K = 8; 0 = a plain decoding step,
            used when no n-gram matched). The runtime moves between the exported depths of the
            ladder the way the compiler does.
        batch_size: the static batch of every graph (the runtime pads smaller batches).
        modes: ``"greedy"`` (``verify_k{k}.onnx``) and/or ``"sample"`` (``verify_k{k}_sample.onnx``).
        top_k, top_p, min_p: warping baked into the sampling graphs (temperature stays an input).
        prefill_chunk: query length C of the prefill graph (prompts are written C tokens per call).
        external_data: store weights in a shared ``weights.bin``; default: when the model's
            parameters exceed 100 MB.
    """
    import onnx

    if getattr(fast, "draft", None) in ("model", "suffix"):
        raise NotImplementedError(f"ONNX export of a draft={fast.draft!r} pipeline is not supported yet: compile with draft=None or 'ngram'")
    if getattr(fast, "tree", None) is not None:
        raise NotImplementedError("ONNX export of tree speculation is not supported yet: compile with tree=None (chains)")
    model, S, window = fast.model, fast.slots, fast.window
    # prompt lookup moves between the depths of the compiler's ladder (SpecGraphModel._next_k)
    ladder = sorted(getattr(fast, "k_ladder", None) or [fast.k])
    modes = tuple(modes)
    if not modes or any(m not in ("greedy", "sample") for m in modes):
        raise ValueError(f"modes must be a non-empty subset of ('greedy', 'sample'), got {modes!r}")
    if depths is None:
        depths = sorted({0, *ladder})
    depths = sorted({int(d) for d in depths})
    if any(d < 0 for d in depths):
        raise ValueError(f"depths must be >= 0, got {depths}")
    if batch_size < 1 or prefill_chunk < 1:
        raise ValueError("batch_size and prefill_chunk must be >= 1")
    if prefill_chunk > S - 1:
        prefill_chunk = S - 1
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    p = next(model.parameters())
    vocab = model.get_output_embeddings().weight.shape[0]
    top_k, top_p, min_p = _norm_filter(vocab, top_k, top_p, min_p)
    if "sample" in modes:  # validate through the library's own checks
        from specgraph.warping import check_sampling_params
        check_sampling_params(1.0, top_k, top_p, min_p)
    layers, kv_heads, head_dim = kv_layout(model)
    param_bytes = sum(t.numel() * t.element_size() for t in model.parameters())
    if external_data is None:
        external_data = param_bytes > EXTERNAL_DATA_BYTES
    B = batch_size
    past, present = kv_names(layers, "past"), kv_names(layers, "present")
    dev = p.device
    translations = _translations()

    jobs = [("verify", k, m) for k in depths for m in ("greedy", "sample") if m in modes] + [("prefill", prefill_chunk, None)]
    it, bar = _progress(jobs, progress)
    store = _WeightStore(out / WEIGHTS_FILE) if external_data else None
    graphs, files, steps = [], {}, {}
    try:
        for kind, q, mode in it:
            t0 = time.perf_counter()
            Q = q + 1 if kind == "verify" else q
            if Q not in steps:  # greedy and sampling graphs of one depth share the captured step
                with _export_env():
                    gm, counts = run_step_pipeline(capture_step(model, B, Q, S))
                steps[Q] = gm
            step = steps[Q]
            kv = new_kv_cache(model, B, S)
            if kind == "verify":
                name = f"verify_k{q}" + ("_sample" if mode == "sample" else "")
                module = VerifyRound(step, q, S, window, mode == "sample", top_k, top_p, min_p)
                names, ex = ["root", "L", "active"], [
                    torch.zeros(B, dtype=torch.long, device=dev), torch.zeros(B, dtype=torch.long, device=dev),
                    torch.ones(B, dtype=torch.bool, device=dev)]
                if q > 0:
                    names.append("drafts")
                    ex.append(torch.zeros(B, q, dtype=torch.long, device=dev))
                if mode == "sample":
                    if q > 0:
                        names.append("accept_u")
                        ex.append(torch.full((B, q), 0.5, device=dev))
                    names += ["expo", "temperature"]
                    ex += [torch.ones(B, q + 1, vocab, device=dev), torch.ones(B, device=dev)]
                out_names = ["tokens", "num_emitted", "logits", *present]
                out_ex = [torch.zeros(B, q + 1, dtype=torch.long), torch.zeros(B, dtype=torch.long),
                          torch.zeros(B, q + 1, vocab, dtype=p.dtype), *kv]
            else:
                name = f"prefill_c{q}"
                module = PrefillChunk(step, q, S, window)
                names = ["input_ids", "start", "num_valid"]
                ex = [torch.zeros(B, q, dtype=torch.long, device=dev), torch.zeros(B, dtype=torch.long, device=dev),
                      torch.full((B,), q, dtype=torch.long, device=dev)]
                out_names, out_ex = list(present), list(kv)
            if bar is not None:
                bar.set_description(f"exporting {name}")
            elif progress:
                print(f"specgraph.export_onnx: exporting {name} ...", flush=True)
            args = (*ex, *kv)
            with _export_env():
                prog = torch.onnx.export(
                    module, args, dynamo=True, opset_version=opset, input_names=names + past,
                    output_names=out_names, custom_translation_table=translations, verbose=False,
                    optimize=True, report=False,
                )
            proto = prog.model_proto
            got_in = [i.name for i in proto.graph.input]
            got_out = [o.name for o in proto.graph.output]
            if got_in != names + past or got_out != out_names:
                raise RuntimeError(f"{name}: exported graph has inputs {got_in} / outputs {got_out}, "
                                   f"expected {names + past} / {out_names}")
            if store is not None:
                store.externalize(proto)
            path = out / f"{name}.onnx"
            onnx.save_model(proto, str(path))
            del proto, prog
            graphs.append({
                "name": name, "file": path.name, "kind": kind,
                "depth": q if kind == "verify" else None, "mode": mode,
                "chunk": q if kind == "prefill" else None, "query_len": Q,
                "inputs": _value_info(names + past, args), "outputs": _value_info(out_names, out_ex),
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
        files[f] = {"sha256": _sha256(out / f), "bytes": (out / f).stat().st_size}

    gc = model.generation_config
    import specgraph

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
            "dtype": str(p.dtype).replace("torch.", ""),
            "parameter_bytes": param_bytes,
        },
        "batch_size": B,
        "slots": S,
        "scratch_slot": S - 1,
        "max_seq_len": fast.max_seq_len,
        "sliding_window": window,
        "draft": fast.draft,
        "num_speculative_tokens": fast.k,
        "k_ladder": [k for k in ladder if k in depths and k > 0] or ([max(depths)] if max(depths) > 0 else []),
        "ngram": {"max": NGRAM_MAX, "min": NGRAM_MIN},
        "depths": depths,
        "modes": list(modes),
        "prefill_chunk": prefill_chunk,
        "sampling": {"temperature": "input", "top_k": top_k, "top_p": top_p, "min_p": min_p},
        "generation": {
            "eos_token_id": gc.eos_token_id, "pad_token_id": gc.pad_token_id, "bos_token_id": gc.bos_token_id,
        },
        "kv": {"past": past, "present": present, "shape": [B, kv_heads, S, head_dim],
               "dtype": str(p.dtype).replace("torch.", "")},
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
