"""Prompt prefix reuse: the KV of prompt blocks already prefilled, copied into a new row's cache
slots instead of being computed again.

Requests to one server share prefixes: a chat template's system prompt, a few-shot preamble,
the same document asked about twice, a conversation's earlier turns. :class:`PrefixCache` keeps
the KV of prompt blocks (``block`` tokens each) in a pool of its own, keyed by the block's
tokens *and* its parent block (a block is only valid after the same prefix, at the same
positions). A new prompt walks its blocks from the first; the blocks found are copied into its
row, and only the rest is prefilled.

The key is the exact token tuple, compared on lookup (a dictionary of tuples, not a hash that
could collide): a reused block holds the KV that prefill computed for these very tokens at
these very positions. What differs from prefilling the whole prompt is only how prefill was
chunked, as with the engine's own chunked prefill.

Eviction is least-recently-used. A lookup touches a chain from its last block back to the
first, so a parent is always more recent than its children and leaves go first; a block is
evicted with everything below it (a child's key names its parent's block id, which a new block
may take).
"""
from __future__ import annotations

import collections

import torch


class PrefixCache:
    """A pool of ``capacity`` blocks of ``block`` prompt tokens' KV, shaped like ``kv`` (the
    engine's cache tensors [B, H, slots, D]); each pool tensor is [capacity, H, block, D]."""

    def __init__(self, kv: list[torch.Tensor], block: int = 32, capacity: int = 256):
        if block < 1 or capacity < 1:
            raise ValueError("block and capacity must be >= 1")
        self.block, self.capacity = block, capacity
        self.pool = [torch.empty(capacity, t.shape[1], block, t.shape[3], dtype=t.dtype, device=t.device) for t in kv]
        self.index: dict[tuple, int] = {}  # (parent block id or -1, tokens) -> block id
        self.keys: list[tuple | None] = [None] * capacity  # block id -> its key
        self.lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # least recent first
        self.children: dict[int, set[int]] = collections.defaultdict(set)
        self.free = list(range(capacity - 1, -1, -1))

    @staticmethod
    def bytes_per_block(kv: list[torch.Tensor], block: int) -> int:
        return sum(t.shape[1] * block * t.shape[3] * t.element_size() for t in kv)

    def _chain(self, tokens: list[int]) -> list[int]:
        """Block ids of the longest cached prefix of ``tokens`` (whole blocks)."""
        ids, parent = [], -1
        for j in range(len(tokens) // self.block):
            bid = self.index.get((parent, tuple(tokens[j * self.block: (j + 1) * self.block])))
            if bid is None:
                break
            ids.append(bid)
            parent = bid
        return ids

    def _touch(self, ids: list[int]) -> None:
        for bid in reversed(ids):  # the first block ends most recent: leaves are evicted first
            self.lru.move_to_end(bid)

    def load(self, tokens: list[int], kv: list[torch.Tensor], row: int, have: int = 0) -> int:
        """Copy the longest cached prefix of ``tokens`` into row ``row`` of ``kv`` (slot = position),
        skipping the whole blocks below ``have`` (the tokens the row already holds); returns the
        tokens the row holds now: max(have, the prefix's length, a multiple of ``block``)."""
        ids = self._chain(tokens)
        n = len(ids) * self.block
        if n <= have:
            return have
        self._touch(ids)
        first = have // self.block
        lo = first * self.block
        sel = torch.tensor(ids[first:], device=self.pool[0].device)
        for t, p in zip(kv, self.pool):
            blocks = p.index_select(0, sel)  # [n_blocks, H, block, D]
            t[row, :, lo:n] = blocks.transpose(0, 1).reshape(t.shape[1], n - lo, t.shape[3])
        return n

    def store(self, tokens: list[int], kv: list[torch.Tensor], row: int) -> int:
        """Keep the whole blocks of ``tokens``, whose KV row ``row`` of ``kv`` holds at slots 0..;
        returns how many blocks were added."""
        parent, added, chain = -1, 0, []
        for j in range(len(tokens) // self.block):
            key = (parent, tuple(tokens[j * self.block: (j + 1) * self.block]))
            bid = self.index.get(key)
            if bid is None:
                bid = self._allocate(protect=chain)
                if bid is None:
                    break
                lo = j * self.block
                for t, p in zip(kv, self.pool):
                    p[bid] = t[row, :, lo: lo + self.block]
                self.index[key], self.keys[bid] = bid, key
                self.lru[bid] = None
                if parent >= 0:
                    self.children[parent].add(bid)
                added += 1
            chain.append(bid)
            parent = bid
        self._touch(chain)
        return added

    def _allocate(self, protect: list[int]) -> int | None:
        """A free block id, evicting the least recently used block not in ``protect`` (None: all
        blocks are in the chain being stored)."""
        if self.free:
            return self.free.pop()
        keep = set(protect)
        victim = next((bid for bid in self.lru if bid not in keep), None)
        if victim is None:
            return None
        self._evict(victim)
        return self.free.pop()

    def _evict(self, bid: int) -> None:
        """Drop block ``bid`` and every block below it (a child's key names its parent's id,
        which a new block may take)."""
        for child in self.children.pop(bid, ()):
            self._evict(child)
        parent = self.keys[bid][0]
        if parent >= 0:
            self.children[parent].discard(bid)
        del self.lru[bid]
        del self.index[self.keys[bid]]
        self.keys[bid] = None
        self.free.append(bid)

    @property
    def used(self) -> int:
        return len(self.lru)


__all__ = ["PrefixCache"]
