"""Statistical proofs that ``verify_chain`` / ``verify_tree`` are exact (lossless), with negative controls.

Method
------
Every test builds a target law and a draft law, drafts *honestly* (``torch.multinomial`` on the
draft distribution, seeded generator), runs one big batched verification call in which every row is
an independent trial, and compares the empirical law of the emitted tokens with the target law using
Pearson's chi-square goodness-of-fit test.

* Significance: ``ALPHA = 1e-4`` per goodness-of-fit test. A run performs a few hundred such tests,
  so under the null hypothesis (the library is exact) the family-wise false-rejection rate is at most
  a few percent (Bonferroni); all seeds are fixed (hypothesis ``derandomize=True``, seeded
  ``torch.Generator``), so CI is deterministic.
* Cells whose expected count is below ``MIN_EXPECTED`` are pooled. Tokens whose target probability is
  exactly 0 (``-inf`` logits, or filtered out by top-k / top-p / min-p) are not part of the chi-square
  test: they are checked exactly (the count must be 0).
* Power: the sample sizes (``N_TOKENS`` = 40k for single-token laws, ``N_JOINT`` = 60k for the joint law
  of two tokens, up to 64 cells) are chosen so that *any* law at total-variation distance
  ``TV_DETECT = 0.02`` from the target is rejected with probability >= ``MIN_POWER = 0.9``. The bound
  used: for a shift d with sum|d| = 2*delta, the chi-square non-centrality n*sum(d^2/p) is at least
  4*n*delta^2 (Cauchy-Schwarz on the positive and negative parts), so the power is at least
  ``ncx2.sf(chi2.isf(ALPHA, df), df, 4*n*delta^2)``. Every law test asserts this power for its own n and
  degrees of freedom (the mass of pooled cells is subtracted from delta, since a shift inside the pool
  is invisible), and ``test_power_*`` checks empirically that TV = 0.02 worst-case shifts are rejected.
* Negative controls (mutated samplers on fixed, hand-chosen laws) must be *rejected* by the same
  tests (p-value < ALPHA). For each one the test first computes the mutated law exactly and asserts
  that it is at least TV_DETECT away from the target (most are far more; the "subtle" chain controls
  sit at TV 0.02 - 0.04), so the mutation provably changes the law by a detectable amount.

Laws checked
------------
Chain (Leviathan et al. 2023 / Chen et al. 2023):
  (a) the first emitted token follows the target row 0;
  (b) for a fixed table of target/draft rows, given the round reached position k (the first k drafts
      were accepted), the k-th emitted token follows target row k -- in particular k = 1 and the bonus
      position k = K; the number emitted per round follows its exact law (acceptance rates
      beta_k = sum min(p_k, q_k));
  (c) with a Markov target P[a] (next-token law given the previous token) and Markov draft Q[a],
      target rows built per trial from the drafted prefix: the joint law of the first two generated
      tokens (across rounds) is P[x][t1] * P[t1][t2].
Tree (recursive rejection sampling for deterministic children; SpecInfer multi-step speculative
sampling for children drawn i.i.d. from q), on TreeSpec.from_paths([(0,), (1,), (2,), (0, 0), (0, 1),
(1, 0)]) with a Markov target: law of the first token and joint law of the first two tokens.
Warping: temperature != 1 and top_k / top_p / min_p; the target law is softmax(warp_logits(...)) and the
draft law is warped_probs(draft logits) with the same settings.

Note on a control that is not lossy: "sampled children verified as deterministic (draft_probs=None)"
is *not* lossy. Recursive rejection sampling is exact for any candidate list that is independent of
the verifier's randomness (conditionally on the list, "accept x1 w.p. p(x1); else accept x2 w.p.
p(x2)/(1-p(x1)); ...; else sample the rest" is just a sequential way of drawing from p), and i.i.d.
sampled siblings are such a list (duplicates are harmless: a rejected token has residual 0). It only
lowers the acceptance rate. ``test_tree_sampled_children_verified_as_deterministic_is_exact`` checks
this, and the lossy mirror image -- deterministic (top-m) children verified with the sampled-children
rule (draft_probs=q) -- is a negative control instead.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from scipy import stats

import specgraph.kernels.chain_reference as chain_ref
import specgraph.verify as sv
from specgraph import TreeSpec, tree_from_paths, verify_chain, verify_tree, warp_logits, warped_probs

ALPHA = 1e-4  # significance of every goodness-of-fit test
TV_DETECT = 0.02  # a law this far (total variation) from the target must be rejected ...
MIN_POWER = 0.9  # ... with at least this probability
MIN_EXPECTED = 10.0  # cells with a smaller expected count are pooled
N_TOKENS = 40_000  # trials for single-token laws
N_JOINT = 60_000  # trials for joint laws of two tokens (up to 8 x 8 cells)
B_MAX = 200_000  # cap when the batch is enlarged so that a conditional law still gets N_TOKENS trials
MIN_CONDITIONAL = 500  # deeper conditional laws are only tested with at least this many trials
SEED = 20240917

TREE_PATHS = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0)]

HYP = dict(
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)




# ==============================================================================================
# goodness of fit


def chi2_power(n: float, df: int, delta: float = TV_DETECT, alpha: float = ALPHA) -> float:
    """Lower bound on the power of the chi-square test (n trials, df degrees of freedom, level alpha)
    against every alternative at total-variation distance ``delta``: non-centrality >= 4 n delta^2."""
    if df < 1 or delta <= 0:
        return 0.0
    return float(stats.ncx2.sf(stats.chi2.isf(alpha, df), df, 4.0 * n * delta * delta))


@dataclass
class Gof:
    name: str
    n: int
    stat: float
    df: int
    pvalue: float
    zero_cell_hits: int  # emitted tokens whose target probability is exactly 0
    pooled_mass: float  # target mass of the pooled small cells
    counts: np.ndarray | None = None  # the observed counts, for re-testing against another law

    @property
    def rejects(self) -> bool:
        return self.zero_cell_hits > 0 or self.pvalue < ALPHA

    @property
    def power(self) -> float:
        """Power against any law at TV distance TV_DETECT (shifts inside the pool are invisible).

        With a single cell of positive probability every deviation lands on tokens of probability 0,
        which the exact zero check catches with probability 1 - (1 - TV)^n."""
        if self.df == 0 and self.pooled_mass == 0:
            return 1.0 - (1.0 - TV_DETECT) ** self.n
        return chi2_power(self.n, self.df, TV_DETECT - self.pooled_mass)

    def __str__(self) -> str:
        return (
            f"{self.name}: n={self.n} chi2={self.stat:.2f} df={self.df} p={self.pvalue:.3g} "
            f"zero-cell hits={self.zero_cell_hits} power(TV={TV_DETECT})={self.power:.3f}"
        )


def gof(name: str, counts, probs, zero_tol: int = 0) -> Gof:
    """Pearson chi-square test of ``counts`` against the law ``probs`` (same shape, any dims).

    Cells with probability exactly 0 are excluded and their counts reported as ``zero_cell_hits``
    (beyond ``zero_tol``); cells with expected count < MIN_EXPECTED are pooled into one cell (merged
    into the smallest regular cell if the pool itself is still too small).
    """
    c = observed = np.asarray(counts, dtype=np.float64).ravel()
    p = np.asarray(probs, dtype=np.float64).ravel()
    assert c.shape == p.shape
    assert np.all(p >= 0) and p.sum() > 0
    p = p / p.sum()
    n = int(c.sum())
    zero = p == 0
    zero_hits = int(c[zero].sum())
    zero_hits = 0 if zero_hits <= zero_tol else zero_hits
    c, p = c[~zero], p[~zero]
    n_pos = c.sum()
    small = n_pos * p < MIN_EXPECTED
    cells_c, cells_p = list(c[~small]), list(p[~small])
    pooled_mass = float(p[small].sum())
    if small.any():
        pc, pp = float(c[small].sum()), pooled_mass
        if n_pos * pp < MIN_EXPECTED and cells_p:
            i = int(np.argmin(cells_p))
            cells_c[i] += pc
            cells_p[i] += pp
        else:
            cells_c.append(pc)
            cells_p.append(pp)
    cc, pp = np.array(cells_c), np.array(cells_p)
    if len(cc) < 2 or n_pos == 0:
        return Gof(name, n, 0.0, 0, 1.0, zero_hits, pooled_mass, observed)
    expected = n_pos * pp
    stat = float(((cc - expected) ** 2 / expected).sum())
    df = len(cc) - 1
    return Gof(name, int(n_pos), stat, df, float(stats.chi2.sf(stat, df)), zero_hits, pooled_mass, observed)


def bincount(x: torch.Tensor, size: int) -> np.ndarray:
    x = x.reshape(-1)
    assert bool(((x >= 0) & (x < size)).all()), "token out of range"
    return torch.bincount(x, minlength=size).numpy()


def assert_accepts(res: Gof, require_power: bool = True) -> None:
    assert res.zero_cell_hits == 0, f"emitted a token of target probability 0 -- {res}"
    assert res.pvalue >= ALPHA, f"law differs from the target -- {res}"
    if require_power:
        assert res.power >= MIN_POWER, f"test too weak -- {res}"


def assert_rejects(res: Gof) -> None:
    assert res.pvalue < ALPHA, f"negative control NOT rejected -- {res}"


def assert_follows_mutated_law(res: Gof, mutated) -> None:
    """The counts a negative control produced fit the exactly computed mutated law: the mutation
    does what the control claims, and the rejection is not an artefact."""
    again = gof(f"{res.name} vs the mutated law", res.counts, mutated)
    assert again.zero_cell_hits == 0 and again.pvalue >= ALPHA, f"control's law is not the computed one -- {again}"


def tv(a, b) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return 0.5 * float(np.abs(a / a.sum() - b / b.sum()).sum())


# ==============================================================================================
# laws and draws


def to_logits(w: np.ndarray) -> torch.Tensor:
    """log of (unnormalised) weights, -inf where the weight is 0."""
    w = np.asarray(w, dtype=np.float64)
    with np.errstate(divide="ignore"):
        return torch.tensor(np.log(w / w.sum(axis=-1, keepdims=True)), dtype=torch.float32)


def target_law(logits: torch.Tensor, warp: dict) -> np.ndarray:
    """The target's sampling law: softmax(warp_logits(logits)), in float64."""
    return torch.softmax(warp_logits(logits, **warp).double(), dim=-1).numpy()


