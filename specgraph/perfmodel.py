"""Analytical performance model of speculative decoding.

Notation (Leviathan et al. 2023, Sec. 3): β is the per-token acceptance rate (assumed i.i.d.), γ the
number of drafted tokens per round, c the cost of one draft step relative to one target step.

* Expected tokens *emitted* per round, counting the correction/bonus token:
  ``E[N] = (1 - β^(γ+1)) / (1 - β)`` (γ + 1 when β = 1).
* A round costs ``γ c + 1`` target-step units (assuming the verification pass over γ+1 tokens costs
  one target step; pass ``verify_cost`` to use a measured cost instead).
* Speedup ``S = E[N] / (γ c + verify_cost)``.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch


def _check_beta(beta: float) -> None:
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"acceptance rate beta must be in [0, 1], got {beta}")


def expected_emitted(beta: float, gamma: int) -> float:
    """E[N] = (1 - β^(γ+1)) / (1 - β): mean tokens emitted per round (accepted + 1)."""
    _check_beta(beta)
    if gamma < 0:
        raise ValueError(f"gamma must be >= 0, got {gamma}")
    if beta == 1.0:
        return float(gamma + 1)
    return (1.0 - beta ** (gamma + 1)) / (1.0 - beta)


def expected_accepted(beta: float, gamma: int) -> float:
    """E[L] = E[N] - 1: mean draft tokens accepted per round."""
    return expected_emitted(beta, gamma) - 1.0


def speedup(beta: float, gamma: int, c: float, verify_cost: float = 1.0) -> float:
    """Expected wall-clock speedup over plain decoding: E[N] / (γ c + verify_cost)."""
    if c < 0:
        raise ValueError(f"cost ratio c must be >= 0, got {c}")
    if verify_cost <= 0:
        raise ValueError(f"verify_cost must be > 0, got {verify_cost}")
    return expected_emitted(beta, gamma) / (gamma * c + verify_cost)


def optimal_gamma(beta: float, c: float, max_gamma: int = 64, verify_cost=None) -> int:
    """γ* = argmax_γ S(β, γ, c) over 1..max_gamma.

    ``verify_cost`` may be a callable γ -> cost of verifying γ+1 tokens (in target-step units),
    e.g. from a measured cost curve; by default verification costs one step for any γ.
    """
    if max_gamma < 1:
        raise ValueError(f"max_gamma must be >= 1, got {max_gamma}")
    best_gamma, best = 1, -math.inf
    for g in range(1, max_gamma + 1):
        vc = 1.0 if verify_cost is None else float(verify_cost(g))
        s = speedup(beta, g, c, vc)
        if s > best + 1e-12:
            best_gamma, best = g, s
    return best_gamma


def tree_expected_accepted(parents, accept_prob) -> float:
    """Expected number of accepted draft nodes of a tree.

    ``accept_prob[i]`` is the probability that node i is accepted given its parent was reached
    (the root's entry is ignored). Reaching a node requires all its ancestors accepted, so
    E[accepted] = Σ_{i>0} Π_{a ∈ path(i)} accept_prob[a]. Siblings are treated as mutually
    exclusive events with the given marginal probabilities (their sum under one parent must not
    exceed 1).
    """
    from specgraph.trees import TreeSpec

    spec = parents if isinstance(parents, TreeSpec) else TreeSpec.from_parents(parents)
    probs = torch.as_tensor(accept_prob, dtype=torch.float64).flatten()
    if probs.numel() != spec.num_nodes:
        raise ValueError(f"accept_prob has {probs.numel()} entries, the tree has {spec.num_nodes} nodes")
    if ((probs < 0) | (probs > 1)).any():
        raise ValueError("accept_prob entries must be in [0, 1]")
    par = spec.parents.tolist()
    sibling_mass: dict[int, float] = {}
    for i in range(1, spec.num_nodes):
        sibling_mass[par[i]] = sibling_mass.get(par[i], 0.0) + float(probs[i])
    for node, mass in sibling_mass.items():
        if mass > 1.0 + 1e-9:
            raise ValueError(f"children of node {node} have acceptance probabilities summing to {mass:.4f} > 1")
    reach = [1.0] * spec.num_nodes
    for i in range(1, spec.num_nodes):
        reach[i] = reach[par[i]] * float(probs[i])
    return float(sum(reach[1:]))


def tree_expected_emitted(parents, accept_prob) -> float:
    """Expected tokens emitted per round by a tree: accepted nodes + 1."""
    return tree_expected_accepted(parents, accept_prob) + 1.0


def best_tree(rank_accept, num_nodes: int, max_depth: int) -> tuple[float, list[int]]:
    """The tree of at most ``num_nodes`` drafted nodes and depth ``max_depth`` with the most expected
    emitted tokens, when the child of rank r at depth d is accepted with probability
    ``rank_accept[d - 1][r]`` given its parent was (rows past the last repeat the last; ranks of one
    depth are disjoint events: each row must sum to <= 1).

    A node's reach probability is the product along its path, so a child never beats its parent:
    taking paths best-first (a heap) keeps the chosen set closed under ancestors, and the best N
    paths are the best tree of N nodes. Returns (expected emitted tokens = 1 + Σ reach, parents with
    -1 for the root, nodes in the order taken, a topological order)."""
    import heapq

    rows = [list(map(float, r)) for r in rank_accept]
    if not rows or any(not r for r in rows):
        raise ValueError("rank_accept needs at least one depth with at least one rank")
    for d, r in enumerate(rows, start=1):
        if any(p < 0 or p > 1 for p in r) or sum(r) > 1 + 1e-9:
            raise ValueError(f"rank_accept row of depth {d} must hold probabilities summing to <= 1, got {r}")
    if num_nodes < 0 or max_depth < 1:
        raise ValueError("num_nodes must be >= 0 and max_depth >= 1")
    parents, total = [-1], 1.0
    heap = [(-p, 0, r, 1) for r, p in enumerate(rows[0])]  # (-reach, parent node, rank, depth)
    heapq.heapify(heap)
    while heap and len(parents) <= num_nodes:
        neg, par, _, depth = heapq.heappop(heap)
        parents.append(par)
        total += -neg
        if depth < max_depth:
            row = rows[min(depth, len(rows) - 1)]
            node = len(parents) - 1
            for r, p in enumerate(row):
                heapq.heappush(heap, (neg * p, node, r, depth + 1))
    return total, parents


def speedup_table(betas: Sequence[float], gammas: Sequence[int], c: float) -> list[dict]:
    """Rows of {beta, gamma, c, expected_emitted, speedup} for printing."""
    return [
        {"beta": b, "gamma": g, "c": c, "expected_emitted": expected_emitted(b, g), "speedup": speedup(b, g, c)}
        for b in betas
        for g in gammas
    ]


# ----------------------------------------------------------------------------------------------
# measured costs: the planner and num_speculative_tokens="auto"
#
# The closed form above assumes verifying γ+1 tokens costs one step. That holds only while a step
# is memory-bound; with a batch of B rows a round processes B(γ+1) tokens and soon costs more. The
# objects below carry measured (or conservatively assumed) costs instead:
#
# * a *cost curve* t(N, B): seconds of one target round over N query tokens per row at batch B;
# * the *draft cost*: seconds per drafted token (a draft-model step; c = t_draft / t(1, B)) and per
#   round (the proposal's fixed part);
# * an *acceptance profile*: survival s_j = P(the first j drafts of a row are all accepted | the row
#   drafted), plus the rate at which rows draft at all (prompt lookup can find nothing).
#
# Expected speedup of depth γ at batch B over plain decoding (rows i.i.d., each drafting with
# probability p; the round runs at depth γ when any row drafted, probability P_B = 1 - (1-p)^B):
#
#     S(γ, B) = E[emitted](γ) T(0, B) / (P_B T(γ, B) + (1 - P_B) T(0, B)),
#     T(γ, B) = t(γ+1, B) + o(B) + [γ > 0] (d_round(B) + γ t_draft(B)),
#     E[emitted](γ) = 1 + p Σ_{j<=γ} s_j
#
# (o: the loop's host time per round) which for p = 1, o = d_round = 0 and s_j = β^j is
# E[N](β, γ) t(1, B) / (t(γ+1, B) + γ c t(1, B)).


def _pava(values: Sequence[float], weights: Sequence[float]) -> list[float]:
    """Non-decreasing least-squares fit (pool adjacent violators): a round over more query tokens
    never costs less, so a dip in the measurements is noise, not a feature to interpolate."""
    blocks: list[list[float]] = []  # [mean, weight, length]
    for v, w in zip(values, weights):
        blocks.append([float(v), float(w), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, w2, n2 = blocks.pop()
            m1, w1, n1 = blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    out: list[float] = []
    for m, _, n in blocks:
        out.extend([m] * n)
    return out


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear through (xs, ys) (xs increasing); the end segments extend linearly
    (a single point: constant), never below zero."""
    if len(xs) == 1:
        return float(ys[0])
    i = 1
    while i < len(xs) - 1 and x > xs[i]:
        i += 1
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]  # x below xs[0] or above xs[-1]: the end segment
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


