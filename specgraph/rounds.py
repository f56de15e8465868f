"""The rounds around a captured step: the masks, the target's logits for a chain, a tree, a draft
step and a prompt chunk, and the chain and tree rounds (logits, logits processors, exact
verification, KV compaction) that every executor runs. The compiled objects build their graphs
from these functions, the graph cache and compiled directories package them, and the ONNX export
traces them: one definition of a round.

A ``step`` is a captured, pass-rewritten model step (:mod:`specgraph.capture`):
``step(ids [B, Q], pos [B, Q], mask [B, 1, Q, W], write_slots [B, Q], *kv) -> (logits, features)``,
writing the K/V of its Q tokens into the cache in place.
"""
from __future__ import annotations

import torch

from specgraph.processors import LogitsSpec, chain_paths, process_logits, tree_paths
from specgraph.trees import tree_buffers
from specgraph.verify import verify_chain_rows, verify_chain_with_noise, verify_tree_with_noise
from specgraph.warping import SamplingParams, token_logprobs

NEG_INF = float("-inf")


def slot_index(width, device) -> torch.Tensor:
    """The attended cache slots 0 .. W-1 as [1, 1, W]. ``width`` is an int, or the [W] slot
    tensor a compiled round takes as input (W then a dynamic dimension: one graph for every W)."""
    if isinstance(width, torch.Tensor):
        return width.view(1, 1, -1)
    return torch.arange(width, device=device).view(1, 1, width)


def step_mask(L, q_pos, valid, width, window):
    """Additive mask [B, 1, Q, W]: a query at position q_pos sees committed slots < L and the
    slots in [L, q_pos] (its chain ancestors and itself). Invalid queries (padding, finished rows)
    see slot 0 only: their output is ignored, but a fully masked row would be NaN. ``width``: see
    :func:`slot_index`."""
    s = slot_index(width, L.device)
    vis = (s < L.view(-1, 1, 1)) | ((s >= L.view(-1, 1, 1)) & (s <= q_pos.unsqueeze(-1)))
    if window is not None:
        vis &= s > q_pos.unsqueeze(-1) - window
    vis = torch.where(valid.unsqueeze(-1), vis, s == 0)
    zero = torch.zeros((), dtype=torch.float32, device=L.device)
    return torch.where(vis, zero, NEG_INF).unsqueeze(1)


def tree_mask(L, q_pos, anc, valid, width, window):
    """Additive mask [B, 1, Q, width] for a tree round whose node i sits in slot L + i: node i sees
    the committed slots < L and its tree ancestors (``anc`` [B, N, N]) — not its siblings or
    cousins. Committed slots hold position = slot, so the window applies to them as usual; tree
    ancestors are at most the tree's depth away."""
    B, Q, N = anc.shape  # Q queries (all N nodes in the target; the fed nodes in a draft level)
    s = slot_index(width, L.device)
    W = s.shape[-1]
    Lv = L.view(-1, 1, 1)
    committed = s < Lv
    if window is not None:
        committed = committed & (s > q_pos.unsqueeze(-1) - window)
    rel = s - Lv  # [B, 1, W] slot relative to the root's slot
    in_tree = (rel >= 0) & (rel < N)
    tree_vis = anc.gather(2, rel.clamp(0, N - 1).expand(B, Q, W)) & in_tree
    vis = torch.where(valid.unsqueeze(-1), committed | tree_vis, s == 0)
    zero = torch.zeros((), dtype=torch.float32, device=L.device)
    return torch.where(vis, zero, NEG_INF).unsqueeze(1)


def chain_logits(step, root, L, active, drafts, kv, slots, width, window, hidden=False):
    """The target's logits for a chain round: the root (slot / position L) and k drafts after it,
    each seeing the committed prefix and the chain before it; inactive rows write to the scratch
    slot. Shared by the compiled round, the AOT packages and the ONNX graphs.
    root [B], L [B], active [B] bool, drafts [B, k] -> logits [B, k+1, V] (``hidden=True``: and the
    final features [B, k+1, H], which head drafters read)."""
    k = drafts.shape[1]
    ids = torch.cat([root.unsqueeze(1), drafts], dim=1)  # [B, k+1]
    pos = L.unsqueeze(1) + torch.arange(k + 1, device=L.device)
    valid = active.unsqueeze(1).expand_as(pos)
    mask = step_mask(L, pos, valid, width, window).to(kv[0].dtype)
    logits, last_hidden = step(ids, pos, mask, torch.where(valid, pos, slots - 1), *kv)
    return (logits, last_hidden) if hidden else logits


