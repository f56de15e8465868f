"""Exact (deterministic) tests of verify_chain / verify_tree.

Greedy decoding has a unique correct answer, so it is checked against hand-written expected tensors
and against a plain-Python reference walk. Sampled decoding is checked for properties that must hold
on every single draw: nothing outside the warped support is ever emitted, the same generator seed
reproduces the same tokens, and bad input is rejected with a clear ValueError.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specgraph import TreeSpec, verify_chain, verify_tree, warped_probs

HYP = settings(derandomize=True, max_examples=40, deadline=None, database=None)

NEG = float("-inf")




def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _peaked_logits(argmax: list[list[int]], vocab: int, seed: int = 0) -> torch.Tensor:
    """[B, L, V] random logits whose row (b, l) has its unique argmax at argmax[b][l]."""
    g = _gen(seed)
    idx = torch.tensor(argmax, dtype=torch.long)
    logits = torch.randn(*idx.shape, vocab, generator=g)
    return logits.scatter(-1, idx.unsqueeze(-1), 10.0)


# ----------------------------------------------------------------------------------------------
# greedy chain: exact expected tensors


def test_chain_greedy_exact_rows_with_different_outcomes():
    V, K = 16, 4
    target = [
        [3, 5, 7, 9, 11],  # row 0: every draft matches -> K + 1 tokens incl. the bonus argmax 11
        [3, 5, 7, 9, 11],  # row 1: first mismatch at j = 2
        [2, 4, 6, 8, 10],  # row 2: mismatch at j = 0 -> only the target argmax
        [1, 1, 1, 1, 12],  # row 3: mismatch at the last draft (j = 3)
    ]
    drafts = torch.tensor(
        [
            [3, 5, 7, 9],
            [3, 5, 0, 9],  # the later 9 matches but must not count after the rejection at j = 2
            [1, 4, 6, 8],
            [1, 1, 1, 0],
        ]
    )
    logits = _peaked_logits(target, V)
    tokens, n = verify_chain(logits, None, drafts, temperature=0.0)
    expected = torch.tensor(
        [
            [3, 5, 7, 9, 11],
            [3, 5, 7, -1, -1],
            [2, -1, -1, -1, -1],
            [1, 1, 1, 1, -1],
        ]
    )
    assert tokens.dtype == torch.long and n.dtype == torch.long
    assert torch.equal(tokens, expected)
    assert torch.equal(n, torch.tensor([5, 3, 1, 4]))


def test_chain_greedy_ignores_draft_probs_and_bonus_is_last_row_argmax():
    V, K = 10, 3
    logits = _peaked_logits([[4, 2, 8, 0]], V, seed=3)
    drafts = torch.tensor([[4, 2, 8]])
    q = torch.full((1, K, V), 1.0 / V)
    for probs in (None, q):
        tokens, n = verify_chain(logits, probs, drafts, temperature=0.0)
        assert torch.equal(tokens, torch.tensor([[4, 2, 8, 0]]))
        assert torch.equal(n, torch.tensor([4]))


def test_chain_greedy_k0_emits_argmax():
    logits = _peaked_logits([[6], [1]], 8)
    tokens, n = verify_chain(logits, None, torch.zeros(2, 0, dtype=torch.long), temperature=0.0)
    assert torch.equal(tokens, torch.tensor([[6], [1]]))
    assert torch.equal(n, torch.tensor([1, 1]))


def _ref_chain_greedy(logits: torch.Tensor, drafts: torch.Tensor) -> tuple[list[list[int]], list[int]]:
    B, K = drafts.shape
    rows, counts = [], []
    for b in range(B):
        out = []
        for j in range(K + 1):
            a = int(logits[b, j].argmax())
            out.append(a)
            if j == K or int(drafts[b, j]) != a:
                break
        counts.append(len(out))
        rows.append(out + [-1] * (K + 1 - len(out)))
    return rows, counts


@HYP
@given(
    B=st.integers(1, 5), K=st.integers(0, 6), V=st.integers(2, 5), seed=st.integers(0, 2**31 - 1),
)
def test_chain_greedy_matches_python_reference(B, K, V, seed):
    g = _gen(seed)
    logits = torch.randn(B, K + 1, V, generator=g)
    drafts = torch.randint(0, V, (B, K), generator=g)  # small V: matches are frequent
    tokens, n = verify_chain(logits, None, drafts, temperature=0.0)
    rows, counts = _ref_chain_greedy(logits, drafts)
    assert tokens.tolist() == rows
    assert n.tolist() == counts


# ----------------------------------------------------------------------------------------------
# greedy tree: exact expected tensors

#         0
#       /   \
#      1     2
#     / \     \
#    3   4     5
#    |
#    6
PARENTS = [-1, 0, 0, 1, 1, 2, 3]


def test_tree_greedy_exact():
    V = 20
    # tree_tokens per row; the root entry is ignored.
    tree_tokens = torch.tensor(
        [
            [0, 11, 12, 13, 14, 15, 16],  # row 0: 0 -> 1 -> 4 (leaf at depth 2), bonus from row of node 4
            [0, 11, 11, 13, 14, 15, 16],  # row 1: siblings 1 and 2 share a token: node 1 wins; 0->1->3->6 leaf
            [0, 11, 12, 13, 14, 15, 16],  # row 2: nothing matches at the root
            [0, 11, 12, 13, 14, 15, 16],  # row 3: 0 -> 2 -> 5 (leaf)
            [0, 11, 12, 13, 14, 15, 16],  # row 4: 0 -> 1, then no child of 1 matches
        ]
    )
    # argmax at each node (row b, node i)
    target = [
        [11, 14, 0, 0, 7, 0, 0],
        [11, 13, 9, 16, 0, 0, 5],
        [3, 13, 15, 16, 0, 0, 0],
        [12, 13, 15, 16, 0, 8, 0],
        [11, 2, 15, 16, 0, 0, 0],
    ]
    logits = _peaked_logits(target, V, seed=1)
    path_tokens, n, path_nodes = verify_tree(logits, None, tree_tokens, PARENTS, temperature=0.0)
    assert torch.equal(
        path_tokens,
        torch.tensor(
            [
                [11, 14, 7, -1],
                [11, 13, 16, 5],
                [3, -1, -1, -1],
                [12, 15, 8, -1],
                [11, 2, -1, -1],
            ]
        ),
    )
    assert torch.equal(n, torch.tensor([3, 4, 1, 3, 2]))
    assert torch.equal(
        path_nodes,
        torch.tensor(
            [
                [0, 1, 4, -1],
                [0, 1, 3, 6],
                [0, -1, -1, -1],
                [0, 2, 5, -1],
                [0, 1, -1, -1],
            ]
        ),
    )


def test_tree_greedy_accepts_treespec_and_list_and_tensor_parents():
    V = 20
    tree_tokens = torch.tensor([[0, 11, 12, 13, 14, 15, 16]])
    logits = _peaked_logits([[11, 14, 0, 0, 7, 0, 0]], V, seed=2)
    outs = [
        verify_tree(logits, None, tree_tokens, p, temperature=0.0)
        for p in (PARENTS, torch.tensor(PARENTS), TreeSpec.from_parents(PARENTS))
    ]
    for out in outs[1:]:
        for a, b in zip(outs[0], out):
            assert torch.equal(a, b)


def test_tree_greedy_chain_tree_equals_verify_chain():
    B, K, V = 6, 5, 4
    g = _gen(7)
    logits = torch.randn(B, K + 1, V, generator=g)
    drafts = torch.randint(0, V, (B, K), generator=g)
    tokens, n = verify_chain(logits, None, drafts, temperature=0.0)
    tree_tokens = torch.cat([torch.zeros(B, 1, dtype=torch.long), drafts], dim=1)
    path_tokens, n_tree, path_nodes = verify_tree(logits, None, tree_tokens, TreeSpec.chain(K), temperature=0.0)
    assert torch.equal(tokens, path_tokens)
    assert torch.equal(n, n_tree)
    # on a chain, the accepted nodes are 0..n-1
    pos = torch.arange(K + 1).unsqueeze(0)
    assert torch.equal(path_nodes, torch.where(pos < n.unsqueeze(1), pos, -1))


def _ref_tree_greedy(logits, tree_tokens, parents):
    N = len(parents)
    kids = [[c for c in range(1, N) if parents[c] == i] for i in range(N)]
    depth = [0] * N
    for i in range(1, N):
        depth[i] = depth[parents[i]] + 1
    D = max(depth)
    rows_t, rows_n, counts = [], [], []
    for b in range(logits.shape[0]):
        node, toks, nodes = 0, [], [0]
        while True:
            a = int(logits[b, node].argmax())
            toks.append(a)
            match = next((c for c in kids[node] if int(tree_tokens[b, c]) == a), None)
            if match is None:
                break
            nodes.append(match)
            node = match
        counts.append(len(toks))
        rows_t.append(toks + [-1] * (D + 1 - len(toks)))
        rows_n.append(nodes + [-1] * (D + 1 - len(nodes)))
    return rows_t, counts, rows_n


@st.composite
def random_parents(draw, max_nodes=12):
    n = draw(st.integers(1, max_nodes))
    return [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]


@HYP
@given(parents=random_parents(), B=st.integers(1, 4), V=st.integers(2, 4), seed=st.integers(0, 2**31 - 1))
def test_tree_greedy_matches_python_reference(parents, B, V, seed):
    g = _gen(seed)
    N = len(parents)
    logits = torch.randn(B, N, V, generator=g)
    tree_tokens = torch.randint(0, V, (B, N), generator=g)
    path_tokens, n, path_nodes = verify_tree(logits, None, tree_tokens, parents, temperature=0.0)
    rows_t, counts, rows_n = _ref_tree_greedy(logits, tree_tokens, parents)
    assert path_tokens.tolist() == rows_t
    assert n.tolist() == counts
    assert path_nodes.tolist() == rows_n


# ----------------------------------------------------------------------------------------------
# sampling: never emit a token outside the warped support


def _allowed_reference(rows: np.ndarray, temperature, top_k, top_p, min_p) -> np.ndarray:
    """Independent float64 reference of the HF support of each row of ``rows`` [R, V]: bool [R, V]."""
    x = rows.astype(np.float64) / temperature

    def softmax(z):
        e = np.exp(z - z.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)

    if top_k is not None and top_k < x.shape[-1]:
        kth = np.sort(x, axis=-1)[:, -top_k][:, None]
        x = np.where(x >= kth, x, -np.inf)
    if top_p is not None and top_p < 1.0:
        p = softmax(x)
        order = np.argsort(-p, axis=-1, kind="stable")
        sorted_p = np.take_along_axis(p, order, axis=-1)
        before = np.cumsum(sorted_p, axis=-1) - sorted_p  # mass strictly before each token
        keep = np.zeros_like(x, dtype=bool)
        np.put_along_axis(keep, order, before < top_p, axis=-1)
        x = np.where(keep, x, -np.inf)
    if min_p is not None and min_p > 0.0:
        p = softmax(x)
        x = np.where(p >= min_p * p.max(axis=-1, keepdims=True), x, -np.inf)
    return np.isfinite(x)


def _allowed(logits: torch.Tensor, **kw) -> torch.Tensor:
    mask = _allowed_reference(logits.reshape(-1, logits.shape[-1]).numpy(), **kw)
    return torch.from_numpy(mask).reshape(logits.shape)


SAMPLING_SETTINGS = [
    dict(temperature=1.0, top_k=3, top_p=None, min_p=None),
    dict(temperature=0.7, top_k=None, top_p=0.6, min_p=None),
    dict(temperature=1.3, top_k=None, top_p=None, min_p=0.2),
    dict(temperature=0.9, top_k=8, top_p=0.8, min_p=0.05),
    dict(temperature=2.0, top_k=1, top_p=None, min_p=None),
    dict(temperature=1.0, top_k=None, top_p=0.05, min_p=None),
    dict(temperature=0.5, top_k=None, top_p=None, min_p=1.0),
]


def _ids(s):
    return "-".join(f"{k}={v}" for k, v in s.items() if v is not None)


def _sample_rows(probs: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=g).reshape(probs.shape[:-1])


@pytest.mark.parametrize("setting", SAMPLING_SETTINGS, ids=_ids)
@pytest.mark.parametrize("with_q", [True, False], ids=["q", "q=None"])
def test_chain_sampling_stays_in_allowed_set(setting, with_q):
    B, K, V = 256, 4, 40
    g = _gen(11)
    target = 2.0 * torch.randn(B, K + 1, V, generator=g)
    allowed = _allowed(target, **setting)
    assert not allowed.all(), "settings must actually filter something"
    if with_q:
        draft_logits = target[:, :K] + torch.randn(B, K, V, generator=g)  # a different model
        q = warped_probs(draft_logits, **setting)
        drafts = _sample_rows(q, g)
    else:
        q = None
        drafts = torch.randint(0, V, (B, K), generator=g)  # deterministic drafts, often disallowed
    tokens, n = verify_chain(target, q, drafts, generator=_gen(12), **setting)
    assert tokens.shape == (B, K + 1)
    assert ((n >= 1) & (n <= K + 1)).all()
    emitted = tokens >= 0
    pos = torch.arange(K + 1).unsqueeze(0)
    assert torch.equal(emitted, pos < n.unsqueeze(1))
    ok = allowed.gather(-1, tokens.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    assert (ok | ~emitted).all(), "emitted a token outside the warped support"
    # sanity: drafts were accepted sometimes and rejected sometimes
    assert (n > 1).any() and (n < K + 1).any()


def _sample_tree_tokens(parents, q: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Children of node i drawn i.i.d. from q[:, i]."""
    B, N, _ = q.shape
    tokens = torch.zeros(B, N, dtype=torch.long)
    for c in range(1, N):
        tokens[:, c] = torch.multinomial(q[:, parents[c]], 1, generator=g).squeeze(1)
    return tokens


