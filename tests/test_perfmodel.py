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
