"""Analytical speedup model (Leviathan et al. 2023, Sec. 3) and the tree extension."""
from __future__ import annotations

import math

import pytest
import torch

from specgraph import TreeSpec
from specgraph.perfmodel import (
    expected_accepted,
    expected_emitted,
    optimal_gamma,
    speedup,
    speedup_table,
    tree_expected_accepted,
    tree_expected_emitted,
)




@pytest.mark.parametrize("beta, c, expected", [(0.8, 0.05, 2.95), (0.9, 0.10, 3.12), (0.5, 0.15, 1.12)])
def test_seed_table_gamma_5(beta, c, expected):
    assert round(speedup(beta, 5, c), 2) == expected


def test_seed_table_exact_values():
    # E[N] = (1 - β^6) / (1 - β), cost = 5c + 1
    assert speedup(0.8, 5, 0.05) == pytest.approx((1 - 0.8**6) / 0.2 / 1.25, rel=1e-12)
    assert speedup(0.5, 5, 0.15) == pytest.approx(1.125, rel=1e-12)


@pytest.mark.parametrize("gamma", [0, 1, 2, 5, 17])
def test_expected_emitted_limits(gamma):
    assert expected_emitted(0.0, gamma) == 1.0
    assert expected_emitted(1.0, gamma) == gamma + 1
    # continuity at β -> 1 and β -> 0
    assert expected_emitted(1 - 1e-9, gamma) == pytest.approx(gamma + 1, rel=1e-6)
    assert expected_emitted(1e-12, gamma) == pytest.approx(1.0, abs=1e-9)
    assert expected_accepted(0.0, gamma) == 0.0
    assert expected_accepted(1.0, gamma) == gamma


@pytest.mark.parametrize("beta", [0.1, 0.5, 0.77, 0.95])
@pytest.mark.parametrize("gamma", [0, 1, 4, 10])
def test_expected_emitted_is_geometric_sum(beta, gamma):
    # E[N] = Σ_{i=0..γ} β^i: token i+1 is emitted iff the first i drafts were all accepted
    assert expected_emitted(beta, gamma) == pytest.approx(sum(beta**i for i in range(gamma + 1)), rel=1e-12)
    assert expected_accepted(beta, gamma) == pytest.approx(sum(beta**i for i in range(1, gamma + 1)), rel=1e-12)


def test_speedup_with_verify_cost():
    assert speedup(0.8, 4, 0.1, verify_cost=2.0) == pytest.approx(expected_emitted(0.8, 4) / 2.4)
    assert speedup(0.0, 3, 0.0) == 1.0  # nothing accepted, free drafts: no gain, no loss


def _brute_force(beta, c, max_gamma, verify_cost=None):
    vals = [
        speedup(beta, g, c, 1.0 if verify_cost is None else verify_cost(g)) for g in range(1, max_gamma + 1)
    ]
    return 1 + max(range(len(vals)), key=lambda i: (vals[i], -i))  # first argmax


@pytest.mark.parametrize("c", [0.0, 0.01, 0.05, 0.2, 0.5, 1.0])
def test_optimal_gamma_is_argmax(c):
    for beta in [0.0, 0.1, 0.3, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0]:
        for max_gamma in (1, 8, 64):
            g = optimal_gamma(beta, c, max_gamma=max_gamma)
            assert 1 <= g <= max_gamma
            assert speedup(beta, g, c) == pytest.approx(max(speedup(beta, k, c) for k in range(1, max_gamma + 1)))
            brute = _brute_force(beta, c, max_gamma)
            if c > 0:
                assert g == brute
            else:
                # c = 0: S keeps growing by ~β^γ, below float resolution for small β; optimal_gamma
                # ignores gains under 1e-12 and so may stop at a shorter γ with the same speedup.
                assert g <= brute and speedup(beta, brute, c) - speedup(beta, g, c) <= 1e-11


def test_optimal_gamma_with_cost_curve():
    curve = lambda g: 1.0 + 0.02 * g  # noqa: E731  verification gets slower with more tokens
    for beta in (0.6, 0.8, 0.9):
        assert optimal_gamma(beta, 0.05, max_gamma=40, verify_cost=curve) == _brute_force(beta, 0.05, 40, curve)
    # a steeper verification cost never makes the optimum longer
    assert optimal_gamma(0.9, 0.05, verify_cost=curve) <= optimal_gamma(0.9, 0.05)


@pytest.mark.parametrize("c", [0.01, 0.05, 0.1, 0.3])
def test_optimal_gamma_grows_with_beta(c):
    betas = [i / 40 for i in range(41)]
    gammas = [optimal_gamma(b, c) for b in betas]
    assert all(a <= b for a, b in zip(gammas, gammas[1:])), gammas
    assert gammas[0] == 1 and gammas[-1] == 64  # β = 1 with c < 1: longest allowed
    assert len(set(gammas)) > 3