def tree_logits(step, root, L, active, tree_tokens, parents, max_children, kv, slots, width, window, hidden=False):
    """The target's logits for a tree round: node i at slot L + i and position L + depth(i), seeing
    the committed prefix and its ancestors (topology from ``parents``, an input, so one graph serves
    every tree of N nodes). root [B], tree_tokens [B, N] (column 0 ignored), parents [B, N] (-1 at
    the root) -> (logits [B, N, V], ids [B, N], children [B, N, C]) (``hidden=True``: + the final
    features [B, N, H])."""
    N = parents.shape[1]
    depth, anc, children = tree_buffers(parents, max_children)
    ids = torch.cat([root.unsqueeze(1), tree_tokens[:, 1:]], dim=1)  # [B, N]
    pos = L.unsqueeze(1) + depth
    valid = active.unsqueeze(1).expand_as(pos)
    write = torch.where(valid, L.unsqueeze(1) + torch.arange(N, device=L.device), slots - 1)
    mask = tree_mask(L, pos, anc, valid, width, window).to(kv[0].dtype)
    logits, last_hidden = step(ids, pos, mask, write, *kv)
    return (logits, ids, children, last_hidden) if hidden else (logits, ids, children)


def draft_logits(step, tokens, last, active, kv, slots, width, window):
    """A draft-model step's logits for the next token: Q fed tokens ending at position ``last``
    (negative positions, before the prompt, are masked), each seeing the committed slots and
    the fed tokens before it. tokens [B, Q], last [B], active [B] bool -> logits [B, V]."""
    Q = tokens.shape[1]
    pos = last.unsqueeze(1) + (torch.arange(Q, device=last.device) - (Q - 1))
    valid = active.unsqueeze(1) & (pos >= 0)
    pos = pos.clamp_min(0)
    mask = step_mask(last - (Q - 1), pos, valid, width, window).to(kv[0].dtype)
    logits, _ = step(tokens, pos, mask, torch.where(valid, pos, slots - 1), *kv)
    return logits[:, -1]


def prefill_logits(step, ids, pos, valid, kv, slots, window, start=None, hidden=False):
    """Prompt tokens into the cache: query (b, j) at position pos[b, j] sees the slots in
    [start, pos] (start = 0: the whole prompt so far); invalid columns write to the scratch slot.
    ids, pos [B, C] long, valid [B, C] bool, start [B] long or None -> logits [B, C, V] (``hidden=True``:
    and the final features [B, C, H]; a step built with ``all_logits=False``: [B, 1, V] and None)."""
    if start is None:
        start = torch.zeros(ids.shape[0], dtype=torch.long, device=ids.device)
    mask = step_mask(start, pos, valid, slots, window).to(kv[0].dtype)
    logits, last_hidden = step(ids, torch.where(valid, pos, 0), mask, torch.where(valid, pos, slots - 1), *kv)
    return (logits, last_hidden) if hidden else logits


