"""Hugging Face's built-in logits processors, applied along drafted paths as tensor ops.

``model.generate`` runs its processors on one position at a time, with ``input_ids`` the whole
sequence so far. A verification round scores many positions at once: the K+1 positions of a chain
or the N nodes of a tree. Position q assumes a prefix of its own: the committed tokens plus the
drafted path to q. :func:`process_logits` applies every processor to every position with *that*
prefix, so a history-dependent processor (repetition penalty, no-repeat n-gram, bad words,
minimum lengths) sees exactly what ``generate`` would show it had the drafts been its own tokens:
greedy verification then takes the processed argmax and sampled verification the processed law.

Everything is static-shaped tensor work with the settings baked in (:class:`LogitsSpec` is
hashable and keys compiled graphs): no host sync, so it traces into the round's graph.

A grammar (structured output, :mod:`specgraph.grammar`) is the one processor whose per-position
state lives on the host: the round takes its token bitmask per position as an input and applies
it last (:func:`apply_token_bitmask`), where ``generate`` runs a caller's logits processor.

The per-request state the round needs besides its drafts:

* ``seq`` ``[B, M]`` long: each row as ``generate`` sees it: the caller's ``input_ids`` row
  (padding tokens included), then the committed new tokens; M = twice the cache slots, room for
  any padding.
* ``meta`` ``[B, 4]`` long: (masked prompt tokens, padded prompt length T, ``max_length``, leading
  masked tokens: what the repetition penalty ignores).

Row b has committed ``masked + L + 1`` tokens of ``seq`` (``L`` as in the engine: the root sits at
position ``L`` of the unpadded row).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

NEG_INF = float("-inf")


@dataclass(frozen=True)
class LogitsSpec:
    """The processors of one request, in the order ``generate`` applies them (the sampling warpers
    -- temperature, top-k, top-p, min-p -- come after, in :mod:`specgraph.warping`)."""

    sequence_bias: tuple[tuple[tuple[int, ...], float], ...] = ()  # SequenceBiasLogitsProcessor
    repetition_penalty: float | None = None  # RepetitionPenaltyLogitsProcessor (prompt padding ignored)
    no_repeat_ngram_size: int = 0  # NoRepeatNGramLogitsProcessor
    bad_words: tuple[tuple[tuple[int, ...], float], ...] = ()  # NoBadWordsLogitsProcessor (bias -inf)
    min_length: int = 0  # MinLengthLogitsProcessor (padded length)
    min_new_tokens: int = 0  # MinNewTokensLengthLogitsProcessor
    eos: tuple[int, ...] = ()  # what the minimum lengths suppress
    forced_bos_token_id: int | None = None  # ForcedBOSTokenLogitsProcessor
    forced_eos: tuple[int, ...] = ()  # ForcedEOSTokenLogitsProcessor, at max_length - 1
    suppress_tokens: tuple[int, ...] = ()  # SuppressTokensLogitsProcessor
    begin_suppress_tokens: tuple[int, ...] = ()  # SuppressTokensAtBeginLogitsProcessor
    begin_offset: int = 0  # its begin index is T + begin_offset
    grammar: bool = False  # a grammar's token bitmask per position (specgraph.grammar), applied last

    @property
    def needs_prefix(self) -> bool:
        """Whether a processor reads each position's prefix (anything but the grammar, whose
        per-position state the host computes)."""
        return bool(self.names()) and self.names() != ["grammar"]

    @property
    def history(self) -> bool:
        """Whether a processor reads earlier tokens (not just the length)."""
        return bool(self.sequence_bias or self.repetition_penalty or self.no_repeat_ngram_size or self.bad_words)

    def names(self) -> list[str]:
        """The generation settings this spec applies (for messages)."""
        fields = [("sequence_bias", self.sequence_bias), ("repetition_penalty", self.repetition_penalty),
                  ("no_repeat_ngram_size", self.no_repeat_ngram_size), ("bad_words_ids", self.bad_words),
                  ("min_length", self.min_length), ("min_new_tokens", self.min_new_tokens),
                  ("forced_bos_token_id", self.forced_bos_token_id is not None),
                  ("forced_eos_token_id", self.forced_eos), ("suppress_tokens", self.suppress_tokens),
                  ("begin_suppress_tokens", self.begin_suppress_tokens), ("grammar", self.grammar)]
        return [n for n, v in fields if v]


def with_grammar(spec: "LogitsSpec | None") -> LogitsSpec:
    """``spec`` (None: no processor) with a grammar's mask added."""
    return dataclasses.replace(spec or LogitsSpec(), grammar=True)


