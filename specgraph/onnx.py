"""Run graphs written by :func:`specgraph.export_onnx` with onnxruntime: ``OnnxSpecGenerator``.

The generation loop is the compiler's own (:func:`specgraph.loop.decode`) with
:class:`OnnxRounds` as its executor: prompts are written into the cache by the prefill graph ``C``
tokens per call (and into the draft model's cache by ``draft_prefill_c{C}``); then every round asks
the compiled loop's own proposers (:mod:`specgraph.proposers`, through the interface of
:mod:`specgraph.proposal`, with the exported settings) for drafts, runs one exported graph, reads the
emitted tokens (the one host sync per round) and advances the committed lengths:

* chains (``draft=None``, ``"ngram"``, ``"suffix"`` with ``tree=None``): prompt lookup
  (:func:`specgraph.lookup.ngram_propose`) or the suffix index's best path
  (:func:`specgraph.proposers.suffix.suffix_chains`, :func:`specgraph.proposers.suffix.suffix_chain_drafts`);
  ``verify_k{k}`` when some live row has a proposal, else the plain ``verify_k0`` step; prompt
  lookup moves k along the compiler's depth ladder (:func:`specgraph.loop.next_k`, e.g. 4 -> 8
  after a fully accepted round), suffix chains take the smallest exported depth that holds them.
* trees: prompt-lookup tries on the static tree (:func:`specgraph.proposers.ngram.propose_ngram_tree`) or
  per-request suffix trees packed into the smallest exported shape
  (:func:`specgraph.proposers.suffix.pack_suffix_trees`); ``tree_n{N}_c{C}_d{D}`` verifies the tree and
  compacts the accepted path's K/V in the graph; the plain step when nothing was proposed.
* a draft model: K ``draft_q{Q}`` steps (Q = 2 for the first, feeding the previous token and the
  root, then 1) on the draft's own cache (:class:`OnnxDraftModelProposer`: the draft model's
  proposer with onnxruntime running its steps), then ``verify_k{K}`` with the drafts and, when
  sampling, the exact q rows they were drawn from (``draft_probs``).

Suffix decoding keeps a :class:`specgraph.suffix.SuffixIndex` (the generator's own, with the
exported settings, or one passed in): each request drafts from a session over its prompt and its
output so far plus the index, and every finished request is added to the index.

The KV caches never leave the runtime's device: per cache two sets of buffers are allocated as
``OrtValue``s and bound with IO binding, one as the ``past_*`` inputs and the other as the
``present_*`` outputs, swapped after every call (ONNX has no in-place update). On CPU the same
code runs with CPU buffers; with ``onnxruntime-gpu`` and a GPU the CUDA provider is picked and the
buffers live on the GPU (the emitted tokens, and a draft model's proposals, are copied back).

Every file is checked against the sha256 in ``manifest.json`` when the generator is created; a
modified or truncated file is refused with its name.
"""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import torch

from specgraph.artifacts import ArtifactError, check_listed, safe_path, verify_files
from specgraph.callrows import CallRows
from specgraph.compiler import assemble_output, eos_and_pad, one_call, prompt_rows
from specgraph.loop import LadderDepth, RoundResult, decode
from specgraph.proposal import CallStart, ChainProposal, Proposer, RoundView, TreeProposal
from specgraph.proposers import NgramProposer, SuffixProposer
from specgraph.proposers.suffix import SUFFIX_MIN_SCORE
from specgraph.eager import GenerationStats
from specgraph.generation import stop_at
from specgraph.onnx_export import (  # noqa: F401 (export_onnx: re-export)
    FORMAT, FORMAT_VERSION, MANIFEST, export_onnx, tree_graph_name,
)
from specgraph.suffix import SuffixIndex
from specgraph.trees import TreeSpec
from specgraph.verify import chain_noise, exponential_noise, tree_noise
from specgraph.warping import SamplingParams, check_sampling_params, normalize_filters

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
    files = man.get("files")
    if not isinstance(files, dict) or not isinstance(man.get("graphs"), list):
        raise ArtifactError(f"{path}: 'files' must be a table and 'graphs' a list")
    for name in files:
        safe_path(d, name)
    for g in man["graphs"]:  # every file a session opens is listed, so its hash is checked first
        check_listed(d, files, g.get("file") if isinstance(g, dict) else None, "graphs[].file")
    if man.get("external_data"):
        check_listed(d, files, man["external_data"], "external_data")
    if check_files:
        verify_files(d, files)
    return man


