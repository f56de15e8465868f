"""Structured output: a JSON schema, a regular expression or an EBNF grammar as an exact logits
processor inside the round.

A grammar is a logits processor: at each position the target's law is masked to the tokens the
grammar allows after that position's prefix, and renormalised. A lossless speculative decoder must
verify against exactly that law, so the mask is applied inside the round graph after the other
processors (:func:`specgraph.processors.process_logits`), where ``generate`` runs a caller's
logits processor: chain position j is masked with the grammar state after the committed tokens
and drafts 0..j-1, tree node q with the state after its drafted ancestors and itself. The host
computes those masks between the proposal and the round: each row keeps one matcher, which
accepts a position's drafted path, fills that position's bitmask and rolls back. The matcher
advances only by the tokens a row keeps, so its state always matches the committed row (the
KV cache's rollback is not advancing a length; the grammar's is not accepting).

Two things come with the masks for free:

* a draft the grammar forbids can never be accepted (its probability is 0): the positions after
  it are dead, and their masks are left open;
* where the grammar allows exactly one token, that token is emitted with probability one, so it
  replaces the drafted token; where it forbids the drafted token but forces a string (a JSON key
  and its punctuation, which a BPE vocabulary can split many ways, so no single token is forced),
  the string's tokens replace the drafts from there, and a round whose drafter found nothing
  drafts that string (deterministic drafts only: a sampled draft's q row says what it was drawn
  from).

Masks are xgrammar bitmasks, int32 [B, Q, ceil(V / 32)]: bit i of word w allows token 32 w + i.
xgrammar (rather than llguidance) because its mask is the cheaper of the two at vocabulary 49k
(docs/structured_output.md).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import numpy as np
import torch

from specgraph.processors import apply_token_bitmask, bitmask_words
from specgraph.proposal import ChainProposal, TreeProposal

KINDS = ("json_schema", "json_object", "regex", "grammar")
FORCED_DRAFTS = True  # a token the grammar forces replaces the drafted one (off: to measure what it adds)


def _xgrammar():
    try:
        import xgrammar
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError("structured output needs xgrammar: pip install 'specgraph[grammar]'") from e
    return xgrammar


@dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains its output to: ``kind`` one of :data:`KINDS`, ``source`` the
    schema as JSON text, the regular expression or the EBNF grammar ("" for any JSON object)."""

    kind: str
    source: str = ""


def grammar_spec(response_format=None, regex: str | None = None, grammar: str | None = None) -> GrammarSpec | None:
    """The constraint of a request from OpenAI's ``response_format`` (``{"type": "json_schema",
    "json_schema": {"name": ..., "schema": {...}}}``, ``{"type": "json_object"}`` or
    ``{"type": "text"}``) or vLLM's ``regex`` / ``grammar`` (EBNF) fields; None: unconstrained.
    Malformed input raises ValueError naming what is wrong."""
    given = [n for n, v in (("response_format", response_format), ("regex", regex), ("grammar", grammar))
             if v is not None]
    if len(given) > 1:
        raise ValueError(f"pass one of response_format, regex and grammar, not {' and '.join(given)}")
    if regex is not None:
        if not isinstance(regex, str) or not regex:
            raise ValueError(f"regex must be a non-empty string, got {regex!r}")
        return GrammarSpec("regex", regex)
    if grammar is not None:
        if not isinstance(grammar, str) or not grammar.strip():
            raise ValueError(f"grammar must be a non-empty EBNF string, got {grammar!r}")
        return GrammarSpec("grammar", grammar)
    if response_format is None:
        return None
    if hasattr(response_format, "model_dump"):  # an OpenAI client's pydantic object
        response_format = response_format.model_dump(by_alias=True, exclude_none=True)
    if not isinstance(response_format, dict) or "type" not in response_format:
        raise ValueError(f"response_format must be a dict with a 'type', got {response_format!r}")
    kind = response_format["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object")
    if kind != "json_schema":
        raise ValueError(f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}")
    body = response_format.get("json_schema")
    if not isinstance(body, dict) or "schema" not in body:
        raise ValueError("response_format of type 'json_schema' needs 'json_schema': {'name': ..., 'schema': {...}}, "
                         f"got {body!r}")
    schema = body["schema"]
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"response_format's schema is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"response_format's schema must be a JSON object, got {schema!r}")
    return GrammarSpec("json_schema", json.dumps(schema))  # key order kept: it is the order of the output's keys


_COMPILERS: dict = {}  # (tokenizer id, vocab, eos) -> (tokenizer, xgrammar.GrammarCompiler)


