"""Packed prefill's layout: several rows' prompt chunks as one sequence over one packed cache, each
token seeing only its own row's slots (the call itself: :meth:`specgraph.compiler.SpecGraphModel.
prefill_packed`)."""
from __future__ import annotations

import torch


def packed_layout(starts: list[int], lengths: list[int], device=None):
    """Several rows' next prompt tokens as one sequence, each row with a segment of its own in
    one packed cache: row r's segment holds its committed slots 0 .. starts[r] - 1, then its
    lengths[r] new tokens. A token sees the slots of its own segment up to itself, never another
    row's. Returns position ids [1, T] (the row's own positions), the packed slots the tokens
    write [1, T], the additive mask [1, 1, T, Wp] and each segment's offset in the packed cache
    (T = sum(lengths), Wp = sum(starts) + T)."""
    offsets, pos, slot, lo = [], [], [], []
    o = 0
    for s0, n in zip(starts, lengths):
        offsets.append(o)
        pos.append(torch.arange(s0, s0 + n))
        slot.append(torch.arange(o + s0, o + s0 + n))
        lo.append(torch.full((n,), o))
        o += s0 + n
    pos, slot, lo = torch.cat(pos), torch.cat(slot), torch.cat(lo)
    s = torch.arange(o)
    vis = (s >= lo.unsqueeze(1)) & (s <= slot.unsqueeze(1))  # [T, Wp]
    mask = torch.zeros(vis.shape).masked_fill(~vis, float("-inf")).view(1, 1, *vis.shape)
    return pos.view(1, -1).to(device), slot.view(1, -1).to(device), mask.to(device), offsets