class OnnxSpecGenerator:
    """Speculative generation with the graphs in ``out_dir``.

    Args:
        providers: onnxruntime execution providers (default: CUDA then CPU when onnxruntime has
            the CUDA provider, else CPU).
        check_files: verify every file's sha256 against the manifest (default True).
        num_threads: onnxruntime intra-op threads (default: onnxruntime's choice).
        suffix_index: for suffix-decoding exports, the :class:`specgraph.suffix.SuffixIndex` to
            draft from and add finished requests to (e.g. one shared with other generators);
            default: a new, empty index with the exported settings.
    """

    def __init__(self, out_dir, providers=None, *, check_files: bool = True, num_threads: int | None = None,
                 session_options=None, suffix_index: SuffixIndex | None = None):
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
        self.draft = man["draft"]
        self.tree = man.get("tree")
        self.num_speculative_tokens = man["num_speculative_tokens"]
        # the static tree and its ranks, as SpecGraphModel parses them (prompt lookup fills them in)
        self._tree_spec = (TreeSpec.from_parents(self.tree["parents"])
                           if self.tree is not None and self.tree["kind"] == "static" else None)
        if self.draft == "suffix":
            settings = dict(man["suffix"])
            # pruning of suffix drafts by estimated path probability, as at export (the compiler default where the manifest has none)
            self._suffix_min_score = settings.pop("min_score", SUFFIX_MIN_SCORE)
            self.suffix_index = suffix_index if suffix_index is not None else SuffixIndex(**settings)
        elif suffix_index is not None:
            raise ValueError(f"suffix_index is for suffix-decoding exports; {self.dir} has draft={self.draft!r}")
        self._caches = {"target": man["kv"]}
        if man.get("draft_model"):
            self._caches["draft"] = man["draft_model"]["kv"]
        for c in self._caches.values():
            if c["dtype"] not in _NP:
                raise ValueError(f"KV dtype {c['dtype']} is not supported by the onnxruntime path")
        self._sessions: dict = {}
        self._kv_host: dict = {}  # cache -> numpy buffers that CPU OrtValues alias: kept alive here
        self._lock = threading.RLock()  # suffix sessions and stats are per call: one generate at a time
        self.stats = GenerationStats()
        # what the proposers read of a compiled object: the chain ladder and the deepest round
        self.k_ladder, self.plain_depth = self._ladder()
        self.k = self.tree["depth_limit"] if self.tree is not None and self.tree["kind"] == "dynamic" \
            else self.num_speculative_tokens
        self.proposer = self._make_proposer()

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

    def new_kv(self, cache: str = "target"):
        """Two sets of zero-filled buffers (past, present) for ``cache`` ("target" or "draft")."""
        info = self._caches[cache]
        make = self._ort.OrtValue.ortvalue_from_numpy
        # zero-filled: masked slots get weight exactly 0 in attention, and 0 * garbage can be NaN
        host = [[np.zeros(info["shape"], dtype=_NP[info["dtype"]]) for _ in info["past"]] for _ in range(2)]
        self._kv_host[cache] = host
        return [[make(a, self.device, 0) for a in bufs] for bufs in host]

    def call(self, name: str, inputs: dict, kv: list, fetch=("tokens", "num_emitted"), cache: str = "target"):
        """Run ``name`` with IO binding: kv[0] in, kv[1] out, then swap. Returns the fetched outputs."""
        sess = self.session(name)
        info = self._caches[cache]
        io = sess.io_binding()
        for spec in self.graphs[name]["inputs"]:
            n = spec["name"]
            if n in inputs:
                io.bind_cpu_input(n, np.ascontiguousarray(inputs[n], dtype=_NP[spec["dtype"]]))
        for n, ov in zip(info["past"], kv[0]):
            io.bind_ortvalue_input(n, ov)
        present = dict(zip(info["present"], kv[1]))
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
        top_k="baked",
        top_p="baked",
        min_p="baked",
        eos_token_id=None,
        pad_token_id=None,
        generator: torch.Generator | None = None,
        uniforms=None,
    ) -> torch.Tensor:
        """prompt + new tokens [B, T + n], rows padded with ``pad_token_id`` after their EOS; left
        padding via ``attention_mask``. The settings are this method's arguments alone: top-k /
        top-p / min-p are the ones baked into the exported sampling graphs (not given: those;
        None: off, which must be what was baked), and there are no logits processors.

        Sampling draws its random inputs from ``generator`` in the compiler's order (a draft
        model's Exp(1) rows per draft step, then :func:`specgraph.verify.chain_noise` or
        :func:`specgraph.verify.tree_noise` per round), so a seeded generator reproduces the
        compiled path's draws round for round. ``uniforms``: optional callable ``(B, k, V) ->
        (accept_u [B, k], expo [B, k+1, V])`` replacing ``chain_noise`` for chain rounds.
        """
        man = self.manifest
        gen = man["generation"]
        eos, pad_token_id = eos_and_pad(eos_token_id, pad_token_id, gen.get("eos_token_id"), gen.get("pad_token_id"))
        if do_sample and temperature == 0:
            raise ValueError("do_sample=True needs temperature > 0 (use do_sample=False for greedy)")
        if do_sample:
            s = man["sampling"]
            baked = (s["top_k"], s["top_p"], s["min_p"])
            top_k, top_p, min_p = (b if v == "baked" else v for v, b in zip((top_k, top_p, min_p), baked))
            check_sampling_params(temperature, top_k, top_p, min_p)
            want = normalize_filters(self.vocab, top_k, top_p, min_p)
            if want != baked:
                raise ValueError(f"these graphs were exported with top_k={baked[0]}, top_p={baked[1]}, min_p={baked[2]} "
                                 f"baked in; got top_k={top_k}, top_p={top_p}, min_p={min_p} (re-export with "
                                 "export_onnx(..., top_k=, top_p=, min_p=); temperature is a graph input)")
        mode = "sample" if do_sample else "greedy"
        if mode not in man["modes"]:
            raise ValueError(f"no {mode} graphs in {self.dir} (exported modes: {man['modes']})")
        rows = self._rows(input_ids, attention_mask, max_new_tokens)
        with one_call(self):
            self.stats = GenerationStats()
            new = self._loop(rows, max_new_tokens, mode, float(temperature), eos, generator, uniforms)
        return assemble_output(input_ids, new, pad_token_id)

    def _rows(self, input_ids, attention_mask, max_new_tokens) -> list[list[int]]:
        if input_ids.dim() == 2 and input_ids.shape[0] > self.batch_size:
            raise ValueError(f"batch size {input_ids.shape[0]} exceeds the exported batch size {self.batch_size}; "
                             "re-export with export_onnx(..., batch_size=)")
        rows = prompt_rows(input_ids, attention_mask, max_new_tokens, self.vocab)
        # cache slots one round writes: the root + K chain drafts, or the tree's nodes
        span, max_seq = self.manifest.get("span", max(self.depths) + 1), self.manifest["max_seq_len"]
        for r in rows:
            need = len(r) + max_new_tokens + span
            if need > max_seq:
                raise ValueError(f"prompt length {len(r)} + max_new_tokens {max_new_tokens} + {span} speculative slots "
                                 f"= {need} exceeds the exported max_seq_len={max_seq}")
        return rows

    def _ladder(self):
        """(chain depth ladder, plain depth), as the compiler moves between its graphs."""
        man = self.manifest
        if self.draft == "model":
            return [self.num_speculative_tokens], self.num_speculative_tokens
        ladder = list(man.get("k_ladder") or []) if self.draft in ("ngram", "suffix") and self.tree is None else []
        plain = 0 if 0 in self.depths else (ladder[0] if ladder else None)
        if plain is None:
            raise ValueError(f"no usable graph: draft={self.draft!r}, depths={self.depths}")
        return ladder, plain

    def prefill(self, rows, kv, cache: str = "target"):
        B, C = self.batch_size, self.manifest["prefill_chunk"]
        name = f"prefill_c{C}" if cache == "target" else f"draft_prefill_c{C}"
        P = max(len(r) for r in rows) - 1
        for c0 in range(0, max(P, 0), C):
            ids = np.zeros((B, C), dtype=np.int64)
            nv = np.zeros(B, dtype=np.int64)
            for b, r in enumerate(rows):
                part = r[c0: min(len(r) - 1, c0 + C)]
                ids[b, : len(part)] = part
                nv[b] = len(part)
            self.call(name, {"input_ids": ids, "start": np.full(B, c0, dtype=np.int64), "num_valid": nv}, kv,
                       fetch=(), cache=cache)

    def _make_proposer(self) -> Proposer:
        """The compiled loop's proposer for this export's drafter, with the exported settings."""
        if self.draft == "model":
            return OnnxDraftModelProposer(self)
        if self.draft == "ngram":
            ngram = self.manifest["ngram"]
            rank = self.tree["rank"] if self._tree_spec is not None else None
            return NgramProposer(self._tree_spec, rank, ngram["max"], ngram["min"])
        if self.draft == "suffix":
            return SuffixProposer(self, self._suffix_min_score)
        return Proposer()

    def _loop(self, rows, max_new_tokens, mode, temperature, eos, generator, uniforms):
        start_t = time.perf_counter()
        kv = self.new_kv("target")
        self.prefill(rows, kv)
        state = CallRows.start(rows, self.batch_size, self.slots, "cpu")  # the compiled loop's row state
        self.proposer.start(CallStart(rows, self.batch_size, torch.device("cpu")))
        sample = mode == "sample"
        rounds = OnnxRounds(self, kv, sample, temperature, generator, uniforms)
        decode(state, self.proposer, rounds, LadderDepth(self.k_ladder),
               params=SamplingParams(temperature if sample else 0.0), generator=generator, vocab=self.vocab,
               trees=self.tree is not None, max_new_tokens=max_new_tokens, eos=eos,
               stop=lambda b, emitted, room: stop_at(emitted, room, eos), stats=self.stats)
        self.stats.seconds += time.perf_counter() - start_t
        self.proposer.finish(rows, state.new)
        return state.new


