"""Learned drafters inside ``specgraph.compile``: EAGLE heads (chains, static trees, EAGLE-2 dynamic
trees) and Medusa heads (chains, static trees) of :mod:`specgraph.heads`, and the resolution of
the ``draft=`` names ``"eagle"``, ``"medusa"`` and ``"layerskip"``.

Both heads read the target's final feature (``last_hidden``, the second output of the captured
step, :class:`specgraph.capture.Step`). Per round:

1. **propose** (one compiled graph per batch bucket and sampling setting; the head is plain torch,
   traced by ``torch.compile`` together with the sampling):

   * EAGLE: the *feed* step writes the previous round's accepted positions into the head's own slot
     KV cache: rows j < n are (emitted token j, target feature j) at position / slot
     ``L_prev + j`` (static shape: F = depth + 1 rows, unused rows masked and written to the head's
     scratch slot). Its output at the last fed row (position L - 1, whose token is the root) is the
     predicted feature at the root's position; its logits give the first draft. A chain then runs
     K - 1 one-row steps, each feeding (draft, predicted feature) at position L + i; a static tree
     expands level by level over the tree mask (node i's head row at slot L - 1 + i, the root row
     being the feed step's last row); a dynamic tree expands the top-k children of the best nodes
     by cumulative draft log-probability and keeps the best N, building ``parents`` on device.
   * Medusa: head k on the feature at position L - 1 predicts the token at L + k.

   Sampled chain drafts are drawn from the warped q rows with the exponential race and the q rows
   go to verification as ``draft_probs`` (exact rejection sampling); greedy drafts are argmaxes
   (one-hot rule). Tree children are the head's top-k tokens (deterministic), verified by recursive
   rejection with ``draft_probs=None``: lossless either way.

2. **verify**: the compiled target round returns, besides the emitted tokens, the target's
   features at the accepted path ``[B, F, H]`` (chains: the rows of the root and the drafts;
   trees: gathered along the accepted nodes). Row j pairs with emitted token j: both belong to
   head position ``L + j``.

3. **observe**: those (tokens, features, n) become the next round's feed. Head slots at and after
   the committed length are only ever read after the next feed step rewrote them with the target's
   real features, so the head cache needs no compaction or rollback.
"""
from __future__ import annotations

import sys
import warnings

import torch

from specgraph.artifacts import cpu_model
from specgraph.heads import EagleHead, HeadMismatchError, MedusaHeads, TargetBound, find_head, load_head, model_fingerprint
from specgraph.limits import max_positions
from specgraph.verify import exponential_noise
from specgraph.warping import SamplingParams, warped_probs

LEARNED = ("eagle", "medusa")
EAGLE_TREE_TOPK = 4  # dynamic trees: children tried per expanded node, and nodes expanded per depth
EAGLE_TREE_NODES = 16  # dynamic trees without a measured choice: drafted nodes kept (the round has this + 1)
TREE_NODE_GRID = (4, 8, 12, 16, 24, 32, 48, 63)  # tree_nodes="auto" chooses among these (the round: + 1)
TREE_COST_POINTS = (1, 5, 9, 17, 33)  # compiled round sizes timed for tree_nodes="auto" (+ the largest); interpolated between
# the held-out evaluation records top-1 and top-4 agreement per depth; the top-4 mass beyond rank 0
# is split over ranks 1..3 in these proportions (a prior: the head's rank curve is not recorded)
RANK_SPLIT = (0.5, 0.3, 0.2)
# tree_nodes="auto" warns when its best EAGLE tree is predicted less than this much faster than a
# plain step (the prediction leaves out the loop's host time, which speculation does not shrink)
TREE_GAIN_MARGIN = 0.05
_DEPTH_TIEBREAK = 1e-6  # dynamic trees: a child always ranks strictly below its parent (see _dynamic_tree_fn)


def draft_noise(B: int, K: int, V: int, device, generator, greedy: bool) -> torch.Tensor:
    """Exp(1) draws for K exponential races over the target vocabulary [B, K, V] ([B, K, 1] ones when
    greedy: unused). A module-level function so a test can replace it (negative control)."""
    if greedy:
        return torch.ones(B, K, 1, device=device)
    return exponential_noise((B, K, V), device, generator)


# ----------------------------------------------------------------------------------------------
# draft= resolution


def is_learned(draft) -> bool:
    return isinstance(draft, TargetBound) or (isinstance(draft, str) and draft in (*LEARNED, "layerskip"))


def check_head(model, head) -> None:
    """A head passed as ``draft=`` must be bound to this target and in eval mode."""
    if head.lm_weight is None:
        raise ValueError(f"the {head.kind} head is not bound to a target: call head.bind(model) first "
                         "(specgraph.heads.load_head does it)")
    if head.training:
        raise ValueError(f"put the {head.kind} head in eval mode first (head.eval())")
    if head.target_fingerprint is not None and head.target_fingerprint != model_fingerprint(model):
        raise HeadMismatchError(
            f"this {head.kind} head was bound to another model (fingerprint {head.target_fingerprint[:16]}..., this "
            f"model {model_fingerprint(model)[:16]}...): bind it to the model you compile (head.bind(model))")
    cfg = model.config.get_text_config(decoder=True)
    if head.config["hidden_size"] != cfg.hidden_size:
        raise HeadMismatchError(f"head hidden size {head.config['hidden_size']} != target hidden size {cfg.hidden_size}")
    p = next(model.parameters())
    hp = next(head.parameters())
    if hp.device != p.device or hp.dtype != p.dtype:
        raise ValueError(f"the head ({hp.dtype}, {hp.device}) must have the target's dtype and device "
                         f"({p.dtype}, {p.device}): head.to(model.dtype / device)")