def prefix_sequences(
    seq: torch.Tensor,  # [B, M] long, committed rows as generate sees them
    committed: torch.Tensor,  # [B] long, committed length of each row in seq
    path: torch.Tensor,  # [B, Q, D] long, drafted tokens leading to each position (first depth[q] valid)
    depth: torch.Tensor,  # [B, Q] long, how many path tokens position q assumes
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each position's whole prefix: (sequences [B, Q, M], lengths [B, Q]). Entries at or past a
    position's length are garbage; every reader masks by length."""
    B, M = seq.shape
    Q, D = path.shape[1], path.shape[2]
    out = seq.unsqueeze(1).expand(B, Q, M).clone()
    if D:
        at = (committed.view(B, 1, 1) + torch.arange(D, device=seq.device).view(1, 1, D)).clamp_max(M - 1)
        out.scatter_(2, at.expand(B, Q, D), path)
    return out, committed.unsqueeze(1) + depth


def _repetition_penalty(x, seqs, lens, pads, penalty: float):
    B, Q, M = seqs.shape
    V = x.shape[-1]
    i = torch.arange(M, device=x.device).view(1, 1, M)
    seen = (i >= pads.view(B, 1, 1)) & (i < lens.unsqueeze(-1))
    present = torch.zeros(B, Q, V + 1, dtype=torch.bool, device=x.device)
    present.scatter_(2, torch.where(seen, seqs.clamp(0, V), V), True)
    penalised = torch.where(x < 0, x * penalty, x / penalty)
    return torch.where(present[..., :V], penalised, x)


def _no_repeat_ngram(x, seqs, lens, n: int):
    """Ban every token that would complete an n-gram already in the prefix."""
    B, Q, M = seqs.shape
    V = x.shape[-1]
    starts = M - n + 1  # windows seqs[s : s + n]
    tail = lens.unsqueeze(-1) - (n - 1) + torch.arange(n - 1, device=x.device)  # [B, Q, n-1]
    suffix = seqs.gather(2, tail.clamp_min(0))
    match = torch.ones(B, Q, starts, dtype=torch.bool, device=x.device)
    for j in range(n - 1):
        match &= seqs[:, :, j: j + starts] == suffix[:, :, j: j + 1]
    s = torch.arange(starts, device=x.device).view(1, 1, starts)
    match &= s + n <= lens.unsqueeze(-1)  # the window lies in the prefix (so never the suffix's own successor)
    match &= (lens >= n).unsqueeze(-1)
    banned = torch.zeros(B, Q, V + 1, dtype=torch.bool, device=x.device)
    banned.scatter_(2, torch.where(match, seqs[:, :, n - 1:].clamp(0, V), V), True)
    return x.masked_fill(banned[..., :V], NEG_INF)


def _sequence_bias(x, seqs, lens, biases):
    """Add each sequence's bias to its last token where the prefix ends with the rest of it."""
    V = x.shape[-1]
    bias = torch.zeros(V, dtype=torch.float32, device=x.device)
    single = [(s[0], b) for s, b in biases if len(s) == 1]
    if single:
        bias[torch.tensor([t for t, _ in single], device=x.device)] = torch.tensor([b for _, b in single], device=x.device)
    total = bias.expand(x.shape).clone()
    for s, b in biases:
        if len(s) == 1:
            continue
        m = len(s) - 1
        at = lens.unsqueeze(-1) - m + torch.arange(m, device=x.device)
        ends = (seqs.gather(2, at.clamp_min(0)) == torch.tensor(s[:-1], device=x.device)).all(-1) & (lens >= m)
        total[..., s[-1]] += torch.where(ends, b, 0.0)
    return x + total


def _only(x, cond, tokens):
    """Where cond [B, Q]: every logit -inf but ``tokens``, which become 0."""
    keep = torch.full_like(x, NEG_INF)
    keep[..., list(tokens)] = 0.0
    return torch.where(cond.unsqueeze(-1), keep, x)


def _suppress(x, cond, tokens):
    hit = torch.zeros(x.shape[-1], dtype=torch.bool, device=x.device)
    hit[[t for t in tokens if t < x.shape[-1]]] = True
    return x.masked_fill(cond.unsqueeze(-1) & hit, NEG_INF)


def bitmask_words(vocab: int) -> int:
    """int32 words of a token bitmask over ``vocab`` tokens."""
    return (vocab + 31) // 32


def apply_token_bitmask(
    x: torch.Tensor,  # [B, Q, V] float32 scores
    allowed: torch.Tensor,  # [B, Q, ceil(V / 32)] int32: bit i of word w allows token 32 w + i
) -> torch.Tensor:  # [B, Q, V]
    """Every token the bitmask does not allow set to -inf (a grammar's mask, xgrammar's layout)."""
    V = x.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=x.device)
    keep = ((allowed.unsqueeze(-1) >> shifts) & 1).flatten(-2)[..., :V]
    return x.masked_fill(keep == 0, NEG_INF)


