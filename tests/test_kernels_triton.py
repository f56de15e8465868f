"""Triton verification kernels vs. the plain-torch references, token for token.

The kernels run on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``). Triton picks
interpreter or compiler when ``@triton.jit`` runs, i.e. when ``specgraph.kernels`` is first
imported, and other test modules import it in this pytest process without the variable. So the
comparisons run in one child process: this file executed as a script, with the variable set before
anything imports Triton. The pytest side starts it once per module (with only the selected cases)
and reports each case as its own test.

Run the worker by hand for debugging:  ``python tests/test_kernels_triton.py [case ...]``.
"""
from __future__ import annotations

import os

if __name__ == "__main__":  # worker: interpreter mode must be on before Triton kernels are defined
    os.environ["TRITON_INTERPRET"] = "1"

import inspect
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from specgraph import TreeSpec, tree_from_paths, warp_logits, warped_probs
from specgraph.kernels import HAS_TRITON, chain_outcomes_reference, tree_outcomes_reference

NEG_INF = float("-inf")

# ----------------------------------------------------------------------------------------------
# cases: each builds its inputs from a fixed seed; ``expect`` checks (on the reference outputs)
# that the case really exercises what its name says.

CASES: dict[str, Callable[[], dict]] = {}


def _case(fn):
    CASES[fn.__name__.removeprefix("case_")] = fn
    return fn


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _expo(shape, g) -> torch.Tensor:  # as specgraph.verify.exponential_noise
    u = torch.rand(shape, generator=g)
    return -torch.log(u.clamp_min(torch.finfo(torch.float32).tiny))


def _chain(logits, q, tokens, g, *, block_v=None, expect=None) -> dict:
    B, K = tokens.shape
    V = logits.shape[-1]
    args = (logits, q, tokens, torch.rand(B, K, generator=g), _expo((B, K + 1, V), g))
    return {"kind": "chain", "args": args, "block_v": block_v, "expect": expect}


def _tree(logits, q, tokens, spec: TreeSpec, g, *, block_v=None, expect=None) -> dict:
    B, N, V = logits.shape
    C = spec.children.shape[1]
    args = (logits, q, tokens, spec.children, torch.rand(B, N, C, generator=g), _expo((B, N, V), g))
    return {"kind": "tree", "args": args, "block_v": block_v, "expect": expect}


def _sample(probs: torch.Tensor, g) -> torch.Tensor:  # [..., V] -> [...]
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=g).reshape(probs.shape[:-1])


def _mixed_accepts(out, args):
    accepted = out[0]
    if not (accepted.any() and (~accepted).any()):
        return f"wanted both accepts and rejections, got {accepted.tolist()}"
    return None


def _mixed_choices(out, args):
    choice = out[0]
    children = args[3]
    has_kids = (children[:, 0] >= 0).unsqueeze(0).expand_as(choice)
    if not ((choice >= 0).any() and ((choice < 0) & has_kids).any()):
        return f"wanted accepted children and all-rejected nodes, got {choice.tolist()}"
    return None


def _sampled_drafts(B, K, V, g, *, top_k=None, scale=2.0):
    """Target logits [B, K+1, V] and draft probs / tokens [B, K] from a related draft model."""
    target = torch.randn(B, K + 1, V, generator=g) * scale
    draft = target[:, :K] + torch.randn(B, K, V, generator=g)
    q = warped_probs(draft, top_k=top_k)
    return warp_logits(target, top_k=top_k), q, _sample(q, g)


# --- chains -------------------------------------------------------------------------------------


@_case
def case_chain_v7_k1_onehot():
    g = _gen(1)
    logits = torch.randn(4, 2, 7, generator=g) * 2
    tokens = logits[:, :1].argmax(-1)
    tokens[1::2] = torch.randint(0, 7, (2, 1), generator=g)
    return _chain(logits, None, tokens, g)


@_case
def case_chain_v7_k3_q():
    g = _gen(2)
    logits, q, tokens = _sampled_drafts(4, 3, 7, g)
    return _chain(logits, q, tokens, g, expect=_mixed_accepts)