def resolve_draft(model, draft):
    """``draft=`` as the compiler handles it: (draft, head). ``"layerskip"`` becomes a draft model (the
    target's first layers, :func:`specgraph.drafters.layer_skip`); ``"eagle"`` / ``"medusa"`` load
    the head whose fingerprint matches ``model`` (:func:`specgraph.heads.find_head`: raises
    :class:`specgraph.heads.HeadMismatchError`, naming the heads found, when none matches); a head
    object is checked. Anything else passes through unchanged with head None."""
    if isinstance(draft, str) and draft == "layerskip":
        from specgraph.drafters import layer_skip

        return layer_skip(model), None
    if isinstance(draft, str) and draft in LEARNED:
        head = load_head(find_head(model, draft), model)
        return draft, head
    if isinstance(draft, TargetBound):
        check_head(model, draft)
        return draft.kind, draft
    return draft, None


def make_drafter(sg, head):
    if isinstance(head, EagleHead):
        return EagleDrafter(sg, head)
    if isinstance(head, MedusaHeads):
        return MedusaDrafter(sg, head)
    raise TypeError(f"not a drafter head: {type(head).__name__}")


# ----------------------------------------------------------------------------------------------
# dynamic-tree size (tree_nodes="auto")


def rank_acceptance(head, topk: int = EAGLE_TREE_TOPK) -> list[list[float]] | None:
    """P(the target's greedy token is the head's rank-r token at depth d) [D][topk] from the head
    file's held-out evaluation (``specgraph train-drafter`` writes top-1 / top-4 agreement per
    depth), or None when the head carries none (a head built in memory, or trained elsewhere)."""
    ev = ((getattr(head, "file_meta", None) or {}).get("meta") or {}).get("final_eval") or {}
    ev = ev.get("all") or {}
    rows, d = [], 1
    while f"top1_depth{d}" in ev:
        top1 = float(ev[f"top1_depth{d}"])
        top4 = max(float(ev.get(f"top4_depth{d}", 0.0)), top1)
        rows.append(([top1] + [(top4 - top1) * w for w in RANK_SPLIT])[:topk])
        d += 1
    return rows or None


@torch.inference_mode()
def measure_tree_costs(model, head, query_sizes, head_rows, context: int = 128, repeats: int = 3) -> dict:
    """Seconds of one eager target step of N query tokens over a ``context``-token slot cache, per N in
    ``query_sizes``, and of one eager head step (+ its draft logits) of Q rows, per Q in
    ``head_rows``: what rounds cost with ``backend="eager"``. Not a proxy for compiled rounds (for
    SmolLM2 on a 2-core CPU eager t(5)/t(1) is about 2.2 against ~1.4 compiled with GEMM autotuning):
    those are timed by :func:`measure_compiled_tree_costs`."""
    import statistics

    from specgraph.capture import Step, new_kv_cache
    from specgraph.timing import timed_calls  # (first call's seconds, [later calls' seconds])

    dev = next(model.parameters()).device
    p = next(head.parameters())
    V = model.get_output_embeddings().out_features
    S = context + max(*query_sizes, *head_rows) + 1
    ids = (torch.arange(S, device=dev) * 7919 % V).unsqueeze(0)
    step, kv = Step(model), new_kv_cache(model, 1, S)  # the round's step (slot KV cache), uncompiled
    target = {}
    for n in sorted(set(query_sizes)):
        pos = torch.arange(context, context + n, device=dev).unsqueeze(0)
        mask = torch.zeros(1, 1, n, S, dtype=p.dtype, device=dev)  # cost does not depend on what is masked
        target[n] = statistics.median(
            timed_calls(lambda n=n, pos=pos, mask=mask: step(ids[:, :n], pos, mask, pos, *kv), dev, repeats)[1])
    heads = time_head_steps(head, head_rows, context, S, V, repeats)
    return {"target": target, "head": heads, "context": context}


def time_head_steps(head, head_rows, context: int, slots: int, vocab: int, repeats: int, build=None,
                    progress: bool = False) -> dict:
    """{Q: median seconds of one head step over Q rows + its draft log-probabilities and top-k}, the
    step as ``build(fn)`` makes it (default: eager; :func:`measure_compiled_tree_costs` compiles it)."""
    import statistics

    from specgraph.timing import timed_calls  # (first call's seconds, [later calls' seconds])

    p = next(head.parameters())
    dev, H = p.device, head.config["hidden_size"]
    hk, hv = head.new_cache(1, slots)
    heads = {}
    for q in sorted(set(head_rows)):
        def head_cost_fn(tok, feats, pos, mask, hk, hv):  # [1, Q] ids, [1, Q, H] features -> top-k [1, Q, k]
            out = head(tok, feats, pos, mask, pos, hk, hv)
            return torch.log_softmax(head.logits(out).float(), dim=-1).topk(EAGLE_TREE_TOPK, dim=-1).values
        fn = head_cost_fn if build is None else build(head_cost_fn)
        tok = (torch.arange(q, device=dev) * 7919 % vocab).unsqueeze(0)
        feats = torch.randn(1, q, H, dtype=p.dtype, device=dev)
        pos = torch.arange(context, context + q, device=dev).unsqueeze(0)
        mask = torch.zeros(1, 1, q, slots, dtype=p.dtype, device=dev)  # cost does not depend on what is masked
        first, times = timed_calls(lambda: fn(tok, feats, pos, mask, hk, hv), dev, repeats)
        heads[q] = statistics.median(times)
        if progress:
            print(f"[tree] head step Q={q}: {1e3 * heads[q]:.2f} ms (first call {first:.1f} s)", file=sys.stderr,
                  flush=True)
    return heads