@pytest.mark.parametrize("setting", SAMPLING_SETTINGS, ids=_ids)
@pytest.mark.parametrize("with_q", [True, False], ids=["q", "q=None"])
def test_tree_sampling_stays_in_allowed_set(setting, with_q):
    B, V = 256, 40
    N = len(PARENTS)
    g = _gen(21)
    target = 2.0 * torch.randn(B, N, V, generator=g)
    allowed = _allowed(target, **setting)
    if with_q:
        q = warped_probs(target + torch.randn(B, N, V, generator=g), **setting)
        tree_tokens = _sample_tree_tokens(PARENTS, q, g)
    else:
        q = None
        # deterministic children: the target's top candidates plus some random (often disallowed) ones
        top = target.topk(2, dim=-1).indices  # [B, N, 2]
        tree_tokens = torch.randint(0, V, (B, N), generator=g)
        for c, rank in ((1, 0), (2, 1), (3, 0), (5, 0)):
            tree_tokens[:, c] = top[:, PARENTS[c], rank]
    path_tokens, n, path_nodes = verify_tree(target, q, tree_tokens, PARENTS, generator=_gen(22), **setting)
    D = TreeSpec.from_parents(PARENTS).max_depth
    assert path_tokens.shape == (B, D + 1) and path_nodes.shape == (B, D + 1)
    pos = torch.arange(D + 1).unsqueeze(0)
    emitted = pos < n.unsqueeze(1)
    assert torch.equal(path_tokens >= 0, emitted)
    assert torch.equal(path_nodes >= 0, emitted)
    # token j is drawn from (or accepted against) the distribution at node path_nodes[j]
    node_allowed = allowed.gather(1, path_nodes.clamp_min(0).unsqueeze(-1).expand(B, D + 1, V))
    ok = node_allowed.gather(-1, path_tokens.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    assert (ok | ~emitted).all(), "emitted a token outside the warped support"
    # accepted nodes form a parent chain, and their tokens are the emitted ones
    par = torch.tensor(PARENTS)
    for j in range(1, D + 1):
        live = path_nodes[:, j] >= 0
        assert torch.equal(par[path_nodes[live, j]], path_nodes[live, j - 1])
        assert torch.equal(tree_tokens[live].gather(1, path_nodes[live, j : j + 1]).squeeze(1), path_tokens[live, j - 1])


# ----------------------------------------------------------------------------------------------
# seeded determinism


def _chain_inputs(seed=0, B=64, K=4, V=30):
    g = _gen(seed)
    target = torch.randn(B, K + 1, V, generator=g)
    q = warped_probs(target[:, :K] + torch.randn(B, K, V, generator=g), temperature=0.8)
    drafts = _sample_rows(q, g)
    return target, q, drafts


def test_chain_same_seed_same_output_different_seed_differs():
    target, q, drafts = _chain_inputs()
    kw = dict(temperature=0.8)
    a = verify_chain(target, q, drafts, generator=_gen(5), **kw)
    b = verify_chain(target, q, drafts, generator=_gen(5), **kw)
    c = verify_chain(target, q, drafts, generator=_gen(6), **kw)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


def test_tree_same_seed_same_output_different_seed_differs():
    B, V = 64, 30
    N = len(PARENTS)
    g = _gen(3)
    target = torch.randn(B, N, V, generator=g)
    q = warped_probs(target + torch.randn(B, N, V, generator=g), temperature=1.1, top_k=10)
    tree_tokens = _sample_tree_tokens(PARENTS, q, g)
    kw = dict(temperature=1.1, top_k=10)
    a = verify_tree(target, q, tree_tokens, PARENTS, generator=_gen(5), **kw)
    b = verify_tree(target, q, tree_tokens, PARENTS, generator=_gen(5), **kw)
    c = verify_tree(target, q, tree_tokens, PARENTS, generator=_gen(6), **kw)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    assert not torch.equal(a[0], c[0])


def test_global_seed_determinism_without_generator():
    target, q, drafts = _chain_inputs(seed=1)
    torch.manual_seed(123)
    a = verify_chain(target, q, drafts, temperature=0.8)
    torch.manual_seed(123)
    b = verify_chain(target, q, drafts, temperature=0.8)
    assert torch.equal(a[0], b[0])


# ----------------------------------------------------------------------------------------------
# vocab boundaries


@pytest.mark.parametrize("V", [1025, 4099])
def test_chain_vocab_boundary_mass_in_last_entries(V):
    B, K = 128, 3
    last = 3  # only the last `last` entries of the vocab are possible
    g = _gen(V)
    target = torch.full((B, K + 1, V), NEG)
    target[..., V - last :] = torch.randn(B, K + 1, last, generator=g)
    # greedy
    target_g = target.clone()
    target_g[..., V - 1] = 50.0
    drafts = torch.full((B, K), V - 1)
    tokens, n = verify_chain(target_g, None, drafts, temperature=0.0)
    assert torch.equal(tokens, torch.full((B, K + 1), V - 1)) and (n == K + 1).all()
    # sampled, deterministic drafts at the very last id, and q drawn from a draft concentrated there too
    tokens, n = verify_chain(target, None, drafts, temperature=1.0, generator=_gen(1))
    emitted = tokens[tokens >= 0]
    assert ((emitted >= V - last) & (emitted < V)).all()
    assert (emitted == V - 1).any() and (emitted == V - last).any()
    q_logits = torch.full((B, K, V), NEG)
    q_logits[..., V - 2 :] = 0.0
    q = warped_probs(q_logits)
    drafts = _sample_rows(q, g)
    tokens, n = verify_chain(target, q, drafts, temperature=1.0, top_k=2, generator=_gen(2))
    emitted = tokens[tokens >= 0]
    assert ((emitted >= V - last) & (emitted < V)).all()


@pytest.mark.parametrize("V", [1025, 4099])
def test_tree_vocab_boundary_mass_in_last_entries(V):
    B, N = 64, len(PARENTS)
    g = _gen(V + 1)
    target = torch.full((B, N, V), NEG)
    target[..., V - 2 :] = torch.randn(B, N, 2, generator=g)
    tree_tokens = torch.full((B, N), V - 1)
    tree_tokens[:, 2] = V - 2
    out = verify_tree(target, None, tree_tokens, PARENTS, temperature=1.0, generator=_gen(3))
    emitted = out[0][out[0] >= 0]
    assert ((emitted == V - 1) | (emitted == V - 2)).all()
    assert (out[1] > 1).any()
    target_g = target.clone()
    target_g[..., V - 1] = 5.0
    path_tokens, n, path_nodes = verify_tree(target_g, None, tree_tokens, PARENTS, temperature=0.0)
    # node 1 (token V-1) is the first match at the root, then 3, then 6 (leaf), bonus V-1
    assert torch.equal(path_tokens, torch.full((B, 4), V - 1))
    assert torch.equal(path_nodes, torch.tensor([[0, 1, 3, 6]]).expand(B, 4))


def test_tree_root_token_is_ignored_even_out_of_range():
    """The root entry is documented as ignored: an out-of-range value there must not reach sampling."""
    V, N = 12, len(PARENTS)
    g = _gen(4)
    target = torch.randn(3, N, V, generator=g)
    tree_tokens = torch.randint(0, V, (3, N), generator=g)
    ref = verify_tree(target, None, tree_tokens, PARENTS, generator=_gen(9))
    for root in (-1, V, 10**6):
        tt = tree_tokens.clone()
        tt[:, 0] = root
        out = verify_tree(target, None, tt, PARENTS, generator=_gen(9))
        for a, b in zip(ref, out):
            assert torch.equal(a, b)
        out = verify_tree(target, None, tt, PARENTS, temperature=0.0)
        ref_g = verify_tree(target, None, tree_tokens, PARENTS, temperature=0.0)
        for a, b in zip(ref_g, out):
            assert torch.equal(a, b)


def test_tree_draft_probs_of_leaves_are_not_validated():
    V, N = 10, len(PARENTS)
    g = _gen(8)
    target = torch.randn(2, N, V, generator=g)
    q = warped_probs(torch.randn(2, N, V, generator=g))
    leaves = [4, 5, 6]
    q[:, leaves] = 0.0  # never used: leaves have no children
    tree_tokens = _sample_tree_tokens(PARENTS, q, g)
    path_tokens, n, _ = verify_tree(target, q, tree_tokens, PARENTS, generator=_gen(1))
    assert ((n >= 1) & (n <= 4)).all()


# ----------------------------------------------------------------------------------------------
# bad input


def _good_chain(B=2, K=3, V=8):
    g = _gen(0)
    target = torch.randn(B, K + 1, V, generator=g)
    q = warped_probs(torch.randn(B, K, V, generator=g))
    drafts = torch.randint(0, V, (B, K), generator=g)
    return target, q, drafts


def test_good_chain_inputs_pass():
    target, q, drafts = _good_chain()
    verify_chain(target, q, drafts)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda t, q, d: (t[:, :-1], q, d), "shape mismatch"),  # K logits rows for K drafts
        (lambda t, q, d: (t, q, d[:, :-1]), "shape mismatch"),  # K-1 drafts
        (lambda t, q, d: (t[:1], q[:1], d), "shape mismatch"),  # batch
        (lambda t, q, d: (t, q[:1], d), "draft_probs must be"),  # batch of q
        (lambda t, q, d: (t, q[:, :-1], d), "draft_probs must be"),  # K of q
        (lambda t, q, d: (t[0], q, d), r"target_logits must be \[B, K\+1, V\]"),
        (lambda t, q, d: (t, q, d[0]), r"draft_tokens must be \[B, K\]"),
        (lambda t, q, d: (t, torch.cat([q, torch.zeros(*q.shape[:2], 1)], -1), d), "vocab mismatch"),
        (lambda t, q, d: (t, None, d.float()), "integer tensor"),
        (lambda t, q, d: (t.long(), None, d), "floating-point"),
    ],
)
def test_chain_bad_shapes_and_dtypes(mutate, match):
    t, q, d = mutate(*_good_chain())
    with pytest.raises(ValueError, match=match):
        verify_chain(t, q, d)