def process_logits(
    spec: LogitsSpec,
    logits: torch.Tensor,  # [B, Q, V] target logits at Q positions
    seq: torch.Tensor,  # [B, M] long
    meta: torch.Tensor,  # [B, 4] long: masked prompt tokens, T, max_length, leading masked tokens
    L: torch.Tensor,  # [B] long, root position in the unpadded row
    path: torch.Tensor,  # [B, Q, D] long
    depth: torch.Tensor,  # [B, Q] long
    allowed: torch.Tensor | None = None,  # [B, Q, ceil(V / 32)] int32 grammar bitmask (spec.grammar)
) -> torch.Tensor:  # [B, Q, V] float32
    """The processed scores ``generate`` would compute at each position, given its own prefix.
    A grammar's mask comes last, where ``generate`` runs a caller's logits processor."""
    x = logits.float()
    if spec.needs_prefix:
        x = _builtin_processors(spec, x, seq, meta, L, path, depth)
    if spec.grammar:
        x = apply_token_bitmask(x, allowed)
    return x


def _builtin_processors(spec: LogitsSpec, x, seq, meta, L, path, depth):
    masked, T, max_length, lead = meta[:, 0], meta[:, 1], meta[:, 2], meta[:, 3]
    seqs, lens = prefix_sequences(seq, masked + L + 1, path, depth)
    every = torch.ones_like(lens, dtype=torch.bool)
    if spec.sequence_bias:
        x = _sequence_bias(x, seqs, lens, spec.sequence_bias)
    if spec.repetition_penalty is not None:
        x = _repetition_penalty(x, seqs, lens, lead, spec.repetition_penalty)
    if spec.no_repeat_ngram_size:
        x = _no_repeat_ngram(x, seqs, lens, spec.no_repeat_ngram_size)
    if spec.bad_words:
        x = _sequence_bias(x, seqs, lens, spec.bad_words)
    if spec.min_length:
        x = _suppress(x, lens < spec.min_length, spec.eos)
    if spec.min_new_tokens:
        x = _suppress(x, lens - T.unsqueeze(1) < spec.min_new_tokens, spec.eos)
    if spec.forced_bos_token_id is not None:
        x = _only(x, lens == 1, (spec.forced_bos_token_id,))
    if spec.forced_eos:
        x = _only(x, lens == (max_length.unsqueeze(1) - 1), spec.forced_eos)
    if spec.suppress_tokens:
        x = _suppress(x, every, spec.suppress_tokens)
    if spec.begin_suppress_tokens:
        x = _suppress(x, lens == (T.unsqueeze(1) + spec.begin_offset), spec.begin_suppress_tokens)
    return x


def chain_paths(drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Paths of a chain's K+1 positions: position j assumes drafts[:, :j].
    drafts [B, K] -> (path [B, K+1, K], depth [B, K+1])."""
    B, K = drafts.shape
    path = drafts.unsqueeze(1).expand(B, K + 1, K)
    depth = torch.arange(K + 1, device=drafts.device).unsqueeze(0).expand(B, K + 1)
    return path, depth


def tree_paths(
    tokens: torch.Tensor,  # [B, N] long, node tokens (node 0, the root, is committed)
    parents: torch.Tensor,  # [B, N] long, parent of each node (-1 for the root)
    max_depth: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Paths of a tree's N nodes: node q assumes the tokens of its ancestors below the root and its
    own, root-most first. -> (path [B, N, D], depth [B, N])."""
    B, N = tokens.shape
    D = max_depth
    # walk up D times: chain[:, :, d] = the d-th ancestor of each node (-1 past the root)
    node = torch.arange(N, device=tokens.device).unsqueeze(0).expand(B, N)
    ups = []
    for _ in range(D):
        ups.append(node)
        node = torch.where(node > 0, parents.gather(1, node.clamp_min(0)), -1)
    up = torch.stack(ups, dim=2)  # [B, N, D], up[..., 0] = the node itself
    real = up > 0  # ancestors below the root
    depth = real.sum(-1)
    # the d-th path token (root-most first) is the ancestor (depth - 1 - d) steps up
    d = torch.arange(D, device=tokens.device).view(1, 1, D)
    step = (depth.unsqueeze(-1) - 1 - d).clamp(0, max(D - 1, 0))
    which = up.gather(2, step).clamp_min(0)
    path = tokens.gather(1, which.view(B, N * D)).view(B, N, D)
    return path, depth