def chain_round(step, k: int, slots: int, window, params: SamplingParams, *, use_q: bool = False,
                spec: LogitsSpec | None = None, want_scores: bool = False, top_n: int = -1,
                with_features: bool = False, greedy_rows: bool = False):
    """The chain round around a captured target ``step`` of k + 1 query tokens: the target's logits
    at the root and the k drafts (:func:`chain_logits`), the logits processors of ``spec``, exact
    verification, and what the caller asked for besides. The one definition of the round: the
    compiled objects, the graph cache's packages and the ONNX graphs all run it.

    ``round_fn(cols, root, L, active, accept_u, expo, drafts, draft_probs, [temperature,] *proc,
    *kv)``: cols [W] attended slots (or an int width), root [B], L [B], active [B] bool, accept_u
    [B, k], expo [B, k+1, V] ([B, k+1, 1] when greedy), drafts [B, k], draft_probs [B, k, V]
    (read when ``use_q``: sampled model drafts), temperature [B] (sampling ``params``: the
    temperature is an input, the filters of ``params`` are baked in), the processors' state when
    ``spec`` (seq [B, M], meta [B, 4], and with ``spec.grammar`` the positions' token bitmask
    [B, k+1, ceil(V / 32)] int32), then the cache, written in place. Returns (tokens [B, k+1], n [B]), then with
    ``want_scores`` the processed and raw logits [B, k+1, V], with ``top_n`` >= 0 the emitted
    tokens' log-probabilities and the top-n, and with ``with_features`` the target's final features
    [B, k+1, H]. ``greedy_rows``: the sampling round in which rows at temperature 0 are verified
    greedily (returns tokens and n only)."""
    S = slots
    hid = with_features
    n_proc = 0 if spec is None else 2 + spec.grammar  # seq, meta (and the grammar's bitmask)

    def target(cols, root, L, active, drafts, rest):
        """(processed logits, raw logits, features) of the k+1 fed positions, and the kv tensors."""
        proc, kv = rest[:n_proc], rest[n_proc:]
        logits, hidden = chain_logits(step, root, L, active, drafts, kv, S, cols, window, hidden=True)
        processed = logits if spec is None else process_logits(spec, logits, *proc[:2], L, *chain_paths(drafts),
                                                               *proc[2:])
        return processed, logits, hidden

    def outputs(verified, processed, raw, hidden, temperature=None):  # heads also read the features [B, k+1, H]
        extra = (processed, raw) if want_scores else ()
        if top_n >= 0:
            x = processed if temperature is None else scaled_logits(processed, temperature)
            extra = (*extra, *token_logprobs(x, verified[0], top_n, temperature is not None, params.top_k,
                                             params.top_p, params.min_p))
        return (*verified, *extra, hidden) if hid else (*verified, *extra)
    # cols [W] attended slots, root [B], L [B], active [B] bool, accept_u [B, k], expo [B, k+1, V]
    # (or [B, k+1, 1] when greedy), drafts [B, k], draft_probs [B, k, V] (sampled model drafts) or unused
    if params.greedy:
        def round_fn(cols, root, L, active, accept_u, expo, drafts, draft_probs, *rest):
            processed, raw, hidden = target(cols, root, L, active, drafts, rest)
            return outputs(verify_chain_with_noise(processed, None, drafts, None, 0.0), processed, raw, hidden)
    elif greedy_rows:
        def round_fn(cols, root, L, active, accept_u, expo, drafts, draft_probs, temperature, *rest):
            processed, _, _ = target(cols, root, L, active, drafts, rest)
            return verify_chain_rows(processed, drafts, (accept_u, expo), temperature, params.top_k, params.top_p,
                                     params.min_p)
    else:
        def round_fn(cols, root, L, active, accept_u, expo, drafts, draft_probs, temperature, *rest):
            processed, raw, hidden = target(cols, root, L, active, drafts, rest)
            return outputs(verify_chain_with_noise(
                scaled_logits(processed, temperature), draft_probs if use_q else None, drafts,
                (accept_u, expo), 1.0, params.top_k, params.top_p, params.min_p,
            ), processed, raw, hidden, temperature)

    return round_fn