def _set(t, idx, value):
    t = t.clone()
    t[idx] = value
    return t


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda t, q, d: (_set(t, (0, 1, 2), float("nan")), q, d), "NaN"),
        (lambda t, q, d: (_set(t, (1, 0, 0), float("inf")), q, d), r"\+inf"),
        (lambda t, q, d: (_set(t, (1, 2), NEG), q, d), "-inf everywhere"),
        (lambda t, q, d: (t, _set(q, (0, 0, 0), -0.1), d), "negative"),
        (lambda t, q, d: (t, _set(q, (0, 1, 0), float("nan")), d), "NaN or inf"),
        (lambda t, q, d: (t, t[:, :-1].exp(), d), "sum to 1"),  # positive but unnormalized
        (lambda t, q, d: (t, t[:, :-1].clone(), d), "negative|sum to 1"),  # raw logits passed as probs
        (lambda t, q, d: (t, q * 0.5, d), "sum to 1"),
        (lambda t, q, d: (t, q, _set(d, (0, 0), t.shape[-1])), "outside"),
        (lambda t, q, d: (t, q, _set(d, (1, 2), -1)), "outside"),
    ],
)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_chain_bad_values(mutate, match, temperature):
    t, q, d = mutate(*_good_chain())
    with pytest.raises(ValueError, match=match):
        verify_chain(t, q, d, temperature=temperature)


