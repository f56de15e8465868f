"""Run graphs written by :func:`specgraph.export_onnx` with onnxruntime: ``OnnxSpecGenerator``.

The generation loop is the compiler's (:meth:`specgraph.SpecGraphModel.generate`) with the round
function replaced by the exported graphs: prompts are written into the cache by the prefill graph
``C`` tokens per call; then every round drafts on the host with prompt lookup
(:func:`specgraph.drafters.ngram_propose`, torch CPU tensors), runs ``verify_k{k}`` when some live
row matched an n-gram (else the plain ``verify_k0`` step), with k moving along the compiler's depth
ladder (e.g. 4 -> 8 after a fully accepted round), reads the emitted tokens (the one host sync per
round) and advances the committed lengths: the same decisions as ``SpecGraphModel.generate``.

The KV cache never leaves the runtime's device: two sets of buffers are allocated once as
``OrtValue``s and bound with IO binding, one as the ``past_*`` inputs and the other as the
``present_*`` outputs, swapped after every call (ONNX has no in-place update). On CPU the same
code runs with CPU buffers; with ``onnxruntime-gpu`` and a GPU the CUDA provider is picked and the
buffers live on the GPU (only the emitted tokens are copied back each round).

Every file is checked against the sha256 in ``manifest.json`` when the generator is created; a
modified or truncated file is refused with its name.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch

from specgraph.compiler import assemble_output, eos_and_pad, keep_until_eos, next_k, prompt_rows
from specgraph.drafters import ngram_propose
from specgraph.eager import GenerationStats
from specgraph.onnx_export import FORMAT, FORMAT_VERSION, MANIFEST, _norm_filter, _sha256, export_onnx  # noqa: F401 (re-export)
from specgraph.verify import chain_noise
from specgraph.warping import check_sampling_params

__all__ = ["OnnxSpecGenerator", "export_onnx", "load_manifest"]

_NP = {"float32": np.float32, "float16": np.float16, "int64": np.int64, "bool": np.bool_}




def load_manifest(out_dir, check_files: bool = True) -> dict:
    """Read ``manifest.json`` and (by default) check every listed file's size and sha256."""
    d = Path(out_dir)
    path = d / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no manifest (not a directory written by specgraph.export_onnx)")
    try:
        man = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    if man.get("format") != FORMAT or man.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: format {man.get('format')!r} v{man.get('format_version')!r}, "
                         f"expected {FORMAT!r} v{FORMAT_VERSION}")
    files = man.get("files", {})
    for g in man["graphs"]:
        if g["file"] not in files:
            raise ValueError(f"{path}: graph file {g['file']} has no sha256 entry")
    if man.get("external_data") and man["external_data"] not in files:
        raise ValueError(f"{path}: weights file {man['external_data']} has no sha256 entry")
    if check_files:
        for name, info in files.items():
            f = d / name
            if not f.is_file():
                raise ValueError(f"{f}: listed in the manifest but missing")
            size = f.stat().st_size
            if size != info["bytes"]:
                raise ValueError(f"{f}: {size} bytes, the manifest says {info['bytes']} "
                                 "(truncated or modified); re-export")
            if _sha256(f) != info["sha256"]:
                raise ValueError(f"{f}: sha256 does not match the manifest (file modified); re-export")
    return man