def _compiler(tokenizer, vocab: int, eos: tuple[int, ...]):
    xgr = _xgrammar()
    key = (id(tokenizer), vocab, eos)
    hit = _COMPILERS.get(key)
    if hit is not None and hit[0] is tokenizer:
        return hit[1]
    if isinstance(tokenizer, xgr.TokenizerInfo):
        if tokenizer.vocab_size != vocab:
            raise ValueError(f"the TokenizerInfo's vocab_size is {tokenizer.vocab_size}, the model's logits have {vocab}")
        info = tokenizer
    else:
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=list(eos))
    if len(_COMPILERS) >= 8:
        _COMPILERS.pop(next(iter(_COMPILERS)))
    _COMPILERS[key] = (tokenizer, xgr.GrammarCompiler(info))
    return _COMPILERS[key][1]


@dataclass(frozen=True)
class Grammar:
    """A constraint compiled for one tokenizer and vocabulary, ending on ``eos``."""

    spec: GrammarSpec
    compiled: object  # xgrammar.CompiledGrammar
    vocab: int
    eos: tuple[int, ...]
    encode: object = None  # text -> token ids (a transformers tokenizer's), for forced strings as drafts

    def matcher(self):
        """A fresh matcher at the start of the output."""
        return _xgrammar().GrammarMatcher(self.compiled, override_stop_tokens=list(self.eos))


def compile_grammar(spec: GrammarSpec, tokenizer, vocab: int, eos) -> Grammar:
    """Compile ``spec`` for ``tokenizer`` (a transformers tokenizer, or an
    ``xgrammar.TokenizerInfo`` for a vocabulary of one's own) and a model with ``vocab`` logits.
    The grammar ends on one of the ``eos`` tokens; without one it could never end, so none is an
    error."""
    eos = (int(eos),) if isinstance(eos, int) else tuple(int(t) for t in (eos or ()))
    if not eos:
        raise ValueError("structured output needs an eos_token_id: the grammar's end is where generation stops")
    if tokenizer is None:
        raise ValueError("structured output needs the tokenizer: pass tokenizer=... to generate (the grammar is "
                         "compiled against its vocabulary)")
    comp = _compiler(tokenizer, vocab, eos)
    try:
        if spec.kind == "json_schema":
            compiled = comp.compile_json_schema(spec.source)
        elif spec.kind == "json_object":
            compiled = comp.compile_builtin_json_grammar()
        elif spec.kind == "regex":
            compiled = comp.compile_regex(spec.source)
        else:
            compiled = comp.compile_grammar(spec.source)
    except RuntimeError as e:  # xgrammar reports bad schemas, regexes and grammars this way
        raise ValueError(f"cannot compile the {spec.kind.replace('_', ' ')}: {e}") from None
    encode = None if not hasattr(tokenizer, "encode") else \
        (lambda text: tokenizer.encode(text, add_special_tokens=False))
    return Grammar(spec, compiled, vocab, eos, encode)


def _allows(words: np.ndarray, token: int) -> bool:
    return bool((int(words[token >> 5]) >> (token & 31)) & 1)


def _only_token(words: np.ndarray) -> int | None:
    """The one token a bitmask row [W] allows, or None when it allows several (or none)."""
    nz = np.flatnonzero(words)
    if len(nz) != 1:
        return None
    w = int(words[nz[0]]) & 0xFFFFFFFF
    return int(nz[0]) * 32 + w.bit_length() - 1 if w & (w - 1) == 0 else None


