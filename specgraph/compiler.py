"""``specgraph.compile``: a captured, rewritten and compiled speculative step for an HF causal LM.

Per (batch bucket, query length) the model step is captured once (:mod:`specgraph.capture`),
rewritten by the pass pipeline (:mod:`specgraph.passes`) and wrapped in a *round* function that
also proposes drafts, builds positions / slots / the additive mask, and verifies — all tensor ops,
traced together by ``torch.compile`` so verification fuses after the logits. The host syncs once
per round to read the emitted tokens (EOS, streaming, stopping).

Static KV cache layout: row b's committed tokens live in slots ``0 .. L[b]-1`` (slot = position),
the pending root (last accepted token) and drafts are written at ``L[b] ..``; rejected slots are
simply not counted (rollback = not advancing ``L``) and are overwritten next round. The last slot
is a scratch slot where padding and finished rows write.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
import warnings
from dataclasses import dataclass

import torch

from specgraph.callrows import CallRows, advanced_slots
from specgraph.loop import LadderDepth, RoundResult, decode, default_ladder
from specgraph.rounds import chain_round, compact_path, draft_logits, prefill_logits, step_mask, tree_mask, tree_round
from specgraph.packing import packed_layout
from specgraph.capture import (Step, UnsupportedModel, capture_step, check_supported, full_width, layer_windows,
                               new_kv_cache, uses_alibi)
from specgraph.eager import GenerationStats as Stats
from specgraph import precision
from specgraph.freezing import BUDGET as FREEZE_BUDGET, ENV_BUDGET as FREEZE_ENV, weight_bytes
from specgraph.limits import check_kv_fits, resolve_max_seq_len
from specgraph.graphset import MODES, GraphSpec, Progress, example_inputs, plan as plan_graph_set, with_logits
from specgraph.generation import (GenerationRequest, ScoreLog, StepStreamer, UnsupportedSetting, inferred_attention_mask,
                                  resolve, stop_at)
from specgraph.passes import block_sparse_attention_pass, dequant_linear_pass, run_step_pipeline
from specgraph.lookup import NGRAM_TREE_MATCHES
from specgraph.proposal import CallStart, ChainProposal, Proposer, RoundView, TreeProposal
from specgraph.grammar import GrammarRows, compile_grammar, grammar_spec
from specgraph.processors import LogitsSpec, process_logits, with_grammar
from specgraph.trees import SUFFIX_CHILDREN, SUFFIX_TREE_SIZES, TreeSpec, tree_from_paths
from specgraph.templates import memoize_kernel_templates
from specgraph.verify import chain_noise, tree_noise
from specgraph.warping import SamplingParams, normalize_filters, warped_probs



@dataclass(frozen=True)
class RoundExtras:
    """What a round does besides verifying: apply logits processors (``logits``) and return the
    processed and raw logits of its positions (``scores``). Part of a round graph's key."""

    logits: LogitsSpec | None = None
    scores: bool = False
    logprobs: int = -1  # >= 0: the emitted tokens' log-probabilities and the top-n of each position

    @property
    def any(self) -> bool:
        return self.logits is not None or self.scores or self.logprobs >= 0


def _bucket(b: int, max_batch: int) -> int:
    p = 1
    while p < b:
        p *= 2
    return min(p, max_batch)


PACKED_TOKENS = 512  # prompt tokens per packed prefill call in generate (its attention is tokens x width)


def _sliding_window(model):
    """The attention window to encode in the mask (None = full attention)."""
    cfg = model.config.get_text_config(decoder=True)
    types = getattr(cfg, "layer_types", None) or []
    window = getattr(cfg, "sliding_window", None)
    if types:
        return window if all(t == "sliding_attention" for t in types) else None
    return window if window and getattr(cfg, "use_sliding_window", True) else None


def check_servable(model) -> None:
    """Refuse, at compile time and with the reason, models no path of specgraph can serve (the
    capture route's own limits are checked apart: those models fall back to the eager path)."""
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(model, "generation_config"):
        raise UnsupportedModel(f"{type(model).__name__} is not a transformers generation model (no config / "
                               "generation_config)")
    if getattr(cfg, "is_encoder_decoder", False):
        raise UnsupportedModel(f"{type(model).__name__} is an encoder-decoder model ({cfg.model_type}); specgraph "
                               "serves decoder-only causal LMs")
    params = list(model.parameters())
    if not params:
        raise UnsupportedModel(f"{type(model).__name__} has no parameters")
    if any(p.device.type == "meta" for p in params):
        raise UnsupportedModel(f"{type(model).__name__} has weights on the 'meta' device (not loaded); load the "
                               "weights (e.g. from_pretrained without device_map='meta', or to_empty + load_state_dict)")
    if model.get_output_embeddings() is None:
        raise UnsupportedModel(f"{type(model).__name__} has no language-model head (use the *ForCausalLM class)")


def _check_draft_model(target, draft) -> None:
    check_servable(draft)
    if draft.training:
        raise ValueError("put the draft model in eval mode first (draft.eval())")
    tv = target.get_output_embeddings().out_features
    dv = draft.get_output_embeddings().out_features  # check_servable: it has an LM head
    if dv != tv:
        raise ValueError(
            f"vocabulary mismatch: target has {tv} output tokens, draft has {dv}; the draft must share the "
            "target's tokenizer and vocabulary (e.g. a smaller model of the same family)"
        )
    for name in ("bos_token_id", "eos_token_id"):
        t, d = getattr(target.config, name, None), getattr(draft.config, name, None)
        if t is not None and d is not None and t != d:
            raise ValueError(f"tokenizer mismatch: target {name}={t}, draft {name}={d}")
    if next(draft.parameters()).device != next(target.parameters()).device:
        raise ValueError("target and draft must be on the same device")


