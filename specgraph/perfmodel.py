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


def speedup_table(betas: Sequence[float], gammas: Sequence[int], c: float) -> list[dict]:
    """Rows of {beta, gamma, c, expected_emitted, speedup} for printing."""
    return [
        {"beta": b, "gamma": g, "c": c, "expected_emitted": expected_emitted(b, g), "speedup": speedup(b, g, c)}
        for b in betas
        for g in gammas
    ]