@_case
def case_chain_v1000_k3_topk_q_block128():  # -inf masks, 1000 = 7 * 128 + 104
    g = _gen(3)
    logits, q, tokens = _sampled_drafts(2, 3, 1000, g, top_k=3)
    return _chain(logits, q, tokens, g, block_v=128, expect=_mixed_accepts)


@_case
def case_chain_v1000_k5_topk_onehot_block128():
    g = _gen(4)
    logits = warp_logits(torch.randn(2, 6, 1000, generator=g) * 2, top_k=3)
    top = logits[:, :5].topk(3, dim=-1).indices  # [2, 5, 3]
    tokens = top.gather(-1, torch.randint(0, 3, (2, 5, 1), generator=g)).squeeze(-1)
    tokens[1, 2] = 999  # filtered out by top-k: p_tok = 0
    return _chain(logits, None, tokens, g, block_v=128, expect=_mixed_accepts)


@_case
def case_chain_v4099_k5_q_block1024():  # last block holds 3 lanes
    g = _gen(5)
    logits, q, tokens = _sampled_drafts(2, 5, 4099, g, scale=4.0)
    return _chain(logits, q, tokens, g, block_v=1024)


@_case
def case_chain_v4099_k3_onehot_default_block():
    g = _gen(6)
    logits = warp_logits(torch.randn(2, 4, 4099, generator=g) * 4, top_k=20)
    tokens = logits[:, :3].argmax(-1)
    tokens[:, 1] = torch.randint(0, 4099, (2,), generator=g)
    return _chain(logits, None, tokens, g)


@_case
def case_chain_v4099_k3_mass_in_last_block():
    # Every block but the last is -inf (the online max stays -inf for a while); tokens >= 4096.
    g = _gen(7)
    V = 4099
    logits = torch.full((2, 4, V), NEG_INF)
    logits[..., -3:] = torch.randn(2, 4, 3, generator=g)
    q = torch.softmax(torch.randn(2, 3, V, generator=g), dim=-1)
    q[0, 0] = 0.0
    q[0, 0, -2:] = 0.5
    tokens = torch.tensor([[4097, 4098, 12], [4096, 4096, 4098]])

    def expect(out, args):
        if not (out[1] >= V - 3).all():
            return f"recovered tokens outside the last block: {out[1].tolist()}"
        return None

    return _chain(logits, q, tokens, g, block_v=1024, expect=expect)


@_case
def case_chain_v4099_k1_max_in_last_block():
    # Large logits late in the row force the online sum to be rescaled.
    g = _gen(8)
    logits = torch.randn(2, 2, 4099, generator=g)
    logits[..., -1] += 40.0
    logits[0, :, 4095] += 39.0
    tokens = torch.tensor([[4095], [4098]])
    return _chain(logits, None, tokens, g, block_v=512)


@_case
def case_chain_v49152_k1_q():
    g = _gen(9)
    logits, q, tokens = _sampled_drafts(1, 1, 49152, g, scale=3.0)
    return _chain(logits, q, tokens, g)


@_case
def case_chain_residual_zero_q_equals_p():
    # Equal finite logits on 4 tokens: p is exactly 0.25 there in both implementations, q == p, so
    # the residual is exactly zero and the recovered token falls back to a sample from p.
    g = _gen(10)
    V = 40
    logits = torch.full((3, 4, V), NEG_INF)
    support = torch.tensor([3, 17, 30, 39])
    logits[..., support] = 0.0
    q = torch.softmax(logits[:, :3], dim=-1)
    tokens = support[torch.randint(0, 4, (3, 3), generator=g)]

    def expect(out, args):
        p = torch.softmax(args[0], dim=-1)[:, :3]
        if not (torch.clamp(p - args[1], min=0.0) == 0).all():
            return "residual is not exactly zero"
        if not torch.isin(out[1], support).all():
            return f"fallback sample outside the support: {out[1].tolist()}"
        return None

    return _chain(logits, q, tokens, g, block_v=16, expect=expect)


