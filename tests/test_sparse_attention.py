"""``block_sparse_attention_pass``: eager parity with the sliced SDPA step on rows of very
different lengths (each row reading only its own blocks), its count of matches, a control that a
row's visible blocks are really read, and the same step compiled by Inductor (the flex attention
template) equal to eager."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
from transformers import AutoConfig, AutoModelForCausalLM

from specgraph.capture import capture_step, new_kv_cache
from specgraph.passes import block_sparse_attention_pass, run_step_pipeline
from specgraph.passes.sparse import BLOCK, attention_plan

pytestmark = pytest.mark.filterwarnings("ignore:.*past_key_values.*deprecated:FutureWarning")

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=512)
NEG = float("-inf")


def tiny_llama(**over):
    torch.manual_seed(0)
    cfg = AutoConfig.for_model("llama", **{**TINY, **over})
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32).eval()


def chain_inputs(L: torch.Tensor, Q: int, S: int, W: int):
    """ids, pos [B, Q] and the mask [B, 1, Q, W] of a chain round: row b sees its L[b] committed
    slots and its own new ones."""
    B = L.shape[0]
    ids = torch.arange(B * Q).view(B, Q) % 100 + 3
    pos = L[:, None] + torch.arange(Q)
    s = torch.arange(W)
    vis = (s[None, None] < L[:, None, None]) | ((s[None, None] >= L[:, None, None]) & (s[None, None] <= pos[..., None]))
    return ids, pos, torch.zeros(B, 1, Q, W).masked_fill(~vis[:, None], NEG)


@torch.no_grad()
def test_plan_lists_each_rows_visible_blocks_first():
    L = torch.tensor([3, 130, 64])
    _, _, mask = chain_inputs(L, 2, 300, 200)
    bias, count, order, whole, whole_order = attention_plan(mask, 300)
    assert bias.shape == (3, 2, 320 + BLOCK) and torch.equal(bias[:, :, :200], mask[:, 0])
    # rows see slots 0..4, 0..131 and 0..65: the blocks they see whole, then those they see in part
    assert whole.flatten().tolist() == [0, 2, 1] and count.flatten().tolist() == [1, 1, 1]
    assert whole_order[1, 0, 0, :2].tolist() == [0, 1] and order[1, 0, 0, 0].item() == 2
    assert order[2, 0, 0, 0].item() == 1 and order.shape[-1] == 320 // BLOCK


@torch.no_grad()
def test_block_sparse_pass_matches_the_sliced_step():
    model = tiny_llama()
    B, Q, S, W = 3, 3, 300, 200
    gm, _ = run_step_pipeline(capture_step(model, B, Q, S))
    dense = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    sparse, n = block_sparse_attention_pass(gm, S)
    assert n == model.config.num_hidden_layers
    L = torch.tensor([5, 190, 70])  # one row needs the whole width, the others one or two blocks
    ids, pos, mask = chain_inputs(L, Q, S, W)
    kv = [t.normal_() for t in new_kv_cache(model, B, S)]  # garbage past L must stay invisible
    kv_dense, kv_sparse = [t.clone() for t in kv], [t.clone() for t in kv]
    ref = dense(ids, pos, mask, pos.clone(), *kv_dense)[0]
    out = sparse(ids, pos, mask, pos.clone(), *kv_sparse)[0]
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for a, b in zip(kv_dense, kv_sparse):  # the same writes (a later layer's, up to summation order)
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # control: a visible slot of the short row, in its one block, is read
    kv_bad = [t.clone() for t in kv]
    for t in kv_bad:
        t[0, :, 2] += 5.0
    bad = sparse(ids, pos, mask, pos.clone(), *kv_bad)[0]
    assert not torch.allclose(bad[0], ref[0], atol=1e-3) and torch.allclose(bad[1:], ref[1:], atol=1e-5)


@pytest.mark.parametrize("Q", [1, 2])
@torch.no_grad()
def test_block_sparse_step_compiles_and_matches_eager(Q):
    """Compiled by Inductor with the engine's settings, at SmolLM2's head layout (9 query heads on
    3 K/V heads of 64) and cache length (2048 slots): one query (Q = 1) folds its heads by a view
    of the rotary embedding's output, which the flex kernel must not read fused (it then reads it
    wrong: the case this test was written for)."""
    from specgraph.compiler import inductor_settings

    model = tiny_llama(hidden_size=576, num_attention_heads=9, num_key_value_heads=3)
    B, S = 2, 2049
    gm, _ = run_step_pipeline(capture_step(model, B, Q, S))
    sparse, _ = block_sparse_attention_pass(gm, S)
    compiled = torch.compile(sparse, dynamic=False,
                             options=inductor_settings(torch.device("cpu"), False, False, "block_sparse"))
    for W, L in ((64, torch.tensor([3, 40])), (192, torch.tensor([150, 9]))):
        ids, pos, mask = chain_inputs(L, Q, S, W)
        kv = [t.normal_() for t in new_kv_cache(model, B, S)]
        kv2 = [t.clone() for t in kv]
        ref = sparse(ids, pos, mask, pos.clone(), *kv)[0]
        out = compiled(ids, pos, mask, pos.clone(), *kv2)[0]
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_block_sparse_dynamic_batch_step_matches_eager():
    """A step whose batch is dynamic (the graph cache's larger buckets, here up to 8 rows) pads the
    score bias to its largest batch: compiled by Inductor, rows 4 and 6 equal eager."""
    from specgraph.compiler import inductor_settings

    model = tiny_llama(hidden_size=576, num_attention_heads=9, num_key_value_heads=3)
    Q, S = 1, 2049
    gm, _ = run_step_pipeline(capture_step(model, 4, Q, S, 8))
    sparse, _ = block_sparse_attention_pass(gm, S, max_batch=8)
    compiled = torch.compile(sparse, dynamic=False,
                             options=inductor_settings(torch.device("cpu"), False, False, "block_sparse"))
    for B in (4, 6):
        L = torch.randint(10, 190, (B,), generator=torch.Generator().manual_seed(B))
        ids, pos, mask = chain_inputs(L, Q, S, 192)
        kv = [t.normal_() for t in new_kv_cache(model, B, S)]
        args = [ids, pos, mask, pos.clone(), *[t.clone() for t in kv]]
        for a in args:
            torch._dynamo.mark_dynamic(a, 0)
        ref = sparse(ids, pos, mask, pos.clone(), *[t.clone() for t in kv])[0]
        torch.testing.assert_close(compiled(*args)[0], ref, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_block_sparse_step_with_a_computed_full_width_mask_compiles():
    """A mask computed inside the compiled graph (a prefill package builds it from the positions)
    as wide as the whole cache: without padding the score bias would be that computation itself,
    and the flex kernel needs it as a buffer of its own (Inductor refuses a fused one:
    "All the buffers in the score and mask subgraph should be in kernel_group.args.input_buffers")."""
    from specgraph.compiler import inductor_settings

    model = tiny_llama(hidden_size=576, num_attention_heads=9, num_key_value_heads=3)
    B, Q, S = 1, 16, 2 * BLOCK
    gm, _ = run_step_pipeline(capture_step(model, B, Q, S))
    sparse, _ = block_sparse_attention_pass(gm, S)

    def step(ids, pos, *kv):  # causal mask over all S slots, built in the graph
        s = torch.arange(S)
        mask = torch.where(s[None, None] <= pos[..., None], 0.0, NEG)[:, None]  # [B, 1, Q, S]
        return sparse(ids, pos, mask, pos.clone(), *kv)[0]

    compiled = torch.compile(step, dynamic=False,
                             options=inductor_settings(torch.device("cpu"), False, False, "block_sparse"))
    ids, pos = torch.arange(Q).view(B, Q) + 3, torch.arange(Q).view(B, Q) + 40
    kv = [t.normal_() for t in new_kv_cache(model, B, S)]
    ref = step(ids, pos, *[t.clone() for t in kv])
    torch.testing.assert_close(compiled(ids, pos, *[t.clone() for t in kv]), ref, atol=1e-5, rtol=1e-5)