def test_speedup_table():
    rows = speedup_table([0.5, 0.8], [1, 5], 0.05)
    assert len(rows) == 4
    assert rows[3] == {
        "beta": 0.8, "gamma": 5, "c": 0.05, "expected_emitted": expected_emitted(0.8, 5), "speedup": speedup(0.8, 5, 0.05)
    }


# ----------------------------------------------------------------------------------------------
# trees


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.8, 1.0])
@pytest.mark.parametrize("gamma", [0, 1, 5, 9])
def test_tree_on_chain_equals_chain_formula(beta, gamma):
    probs = [0.123] + [beta] * gamma  # the root's entry is ignored
    spec = TreeSpec.chain(gamma)
    assert tree_expected_accepted(spec, probs) == pytest.approx(expected_accepted(beta, gamma), abs=1e-12)
    assert tree_expected_accepted([-1] + list(range(gamma)), torch.tensor(probs, dtype=torch.float64)) == pytest.approx(
        expected_accepted(beta, gamma), abs=1e-12
    )
    assert tree_expected_emitted(spec, probs) == pytest.approx(expected_emitted(beta, gamma), abs=1e-12)


#         0
#      /  |  \
#     1   2   3
#    / \  |
#   4   5 6
#   |
#   7
MC_PARENTS = [-1, 0, 0, 0, 1, 1, 2, 4]
MC_PROBS = [1.0, 0.5, 0.3, 0.1, 0.6, 0.3, 0.7, 0.8]


def test_tree_expected_accepted_closed_form():
    reach1, reach2, reach3 = 0.5, 0.3, 0.1
    reach4, reach5, reach6 = 0.5 * 0.6, 0.5 * 0.3, 0.3 * 0.7
    reach7 = reach4 * 0.8
    expected = reach1 + reach2 + reach3 + reach4 + reach5 + reach6 + reach7
    assert tree_expected_accepted(MC_PARENTS, MC_PROBS) == pytest.approx(expected, abs=1e-12)


def test_tree_expected_accepted_monte_carlo():
    """Simulate rounds where at each reached node at most one child is accepted (child i with prob p_i)."""
    n = 200_000
    g = torch.Generator().manual_seed(2024)
    spec = TreeSpec.from_parents(MC_PARENTS)
    probs = torch.tensor(MC_PROBS, dtype=torch.float64)
    node = torch.zeros(n, dtype=torch.long)
    alive = torch.ones(n, dtype=torch.bool)
    accepted = torch.zeros(n, dtype=torch.float64)
    for _ in range(spec.max_depth):
        u = torch.rand(n, generator=g, dtype=torch.float64)
        kids = spec.children[node]  # [n, C]
        p_kids = torch.where(kids >= 0, probs[kids.clamp_min(0)], 0.0)
        cum = p_kids.cumsum(dim=1)
        # mutually exclusive: child j is accepted when cum[j-1] <= u < cum[j]
        hit = (u.unsqueeze(1) < cum) & (kids >= 0)
        any_hit = hit.any(dim=1) & alive
        first = hit.long().argmax(dim=1)
        node = torch.where(any_hit, kids.gather(1, first.unsqueeze(1)).squeeze(1), node)
        accepted += any_hit.double()
        alive = any_hit
    mean = accepted.mean().item()
    se = accepted.std().item() / math.sqrt(n)
    analytic = tree_expected_accepted(MC_PARENTS, MC_PROBS)
    assert abs(mean - analytic) < 3 * se, (mean, analytic, se)


def test_tree_siblings_may_sum_to_one():
    assert tree_expected_accepted([-1, 0, 0], [0, 0.4, 0.6]) == pytest.approx(1.0)


