"""Model-free tree drafting from suffix statistics (SuffixDecoding, Oliaro et al., 2024).

Why: agentic / repetitive workloads re-emit long spans of earlier text (the prompt, earlier
responses). Matching the tail of the current context against everything seen so far and drafting
the *frequent* continuations as a tree costs no model call, and a frequency-scored tree hedges
between several plausible continuations instead of betting on one.

Data structure: a suffix trie truncated at ``max_depth``. Conceptually every start position ``i``
of an indexed text inserts the string ``text[i : i + max_depth]`` and each trie node counts the
strings passing through it, so ``node.count`` == number of (overlapping) occurrences of the node's
path in the text (for paths of length <= max_depth).

To keep memory near O(tokens) instead of O(tokens * max_depth), a path that only one string has
reached is stored as a *tail*: a single node that points into that string's text (``text``,
``start``); the tail implicitly stands for the rest of the string (all those implicit nodes have
count 1). A tail is expanded one level only when a second string walks into it. For a growing text
(the per-request local index) a tail also grows implicitly as tokens are appended, so an append
only touches the suffixes that currently end *at* a shared (internal) node.

Matching: ``match_len`` is the largest m <= ``max_match`` such that the last m context tokens occur
*followed by at least one token* somewhere (earlier in the context, or in a global document); a
match that predicts nothing is useless. This property is monotone in m, so it is binary-searched.

Counting convention (what ``SuffixProposal.counts`` means), with ``pattern`` = the last
``match_len`` tokens of the session context:

* ``count(pattern + path)`` = number of overlapping occurrences in the local context plus in every
  live global document, for a non-empty ``path``;
* ``count(pattern)`` (the root) is the same minus one: the *trivial occurrence*, i.e. the pattern
  occurring at start ``len(context) - match_len`` (the context's own end), is excluded. It is
  followed by nothing, so counting it would only deflate every score.

Occurrences at the very end of a global document are counted (they are real occurrences), so the
children's scores of a node can sum to less than its own score.
"""
from __future__ import annotations

import heapq
import operator
import threading
from dataclasses import dataclass, field

__all__ = ["SuffixIndex", "SuffixSession", "SuffixProposal", "DEPTH_PER_MATCH", "default_spec_depth"]

# Default speculation depth grows linearly with the match length: a 1-token match is weak evidence,
# a 10-token match usually means we are inside a copied span. See ``default_spec_depth``.
DEPTH_PER_MATCH = 2


def default_spec_depth(match_len: int, max_depth: int) -> int:
    """Depth cap used when ``propose(max_spec_depth=None)``.

    ``min(max_depth - match_len, DEPTH_PER_MATCH * match_len)``: longer matches -> deeper trees
    (the continuation is more predictable: the paper's MAX_SPEC = alpha * p), and never deeper than
    the truncated trie can answer (pattern + path <= max_depth). 0 when nothing matched. With the
    defaults (max_depth 24, max_match 12): m = 1, 2, 4, 6..12 -> depth 2, 4, 8, 12.
    """
    if match_len <= 0:
        return 0
    return max(0, min(max_depth - match_len, DEPTH_PER_MATCH * match_len))


# ----------------------------------------------------------------------------------------------
# validation


def _as_tokens(tokens, what: str = "tokens") -> list[int]:
    """Copy ``tokens`` into a fresh ``list[int]`` of non-negative ids, or raise ValueError.

    Accepts lists/tuples/ranges of ints, numpy/torch integer arrays (via ``tolist``) and integer
    scalars implementing ``__index__``; bools, floats and strings are rejected because they are
    almost always a caller bug (a mask or logits passed instead of ids).
    """
    if hasattr(tokens, "tolist") and not isinstance(tokens, (list, tuple)):
        tokens = tokens.tolist()
    if isinstance(tokens, (str, bytes)) or not hasattr(tokens, "__iter__"):
        raise ValueError(f"{what} must be a sequence of non-negative ints, got {type(tokens).__name__}")
    out = list(tokens)
    if not all(type(t) is int for t in out):  # slow path only when needed
        for j, t in enumerate(out):
            if type(t) is int:
                continue
            if isinstance(t, bool) or not hasattr(t, "__index__"):
                raise ValueError(f"{what} must be ints; element {j} is {t!r} ({type(t).__name__})")
            out[j] = operator.index(t)
    if out and min(out) < 0:
        j = next(j for j, t in enumerate(out) if t < 0)
        raise ValueError(f"{what} must be non-negative token ids; element {j} is {out[j]}")
    return out