def test_chain_validate_false_skips_value_checks():
    t, q, d = _good_chain()
    verify_chain(t, q * 0.5, d, validate=False)  # no value check, no error


def test_bf16_draft_rows_at_a_large_vocabulary_pass_the_sum_check():
    """Peaked rows rounded to bf16 from exact distributions (vocab 152k) sum to 1 within bf16's
    eps but not within 1e-3: the tolerance follows the dtype; a row 5% off still fails."""
    g = torch.Generator().manual_seed(0)
    V = 152064
    q = torch.softmax(torch.randn(1, 2, V, generator=g) * 10, -1).to(torch.bfloat16)  # [1, K=2, V]
    assert ((q.float().sum(-1) - 1).abs() > 1e-3).any()  # a fixed 1e-3 would refuse these rows
    t = torch.randn(1, 3, V, generator=g).to(torch.bfloat16)  # [1, K+1, V]
    d = torch.multinomial(q[0].float(), 1, generator=g).T  # [1, K]
    verify_chain(t, q, d, temperature=1.0, generator=g)
    with pytest.raises(ValueError, match="sum to 1"):
        verify_chain(t, q * 1.05, d, temperature=1.0)


BAD_PARAMS = [
    (dict(temperature=-0.5), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(temperature=1e-39), "temperature"),  # logits / T would overflow float32
    (dict(top_k=0), "top_k"),
    (dict(top_k=-3), "top_k"),
    (dict(top_k=2.0), "top_k"),
    (dict(top_k=True), "top_k"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_p=-0.2), "top_p"),
    (dict(min_p=-0.1), "min_p"),
    (dict(min_p=1.5), "min_p"),
]