class OnnxSpecGenerator:
    """Speculative generation with the graphs in ``out_dir``.

    Args:
        providers: onnxruntime execution providers (default: CUDA then CPU when onnxruntime has
            the CUDA provider, else CPU).
        check_files: verify every file's sha256 against the manifest (default True).
        num_threads: onnxruntime intra-op threads (default: onnxruntime's choice).
    """

    def __init__(self, out_dir, providers=None, *, check_files: bool = True, num_threads: int | None = None,
                 session_options=None):
        import onnxruntime as ort

        self._ort = ort
        self.dir = Path(out_dir)
        self.manifest = man = load_manifest(self.dir, check_files)
        if providers is None:
            avail = ort.get_available_providers()
            providers = (["CUDAExecutionProvider"] if "CUDAExecutionProvider" in avail else []) + ["CPUExecutionProvider"]
        self.providers = list(providers)
        first = self.providers[0][0] if isinstance(self.providers[0], (tuple, list)) else self.providers[0]
        self.device = "cuda" if first == "CUDAExecutionProvider" else "cpu"
        if session_options is None:
            session_options = ort.SessionOptions()
            if num_threads is not None:
                session_options.intra_op_num_threads = num_threads
                session_options.inter_op_num_threads = 1
        self.session_options = session_options
        self.graphs = {g["name"]: g for g in man["graphs"]}
        self.batch_size = man["batch_size"]
        self.slots = man["slots"]
        self.vocab = man["model"]["vocab_size"]
        self.depths = man["depths"]
        self.kv_dtype = _NP[man["kv"]["dtype"]] if man["kv"]["dtype"] in _NP else None
        self._sessions: dict = {}
        self.stats = GenerationStats()

    # ------------------------------------------------------------------------------------------
    # graphs

    def session(self, name: str):
        """The onnxruntime session of graph ``name`` (created on first use)."""
        if name not in self.graphs:
            raise KeyError(f"no graph {name!r} in {self.dir} (graphs: {sorted(self.graphs)})")
        if name not in self._sessions:
            path = self.dir / self.graphs[name]["file"]
            self._sessions[name] = self._ort.InferenceSession(str(path), sess_options=self.session_options,
                                                              providers=self.providers)
        return self._sessions[name]

    def run(self, name: str, feeds: dict) -> dict:
        """Run graph ``name`` once on numpy (or torch CPU) inputs; returns ``{output name: ndarray}``."""
        feeds = {k: (v.numpy() if isinstance(v, torch.Tensor) else np.asarray(v)) for k, v in feeds.items()}
        sess = self.session(name)
        names = [o.name for o in sess.get_outputs()]
        return dict(zip(names, sess.run(names, feeds)))

    def _new_kv(self):
        if self.kv_dtype is None:
            raise ValueError(f"KV dtype {self.manifest['kv']['dtype']} is not supported by the onnxruntime path")
        shape = self.manifest["kv"]["shape"]
        make = self._ort.OrtValue.ortvalue_from_numpy
        # zero-filled: masked slots get weight exactly 0 in attention, and 0 * garbage can be NaN
        self._kv_host = [[np.zeros(shape, dtype=self.kv_dtype) for _ in self.manifest["kv"]["past"]] for _ in range(2)]
        return [[make(a, self.device, 0) for a in bufs] for bufs in self._kv_host]

    def _call(self, name: str, inputs: dict, kv: list, fetch=("tokens", "num_emitted")):
        """Run ``name`` with IO binding: kv[0] in, kv[1] out, then swap. Returns the fetched outputs."""
        sess = self.session(name)
        man = self.manifest["kv"]
        io = sess.io_binding()
        for info in self.graphs[name]["inputs"]:
            n = info["name"]
            if n in inputs:
                io.bind_cpu_input(n, np.ascontiguousarray(inputs[n], dtype=_NP[info["dtype"]]))
        for n, ov in zip(man["past"], kv[0]):
            io.bind_ortvalue_input(n, ov)
        present = dict(zip(man["present"], kv[1]))
        out_names = [o["name"] for o in self.graphs[name]["outputs"]]
        for n in out_names:  # in the graph's output order: get_outputs() follows the binding order
            if n in present:
                io.bind_ortvalue_output(n, present[n])
            else:
                io.bind_output(n, "cpu" if n in fetch else self.device)
        sess.run_with_iobinding(io)
        outs = dict(zip(out_names, io.get_outputs()))
        kv.reverse()
        return {n: outs[n].numpy() for n in fetch if n in outs}

    # ------------------------------------------------------------------------------------------
    # generation

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        max_new_tokens: int = 128,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        min_p: float | None = None,
        eos_token_id=None,
        pad_token_id=None,
        generator: torch.Generator | None = None,
        uniforms=None,
    ) -> torch.Tensor:
        """Same contract as ``model.generate`` / ``SpecGraphModel.generate``: prompt + new tokens
        [B, T + n], rows padded with ``pad_token_id`` after their EOS; left padding via
        ``attention_mask``.

        ``uniforms``: optional callable ``(B, k, V) -> (accept_u [B, k], expo [B, k+1, V])`` giving
        each sampled round's random inputs (default :func:`specgraph.verify.chain_noise` with
        ``generator``, the compiler's source, so a seeded generator reproduces the compiled path's
        draws round for round).
        """
        man = self.manifest
        gen = man["generation"]
        eos, pad_token_id = eos_and_pad(eos_token_id, pad_token_id, gen.get("eos_token_id"), gen.get("pad_token_id"))
        if do_sample and temperature == 0:
            raise ValueError("do_sample=True needs temperature > 0 (use do_sample=False for greedy)")
        if do_sample:
            check_sampling_params(temperature, top_k, top_p, min_p)
            want = _norm_filter(self.vocab, top_k, top_p, min_p)
            s = man["sampling"]
            baked = (s["top_k"], s["top_p"], s["min_p"])
            if want != baked:
                raise ValueError(f"these graphs were exported with top_k={baked[0]}, top_p={baked[1]}, min_p={baked[2]} "
                                 f"baked in; got top_k={top_k}, top_p={top_p}, min_p={min_p} (re-export with "
                                 "export_onnx(..., top_k=, top_p=, min_p=); temperature is a graph input)")
        mode = "sample" if do_sample else "greedy"
        if mode not in man["modes"]:
            raise ValueError(f"no {mode} graphs in {self.dir} (exported modes: {man['modes']})")
        rows = self._rows(input_ids, attention_mask, max_new_tokens)
        self.stats = GenerationStats()
        new = self._loop(rows, max_new_tokens, mode, float(temperature), eos, generator, uniforms)
        return assemble_output(input_ids, new, pad_token_id)

    def _rows(self, input_ids, attention_mask, max_new_tokens) -> list[list[int]]:
        if input_ids.dim() == 2 and input_ids.shape[0] > self.batch_size:
            raise ValueError(f"batch size {input_ids.shape[0]} exceeds the exported batch size {self.batch_size}; "
                             "re-export with export_onnx(..., batch_size=)")
        rows = prompt_rows(input_ids, attention_mask, max_new_tokens, self.vocab)
        K, max_seq = max(self.depths), self.manifest["max_seq_len"]
        for r in rows:
            need = len(r) + max_new_tokens + K + 1
            if need > max_seq:
                raise ValueError(f"prompt length {len(r)} + max_new_tokens {max_new_tokens} + {K + 1} speculative slots "
                                 f"= {need} exceeds the exported max_seq_len={max_seq}")
        return rows

    def _ladder(self):
        """(prompt-lookup depth ladder, plain depth), as the compiler moves between its graphs."""
        ladder = list(self.manifest.get("k_ladder") or []) if self.manifest["draft"] == "ngram" else []
        plain = 0 if 0 in self.depths else (ladder[0] if ladder else None)
        if plain is None:
            raise ValueError(f"no usable graph: draft={self.manifest['draft']!r}, depths={self.depths}")
        return ladder, plain

    def _prefill(self, rows, kv):
        B, C = self.batch_size, self.manifest["prefill_chunk"]
        name = f"prefill_c{C}"
        P = max(len(r) for r in rows) - 1
        for c0 in range(0, max(P, 0), C):
            ids = np.zeros((B, C), dtype=np.int64)
            nv = np.zeros(B, dtype=np.int64)
            for b, r in enumerate(rows):
                part = r[c0: min(len(r) - 1, c0 + C)]
                ids[b, : len(part)] = part
                nv[b] = len(part)
            self._call(name, {"input_ids": ids, "start": np.full(B, c0, dtype=np.int64), "num_valid": nv}, kv, fetch=())

    def _loop(self, rows, max_new_tokens, mode, temperature, eos, generator, uniforms):
        man = self.manifest
        n_rows, B, S, V = len(rows), self.batch_size, self.slots, self.vocab
        ladder, plain = self._ladder()
        k_now = ladder[0] if ladder else None
        ngram = man["ngram"]
        start_t = time.perf_counter()
        kv = self._new_kv()
        hist = torch.zeros(B, S, dtype=torch.long)
        lens = [len(r) for r in rows] + [1] * (B - n_rows)
        for b, r in enumerate(rows):
            hist[b, : len(r)] = torch.tensor(r)
        self._prefill(rows, kv)
        L = torch.tensor([n - 1 for n in lens])
        root = hist.gather(1, L.unsqueeze(1)).squeeze(1)
        new = [[] for _ in range(n_rows)]
        done = [False] * n_rows + [True] * (B - n_rows)
        temp = np.full(B, temperature, dtype=np.float32)
        while not all(done):
            active = torch.tensor([not d for d in done])
            k, drafts = plain, None
            if k_now is not None:
                d, matched = ngram_propose(hist, L + 1, k_now, ngram["max"], ngram["min"])
                if plain != 0 or bool((matched * active).any()):  # else a plain step, as the compiler
                    k, drafts = k_now, d
            if k > 0 and drafts is None:  # pragma: no cover - plain depth > 0 only without a drafter
                raise ValueError("a speculative graph needs drafts")
            inputs = {"root": root.numpy(), "L": L.numpy(), "active": active.numpy()}
            if k > 0:
                inputs["drafts"] = drafts.numpy()
            name = f"verify_k{k}"
            if mode == "sample":
                name += "_sample"
                accept_u, expo = (uniforms or (lambda b, kk, v: chain_noise(b, kk, v, "cpu", generator)))(B, k, V)
                if k > 0:
                    inputs["accept_u"] = _np(accept_u)
                inputs["expo"] = _np(expo)
                inputs["temperature"] = temp
            outs = self._call(name, inputs, kv)
            tokens_t = torch.from_numpy(outs["tokens"])
            tokens_h, n_h = outs["tokens"].tolist(), outs["num_emitted"].tolist()
            self.stats.rounds += 1
            if k_now is not None:
                k_now = next_k(ladder, k_now, k, [n_h[b] for b in range(n_rows) if not done[b]])
            for b in range(n_rows):
                if done[b]:
                    continue
                keep, stopped = keep_until_eos(tokens_h[b][: n_h[b]], max_new_tokens - len(new[b]), eos)
                new[b].extend(keep)
                self.stats.record_row(k, n_h[b], len(keep))
                if stopped or len(new[b]) >= max_new_tokens:
                    done[b] = True
            adv = torch.tensor([0 if done[b] else n_h[b] for b in range(B)])
            pos = L.unsqueeze(1) + 1 + torch.arange(k + 1)  # history holds L + 1 tokens
            write = torch.arange(k + 1).unsqueeze(0) < adv.unsqueeze(1)
            hist.scatter_(1, torch.where(write, pos, S - 1), torch.where(write, tokens_t, hist[:, S - 1:]))
            L = L + adv
            root = torch.where(adv > 0, tokens_t.gather(1, (adv - 1).clamp_min(0).unsqueeze(1)).squeeze(1), root)
        self.stats.seconds += time.perf_counter() - start_t
        return new


def _np(t) -> np.ndarray:
    if isinstance(t, torch.Tensor):
        return t.detach().cpu().float().numpy()
    return np.asarray(t, dtype=np.float32)
