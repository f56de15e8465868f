"""Randomly perturbed learned heads bound to a target, shared by the exactness tests."""
from __future__ import annotations

import torch

from specgraph.heads import EagleHead, MedusaHeads


def random_head(target, kind):
    """A randomly perturbed head bound to the target. The EAGLE head's fc starts by passing the token
    embedding through and its output norm has the target's final-norm scale, so its q rows overlap
    the target's (a head whose drafts are never accepted would not exercise the accept branch)."""
    head = EagleHead(target.config) if kind == "eagle" else MedusaHeads.for_target(target.config, num_heads=2)
    head.bind(target)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        if kind == "eagle":
            H = target.config.hidden_size
            head.fc.weight[:, :H] += torch.eye(H)
            head.out_norm.weight.copy_(target.model.norm.weight)
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return head.eval()