@pytest.mark.parametrize("params, match", BAD_PARAMS, ids=[str(p) for p, _ in BAD_PARAMS])
def test_bad_sampling_params(params, match):
    t, q, d = _good_chain()
    with pytest.raises(ValueError, match=match):
        verify_chain(t, q, d, **params)
    N = len(PARENTS)
    tl = torch.randn(2, N, 8)
    with pytest.raises(ValueError, match=match):
        verify_tree(tl, None, torch.zeros(2, N, dtype=torch.long), PARENTS, **params)


def _good_tree(B=2, V=8):
    N = len(PARENTS)
    g = _gen(0)
    target = torch.randn(B, N, V, generator=g)
    q = warped_probs(torch.randn(B, N, V, generator=g))
    tokens = torch.randint(0, V, (B, N), generator=g)
    return target, q, tokens


def test_good_tree_inputs_pass():
    t, q, tok = _good_tree()
    verify_tree(t, q, tok, PARENTS)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda t, q, k: (t[:, :-1], q, k), "shape mismatch"),
        (lambda t, q, k: (t, q, k[:, :-1]), "tree_tokens must be"),
        (lambda t, q, k: (t, q, k[:1]), "tree_tokens must be"),
        (lambda t, q, k: (t, q[:1], k), "draft_probs must be"),
        (lambda t, q, k: (t, q[..., :-1], k), "vocab mismatch"),
        (lambda t, q, k: (t[0], q, k), r"target_logits must be \[B, N, V\]"),
        (lambda t, q, k: (_set(t, (0, 3, 1), float("nan")), q, k), "NaN"),
        (lambda t, q, k: (_set(t, (1, 6, 1), float("inf")), q, k), r"\+inf"),
        (lambda t, q, k: (_set(t, (0, 5), NEG), q, k), "-inf everywhere"),
        (lambda t, q, k: (t, _set(q, (0, 1, 0), -1e-2), k), "negative"),
        (lambda t, q, k: (t, t.exp(), k), "sum to 1"),
        (lambda t, q, k: (t, q, _set(k, (0, 3), t.shape[-1])), "outside"),
        (lambda t, q, k: (t, q, _set(k, (1, 1), -1)), "outside"),
        (lambda t, q, k: (t, q, k.float()), "integer tensor"),
    ],
)
def test_tree_bad_input(mutate, match):
    t, q, k = mutate(*_good_tree())
    with pytest.raises(ValueError, match=match):
        verify_tree(t, q, k, PARENTS)