@_case
def case_chain_residual_zero_onehot():
    # p is one-hot on the draft token (a single finite logit): residual zero -> sample from p.
    g = _gen(11)
    V = 50
    tokens = torch.tensor([[5, 49], [0, 33]])
    logits = torch.randn(2, 3, V, generator=g)
    logits[:, :2] = NEG_INF
    logits[:, :2].scatter_(-1, tokens.unsqueeze(-1), 1.5)

    def expect(out, args):
        if not (out[0].all() and torch.equal(out[1][:, :2], tokens)):
            return f"expected accept + fallback to the draft token, got {out[0].tolist()} {out[1].tolist()}"
        return None

    return _chain(logits, None, tokens, g, block_v=16, expect=expect)


@_case
def case_chain_ties_go_to_lowest_index():
    # Expo all ones and equal weights in several blocks: exact ties, which torch.argmax breaks
    # towards the lowest index, inside a block and across blocks.
    g = _gen(14)
    V = 40
    logits = torch.full((2, 3, V), NEG_INF)
    logits[..., [5, 17, 30, 39]] = 0.0
    q = torch.zeros(2, 2, V)
    q[0, 0, 5] = 1.0  # residual ties on 17, 30, 39
    q[0, 1, [5, 17]] = 0.5  # residual ties on 30, 39
    q[1, :, [5, 17, 30, 39]] = 0.25  # residual zero -> fallback ties on 5, 17, 30, 39
    tokens = torch.tensor([[5, 17], [30, 39]])
    case = _chain(logits, q, tokens, g, block_v=16)
    case["args"] = case["args"][:4] + (torch.ones(2, 3, V),)

    def expect(out, args):
        if out[1].tolist() != [[17, 30, 5], [5, 5, 5]]:
            return f"unexpected tie breaking in the reference: {out[1].tolist()}"
        return None

    case["expect"] = expect
    return case


@_case
def case_chain_int32_tokens_noncontiguous():
    g = _gen(12)
    big = torch.randn(2, 4, 300, generator=g)
    logits = big[..., 50:250]  # non-contiguous view, V = 200
    q = warped_probs(torch.randn(2, 3, 200, generator=g)).transpose(0, 1).contiguous().transpose(0, 1)
    tokens = _sample(q, g).to(torch.int32)
    return _chain(logits, q, tokens, g, block_v=64)


@_case
def case_chain_k0_bonus_only():
    g = _gen(13)
    logits = torch.randn(3, 1, 100, generator=g)
    return _chain(logits, torch.empty(3, 0, 100), torch.empty(3, 0, dtype=torch.long), g, block_v=32)


# --- trees --------------------------------------------------------------------------------------

_BRANCHY = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]


def _topk_tree_tokens(logits, spec, rank, g, random_every=0):
    """Child tokens = the parent's target top-k by rank (deterministic drafts); root token -1."""
    B, N, V = logits.shape
    top = logits.topk(int(rank.max()) + 1, dim=-1).indices  # [B, N, r]
    tokens = torch.full((B, N), -1, dtype=torch.long)
    for i in range(1, N):
        tokens[:, i] = top[:, spec.parents[i], rank[i]]
    if random_every:
        tokens[:, 1::random_every] = torch.randint(0, V, tokens[:, 1::random_every].shape, generator=g)
    return tokens


def _sampled_tree(B, spec, V, g, *, top_k=None, scale=2.0):
    """Target logits, per-node draft probs, and children drawn i.i.d. from the parent's q."""
    N = spec.num_nodes
    target = torch.randn(B, N, V, generator=g) * scale
    q = warped_probs(target + torch.randn(B, N, V, generator=g), top_k=top_k)
    tokens = torch.full((B, N), -1, dtype=torch.long)
    for i in range(1, N):
        tokens[:, i] = _sample(q[:, spec.parents[i]], g)  # fresh i.i.d. draw per child
    return warp_logits(target, top_k=top_k), q, tokens