@torch.no_grad()
def measure_compiled_tree_costs(model, head, query_sizes, head_rows, *, backend: str = "inductor", freeze: bool = True,
                                autotune: bool = False, context: int = 128, repeats: int = 3,
                                points=TREE_COST_POINTS, progress: bool = True) -> dict:
    """:func:`measure_tree_costs`' result for compiled rounds: the target's verification round
    compiled as ``compile`` builds it (same backend, freezing and GEMM autotuning), timed at the
    query sizes of ``points`` up to ``max(query_sizes)`` and interpolated between them
    (:class:`specgraph.perfmodel.CostCurve`: piecewise linear, non-decreasing), and the head step
    compiled at each Q of ``head_rows``. A throwaway plain compiled object holds the graphs (and
    their frozen weight copies) only while it measures. Minutes on a CPU: each size is a graph
    compile; :func:`choose_dynamic_tree` caches the result per machine and configuration."""
    import gc

    from specgraph.compiler import Draft, SpecGraphModel, engine_config
    from specgraph.perfmodel import CostCurve
    from specgraph.timing import measure_round_costs

    hi = max(query_sizes)
    pts = sorted({int(n) for n in points if 1 <= n < hi} | {1, hi})
    width = max(hi, *head_rows) + 2
    limit = max_positions(model)
    if limit is not None:  # a model of few positions is timed after a shorter context
        context = max(0, min(context, limit[1] - width))
    plain = engine_config(model, Draft(None), 1, None, backend, 1, context + width, freeze, autotune)
    tmp = SpecGraphModel(model, plain)
    try:
        curve = CostCurve.fit(measure_round_costs(tmp, [1], pts, context, repeats, progress))
        target = {n: curve(n, 1) for n in sorted(set(query_sizes))}
        heads = time_head_steps(head, head_rows, context, tmp.slots, model.get_output_embeddings().out_features,
                                repeats, lambda fn: tmp._compiled("head_cost", fn, weights=(head,)), progress)
    finally:
        del tmp
        gc.collect()  # returns the throwaway graphs' frozen weight copies (specgraph.freezing)
    return {"target": target, "head": heads, "context": context, "points": pts}