@pytest.mark.parametrize(
    "parents, match",
    [
        ([-1, 0, -1, 1], "exactly one root"),  # two roots
        ([-1, -1], "exactly one root"),
        ([0, 0, 1], "node 0 must be the root"),
        ([1, -1, 0], "node 0 must be the root"),
        ([-1, 0, 2, 1], "topological order"),  # parent == index (self loop)
        ([-1, 0, 3, 0], "topological order"),  # parent > index
        ([-1, 0, 7], "topological order"),  # parent out of range
        ([], "at least the root"),
    ],
)
def test_tree_bad_parents(parents, match):
    N = max(len(parents), 1)
    with pytest.raises(ValueError, match=match):
        verify_tree(torch.randn(1, N, 5), None, torch.zeros(1, N, dtype=torch.long), parents)


def test_tree_bad_parents_tensor():
    with pytest.raises(ValueError, match="1-D integer tensor"):
        verify_tree(torch.randn(1, 3, 5), None, torch.zeros(1, 3, dtype=torch.long), torch.tensor([[-1, 0, 0]]))
    with pytest.raises(ValueError, match="1-D integer tensor"):
        verify_tree(torch.randn(1, 3, 5), None, torch.zeros(1, 3, dtype=torch.long), torch.tensor([-1.0, 0.0, 0.0]))