@_case
def case_tree_chain_v7_onehot():
    g = _gen(21)
    spec = TreeSpec.from_paths([(0,), (0, 0), (0, 0, 0)])
    logits = torch.randn(3, 4, 7, generator=g) * 2
    tokens = torch.randint(0, 7, (3, 4), generator=g)
    tokens[:, 1:] = logits[:, :3].argmax(-1)
    tokens[1, 2] = (tokens[1, 2] + 1) % 7
    # A negative child token (only possible with validate=False) is clamped to token 0 by both;
    # node 1 of row 2 puts nearly all its mass on token 0, so the clamped child is accepted.
    tokens[2, 2] = -3
    logits[2, 1, 0] = 20.0

    def expect(out, args):
        if out[0][2, 1] != 2:
            return f"the clamped child should be accepted, got choice {out[0].tolist()}"
        return None

    return _tree(logits, None, tokens, spec, g, expect=expect)


@_case
def case_tree_root_only_v7():
    g = _gen(22)
    spec = TreeSpec.from_parents([-1])
    logits = torch.randn(3, 1, 7, generator=g)
    q = warped_probs(torch.randn(3, 1, 7, generator=g))
    return _tree(logits, q, torch.full((3, 1), -1, dtype=torch.long), spec, g)


@_case
def case_tree_branchy_v7_q():
    g = _gen(23)
    spec = TreeSpec.from_paths(_BRANCHY)
    logits, q, tokens = _sampled_tree(4, spec, 7, g)
    return _tree(logits, q, tokens, spec, g, expect=_mixed_choices)


@_case
def case_tree_branchy_v7_onehot_duplicate_siblings():
    # Deterministic scheme with repeated sibling tokens: the second try of a token sees R(x) = 0.
    g = _gen(24)
    spec, rank = tree_from_paths(_BRANCHY)
    logits = torch.randn(4, spec.num_nodes, 7, generator=g)
    tokens = _topk_tree_tokens(logits, spec, rank, g)
    tokens[:2, 2] = tokens[:2, 1]  # root's children 1 and 2 share a token
    tokens[0, 5] = tokens[0, 4]  # node 1's children 4 and 5 too
    return _tree(logits, None, tokens, spec, g, expect=_mixed_choices)


def _per_row_children(parent_rows, C):
    from specgraph.trees import tree_buffers

    return tree_buffers(torch.tensor(parent_rows), C)[2]  # [B, N, C]


# Two rows with different shapes under one N (n-gram / suffix tries): row 0 a wide root, row 1 a chain.
_PER_ROW_PARENTS = [[-1, 0, 0, 0, 1, 2], [-1, 0, 1, 2, 3, 4]]


@_case
def case_tree_per_row_children_v7_onehot():
    g = _gen(41)
    children = _per_row_children(_PER_ROW_PARENTS, 3)
    logits = torch.randn(2, 6, 7, generator=g)
    tokens = torch.randint(0, 7, (2, 6), generator=g)
    tokens[1, 1:] = logits[1, :5].argmax(-1)  # row 1's chain is the target's argmax: accepts likely
    args = (logits, None, tokens, children, torch.rand(2, 6, 3, generator=g), _expo((2, 6, 7), g))
    return {"kind": "tree", "args": args, "block_v": None, "expect": None}


@_case
def case_tree_per_row_children_v1000_q_block128():
    g = _gen(42)
    children = _per_row_children(_PER_ROW_PARENTS, 3)
    logits = torch.randn(2, 6, 1000, generator=g) * 2
    q = warped_probs(logits + torch.randn(2, 6, 1000, generator=g))
    tokens = _sample(q, g)
    args = (logits, q, tokens, children, torch.rand(2, 6, 3, generator=g), _expo((2, 6, 1000), g))
    return {"kind": "tree", "args": args, "block_v": 128, "expect": None}


@_case
def case_tree_branchy_v1000_topk_onehot_block128():
    g = _gen(25)
    spec, rank = tree_from_paths(_BRANCHY)
    logits = warp_logits(torch.randn(2, spec.num_nodes, 1000, generator=g) * 2, top_k=3)
    tokens = _topk_tree_tokens(logits, spec, rank, g, random_every=3)
    return _tree(logits, None, tokens, spec, g, block_v=128, expect=_mixed_choices)