def _machine(device: torch.device) -> str:
    """What the cost of a graph on ``device`` depends on besides the model: the GPU, or the
    processor and the threads."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return f"cpu:{cpu_model()}:{torch.get_num_threads()} threads"


def cached_tree_costs(fields: dict, measure) -> tuple[dict, bool]:
    """(costs, whether they came from the cache): ``measure()``'s result stored under
    ``$SPECGRAPH_CACHE/tree_costs.json`` keyed by ``fields`` (model, head shape, machine, torch,
    compile settings); a cache that cannot be read or written is skipped, never fatal."""
    import hashlib
    import json
    import os

    from specgraph.models import cache_dir

    def ints(d):
        return {int(k): float(v) for k, v in d.items()}

    path = cache_dir() / "tree_costs.json"
    key = hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:32]
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = {}
    hit = data.get(key) if isinstance(data, dict) else None
    if hit is not None:
        c = hit["costs"]
        return {**c, "target": ints(c["target"]), "head": ints(c["head"])}, True
    costs = measure()
    data = data if isinstance(data, dict) else {}
    data[key] = {"fields": fields, "costs": costs}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, default=str))
        os.replace(tmp, path)
    except OSError:
        pass
    return costs, False


def dynamic_tree_candidates(depth: int, topk: int = EAGLE_TREE_TOPK) -> int:
    """Nodes an EAGLE-2 expansion of ``depth`` levels scores: topk children of the root, then topk^2 per level."""
    return topk + (depth - 1) * topk ** 2


def plan_dynamic_tree(rank_accept, costs: dict, max_depth: int, topk: int = EAGLE_TREE_TOPK,
                      grid=TREE_NODE_GRID) -> dict:
    """The (depth, nodes) of an EAGLE-2 tree with the most expected tokens per second.

    Per round: expected emitted tokens = :func:`specgraph.perfmodel.best_tree` of ``rank_accept``
    (the best N-node tree of that depth, as EAGLE-2's rerank keeps the best N candidates), time =
    target forward of N + 1 tokens + head feed step (depth + 1 rows) + (depth - 1) expansions of
    ``topk`` rows. ``costs`` from :func:`measure_tree_costs`; a size whose cost was not measured is
    skipped. Returns the choice and every candidate's prediction (speedup over one plain step)."""
    from specgraph.perfmodel import best_tree

    tgt, hd = costs["target"], costs["head"]
    table = []
    for depth in range(1, max_depth + 1):
        if depth + 1 not in hd or (depth > 1 and topk not in hd):
            continue
        draft = hd[depth + 1] + (depth - 1) * (hd[topk] if depth > 1 else 0.0)
        for n in grid:
            if n > dynamic_tree_candidates(depth, topk) or n + 1 not in tgt:
                continue
            emitted, _ = best_tree([r[:topk] for r in rank_accept], n, depth)
            seconds = tgt[n + 1] + draft
            table.append({"depth": depth, "nodes": n, "expected_emitted": round(emitted, 4),
                          "round_seconds": seconds, "speedup": emitted * tgt[1] / seconds})
    if not table:
        raise ValueError("no (depth, nodes) candidate has measured costs")
    best = max(table, key=lambda r: r["speedup"])
    return {"depth": best["depth"], "nodes": best["nodes"], "predicted_speedup": best["speedup"],
            "expected_emitted": best["expected_emitted"], "candidates": table}


def choose_dynamic_tree(model, head, max_depth: int, topk: int = EAGLE_TREE_TOPK, grid=TREE_NODE_GRID,
                        repeats: int = 7, *, backend: str = "eager", freeze: bool = True, autotune: bool = False,
                        cache: bool = True, progress: bool = True) -> dict | None:
    """``tree_nodes="auto"``: this machine's costs for rounds built like ``compile`` builds them
    (``backend="eager"``: :func:`measure_tree_costs`, seconds; compiled:
    :func:`measure_compiled_tree_costs`, minutes the first time, then read from the cache
    (:func:`cached_tree_costs`) unless ``cache=False``), and the tree they imply
    (:func:`plan_dynamic_tree`) with the head's recorded acceptance; None when the head has no
    recorded acceptance (then the fixed default size is used)."""
    accept = rank_acceptance(head, topk)
    if accept is None:
        return None
    grid = [n for n in grid if n <= dynamic_tree_candidates(max_depth, topk)] or [min(grid)]
    query_sizes, head_rows = [1] + [n + 1 for n in grid], sorted({topk, *range(2, max_depth + 2)})
    if backend == "eager":
        costs, source = measure_tree_costs(model, head, query_sizes, head_rows, repeats=repeats), "eager"
    else:
        p = next(head.parameters())
        fields = {"model": model_fingerprint(model), "dtype": str(p.dtype), "head": dict(head.config),
                  "head_vocab": head.draft_vocab_size,
                  "machine": _machine(p.device), "torch": torch.__version__, "backend": backend, "freeze": bool(freeze),
                  "autotune": bool(autotune), "query_sizes": query_sizes, "head_rows": head_rows,
                  "points": list(TREE_COST_POINTS), "repeats": repeats}

        def measure():
            if progress:
                print(f"[tree] tree_nodes='auto': timing compiled rounds of up to {max(query_sizes)} query tokens "
                      "on this machine (once; cached under $SPECGRAPH_CACHE)", file=sys.stderr, flush=True)
            return measure_compiled_tree_costs(model, head, query_sizes, head_rows, backend=backend, freeze=freeze,
                                               autotune=autotune, repeats=repeats, progress=progress)
        if cache:
            costs, hit = cached_tree_costs(fields, measure)
        else:
            costs, hit = measure(), False
        source = "compiled (cached)" if hit else "compiled"
    plan = plan_dynamic_tree(accept, costs, max_depth, topk, grid)
    plan["costs"] = {k: ({str(n): t for n, t in v.items()} if isinstance(v, dict) else v) for k, v in costs.items()}
    plan["cost_source"] = source
    plan["rank_acceptance"] = accept
    return plan


def size_dynamic_tree(model, config, stacklevel: int = 2):
    """``tree_nodes="auto"`` for an EAGLE-2 config (:class:`specgraph.compiler.EngineConfig`):
    ``config`` with the depth and drafted nodes :func:`choose_dynamic_tree` picks from this
    machine's costs, or unchanged (then :data:`EAGLE_TREE_NODES`) when the head has no recorded
    acceptance or the costs cannot be measured (with a warning that says why)."""
    try:
        choice = choose_dynamic_tree(model, config.head, config.k, backend=config.backend, freeze=config.freeze,
                                     autotune=config.autotune)
    except Exception as e:  # noqa: BLE001 - a size is an optimisation: keep the default, say why
        warnings.warn(f"specgraph: could not measure this machine's tree costs ({type(e).__name__}: {e}); "
                      f"using {EAGLE_TREE_NODES} nodes", stacklevel=stacklevel + 1)
        return config
    if choice is None:
        return config
    if choice["predicted_speedup"] < 1.0 + TREE_GAIN_MARGIN:
        # dynamic trees have no per-round off switch (num_speculative_tokens="auto" gates chains
        # only): say so rather than serve a predicted slowdown without a word
        warnings.warn(
            f"specgraph: on this machine the best EAGLE tree (depth {choice['depth']}, {choice['nodes']} nodes) is "
            f"predicted at {choice['predicted_speedup']:.2f}x a plain step: speculation may not pay here; "
            "draft=None compiles plain decoding (fast.tree_choice has the measurements)", stacklevel=stacklevel + 1)
    return config.with_tree_size(choice["depth"], choice["nodes"], choice)


# ----------------------------------------------------------------------------------------------
# shared generation-loop side


class _HeadDrafter:
    """Per-compiled-object state of a head drafter: the feed (what the next round's head reads)."""

    def __init__(self, sg, head):
        self.sg, self.head = sg, head
        self.V = sg.model.get_output_embeddings().out_features
        self.H = head.config["hidden_size"]
        self.Vd = head.draft_vocab_size
        # drafts are target ids; the draft index -> target id map is skipped when it is the identity
        self.identity = self.Vd == self.V and bool((head.d2t == torch.arange(self.V, device=head.d2t.device)).all())
        self.F = sg.k + 1  # feed rows: the most tokens one round emits (chain depth or tree depth, + 1)
        if sg.tree is not None and not isinstance(sg.tree, str) and max(sg.tree_rank) + 1 > self.Vd:
            raise ValueError(f"tree ranks up to {max(sg.tree_rank)} need a draft vocabulary of more than "
                             f"{max(sg.tree_rank)} tokens (this head has {self.Vd})")
        self.feed = None

    @property
    def span(self) -> int:
        """Target cache slots one round writes (root + drafts, or the tree's nodes)."""
        return self.sg.span

    # -- vocabulary --------------------------------------------------------------------------
    def _ids(self, idx):  # draft-vocabulary indices -> target ids (any shape)
        return idx if self.identity else self.head.d2t[idx]

    def _target_logits(self, logits):  # [..., Vd] -> [..., V], -inf outside the draft vocabulary
        if self.identity:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.V), float("-inf"))
        return full.index_copy(-1, self.head.d2t, logits)

    def _pick(self, logits, params: SamplingParams, expo, temperature):
        """Draft tokens from draft logits [B, ..., Vd]: (target ids [B, ...], warped q [B, ..., V] or None).
        Sampled drafts come from q by the exponential race (``argmax q / E``, E ~ Exp(1) = ``expo``).
        q is warped like the round warps the target (logits / temperature [B], then the filters of
        ``params`` at temperature 1), so one graph serves every temperature."""
        if params.greedy:
            return self._ids(logits.argmax(dim=-1)), None
        scaled = self._target_logits(logits).float() / temperature.view(-1, *[1] * (logits.dim() - 1))
        q = warped_probs(scaled, 1.0, params.top_k, params.top_p, params.min_p)
        return (q / expo).argmax(dim=-1), q

    def _sampling_inputs(self, B, params, generator, device):
        """(graph params, Exp(1) draws [B, K, V] or [B, K, 1], temperature [B]) for a chain proposal."""
        expo = draft_noise(B, self.sg.k, self.V, device, generator, params.greedy)
        return self.sg._graph_params(params), expo, torch.full((B,), float(params.temperature), device=device)

    # -- feed state --------------------------------------------------------------------------
    def start(self, B, rows, prefill_hidden, device):
        """State after the target's prefill. Prompt row r (length T) was prefilled up to position T - 2
        and its root is ``r[-1]`` at position T - 1: the first feed is (r[-1], feature T - 2) at
        position T - 2 (none when T = 1: that row's first drafts are uninformed, still verified).
        ``prefill_hidden`` [B, P, H] target features of the prefill (P = longest prompt - 1), or None."""
        lens = torch.tensor([len(r) for r in rows] + [1] * (B - len(rows)), device=device)
        p = next(self.head.parameters())
        tokens = torch.zeros(B, self.F, dtype=torch.long, device=device)
        tokens[: len(rows), 0] = torch.tensor([r[-1] for r in rows], device=device)
        feats = torch.zeros(B, self.F, self.H, dtype=p.dtype, device=device)
        if prefill_hidden is not None:
            idx = (lens - 2).clamp_min(0).view(B, 1, 1).expand(B, 1, self.H)
            feats[:, 0] = prefill_hidden.gather(1, idx).squeeze(1).to(p.dtype)
        self.feed = dict(tokens=tokens, feats=feats, start=(lens - 2).clamp_min(0), n=(lens >= 2).long())
        self._prefill_head(B, rows, prefill_hidden, lens, device)

    def _prefill_head(self, B, rows, prefill_hidden, lens, device):
        pass

    def observe(self, L, tokens, n, hidden):
        """After a round that started at committed length L [B]: the emitted tokens [B, T] (-1 after
        the n [B] emitted) and the target features at the accepted path [B, T, H] feed the next round
        (T <= F; a plain round has T = 1)."""
        B, T = tokens.shape
        if T < self.F:
            tokens = torch.cat([tokens, tokens.new_zeros(B, self.F - T)], dim=1)
            hidden = torch.cat([hidden, hidden.new_zeros(B, self.F - T, hidden.shape[2])], dim=1)
        self.feed = dict(tokens=tokens.clamp_min(0), feats=hidden.to(self.feed["feats"].dtype), start=L, n=n)

    def _feed_args(self):
        f = self.feed
        return f["tokens"], f["feats"], f["start"], f["n"]


