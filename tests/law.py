"""The goodness-of-fit test the enumeration tests share."""
from __future__ import annotations

import torch
from scipy.stats import chisquare


def gof_pvalue(counts: torch.Tensor, law: torch.Tensor) -> float:
    """Chi-square p-value of observed ``counts`` against the exact ``law`` (same shape), cells with
    an expected count below 5 pooled. A draw of probability 0 fails outright."""
    n = counts.sum()
    expected = (law * n).flatten()
    observed = counts.flatten()
    assert observed[expected == 0].sum() == 0, "a continuation of probability 0 was emitted"
    small = expected < 5
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    obs = torch.cat([observed[~small], observed[small].sum().view(1)])
    keep = exp > 0
    return float(chisquare(obs[keep].numpy(), exp[keep].numpy() * obs[keep].sum().item() / exp[keep].sum().item()).pvalue)