@_case
def case_tree_branchy_v1000_topk_q_block128():
    g = _gen(26)
    spec = TreeSpec.from_paths(_BRANCHY)
    logits, q, tokens = _sampled_tree(2, spec, 1000, g, top_k=3)
    return _tree(logits, q, tokens, spec, g, block_v=128, expect=_mixed_choices)


@_case
def case_tree_wide_root_v4099_q_block1024():  # C = 5 -> BLOCK_C = 8
    g = _gen(27)
    spec = TreeSpec.from_paths([(0,), (1,), (2,), (3,), (4,), (0, 0)])
    logits, q, tokens = _sampled_tree(2, spec, 4099, g, scale=3.0)
    return _tree(logits, q, tokens, spec, g, block_v=1024)


@_case
def case_tree_branchy_v4099_onehot_default_block():
    g = _gen(28)
    spec, rank = tree_from_paths(_BRANCHY)
    logits = warp_logits(torch.randn(1, spec.num_nodes, 4099, generator=g) * 3, top_k=10)
    tokens = _topk_tree_tokens(logits, spec, rank, g)
    return _tree(logits, None, tokens, spec, g)


@_case
def case_tree_mass_in_last_block_q():
    g = _gen(29)
    V = 1027
    spec = TreeSpec.from_paths([(0,), (1,), (0, 0)])
    logits = torch.full((2, 4, V), NEG_INF)
    logits[..., -3:] = torch.randn(2, 4, 3, generator=g)
    q = torch.softmax(torch.randn(2, 4, V, generator=g), dim=-1)
    tokens = torch.tensor([[-1, 1025, 1026, 1024], [-1, 7, 1026, 1026]])

    def expect(out, args):
        if not (out[1] >= V - 3).all():
            return f"sampled tokens outside the last block: {out[1].tolist()}"
        return None

    return _tree(logits, q, tokens, spec, g, block_v=256, expect=expect)


@_case
def case_tree_residual_zero_q_equals_p():
    # q == p exactly (equal logits on 4 tokens): the first child is accepted and R = max(p - p, 0)
    # is exactly zero afterwards, so `sampled` falls back to p.
    g = _gen(30)
    V = 40
    spec = TreeSpec.from_paths([(0,), (1,), (0, 0)])
    support = torch.tensor([2, 9, 21, 38])
    logits = torch.full((3, 4, V), NEG_INF)
    logits[..., support] = 0.0
    q = torch.softmax(logits, dim=-1)
    tokens = support[torch.randint(0, 4, (3, 4), generator=g)]
    tokens[:, 0] = -1

    def expect(out, args):
        if not torch.isin(out[1], support).all():
            return f"fallback sample outside the support: {out[1].tolist()}"
        if not (out[0][:, 0] == 1).all():
            return f"first child should be accepted when q == p, got {out[0].tolist()}"
        return None

    return _tree(logits, q, tokens, spec, g, block_v=16, expect=expect)


@_case
def case_tree_residual_zero_onehot():
    # Deterministic children, p one-hot on a child's token: after trying it R is zero -> sample from p.
    g = _gen(31)
    V = 40
    spec = TreeSpec.from_paths([(0,), (1,), (0, 0)])
    tokens = torch.tensor([[-1, 5, 11, 30], [-1, 5, 11, 30]])
    logits = torch.randn(2, 4, V, generator=g)
    logits[:, 0] = NEG_INF
    logits[0, 0, 11] = 0.3  # root: only the second child's token is possible
    logits[1, 0, 5] = 0.3  # root: only the first child's token
    return _tree(logits, None, tokens, spec, g, block_v=16)