# ----------------------------------------------------------------------------------------------
# bad input


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: expected_emitted(-0.1, 3), "beta"),
        (lambda: expected_emitted(1.1, 3), "beta"),
        (lambda: expected_emitted(0.5, -1), "gamma"),
        (lambda: expected_accepted(2.0, 3), "beta"),
        (lambda: speedup(0.5, 3, -0.1), "cost ratio"),
        (lambda: speedup(0.5, 3, 0.1, verify_cost=0.0), "verify_cost"),
        (lambda: speedup(1.5, 3, 0.1), "beta"),
        (lambda: optimal_gamma(1.5, 0.1), "beta"),
        (lambda: optimal_gamma(0.5, -0.1), "cost ratio"),
        (lambda: optimal_gamma(0.5, 0.1, max_gamma=0), "max_gamma"),
        (lambda: optimal_gamma(0.5, 0.1, verify_cost=lambda g: 0.0), "verify_cost"),
        (lambda: tree_expected_accepted([-1, 0, 0], [1.0, 0.5]), "entries"),
        (lambda: tree_expected_accepted([-1, 0, 0], [1.0, 0.5, -0.1]), r"\[0, 1\]"),
        (lambda: tree_expected_accepted([-1, 0, 0], [1.0, 0.5, 1.2]), r"\[0, 1\]"),
        (lambda: tree_expected_accepted([-1, 0, 0], [1.0, 0.6, 0.6]), "summing to"),
        (lambda: tree_expected_accepted([-1, 0, 1, 1], [1.0, 1.0, 0.7, 0.7]), "children of node 1"),
        (lambda: tree_expected_accepted([-1, -1], [1.0, 0.5]), "root"),
        (lambda: tree_expected_accepted([-1, 2, 0], [1.0, 0.5, 0.5]), "topological"),
    ],
)
def test_bad_inputs_raise(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ----------------------------------------------------------------------------------------------
# measured costs: cost curve fit, acceptance profiles, recommended depth


from specgraph.perfmodel import (  # noqa: E402
    AcceptanceProfile,
    CostCurve,
    CostModel,
    LinearCost,
    predicted_speedup,
    recommend_gamma,
)


def _true_cost(n, b):
    """A memory-bound floor up to a knee of 16 tokens per batch, then linear in tokens (compute-bound)."""
    return 0.010 + 0.0002 * b + 0.0004 * max(0.0, n * b - 16)


def test_cost_curve_recovers_a_known_curve_from_noisy_samples():
    g = torch.Generator().manual_seed(0)
    grid, batches = [1, 2, 4, 8, 16, 32, 64], [1, 2, 4, 8]
    samples = []
    for b in batches:
        for n in grid:
            for _ in range(7):  # 3% multiplicative noise, like timing jitter
                samples.append((b, n, _true_cost(n, b) * (1 + 0.03 * float(torch.randn(1, generator=g)))))
    c = CostCurve.fit(samples)
    for b in batches:
        for n in grid:  # at the grid: the median of 7 noisy repeats
            assert c(n, b) == pytest.approx(_true_cost(n, b), rel=0.04)
        for n in (3, 12, 24, 48):  # between grid points the true curve is piecewise linear with a knee at n*b=16
            tol = 0.04 if (n * b > 16 or n * b * 2 <= 16) else 0.25  # one segment straddles the knee
            assert c(n, b) == pytest.approx(_true_cost(n, b), rel=tol), (n, b)
    # between batch sizes: between the neighbours; above the largest: grows in proportion to B
    assert min(c(8, 2), c(8, 4)) <= c(8, 3) <= max(c(8, 2), c(8, 4))
    assert c(8, 16) == pytest.approx(2 * c(8, 8))
    d = CostCurve.fit([tuple(s) for s in samples])
    assert CostCurve(d.table).table == d.table


def test_acceptance_profile_from_counts_and_extrapolation():
    # 100 row-rounds, 80 drafted; of those 60 kept draft 1, 30 kept drafts 1-2
    p = AcceptanceProfile.from_counts([60, 30], [80, 80], row_rounds=100)
    assert p.draft_rate == pytest.approx(0.8)
    assert p.survival == pytest.approx([0.75, 0.375])
    assert p.conditional(1) == pytest.approx(0.75) and p.conditional(2) == pytest.approx(0.5)
    assert p.survival_at(4) == pytest.approx(0.375 * 0.25)  # the last conditional repeats
    assert p.expected_emitted(2) == pytest.approx(1 + 0.8 * (0.75 + 0.375))
    assert AcceptanceProfile.from_beta(0.7).expected_emitted(5) == pytest.approx(expected_emitted(0.7, 5))


@pytest.mark.parametrize("beta, gamma, c", [(0.8, 5, 0.05), (0.5, 3, 0.2), (0.95, 8, 0.0)])
def test_predicted_speedup_reduces_to_the_closed_form(beta, gamma, c):
    """p = 1, s_j = β^j, a flat cost curve and a draft step of c plain steps: Leviathan et al.'s S."""
    cost = CostModel(LinearCost(1.0, 0.0), draft_step={1: c})
    assert predicted_speedup(AcceptanceProfile.from_beta(beta, depth=16), cost, gamma) == pytest.approx(speedup(beta, gamma, c))


def _brute(profile, cost, b, depths):
    """Independent evaluation of S(γ, B) = E t0 / (P_B T_γ + (1 - P_B) t0), argmax with ties to smaller γ."""
    p = profile.draft_rate
    t0 = cost.target(1, b) + cost.overhead.get(b, 0.0)
    best, best_s = 0, 1.0
    for g in sorted(depths):
        if g == 0:
            continue
        e = 1 + p * sum(profile.survival_at(j) for j in range(1, g + 1))
        tg = cost.target(g + 1, b) + cost.overhead.get(b, 0.0) + cost.draft_round.get(b, 0.0) + g * cost.draft_step.get(b, 0.0)
        pb = 1 - (1 - p) ** b
        s = e * t0 / (pb * tg + (1 - pb) * t0)
        if s > best_s * (1 + 1e-12):
            best, best_s = g, s
    return best


def test_recommended_gamma_matches_brute_force_argmax():
    g = torch.Generator().manual_seed(1)
    rnd = lambda: float(torch.rand(1, generator=g))  # noqa: E731
    for _ in range(200):
        beta, rate = rnd(), 0.2 + 0.8 * rnd()
        table = {b: {n: _true_cost(n, b) for n in (1, 2, 4, 8, 16, 32, 64)} for b in (1, 4, 16)}
        knee = 1 + 10 * rnd()
        cost = CostModel(CostCurve.fit([(b, n, t * (1 + rnd() * n / knee / 64)) for b, row in table.items() for n, t in row.items()]),
                         draft_step={b: 0.002 * rnd() for b in table}, draft_round={b: 0.001 * rnd() for b in table},
                         overhead={b: 0.001 * rnd() for b in table})
        prof = AcceptanceProfile([beta ** j * (1 - 0.05 * j * rnd()) for j in range(1, 9)], rate)
        for b in table:  # the measured batch sizes: the brute force reads the tables directly
            depths = range(0, 64)
            assert recommend_gamma(prof, cost, b, depths) == _brute(prof, cost, b, depths)


def test_recommendation_turns_off_at_high_batch_and_low_acceptance():
    cost = CostModel(LinearCost())  # the conservative built-in curve
    assert recommend_gamma(AcceptanceProfile.from_beta(0.9), cost, 1) > 0
    assert recommend_gamma(AcceptanceProfile.from_beta(0.8), cost, 64) == 0
    assert recommend_gamma(AcceptanceProfile.from_beta(0.05), cost, 1) == 0


def test_workload_speedup_static_batches():
    from specgraph.perfmodel import predicted_workload_speedup

    cost = CostModel(LinearCost(1.0, 0.05), draft_step={1: 0.02, 4: 0.05})
    prof = AcceptanceProfile.from_beta(0.7)
    # identical rows that always draft: no straggler, the steady-state per-round model
    for b in (1, 4):
        assert predicted_workload_speedup([(prof, 64)] * 4, cost, 3, b) == pytest.approx(predicted_speedup(prof, cost, 3, b))
    # one hard row in a batch of 4: the batch waits for it; alone (B=1) the easy rows still gain
    rows = [(AcceptanceProfile.from_beta(0.9), 64)] * 3 + [(AcceptanceProfile.from_beta(0.1), 64)]
    s4 = predicted_workload_speedup(rows, cost, 4, 4)
    assert s4 == pytest.approx(AcceptanceProfile.from_beta(0.1).expected_emitted(4) * cost.round_cost(0, 4) / cost.round_cost(4, 4))
    assert predicted_workload_speedup(rows, cost, 4, 1) > s4
    assert predicted_workload_speedup(rows, cost, 0, 4) == 1.0


def test_workload_speedup_counts_a_cycled_sequence_once_for_drafting():
    """A sequence cycled into a batch twice decodes the same way twice: its copies draft in the same
    rounds, so a batch of copies drafts as often as one row does, not as four independent rows."""
    from specgraph.perfmodel import predicted_workload_speedup

    cost = CostModel(LinearCost(1.0, 0.05), draft_step={1: 0.02, 4: 0.05})
    sparse = AcceptanceProfile([0.8, 0.6, 0.4], draft_rate=0.1)  # prompt lookup: a match in 10% of rounds
    copies = predicted_workload_speedup([(sparse, 48)], cost, 3, 4)
    t0, t3 = cost.round_cost(0, 4), cost.round_cost(3, 4)
    assert copies == pytest.approx(sparse.expected_emitted(3) * t0 / (0.1 * t3 + 0.9 * t0))
    # four distinct sequences with the same profile draft independently: a drafted round 1 - 0.9^4 of the time
    distinct = predicted_workload_speedup([(sparse, 48)] * 4, cost, 3, 4)
    assert distinct == pytest.approx(sparse.expected_emitted(3) * t0 / (0.3439 * t3 + 0.6561 * t0))
    assert distinct < copies