def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` with the strides of a new tensor of its shape: compiled graphs guard on input strides,
    and the loop's views (a row slice, an empty ``[B, 0]`` draft tensor cut from the history) must
    not make a graph that warmup built on fresh tensors build again. Contiguous tensors, the KV
    caches among them, are passed as they are (their in-place writes must land)."""
    if t.numel() == 0:
        return t.new_empty(t.shape)
    return t.contiguous()


MIN_ATTEND = 256  # overridable for tests
# past MIN_ATTEND, CPU rounds attend the live slots rounded up to this step: a round's attention
# reads every attended slot of every row, and one dynamic-width graph serves every width
WIDTH_STEP = 64
# compile(warmup=None) builds the whole graph set up front (the test suite turns this off: each test
# then builds only the graphs it runs; the warmup tests pass warmup=True)
WARMUP_BY_DEFAULT = True
# autotune="auto" turns Inductor's GEMM autotuning on for CPU models of at least this many parameters:
# SmolLM2-135M on a 2-core CPU decodes 1.8x faster plain and 1.4x with prompt lookup, for about 12%
# more build time per graph (benchmarks/stream_bench.py, "untuned" methods); for tiny models the
# GEMMs are not what a step costs, so only the build time would grow.
# On CUDA it stays off (Triton autotuning of every GEMM shape adds minutes per graph).
AUTOTUNE_MIN_PARAMS = 50_000_000
# On CUDA each width is one more graph to compile and record (~25 s each for SmolLM2 on an H200), while
# attending the whole cache costs little there (1024 fp32 K/V slots of SmolLM2 read ~280 MB per step
# at ~4.8 TB/s): one width per shape up to max_seq_len 1024.
MIN_ATTEND_CUDA = 1024


@contextlib.contextmanager
def one_call(obj):
    """Hold ``obj._lock`` (an RLock) for one ``generate`` call. Calls from other threads wait; a
    call from inside a running one on the same thread (a streamer calling back into ``generate``)
    raises instead: the two would share one set of KV caches and the outer output would be wrong."""
    with obj._lock:
        if getattr(obj, "_in_call", False):
            raise RuntimeError("generate was called from inside a running generate on the same object (e.g. from "
                               "its streamer); use a second compiled object for nested generation")
        obj._in_call = True
        try:
            yield
        finally:
            obj._in_call = False


def eos_and_pad(eos_token_id, pad_token_id, default_eos, default_pad) -> tuple[list[int], int]:
    """HF's defaults: EOS ids from the argument or the generation config; pad from the argument,
    the config, else the first EOS id, else 0."""
    eos_token_id = eos_token_id if eos_token_id is not None else default_eos
    eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or [])
    pad = pad_token_id if pad_token_id is not None else default_pad
    return eos, (pad if pad is not None else (eos[0] if eos else 0))


def prompt_rows(input_ids, attention_mask, max_new_tokens, vocab) -> list[list[int]]:
    """The unpadded prompt of each row (left padding via ``attention_mask``), checked."""
    if input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"input_ids must be a [B, T] integer tensor, got {tuple(input_ids.shape)} {input_ids.dtype}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    if mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask shape {tuple(mask.shape)} != input_ids shape {tuple(input_ids.shape)}")
    rows = [input_ids[b].cpu()[mask[b].cpu().bool()].tolist() for b in range(input_ids.shape[0])]
    for b, r in enumerate(rows):
        if not r:
            raise ValueError(f"row {b} of the batch has no tokens (attention_mask is all zeros)")
        if vocab is not None and (min(r) < 0 or max(r) >= vocab):
            raise ValueError(f"row {b} has token ids outside the model's vocabulary [0, {vocab})")
    return rows


def assemble_output(input_ids, new: list[list[int]], pad_token_id) -> torch.Tensor:
    """prompt + new tokens [B, T + n], rows padded with ``pad_token_id`` (HF's return convention)."""
    width = max(len(n) for n in new)
    out = torch.full((input_ids.shape[0], width), pad_token_id, dtype=input_ids.dtype, device=input_ids.device)
    for b, n in enumerate(new):
        if n:
            out[b, : len(n)] = torch.tensor(n, dtype=input_ids.dtype)
    return torch.cat([input_ids, out], dim=1)


def kernel_threads() -> int:
    """The threads a block-sparse attention kernel is built for: the machine's logical CPUs.
    Inductor's flex attention template sizes its per-thread scratch buffers by a thread count fixed
    when it is built, and runs on the ATen pool of the calling process: more threads at run time
    than at build time write past those buffers, so graphs are built for the most a process can
    usefully run, and :meth:`SpecGraphModel.check_threads` refuses more."""
    return os.cpu_count() or 1


def _flex_buffers_for_kernel_threads() -> bool:
    """Have Inductor's CPU flex attention template size its buffers for :func:`kernel_threads`
    rather than for ``config.cpp.threads`` (which is 1 here, see :func:`inductor_settings`). False
    where this torch has no such template function: the graph then gets
    ``cpp.threads = kernel_threads()`` for every kernel instead (a little slower, as safe)."""
    try:
        from torch._inductor.kernel.flex import flex_cpu  # noqa: F401 - loads the template module without a cycle
        from torch._inductor.codegen import cpp_flex_attention_template as template
    except ImportError:
        return False
    if not callable(getattr(template, "parallel_num_threads", None)):
        return False
    template.parallel_num_threads = kernel_threads
    return True


def inductor_settings(device, freeze: bool, autotune: bool, attention: str = "sdpa", low_precision: bool = False) -> dict:
    """The Inductor config of every graph specgraph builds, JIT or AOT. ``freeze``: the weights
    become constants, prepacked for the GEMMs. ``autotune``: Inductor benchmarks its own GEMM
    template against the library call per shape (on an AVX-512 CPU its micro-kernel beats MKL for
    the few-row GEMMs of a decode round; about 12% more build time per graph, and it pays with
    frozen weights only). No autotune tables or stats reach the user's terminal.
    On CPU the per-step elementwise kernels are tiny: one OpenMP region each costs more than it
    saves, so they run single-threaded (GEMMs still use all threads); a block-sparse attention
    kernel is built for :func:`kernel_threads` threads whatever that setting says.
    Low-precision (bf16 / fp16) results are rounded after each operation as eager rounds them
    (``emulate_precision_casts``), not kept in fp32 through a fused kernel: the compiled rounds
    then compute the model's own law (greedy output equal to ``model.generate``).
    ``low_precision`` (a graph with :mod:`specgraph.precision`'s layers): no epilogue fusion, so
    nothing of a dequantized linear is fused into the attention kernel before it (Inductor's CPU
    flex-attention template takes no epilogue)."""
    memoize_kernel_templates()
    config = {"freezing": freeze, "emulate_precision_casts": True}
    if low_precision:
        config["epilogue_fusion"] = False
    if autotune:
        config.update(max_autotune=True,
                      max_autotune_gemm_backends="CPP,ATEN" if device.type == "cpu" else "TRITON,ATEN")
    for quiet, value in (("autotune_num_choices_displayed", 0), ("max_autotune_report_choices_stats", False)):
        if hasattr(torch._inductor.config, quiet):
            config[quiet] = value
    if device.type == "cpu":
        sized = attention != "block_sparse" or _flex_buffers_for_kernel_threads()
        config["cpp.threads"] = 1 if sized else kernel_threads()
    return config


def resolve_attention(attention, model, backend) -> str:
    """``compile(attention=...)``: "sdpa" (each attention call reads the attended width W for every
    row of the batch) or "block_sparse" (:func:`specgraph.passes.block_sparse_attention_pass`: each
    row reads only the cache blocks its mask shows, so a short row next to a long one costs what
    its own length costs). ``"auto"``: "block_sparse" for Inductor on CPU (flex attention's C++
    template), else "sdpa"."""
    if attention == "auto":
        cpu = next(model.parameters()).device.type == "cpu"
        return "block_sparse" if backend == "inductor" and cpu else "sdpa"
    if attention not in ("sdpa", "block_sparse"):
        raise ValueError(f"attention must be 'auto', 'sdpa' or 'block_sparse', got {attention!r}")
    return attention


def resolve_autotune(autotune, model, frozen: bool = True) -> bool:
    """``compile(autotune=...)``: True / False as given; ``"auto"``: frozen graphs (GEMM autotuning
    pays with frozen weights only) of a CPU model of at least AUTOTUNE_MIN_PARAMS parameters."""
    if autotune == "auto":
        first = next(model.parameters())
        return (frozen and first.device.type == "cpu"
                and sum(p.numel() for p in model.parameters()) >= AUTOTUNE_MIN_PARAMS)
    if not isinstance(autotune, bool):
        raise ValueError(f"autotune must be True, False or 'auto', got {autotune!r}")
    return autotune


def attend_width(need: int, slots: int, min_attend: int | None = None, step: int | None = None) -> int:
    """Attended cache prefix for a round: at least ``min_attend`` (default MIN_ATTEND) and ``need``,
    or all slots. Past ``min_attend`` it grows by multiples of ``step`` (one dynamic-width graph
    serves them all, and a round reads ``need`` rounded up to the step) or, with ``step=None``,
    by powers of two (on CUDA each width is a CUDA graph of its own, so widths must be few)."""
    w = MIN_ATTEND if min_attend is None else min_attend
    if step and need > w:
        w = -(-need // step) * step
    while w < need:
        w *= 2
    return w if w < slots else slots


@dataclass
class Draft:
    """``compile(draft=...)`` resolved into what the engine runs (:func:`specgraph.proposers.resolve_draft`
    does it): the drafter's kind and the objects it drafts with."""
    kind: str | None  # None (plain decoding), "ngram", "suffix", "custom", "model", "eagle" or "medusa"
    draft_model: torch.nn.Module | None = None  # kind "model": the smaller model
    head: object | None = None  # kind "eagle" / "medusa": the head bound to the target
    suffix_index: object | None = None  # kind "suffix": the specgraph.suffix.SuffixIndex it drafts from
    chain_drafter: object | None = None  # kind "custom": a specgraph.drafters.ChainDrafter


DRAFT_KINDS = (None, "ngram", "suffix", "custom", "model", "eagle", "medusa")
HEAD_KINDS = ("eagle", "medusa")  # drafters that read the target's features (specgraph.learned)


@dataclass
class EngineConfig:
    """What :func:`compile` was asked, resolved and validated: the settings a compiled object is
    built with. ``k`` and ``k_ladder`` are the depths at construction: ``set_depths`` and
    ``num_speculative_tokens="auto"`` move the object's own ``fast.k`` / ``fast.k_ladder`` later,
    and the cache slots a round writes (``fast.span``) also depend on a head drafter's tree size."""
    draft: str | None  # None (plain decoding), "ngram", "suffix", "custom", "model", "eagle" or "medusa"
    k: int  # tokens drafted per chain round (a static tree's depth; 0 for plain decoding)
    k_ladder: list[int]  # the chain depths model-free drafters move between (one graph each)
    tree: "TreeSpec | str | None"  # a static tree, "dynamic", or None (chains)
    tree_rank: list[int] | None  # a static tree's node ranks
    tree_nodes: int | None  # drafted nodes per EAGLE-2 dynamic tree
    tree_choice: dict | None  # tree_nodes="auto": this machine's measurements behind the choice
    backend: str
    freeze: bool
    autotune: bool
    max_batch_size: int
    max_seq_len: int
    attention: str  # "sdpa" (the model's own) or "block_sparse" (per row, the cache blocks it sees)
    draft_model: torch.nn.Module | None = None  # draft="model": the smaller model
    head: object | None = None  # an EAGLE / Medusa head bound to the target
    suffix_index: object | None = None  # draft="suffix": the specgraph.suffix.SuffixIndex it drafts from
    chain_drafter: object | None = None  # draft="custom": a specgraph.drafters.ChainDrafter

    @property
    def slots(self) -> int:
        return self.max_seq_len + 1  # + a scratch slot

    def with_tree_size(self, depth: int, nodes: int, choice: dict | None) -> "EngineConfig":
        """The same settings with an EAGLE-2 tree of ``nodes`` drafted nodes, ``depth`` deep."""
        return dataclasses.replace(self, k=depth, k_ladder=[depth], tree_nodes=nodes, tree_choice=choice)


def engine_config(model, draft: Draft, num_speculative_tokens, tree, backend, max_batch_size, max_seq_len,
                  freeze=True, autotune=False, tree_nodes=None, attention="auto") -> EngineConfig:
    """:func:`compile`'s arguments, the drafter already resolved, as an :class:`EngineConfig`, or a
    ``ValueError`` that says what to pass instead. ``tree_nodes``: None, or the drafted nodes of
    EAGLE-2 trees (``tree_nodes="auto"`` is sized by the API layer, :func:`specgraph.learned.size_dynamic_tree`)."""
    if backend not in ("inductor", "eager"):
        raise ValueError(f"backend must be 'inductor' or 'eager', got {backend!r}")
    check_servable(model)
    if draft.kind not in DRAFT_KINDS:
        raise ValueError(f"unknown drafter kind {draft.kind!r}: one of {DRAFT_KINDS}")
    if draft.draft_model is not None:
        _check_draft_model(model, draft.draft_model)
    if not isinstance(num_speculative_tokens, int) or num_speculative_tokens < 1:
        raise ValueError(f"num_speculative_tokens must be a positive int, got {num_speculative_tokens!r}")
    tree, tree_rank = parse_tree(tree, draft.kind)
    draft_model = draft.draft_model
    if tree is not None and (uses_alibi(model) or (draft_model is not None and uses_alibi(draft_model))):
        raise ValueError("ALiBi models (Bloom) run chains, not trees: their position biases count cache slots, "
                         "and a tree's nodes do not sit at their positions")
    if tree_nodes is not None:
        if not (tree == "dynamic" and draft.kind == "eagle"):
            raise ValueError("tree_nodes= sizes EAGLE-2 dynamic trees: it needs an EAGLE head and tree='dynamic'")
        if isinstance(tree_nodes, bool) or not isinstance(tree_nodes, int) or tree_nodes < 1:
            raise ValueError(f"tree_nodes must be a positive int or 'auto', got {tree_nodes!r}")
    if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
        raise ValueError(f"max_batch_size must be an int >= 1, got {max_batch_size!r}")
    max_seq_len = resolve_max_seq_len(model, max_seq_len, draft_model=draft_model)
    check_kv_fits(model, draft_model, max_batch_size, max_seq_len + 1)  # + the scratch slot (EngineConfig.slots)
    if model.training:
        raise ValueError("put the model in eval mode first (model.eval())")
    kind = draft.kind
    k = 0 if kind is None else (tree.max_depth if isinstance(tree, TreeSpec) else num_speculative_tokens)
    model_free = kind in ("ngram", "suffix", "custom")  # their chains move between depths, see next_k
    return EngineConfig(kind, k, default_ladder(k) if model_free else [k], tree, tree_rank, tree_nodes, None,
                        backend, bool(freeze), bool(autotune), max_batch_size, max_seq_len,
                        resolve_attention(attention, model, backend), draft_model, draft.head, draft.suffix_index,
                        draft.chain_drafter)


def parse_tree(tree, draft):
    """(TreeSpec, rank per node) for ``tree`` = list of paths (Medusa-style ranks), ("dynamic",
    None), or (None, None)."""
    if tree is None:
        return None, None
    if draft is None:
        raise ValueError("tree= needs a draft ('ngram' or a draft model): plain decoding has nothing to branch on")
    if draft == "custom":
        raise ValueError("a ChainDrafter proposes chains: use tree=None")
    if isinstance(tree, str):
        if tree == "dynamic":
            if draft in ("suffix", "eagle"):
                return "dynamic", None
            raise ValueError(
                "tree='dynamic' needs a drafter that scores its own nodes (draft='suffix' or an EAGLE head); for "
                "'ngram' and draft models pass a static tree as a list of paths, e.g. [(0,), (1,), (0, 0), (0, 0, 0)]"
            )
        raise ValueError(f"tree must be None, a list of paths or 'dynamic', got {tree!r}")
    if draft == "suffix":
        raise ValueError("draft='suffix' builds its own trees: use tree='dynamic' (or tree=None for a chain)")
    try:
        spec, rank = tree_from_paths(tree)
    except TypeError as e:
        raise ValueError(f"tree must be a list of paths (tuples of ranks), got {tree!r}") from e
    if draft == "ngram" and int(rank.max()) >= NGRAM_TREE_MATCHES:
        raise ValueError(f"prompt-lookup trees rank at most {NGRAM_TREE_MATCHES} candidates per node; got rank {int(rank.max())}")
    return spec, rank.tolist()


class SpecGraphModel:
    """What :func:`compile` returns. Call :meth:`generate`; read :attr:`stats`."""

    def __init__(self, model, config: EngineConfig, make_proposer=None):
        """``config`` from :func:`engine_config`; ``make_proposer(fast)`` returns the drafter behind
        the loop's one interface (:class:`specgraph.proposal.Proposer`; the default drafts nothing:
        :func:`specgraph.proposers.make_proposer` builds the drafter ``config`` names)."""
        cfg = self.config = config
        draft_model = cfg.draft_model
        self.model = model
        self.weights = precision.as_given(model)  # the precision the target runs at (specgraph.precision)
        self.source_model = None  # specgraph.compile: the model it was given, while the graph set builds
        self.draft, self.draft_model = cfg.draft, cfg.draft_model
        self.suffix_index, self.chain_drafter = cfg.suffix_index, cfg.chain_drafter
        self.tree, self.tree_rank, self.tree_nodes, self.tree_choice = cfg.tree, cfg.tree_rank, cfg.tree_nodes, cfg.tree_choice
        self.dynamic_tree = self.tree == "dynamic"
        self.k, self.k_ladder = cfg.k, cfg.k_ladder
        # cache slots one round writes: the root + k chain drafts, or the tree's nodes (a head
        # drafter's dynamic trees: its own size, below)
        if self.tree is None:
            self.span = self.k + 1
        else:
            self.span = 1 + max(SUFFIX_TREE_SIZES) if self.dynamic_tree else self.tree.num_nodes
        self._lock = threading.RLock()  # one generate at a time per object (shared KV caches)
        # chooses each round's chain depth when set (num_speculative_tokens="auto": specgraph.adaptive)
        self.policy = None
        self.backend, self.freeze, self.autotune, self.attention = cfg.backend, cfg.freeze, cfg.autotune, cfg.attention
        # the threads block-sparse graphs are built for (a compiled directory's: its manifest's)
        self.built_threads = kernel_threads()
        self.max_batch_size, self.max_seq_len, self.slots = cfg.max_batch_size, cfg.max_seq_len, cfg.slots
        # frozen graphs each copy their weights: a process-wide budget (specgraph.freezing) decides
        # per graph; graph_frozen records what each compiled graph got
        self.graph_frozen: dict[str, bool] = {}
        self._frozen_account: dict = {}
        FREEZE_BUDGET.track(self, self._frozen_account)
        self.stats = Stats()
        self.draft_processors = (None, ())  # (LogitsSpec, state) of the running call
        self.fallback_reason = None
        try:
            check_supported(model)
            if draft_model is not None:
                check_supported(draft_model)
        except UnsupportedModel as e:
            if draft_model is not None:
                raise ValueError(f"cannot compile this target/draft pair: {e}") from e
            self.fallback_reason = str(e)
            warnings.warn(f"specgraph: cannot rewrite this model ({e}); falling back to the eager path", stacklevel=3)
        # eager attention (target or draft) reads every cache slot: its rounds attend the full width
        self.full_width = full_width(model) or (draft_model is not None and full_width(draft_model))
        self.window = _sliding_window(model)
        self.draft_window = None if draft_model is None else _sliding_window(draft_model)
        self._eager_step = Step(model)  # a head drafter's prefill: it reads the prompt's features
        # prefills and the draft's catch-up only write the cache: no [B, P, V] logits
        self._fill_step = Step(model, all_logits=False)
        self._eager_draft_step = None if draft_model is None else Step(draft_model, all_logits=False)
        self._steps: dict = {}
        self._fns: dict = {}
        self._bound: dict = {}  # (shared graph key, width) -> the graph bound to that width's slot input
        self._slot_inputs: dict = {}
        self.graphs_built: dict[str, float] = {}  # graph name -> seconds its first call (the build) took
        self._warm = self._warming = False  # warmup() ran / is running
        self.graph_cache = None  # what specgraph.compile's graph cache did for this object (specgraph.graphcache)
        self.graph_cache_root = None  # the folder of that cache (None: the default)
        self._prefill_graph = None
        self._kv: dict = {}
        self.pass_counts: dict = {}
        self.proposer = Proposer() if make_proposer is None else make_proposer(self)
        if (self.proposer.head_drafter is None) != (cfg.head is None):
            raise ValueError("make_proposer must give a head drafter exactly when the config has a head")
        # a head drafter proposes from the target's final features, which the rounds then also return
        self.learned = self.proposer.head_drafter
        if self.learned is not None:
            self.span = self.learned.span
        if self.fallback_reason is None and self.full_width:
            self._check_eager_attention(draft_model)

    def _check_eager_attention(self, draft_model) -> None:
        """Eager attention is served when the step's mask reaches every layer's scores (the pass
        pipeline checks it on a captured step); otherwise the model falls back, or a draft pair is
        refused, with the reason."""
        try:
            self._step(1, 1)
            if draft_model is not None:
                self._step(1, 1, which="draft")
        except (UnsupportedModel, ValueError) as e:
            if draft_model is not None:
                raise ValueError(f"cannot compile this target/draft pair: {e}") from e
            self.fallback_reason = str(e)
            warnings.warn(f"specgraph: cannot rewrite this model ({e}); falling back to the eager path", stacklevel=4)

    # ------------------------------------------------------------------------------------------
    # precompiled graphs

    def use_graphs(self, graphs, prefill=None) -> None:
        """Serve rounds from graphs compiled elsewhere (AOTInductor packages: :mod:`specgraph.aot`).

        ``graphs`` is a mapping from graph keys (see :meth:`graph_key`) to callables taking the
        attended cache slots [W] (any W up to ``slots - 1``) first, then the inputs of
        :meth:`_round_fn` / :meth:`_tree_round_fn`; lookups it does not
        answer (``key not in graphs``) are compiled here as usual, so a mapping may also raise from
        ``__contains__`` to forbid compiling. ``prefill(ids, pos, valid, *kv)`` (ids, pos [B, P]
        long, valid [B, P] bool) replaces the eager prompt prefill of the target.
        """
        self._fns = graphs
        self._bound = {}
        self._prefill_graph = prefill

    def refresh_graphs(self) -> list[int]:
        """Adopt graphs that finished building in the background since the last call (the graph
        cache's packages of batch buckets above 1, :mod:`specgraph.graphcache`): asked of
        the :meth:`use_graphs` mapping when it has a ``refresh()``. ``generate`` calls it before
        each call and a server between rounds, never inside a round. Returns the batch buckets
        whose graphs changed (empty: none)."""
        refresh = getattr(self._fns, "refresh", None)
        changed = [] if refresh is None else refresh()
        if changed:
            self._bound = {}
        return changed

    def graphs_in_use(self):
        """The mapping given to :meth:`use_graphs` (graphs built here are added to it), or this
        object's own graphs."""
        return self._fns

    def graph_key(self, kind: str, batch: int, params: SamplingParams, width: int | None, shape) -> tuple:
        """The key :meth:`use_graphs` mappings are asked for: ``kind`` "round" (``shape`` = chain
        depth k) or "tree" (``shape`` = (N nodes, C max children, D depth)), a batch bucket and the
        sampling settings (sampling graphs are keyed at temperature 1: it is an input). The
        attended width is an input of the graph, not part of its key: whatever ``width`` is given,
        the key's width slot is None."""
        if kind not in ("round", "tree"):
            raise ValueError(f"kind must be 'round' or 'tree', got {kind!r}")
        return (kind, batch, self._graph_params(params), None, shape)

    # ------------------------------------------------------------------------------------------
    # the graph set

    def chain_depths(self) -> list[int]:
        """The chain depths a round can run at: 0 (a plain step: plain decoding, a model-free
        drafter without a match, a tree drafter without a tree, the adaptive policy's off) and the
        drafter's ladder (or the policy's depths)."""
        if self.draft is None:
            return [0]
        if self.tree is not None:
            return [0] if self.learned is None and self.draft != "model" else []
        chain = set(self.k_ladder)
        if self.draft in ("ngram", "suffix", "custom") or self.policy is not None:
            chain.add(0)
        return sorted(chain)

    def tree_shapes(self) -> list[tuple[int, int, int]]:
        """The tree round shapes (N nodes, C max children, D depth) the loop can run; [] for chains."""
        if self.tree is None or self.learned is not None:  # a head drafter's trees: built by its warmup generation
            return []
        if self.dynamic_tree:  # suffix trees are packed into one of SUFFIX_TREE_SIZES (see pack_suffix_trees)
            return [(n + 1, SUFFIX_CHILDREN, min(self.k, n)) for n in SUFFIX_TREE_SIZES]
        spec = self.tree
        return [(spec.num_nodes, spec.children.shape[1], spec.max_depth)]

    @property
    def draft_q(self) -> bool:
        """Whether sampled rounds read the draft's q rows (drafts sampled from a draft distribution)."""
        return self.draft in ("model", *HEAD_KINDS)

    def graph_plan(self, modes=MODES) -> list[GraphSpec]:
        """Every graph :meth:`generate` can ask for under this object's settings, for the given
        sampling modes: what :meth:`warmup` builds (see :mod:`specgraph.graphset`)."""
        return plan_graph_set(self, modes)

    def warmup(self, modes=MODES, progress: bool = True, generation_config=None,
               structured_output: bool = False) -> dict[str, float]:
        """Build every graph of :meth:`graph_plan` now, so that no ``generate`` call compiles:
        any prompt length up to ``max_seq_len``, any batch up to ``max_batch_size``, the given
        modes. Sampling graphs are built for temperature-only sampling (top-k / top-p / min-p are
        baked into a sampling graph: a request with other filters builds its graph on first use,
        with a warning). ``progress``: a progress bar on stderr. ``generation_config``: build the
        rounds for requests with its logits processors instead (e.g. ``GenerationConfig(
        repetition_penalty=1.1)``: each distinct processor setting has round graphs of its own);
        ``structured_output``: with a grammar's mask (every grammar runs the same rounds).
        Returns {graph: seconds}."""
        plan = self.graph_plan(modes)
        vocab = self.vocab
        if generation_config is not None or structured_output:
            plan = with_logits(plan, self.logits_spec(generation_config, structured_output))
        width = self.min_attend if self.full_width else min(self.min_attend, self.slots - 1)
        bar = Progress(len(plan), progress, verb="building")
        seconds = {}
        with self._lock, torch.no_grad():  # as generate runs them (grad mode is part of a graph's guards)
            self._warming = True
            try:
                for g in plan:
                    bar.start(g.name)
                    t0 = time.perf_counter()
                    self._build(g, vocab, width)
                    seconds[g.name] = time.perf_counter() - t0
                    bar.advance(g.name, seconds[g.name])
            finally:
                self._warming = False
                bar.close()
            self._warm = True
        return seconds

    def _build(self, g: GraphSpec, vocab: int, width: int) -> None:
        """Run graph ``g`` once on placeholder inputs (its first call builds it)."""
        params = SamplingParams(0.0) if g.mode == "greedy" else self.default_sampling()
        if g.kind == "learned":  # a two-token generation runs the head's graphs for this batch and mode
            stats = self.stats
            ids = torch.full((g.batch, 4), 1, dtype=torch.long, device=next(self.model.parameters()).device)
            self.generate(ids, max_new_tokens=2, do_sample=g.mode == "sample")
            self.stats = stats
            return
        args, _ = example_inputs(self, g, vocab)  # with the processors' state when the round has processors
        extras = None if g.logits is None else RoundExtras(g.logits)
        if g.kind == "round":
            if self.row_by_row(g.batch, params, g.depth, extras):
                return  # the batch-1 graph, already run
            self._round_fn(g.batch, params, width, g.depth, extras)(*args, *self.kv_cache(g.batch))
        elif g.kind == "tree":
            self._tree_round_fn(g.batch, params, width, g.tree, extras)(*args, *self.kv_cache(g.batch))
        elif g.kind == "draft":
            self.draft_graph(g.batch, g.depth, params, width)(*args, *self.kv_cache(g.batch, "draft"))
        elif g.kind == "draft_tree":
            self.draft_tree_graph(g.batch, g.depth, width)(*args, *self.kv_cache(g.batch, "draft"))
        elif g.kind == "compact":
            self._compact_fn(g.batch, "draft")(*args, *self.kv_cache(g.batch, "draft"))
        else:
            raise ValueError(f"graph kind {g.kind!r} is not built by warmup")

    @property
    def min_attend(self) -> int:
        """Smallest attended cache width of a round (see MIN_ATTEND, MIN_ATTEND_CUDA)."""
        if self.full_width:  # eager attention's key length is fixed in its graph: every round attends all slots
            return self.slots
        on_cuda = next(self.model.parameters()).device.type == "cuda"
        return MIN_ATTEND_CUDA if on_cuda else MIN_ATTEND

    @property
    def width_step(self) -> int | None:
        """How attended widths grow past :attr:`min_attend`: by WIDTH_STEP slots on the CPU, by
        powers of two (None) on CUDA, where each width is a CUDA graph of its own."""
        return None if next(self.model.parameters()).device.type == "cuda" else WIDTH_STEP

    def set_depths(self, depths) -> None:
        """The chain depths model-free drafters move between (one compiled graph each): they start
        at the smallest, climb after a fully accepted round and step down after a poor one."""
        if self.draft not in ("ngram", "suffix", "custom") or self.tree is not None:
            raise ValueError("depths apply to model-free chains: draft='ngram' or 'suffix' with tree=None")
        try:
            ladder = sorted({int(d) for d in depths})
        except (TypeError, ValueError) as e:
            raise ValueError(f"depths must be positive integers, got {depths!r}") from e
        if not ladder or ladder[0] < 1:
            raise ValueError(f"depths must be positive integers, got {depths!r}")
        self.k, self.k_ladder, self.span = ladder[-1], ladder, ladder[-1] + 1

    # ------------------------------------------------------------------------------------------
    # graphs

    def _step(self, B: int, Q: int, which: str = "target", max_batch: int | None = None):
        """The captured, pass-rewritten step at batch B and query length Q. Its attention reads as
        many cache slots as its mask has columns (``attend_mask_width_pass``): one step per shape
        serves every attended width; with ``attention="block_sparse"`` each row reads only the
        blocks of those it sees (``block_sparse_attention_pass``). ``max_batch``: traced at B with a
        dynamic batch, 2 .. max_batch."""
        key = (B, Q) if which == "target" else (which, B, Q)
        if max_batch is not None:
            key = (*key, "batch<=", max_batch)
        if key not in self._steps:
            model = self.model if which == "target" else self.draft_model
            gm, counts = run_step_pipeline(capture_step(model, B, Q, self.slots, max_batch), layer_windows(model))
            if self.attention == "block_sparse":
                gm, counts["block_sparse_attention_pass"] = block_sparse_attention_pass(gm, self.slots, max_batch)
            if self.backend == "inductor":
                gm, counts["dequant_linear_pass"] = dequant_linear_pass(gm, (max_batch or B) * Q)
            self.pass_counts[key] = counts
            self._steps[key] = gm
        return self._steps[key]

    def _slot_input(self, width: int) -> torch.Tensor:
        """The attended slots 0 .. W-1 [W] long, a round's first input. W is capped at the last
        real slot (the scratch slot S - 1 is written by padding, never read by a live query). For
        Inductor its length is a dynamic dimension: one compiled graph serves every width."""
        W = self.slots if self.full_width else min(width, self.slots - 1)
        t = self._slot_inputs.get(W)
        if t is None:
            t = torch.arange(W, device=next(self.model.parameters()).device)
            if self.backend == "inductor" and not self.full_width:
                torch._dynamo.mark_dynamic(t, 0, min=2, max=self.slots - 1)
            self._slot_inputs[W] = t
        return t

    def _graph(self, key: tuple, width: int, build):
        """The callable for graph ``key`` (kind, batch, params, width, shape) at attended ``width``.

        One graph serves every width: the graph stored under ``key`` without its width (asked of a
        mapping given to :meth:`use_graphs` first, else built by ``build()``), whose first input
        is the attended slots, bound here to ``width``'s slot input."""
        shared = (*key[:3], None, *key[4:])
        bound = self._bound.get((shared, width))
        if bound is not None:
            return bound
        if shared not in self._fns:
            self._fns[shared] = build()
        fn, cols = self._fns[shared], self._slot_input(width)
        if self.attention == "block_sparse":
            def bound(*args):
                self.check_threads()
                return fn(cols, *map(_dense, args))
        else:
            def bound(*args):
                return fn(cols, *map(_dense, args))
        self._bound[(shared, width)] = bound
        return bound

    def check_threads(self) -> None:
        """Refuse to run block-sparse graphs on more threads than they were built for
        (``built_threads``, :func:`kernel_threads`): their attention kernel's scratch buffers would
        overflow."""
        if torch.get_num_threads() > self.built_threads:
            raise RuntimeError(f"torch.get_num_threads() is {torch.get_num_threads()}, above the "
                               f"{self.built_threads} threads block-sparse attention graphs are built for: "
                               "lower it (torch.set_num_threads), or compile with attention='sdpa'")

    def _compiled(self, name: str, fn, weights=None):
        """``fn`` compiled for this object's backend and device. ``weights``: the modules whose
        parameters the graph reads (default: the target model; ``()`` for weight-free graphs),
        what a frozen copy of it costs. The first call builds the graph (counted in
        :attr:`graphs_built`); after :meth:`warmup` a build inside ``generate`` warns."""
        # Dynamo caches compiled graphs on the *code object*, and every round function of every
        # compiled object shares one (a closure per shape): past torch._dynamo's recompile_limit
        # (8) shapes in a process, fullgraph compilation fails. A fresh code object per compiled
        # function gives each its own cache with one entry (and one guard check per call).
        graph = f"{fn.__code__.co_name}_{len(self._fns)}"
        fn.__code__ = fn.__code__.replace(co_name=graph)
        if self.backend == "eager":
            return self._counted(graph, fn, lambda: None)
        # freezing (prepacked weights: GEMV ~25% faster on SmolLM2), autotuning and threads: see
        # inductor_settings. Applied as a config patch around every call: torch.compile(options=...) ignores
        # "freezing", and a recompile must see the same settings as the first compile.
        device = next(self.model.parameters()).device
        low = self.weights != "float32" or (self.draft_model is not None
                                            and precision.as_given(self.draft_model) != "float32")
        config = inductor_settings(device, self.freeze, self.autotune, self.attention, low)
        self.inductor_config = dict(config)  # what every compiled graph of this object is built with

        def decide_freezing():
            # at the first call, when the graph is compiled: objects that never run a shape reserve nothing
            config["freezing"] = self.reserve_frozen_copy(graph, weights)

        if device.type != "cuda":
            compiled = torch.compile(fn, dynamic=False, fullgraph=True)

            def run(*args):
                with torch._inductor.config.patch(config):
                    return compiled(*args)

            return self._counted(graph, run, decide_freezing)
        # CUDA: one CUDA graph per compiled shape (batch bucket, depth / tree size, attended width):
        # Inductor's cudagraph trees record each graph on first use and replay it afterwards. The KV
        # caches are marked static (see _cache), so their in-place writes stay inside the graph;
        # outputs live in the graph's pool and are overwritten by the next replay, hence the clone.
        compiled = torch.compile(fn, mode="reduce-overhead", dynamic=False, fullgraph=True)

        def run_cuda(*args):
            with torch._inductor.config.patch(config):
                out = compiled(*args)
            return tuple(o.clone() for o in out) if isinstance(out, tuple) else out.clone()

        return self._counted(graph, run_cuda, decide_freezing)

    def reserve_frozen_copy(self, graph: str, weights=None) -> bool:
        """Whether graph ``graph`` may hold a frozen copy of ``weights`` (default: the target
        model's parameters): ``freeze`` is on and the process-wide budget
        (:mod:`specgraph.freezing`) has room, which this reserves. Recorded in :attr:`graph_frozen`;
        the object's first refusal warns."""
        device = next(self.model.parameters()).device
        nbytes = weight_bytes(*((self.model,) if weights is None else weights))
        frozen = self.freeze
        if self.freeze and nbytes and not FREEZE_BUDGET.reserve(device, nbytes, self._frozen_account):
            frozen = False
            if all(self.graph_frozen.values()):  # the object's first unfrozen graph
                warnings.warn(
                    f"specgraph: frozen graphs of this process already hold "
                    f"{FREEZE_BUDGET.used.get(device.type, 0) / 2**30:.1f} GB of weight copies (budget "
                    f"{FREEZE_BUDGET.limit(device) / 2**30:.1f} GB, {FREEZE_ENV} to change it); this object's "
                    f"further graphs compile without freezing (slower matmuls on CPU, no weight copy)",
                    stacklevel=3)
        self.graph_frozen[graph] = frozen
        return frozen

    def _counted(self, graph: str, run, on_build):
        """``run`` with its first call (the capture and compile) timed into :attr:`graphs_built`."""
        def first_call(*args):
            if self._warm and not self._warming:
                warnings.warn(f"specgraph: building graph {graph} inside generate: warmup() did not build it "
                              "(a shape outside the compile settings)", stacklevel=4)
            on_build()
            t0 = time.perf_counter()
            out = run(*args)
            self.graphs_built[graph] = time.perf_counter() - t0
            state["fn"] = run
            return out

        state = {"fn": first_call}
        return lambda *args: state["fn"](*args)

    def _graph_params(self, params: SamplingParams) -> SamplingParams:
        """Sampling rounds take the temperature as an input: graphs are keyed without it, and with
        no-op filters (top-k at or above the vocabulary, top-p 1, min-p 0) as None."""
        if params.greedy:
            return params
        return SamplingParams(1.0, *normalize_filters(self.vocab, params.top_k, params.top_p, params.min_p))

    @property
    def vocab(self) -> int:
        return self.model.get_output_embeddings().out_features

    def logits_spec(self, generation_config, structured_output: bool = False) -> LogitsSpec | None:
        """The logits processors requests with ``generation_config`` run (None: none), with a
        grammar (``response_format`` / ``regex`` / ``grammar``) when ``structured_output``."""
        # any prompt longer than one token: a spec does not depend on the prompt's length beyond that
        spec = None if generation_config is None else \
            resolve(self.model, torch.ones(1, 2, dtype=torch.long), generation_config, vocab=self.vocab).logits
        return with_grammar(spec) if structured_output else spec

    def default_sampling(self) -> SamplingParams:
        """The graph settings of a plain ``do_sample=True`` request on this model: its
        ``generation_config`` and transformers' defaults (top-k 50 unless the model says otherwise),
        at temperature 1 (an input). What the warmed-up and cached sampling graphs are built for."""
        ids = torch.ones(1, 1, dtype=torch.long)
        try:
            req = resolve(self.model, ids, do_sample=True, max_new_tokens=1, vocab=self.vocab)
        except (UnsupportedSetting, ValueError):  # the model's own defaults are refused: requests say why
            return SamplingParams(1.0)
        return self._graph_params(req.params)

    # ------------------------------------------------------------------------------------------
    # the engine surface a row scheduler drives (specgraph.serving): rounds, caches, prompt chunks

    def round_graph(self, B: int, params: SamplingParams, width: int, k: int, extras: "RoundExtras | None" = None):
        """The chain round of depth ``k`` at batch bucket ``B`` attending ``width`` slots (built
        on first use, else from the graph set), called as
        ``fn(root, L, active, accept_u, expo, drafts, draft_probs, [temperature,] *kv)``:
        see :meth:`_round_fn`. ``kv`` may be the first B rows of a larger cache (``t[:B]`` of
        each tensor: contiguous, so the round's writes land in it)."""
        return self._round_fn(B, params, width, k, extras)

    def round_width(self, need: int) -> int:
        """The attended width of a round whose live rows need ``need`` slots."""
        return attend_width(need, self.slots, self.min_attend, self.width_step)

    def prefill_chunk(self, kv: list[torch.Tensor], ids: torch.Tensor, start, lengths=None) -> None:
        """Write prompt tokens ids [B, C] long into ``kv`` (the rows' cache views, [B, H, slots, D]
        each): row b's token j at position ``start`` + j (``start`` an int, or a per-row [B]
        sequence), every token seeing slots 0 up to its own position. ``lengths`` [B]: row b
        writes its first lengths[b] tokens only (the rest is padding). A prompt is written chunk by
        chunk, in any number of calls, with the model's own kernels (no graph per prompt length)."""
        B, C = ids.shape
        starts = torch.as_tensor(start, dtype=torch.long, device=ids.device).expand(B)
        pos = starts.unsqueeze(1) + torch.arange(C, device=ids.device)
        if lengths is None:
            valid = torch.ones(B, C, dtype=torch.bool, device=ids.device)
        else:
            valid = torch.arange(C, device=ids.device) < torch.as_tensor(lengths, device=ids.device).view(B, 1)
        # padding writes to the view's last slot, past every position this call writes and every
        # slot these rows hold (each row holds the positions before its start)
        W = min(self.slots, int(starts.max()) + C + 1)
        prefill_logits(self._fill_step, ids, pos, valid, [t[:, :, :W] for t in kv], W, self.window)

    @property
    def packed_prefill_compiled(self) -> bool:
        """Whether :meth:`prefill_packed` runs a compiled graph (the graph cache's packed prefill
        package, ``compile(packed_prefill=True)``) rather than the eager model."""
        get = getattr(self._fns, "packed_prefill", None)
        return self.packs_prefill and get is not None and get() is not None

    def _prefill_packed_groups(self, rows: list[list[int]], kv: list[torch.Tensor]) -> None:
        """Every prompt token but the last of each row, through the packed prefill graph: rows
        packed together up to PACKED_TOKENS tokens per call (a longer prompt alone; packed
        attention costs tokens x packed width, so a call stays small), no padding."""
        groups: list[list[int]] = [[]]
        total = 0
        for b, r in enumerate(rows):
            n = len(r) - 1
            if n <= 0:
                continue
            if groups[-1] and total + n > PACKED_TOKENS:
                groups.append([])
                total = 0
            groups[-1].append(b)
            total += n
        for group in filter(None, groups):
            self.prefill_packed(kv, group, [0] * len(group),
                                [torch.tensor(rows[b][:-1], device=kv[0].device) for b in group])

    def _packed_step(self, tokens: int, width: int):
        """What runs a packed call of ``tokens`` tokens over ``width`` packed slots: the packed
        prefill graph (:attr:`packed_prefill_compiled`) when the sizes are in its range, else the
        eager model."""
        if not self.packed_prefill_compiled or tokens < 2 or tokens > self.slots or width > self.max_batch_size * self.slots:
            return self._fill_step
        return self._fns.packed_prefill()

    @property
    def packs_prefill(self) -> bool:
        """Whether :meth:`prefill_packed` applies: a model whose attention sees a cache slot by
        its mask alone (no sliding window, no ALiBi bias counted in slots)."""
        return self.window is None and layer_windows(self.model) is None and not uses_alibi(self.model)

    def prefill_packed(self, kv: list[torch.Tensor], rows: list[int], starts: list[int],
                       chunks: list[torch.Tensor], compiled: bool = True) -> None:
        """Write the prompt tokens ``chunks[i]`` (long [n_i]) of cache rows ``rows[i]`` at
        positions ``starts[i]`` on, in one call of the model with no padding: the rows' committed
        slots and new tokens are laid out one row after another in a packed cache
        (:func:`packed_layout`), a token attending its own row's segment only, and what the call
        wrote is copied back to each row. Rows of different chunk lengths would otherwise take
        a call each (every call reads all the weights) or pad to the longest. ``kv``: the cache
        tensors [B, H, slots, D]; needs :attr:`packs_prefill`. The call runs the packed prefill
        graph when it is built (:attr:`packed_prefill_compiled`), else (or with
        ``compiled=False``) the eager model."""
        if not self.packs_prefill:
            raise ValueError("packed prefill needs a model without sliding windows or ALiBi")
        device = kv[0].device
        lengths = [int(c.numel()) for c in chunks]
        pos, slot, mask, offsets = packed_layout(starts, lengths, device)
        packed = []
        for t in kv:
            p = t.new_empty(1, t.shape[1], mask.shape[-1], t.shape[3])
            for r, o, s0 in zip(rows, offsets, starts):
                p[0, :, o: o + s0] = t[r, :, :s0]
            packed.append(p)
        ids = torch.cat([c.to(device) for c in chunks]).view(1, -1)
        step = self._packed_step(*mask.shape[-2:]) if compiled else self._fill_step
        step(ids, pos, mask.to(kv[0].dtype), slot, *packed)
        for t, p in zip(kv, packed):
            for r, o, s0, n in zip(rows, offsets, starts, lengths):
                t[r, :, s0: s0 + n] = p[0, :, o + s0: o + s0 + n]

    def _key_params(self, params: SamplingParams, extras: "RoundExtras | None") -> object:
        """A round graph's settings slot in its key: the graph's sampling settings, paired with the
        round's extras (logits processors, score outputs) when it has any."""
        params = self._graph_params(params)
        return params if extras is None or not extras.any else (params, extras)

    def row_by_row(self, B: int, params: SamplingParams, k: int, extras: "RoundExtras | None" = None) -> bool:
        """Whether the chain round of bucket ``B`` at depth ``k`` runs as B rounds of one row on the
        batch-1 graph (a :meth:`use_graphs` mapping answers it so while its own graph is still being
        built: :class:`specgraph.graphcache.RowSplit`)."""
        key = ("round", B, self._key_params(params, extras), None, k)
        return key in self._fns and getattr(self._fns[key], "row_by_row", False)

    def _round_fn(self, B: int, params: SamplingParams, width: int, k: int, extras: "RoundExtras | None" = None):
        """One verification round over k given drafts (k = 0: a plain decoding step), attending
        ``width`` cache slots. Greedy: ``fn(root, L, active, accept_u, expo, drafts, draft_probs, *kv)``;
        sampling takes a ``temperature`` [B] float32 after ``draft_probs``; with logits processors
        (``extras.logits``) the processor state (seq [B, 2S], meta [B, 4]) comes next. Returns
        (tokens [B, k+1], n [B]), then with ``extras.scores`` the processed and raw logits [B, k+1, V]."""
        key = self._key_params(params, extras)
        return self._graph(("round", B, key, width, k), width, lambda: self._build_round(B, params, k, extras))

    def _build_round(self, B: int, params: SamplingParams, k: int, extras=None):
        return self._compiled("round", self.round_function(B, self._graph_params(params), k, extras))

    def round_function(self, B: int, params: SamplingParams, k: int, extras: "RoundExtras | None" = None,
                       max_batch: int | None = None, greedy_rows: bool = False):
        """The uncompiled chain round of :meth:`_round_fn` (:func:`chain_round` around this
        object's captured step), taking the attended slots [W] (or an int width: a graph for that
        width only) first. ``max_batch``: its step has a dynamic batch (2 .. max_batch, traced at
        B): for ``torch.export`` with a batch dimension. ``greedy_rows`` (sampling ``params``,
        deterministic drafts, no extras): the sampling round in which a row whose temperature is 0
        is verified greedily (:func:`verify_chain_rows`), so one graph serves greedy and sampled
        rows."""
        if greedy_rows and (params.greedy or self.draft_q or extras is not None or self.learned is not None):
            raise ValueError("greedy_rows= is for sampling rounds of deterministic drafts without extras")
        return chain_round(self._step(B, k + 1, max_batch=max_batch), k, self.slots, self.window, params,
                           use_q=self.draft_q and not params.greedy and k > 0,
                           spec=None if extras is None else extras.logits,
                           want_scores=extras is not None and extras.scores,
                           top_n=-1 if extras is None else extras.logprobs,
                           with_features=self.learned is not None, greedy_rows=greedy_rows)

    def _tree_round_fn(self, B: int, params: SamplingParams, width: int, shape: tuple[int, int, int],
                       extras: "RoundExtras | None" = None):
        """One verification round over a token tree of the compiled ``shape`` (N nodes, at most C
        children per node, depth at most D), with the tree's topology an input (``parents``), then
        KV compaction of the accepted path, all in one graph. Greedy:
        ``fn(root, L, active, accept_u, expo, tree_tokens, parents, *kv)``; sampling takes a
        ``temperature`` [B] float32 after ``parents``, processors their state next (see
        :meth:`_round_fn`). Returns (path tokens, n, path nodes), then with ``extras.scores`` the
        processed and raw logits along the path [B, D+1, V]."""
        key = self._key_params(params, extras)
        return self._graph(("tree", B, key, width, shape), width,
                           lambda: self._build_tree_round(B, params, shape, extras))

    def _build_tree_round(self, B: int, params: SamplingParams, shape: tuple[int, int, int], extras=None):
        return self._compiled("tree_round", self.tree_round_function(B, self._graph_params(params), shape, extras))

    def tree_round_function(self, B: int, params: SamplingParams, shape: tuple[int, int, int],
                            extras: "RoundExtras | None" = None, max_batch: int | None = None):
        """The uncompiled tree round of :meth:`_tree_round_fn` (:func:`tree_round` around this
        object's captured step), taking the attended slots [W] (or an int width) first.
        ``max_batch``: as :meth:`round_function`."""
        return tree_round(self._step(B, shape[0], max_batch=max_batch), shape, self.slots, self.window, params,
                          spec=None if extras is None else extras.logits,
                          want_scores=extras is not None and extras.scores,
                          top_n=-1 if extras is None else extras.logprobs,
                          with_features=self.learned is not None)

    def _compact_fn(self, B: int, which: str):
        key = ("compact", which, B)
        if key not in self._fns:
            S = self.slots

            def compact_fn(L, path_nodes, n, active, *kv):
                compact_path(kv, L, path_nodes, n, active, S - 1)
                return n

            self._fns[key] = self._compiled("compact", compact_fn, weights=())
        return self._fns[key]

    def draft_tree_graph(self, B: int, d: int, width: int):
        """Draft-model expansion of tree level d: feed the nodes at depth d that have children
        (at d = 0 also the previous token, as the chain's first draft step does), return the
        draft's top-R tokens at each fed node [B, Q_d, R]. Children are picked deterministically
        (top-k by rank), so verification treats them with recursive rejection: lossless."""
        return self._graph(("draft_tree", B, None, width, d), width, lambda: self._build_draft_tree(B, d))

    def _build_draft_tree(self, B: int, d: int):
        S, window, spec = self.slots, self.draft_window, self.tree
        fed = self.tree_levels[d]
        R = max(self.tree_rank) + 1
        Q = len(fed) + (1 if d == 0 else 0)
        step = self._step(B, Q, which="draft")
        fed_t = torch.tensor(fed)
        anc_fed = spec.ancestors[fed_t]  # [Qd, N]

        def draft_tree_fn(cols, tree_tokens, prev, L, active, *kv):
            # cols [W] attended slots, tree_tokens [B, N] (column 0 = root), prev [B] token at position L - 1
            dev = L.device
            Lc = L.unsqueeze(1)
            ids = tree_tokens[:, fed_t.to(dev)]
            pos = Lc + d
            slots = Lc + fed_t.to(dev)
            anc = anc_fed.to(dev).unsqueeze(0).expand(B, len(fed), spec.num_nodes)
            valid = active.unsqueeze(1).expand(B, len(fed))
            mask = tree_mask(L, pos.expand(B, len(fed)), anc, valid, cols, window)
            if d == 0:  # the previous token, at position / slot L - 1, sees the committed prefix
                pv = active & (L >= 1)
                prev_mask = step_mask((L - 1).clamp_min(0), (L - 1).clamp_min(0).unsqueeze(1), pv.unsqueeze(1), cols, window)
                ids = torch.cat([prev.unsqueeze(1), ids], dim=1)
                pos = torch.cat([(Lc - 1).clamp_min(0), pos.expand(B, len(fed))], dim=1)
                slots = torch.cat([torch.where(pv.unsqueeze(1), Lc - 1, S - 1), slots], dim=1)
                valid = torch.cat([pv.unsqueeze(1), valid], dim=1)
                mask = torch.cat([prev_mask, mask], dim=2)
            else:
                pos = pos.expand(B, len(fed))
            slots = torch.where(valid, slots, S - 1)
            logits, _ = step(ids, pos, mask.to(kv[0].dtype), slots, *kv)
            return logits[:, Q - len(fed):].topk(R, dim=-1).indices  # [B, Qd, R]

        return self._compiled("draft_tree", draft_tree_fn, weights=(self.draft_model,))

    @property
    def tree_levels(self) -> list[list[int]]:
        """Per depth d < D, the nodes at depth d that have children (what the draft must feed)."""
        spec = self.tree
        has_kids = (spec.children[:, 0] >= 0).tolist()
        depth = spec.depth.tolist()
        return [[i for i in range(spec.num_nodes) if depth[i] == d and has_kids[i]] for d in range(spec.max_depth)]

    def kv_cache(self, B: int, which: str = "target") -> list[torch.Tensor]:
        """The KV cache of batch bucket B, the target's or (``which="draft"``) the draft model's: 2 x
        layers tensors [B, kv heads, slots, head dim]; slot ``slots - 1`` is the scratch slot
        inactive rows write to. On the CPU every bucket is a view of the first B rows of the
        largest bucket's cache (one allocation: the loop prefills a row before it reads it); on
        CUDA each bucket has its own tensors, at addresses fixed for its recorded graphs."""
        key = (which, B)
        if key not in self._kv:
            model = self.model if which == "target" else self.draft_model
            on_cuda = next(model.parameters()).is_cuda
            if on_cuda or B >= self.max_batch_size:
                self._kv[key] = new_kv_cache(model, B, self.slots)
            else:
                self._kv[key] = [t[:B] for t in self.kv_cache(self.max_batch_size, which)]
            if on_cuda and self.backend == "inductor":
                for t in self._kv[key]:  # fixed addresses: mutated inside recorded CUDA graphs
                    torch._dynamo.mark_static_address(t)
        return self._kv[key]

    def draft_graph(self, B: int, Q: int, params: SamplingParams, width: int, spec: LogitsSpec | None = None):
        """One draft-model step: feed Q tokens ending at position ``last``, propose the next token.

        The first step of a round feeds (previous token, root) so the draft cache catches up on the
        token it never saw when every draft of the last round was accepted (re-writing a slot that
        already holds the same K/V is harmless); later steps feed the previous draft token.

        With logits processors (``spec``) the draft's logits go through them too, with the prefix the
        drafted token assumes (``fn(tokens, last, active, expo, seq, meta, path [B, 1, K], depth
        [B, 1], *kv)``): drafts the target's processors would forbid are not proposed. Verification
        is exact either way; this raises acceptance.
        """
        key = params if spec is None else (params, RoundExtras(spec))
        return self._graph(("draft", B, key, width, Q), width, lambda: self._build_draft(B, Q, params, spec))

    def _build_draft(self, B: int, Q: int, params: SamplingParams, spec: LogitsSpec | None = None):
        S, window = self.slots, self.draft_window
        step = self._step(B, Q, which="draft")
        n_proc = 0 if spec is None else 4

        def draft_fn(cols, tokens, last, active, expo, *rest):
            # cols [W] attended slots, tokens [B, Q], last [B] position of the last fed token, expo [B, V] Exp(1) draws
            proc, kv = rest[:n_proc], rest[n_proc:]
            logits = draft_logits(step, tokens, last, active, kv, S, cols, window)
            if spec is not None:  # the drafted token's prefix: committed (root at last - depth) + drafts so far
                seq, meta, path, depth = proc
                logits = process_logits(spec, logits.unsqueeze(1), seq, meta, last - depth[:, 0], path, depth)[:, 0]
            if params.greedy:
                return logits.argmax(dim=-1), logits
            q = warped_probs(logits, params.temperature, params.top_k, params.top_p, params.min_p)
            return (q / expo).argmax(dim=-1), q

        return self._compiled("draft", draft_fn, weights=(self.draft_model,))

    # ------------------------------------------------------------------------------------------
    # generation

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor | None = None,  # [B, T] long, left-padded batches via attention_mask
        attention_mask: torch.Tensor | None = None,  # [B, T]
        generation_config=None,
        *,
        inputs: torch.Tensor | None = None,  # model.generate's name for input_ids
        logits_processor=None,
        stopping_criteria=None,
        streamer=None,
        generator: torch.Generator | None = None,
        tokenizer=None,
        output_logprobs: int | None = None,
        response_format=None,
        regex: str | None = None,
        grammar: str | None = None,
        **kwargs,
    ):
        """Same contract as ``model.generate``: the model's ``generation_config``, then a passed
        ``GenerationConfig``, then keyword arguments (``max_new_tokens``, ``do_sample``,
        ``repetition_penalty``, ...), resolved by transformers' own rules; a setting specgraph
        cannot honour exactly raises :class:`specgraph.generation.UnsupportedSetting`. Returns
        prompt + new tokens [B, T + n], rows padded with ``pad_token_id`` after their end (or
        transformers' ``GenerateDecoderOnlyOutput`` with ``return_dict_in_generate=True``).
        ``output_logprobs=n`` (n >= 0, an addition for serving): the output also carries each
        emitted token's log-probability and the top-n of its position
        (:class:`specgraph.generation.SpecGenerateOutput`), computed inside the round.

        Structured output (additions, with ``tokenizer=``): ``response_format`` (OpenAI's
        ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}`` or
        ``{"type": "json_object"}``), ``regex`` or ``grammar`` (EBNF) constrain every row; the
        grammar's mask is applied inside exact verification (:mod:`specgraph.grammar`), so the
        output follows the target's masked, renormalised law."""
        if (input_ids is None) == (inputs is None):
            raise ValueError("pass the prompt token ids as input_ids (or inputs, as model.generate names them), once")
        input_ids = input_ids if input_ids is not None else inputs
        req = resolve(self.model, input_ids, generation_config, logits_processor=logits_processor,
                      stopping_criteria=stopping_criteria, tokenizer=tokenizer, vocab=self.vocab, **kwargs)
        if output_logprobs is not None:
            if isinstance(output_logprobs, bool) or not isinstance(output_logprobs, int) or output_logprobs < 0:
                raise ValueError(f"output_logprobs must be an int >= 0 (top-n), got {output_logprobs!r}")
            req = dataclasses.replace(req, return_dict=True, logprobs=output_logprobs)
        constraint = grammar_spec(response_format, regex, grammar)
        if constraint is not None:
            req = dataclasses.replace(req, logits=with_grammar(req.logits),
                                      grammar=compile_grammar(constraint, tokenizer, self.vocab, req.eos))
        if req.num_return_sequences > 1:
            input_ids = input_ids.repeat_interleave(req.num_return_sequences, dim=0)
            if attention_mask is not None:
                attention_mask = attention_mask.repeat_interleave(req.num_return_sequences, dim=0)
        attention_mask = inferred_attention_mask(input_ids, attention_mask, req)
        rows = self._rows(input_ids, attention_mask, req.max_new_tokens)
        if self.fallback_reason is not None and (req.logits or req.stopping or req.return_dict or req.max_time):
            what = (req.logits.names() if req.logits else []) + ["stopping criteria"] * bool(req.stopping) + \
                ["max_time"] * bool(req.max_time) + ["scores / log-probabilities"] * bool(req.return_dict)
            raise UnsupportedSetting(f"{', '.join(what)} need the compiled engine, and this model runs on the "
                                     f"eager fallback ({self.fallback_reason})")
        stream = None if streamer is None else StepStreamer(streamer, input_ids, len(rows), req.pad_token_id)
        with one_call(self):  # concurrent calls on one object share its KV caches: one at a time
            self.stats = Stats()  # per call
            if self.fallback_reason is not None:
                new, scores = self._generate_eager(rows, req, generator, stream), None
            else:
                self.refresh_graphs()
                new, scores = self._generate_compiled(rows, req, generator, stream, input_ids, attention_mask)
                self.proposer.finish(rows, new)
        sequences = assemble_output(input_ids, new, req.pad_token_id)
        return sequences if not req.return_dict else scores.output(sequences, req)

    def _rows(self, input_ids, attention_mask, max_new_tokens) -> list[list[int]]:
        if input_ids.dim() == 2 and input_ids.shape[0] > self.max_batch_size:
            raise ValueError(f"batch size {input_ids.shape[0]} exceeds max_batch_size={self.max_batch_size}; "
                             "pass a larger max_batch_size to specgraph.compile")
        rows = prompt_rows(input_ids, attention_mask, max_new_tokens, self.vocab)
        for r in rows:
            need = len(r) + max_new_tokens + self.span
            if need > self.max_seq_len:
                raise ValueError(
                    f"prompt length {len(r)} + max_new_tokens {max_new_tokens} + {self.span} speculative slots "
                    f"= {need} exceeds max_seq_len={self.max_seq_len}; pass a larger max_seq_len to specgraph.compile"
                )
        return rows

    def _generate_eager(self, rows, req: GenerationRequest, generator, stream):
        from specgraph.eager import eager_generate_ngram

        new, params = [], req.params
        for r in rows:
            ids = torch.tensor([r], device=next(self.model.parameters()).device)
            out, st = eager_generate_ngram(
                self.model, ids, max_new_tokens=req.max_new_tokens, num_speculative_tokens=max(self.k, 1),
                temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, min_p=params.min_p,
                eos_token_id=list(req.eos), generator=generator,
            )
            new.append(out[0, len(r):].tolist())
            self.stats.rounds += st.rounds
            self.stats.emitted += st.emitted
        if stream is not None:
            stream.advance(new, [True] * len(new))
            stream.end()
        return new

    def _processor_state(self, input_ids, attention_mask, rows, req: GenerationRequest, B: int, device):
        """(seq [B, 2S] long: each row as generate sees it, the input row (padding tokens included)
        first; meta [B, 4] long: masked prompt tokens, padded prompt length T, max_length, leading
        masked tokens) -- see :mod:`specgraph.processors`."""
        S, T = self.slots, input_ids.shape[1]
        seq = torch.full((B, 2 * S), req.pad_token_id, dtype=torch.long)
        meta = torch.zeros(B, 4, dtype=torch.long)
        seq[: len(rows), :T] = input_ids.cpu()
        for b, r in enumerate(rows):
            lead = 0 if attention_mask is None else int((attention_mask[b] != 0).int().argmax())
            meta[b] = torch.tensor([T - len(r), T, req.max_length, lead])
        return seq.to(device), meta.to(device)

    def _generate_compiled(self, rows, req: GenerationRequest, generator, stream, input_ids, attention_mask):
        device = next(self.model.parameters()).device
        params, eos, max_new_tokens = req.params, req.eos, req.max_new_tokens
        n_rows = len(rows)
        B = _bucket(n_rows, self.max_batch_size)
        S = self.slots
        kv = self.kv_cache(B)
        start = time.perf_counter()
        # the logits processors' view of each row (padding included), and what the host checks stop on
        proc = () if req.logits is None else self._processor_state(input_ids, attention_mask, rows, req, B, device)
        # a draft model's proposals go through the processors too (not the grammar: its masks are per round)
        draft_spec = None if req.logits is None else dataclasses.replace(req.logits, grammar=False)
        self.draft_processors = (draft_spec, proc) if draft_spec is not None and draft_spec.names() else (None, ())
        grammar = None if req.grammar is None else GrammarRows(req.grammar, n_rows, device,
                                                               force_drafts=self.draft in ("ngram", "suffix", "custom"))
        padded = input_ids.tolist()  # the rows as stopping criteria see them
        score_log = ScoreLog(n_rows, req) if req.return_dict else None
        extras = RoundExtras(req.logits, req.return_dict and (req.output_scores or req.output_logits), req.logprobs)
        prefilled = self.prefill_rows(B, rows, kv, device, "target")
        # a head drafter's first feed (and its cache) comes from the prompt's features
        self.proposer.start(CallStart(rows, B, device, None if prefilled is None else prefilled[1]))
        state = CallRows.start(rows, B, S, device)

        def stop(b, emitted, room):  # the request's stops, on the row as stopping criteria see it
            return stop_at(emitted, room, eos, req.stopping, padded[b] + state.new[b], start, req.max_time)
        depth = self.policy if self.policy is not None else LadderDepth(self.k_ladder)
        depth.start(self, rows, B, device)
        rounds = CompiledRounds(self, B, params, kv, proc, extras, score_log, generator)
        decode(state, self.proposer, rounds, depth, params=params, generator=generator, vocab=self.vocab,
               trees=self.tree is not None, max_new_tokens=max_new_tokens, eos=eos, stop=stop, stats=self.stats,
               stream=stream, grammar=grammar)
        if stream is not None:
            stream.advance(state.new, [True] * n_rows)
            stream.end()
        self.stats.seconds += time.perf_counter() - start
        return state.new, score_log

    def prefill_rows(self, B, rows, kv, device, which):
        """Write every prompt token but the last (the first root) into the cache.

        Runs the unmodified model eagerly through :class:`specgraph.capture.Step` with the same
        tensor-backed cache: one call for any prompt length, no compile per prompt shape, and the
        same kernels HF's own prefill uses (or the target's prefill graph given to
        :meth:`use_graphs`). Padding positions write to slot P, one past the prompts' (the eager step
        attends slots 0..P only). Returns the target's
        (logits, final features) when a head drafter needs the features, else None.
        """
        P = max(len(r) for r in rows) - 1
        if P <= 0:
            return None
        ids = torch.zeros(B, P, dtype=torch.long)
        valid = torch.zeros(B, P, dtype=torch.bool)
        for b, r in enumerate(rows):
            ids[b, : len(r) - 1] = torch.tensor(r[:-1])
            valid[b, : len(r) - 1] = True
        ids, valid = ids.to(device), valid.to(device)
        pos = torch.arange(P, device=device).expand(B, P).contiguous()
        if which == "target" and self._prefill_graph is not None:
            self._prefill_graph(ids, pos, valid, *kv)
            return None
        if which == "target" and self.learned is None and self.packed_prefill_compiled:
            self._prefill_packed_groups(rows, kv)
            return None
        # the eager step attends the prompt's slots and one past them, where its padding columns
        # write (no row has committed it: every row starts over here, and a round writes a slot
        # before reading it), not the whole cache: 2048 slots by default for a ~100-token prompt
        W = min(self.slots, P + 1)
        part = [t[:, :, :W] for t in kv]
        if which == "target" and self.learned is not None:
            return prefill_logits(self._eager_step, ids, pos, valid, part, W, self.window, hidden=True)
        if which == "target":
            prefill_logits(self._fill_step, ids, pos, valid, part, W, self.window)
        else:
            prefill_logits(self._eager_draft_step, ids, pos, valid, part, W, self.draft_window)
        return None


def _mask(allowed) -> tuple:
    """A round's grammar input: the positions' bitmask when the request has a grammar."""
    return () if allowed is None else (allowed,)


class CompiledRounds:
    """The round graphs of one ``generate`` call on a compiled object (Inductor graphs or
    AOTInductor packages), as :func:`specgraph.loop.decode` runs them: batch bucket ``B``, the
    call's sampling ``params``, its cache ``kv``, the logits processors' row state ``proc`` and
    the outputs the request asked for (``extras``, collected in ``score_log``)."""

    def __init__(self, fast: SpecGraphModel, B: int, params: SamplingParams, kv, proc, extras: RoundExtras,
                 score_log: ScoreLog | None, generator):
        self.fast, self.B, self.params, self.kv, self.proc = fast, B, params, kv, proc
        self.extras, self.score_log, self.generator = extras, score_log, generator
        self.device = kv[0].device
        self.temp = () if params.greedy else (torch.full((B,), params.temperature, device=self.device),)

    def width(self, state: CallRows) -> int:
        f = self.fast
        return attend_width(state.need(f.span), f.slots, f.min_attend, f.width_step)

    def chain(self, view: RoundView, chain: ChainProposal) -> RoundResult:
        B, k, dev = self.B, chain.k, self.device
        if self.params.greedy:
            accept_u, expo = torch.zeros(B, k, device=dev), torch.ones(B, k + 1, 1, device=dev)
        else:
            accept_u, expo = chain_noise(B, k, view.vocab, dev, self.generator)
        round_fn = self.fast._round_fn(B, self.params, view.width, k, self.extras)
        q = accept_u if chain.probs is None else chain.probs
        tokens, n, *rest = round_fn(view.root, view.L, view.active, accept_u, expo, chain.drafts, q,
                                    *self.temp, *self.proc, *_mask(chain.allowed), *self.kv)
        return self._result(tokens, n, rest)

    def tree(self, view: RoundView, tree: TreeProposal) -> RoundResult:
        B, (N, C, _), dev, f = self.B, tree.shape, self.device, self.fast
        if self.params.greedy:
            accept_u, expo = torch.zeros(B, N, C, device=dev), torch.ones(B, N, 1, device=dev)
        else:
            accept_u, expo = tree_noise(B, N, C, view.vocab, dev, self.generator)
        round_fn = f._tree_round_fn(B, self.params, view.width, tree.shape, self.extras)
        tokens, n, path_nodes, *rest = round_fn(view.root, view.L, view.active, accept_u, expo, tree.tokens,
                                                tree.parents, *self.temp, *self.proc, *_mask(tree.allowed),
                                                *self.kv)
        if f.draft == "model":  # the draft cache holds the fed tree nodes at their tree slots too
            f._compact_fn(B, "draft")(view.L, path_nodes, n, view.active, *f.kv_cache(B, "draft"))
        return self._result(tokens, n, rest)

    def _result(self, tokens, n, rest) -> RoundResult:
        """The round's outputs after (tokens, n): scores (2), log-probabilities (3), the head's feed."""
        scores, rest = (rest[:2], rest[2:]) if self.extras.scores else (None, rest)
        logprobs, rest = (rest[:3], rest[3:]) if self.extras.logprobs >= 0 else (None, rest)
        hidden = rest[0] if self.fast.learned is not None else None
        return RoundResult(tokens, n, hidden, (scores, logprobs))

    def record(self, result: RoundResult, state: CallRows, kept: list[list[int]], adv: list[int]) -> None:
        """The kept tokens' scores and log-probabilities into the call's log; the logits
        processors' view of each row grows by the tokens it keeps."""
        scores, logprobs = result.extra
        if self.score_log is not None:
            for b, keep in enumerate(kept):
                if not keep:
                    continue
                if scores is not None:
                    self.score_log.add(b, scores[0][b, :len(keep)].cpu(), scores[1][b, :len(keep)].cpu())
                if logprobs is not None:
                    self.score_log.add_logprobs(b, *(t[b, :len(keep)].cpu() for t in logprobs))
        if self.proc:
            seq, meta = self.proc
            S = self.fast.slots
            pos, write = advanced_slots(state.L, result.tokens, torch.tensor(adv, device=self.device))
            ppos = torch.where(write, pos + meta[:, :1], 2 * S - 1)
            seq.scatter_(1, ppos, torch.where(write, result.tokens, seq[:, 2 * S - 1:]))