@_case
def case_tree_ties_go_to_lowest_index():
    g = _gen(33)
    V = 40
    spec = TreeSpec.from_paths([(0,), (1,), (0, 0)])
    logits = torch.full((2, 4, V), NEG_INF)
    logits[..., [4, 16, 20, 36]] = 0.0
    tokens = torch.tensor([[-1, 4, 20, 36], [-1, 36, 35, 4]])
    case = _tree(logits, None, tokens, spec, g, block_v=16)
    case["args"] = case["args"][:4] + (torch.zeros(2, 4, 2), torch.ones(2, 4, V))  # u = 0: accept if R(x) > 0

    def expect(out, args):
        if out[1].tolist() != [[16, 4, 4, 4], [4, 16, 4, 4]]:
            return f"unexpected tie breaking in the reference: {out[1].tolist()}"
        return None

    case["expect"] = expect
    return case


@_case
def case_tree_nan_q_rows_of_leaves():
    # verify_tree only validates q rows of nodes that have children; leaves may hold garbage.
    g = _gen(32)
    spec = TreeSpec.from_paths(_BRANCHY)
    logits, q, tokens = _sampled_tree(2, spec, 50, g)
    leaves = spec.children[:, 0] < 0
    q[:, leaves] = float("nan")
    return _tree(logits, q, tokens, spec, g, block_v=16)


# ----------------------------------------------------------------------------------------------
# worker (runs in the child process)


def _mismatch(name: str, got: torch.Tensor, want: torch.Tensor) -> str | None:
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"{name}: got {got.dtype} {tuple(got.shape)}, want {want.dtype} {tuple(want.shape)}"
    if torch.equal(got, want):
        return None
    bad = (got != want).nonzero().tolist()
    return f"{name}: {len(bad)} mismatches, first at {bad[:5]}; got {got.tolist()}, want {want.tolist()}"


def run_case(name: str, device: str = "cpu") -> dict:
    from specgraph.kernels import chain_outcomes_triton, tree_outcomes_triton

    spec = CASES[name]()
    args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in spec["args"])
    if spec["kind"] == "chain":
        want = chain_outcomes_reference(*args)
        t0 = time.perf_counter()
        got = chain_outcomes_triton(*args, block_v=spec["block_v"])
        names = ("accepted", "recovered")
    else:
        want = tree_outcomes_reference(*args)
        t0 = time.perf_counter()
        got = tree_outcomes_triton(*args, block_v=spec["block_v"])
        names = ("choice", "sampled")
    seconds = time.perf_counter() - t0
    problems = [m for n, a, b in zip(names, got, want) if (m := _mismatch(n, a.cpu(), b.cpu()))]
    if spec["expect"] is not None and (msg := spec["expect"](tuple(w.cpu() for w in want), spec["args"])):
        problems.append(f"case does not exercise what it claims: {msg}")
    return {"ok": not problems, "detail": "; ".join(problems), "seconds": round(seconds, 3)}


def _worker(names: list[str], out_path: str | None) -> int:
    from specgraph.kernels import chain_triton, tree_triton

    meta = {
        "interpreted": [type(k).__name__ for k in (chain_triton._chain_kernel, tree_triton._tree_kernel)],
    }
    results = {}
    for name in names or list(CASES):
        try:
            results[name] = run_case(name)
        except Exception as exc:  # report, keep going with the other cases
            results[name] = {"ok": False, "detail": f"{type(exc).__name__}: {exc}", "seconds": None}
        if out_path is None:
            print(f"{name}: {results[name]}", flush=True)
    if out_path is not None:
        Path(out_path).write_text(json.dumps({"meta": meta, "results": results}))
    else:
        print(meta)
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    argv = sys.argv[1:]
    out = None
    if argv[:1] == ["--out"]:
        out, argv = argv[1], argv[2:]
    sys.exit(_worker(argv, out))


# ----------------------------------------------------------------------------------------------
# pytest side

import pytest  # noqa: E402

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

_THIS = Path(__file__).resolve()