def draft_law(logits: torch.Tensor, warp: dict) -> torch.Tensor:
    """What the draft samples from (float32, as passed to verify)."""
    return warped_probs(logits, **warp)


def sample_next(table: torch.Tensor, prev: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One draw from table[prev[b]] for every trial b (grouped by previous token: a few vector
    ``torch.multinomial`` calls instead of one slow call on a [B, V] matrix)."""
    out = torch.empty_like(prev)
    for a in range(table.shape[0]):
        idx = (prev == a).nonzero().squeeze(1)
        if idx.numel():
            out[idx] = torch.multinomial(table[a], idx.numel(), replacement=True, generator=gen)
    return out


def no_warp() -> dict:
    return dict(temperature=1.0, top_k=None, top_p=None, min_p=None)


# ==============================================================================================
# format checks


def check_chain_format(tokens, num, drafts, K) -> None:
    B = drafts.shape[0]
    assert tokens.shape == (B, K + 1) and num.shape == (B,)
    assert bool(((num >= 1) & (num <= K + 1)).all()), "num_emitted outside 1..K+1"
    pos = torch.arange(K + 1).unsqueeze(0)
    emitted = pos < num.unsqueeze(1)
    assert bool((tokens[emitted] >= 0).all()), "an emitted token is negative"
    assert bool((tokens[~emitted] == -1).all()), "padding after the emitted tokens must be -1"
    acc = pos[:, :K] < (num - 1).unsqueeze(1)  # accepted drafts are emitted verbatim
    assert bool((tokens[:, :K][acc] == drafts[acc]).all()), "an accepted position differs from its draft"


def check_tree_format(path_tokens, num, path_nodes, tree_tokens, spec: TreeSpec) -> None:
    B, N = tree_tokens.shape
    D = spec.max_depth
    assert path_tokens.shape == (B, D + 1) and path_nodes.shape == (B, D + 1) and num.shape == (B,)
    assert bool(((num >= 1) & (num <= D + 1)).all()), "num_emitted outside 1..D+1"
    pos = torch.arange(D + 1).unsqueeze(0)
    emitted = pos < num.unsqueeze(1)
    assert bool((path_tokens[emitted] >= 0).all()) and bool((path_tokens[~emitted] == -1).all())
    assert bool((path_nodes[:, 0] == 0).all()), "path must start at the root"
    kept = pos < num.unsqueeze(1)  # root + (num - 1) accepted nodes
    assert bool((path_nodes[~kept] == -1).all()) and bool((path_nodes[kept] >= 0).all())
    parents = spec.parents
    for j in range(1, D + 1):
        rows = num > j
        node, prev = path_nodes[rows, j], path_nodes[rows, j - 1]
        assert bool((parents[node] == prev).all()), "path is not a root-to-leaf walk"
        assert bool((path_tokens[rows, j - 1] == tree_tokens[rows].gather(1, node[:, None]).squeeze(1)).all())


# ==============================================================================================
# hypothesis strategies


@st.composite
def weights(draw, V: int, kind: str | None = None) -> np.ndarray:
    """Unnormalised weights over V tokens: generic (some zeros), sparse, near-uniform, one-hot."""
    kind = kind or draw(st.sampled_from(["generic", "sparse", "near_uniform", "onehot"]))
    w = np.zeros(V)
    if kind == "generic":
        w[:] = draw(st.lists(st.integers(1, 30), min_size=V, max_size=V))
        zero = np.array(draw(st.lists(st.booleans(), min_size=V, max_size=V)))
        if not zero.all():
            w[zero] = 0
    elif kind == "sparse":
        perm = draw(st.permutations(range(V)))
        s = draw(st.integers(1, V - 1))
        for i in perm[:s]:
            w[i] = draw(st.integers(1, 30))
    elif kind == "near_uniform":
        w[:] = [1000 + draw(st.integers(-40, 40)) for _ in range(V)]
    else:
        w[draw(st.integers(0, V - 1))] = 1
    return w


@st.composite
def pq_pair(draw, V: int) -> tuple[np.ndarray, np.ndarray]:
    """(target weights, draft weights): independent, close, disjoint supports or equal."""
    rel = draw(st.sampled_from(["independent", "close", "disjoint", "equal"]))
    if rel == "disjoint":
        perm = draw(st.permutations(range(V)))
        s = draw(st.integers(1, V - 1))
        p, q = np.zeros(V), np.zeros(V)
        for i in perm[:s]:
            p[i] = draw(st.integers(1, 30))
        for i in perm[s:]:
            q[i] = draw(st.integers(1, 30))
    elif rel == "equal":
        p = draw(weights(V))
        q = p.copy()
    elif rel == "close":
        p = draw(weights(V))
        p = p / p.sum() * 100
        q = p + np.array(draw(st.lists(st.integers(0, 4), min_size=V, max_size=V)), dtype=np.float64)
    else:
        p, q = draw(weights(V)), draw(weights(V))
    return p, q


# constants chosen away from the rational probabilities the weights produce, so that no top-p / min-p
# threshold lands exactly on a boundary (where float rounding would decide).
TOP_P = [0.5772156649, 0.6180339887, 0.8414709848, 0.9238795325, 1.0]
MIN_P = [0.0, 0.0523359562, 0.1414213562, 0.3678794412]


@st.composite
def warp_settings(draw, V: int) -> dict:
    return dict(
        temperature=draw(st.sampled_from([0.5, 0.7, 1.0, 1.3, 2.5])),
        top_k=draw(st.none() | st.integers(1, V)),
        top_p=draw(st.none() | st.sampled_from(TOP_P)),
        min_p=draw(st.none() | st.sampled_from(MIN_P)),
    )


# ==============================================================================================
# chain, fixed table of rows (laws (a) and (b))


def run_chain_fixed_table(target_logits: torch.Tensor, draft_logits: torch.Tensor, warp: dict, verify=None):
    """target_logits [K+1, V] and draft_logits [K, V] (the same rows for every trial).

    Returns (p [K+1, V] float64 target laws, q [K, V] float32 draft laws, drafts, tokens, num).
    """
    verify = verify or verify_chain
    K1, V = target_logits.shape
    K = K1 - 1
    p = target_law(target_logits, warp)
    q = draft_law(draft_logits, warp)
    beta0 = float(np.minimum(p[0], q[0].double().numpy()).sum())
    # enlarge the batch so that the law at position 1 (given position 0 accepted) still gets N_TOKENS trials
    B = N_TOKENS if beta0 <= 0 else int(min(B_MAX, max(N_TOKENS, math.ceil(N_TOKENS / beta0))))
    gen = torch.Generator().manual_seed(SEED)
    drafts = torch.stack([torch.multinomial(q[k], B, replacement=True, generator=gen) for k in range(K)], dim=1)
    tl = target_logits.unsqueeze(0).expand(B, K1, V)
    dp = q.unsqueeze(0).expand(B, K, V)
    tokens, num = verify(tl, dp, drafts, **warp, generator=gen)
    return p, q, drafts, tokens, num


def round_length_law(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """P(num_emitted = j + 1), j = 0..K, for Leviathan's sampler: acceptance at k w.p. beta_k."""
    K = q.shape[0]
    beta = np.minimum(p[:K], q).sum(axis=1)
    law, reach = np.zeros(K + 1), 1.0
    for j in range(K):
        law[j] = reach * (1 - beta[j])
        reach *= beta[j]
    law[K] = reach
    return np.clip(law, 0.0, None)


def check_chain_fixed_table(target_logits, draft_logits, warp) -> None:
    p, q, drafts, tokens, num = run_chain_fixed_table(target_logits, draft_logits, warp)
    K1, V = target_logits.shape
    K = K1 - 1
    check_chain_format(tokens, num, drafts, K)
    B = drafts.shape[0]
    beta0 = float(np.minimum(p[0], q[0].double().numpy()).sum())
    # (a) first token
    assert_accepts(gof("first token", bincount(tokens[:, 0], V), p[0]))
    # (b) token at position k given that the first k drafts were accepted (k = K is the bonus)
    for k in range(1, K + 1):
        rows = num > k
        n_k = int(rows.sum())
        res = gof(f"position {k} | reached", bincount(tokens[rows, k], V), p[k])
        assert res.zero_cell_hits == 0, f"emitted a token of target probability 0 -- {res}"
        if n_k >= MIN_CONDITIONAL:
            # full power is asserted for position 1 whenever the batch could be sized for it
            assert_accepts(res, require_power=(k == 1 and beta0 * B_MAX >= N_TOKENS))
    # exact law of the round length (a property of Leviathan's sampler: acceptance rate beta_k).
    # near-zero cells (beta == 1) may be hit by float32 rounding of p and q: tolerate a handful.
    law = round_length_law(p, q.double().numpy())
    res = gof("num_emitted", bincount(num - 1, K + 1), law, zero_tol=max(2, B // 100_000))
    assert_accepts(res, require_power=False)


@st.composite
def chain_table_case(draw, warped: bool):
    V = draw(st.integers(3, 8))
    K = draw(st.integers(1, 4))
    pairs = [draw(pq_pair(V)) for _ in range(K)]
    bonus = draw(weights(V))
    tl = to_logits(np.stack([pp for pp, _ in pairs] + [bonus]))
    dl = to_logits(np.stack([qq for _, qq in pairs]))
    return tl, dl, (draw(warp_settings(V)) if warped else no_warp())


def table(p_rows, q_rows, warp=None):
    """An explicit chain case: target rows p_0..p_K and draft rows q_0..q_{K-1} (weights)."""
    return to_logits(np.array(p_rows, np.float64)), to_logits(np.array(q_rows, np.float64)), warp or no_warp()


NEAR_UNIFORM_8 = [1000, 1013, 987, 1021, 995, 1004, 979, 1030]
# explicit cases (run before the generated ones): zeros in p, zeros in q, disjoint supports, p = q,
# one-hot, near-uniform; the largest K and V.
CHAIN_EXAMPLES = [
    table([[0, 3, 1, 0, 6], [5, 1, 0, 2, 2], [1, 1, 1, 1, 1]], [[2, 0, 1, 5, 0], [0, 0, 1, 0, 0]]),
    table([[1, 2, 0, 0], [3, 1, 1, 1]], [[0, 0, 3, 1]]),  # disjoint: never accepted
    table([[4, 0, 2, 1, 1, 3, 0, 5]] * 4 + [[1, 2, 3, 4, 5, 6, 7, 8]], [[4, 0, 2, 1, 1, 3, 0, 5]] * 4),  # p = q
    table([[0, 0, 1], [2, 1, 1], [1, 0, 3]], [[1, 1, 1], [0, 1, 0]]),  # one-hot p, one-hot q
    table([NEAR_UNIFORM_8, NEAR_UNIFORM_8[::-1], [9, 1, 0, 0, 3, 3, 1, 1]], [[1, 2, 3, 4, 5, 6, 7, 8], NEAR_UNIFORM_8]),
]
WARP_EXAMPLES = [
    dict(temperature=0.7, top_k=3, top_p=None, min_p=None),
    dict(temperature=1.3, top_k=None, top_p=0.8414709848, min_p=None),
    dict(temperature=0.5, top_k=None, top_p=None, min_p=0.1414213562),
    dict(temperature=2.5, top_k=4, top_p=0.9238795325, min_p=0.0523359562),
]


def with_examples(cases):
    def deco(fn):
        for case in reversed(cases):
            fn = example(case=case)(fn)
        return fn

    return deco


@settings(max_examples=25, **HYP)
@given(case=chain_table_case(warped=False))
@with_examples(CHAIN_EXAMPLES)
def test_chain_fixed_table_laws(case):
    """(a) first token ~ p0; (b) token k given positions < k accepted ~ p_k; round-length law."""
    check_chain_fixed_table(*case)


@settings(max_examples=20, **HYP)
@given(case=chain_table_case(warped=True))
@with_examples([(tl, dl, w) for (tl, dl, _), w in zip(CHAIN_EXAMPLES, WARP_EXAMPLES)])
def test_chain_fixed_table_laws_warped(case):
    """Same with temperature / top-k / top-p / min-p: the target law is softmax(warp_logits(.)) and
    the drafts come from warped_probs(draft logits) with the same settings."""
    check_chain_fixed_table(*case)


# ==============================================================================================
# Markov target: sequences across rounds (law (c), chains and trees)


class MarkovModel:
    """Target logits TL[a] and draft logits DL[a] ([V, V]): next-token laws given the previous token."""

    def __init__(self, target_logits: torch.Tensor, draft_logits: torch.Tensor, warp: dict):
        self.TL, self.warp = target_logits, warp
        self.P = target_law(target_logits, warp)  # [V, V] float64 target law
        self.Q = draft_law(draft_logits, warp)  # [V, V] float32 draft law
        self.V = target_logits.shape[0]

    def joint2(self, x: int) -> np.ndarray:
        """Law of the first two generated tokens after context x: P[x][t1] * P[t1][t2]."""
        return self.P[x][:, None] * self.P


def generate(round_fn, context: torch.Tensor, length: int) -> torch.Tensor:
    """Run verification rounds (each emits >= 1 token) until every trial has ``length`` tokens."""
    B = context.shape[0]
    seq = torch.full((B, length), -1, dtype=torch.long)
    filled = torch.zeros(B, dtype=torch.long)
    last = context.clone()
    todo = torch.arange(B)  # trials that still need tokens
    while todo.numel() > 0:
        toks, num = round_fn(last[todo])
        for j in range(toks.shape[1]):
            pos = filled[todo] + j
            ok = (j < num) & (pos < length)
            seq[todo[ok], pos[ok]] = toks[ok, j]
        last[todo] = toks.gather(1, (num - 1).unsqueeze(1)).squeeze(1)
        filled[todo] = (filled[todo] + num).clamp_max(length)
        todo = todo[filled[todo] < length]
    return seq


def chain_round_fn(model: MarkovModel, K: int, gen: torch.Generator, verify=None):
    verify = verify or verify_chain

    def round_fn(ctx: torch.Tensor):
        prev, drafts = ctx, []
        for _ in range(K):
            prev = sample_next(model.Q, prev, gen)
            drafts.append(prev)
        drafts = torch.stack(drafts, dim=1)  # [B, K]
        rows = torch.cat([ctx.unsqueeze(1), drafts], dim=1)  # the token before each position
        tokens, num = verify(model.TL[rows], model.Q[rows[:, :K]], drafts, **model.warp, generator=gen)
        check_chain_format(tokens, num, drafts, K)
        return tokens, num

    return round_fn


def tree_round_fn(model: MarkovModel, scheme: str, gen: torch.Generator, paths=TREE_PATHS):
    """Tree rounds. scheme: 'topm' (deterministic children: the top-m tokens of Q[parent token]),
    'distinct' (deterministic children: arbitrary distinct tokens, a random permutation independent of
    the verifier), 'sampled' (children i.i.d. from Q[parent token], draft_probs = Q rows),
    'sampled_rrs' (children i.i.d. from Q, verified as deterministic: draft_probs=None),
    'topm_as_sampled' (NEGATIVE CONTROL: top-m children passed with draft_probs = Q)."""
    spec, rank = tree_from_paths(paths)
    parents, rank = spec.parents.tolist(), rank.tolist()
    N = spec.num_nodes
    order = torch.argsort(model.Q, dim=-1, descending=True, stable=True)  # [V, V] tokens by draft rank

    def round_fn(ctx: torch.Tensor):
        B = ctx.shape[0]
        tt = torch.empty(B, N, dtype=torch.long)
        tt[:, 0] = ctx
        perms = {}
        for i in range(1, N):
            j = parents[i]
            par_tok = tt[:, j]
            if scheme in ("topm", "topm_as_sampled"):
                tt[:, i] = order[par_tok, rank[i]]
            elif scheme == "distinct":
                if j not in perms:
                    perms[j] = torch.rand(B, model.V, generator=gen).argsort(dim=-1)
                tt[:, i] = perms[j][:, rank[i]]
            else:
                tt[:, i] = sample_next(model.Q, par_tok, gen)
        dp = model.Q[tt] if scheme in ("sampled", "topm_as_sampled") else None
        path_tokens, num, path_nodes = verify_tree(model.TL[tt], dp, tt, spec, **model.warp, generator=gen)
        check_tree_format(path_tokens, num, path_nodes, tt, spec)
        return path_tokens, num

    return round_fn


def markov_sequences(model: MarkovModel, round_fn_factory, x: int, n: int = N_JOINT) -> torch.Tensor:
    gen = torch.Generator().manual_seed(SEED)
    ctx = torch.full((n,), x, dtype=torch.long)
    return generate(round_fn_factory(gen), ctx, 2)


def markov_laws(model: MarkovModel, seq: torch.Tensor, x: int) -> tuple[Gof, Gof]:
    V = model.V
    first = gof("first token", bincount(seq[:, 0], V), model.P[x])
    joint = gof("first two tokens", bincount(seq[:, 0] * V + seq[:, 1], V * V), model.joint2(x))
    return first, joint


@st.composite
def markov_case(draw, warped: bool):
    V = draw(st.integers(3, 8))
    pairs = [draw(pq_pair(V)) for _ in range(V)]
    tl = to_logits(np.stack([pp for pp, _ in pairs]))
    dl = to_logits(np.stack([qq for _, qq in pairs]))
    warp = draw(warp_settings(V)) if warped else no_warp()
    x = draw(st.integers(0, V - 1))
    return MarkovModel(tl, dl, warp), x


def markov(P, Q, x, warp=None):
    """An explicit Markov case from target / draft weight tables."""
    return MarkovModel(to_logits(np.array(P, np.float64)), to_logits(np.array(Q, np.float64)), warp or no_warp()), x


_P4 = [[0, 3, 1, 6], [5, 1, 0, 2], [1, 1, 1, 1], [0, 0, 2, 1]]
_Q4 = [[2, 0, 1, 5], [1, 1, 1, 1], [0, 1, 0, 0], [3, 0, 0, 1]]
_P5 = [[4, 1, 0, 2, 3], [1, 1, 1, 1, 6], [0, 0, 5, 1, 1], [2, 7, 1, 0, 0], [3, 3, 3, 1, 0]]
_P6 = [[3 if j in (a, (a + 1) % 6) else 0 for j in range(6)] for a in range(6)]
_Q6 = [[0 if j in (a, (a + 1) % 6) else 1 + j for j in range(6)] for a in range(6)]
_P8 = [NEAR_UNIFORM_8[a:] + NEAR_UNIFORM_8[:a] for a in range(8)]
_Q8 = [[1 if j == (a + 3) % 8 else 0 for j in range(8)] for a in range(8)]
MARKOV_EXAMPLES = [
    markov(_P4, _Q4, 0),  # zeros in p and in q
    markov(_P5, _P5, 1),  # q = p: every draft accepted, deepest paths
    markov(_P6, _Q6, 2),  # disjoint supports in every row
    markov(_P8, _Q8, 5),  # near-uniform p, one-hot q, V = 8
]
MARKOV_WARPED_EXAMPLES = [
    markov(_P4, _Q4, 0, WARP_EXAMPLES[0]),
    markov(_P5, _P5, 1, WARP_EXAMPLES[1]),
    markov(_P8, _Q8, 5, WARP_EXAMPLES[2]),
    markov(_P8, _P8, 3, WARP_EXAMPLES[3]),
]
TREE_SCHEMES = ["topm", "distinct", "sampled"]


def with_markov_examples(cases, name, values):
    def deco(fn):
        for i, case in reversed(list(enumerate(cases))):
            fn = example(case=case, **{name: values[i % len(values)]})(fn)
        return fn

    return deco


@settings(max_examples=20, **HYP)
@given(case=markov_case(warped=False), K=st.integers(1, 4))
@with_markov_examples(MARKOV_EXAMPLES, "K", [1, 4, 2, 3])
def test_chain_markov_joint_law(case, K):
    """(c) rows conditioned on the drafted prefix: the first two generated tokens follow P[x][t1] P[t1][t2]."""
    model, x = case
    seq = markov_sequences(model, lambda gen: chain_round_fn(model, K, gen), x)
    for res in markov_laws(model, seq, x):
        assert_accepts(res)


@settings(max_examples=15, **HYP)
@given(case=markov_case(warped=True), K=st.integers(1, 4))
@with_markov_examples(MARKOV_WARPED_EXAMPLES, "K", [2, 4, 1, 3])
def test_chain_markov_joint_law_warped(case, K):
    model, x = case
    seq = markov_sequences(model, lambda gen: chain_round_fn(model, K, gen), x)
    for res in markov_laws(model, seq, x):
        assert_accepts(res)


@settings(max_examples=25, **HYP)
@given(case=markov_case(warped=False), scheme=st.sampled_from(TREE_SCHEMES))
@with_markov_examples([c for c in MARKOV_EXAMPLES for _ in TREE_SCHEMES], "scheme", TREE_SCHEMES)
def test_tree_markov_joint_law(case, scheme):
    """Both child schemes on the small tree, rows at deeper nodes depend on the node's token."""
    model, x = case
    seq = markov_sequences(model, lambda gen: tree_round_fn(model, scheme, gen), x)
    for res in markov_laws(model, seq, x):
        assert_accepts(res)


@settings(max_examples=20, **HYP)
@given(case=markov_case(warped=True), scheme=st.sampled_from(TREE_SCHEMES))
@with_markov_examples(MARKOV_WARPED_EXAMPLES, "scheme", TREE_SCHEMES)
def test_tree_markov_joint_law_warped(case, scheme):
    model, x = case
    seq = markov_sequences(model, lambda gen: tree_round_fn(model, scheme, gen), x)
    for res in markov_laws(model, seq, x):
        assert_accepts(res)


@settings(max_examples=8, **HYP)
@given(case=markov_case(warped=False))
@with_examples(MARKOV_EXAMPLES[:2])
def test_tree_sampled_children_verified_as_deterministic_is_exact(case):
    """Children drawn i.i.d. from q but verified with draft_probs=None (recursive rejection sampling):
    still exact, because RRS is exact for any candidate list independent of the verifier."""
    model, x = case
    seq = markov_sequences(model, lambda gen: tree_round_fn(model, "sampled_rrs", gen), x)
    for res in markov_laws(model, seq, x):
        assert_accepts(res)


# ==============================================================================================
# power of the tests


def worst_case_shift(p: np.ndarray, delta: float) -> np.ndarray:
    """A law at TV distance delta from p that is hardest for the chi-square test: mass moved
    proportionally from a set A with p(A) close to 1/2 to its complement."""
    p = np.asarray(p, np.float64).ravel()
    order = np.argsort(-p)
    A, mass = [], 0.0
    for i in order:
        if abs(mass + p[i] - 0.5) < abs(mass - 0.5):
            A.append(i)
            mass += p[i]
    inA = np.zeros(p.shape, bool)
    inA[A] = True
    shifted = p.copy()
    shifted[inA] -= delta * p[inA] / p[inA].sum()
    shifted[~inA] += delta * p[~inA] / p[~inA].sum()
    assert abs(tv(shifted, p) - delta) < 1e-12
    return shifted


POWER_LAWS = {
    "uniform-8": (np.full(8, 1 / 8), N_TOKENS),
    "skewed-8": (np.array([0.35, 0.2, 0.15, 0.1, 0.08, 0.06, 0.04, 0.02]), N_TOKENS),
    "one-dominant-3": (np.array([0.9, 0.07, 0.03]), N_TOKENS),
    "joint-8x8": (np.outer(np.linspace(1, 2, 8), np.linspace(2, 1, 8)).ravel(), N_JOINT),
    "joint-8x8-sparse": (np.outer([5, 3, 2, 1, 1, 0.5, 0.2, 0.1], [4, 1, 1, 1, 1, 1, 1, 2]).ravel(), N_JOINT),
}


@pytest.mark.parametrize("name", sorted(POWER_LAWS))
def test_power_against_tv_shift(name):
    """At the sample sizes used above, a TV = 0.02 (worst-case) shift of the law is rejected, while
    the law itself is not."""
    p, n = POWER_LAWS[name]
    p = p / p.sum()
    df = p.size - 1
    assert chi2_power(n, df) >= MIN_POWER
    rng = np.random.default_rng(SEED)
    shifted = worst_case_shift(p, TV_DETECT)
    reps = 40
    rejected = sum(gof("shifted", rng.multinomial(n, shifted), p).rejects for _ in range(reps))
    false_alarms = sum(gof("null", rng.multinomial(n, p), p).rejects for _ in range(reps))
    assert rejected >= 0.8 * reps, f"{name}: only {rejected}/{reps} TV={TV_DETECT} shifts rejected at n={n}"
    assert false_alarms == 0, f"{name}: {false_alarms}/{reps} false rejections at alpha={ALPHA}"


def test_power_design_covers_all_tests():
    """The worst case of the hypothesis tests: 7 df at N_TOKENS and 63 df at N_JOINT."""
    assert chi2_power(N_TOKENS, 7) >= MIN_POWER
    assert chi2_power(N_JOINT, 63) >= MIN_POWER


# ==============================================================================================
# exact laws of single decisions (for the negative controls)


def chain_step_law(p, q_true, q_passed=None, residual=lambda p, q: np.maximum(p - q, 0), always_accept=False):
    """Exact law of the token emitted at one chain position when the draft comes from ``q_true`` but
    the verifier is told ``q_passed`` (and uses the given residual / acceptance)."""
    p, q_true = np.asarray(p, np.float64), np.asarray(q_true, np.float64)
    q_passed = q_true if q_passed is None else np.asarray(q_passed, np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        a = np.ones_like(p) if always_accept else np.where(q_passed > 0, np.minimum(1, p / q_passed), 0.0)
    r = residual(p, q_passed)
    r = p if r.sum() <= 0 else r / r.sum()
    reject = float((q_true * (1 - a)).sum())
    return q_true * a + reject * r


def tree_node_law(p, kids, q=None, mode="correct"):
    """Exact law of the token emitted at a node with target law p and the fixed child tokens ``kids``.

    q None: recursive rejection sampling ('correct'; 'no_renorm': the rejected child's mass is removed
    but S is not decreased; 'no_removal': a rejected child is left in the residual). q given: the
    sampled-children rule accept w.p. min(1, r(x)/q(x)), r <- norm(max(0, r - q)) ('correct'; with
    'no_renorm' the acceptance uses the unnormalised residual R(x)/q(x)).
    """
    p = np.asarray(p, np.float64)
    R, S, reach, law = p.copy(), 1.0, 1.0, np.zeros_like(p)
    for x in kids:
        if q is None:
            a = R[x] / S if S > 0 else 0.0
        else:
            scale = S if mode == "correct" else 1.0
            a = min(1.0, R[x] / (scale * q[x])) if scale * q[x] > 0 else 0.0
        law[x] += reach * a
        reach *= 1 - a
        if q is None:
            if mode == "correct":
                S -= R[x]
            if mode != "no_removal":
                R[x] = 0.0
        else:
            R = np.maximum(R - S * q, 0.0)
            S = R.sum()
    law += reach * (R / R.sum() if R.sum() > 0 else p)
    return law


def sampled_node_law(p, q, m: int, mode: str = "correct"):
    """Exact law at a node whose m children are drawn i.i.d. from q (sum over all V^m child lists)."""
    p, q = np.asarray(p, np.float64), np.asarray(q, np.float64)
    law = np.zeros_like(p)
    for kids in itertools.product(range(p.size), repeat=m):
        law += np.prod(q[list(kids)]) * tree_node_law(p, kids, q=q, mode=mode)
    return law


def test_exact_law_calculators_are_exact_for_the_correct_rules():
    """Sanity check of the calculators used to prove the controls change the law."""
    p = np.array([0.4, 0.3, 0.2, 0.1])
    q = np.array([0.1, 0.2, 0.3, 0.4])
    np.testing.assert_allclose(chain_step_law(p, q), p, atol=1e-12)
    for kids in ([0, 1, 2], [3, 3, 1], [2]):
        np.testing.assert_allclose(tree_node_law(p, kids), p, atol=1e-12)
    # sampled-children rule: exact on average over kids drawn i.i.d. from q
    for m in (1, 2, 3):
        np.testing.assert_allclose(sampled_node_law(p, q, m), p, atol=1e-12)


# ==============================================================================================
# negative controls: chain

P0 = np.array([0.45, 0.25, 0.2, 0.1])
Q0 = np.array([0.1, 0.2, 0.3, 0.4])
P1 = np.array([0.1, 0.2, 0.3, 0.4])
# "subtle": p and q close, so that the mutations below move the law by only TV 0.02 - 0.04
PS = np.array([0.3, 0.3, 0.2, 0.2])
QS = np.array([0.26, 0.3, 0.24, 0.2])
CONTROL_LAWS = {"strong": (P0, Q0), "subtle": (PS, QS)}


def chain_first_token_control(p0, q0, verify=None) -> Gof:
    """K = 1, rows (p0, P1), draft q0: the test of law (a)."""
    tl, dl = to_logits(np.stack([p0, P1])), to_logits(q0[None])
    p, q, drafts, tokens, num = run_chain_fixed_table(tl, dl, no_warp(), verify=verify)
    return gof("first token", bincount(tokens[:, 0], 4), p[0])


@pytest.mark.parametrize("laws", sorted(CONTROL_LAWS))
def test_control_chain_correct_sampler_passes(laws):
    """The fixed laws used below do pass with the unmutated library."""
    assert_accepts(chain_first_token_control(*CONTROL_LAWS[laws]))


@pytest.mark.parametrize("laws", sorted(CONTROL_LAWS))
def test_control_chain_always_accept(monkeypatch, laws):
    """(1) Accept every draft (and emit a bonus): the first token follows q, not p."""
    p0, q0 = CONTROL_LAWS[laws]
    mutated = chain_step_law(p0, q0, always_accept=True)
    assert tv(mutated, p0) >= TV_DETECT - 1e-9
    monkeypatch.setattr(chain_ref, "accept_test", lambda u, p_tok, q_tok: torch.ones_like(u, dtype=torch.bool))
    res = chain_first_token_control(p0, q0)
    assert_rejects(res)
    assert_follows_mutated_law(res, mutated)


@pytest.mark.parametrize("laws", sorted(CONTROL_LAWS))
def test_control_chain_residual_without_clamp(monkeypatch, laws):
    """(2) Residual |p - q| instead of max(0, p - q) (with the subtle laws the law moves by TV 0.02)."""
    p0, q0 = CONTROL_LAWS[laws]
    mutated = chain_step_law(p0, q0, residual=lambda p, q: np.abs(p - q))
    assert tv(mutated, p0) >= TV_DETECT - 1e-9
    monkeypatch.setattr(chain_ref, "residual", lambda p, q: (p - q).abs())
    res = chain_first_token_control(p0, q0)
    assert_rejects(res)
    assert_follows_mutated_law(res, mutated)


PB = np.array([0.1, 0.2, 0.3, 0.4])  # bonus row (position K)
PL = np.array([0.4, 0.3, 0.2, 0.1])  # last draft row's target
QL = np.array([0.25, 0.25, 0.25, 0.25])  # last draft row's draft law


def bonus_control(verify=None) -> Gof:
    """K = 1, rows (PL, PB), draft QL: law of the bonus token given the draft was accepted."""
    tl, dl = to_logits(np.stack([PL, PB])), to_logits(QL[None])
    p, q, drafts, tokens, num = run_chain_fixed_table(tl, dl, no_warp(), verify=verify)
    rows = num == 2
    return gof("bonus | all accepted", bincount(tokens[rows, 1], 4), p[1])


def test_control_chain_bonus_correct_sampler_passes():
    assert_accepts(bonus_control())


def test_control_chain_bonus_from_last_draft_row(monkeypatch):
    """(3) No real bonus token: when all K drafts are accepted the extra token is resampled from the
    last draft row's residual (an off-by-one) instead of drawn from the bonus row p_K."""
    mutated = np.maximum(PL - QL, 0) / np.maximum(PL - QL, 0).sum()
    assert tv(mutated, PB) >= 0.05
    original = sv.chain_outcomes

    def off_by_one(warped, draft_probs, draft_tokens, accept_u, expo):
        accepted, recovered = original(warped, draft_probs, draft_tokens, accept_u, expo)
        recovered = recovered.clone()
        recovered[:, -1] = recovered[:, -2]
        return accepted, recovered

    monkeypatch.setattr(sv, "chain_outcomes", off_by_one)
    res = bonus_control()
    assert_rejects(res)
    assert_follows_mutated_law(res, mutated)


def test_control_chain_no_bonus_breaks_round_length_law():
    """(3') Emitting nothing extra when all K are accepted keeps the token law (the next round draws
    the same token) but is caught by the round-length law, whose last cell is then empty."""
    tl, dl = to_logits(np.stack([PL, PL, PB])), to_logits(np.stack([QL, QL]))

    def no_bonus(*args, **kwargs):
        tokens, num = verify_chain(*args, **kwargs)
        K = tokens.shape[1] - 1
        full = num == K + 1
        tokens = tokens.clone()
        tokens[full, K] = -1
        return tokens, torch.where(full, num - 1, num)

    p, q, drafts, tokens, num = run_chain_fixed_table(tl, dl, no_warp(), verify=no_bonus)
    law = round_length_law(p, q.double().numpy())
    assert law[-1] >= 0.05
    assert_rejects(gof("num_emitted", bincount(num - 1, 3), law))


WARP_CTRL = dict(temperature=0.7, top_k=2, top_p=None, min_p=None)
TL_W = torch.tensor([[1.0, 0.8, 0.0, -0.5, -1.0], [0.0, 0.3, 0.6, 0.9, 1.2]])
DL_W = torch.tensor([[0.2, 1.0, 0.9, 0.0, 0.0]])


def warped_control(pass_unwarped: bool) -> Gof:
    K, V = 1, 5
    B = N_TOKENS
    p = target_law(TL_W, WARP_CTRL)
    q_w = draft_law(DL_W, WARP_CTRL)  # what the drafter samples from
    q_passed = torch.softmax(DL_W, dim=-1) if pass_unwarped else q_w
    gen = torch.Generator().manual_seed(SEED)
    drafts = torch.multinomial(q_w[0], B, replacement=True, generator=gen).unsqueeze(1)
    tokens, num = verify_chain(
        TL_W.expand(B, K + 1, V), q_passed.expand(B, K, V), drafts, **WARP_CTRL, generator=gen
    )
    check_chain_format(tokens, num, drafts, K)
    res = gof("first token", bincount(tokens[:, 0], V), p[0])
    assert res.zero_cell_hits == 0
    return res


def test_control_chain_warped_correct_sampler_passes():
    assert_accepts(warped_control(pass_unwarped=False))


def test_control_chain_unwarped_draft_probs():
    """(4) Drafts sampled from the warped q (temperature 0.7, top_k 2) but draft_probs taken from the
    unwarped draft logits, while the target is warped."""
    p = target_law(TL_W, WARP_CTRL)[0]
    q_w = draft_law(DL_W, WARP_CTRL)[0].double().numpy()
    q_u = torch.softmax(DL_W.double(), dim=-1)[0].numpy()
    mutated = chain_step_law(p, q_w, q_passed=q_u)
    assert tv(mutated, p) >= 0.05
    res = warped_control(pass_unwarped=True)
    assert_rejects(res)
    assert_follows_mutated_law(res, mutated)


# ==============================================================================================
# negative controls: tree

TREE_V = 4
TREE_P = np.array([0.4, 0.3, 0.2, 0.1])
TREE_Q_SAMPLED = np.array([0.1, 0.2, 0.3, 0.4])


def tree_control(scheme: str, q=TREE_P) -> tuple[Gof, Gof]:
    """Markov tables whose every row is TREE_P (target) / q (draft): the first token's law is decided
    at the root (3 children: the top-3 tokens 0, 1, 2 of q = p, or 3 i.i.d. draws from q)."""
    model = MarkovModel(to_logits(np.tile(TREE_P, (TREE_V, 1))), to_logits(np.tile(q, (TREE_V, 1))), no_warp())
    seq = markov_sequences(model, lambda gen: tree_round_fn(model, scheme, gen), 0, n=N_TOKENS)
    return markov_laws(model, seq, 0)


def mutated_tree_outcomes(mode: str):
    """A mutated copy of the tree decision (modes as in tree_node_law). Deterministic children:
    'no_renorm' removes a rejected child from R but keeps S; 'no_removal' keeps R and S. Sampled
    children: 'no_renorm' accepts w.p. min(1, R(x)/q(x)) instead of min(1, R(x)/(S q(x)))."""

    def outcomes(warped_logits, draft_probs, tree_tokens, children, accept_u, expo):
        B, N, V = warped_logits.shape
        p = torch.softmax(warped_logits.float(), dim=-1)
        R, S = p.clone(), torch.ones(B, N)
        choice = torch.full((B, N), -1, dtype=torch.long)
        for j in range(children.shape[1]):
            child = children[:, j]
            valid = (child >= 0).unsqueeze(0).expand(B, N)
            x = tree_tokens.gather(1, child.clamp_min(0).unsqueeze(0).expand(B, N)).clamp_min(0)
            r_x = R.gather(-1, x.unsqueeze(-1)).squeeze(-1)
            if draft_probs is None:
                passed = accept_u[:, :, j] * S < r_x
            else:
                q_x = draft_probs.gather(-1, x.unsqueeze(-1)).squeeze(-1)
                passed = accept_u[:, :, j] * q_x < r_x  # the mutation: S missing
            choice = torch.where(valid & (choice < 0) & passed, child.unsqueeze(0).expand(B, N), choice)
            if draft_probs is None:
                if mode == "no_renorm":
                    R = R.scatter(-1, x.unsqueeze(-1), torch.where(valid, 0.0, r_x).unsqueeze(-1))
            else:
                R = torch.where(valid.unsqueeze(-1), torch.clamp(R - S.unsqueeze(-1) * draft_probs, min=0.0), R)
                S = torch.where(valid, R.sum(dim=-1), S)
        empty = R.amax(dim=-1, keepdim=True) <= 0
        return choice, chain_ref.race_sample(torch.where(empty, p, R), expo)

    return outcomes


def test_control_tree_correct_sampler_passes():
    for scheme, q in [("topm", TREE_P), ("sampled", TREE_P), ("sampled", TREE_Q_SAMPLED), ("sampled_rrs", TREE_Q_SAMPLED)]:
        for res in tree_control(scheme, q):
            assert_accepts(res, require_power=False)


@pytest.mark.parametrize("mode", ["no_renorm", "no_removal"])
def test_control_tree_deterministic_residual_not_updated(monkeypatch, mode):
    """Deterministic children with the residual not renormalised / the rejected child not removed."""
    mutated = tree_node_law(TREE_P, [0, 1, 2], mode=mode)
    assert tv(mutated, TREE_P) >= 0.05, mutated
    monkeypatch.setattr(sv, "tree_outcomes", mutated_tree_outcomes(mode))
    first, joint = tree_control("topm")
    assert_rejects(first)
    assert_rejects(joint)
    assert_follows_mutated_law(first, mutated)


def test_control_tree_deterministic_children_verified_as_sampled():
    """Top-m children passed with draft_probs = q (the sampled-children rule) although they were not
    drawn from q: with q = p the top child is always accepted."""
    mutated = tree_node_law(TREE_P, [0, 1, 2], q=TREE_P)
    assert tv(mutated, TREE_P) >= 0.05, mutated
    first, joint = tree_control("topm_as_sampled")
    assert_rejects(first)
    assert_rejects(joint)
    assert_follows_mutated_law(first, mutated)


def test_control_tree_sampled_acceptance_not_renormalised(monkeypatch):
    """Sampled children whose acceptance uses the unnormalised residual, min(1, R(x)/q(x))."""
    mutated = sampled_node_law(TREE_P, TREE_Q_SAMPLED, 3, mode="no_renorm")
    assert tv(mutated, TREE_P) >= TV_DETECT, mutated
    monkeypatch.setattr(sv, "tree_outcomes", mutated_tree_outcomes("no_renorm"))
    first, joint = tree_control("sampled", TREE_Q_SAMPLED)
    assert_rejects(first)
    assert_rejects(joint)
    assert_follows_mutated_law(first, mutated)
