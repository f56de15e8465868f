"""Drafters built from the target itself: model-free drafters that run as tensor ops (on the device
that holds the history; prompt lookup itself is :mod:`specgraph.lookup`), the target's first
layers (:func:`layer_skip`) and its own weights at int4 (:func:`self_int4`)."""
from __future__ import annotations

import itertools

import torch

from specgraph.lookup import ngram_propose, ngram_tree_propose  # noqa: F401 - public here too
from specgraph.precision import quantize


def _decoder_layers_path(model, total: int) -> str:
    """Dotted name of the model's decoder-layer list: the one ``ModuleList`` with one entry per
    layer (``model.layers`` for Llama-likes, ``transformer.h`` for GPT-2, ``model.decoder.layers``
    for OPT, ``gpt_neox.layers``, ...)."""
    found = [name for name, m in model.named_modules()
             if isinstance(m, torch.nn.ModuleList) and len(m) == total and name]
    if len(found) != 1:
        raise ValueError(
            f"layer_skip: cannot tell which module list of {type(model).__name__} holds its {total} decoder layers "
            f"(candidates: {found or 'none'})")
    return found[0]


def layer_skip(model, num_layers: int | None = None):
    """The target's first ``num_layers`` decoder layers + its final norm + its LM head, as a draft
    model for ``specgraph.compile(model, draft=layer_skip(model, L))`` (``draft="layerskip"`` uses
    the default L).

    No weight is copied: the result is a shallow clone whose modules on the path to the layer list
    are new objects (so the target keeps all its layers) while every parameter tensor is the
    target's own. Its config is a copy with ``num_hidden_layers = L`` (and ``layer_types``
    truncated), so the compiler allocates an L-layer draft cache and captures an L-layer step. The
    draft keeps its own KV cache; the first L layers' K/V equal the target's at committed
    positions, but sharing them would need the draft step to write into the target's cache
    tensors, which the separate draft-model path does not do.

    Default L = max(1, num_hidden_layers // 4): early exits from a quarter of the network are
    cheap (a round's K draft steps cost about K/4 target steps) and, on pretrained models, agree
    with the full model on easy tokens; untrained models gain little. L = num_hidden_layers gives
    a draft equal to the target (every draft accepted: a self-check, not a speed-up).
    """
    import copy

    cfg = model.config.get_text_config(decoder=True)
    total = getattr(cfg, "num_hidden_layers", None)
    if not total:
        raise ValueError(f"layer_skip: {type(model).__name__}'s config has no num_hidden_layers")
    if num_layers is None:
        num_layers = max(1, total // 4)
    if not isinstance(num_layers, int) or isinstance(num_layers, bool) or not 1 <= num_layers <= total:
        raise ValueError(f"layer_skip: num_layers must be an int in 1..{total}, got {num_layers!r}")
    path = _decoder_layers_path(model, total).split(".")
    new_config = copy.deepcopy(model.config)
    new_text = new_config.get_text_config(decoder=True)
    new_text.num_hidden_layers = num_layers
    if getattr(new_text, "layer_types", None):
        new_text.layer_types = list(new_text.layer_types)[:num_layers]

    def clone(module):
        # a new module object with its own child table; parameters and buffers stay shared
        c = copy.copy(module)
        c._modules = dict(module._modules)
        if getattr(module, "config", None) is model.config:
            c.config = new_config
        elif getattr(module, "config", None) is cfg:
            c.config = new_text
        return c

    root = clone(model)
    parent = root
    for name in path[:-1]:
        child = clone(parent._modules[name])
        parent._modules[name] = child
        parent = child
    parent._modules[path[-1]] = torch.nn.ModuleList(list(parent._modules[path[-1]])[:num_layers])
    try:
        root._specgraph_fingerprint = None  # a cached fingerprint of the target does not describe this draft
    except Exception:  # noqa: BLE001
        pass
    return root


# ----------------------------------------------------------------------------------------------
# host-side chain drafters (a protocol), and the replay drafter for benchmarks


class ChainDrafter:
    """A drafter object for ``specgraph.compile(model, draft=obj)`` that proposes chains: the
    compiled round verifies them like prompt-lookup drafts (deterministic proposals: the output law
    stays the target's). Subclasses implement :meth:`start` (once per ``generate`` call) and
    :meth:`propose` (once per round, with tensor ops on the history's device so a round needs no
    extra host sync)."""

    def start(self, rows: list[list[int]], batch: int, device) -> None:
        """A new ``generate`` call: ``rows`` are the unpadded prompts (``batch`` >= len(rows) rows are
        compiled; the extra rows are inactive)."""

    def propose(self, hist: torch.Tensor, L: torch.Tensor, k: int, active: torch.Tensor) -> torch.Tensor | None:
        """Drafts [B, k] long for the positions after each row's root, or None for no drafts this
        round (a plain step). hist [B, S] long holds positions 0..L[b] of row b (L[b] = the root),
        active [B] bool."""
        raise NotImplementedError


def replay_corruption(seed: int, row: int, length: int, beta: float) -> tuple[torch.Tensor, torch.Generator]:
    """([length] bool: where :class:`ReplayDrafter` corrupts row ``row``'s continuation under replay
    seed ``seed``, P = 1 - β, never at β = 1; the generator, left where the replacement tokens are
    drawn). The benchmark's simulator replays these masks without a model."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + row)
    return torch.rand(length, generator=g) >= beta, g


class ReplayDrafter(ChainDrafter):
    """Benchmark drafter with a set acceptance rate β: it proposes the target's own greedy
    continuation of each prompt (computed once, e.g. by :meth:`from_model` with HF ``generate``),
    each token corrupted into a different one with probability 1 - β. Under greedy decoding a draft
    is accepted exactly when it is uncorrupted and all before it were, so acceptance per position is
    i.i.d. β whatever the depth: the corruption of position t of row b is drawn once per ``generate``
    call (seeded: ``seed`` and the row index) and does not depend on which rounds draft it.
    ``seed`` is read at each call's start: set it between calls to draw new corruptions (one seed
    for every call replays the same few draws per row, a sample too small to stand for β).

    ``continuations``: {prompt token tuple: greedy continuation token list}. Prompts must be known;
    past the end of a continuation the drafts repeat the root (rejected)."""

    def __init__(self, continuations, beta: float, vocab_size: int, seed: int = 0):
        if not 0.0 <= beta <= 1.0:
            raise ValueError(f"beta must be in [0, 1], got {beta}")
        if vocab_size < 2:
            raise ValueError("a replay drafter needs a vocabulary of at least 2 tokens to corrupt a draft")
        self.continuations = {tuple(int(t) for t in p): [int(t) for t in c] for p, c in dict(continuations).items()}
        self.beta, self.vocab_size, self.seed = float(beta), int(vocab_size), int(seed)
        self._cont = self._plen = None

    @classmethod
    @torch.no_grad()
    def from_model(cls, model, prompts, max_new_tokens: int, beta: float, seed: int = 0, eos_token_id=None):
        """Greedy continuations of ``prompts`` (lists of token ids) by ``model.generate``, one prompt
        at a time (no padding), ``max_new_tokens`` each; EOS as ``model.generate`` defaults unless
        given (``[]`` disables it)."""
        device = next(model.parameters()).device
        kw = {} if eos_token_id is None else {"eos_token_id": eos_token_id}
        pad = model.generation_config.pad_token_id
        pad = pad if pad is not None else 0
        conts = {}
        for p in prompts:
            ids = torch.tensor([list(p)], device=device)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=pad, **kw)
            conts[tuple(int(t) for t in p)] = out[0, ids.shape[1]:].tolist()
        V = model.get_output_embeddings().out_features
        return cls(conts, beta, V, seed)

    def start(self, rows, batch, device) -> None:
        missing = [b for b, r in enumerate(rows) if tuple(r) not in self.continuations]
        if missing:
            raise ValueError(f"ReplayDrafter has no continuation for the prompt of row(s) {missing}: build it with "
                             "ReplayDrafter.from_model(model, prompts, ...) over the prompts you generate from")
        T = max(len(self.continuations[tuple(r)]) for r in rows) + 1
        cont = torch.full((batch, T), -1, dtype=torch.long)
        plen = torch.ones(batch, dtype=torch.long)
        for b, r in enumerate(rows):
            c = self.continuations[tuple(r)]
            bad, g = replay_corruption(self.seed, b, len(c), self.beta)
            true = torch.tensor(c, dtype=torch.long)
            other = (true + 1 + torch.randint(0, self.vocab_size - 1, (len(c),), generator=g)) % self.vocab_size
            cont[b, : len(c)] = torch.where(bad, other, true)
            plen[b] = len(r)
        self._cont, self._plen = cont.to(device), plen.to(device)

    def propose(self, hist, L, k, active):
        # continuation index of position L + 1 + j is L + 1 - prompt_len + j
        idx = (L + 1 - self._plen).unsqueeze(1) + torch.arange(k, device=L.device)  # [B, k]
        T = self._cont.shape[1]
        tok = self._cont.gather(1, idx.clamp(0, T - 1))
        root = hist.gather(1, L.unsqueeze(1))  # [B, 1]
        return torch.where((idx < T) & (tok >= 0), tok, root)


def self_int4(model, target=None):
    """``model``'s own weights at int4 (:func:`specgraph.precision.quantize`), as a draft model for
    ``target``, the same model at a higher precision (``compile(model, draft="self-int4")``).
    Its linear layers read an int4 copy (an eighth of fp32's bytes); every other tensor (the
    embedding, the norms) is ``target``'s own where ``target`` has it under the same name,
    shape and dtype, so the drafter adds only its int4 layers to the object's memory."""
    if target is None:
        target = model
    theirs = dict(itertools.chain(target.named_parameters(remove_duplicate=False),
                                  target.named_buffers(remove_duplicate=False)))
    shared = {}
    for name, t in itertools.chain(model.named_parameters(remove_duplicate=False),
                                   model.named_buffers(remove_duplicate=False)):
        other = theirs.get(name)
        if other is not None and other.shape == t.shape and other.dtype == t.dtype:
            shared[id(t)] = other
    return quantize(model, "int4", shared=shared)