@pytest.fixture(scope="module")
def interpreted(request):
    """Run the selected cases once, in a child process with TRITON_INTERPRET=1."""
    names = sorted({
        item.callspec.params["name"]
        for item in request.session.items
        if Path(str(item.path)).resolve() == _THIS and getattr(item, "callspec", None) is not None
        and "name" in item.callspec.params and item.originalname == "test_interpreted_matches_reference"
    })
    env = dict(os.environ, TRITON_INTERPRET="1")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.json")
        proc = subprocess.run(
            [sys.executable, str(_THIS), "--out", out, *names],
            env=env, capture_output=True, text=True, timeout=900,
        )
        if not os.path.exists(out):
            pytest.fail(f"interpreter worker crashed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
        return json.loads(Path(out).read_text())


@pytest.mark.parametrize("name", list(CASES))
def test_interpreted_matches_reference(interpreted, name):
    res = interpreted["results"][name]
    assert res["ok"], res["detail"]


def test_worker_really_used_the_interpreter(interpreted):
    assert interpreted["meta"]["interpreted"] == ["InterpretedFunction", "InterpretedFunction"]


def test_signatures_match_references():
    from specgraph.kernels import chain_outcomes_triton, tree_outcomes_triton

    for fast, ref in ((chain_outcomes_triton, chain_outcomes_reference), (tree_outcomes_triton, tree_outcomes_reference)):
        positional = [p for p in inspect.signature(fast).parameters.values() if p.kind is not p.KEYWORD_ONLY]
        assert [p.name for p in positional] == list(inspect.signature(ref).parameters)


def test_only_block_sizes_and_flags_are_compile_time():
    """K, N, C and V are runtime arguments: a new chain length or tree shape never recompiles."""
    from specgraph.kernels import chain_triton, tree_triton

    def constexprs(kernel):
        params = inspect.signature(kernel.fn).parameters.values()
        return {p.name for p in params if "constexpr" in str(p.annotation)}

    assert constexprs(chain_triton._chain_kernel) == {"HAS_Q", "BLOCK_V"}
    assert constexprs(tree_triton._tree_kernel) == {"HAS_Q", "BLOCK_V", "BLOCK_C"}


def test_block_size_must_be_power_of_two():
    from specgraph.kernels import chain_outcomes_triton

    with pytest.raises(ValueError, match="power of two"):
        chain_outcomes_triton(
            torch.zeros(1, 2, 8), None, torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1), torch.ones(1, 2, 8),
            block_v=12,
        )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(CASES))
def test_cuda_matches_reference_without_sync(name):
    """Compiled kernels on the GPU, with CUDA sync debugging set to error on any host sync."""
    from specgraph.kernels import chain_outcomes_triton, tree_outcomes_triton

    spec = CASES[name]()
    args = tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in spec["args"])
    fast, ref = (
        (chain_outcomes_triton, chain_outcomes_reference) if spec["kind"] == "chain"
        else (tree_outcomes_triton, tree_outcomes_reference)
    )
    fast(*args, block_v=spec["block_v"])  # compile outside the sync check
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = fast(*args, block_v=spec["block_v"])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = ref(*args)
    for a, b in zip(got, want):
        assert torch.equal(a.cpu(), b.cpu()), (name, a.tolist(), b.tolist())


def test_reference_per_row_children_equal_row_by_row():
    """[B, N, C] children give each row exactly what its own [N, C] table gives it."""
    g = _gen(43)
    children = _per_row_children(_PER_ROW_PARENTS, 3)
    for q_kind in ("onehot", "q"):
        logits = torch.randn(2, 6, 9, generator=g) * 2
        q = None if q_kind == "onehot" else warped_probs(torch.randn(2, 6, 9, generator=g))
        tokens = torch.randint(0, 9, (2, 6), generator=g)
        u, e = torch.rand(2, 6, 3, generator=g), _expo((2, 6, 9), g)
        choice, sampled = tree_outcomes_reference(logits, q, tokens, children, u, e)
        for b in range(2):
            spec = TreeSpec.from_parents(_PER_ROW_PARENTS[b])
            kids = torch.full((6, 3), -1, dtype=torch.long)
            kids[:, : spec.children.shape[1]] = spec.children
            qb = None if q is None else q[b : b + 1]
            cb, sb = tree_outcomes_reference(logits[b : b + 1], qb, tokens[b : b + 1], kids, u[b : b + 1], e[b : b + 1])
            assert torch.equal(choice[b], cb[0]) and torch.equal(sampled[b], sb[0]), (q_kind, b)
