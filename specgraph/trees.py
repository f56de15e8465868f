"""Token-tree shapes and the buffers derived from them, computed once per shape.

A tree has N nodes in topological order; node 0 is the root (the last accepted token), every other
node's parent has a smaller index. A chain of K drafts is the tree ``parents = [-1, 0, 1, ..., K-1]``.

Static trees can be given in Medusa's "choices" format: a list of paths, each a tuple of top-k
ranks, e.g. ``[(0,), (1,), (0, 0), (0, 1)]`` means: the best and second-best candidates at depth 1,
and under the best one, the best and second-best candidates at depth 2.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Sequence

import torch

# suffix decoding's dynamic trees are packed into one of these compiled shapes: drafted nodes
# (the smallest that fits is used) and children per node
SUFFIX_TREE_SIZES = (4, 16)
SUFFIX_CHILDREN = 4


def _as_parent_list(parents) -> list[int]:
    if isinstance(parents, torch.Tensor):
        if parents.dim() != 1 or parents.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"parents must be a 1-D integer tensor [N], got {tuple(parents.shape)} {parents.dtype}")
        return [int(v) for v in parents.cpu().tolist()]
    try:
        values = list(parents)
    except TypeError:
        raise ValueError(f"parents must be a sequence of ints or a 1-D integer tensor, got {parents!r}") from None
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, numbers.Integral)]
    if bad:  # a float parent would be truncated to another node
        raise ValueError(f"parents must be integers, got {bad[0]!r} ({type(bad[0]).__name__})")
    return [int(v) for v in values]


def check_parents(parents: list[int]) -> None:
    """Raise ``ValueError`` unless ``parents`` describes a rooted tree in topological order."""
    if len(parents) == 0:
        raise ValueError("a tree needs at least the root node")
    if parents[0] != -1:
        raise ValueError(f"node 0 must be the root (parent -1), got parent {parents[0]}")
    for i, par in enumerate(parents[1:], start=1):
        if par == -1:
            raise ValueError(f"node {i} has parent -1: a tree has exactly one root (node 0)")
        if not 0 <= par < i:
            raise ValueError(
                f"node {i} has parent {par}: nodes must be in topological order (0 <= parent < index)"
            )


@dataclass(frozen=True, eq=False)
class TreeSpec:
    """Static buffers for one tree shape (all on CPU; move with :meth:`to`)."""

    parents: torch.Tensor  # [N] long, -1 for the root
    depth: torch.Tensor  # [N] long, root = 0
    ancestors: torch.Tensor  # [N, N] bool, ancestors[i, j] = j is i or an ancestor of i
    children: torch.Tensor  # [N, C] long, children in trial order (ascending index), -1 padded
    retrieve: torch.Tensor  # [L, D+1] long, node indices of each root-to-leaf path, -1 padded
    max_depth: int
    key: tuple = field(default=())  # hashable shape id, for caches of compiled graphs

    @property
    def num_nodes(self) -> int:
        return self.parents.shape[0]

    @property
    def is_chain(self) -> bool:
        return self.max_depth == self.num_nodes - 1

    @classmethod
    def from_parents(cls, parents) -> "TreeSpec":
        plist = _as_parent_list(parents)
        check_parents(plist)
        return _tree_from_checked_parents(tuple(plist))

    @classmethod
    def chain(cls, k: int) -> "TreeSpec":
        if k < 0:
            raise ValueError(f"chain length must be >= 0, got {k}")
        return cls.from_parents([-1] + list(range(k)))

    @classmethod
    def from_paths(cls, paths: Sequence[Sequence[int]]) -> "TreeSpec":
        return tree_from_paths(paths)[0]

    def to(self, device) -> "TreeSpec":
        return TreeSpec(
            self.parents.to(device), self.depth.to(device), self.ancestors.to(device),
            self.children.to(device), self.retrieve.to(device), self.max_depth, self.key,
        )


_TREE_CACHE: dict[tuple, TreeSpec] = {}


def _tree_from_checked_parents(plist: tuple[int, ...]) -> TreeSpec:
    cached = _TREE_CACHE.get(plist)
    if cached is not None:
        return cached
    n = len(plist)
    depth = [0] * n
    kids: list[list[int]] = [[] for _ in range(n)]
    anc = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        anc[i, i] = True
        if i:
            par = plist[i]
            depth[i] = depth[par] + 1
            kids[par].append(i)
            anc[i] |= anc[par]
    width = max(1, max(len(k) for k in kids))
    children = torch.full((n, width), -1, dtype=torch.long)
    for i, k in enumerate(kids):
        if k:
            children[i, : len(k)] = torch.tensor(k)
    max_depth = max(depth)
    leaves = [i for i in range(n) if not kids[i]]
    retrieve = torch.full((len(leaves), max_depth + 1), -1, dtype=torch.long)
    for row, leaf in enumerate(leaves):
        path = anc[leaf].nonzero().flatten()  # ancestors are in topological order, so sorted = root first
        retrieve[row, : path.numel()] = path
    spec = TreeSpec(
        parents=torch.tensor(plist, dtype=torch.long),
        depth=torch.tensor(depth, dtype=torch.long),
        ancestors=anc,
        children=children,
        retrieve=retrieve,
        max_depth=max_depth,
        key=plist,
    )
    _TREE_CACHE[plist] = spec
    return spec


def tree_from_paths(paths: Sequence[Sequence[int]]) -> tuple[TreeSpec, torch.Tensor]:
    """Build a static tree from Medusa-style choices.

    Returns the :class:`TreeSpec` and ``rank`` [N] long: for each node, its top-k rank among the
    candidates at its depth (-1 for the root), which a drafter uses to fill in tokens.
    Nodes are ordered by (depth, path), so the order is topological.
    """
    norm = []
    for path in paths:
        t = tuple(int(r) for r in path)
        if len(t) == 0:
            raise ValueError("empty path in tree choices (the root is implicit)")
        if any(r < 0 for r in t):
            raise ValueError(f"negative rank in tree path {t}")
        norm.append(t)
    unique = sorted(set(norm), key=lambda t: (len(t), t))
    if len(unique) != len(norm):
        raise ValueError("duplicate paths in tree choices")
    index = {(): 0}
    plist = [-1]
    for t in unique:
        if t[:-1] not in index:
            raise ValueError(f"tree path {t} is missing its prefix {t[:-1]}: choices must be prefix-closed")
        index[t] = len(plist)
        plist.append(index[t[:-1]])
    rank = torch.tensor([-1] + [t[-1] for t in unique], dtype=torch.long)
    return _tree_from_checked_parents(tuple(plist)), rank


def ancestor_mask(parents) -> torch.Tensor:  # [N, N] bool
    """``mask[i, j]`` is True when node i may attend to node j (j is i or one of its ancestors)."""
    return TreeSpec.from_parents(parents).ancestors


def tree_positions(prefix_len: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """Position ids of tree nodes: prefix length + depth. ``prefix_len`` [B] -> [B, N]."""
    return prefix_len.unsqueeze(-1) + depth.unsqueeze(0)


def tree_buffers(
    parents: torch.Tensor,  # [B, N] long, -1 for the root, topological (parent < index)
    max_children: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row tree buffers computed on the device, for trees whose shape changes every round
    (n-gram / suffix tries, dynamic trees) under one compiled graph of N nodes.

    Returns ``depth`` [B, N] long, ``ancestors`` [B, N, N] bool (``[b, i, j]``: j is i or an
    ancestor of i) and ``children`` [B, N, C] long (in ascending node order, -1 padded; C =
    ``max_children``). A node with more than C children keeps its first C; the drafters never build
    such trees, and a dropped child is only a draft that is not tried (still lossless).
    No host sync: a static loop over N, traceable by torch.compile and torch.export.
    """
    B, N = parents.shape
    device = parents.device
    eye = torch.eye(N, dtype=torch.bool, device=device)
    par = parents.clamp_min(0)
    depth = torch.zeros(B, N, dtype=torch.long, device=device)
    anc = eye.unsqueeze(0).expand(B, N, N).clone()
    for i in range(1, N):  # topological order: a parent's row is final before its children read it
        p = par[:, i : i + 1]  # [B, 1]
        depth[:, i] = depth.gather(1, p).squeeze(1) + 1
        anc[:, i] = anc.gather(1, p.unsqueeze(-1).expand(B, 1, N)).squeeze(1) | eye[i]
    # child rank = number of earlier siblings; slot (parent, rank) holds the child
    is_child = parents >= 0
    same = (parents.unsqueeze(2) == parents.unsqueeze(1)) & is_child.unsqueeze(2)  # [B, N, N]
    earlier = torch.ones(N, N, dtype=torch.bool, device=device).tril(-1)
    rank = (same & earlier).sum(-1)  # [B, N]
    keep = is_child & (rank < max_children)
    flat = torch.where(keep, par * max_children + rank, N * max_children)  # overflow -> dump slot
    node = torch.arange(N, device=device).expand(B, N)
    children = torch.full((B, N * max_children + 1), -1, dtype=torch.long, device=device)
    children = children.scatter(1, flat, node)[:, :-1].view(B, N, max_children)
    return depth, anc, children