def tree_round(step, shape: tuple[int, int, int], slots: int, window, params: SamplingParams, *,
               spec: LogitsSpec | None = None, want_scores: bool = False, top_n: int = -1,
               with_features: bool = False):
    """The tree round around a captured target ``step`` of N query tokens, for trees of ``shape``
    (N nodes, at most C children per node, depth at most D) whose topology is an input
    (``parents``): the target's logits at every node (:func:`tree_logits`), the logits processors
    of ``spec`` along each node's path, exact verification, then the accepted path's K/V moved to
    contiguous slots (:func:`compact_path`), all in one graph.

    Greedy: ``tree_round_fn(cols, root, L, active, accept_u, expo, tree_tokens, parents, *proc,
    *kv)``; sampling takes a ``temperature`` [B] float32 after ``parents``. Returns (path tokens
    [B, D+1], n [B], path nodes [B, D+1]), then with ``want_scores`` the processed and raw logits
    along the path [B, D+1, V], with ``top_n`` >= 0 the emitted tokens' log-probabilities and
    the top-n, and with ``with_features`` the target's features along the path [B, D+1, H]."""
    S = slots
    N, C, D = shape
    hid = with_features
    n_proc = 0 if spec is None else 2 + spec.grammar  # seq, meta (and the grammar's bitmask)

    def along(t, path_nodes):  # rows of t [B, N, X] at the accepted path's nodes [B, D+1]
        return t.gather(1, path_nodes.clamp_min(0).unsqueeze(-1).expand(-1, -1, t.shape[2]))

    def verify_and_compact(cols, root, L, active, tree_tokens, parents, noise, temperature, rest):
        proc, kv = rest[:n_proc], rest[n_proc:]
        logits, ids, children, hidden = tree_logits(step, root, L, active, tree_tokens, parents, C, kv, S,
                                                    cols, window, hidden=True)
        processed = logits if spec is None else process_logits(
            spec, logits, *proc[:2], L, *tree_paths(tree_tokens, parents, D), *proc[2:])
        path_tokens, n, path_nodes = verify_tree_with_noise(
            processed if temperature is None else scaled_logits(processed, temperature), None, ids, children, D,
            noise, 1.0 if noise is not None else 0.0, params.top_k, params.top_p, params.min_p,
        )
        compact_path(kv, L, path_nodes, n, active, S - 1)
        out = (path_tokens, n, path_nodes)
        if want_scores:
            out = (*out, along(processed, path_nodes), along(logits, path_nodes))
        if top_n >= 0:
            x = along(processed, path_nodes)
            x = x if temperature is None else scaled_logits(x, temperature)
            out = (*out, *token_logprobs(x, path_tokens, top_n, temperature is not None, params.top_k,
                                         params.top_p, params.min_p))
        # head drafters read the target's features along the accepted path [B, D+1, H]
        return (*out, along(hidden, path_nodes)) if hid else out

    # cols [W] attended slots, root [B], L [B], active [B] bool, accept_u [B, N, C], expo [B, N, V]
    # (or [B, N, 1] when greedy), tree_tokens [B, N] (root entry ignored), parents [B, N] (-1 root)
    if params.greedy:
        def tree_round_fn(cols, root, L, active, accept_u, expo, tree_tokens, parents, *rest):
            return verify_and_compact(cols, root, L, active, tree_tokens, parents, None, None, rest)
    else:
        def tree_round_fn(cols, root, L, active, accept_u, expo, tree_tokens, parents, temperature, *rest):
            return verify_and_compact(cols, root, L, active, tree_tokens, parents, (accept_u, expo), temperature,
                                      rest)

    return tree_round_fn


def scaled_logits(logits, temperature):
    """logits [B, Q, V] divided by a per-row temperature [B] float32: what ``warp_logits`` does
    first, with the temperature an input instead of a constant, so one sampling graph serves every
    temperature (verification then runs at temperature 1.0: the same arithmetic)."""
    return logits.float() / temperature.view(-1, 1, 1)


def compact_path(kv, L, path_nodes, n, active, scratch):
    """KV compaction after a tree round: the accepted nodes' K/V (slots L + path_nodes[:, j]) move
    to the contiguous slots L + j, so the committed prefix stays slot = position and the next
    round's rollback is again just not advancing L. Rows that stopped, and entries past the
    accepted path, write to the scratch slot. The gather completes before the writes, so
    overlapping source and destination slots are safe. path_nodes [B, D+1], n [B] in 1..D+1."""
    B, D1 = path_nodes.shape
    if D1 < 2:
        return
    j = torch.arange(1, D1, device=L.device)
    keep = active.unsqueeze(1) & (j.unsqueeze(0) < n.unsqueeze(1))
    src = L.unsqueeze(1) + path_nodes[:, 1:].clamp_min(0)  # [B, D]
    dst = torch.where(keep, L.unsqueeze(1) + j, scratch)
    rows = torch.arange(B, device=L.device).unsqueeze(1)
    for t in kv:  # [B, H, S, Dh]
        t[rows, :, dst] = t[rows, :, src]
