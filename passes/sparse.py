"""Attention that reads, for each row, only the cache blocks its mask lets it see."""
from __future__ import annotations

import torch
import torch.fx as fx

from .attention import attention_nodes
from .dce import safe_dce_pass

aten = torch.ops.aten
BLOCK = 64  # cache slots per block: a block a row cannot see is not read


def attention_plan(mask: torch.Tensor, slots: int, rows: int | None = None):
    """What every layer's block-sparse attention needs, computed once per step from the additive
    mask [B, 1, Q, W] (W <= ``slots``):

    - the mask as a score bias [R, Q, S + BLOCK], S = ``slots`` rounded up to a whole block (the
      slots past W are -inf), R = ``rows`` (a dynamic batch's largest; default B): a static
      shape, whatever W and B are (the flex kernel's bias buffer must not have a dynamic size);
    - per row, the blocks some but not every query-slot pair of which is visible (the bias is
      added there): their count [B, 1, 1] int32 and those blocks first [B, 1, 1, S / BLOCK] int32;
    - the same for the blocks every query of the row sees whole (bias 0 throughout).

    A block no query of a row sees is in neither list: that row never reads it.
    """
    B, _, Q, W = mask.shape
    S = -(-slots // BLOCK) * BLOCK
    # one block more than S, never read: the padding is never empty, so the bias is always a
    # concatenation, a buffer of its own (the flex kernel refuses a bias that is a fused
    # computation, which an empty piece would leave when a mask computed in the graph is S wide)
    bias = torch.cat([mask[:, 0], mask.new_full((B, Q, S + BLOCK - W), float("-inf"))], dim=-1)  # [B, Q, S+BLOCK]
    seen = (bias[..., :S] > float("-inf")).any(dim=1).view(B, S // BLOCK, BLOCK).any(dim=-1)  # [B, S/BLOCK]
    whole = (bias[..., :S] == 0).all(dim=1).view(B, S // BLOCK, BLOCK).all(dim=-1)
    if rows is not None:
        # at least two rows of padding (a piece of 0 or 1 rows would make export guard the batch
        # below its top: sizes 0 and 1 are special cases), then cut to the static size
        bias = torch.cat([bias, bias.new_full((rows + 2 - B, Q, S + BLOCK), float("-inf"))], dim=0)[:rows]
    return (bias, *_listed(seen & ~whole), *_listed(whole))


def _listed(blocks: torch.Tensor):
    """Per row, how many blocks are set in ``blocks`` [B, n] bool [B, 1, 1] and their indices first,
    in order [B, 1, 1, n] (flex attention's block lists)."""
    B = blocks.shape[0]
    count = blocks.sum(dim=-1, dtype=torch.int32).view(B, 1, 1)
    order = torch.argsort((~blocks).to(torch.int32), dim=-1, stable=True).to(torch.int32).view(B, 1, 1, -1)
    return count, order


def block_sparse_attention(q: torch.Tensor,  # [B, H, R*Q, D]: R query heads per K/V head, folded
                           k: torch.Tensor,  # [B, H, S, D] the whole cache
                           v: torch.Tensor,  # [B, H, S, D]
                           width,  # attended slots W (an int or a symbolic size)
                           plan, scale=None) -> torch.Tensor:  # -> [B, H, R*Q, D]
    """``sdpa(q, k[:, :, :W], v[:, :, :W], mask)`` (the mask repeated over the folded query rows)
    as flex attention that skips the blocks :func:`attention_plan` found dead for a row: a row
    reads the blocks it sees, not the W slots the longest row needs."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    bias, count, order, whole_count, whole_order = plan
    Q, rows = bias.shape[1], q.shape[2]
    blocks = BlockMask.from_kv_blocks(count, order, whole_count, whole_order, BLOCK_SIZE=(rows, BLOCK),
                                      seq_lengths=(rows, width))

    def add_mask(score, b, h, i, j):
        return score + bias[b, i % Q, j]

    return flex_attention(_buffer(q), k[:, :, :width], v[:, :, :width], score_mod=add_mask, block_mask=blocks,
                          scale=scale)


def _buffer(x: torch.Tensor) -> torch.Tensor:
    """``x`` written to a buffer of its own by a scatter, which Inductor does not fuse into the
    kernel that reads it: fused into the CPU flex attention kernel, the query's producers (the
    rotary embedding) are indexed wrongly when the query is a view of them (one query per head
    group: the head-folding reshape copies nothing)."""
    return x.new_empty(x.shape).index_put((torch.arange(x.shape[0], device=x.device),), x)


def block_sparse_attention_pass(gm: fx.GraphModule, slots: int, max_batch: int | None = None,
                                mask_placeholder: str = "mask") -> tuple[fx.GraphModule, int]:
    """Every attention call that :func:`attend_mask_width_pass` sliced to the mask's width skips,
    row by row, the cache blocks the row's mask hides (:func:`block_sparse_attention`).

    Before::   w = sym_size(mask, 3)
               o = sdpa(q, k[:, :, :w], v[:, :, :w], repeat(mask, [1, 1, R, 1]), scale=s)
    After::    plan = attention_plan(mask, S, max_batch)             # once per step
               o = block_sparse_attention(q, k, v, w, plan, scale=s)

    In a batch, the attended width W is what the longest row needs; the others' later slots are
    masked and cost the same to read. Here a row reads only the blocks it sees. Same attention
    up to float summation order. Only calls with no dropout, not causal, reading the mask input
    itself (or its repeat over folded query heads) are rewritten: a mixed-window model's sliding
    layers, which read a band of the mask, keep SDPA. ``max_batch``: a graph whose batch is
    dynamic, up to that many rows. Returns (gm, calls rewritten).
    """
    g = gm.graph
    mask = next((n for n in g.nodes if n.op == "placeholder" and n.name == mask_placeholder), None)
    if mask is None:
        return gm, 0
    plan, done = None, 0
    for node in attention_nodes(g):
        q, k, v = node.args[:3]
        m = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        dropout = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
        causal = node.args[5] if len(node.args) > 5 else node.kwargs.get("is_causal", False)
        if dropout or causal or node.kwargs.get("enable_gqa") or not (_is_slice(k) and _is_slice(v)):
            continue
        if not (m is mask or (isinstance(m, fx.Node) and m.target is aten.repeat.default and m.args[0] is mask)):
            continue
        if k.args[3] is not v.args[3]:
            continue
        if plan is None:  # before the first attention call, so before them all
            with g.inserting_before(node):
                plan = g.call_function(attention_plan, (mask, slots, max_batch))
        scale = node.args[6] if len(node.args) > 6 else node.kwargs.get("scale")
        with g.inserting_before(node):
            out = g.call_function(block_sparse_attention, (q, k.args[0], v.args[0], k.args[3], plan),
                                  {"scale": scale})
        node.replace_all_uses_with(out)
        g.erase_node(node)
        done += 1
    g.lint()
    gm.recompile()
    return safe_dce_pass(gm)[0], done


def _is_slice(node) -> bool:
    """``x[:, :, :w]``: the attended-width slice of a cache tensor."""
    return (isinstance(node, fx.Node) and node.target is aten.slice.Tensor and node.args[1] == 2
            and node.args[2] == 0 and len(node.args) > 3)