# ----------------------------------------------------------------------------------------------
# torch.compile(fullgraph=True)
#
# Only generator=None is compiled: a torch.Generator passed to torch.rand inside the compiled region
# is not supported by Dynamo (fullgraph raises "Unsupported"), so seeded-generator calls run eagerly.


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_compile_fullgraph_chain(fresh_dynamo):
    target, q, drafts = _chain_inputs(seed=2)
    greedy = torch.compile(lambda t, d: verify_chain(t, None, d, temperature=0.0), backend="eager", fullgraph=True)
    a = greedy(target, drafts)
    b = verify_chain(target, None, drafts, temperature=0.0)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])

    def sampled(t, q, d):
        return verify_chain(t, q, d, temperature=0.8, top_p=0.9, min_p=0.01)

    compiled = torch.compile(sampled, backend="eager", fullgraph=True)
    torch.manual_seed(7)
    a = compiled(target, q, drafts)
    torch.manual_seed(7)
    b = sampled(target, q, drafts)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_compile_fullgraph_tree(fresh_dynamo):
    B, V = 32, 30
    N = len(PARENTS)
    spec = TreeSpec.from_parents(PARENTS)
    g = _gen(4)
    target = torch.randn(B, N, V, generator=g)
    q = warped_probs(target + torch.randn(B, N, V, generator=g), temperature=1.2, top_k=6)
    tree_tokens = _sample_tree_tokens(PARENTS, q, g)
    greedy = torch.compile(lambda t, k: verify_tree(t, None, k, spec, temperature=0.0), backend="eager", fullgraph=True)
    for x, y in zip(greedy(target, tree_tokens), verify_tree(target, None, tree_tokens, spec, temperature=0.0)):
        assert torch.equal(x, y)

    def sampled(t, q, k):
        return verify_tree(t, q, k, spec, temperature=1.2, top_k=6)

    compiled = torch.compile(sampled, backend="eager", fullgraph=True)
    torch.manual_seed(3)
    a = compiled(target, q, tree_tokens)
    torch.manual_seed(3)
    b = sampled(target, q, tree_tokens)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