def _check_int(value, name: str, lo: int) -> int:
    """``value`` as an int >= lo, else ValueError naming the argument."""
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {value!r}")
    return value


# ----------------------------------------------------------------------------------------------
# truncated suffix trie


class _Node:
    """One trie node. Internal: ``children`` dict (or None while empty), ``text`` None.
    Tail: ``text`` is the owner string's token list, ``start`` its start, ``count`` == 1, no children."""

    __slots__ = ("count", "children", "depth", "text", "start", "top")

    def __init__(self, count: int, depth: int, text: list[int] | None = None, start: int = 0):
        self.count = count  # occurrences of this node's path (strings passing through)
        self.children: dict[int, _Node] | None = None
        self.depth = depth  # path length from the root
        self.text = text
        self.start = start
        self.top: list | None = None  # ranked-children cache [floor, toks, size] once queried, see _top


# Ranking of children: count descending, then token ascending. As a comparable key (larger =
# better): (count, -token). Structure-independent, so incremental / batch / evicted-and-rebuilt
# indexes rank identically.


# A position in the trie: (node, depth). depth == node.depth for materialized nodes; a position
# inside a tail has depth > node.depth and reads its path from the tail's text.
_Pos = tuple  # (_Node, int)


class _SuffixTrie:
    """Counts of all substrings of length <= ``max_depth`` of a set of texts.

    Texts are added by appending tokens to the *live* text (``new_text`` then ``extend``); the
    local index only ever has one live text, the global index opens one per document and seals it.
    Not thread-safe on its own (SuffixIndex holds a lock around the global one).
    """

    def __init__(self, max_depth: int):
        self.max_depth = max_depth
        self.root = _Node(0, 0)  # root.count == number of indexed strings == indexed tokens
        self.node_count = 0  # materialized nodes, root excluded
        self._live: list[int] | None = None
        # start -> internal node where the live text's string starting there currently ends, for
        # strings shorter than max_depth (they grow on append). Strings ending in their own tail
        # grow implicitly and are not listed.
        self._open: dict[int, _Node] = {}

    # -- building -------------------------------------------------------------------------------

    def new_text(self) -> list[int]:
        """Start a new live text (sealing the previous one) and return its (growing) token list."""
        self._live = []
        self._open = {}
        return self._live

    def seal(self) -> None:
        """The live text will not grow any more."""
        self._live = None
        self._open = {}

    def extend(self, tokens: list[int]) -> None:
        """Append ``tokens`` to the live text. Cost per token: O(#strings ending at internal nodes),
        at most max_depth, usually a handful (tails absorb appends for free)."""
        for tok in tokens:
            self._append(tok)

    def _append(self, tok: int) -> None:
        text, opened, D = self._live, self._open, self.max_depth
        text.append(tok)
        L = len(text)
        # Extend every open string by one token (iterate a snapshot: the loop edits ``opened``).
        for i, node in list(opened.items()):
            child = self._step(node, tok, text, i)
            if child.text is not None or child.depth >= D:
                del opened[i]  # now grows implicitly in its tail, or finished at max_depth
            else:
                opened[i] = child
        self.root.count += 1  # the new string starting at L - 1
        child = self._step(self.root, tok, text, L - 1)
        if child.text is None and child.depth < D:
            opened[L - 1] = child

    def _step(self, node: _Node, tok: int, text: list[int], start: int) -> _Node:
        """The string (text, start), which ends at internal ``node``, grows by ``tok``: count it
        in the child (creating a tail owned by it, or expanding another string's tail first)."""
        children = node.children
        if children is None:
            children = node.children = {}
        child = children.get(tok)
        if child is None:
            child = _Node(1, node.depth + 1, text, start)
            children[tok] = child
            self.node_count += 1
        else:
            if child.text is not None:
                self._expand(child)
            child.count += 1
        if node.top is not None:
            self._touch(node, tok)
        return child

    def _expand(self, tail: _Node) -> None:
        """Materialize one more level of ``tail`` so that a second string can pass through it."""
        text, start, d = tail.text, tail.start, tail.depth
        tail.text = None
        # If the owner string continues below d, hand the rest to a new tail one level down. Else it
        # ends here for good (max_depth or end of a sealed text): a live owner that is still short
        # of max_depth cannot end exactly at its tail, because the tail was created in the append
        # that made it length d and only that same string could have reached it in that append.
        if min(self.max_depth, len(text) - start) > d:
            tail.children = {text[start + d]: _Node(1, d + 1, text, start)}
            self.node_count += 1

    def remove_text(self, text: list[int]) -> None:
        """Un-count every string of a sealed ``text``; nodes whose count reaches 0 are freed."""
        D = self.max_depth
        for i in range(len(text)):
            self.root.count -= 1
            node = self.root
            for d in range(min(D, len(text) - i)):
                tok = text[i + d]
                child = node.children[tok]
                child.count -= 1
                gone = child.count == 0  # only this string was below: drop the whole chain
                if gone:
                    del node.children[tok]
                    if not node.children:
                        node.children = None
                    self.node_count -= self._chain_size(child)
                if node.top is not None:
                    self._touch(node, tok)
                if gone:
                    break
                node = child

    @staticmethod
    def _chain_size(node: _Node) -> int:
        """Materialized nodes in a subtree that holds a single string (a chain)."""
        n = 0
        while node is not None:
            n += 1
            node = next(iter(node.children.values())) if node.children else None
        return n

    # -- queries --------------------------------------------------------------------------------

    def locate(self, seq: list[int], lo: int, hi: int) -> _Pos | None:
        """Position of the path ``seq[lo:hi]`` (len <= max_depth), or None if it never occurs."""
        node, d, m = self.root, 0, hi - lo
        while d < m:
            if node.text is not None:  # inside a tail: compare against the owner's text
                t, s = node.text, node.start
                if min(self.max_depth, len(t) - s) < m or t[s + d : s + m] != seq[lo + d : hi]:
                    return None
                return (node, m)
            children = node.children
            node = children.get(seq[lo + d]) if children else None
            if node is None:
                return None
            d += 1
        return (node, m)

    def fanout(self, pos: _Pos | None) -> int:
        """Number of distinct tokens following the path at ``pos``."""
        if pos is None:
            return 0
        node, d = pos
        if node.text is not None:
            return int(d < min(self.max_depth, len(node.text) - node.start))
        return len(node.children) if node.children else 0

    def children(self, pos: _Pos | None) -> list[tuple[int, int, _Pos]]:
        """All [(token, count, child position)] one level below ``pos`` (unordered)."""
        if not self.fanout(pos):
            return []
        node, d = pos
        if node.text is not None:
            return [(node.text[node.start + d], 1, (node, d + 1))]
        return [(tok, c.count, (c, c.depth)) for tok, c in node.children.items()]

    def child(self, pos: _Pos | None, tok: int) -> tuple[int, _Pos | None]:
        """(count, position) of ``pos`` + [tok]; (0, None) if that never occurs."""
        if not self.fanout(pos):
            return 0, None
        node, d = pos
        if node.text is not None:
            return (1, (node, d + 1)) if node.text[node.start + d] == tok else (0, None)
        c = node.children.get(tok)
        return (c.count, (c, c.depth)) if c is not None else (0, None)

    def top_children(self, pos: _Pos | None, k: int) -> list[tuple[int, int, _Pos]]:
        """The best ``k`` children of ``pos`` as [(token, count, position)], ranked."""
        if not self.fanout(pos):
            return []
        node = pos[0]
        if node.text is not None:
            return self.children(pos)
        d = node.children
        return [(t, d[t].count, (d[t], d[t].depth)) for t in self._top(node, k)]

    # -- ranked-children cache -----------------------------------------------------------------
    # Why: frequent short patterns ("the") have thousands of children; ranking them on every
    # propose costs milliseconds. A queried node keeps ``top = [floor, toks, size]`` with the
    # invariant: toks == all children whose key (count, -token) >= floor, sorted best first
    # (floor None: all children). Every count change of a child goes through _touch, which keeps
    # the invariant in O(len(toks)); a query for k is exact while len(toks) >= k (or floor is None)
    # and only otherwise rescans the children.

    def _top(self, node: _Node, k: int) -> list[int]:
        """Tokens of the best ``k`` children of internal ``node``, ranked (cached)."""
        top = node.top
        if top is None or (top[0] is not None and len(top[1]) < k):
            top = node.top = self._rank(node.children, max(2 * k, 8))
        return top[1][:k]

    @staticmethod
    def _rank(children: dict[int, _Node], size: int) -> list:
        """Fresh cache holding the best ``size`` children (all if there are at most ``size``)."""
        if len(children) <= size:
            return [None, sorted(children, key=lambda t: (-children[t].count, t)), size]
        threshold = heapq.nlargest(size, [c.count for c in children.values()])[-1]  # C-speed scan
        toks = [t for t, c in children.items() if c.count >= threshold]
        toks.sort(key=lambda t: (-children[t].count, t))
        del toks[size:]
        return [(children[toks[-1]].count, -toks[-1]), toks, size]

    @staticmethod
    def _touch(node: _Node, tok: int) -> None:
        """Child ``tok`` of ``node`` changed count (or appeared / vanished): repair node.top."""
        top = node.top
        floor, toks = top[0], top[1]
        children = node.children
        if tok in toks:
            toks.remove(tok)
        c = children.get(tok) if children else None
        if c is None:
            return
        key = (c.count, -tok)
        if floor is not None and key < floor:
            return  # stays (or becomes) unlisted: below every listed child
        i = 0
        while i < len(toks) and (children[toks[i]].count, -toks[i]) > key:
            i += 1
        toks.insert(i, tok)
        size = top[2]
        if floor is None and len(toks) > size:  # a complete list outgrew its size: truncate
            del toks[size:]
            top[0] = (children[toks[-1]].count, -toks[-1])

    def verify(self) -> None:
        """Debug/test helper: check structural invariants (counts, tails, node_count)."""
        seen = 0
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node.text is not None:
                assert node.count == 1 and node.children is None, "tail must be a count-1 leaf"
            elif node.children:
                assert node.count >= sum(c.count for c in node.children.values()), "child counts exceed parent"
                if node.top is not None:
                    floor, toks = node.top[0], node.top[1]
                    want = sorted((t for t, c in node.children.items() if floor is None or (c.count, -t) >= floor),
                                  key=lambda t: (-node.children[t].count, t))
                    assert toks == want, "stale ranked-children cache"
                for c in node.children.values():
                    assert c.count >= 1 and c.depth == node.depth + 1 <= self.max_depth
                    seen += 1
                    stack.append(c)
        assert seen == self.node_count, f"node_count {self.node_count} != {seen} reachable nodes"