class CostCurve:
    """t(N, B): seconds of one target round over N query tokens per row at batch bucket B, fitted
    from measurements. Per measured B: the median of the repeats at each N, made non-decreasing in
    N (:func:`_pava`), then piecewise-linear in N (linear past the grid's ends). Between measured
    batch sizes: linear in log2 B; above the largest, t grows in proportion to B (the
    compute-bound limit, pessimistic while memory-bound); below the smallest, the smallest's."""

    def __init__(self, table: dict[int, dict[int, float]]):
        if not table:
            raise ValueError("a cost curve needs measurements for at least one batch size")
        self.table = {int(b): {int(n): float(t) for n, t in sorted(row.items())} for b, row in sorted(table.items())}
        for b, row in self.table.items():
            if b < 1 or not row or min(row) < 1 or any(t <= 0 for t in row.values()):
                raise ValueError(f"bad cost table row for batch {b}: {row}")

    @classmethod
    def fit(cls, samples) -> "CostCurve":
        """``samples``: iterable of (B, N, seconds), repeats allowed."""
        import statistics

        by: dict[int, dict[int, list[float]]] = {}
        for b, n, t in samples:
            by.setdefault(int(b), {}).setdefault(int(n), []).append(float(t))
        table = {}
        for b, row in by.items():
            ns = sorted(row)
            med = [statistics.median(row[n]) for n in ns]
            table[b] = dict(zip(ns, _pava(med, [len(row[n]) for n in ns])))
        return cls(table)

    @property
    def batch_sizes(self) -> list[int]:
        return list(self.table)

    def _at(self, b: int, n: float) -> float:
        row = self.table[b]
        return _interp(list(row), list(row.values()), n)

    def __call__(self, n: float, b: int = 1) -> float:
        if n < 1 or b < 1:
            raise ValueError(f"need N >= 1 and B >= 1, got N={n}, B={b}")
        bs = self.batch_sizes
        if b in self.table:
            return self._at(b, n)
        if b < bs[0]:
            return self._at(bs[0], n)
        if b > bs[-1]:
            return self._at(bs[-1], n) * b / bs[-1]
        hi = next(x for x in bs if x > b)
        lo = max(x for x in bs if x < b)
        w = (math.log2(b) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
        return (1 - w) * self._at(lo, n) + w * self._at(hi, n)

    def to_dict(self) -> dict:
        return {"kind": "measured", "table": {str(b): {str(n): t for n, t in row.items()} for b, row in self.table.items()}}


class LinearCost:
    """A built-in cost curve for when nothing was measured: t(N, B) = overhead + per_token N B (in
    units of one weight pass). The default (per_token = 1/9 of the overhead) makes a round over 10
    tokens cost twice a plain step at batch 1, close to SmolLM2 on a 2-core CPU, and keeps
    growing with B N: conservative (a GPU is flatter), so unmeasured speculation errs towards off."""

    def __init__(self, overhead: float = 1.0, per_token: float = 1.0 / 9.0):
        if overhead <= 0 or per_token < 0:
            raise ValueError(f"need overhead > 0 and per_token >= 0, got {overhead}, {per_token}")
        self.overhead, self.per_token = float(overhead), float(per_token)

    def __call__(self, n: float, b: int = 1) -> float:
        if n < 1 or b < 1:
            raise ValueError(f"need N >= 1 and B >= 1, got N={n}, B={b}")
        return self.overhead + self.per_token * n * b

    def to_dict(self) -> dict:
        return {"kind": "linear", "overhead": self.overhead, "per_token": self.per_token}


def cost_curve_from_dict(d: dict):
    if d.get("kind") == "linear":
        return LinearCost(d["overhead"], d["per_token"])
    if d.get("kind") == "measured":
        return CostCurve({int(b): {int(n): t for n, t in row.items()} for b, row in d["table"].items()})
    raise ValueError(f"unknown cost curve {d.get('kind')!r}")


def _per_batch(table: dict[int, float], b: int) -> float:
    """A per-batch-size cost (seconds) at B: interpolated in log2 B like :class:`CostCurve`,
    proportional to B above the largest measured size."""
    if not table:
        return 0.0
    bs = sorted(table)
    if b in table:
        return table[b]
    if b < bs[0]:
        return table[bs[0]]
    if b > bs[-1]:
        return table[bs[-1]] * b / bs[-1]
    hi = next(x for x in bs if x > b)
    lo = max(x for x in bs if x < b)
    w = (math.log2(b) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
    return (1 - w) * table[lo] + w * table[hi]


class CostModel:
    """The seconds of one round at depth γ and batch bucket B: the target's t(γ+1, B), the
    generation loop's own per-round time (``overhead``: {B: seconds}, host work around the graph,
    paid by plain rounds too) and, when γ > 0, the draft's per-round and per-token costs.
    ``draft_step``: {B: seconds of one draft step} (draft models; c = t_draft / t(1, B));
    ``draft_round``: {B: seconds of a proposal's fixed part} (host-side drafters). All default to
    free."""

    def __init__(self, target, draft_step: dict | None = None, draft_round: dict | None = None,
                 overhead: dict | None = None):
        self.target = target
        self.draft_step = {int(b): float(t) for b, t in (draft_step or {}).items()}
        self.draft_round = {int(b): float(t) for b, t in (draft_round or {}).items()}
        self.overhead = {int(b): float(t) for b, t in (overhead or {}).items()}

    def round_cost(self, gamma: int, b: int = 1) -> float:
        t = self.target(gamma + 1, b) + _per_batch(self.overhead, b)
        if gamma > 0:
            t += _per_batch(self.draft_round, b) + gamma * _per_batch(self.draft_step, b)
        return t

    def draft_ratio(self, b: int = 1) -> float:
        """c: one draft step's cost relative to one plain target step at batch B."""
        return _per_batch(self.draft_step, b) / self.target(1, b)

    def to_dict(self) -> dict:
        return {"target": self.target.to_dict(), "draft_step": {str(b): t for b, t in self.draft_step.items()},
                "draft_round": {str(b): t for b, t in self.draft_round.items()},
                "overhead": {str(b): t for b, t in self.overhead.items()}}

    @classmethod
    def from_dict(cls, d: dict) -> "CostModel":
        return cls(cost_curve_from_dict(d["target"]), {int(b): t for b, t in d.get("draft_step", {}).items()},
                   {int(b): t for b, t in d.get("draft_round", {}).items()},
                   {int(b): t for b, t in d.get("overhead", {}).items()})


class AcceptanceProfile:
    """How far a row's drafts survive: ``survival[j-1]`` = P(the first j drafts are all accepted |
    the row drafted), non-increasing, and ``draft_rate`` = P(a row drafts in a round). Past the
    measured depth the last conditional acceptance (s_J / s_{J-1}) repeats: geometric extrapolation."""

    def __init__(self, survival: Sequence[float], draft_rate: float = 1.0):
        s = [float(x) for x in survival]
        if not s:
            raise ValueError("an acceptance profile needs at least one position")
        if not 0.0 <= draft_rate <= 1.0:
            raise ValueError(f"draft_rate must be in [0, 1], got {draft_rate}")
        for i, x in enumerate(s):  # sampling noise can break monotonicity at deep, rarely reached positions
            if not 0.0 <= x <= 1.0 + 1e-9:
                raise ValueError(f"survival probabilities must be in [0, 1], got {s}")
            s[i] = min(x, s[i - 1]) if i else min(x, 1.0)
        self.survival, self.draft_rate = s, float(draft_rate)

    @classmethod
    def from_beta(cls, beta: float, depth: int = 8, draft_rate: float = 1.0) -> "AcceptanceProfile":
        """I.i.d. acceptance β per token (Leviathan et al.'s model): s_j = β^j."""
        _check_beta(beta)
        return cls([beta ** j for j in range(1, depth + 1)], draft_rate)

    @classmethod
    def from_counts(cls, accepted_at: Sequence[int], drafted_at: Sequence[int], row_rounds: int | None = None):
        """From a run's per-position counts (``GenerationStats``): ``accepted_at[j]`` row-rounds whose
        draft j was accepted, ``drafted_at[j]`` row-rounds that drafted position j; ``row_rounds``
        (all row-rounds, drafted or not) gives the draft rate (default 1)."""
        J = max((j + 1 for j, d in enumerate(drafted_at) if d > 0), default=0)
        if J == 0:
            return cls([0.0], 0.0)
        surv = [accepted_at[j] / drafted_at[j] if j < len(accepted_at) else 0.0 for j in range(J)]
        rate = 1.0 if row_rounds is None else min(1.0, drafted_at[0] / max(row_rounds, 1))
        return cls(surv, rate)

    def conditional(self, j: int) -> float:
        """P(draft j accepted | drafts 1..j-1 accepted), j >= 1."""
        s = self.survival
        if j <= len(s):
            prev = 1.0 if j == 1 else s[j - 2]
            return s[j - 1] / prev if prev > 0 else 0.0
        return self.conditional(len(s))

    def survival_at(self, j: int) -> float:
        s = self.survival
        if j <= len(s):
            return s[j - 1]
        return s[-1] * self.conditional(len(s)) ** (j - len(s))

    def expected_emitted(self, gamma: int) -> float:
        """Mean tokens a row emits per round at depth γ (1 when it did not draft)."""
        if gamma < 0:
            raise ValueError(f"gamma must be >= 0, got {gamma}")
        return 1.0 + self.draft_rate * sum(self.survival_at(j) for j in range(1, gamma + 1))

    def to_dict(self) -> dict:
        return {"survival": self.survival, "draft_rate": self.draft_rate}

    @classmethod
    def from_dict(cls, d: dict) -> "AcceptanceProfile":
        return cls(d["survival"], d.get("draft_rate", 1.0))


def predicted_speedup(profile: AcceptanceProfile, cost: CostModel, gamma: int, b: int = 1) -> float:
    """S(γ, B) of the module comment: tokens per second at depth γ over plain decoding, both at
    batch bucket B (γ = 0: exactly 1)."""
    if gamma == 0:
        return 1.0
    t1 = cost.round_cost(0, b)
    p_round = 1.0 - (1.0 - profile.draft_rate) ** b
    per_round = p_round * cost.round_cost(gamma, b) + (1.0 - p_round) * t1
    return profile.expected_emitted(gamma) * t1 / per_round


def recommend_gamma(profile: AcceptanceProfile, cost: CostModel, b: int = 1, depths: Sequence[int] = range(0, 65)) -> int:
    """argmax over ``depths`` of :func:`predicted_speedup` (0 = no speculation, speedup 1); ties go
    to the smaller depth (fewer graphs, less wasted compute)."""
    best, best_s = 0, 1.0
    for g in sorted(set(int(d) for d in depths) | {0}):
        s = predicted_speedup(profile, cost, g, b)
        if s > best_s * (1 + 1e-12):
            best, best_s = g, s
    return best


def predicted_workload_speedup(rows, cost: CostModel, gamma: int, b: int = 1) -> float:
    """Speedup of depth γ for a workload of sequences served in consecutive *static* batches of b
    rows (the sequence list cycled to fill the last batch; no sequence joins a running batch).
    ``rows``: (AcceptanceProfile, new tokens) per sequence.

    A static batch runs until its slowest row is done, so heterogeneous rows cost more than the
    per-round model says: row i needs about n_i / E_i(γ) rounds, the batch max_i of that, against
    max_i n_i plain rounds; a round drafts when any row drafts: 1 - Π (1 - p_i) over the batch's
    *distinct* sequences, since a sequence cycled into one batch twice decodes the same way twice and
    drafts in the same rounds (4 prompts cycled to B = 16 and counted as 16 independent rows would
    predict far too many drafting rounds)."""
    rows = list(rows)
    if not rows:
        raise ValueError("a workload needs at least one sequence")
    if gamma == 0:
        return 1.0
    t0, tg = cost.round_cost(0, b), cost.round_cost(gamma, b)
    plain = spec = 0.0
    for start in range(0, len(rows), b):
        members = {(start + j) % len(rows) for j in range(b)}
        n_max = max(rows[i][1] for i in members)
        rounds = max(rows[i][1] / rows[i][0].expected_emitted(gamma) for i in members)
        p_round = 1.0 - math.prod(1.0 - rows[i][0].draft_rate for i in members)
        plain += n_max * t0
        spec += rounds * (p_round * tg + (1.0 - p_round) * t0)
    return plain / spec