# ----------------------------------------------------------------------------------------------
# EAGLE


def select_tree(scores, tokens, parent, depth, num_nodes: int, root):
    """Keep the best ``num_nodes`` of M drafted candidates as a tree, on device (EAGLE-2's rerank).

    scores [B, M] float64 cumulative draft log-probabilities (a child's <= its parent's), tokens
    [B, M] long, parent [B, M] long (the parent's candidate id, -1 for the root; always smaller than
    the child's id), depth [M] float64 (1 for the root's children; non-decreasing in the id), root
    [B] long -> tree tokens [B, N] (column 0 = root), parents [B, N] (-1 at the root), N =
    num_nodes + 1.

    A candidate's key is its score minus ``_DEPTH_TIEBREAK`` x depth: strictly below its parent's
    key even when q(child) rounds to 1, so the kept set is closed under ancestors. The kept ids,
    sorted, are a topological order (parents have smaller ids), and each kept candidate's parent
    is mapped to its node index by a scatter: no host loop, no sync."""
    B, M = scores.shape
    dev = scores.device
    key = scores - _DEPTH_TIEBREAK * depth
    chosen = key.topk(num_nodes, dim=1).indices.sort(dim=1).values  # [B, n] candidate ids, topological
    node_of = torch.full((B, M), -1, dtype=torch.long, device=dev).scatter(
        1, chosen, torch.arange(1, num_nodes + 1, device=dev).expand(B, num_nodes))  # candidate -> node
    pc = parent.gather(1, chosen)
    parents = torch.where(pc < 0, 0, node_of.gather(1, pc.clamp_min(0)))
    parents = torch.cat([torch.full((B, 1), -1, dtype=torch.long, device=dev), parents], dim=1)
    return torch.cat([root.unsqueeze(1), tokens.gather(1, chosen)], dim=1), parents