class OnnxRounds:
    """The exported round graphs as :func:`specgraph.loop.decode` runs them, on one call's
    cache ``kv``: ``verify_k{k}[_sample]`` for chains, the tree shape's graph for trees, over all
    exported slots. An export without the plain graph runs a plain step as its smallest depth
    with the root repeated as drafts (all rejected: one token, as a plain step)."""

    def __init__(self, gen: OnnxSpecGenerator, kv, sample: bool, temperature: float, generator, uniforms=None):
        self.gen, self.kv, self.sample, self.generator = gen, kv, sample, generator
        self.temp = np.full(gen.batch_size, temperature, dtype=np.float32)
        self.noise = uniforms or (lambda b, k, v: chain_noise(b, k, v, "cpu", generator))

    def width(self, state: CallRows) -> int:
        return self.gen.slots

    def chain(self, view: RoundView, chain: ChainProposal) -> RoundResult:
        plain = self.gen.plain_depth
        if chain.k == 0 and plain != 0:
            chain = ChainProposal(plain, view.root.unsqueeze(1).repeat(1, plain))
        k = chain.k
        inputs = self._inputs(view)
        if k > 0:
            inputs["drafts"] = chain.drafts.numpy()
        if chain.probs is not None:
            inputs["draft_probs"] = _np(chain.probs)
        name = f"verify_k{k}"
        if self.sample:
            name += "_sample"
            accept_u, expo = self.noise(view.batch, k, view.vocab)
            if k > 0:
                inputs["accept_u"] = _np(accept_u)
            inputs.update(expo=_np(expo), temperature=self.temp)
        return self._run(name, inputs)

    def tree(self, view: RoundView, tree: TreeProposal) -> RoundResult:
        N, C, _ = tree.shape
        inputs = self._inputs(view)
        inputs.update(tree_tokens=tree.tokens.numpy(), parents=tree.parents.numpy())
        if self.sample:
            accept_u, expo = tree_noise(view.batch, N, C, view.vocab, "cpu", self.generator)
            inputs.update(accept_u=_np(accept_u), expo=_np(expo), temperature=self.temp)
        return self._run(tree_graph_name(tree.shape, self.sample), inputs)

    def record(self, result: RoundResult, state: CallRows, kept, adv) -> None:
        pass

    @staticmethod
    def _inputs(view: RoundView) -> dict:
        return {"root": view.root.numpy(), "L": view.L.numpy(), "active": view.active.numpy()}

    def _run(self, name: str, inputs: dict) -> RoundResult:
        outs = self.gen.call(name, inputs, self.kv)
        return RoundResult(torch.from_numpy(outs["tokens"]), torch.from_numpy(outs["num_emitted"]))