# ----------------------------------------------------------------------------------------------
# public API


@dataclass
class SuffixProposal:
    """A speculation tree. Node 0 is the root (the last context token's slot, token -1).

    Nodes are in expansion order (score descending, ties: earlier-pushed first), so parents come
    before children and siblings are ordered by score descending (ties: smaller token id).
    """

    tokens: list[int]  # [N] drafted token per node; tokens[0] == -1
    parents: list[int]  # [N] parent index, parents[0] == -1, parents[i] < i
    scores: list[float]  # [N] count / root count: estimated probability of the path (root 1.0)
    counts: list[int]  # [N] occurrences of pattern+path (root: of the pattern, trivial one excluded)
    match_len: int  # length of the matched context suffix; 0 -> only the root
    depth_cap: int = 0  # the max_spec_depth that was applied
    _kids: list[list[int]] | None = field(default=None, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.tokens)

    def children(self, i: int) -> list[int]:
        """Child indices of node ``i`` in score order."""
        if self._kids is None:
            kids: list[list[int]] = [[] for _ in self.tokens]
            for j in range(1, len(self.tokens)):
                kids[self.parents[j]].append(j)
            self._kids = kids
        return self._kids[i]

    def path(self, i: int) -> list[int]:
        """Tokens from the root (exclusive) down to node ``i`` (inclusive)."""
        out = []
        while i > 0:
            out.append(self.tokens[i])
            i = self.parents[i]
        return out[::-1]

    def paths(self) -> list[list[int]]:
        """Root-to-leaf token paths (root excluded), leaves in node order. [] for a root-only tree."""
        return [self.path(i) for i in range(1, len(self.tokens)) if not self.children(i)]

    def best_chain(self, k: int, min_score: float = 0.0) -> list[int]:
        """Greedy top-1 chain of at most ``k`` tokens: from the root, repeatedly take the
        highest-score child (its first child), stopping before a node whose score (estimated path
        probability) is below ``min_score``. This is what a chain-only caller should draft."""
        return self.best_path(k, min_score)[0]

    def best_path(self, k: int, min_score: float = 0.0) -> tuple[list[int], list[float]]:
        """:meth:`best_chain` and the score of each of its nodes."""
        toks, scores, i = [], [], 0
        while len(toks) < k:
            kids = self.children(i)
            if not kids or self.scores[kids[0]] < min_score:
                break
            i = kids[0]
            toks.append(self.tokens[i])
            scores.append(self.scores[i])
        return toks, scores