class EagleDrafter(_HeadDrafter):
    def __init__(self, sg, head):
        super().__init__(sg, head)
        self.dynamic = sg.tree == "dynamic"
        self.topk = min(EAGLE_TREE_TOPK, self.Vd)
        D = sg.k
        # dynamic trees: candidates = k children of the root + k^2 per deeper level; keep the best
        self.candidates = dynamic_tree_candidates(D, self.topk)
        self.tree_nodes = min(sg.tree_nodes or EAGLE_TREE_NODES, self.candidates) + 1
        # chains and static trees write below L + span <= max_seq_len (checked per request), i.e. below
        # the scratch slot; a dynamic tree writes k head rows per expanded depth, maybe more than N
        self.slots = sg.slots + ((D - 1) * self.topk if self.dynamic else 0)  # last = scratch
        self._kv: dict = {}

    @property
    def span(self) -> int:
        return self.tree_nodes if self.dynamic else self.sg.span

    def cache(self, B):
        if B not in self._kv:
            self._kv[B] = self.head.new_cache(B, self.slots)
            if self._kv[B][0].is_cuda and self.sg.backend == "inductor":
                for t in self._kv[B]:  # mutated inside recorded CUDA graphs: fixed addresses
                    torch._dynamo.mark_static_address(t)
        return self._kv[B]

    def _prefill_head(self, B, rows, prefill_hidden, lens, device):
        """Head positions 0 .. T - 3 of each prompt: (token p + 1, target feature p); position T - 2
        is the first round's feed. Eager, like the target's prefill (no compile per prompt length)."""
        from specgraph.rounds import step_mask

        P = int(lens.max()) - 2
        if P <= 0 or prefill_hidden is None:
            return
        ids = torch.zeros(B, P, dtype=torch.long)
        for b, r in enumerate(rows):
            if len(r) > 2:
                ids[b, : len(r) - 2] = torch.tensor(r[1:-1])
        ids = ids.to(device)
        pos = torch.arange(P, device=device).expand(B, P).contiguous()
        valid = pos < (lens - 2).unsqueeze(1)
        S = self.slots
        mask = step_mask(torch.zeros(B, dtype=torch.long, device=device), pos, valid, S, None)
        kv = self.cache(B)
        self.head(ids, prefill_hidden[:, :P].to(kv[0].dtype), pos, mask, torch.where(valid, pos, S - 1), *kv)

    def _feed_step(self, feed_tokens, feed_feats, feed_start, feed_n, active, hk, hv):
        """The feed step (see the module doc): returns the head's output at the last fed row, the
        predicted target feature at the root's position [B, H]."""
        from specgraph.rounds import step_mask

        B, F = feed_tokens.shape
        S = self.slots
        j = torch.arange(F, device=feed_start.device)
        valid = active.unsqueeze(1) & (j < feed_n.unsqueeze(1))  # [B, F]
        pos = feed_start.unsqueeze(1) + j
        mask = step_mask(feed_start, pos, valid, S, None).to(hk.dtype)
        out = self.head(feed_tokens, feed_feats, pos, mask, torch.where(valid, pos, S - 1), hk, hv)  # [B, F, H]
        last = (feed_n - 1).clamp_min(0).view(B, 1, 1).expand(B, 1, out.shape[2])
        return out.gather(1, last).squeeze(1)

    # -- chain ------------------------------------------------------------------------------
    def propose_chain(self, B, params, generator, L, root, active):
        """K drafts [B, K] (target ids) and the q rows they were drawn from [B, K, V] (None when greedy)."""
        gparams, expo, temperature = self._sampling_inputs(B, params, generator, L.device)
        out = self._chain_fn(B, gparams)(*self._feed_args(), L, active, expo, temperature, *self.cache(B))
        return (out, None) if params.greedy else out

    def _chain_fn(self, B, params):
        key = ("eagle_chain", B, params)
        fns = self.sg._fns
        if key not in fns:
            from specgraph.rounds import step_mask

            K, S, head = self.sg.k, self.slots, self.head

            def eagle_chain_fn(feed_tokens, feed_feats, feed_start, feed_n, L, active, expo, temperature, hk, hv):
                # feed_tokens [B, F] long, feed_feats [B, F, H], feed_start [B], feed_n [B], L [B], active [B]
                # bool, expo [B, K, V] Exp(1) (or [B, K, 1] when greedy), temperature [B], hk/hv [B, Hkv, S, D]
                g = self._feed_step(feed_tokens, feed_feats, feed_start, feed_n, active, hk, hv)  # [B, H]
                drafts, qs = [], []
                for i in range(K):
                    tok, q = self._pick(head.logits(g), params, expo[:, i], temperature)
                    drafts.append(tok)
                    qs.append(q)
                    if i + 1 < K:  # head position L + i reads (draft i + 1, predicted feature L + i)
                        p = (L + i).unsqueeze(1)  # [B, 1]
                        mask = step_mask(L, p, active.unsqueeze(1), S, None).to(hk.dtype)
                        slot = torch.where(active.unsqueeze(1), p, S - 1)
                        g = head(tok.unsqueeze(1), g.unsqueeze(1), p, mask, slot, hk, hv)[:, 0]
                drafts = torch.stack(drafts, dim=1)  # [B, K]
                return drafts if params.greedy else (drafts, torch.stack(qs, dim=1))

            fns[key] = self.sg._compiled("eagle_chain", eagle_chain_fn, weights=(self.head,))
        return fns[key]

    # -- trees ------------------------------------------------------------------------------
    def propose_tree(self, B, L, root, active):
        """(tree_tokens [B, N], parents [B, N], shape (N, C, D), drafted nodes per row)."""
        args = (*self._feed_args(), L, root, active, *self.cache(B))
        D = self.sg.k
        if self.dynamic:
            tokens, parents = self._dynamic_tree_fn(B)(*args)
            N = self.tree_nodes
            return tokens, parents, (N, self.topk, D), [N - 1] * B
        spec = self.sg.tree
        N = spec.num_nodes
        tokens = self._static_tree_fn(B)(*args)
        return tokens, spec.parents.to(L.device).expand(B, N), (N, spec.children.shape[1], D), [N - 1] * B

    def _static_tree_fn(self, B):
        """Level by level like the draft model's ``draft_tree_graph``: the nodes of depth d that have
        children are fed together (each sees the committed head slots and its own ancestors), and a
        node's rank-r child is the head's r-th most likely token there."""
        key = ("eagle_tree", B)
        fns = self.sg._fns
        if key not in fns:
            from specgraph.rounds import tree_mask

            S, head, spec = self.slots, self.head, self.sg.tree
            levels = self.sg.tree_levels
            parents, rank = spec.parents.tolist(), self.sg.tree_rank
            kids = spec.children.tolist()
            R = max(rank) + 1
            N = spec.num_nodes
            fed_idx = [torch.tensor(fed) for fed in levels]  # [Q_d] nodes fed at depth d
            fed_anc = [spec.ancestors[t] for t in fed_idx]  # [Q_d, N]

            def eagle_tree_fn(feed_tokens, feed_feats, feed_start, feed_n, L, root, active, hk, hv):
                # feed_* as in eagle_chain_fn, L [B], root [B], active [B] bool -> tree tokens [B, N]
                dev = L.device
                base = L - 1  # head row of node i at slot / position base + i / base + depth(i); the root's row is the feed's last
                feat = {0: self._feed_step(feed_tokens, feed_feats, feed_start, feed_n, active, hk, hv)}  # node -> [B, H]
                tokens = [root] + [None] * (N - 1)
                for d, fed in enumerate(levels):
                    if d == 0:
                        out = feat[0].unsqueeze(1)  # [B, 1, H]: fed == [0]
                    else:
                        Q = len(fed)
                        fed_t = fed_idx[d].to(dev)
                        ids = torch.stack([tokens[i] for i in fed], dim=1)  # [B, Q]
                        feats = torch.stack([feat[parents[i]] for i in fed], dim=1)  # [B, Q, H]
                        pos = (base + d).unsqueeze(1).expand(B, Q)
                        valid = active.unsqueeze(1).expand(B, Q)
                        anc = fed_anc[d].to(dev).unsqueeze(0).expand(B, Q, N)
                        mask = tree_mask(base, pos, anc, valid, S, None).to(hk.dtype)
                        slots = torch.where(valid, base.unsqueeze(1) + fed_t, S - 1)
                        out = head(ids, feats, pos.clamp_min(0), mask, slots, hk, hv)  # [B, Q, H]
                        for q, i in enumerate(fed):
                            feat[i] = out[:, q]
                    top = self._ids(head.logits(out).topk(R, dim=-1).indices)  # [B, Q, R] target ids
                    for q, i in enumerate(fed):
                        for c in kids[i]:
                            if c >= 0:
                                tokens[c] = top[:, q, rank[c]]
                return torch.stack(tokens, dim=1)

            fns[key] = self.sg._compiled("eagle_tree", eagle_tree_fn, weights=(self.head,))
        return fns[key]

    def _dynamic_tree_fn(self, B):
        """EAGLE-2 style: expand the top-k children of the k best nodes of each depth (by cumulative
        draft log-probability), then keep the best N - 1 of all candidates (:func:`select_tree`).
        Candidate ids grow with depth (the root's k children first, then k^2 per depth)."""
        key = ("eagle_dyn_tree", B)
        fns = self.sg._fns
        if key not in fns:
            from specgraph.rounds import tree_mask

            S, head, k, D = self.slots, self.head, self.topk, self.sg.k
            Nd = self.tree_nodes - 1
            rows = 1 + (D - 1) * k  # head rows: the root's (feed step) + k per expanded depth
            depth = torch.cat([torch.ones(k)] + [torch.full((k * k,), d + 1.0) for d in range(1, D)]).double()

            def expand(out):  # [B, Q, H] -> top-k (log q, target ids) [B, Q, k]
                logp = torch.log_softmax(head.logits(out).float(), dim=-1).clamp_max(0.0)
                top = logp.topk(k, dim=-1)
                return top.values.double(), self._ids(top.indices)

            def eagle_dyn_tree_fn(feed_tokens, feed_feats, feed_start, feed_n, L, root, active, hk, hv):
                # -> tree tokens [B, N] (column 0 = root), parents [B, N] (-1 root, topological)
                dev = L.device
                base = L - 1  # head row r at slot base + r (row 0 = the root's, written by the feed step)
                g_root = self._feed_step(feed_tokens, feed_feats, feed_start, feed_n, active, hk, hv)
                score, tok = expand(g_root.unsqueeze(1))  # [B, 1, k]
                scores, toks = [score.view(B, k)], [tok.view(B, k)]  # per depth: cumulative log q, target ids
                par = [torch.full((B, k), -1, dtype=torch.long, device=dev)]  # parent candidate id (-1 root)
                prow = torch.zeros(B, k, dtype=torch.long, device=dev)  # head row of each candidate's parent
                G = g_root.unsqueeze(1)  # [B, rows so far, H] head outputs (predicted features) per row
                anc = torch.eye(rows, dtype=torch.bool, device=dev)[:1].expand(B, 1, rows)  # [B, rows so far, rows]
                valid = active.unsqueeze(1).expand(B, k)
                eye_k = torch.eye(k, rows, dtype=torch.bool, device=dev)
                offset = 0  # candidate id of the current depth's first candidate
                for d in range(1, D):
                    # the k best candidates of depth d become head rows 1 + (d-1)k .. dk
                    sel = scores[-1].topk(k, dim=1).indices  # [B, k]
                    f_tok, f_score, f_prow = toks[-1].gather(1, sel), scores[-1].gather(1, sel), prow.gather(1, sel)
                    r0 = 1 + (d - 1) * k
                    f_feat = G.gather(1, f_prow.unsqueeze(-1).expand(B, k, G.shape[2]))  # parents' outputs [B, k, H]
                    own = eye_k.roll(r0, dims=1).unsqueeze(0)  # [1, k, rows]: row r0 + j is itself
                    f_anc = anc.gather(1, f_prow.unsqueeze(-1).expand(B, k, rows)) | own  # [B, k, rows]
                    pos = (base + d).unsqueeze(1).expand(B, k)
                    mask = tree_mask(base, pos, f_anc, valid, S, None).to(hk.dtype)
                    slots = torch.where(valid, base.unsqueeze(1) + r0 + torch.arange(k, device=dev), S - 1)
                    out = head(f_tok, f_feat, pos.clamp_min(0), mask, slots, hk, hv)  # [B, k, H]
                    G, anc = torch.cat([G, out], dim=1), torch.cat([anc, f_anc], dim=1)
                    score, tok = expand(out)  # [B, k, k]: child c of expanded node j at j * k + c
                    scores.append((f_score.unsqueeze(2) + score).view(B, k * k))
                    toks.append(tok.view(B, k * k))
                    par.append((offset + sel).unsqueeze(2).expand(B, k, k).reshape(B, k * k))
                    prow = (r0 + torch.arange(k, device=dev)).view(1, k, 1).expand(B, k, k).reshape(B, k * k)
                    offset += scores[-2].shape[1]
                return select_tree(torch.cat(scores, dim=1), torch.cat(toks, dim=1), torch.cat(par, dim=1),
                                   depth.to(dev), Nd, root)

            fns[key] = self.sg._compiled("eagle_dyn_tree", eagle_dyn_tree_fn, weights=(self.head,))
        return fns[key]