class OnnxDraftModelProposer(Proposer):
    """A draft model's chains (as :class:`specgraph.proposers.draft_model.DraftModelProposer`
    drafts them) with onnxruntime as the executor: per call the prompts go into the draft's own
    cache (``draft_prefill_c{C}``); per round K ``draft_q{Q}`` steps (Q = 2 for the first, feeding
    the previous token and the root, then 1) draw the drafts, in the compiler's draw order when
    sampling, and return the q rows they were drawn from."""

    def __init__(self, gen: "OnnxSpecGenerator"):
        self.gen, self.kv = gen, None

    def start(self, call: CallStart) -> None:
        self.kv = self.gen.new_kv("draft")
        self.gen.prefill(call.rows, self.kv, "draft")

    def propose(self, view: RoundView, k: int) -> ChainProposal:
        """K draft-model steps: drafts [B, K] and, when sampling, the q rows [B, K, V]."""
        gen, B, V = self.gen, view.batch, view.vocab
        K, sample = gen.num_speculative_tokens, not view.params.greedy
        temp = np.full(B, view.params.temperature, dtype=np.float32)
        prev = view.hist.gather(1, (view.L - 1).clamp_min(0).unsqueeze(1)).squeeze(1)
        tokens, last = torch.stack([prev, view.root], dim=1), view.L
        drafts, probs = [], []
        for j in range(K):
            Q = 2 if j == 0 else 1
            inputs = {"tokens": tokens.numpy(), "last": last.numpy(), "active": view.active.numpy()}
            if sample:
                inputs["expo"] = _np(exponential_noise((B, V), "cpu", view.generator))  # the compiler's draw order
                inputs["temperature"] = temp
            outs = gen.call(f"draft_q{Q}" + ("_sample" if sample else ""), inputs, self.kv,
                             fetch=("token", "q") if sample else ("token",), cache="draft")
            tok = torch.from_numpy(outs["token"])
            drafts.append(tok)
            if sample:
                probs.append(torch.from_numpy(outs["q"]))
            tokens, last = tok.unsqueeze(1), last + 1
        return ChainProposal(K, torch.stack(drafts, dim=1), torch.stack(probs, dim=1) if sample else None)

    def finish(self, rows, new) -> None:
        self.kv = None


def _np(t) -> np.ndarray:
    if isinstance(t, torch.Tensor):
        return t.detach().cpu().float().numpy()
    return np.asarray(t, dtype=np.float32)
