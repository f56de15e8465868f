"""TreeSpec buffers (ancestors, depth, children, retrieve) and Medusa-style paths."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specgraph import TreeSpec, ancestor_mask, tree_from_paths, tree_positions

HYP = settings(derandomize=True, max_examples=60, deadline=None, database=None)




@st.composite
def random_parents(draw, max_nodes=24):
    """A random rooted tree in topological order: parents[i] drawn from range(i)."""
    n = draw(st.integers(1, max_nodes))
    return [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]


def _ancestor_set(parents, i):
    out = {i}
    while parents[i] >= 0:
        i = parents[i]
        out.add(i)
    return out


def _kids(parents):
    return [[c for c in range(len(parents)) if parents[c] == i] for i in range(len(parents))]


def _check_spec(spec: TreeSpec, parents: list[int]) -> None:
    N = len(parents)
    assert spec.num_nodes == N
    assert spec.parents.dtype == torch.long and spec.parents.tolist() == parents
    # ancestors
    assert spec.ancestors.dtype == torch.bool and spec.ancestors.shape == (N, N)
    for i in range(N):
        assert set(spec.ancestors[i].nonzero().flatten().tolist()) == _ancestor_set(parents, i)
    # depth = number of edges to the root
    depth = [len(_ancestor_set(parents, i)) - 1 for i in range(N)]
    assert spec.depth.dtype == torch.long and spec.depth.tolist() == depth
    assert spec.max_depth == max(depth)
    assert spec.is_chain == (max(depth) == N - 1)
    # children: ascending, -1 padded, width = the largest fan-out (at least 1)
    kids = _kids(parents)
    width = max(1, max(len(k) for k in kids))
    assert spec.children.shape == (N, width)
    for i in range(N):
        row = spec.children[i].tolist()
        assert row == kids[i] + [-1] * (width - len(kids[i]))
    # retrieve: one row per leaf, ascending leaves, each the root-to-leaf path padded with -1
    leaves = [i for i in range(N) if not kids[i]]
    assert spec.retrieve.shape == (len(leaves), max(depth) + 1)
    for row, leaf in zip(spec.retrieve.tolist(), leaves):
        path = [leaf]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        path.reverse()
        assert row == path + [-1] * (max(depth) + 1 - len(path))
        # consecutive entries are parent -> child, starting at the root
        assert row[0] == 0
    # every node lies on some retrieved path
    covered = {v for r in spec.retrieve.tolist() for v in r if v >= 0}
    assert covered == set(range(N))


@HYP
@given(parents=random_parents())
def test_from_parents_buffers(parents):
    spec = TreeSpec.from_parents(parents)
    _check_spec(spec, parents)
    assert torch.equal(ancestor_mask(parents), spec.ancestors)
    # same shape, same buffers whatever the input container
    spec_t = TreeSpec.from_parents(torch.tensor(parents))
    _check_spec(spec_t, parents)
    spec_32 = TreeSpec.from_parents(torch.tensor(parents, dtype=torch.int32))
    _check_spec(spec_32, parents)
    assert spec.key == tuple(parents)


@HYP
@given(parents=random_parents())
def test_ancestor_mask_is_reflexive_lower_triangular_and_transitive(parents):
    anc = TreeSpec.from_parents(parents).ancestors
    N = len(parents)
    assert anc.diagonal().all()
    assert not anc.triu(1).any()  # topological order: ancestors have smaller indices
    assert anc[:, 0].all()  # everyone attends to the root
    # mask[i] = mask[parent(i)] + {i}
    for i in range(1, N):
        expected = anc[parents[i]].clone()
        expected[i] = True
        assert torch.equal(anc[i], expected)


@pytest.mark.parametrize("k", [0, 1, 2, 7])
def test_chain(k):
    spec = TreeSpec.chain(k)
    parents = [-1] + list(range(k))
    _check_spec(spec, parents)
    assert spec.is_chain
    assert spec.max_depth == k
    assert torch.equal(spec.depth, torch.arange(k + 1))
    assert torch.equal(spec.ancestors, torch.ones(k + 1, k + 1, dtype=torch.bool).tril())
    assert spec.children.tolist() == [[i + 1] for i in range(k)] + [[-1]]
    assert spec.retrieve.tolist() == [list(range(k + 1))]


def test_chain_negative_raises():
    with pytest.raises(ValueError, match="chain length"):
        TreeSpec.chain(-1)


@pytest.mark.parametrize("parents", [[-1, 0.0, 1.7], [-1, 0, True], "abc", [-1.0, 0]])
def test_non_integer_parents_raise(parents):
    """A float parent would otherwise be truncated to another node (1.7 -> 1)."""
    with pytest.raises(ValueError, match="integer"):
        TreeSpec.from_parents(parents)
    with pytest.raises(ValueError, match="integer"):
        TreeSpec.from_parents(torch.tensor([-1.0, 0.0, 1.0]))
    assert TreeSpec.from_parents([-1, 0, 1]).num_nodes == 3  # negative control


def test_small_tree_explicit():
    #       0
    #     / | \
    #    1  2  3
    #   / \     \
    #  4   5     6
    #      |
    #      7
    parents = [-1, 0, 0, 0, 1, 1, 3, 5]
    spec = TreeSpec.from_parents(parents)
    assert spec.depth.tolist() == [0, 1, 1, 1, 2, 2, 2, 3]
    assert spec.max_depth == 3 and not spec.is_chain
    assert spec.children.tolist() == [
        [1, 2, 3], [4, 5, -1], [-1, -1, -1], [6, -1, -1], [-1, -1, -1], [7, -1, -1], [-1, -1, -1], [-1, -1, -1],
    ]
    assert spec.retrieve.tolist() == [[0, 2, -1, -1], [0, 1, 4, -1], [0, 3, 6, -1], [0, 1, 5, 7]]
    assert spec.ancestors[7].nonzero().flatten().tolist() == [0, 1, 5, 7]


def test_spec_is_cached_and_to_device_keeps_buffers():
    parents = [-1, 0, 0, 1]
    a = TreeSpec.from_parents(parents)
    assert TreeSpec.from_parents(torch.tensor(parents)) is a
    b = a.to("cpu")
    for name in ("parents", "depth", "ancestors", "children", "retrieve"):
        assert torch.equal(getattr(a, name), getattr(b, name))
    assert b.max_depth == a.max_depth and b.key == a.key


@pytest.mark.parametrize(
    "parents, match",
    [
        ([], "at least the root"),
        ([0], "node 0 must be the root"),
        ([2, -1, 0], "node 0 must be the root"),
        ([-1, 0, -1], "exactly one root"),
        ([-1, 1], "topological order"),
        ([-1, 0, 5], "topological order"),
        ([-1, -2], "topological order"),
    ],
)
def test_from_parents_rejects_non_trees(parents, match):
    with pytest.raises(ValueError, match=match):
        TreeSpec.from_parents(parents)
    if parents:
        with pytest.raises(ValueError, match=match):
            ancestor_mask(torch.tensor(parents))


def test_from_parents_rejects_bad_tensor():
    with pytest.raises(ValueError, match="1-D integer tensor"):
        TreeSpec.from_parents(torch.tensor([[-1, 0]]))
    with pytest.raises(ValueError, match="1-D integer tensor"):
        TreeSpec.from_parents(torch.tensor([-1.0, 0.0]))


# ----------------------------------------------------------------------------------------------
# Medusa "choices"


def test_from_paths_medusa_example():
    spec, rank = tree_from_paths([(0,), (1,), (0, 0), (0, 1)])
    assert spec.parents.tolist() == [-1, 0, 0, 1, 1]
    assert rank.tolist() == [-1, 0, 1, 0, 1]
    assert spec.depth.tolist() == [0, 1, 1, 2, 2]
    assert TreeSpec.from_paths([(0,), (1,), (0, 0), (0, 1)]) is spec


def test_from_paths_order_does_not_matter():
    paths = [(0, 1, 0), (2,), (0,), (0, 1), (1,), (0, 0), (1, 0)]
    spec, rank = tree_from_paths(paths)
    spec2, rank2 = tree_from_paths(sorted(paths))
    assert spec is spec2 and torch.equal(rank, rank2)
    # nodes ordered by (depth, path)
    assert spec.parents.tolist() == [-1, 0, 0, 0, 1, 1, 2, 5]
    assert rank.tolist() == [-1, 0, 1, 2, 0, 1, 0, 0]


@st.composite
def random_paths(draw):
    """A prefix-closed set of rank tuples, built from a random tree with random (sparse) ranks."""
    parents = draw(random_parents(max_nodes=20))
    paths: list[tuple[int, ...]] = [()]
    used: dict[int, set[int]] = {}
    for i in range(1, len(parents)):
        r = draw(st.integers(0, 24).filter(lambda v, p=parents[i]: v not in used.get(p, set())))
        used.setdefault(parents[i], set()).add(r)
        paths.append(paths[parents[i]] + (r,))
    choices = paths[1:]
    order = draw(st.permutations(range(len(choices))))
    return [list(choices[j]) for j in order]


@HYP
@given(paths=random_paths())
def test_from_paths_properties(paths):
    spec, rank = tree_from_paths(paths)
    N = len(paths) + 1
    par = spec.parents.tolist()
    assert spec.num_nodes == N and rank.shape == (N,) and rank.dtype == torch.long
    assert par[0] == -1 and rank[0] == -1
    assert all(0 <= par[i] < i for i in range(1, N))  # topological
    # reconstruct every node's path from parents + rank
    node_path = [()]
    for i in range(1, N):
        node_path.append(node_path[par[i]] + (int(rank[i]),))
    assert set(node_path[1:]) == {tuple(p) for p in paths}
    assert len(set(node_path)) == N
    # rank is the last element of the node's path, depth its length
    for i in range(1, N):
        assert rank[i] == node_path[i][-1]
        assert spec.depth[i] == len(node_path[i])
    # nodes are sorted by (depth, path)
    keys = [(len(p), p) for p in node_path]
    assert keys == sorted(keys)
    _check_spec(spec, par)


@pytest.mark.parametrize(
    "paths, match",
    [
        ([(0,), (0, 1, 0)], "missing its prefix"),
        ([(1, 0)], "missing its prefix"),
        ([(0,), (1,), (0,)], "duplicate"),
        ([(0,), [0]], "duplicate"),
        ([(0,), (-1,)], "negative rank"),
        ([(0,), (0, -2)], "negative rank"),
        ([(0,), ()], "empty path"),
    ],
)
def test_from_paths_rejects_bad_choices(paths, match):
    with pytest.raises(ValueError, match=match):
        tree_from_paths(paths)
    with pytest.raises(ValueError, match=match):
        TreeSpec.from_paths(paths)


def test_from_paths_empty_is_root_only():
    spec, rank = tree_from_paths([])
    assert spec.parents.tolist() == [-1] and rank.tolist() == [-1] and spec.max_depth == 0


# ----------------------------------------------------------------------------------------------
# positions


@HYP
@given(parents=random_parents(), prefix=st.lists(st.integers(0, 10_000), min_size=1, max_size=4))
def test_tree_positions(parents, prefix):
    spec = TreeSpec.from_parents(parents)
    prefix_len = torch.tensor(prefix)
    pos = tree_positions(prefix_len, spec.depth)
    assert pos.shape == (len(prefix), len(parents))
    for b, p in enumerate(prefix):
        assert pos[b].tolist() == [p + int(d) for d in spec.depth]
    # a node sits one position after its parent
    for i in range(1, len(parents)):
        assert torch.equal(pos[:, i], pos[:, parents[i]] + 1)


def test_tree_positions_chain():
    spec = TreeSpec.chain(4)
    assert tree_positions(torch.tensor([7, 0]), spec.depth).tolist() == [[7, 8, 9, 10, 11], [0, 1, 2, 3, 4]]