class GrammarRows:
    """The grammar state of one call's rows: a matcher per row at the row's committed tokens.
    ``chain`` and ``tree`` add each position's mask to a proposal (and the forced drafts),
    ``advance`` moves each row by the tokens it kept. ``force_drafts``: forced tokens may replace
    drafts (for drafters without a cache of their own drafts, which a replaced token would leave
    stale)."""

    def __init__(self, grammar: Grammar, n_rows: int, device, force_drafts: bool = True):
        self.grammar, self.device, self.force_drafts = grammar, device, force_drafts
        self.matchers = [grammar.matcher() for _ in range(n_rows)]
        self.words = bitmask_words(grammar.vocab)

    def _open(self, B: int, Q: int) -> torch.Tensor:
        return torch.full((B, Q, self.words), -1, dtype=torch.int32)  # every token allowed

    def chain(self, chain: ChainProposal, live: list[bool], stats) -> ChainProposal:
        """``chain`` with the mask of each of its k+1 positions (``allowed``), each forced draft in
        place of the drafted token."""
        B, k = chain.drafts.shape
        allowed = self._open(B, k + 1)
        flat = allowed.view(B * (k + 1), self.words)
        drafts = chain.drafts.tolist()
        force = self.force_drafts and FORCED_DRAFTS and chain.probs is None
        changed = False
        for b, m in enumerate(self.matchers):
            if not live[b]:
                continue
            taken = 0
            for j in range(k + 1):
                if m.is_terminated():
                    break  # the row ends at the EOS just accepted: nothing after it is kept
                m.fill_next_token_bitmask(flat, b * (k + 1) + j)
                if j == k:
                    break
                if force:
                    supplied = self._forced(m, flat[b * (k + 1) + j].numpy(), drafts[b][j], k - j)
                    if supplied:
                        drafts[b][j: j + len(supplied)], changed = supplied, True
                        stats.forced += len(supplied)
                if not m.accept_token(drafts[b][j]):
                    stats.cut += k - j  # positions j+1.. are never reached: their masks stay open
                    break
                taken += 1
            m.rollback(taken)
        new_drafts = torch.tensor(drafts, dtype=torch.long, device=self.device).view(B, k) if changed else chain.drafts
        return dataclasses.replace(chain, drafts=new_drafts, allowed=allowed.to(self.device))

    def propose(self, k: int, live: list[bool], stats) -> ChainProposal | None:
        """A chain of the strings the grammar forces next (a JSON key and its punctuation), for a
        round whose drafter proposed nothing; None when no live row has one. Rows without one
        draft padding, which verification rejects."""
        if not (self.force_drafts and FORCED_DRAFTS) or self.grammar.encode is None:
            return None
        rows = [self._forced_string(m, k) if live[b] and not m.is_terminated() else []
                for b, m in enumerate(self.matchers)]
        if not any(rows):
            return None
        stats.forced += sum(map(len, rows))
        drafts = torch.zeros(len(live), k, dtype=torch.long)
        for b, r in enumerate(rows):
            drafts[b, :len(r)] = torch.tensor(r, dtype=torch.long)
        return ChainProposal(k, drafts.to(self.device))

    def _forced(self, m, words: np.ndarray, draft: int, room: int) -> list[int]:
        """Drafts the grammar supplies at a position whose mask is ``words``, in place of ``draft``:
        the one token it allows (emitted with probability one), or, where it forbids the draft,
        the tokens of the string it forces next (JSON keys and punctuation split into several
        tokens: a guess the target verifies like any draft); [] to keep the draft."""
        only = _only_token(words)
        if only is not None:
            return [only] if only != draft else []
        if _allows(words, draft) or self.grammar.encode is None:
            return []
        return self._forced_string(m, room)

    def _forced_string(self, m, room: int) -> list[int]:
        """The first ``room`` tokens of the string the grammar forces from matcher ``m``'s state."""
        text = m.find_jump_forward_string()
        return list(self.grammar.encode(text))[:room] if text else []

    def tree(self, tree: TreeProposal, live: list[bool], stats) -> TreeProposal:
        """``tree`` with the mask of each node (the state after its drafted path)."""
        B, N = tree.tokens.shape
        allowed = self._open(B, N)
        flat = allowed.view(B * N, self.words)
        tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
        for b, m in enumerate(self.matchers):
            if not live[b]:
                continue
            for q in range(N):
                path, node = [], q
                while node > 0:
                    path.append(tokens[b][node])
                    node = parents[b][node]
                if node < 0 and q > 0:
                    continue  # not attached to the root: never accepted
                taken = 0
                for t in reversed(path):
                    if m.is_terminated() or not m.accept_token(t):
                        break
                    taken += 1
                if taken == len(path) and not m.is_terminated():
                    m.fill_next_token_bitmask(flat, b * N + q)
                elif taken == len(path) - 1:
                    stats.cut += 1  # the node's own token is forbidden
                m.rollback(taken)
        return dataclasses.replace(tree, allowed=allowed.to(self.device))

    def advance(self, kept: list[list[int]]) -> None:
        """Each row's matcher accepts the tokens the row kept this round."""
        for b, (m, toks) in enumerate(zip(self.matchers, kept)):  # (rows past the request's: padding)
            for t in toks:
                if not m.accept_token(int(t)):
                    raise RuntimeError(f"row {b} kept token {t}, which its grammar does not allow: the grammar "
                                       "state is out of step with the row (a bug in specgraph; please report it)")


class GrammarLogitsProcessor:
    """The same constraint as a transformers logits processor, for ``model.generate`` (the HF
    baseline of a benchmark, or a reference): each row's matcher accepts the row's last token,
    then its bitmask masks the scores. ``prompt_length``: the padded prompt length T."""

    def __init__(self, grammar: Grammar, prompt_length: int):
        self.grammar, self.T = grammar, prompt_length
        self.matchers: list | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        B = input_ids.shape[0]
        if self.matchers is None:
            self.matchers = [self.grammar.matcher() for _ in range(B)]
        mask = torch.full((B, bitmask_words(self.grammar.vocab)), -1, dtype=torch.int32)
        for b, m in enumerate(self.matchers):
            if input_ids.shape[1] > self.T and not m.is_terminated():
                m.accept_token(int(input_ids[b, -1]))
            if not m.is_terminated():
                m.fill_next_token_bitmask(mask, b)
        return apply_token_bitmask(scores.float().unsqueeze(1), mask.to(scores.device).unsqueeze(1)).squeeze(1)