class AcceptanceCalibration:
    """Accepted / predicted drafts of one request (decayed sums), for sampled rounds.

    A suffix node's score is the share of the matched context's occurrences that continued along
    its path. A greedy target repeats itself, so that share predicts acceptance; a sampled target
    accepts a deterministic draft x with probability p(x) only, which the share overstates when the
    indexed text was itself one sample (the same prompt answered before at T = 0.7: uncalibrated,
    suffix chains draft 8-token chains of which few tokens are accepted, and lose to prompt lookup).
    Dividing the drafting threshold by ``scale`` keeps the drafts that pay at the observed rate.

    The prior (``PRIOR`` drafts predicted and accepted) keeps a few unlucky rounds from cutting a
    request's drafting: a scale estimated from one or two rounds is noisy, and being capped at 1 its
    noise only ever cuts. ``benchmarks/suffix_replay.py`` replays T = 0.7 samples of SmolLM2 at a
    drafted token's cost with GEMM autotuning (0.1 plain step) and compares priors of one, four and
    eight tokens: with one, suffix chains fall slightly behind prompt lookup; with four, they keep
    level with it."""

    DECAY = 0.8  # per drafted round
    PRIOR = 4.0

    def __init__(self):
        self.predicted = self.PRIOR  # at scale 1
        self.accepted = self.PRIOR

    @property
    def scale(self) -> float:
        return min(1.0, self.accepted / self.predicted)

    def observe(self, scores: list[float], accepted: int) -> None:
        """One round that drafted a chain with these node ``scores``, of which ``accepted`` were accepted."""
        self.predicted = self.DECAY * self.predicted + sum(scores)
        self.accepted = self.DECAY * self.accepted + min(accepted, len(scores))