# ----------------------------------------------------------------------------------------------
# greedy and sampled rows in one verification (the graph cache's rounds of mode "any")


@pytest.mark.parametrize("filters", [(None, None, None), (5, 0.9, None), (None, None, 0.05)])
def test_chain_rows_give_each_row_its_single_mode_verification(filters):
    from specgraph.verify import chain_noise, verify_chain_rows, verify_chain_with_noise

    B, K, V = 6, 3, 40
    g = _gen(11)
    logits = torch.randn(B, K + 1, V, generator=g) * 3
    drafts = logits[:, :K].argmax(-1)  # the greedy choice: greedy rows accept, sampled rows may not
    drafts[1, 1] = (drafts[1, 1] + 1) % V  # a rejection in a greedy row
    noise = chain_noise(B, K, V, "cpu", g)
    temperature = torch.tensor([0.0, 0.0, 0.7, 1.0, 0.0, 1.5])
    tokens, n = verify_chain_rows(logits, drafts, noise, temperature, *filters)
    for b in range(B):
        t = float(temperature[b])
        if t == 0:
            ref = verify_chain_with_noise(logits[b:b + 1], None, drafts[b:b + 1], None, 0.0)
        else:
            scaled = logits[b:b + 1].float() / t
            ref = verify_chain_with_noise(scaled, None, drafts[b:b + 1], (noise[0][b:b + 1], noise[1][b:b + 1]), 1.0,
                                          *filters)
        assert torch.equal(tokens[b], ref[0][0]) and int(n[b]) == int(ref[1][0]), b
    assert n[0] == K + 1 and n[1] == 2  # greedy rows: all accepted / the rejection at position 1
    # negative control: the same rows all sampled at temperature 1 give the greedy rows other tokens
    sampled, _ = verify_chain_rows(logits, drafts, noise, torch.ones(B), *filters)
    assert not torch.equal(sampled[[0, 1, 4]], tokens[[0, 1, 4]])