# ----------------------------------------------------------------------------------------------
# Medusa


class MedusaDrafter(_HeadDrafter):
    """Head k (1-based) on the target feature at the last committed position L - 1 predicts the token
    at L + k: a chain takes one token per head, a static tree the rank-r token of head d for a node
    of depth d (so a node's token depends on its depth and rank, not on its parent's token)."""

    def __init__(self, sg, head):
        super().__init__(sg, head)
        if sg.tree == "dynamic":
            raise ValueError("tree='dynamic' needs a drafter that scores its own nodes: use an EAGLE head "
                             "(Medusa heads take a static tree, a list of paths)")
        if sg.k > head.num_heads:
            raise ValueError(f"these Medusa heads draft at most {head.num_heads} tokens per round: pass "
                             f"num_speculative_tokens<={head.num_heads} (or a tree of that depth)")

    def _last_feature(self, feed_feats, feed_n):  # [B, F, H], [B] -> [B, 1, H] feature at position L - 1
        B = feed_feats.shape[0]
        return feed_feats.gather(1, (feed_n - 1).clamp_min(0).view(B, 1, 1).expand(B, 1, feed_feats.shape[2]))

    def propose_chain(self, B, params, generator, L, root, active):
        gparams, expo, temperature = self._sampling_inputs(B, params, generator, L.device)
        f = self.feed
        out = self._chain_fn(B, gparams)(f["feats"], f["n"], expo, temperature)
        return (out, None) if params.greedy else out

    def _chain_fn(self, B, params):
        key = ("medusa_chain", B, params)
        fns = self.sg._fns
        if key not in fns:
            K, head = self.sg.k, self.head

            def medusa_chain_fn(feed_feats, feed_n, expo, temperature):
                # feed_feats [B, F, H], feed_n [B], expo [B, K, V] (or [B, K, 1] when greedy), temperature [B]
                h = head(self._last_feature(feed_feats, feed_n))[:, 0, :K]  # [B, K, H]
                drafts, q = self._pick(head.logits(h), params, expo, temperature)  # [B, K], [B, K, V]
                return drafts if params.greedy else (drafts, q)

            fns[key] = self.sg._compiled("medusa_chain", medusa_chain_fn, weights=(self.head,))
        return fns[key]

    def propose_tree(self, B, L, root, active):
        spec = self.sg.tree
        N, D = spec.num_nodes, spec.max_depth
        f = self.feed
        tokens = self._tree_fn(B)(f["feats"], f["n"], root)
        return tokens, spec.parents.to(L.device).expand(B, N), (N, spec.children.shape[1], D), [N - 1] * B

    def _tree_fn(self, B):
        key = ("medusa_tree", B)
        fns = self.sg._fns
        if key not in fns:
            head, spec = self.head, self.sg.tree
            D, R = spec.max_depth, max(self.sg.tree_rank) + 1
            head_of = (spec.depth[1:] - 1).tolist()  # node i >= 1 takes head depth(i) - 1 ...
            rank_of = self.sg.tree_rank[1:]  # ... its rank-r token

            def medusa_tree_fn(feed_feats, feed_n, root):
                # feed_feats [B, F, H], feed_n [B], root [B] -> tree tokens [B, N]
                h = head(self._last_feature(feed_feats, feed_n))[:, 0, :D]  # [B, D, H]
                top = self._ids(head.logits(h).topk(R, dim=-1).indices)  # [B, D, R]
                nodes = top[:, head_of, rank_of]  # [B, N - 1]
                return torch.cat([root.unsqueeze(1), nodes], dim=1)

            fns[key] = self.sg._compiled("medusa_tree", medusa_tree_fn, weights=(self.head,))
        return fns[key]