class SuffixIndex:
    """Global index over earlier outputs plus a factory for per-request sessions.

    ``add_document``, ``start`` and ``SuffixSession.propose`` may run concurrently from several
    threads: the global trie is guarded by one lock (held while a document is indexed/evicted and
    while a proposal reads it). A single session must be used by one thread at a time.
    """

    def __init__(self, max_depth: int = 24, global_budget: int = 200_000, max_match: int | None = None):
        """``max_depth``: the trie holds pattern + continuation of at most this many tokens.
        ``global_budget``: tokens kept in the global index (oldest documents evicted first).
        ``max_match``: longest pattern tried (default ``max_depth // 2``). Inside a long copied
        span every length matches, and a pattern of m tokens leaves only ``max_depth - m`` for the
        draft, so matching up to max_depth - 1 would draft one token deep exactly where deep
        drafts pay off most; half-and-half keeps both a selective pattern and a deep tree."""
        self.max_depth = _check_int(max_depth, "max_depth", 2)
        self.max_match = max(1, self.max_depth // 2) if max_match is None else _check_int(max_match, "max_match", 1)
        if self.max_match >= self.max_depth:
            raise ValueError(f"max_match must be < max_depth ({self.max_depth}), got {max_match}")
        self.global_budget = _check_int(global_budget, "global_budget", 0)
        self._trie = _SuffixTrie(self.max_depth)
        self._docs: dict[int, list[int]] = {}  # doc id -> tokens, insertion (= eviction) order
        self._tokens = 0
        self._next_id = 0
        self._lock = threading.Lock()

    def add_document(self, tokens) -> int:
        """Index a finished text (e.g. prompt + response of an earlier request); return its id.

        Oldest documents are evicted first until the new one fits in ``global_budget``; a document
        longer than the budget keeps only its last ``global_budget`` tokens (the most recent text).
        """
        toks = _as_tokens(tokens)
        if len(toks) > self.global_budget:
            toks = toks[len(toks) - self.global_budget :]
        with self._lock:
            while self._docs and self._tokens + len(toks) > self.global_budget:
                self._evict_oldest()
            doc_id = self._next_id
            self._next_id += 1
            text = self._trie.new_text()
            self._trie.extend(toks)
            self._trie.seal()
            self._docs[doc_id] = text
            self._tokens += len(text)
            return doc_id

    def _evict_oldest(self) -> None:
        doc_id = next(iter(self._docs))
        text = self._docs.pop(doc_id)
        self._trie.remove_text(text)
        self._tokens -= len(text)

    def start(self, tokens) -> "SuffixSession":
        """A per-request session whose local index covers ``tokens`` (the prompt)."""
        return SuffixSession(self, _as_tokens(tokens))

    @property
    def global_tokens(self) -> int:
        """Tokens currently held in the global index."""
        return self._tokens

    @property
    def node_count(self) -> int:
        """Materialized global trie nodes (root excluded); <= global_tokens * max_depth."""
        return self._trie.node_count

    @property
    def doc_ids(self) -> list[int]:
        """Ids of the live documents, oldest first."""
        with self._lock:
            return list(self._docs)

    def verify(self) -> None:
        """Test helper: assert the global trie's invariants."""
        with self._lock:
            self._trie.verify()
            assert self._trie.root.count == self._tokens


class SuffixSession:
    """Per-request drafting state: a local trie over the prompt and the tokens generated so far."""

    def __init__(self, index: SuffixIndex, tokens: list[int]):
        self._index = index
        self._trie = _SuffixTrie(index.max_depth)
        self._text = self._trie.new_text()  # grows in place as tokens are appended
        self._trie.extend(tokens)
        self.calibration = AcceptanceCalibration()
        self.drafted_scores: list[float] = []  # scores of the chain last proposed (suffix_chains)

    def extend(self, tokens) -> None:
        """Append generated tokens; incremental (no rebuild)."""
        self._trie.extend(_as_tokens(tokens))

    @property
    def tokens(self) -> list[int]:
        """A copy of the session context (prompt + extended tokens)."""
        return list(self._text)

    @property
    def node_count(self) -> int:
        """Materialized local trie nodes (root excluded)."""
        return self._trie.node_count

    def verify(self) -> None:
        """Test helper: assert the local trie's invariants."""
        self._trie.verify()

    def propose(self, max_nodes: int, max_children: int = 4, max_spec_depth: int | None = None,
                depth_limit: int | None = None) -> SuffixProposal:
        """Draft a tree after the longest context suffix that has a continuation somewhere.

        match_len = largest m <= max_match such that the last m context tokens occur followed
        by at least one token (earlier in the context, or in a global document). Then the tree is
        grown greedily: pop the highest-count frontier node (a heap; ties: pushed first), add it,
        push its best ``max_children`` children; stop at ``max_nodes`` drafted nodes or when the
        depth cap (``max_spec_depth``, default ``default_spec_depth(match_len, max_depth)``) or the
        trie depth is reached. ``depth_limit`` caps the default rule without replacing it (the
        compiled step's largest depth): depth = min(rule, depth_limit).
        """
        _check_int(max_nodes, "max_nodes", 0)
        if depth_limit is not None:
            _check_int(depth_limit, "depth_limit", 0)
        _check_int(max_children, "max_children", 1)
        if max_spec_depth is not None:
            _check_int(max_spec_depth, "max_spec_depth", 0)
        with self._index._lock:
            return self._propose(max_nodes, max_children, max_spec_depth, depth_limit)

    # -- internals ------------------------------------------------------------------------------

    def _positions(self, m: int) -> tuple[_Pos | None, _Pos | None]:
        """Local and global positions of the last ``m`` context tokens."""
        L = len(self._text)
        return self._trie.locate(self._text, L - m, L), self._index._trie.locate(self._text, L - m, L)

    def _matchable(self, m: int) -> bool:
        lpos, gpos = self._positions(m)
        return self._trie.fanout(lpos) > 0 or self._index._trie.fanout(gpos) > 0

    def _match_len(self) -> int:
        """Binary search: 'suffix of length m has a continuation' is monotone (true up to some M)
        because a suffix of a continued occurrence is continued by the same token."""
        lo, hi = 0, min(self._index.max_match, len(self._text))
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._matchable(mid):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _top_children(self, lpos, gpos, k: int) -> list[tuple[int, int, _Pos | None, _Pos | None]]:
        """Best ``k`` merged (local + global) children: (token, count, local pos, global pos),
        ordered by count descending then token ascending.

        Exact without scanning both sides: a token outside the larger side's top-k and absent from
        the smaller side is beaten by all k of those, so candidates = smaller side's children +
        larger side's top-k, each looked up on the other side.
        """
        L, G = self._trie, self._index._trie
        nl, ng = L.fanout(lpos), G.fanout(gpos)
        if ng == 0:
            return [(t, c, p, None) for t, c, p in L.top_children(lpos, k)]
        if nl == 0:
            return [(t, c, None, p) for t, c, p in G.top_children(gpos, k)]
        local_small = nl <= ng
        small, spos, big, bpos = (L, lpos, G, gpos) if local_small else (G, gpos, L, lpos)
        cand = {t: (c, p) for t, c, p in small.children(spos)}
        for t, _, _ in big.top_children(bpos, k):
            cand.setdefault(t, (0, None))
        merged = []
        for t, (c, p) in cand.items():
            bc, bp = big.child(bpos, t)
            merged.append((t, c + bc, p, bp) if local_small else (t, c + bc, bp, p))
        if len(merged) > k:
            return heapq.nsmallest(k, merged, key=lambda x: (-x[1], x[0]))
        merged.sort(key=lambda x: (-x[1], x[0]))
        return merged

    def _propose(self, max_nodes: int, max_children: int, max_spec_depth: int | None,
                 depth_limit: int | None = None) -> SuffixProposal:
        D = self._index.max_depth
        m = self._match_len()
        cap = default_spec_depth(m, D) if max_spec_depth is None else min(max_spec_depth, D - m)
        if depth_limit is not None:
            cap = min(cap, depth_limit)
        if m == 0:
            return SuffixProposal([-1], [-1], [1.0], [0], 0, 0)
        lpos, gpos = self._positions(m)
        root_count = lpos[0].count - 1 + (gpos[0].count if gpos is not None else 0)  # minus the trivial occurrence
        tokens, parents, scores, counts = [-1], [-1], [1.0], [root_count]
        heap: list[tuple] = []  # (-count, seq, parent, token, local pos, global pos, depth)
        seq = 0

        def push(idx: int, lp, gp, depth: int) -> None:
            nonlocal seq
            if depth >= cap:
                return
            for tok, c, clp, cgp in self._top_children(lp, gp, max_children):
                heapq.heappush(heap, (-c, seq, idx, tok, clp, cgp, depth + 1))
                seq += 1

        push(0, lpos, gpos, 0)
        while heap and len(tokens) <= max_nodes:
            negc, _, par, tok, lp, gp, depth = heapq.heappop(heap)
            tokens.append(tok)
            parents.append(par)
            scores.append(-negc / root_count)
            counts.append(-negc)
            push(len(tokens) - 1, lp, gp, depth)
        return SuffixProposal(tokens, parents, scores, counts, m, cap)
