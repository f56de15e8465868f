"""The planner: measure what speculation costs and gains on this machine, fit
:mod:`specgraph.perfmodel`, and recommend a chain depth γ per batch size.

``specgraph.plan(fast, prompts)`` (and ``specgraph plan MODEL``) measures, on the compiled object
``fast`` itself (the graphs it measures are the ones it later serves):

1. the cost curve t(N, B): one compiled verification round over N query tokens per row (depth
   γ = N - 1, random drafts) at each batch bucket B, median of a few timed calls after a warm-up
   call (the compile); fitted by :class:`specgraph.perfmodel.CostCurve`;
2. the draft's cost: one compiled draft-model step per B (c = t_draft / t(1, B)), or prompt
   lookup's proposal per round; other host-side drafters count as free;
3. the acceptance profile: a short greedy run of each sample prompt at a fixed depth, read from
   ``fast.stats`` (accepted and drafted row-rounds per position);
4. measured speedups: the sample prompts in batches of B rows, plain and at several fixed
   depths, tokens per second (the plain run also gives the loop's host time per round).

From these it predicts the speedup of every depth at every batch size, recommends the best
(0 = do not speculate), and reports predicted against measured speedup. ``Plan.save(dir)`` writes
``plan.json`` and ``plan.png``; ``specgraph.compile(..., num_speculative_tokens="auto",
plan=plan_or_path)`` uses the plan's costs, acceptance prior and recommended depths.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

from specgraph.adaptive import MARGIN
from specgraph.timing import call_seconds, measure_round_costs, timed_calls  # noqa: F401 - public here too
from specgraph.perfmodel import AcceptanceProfile, CostCurve, CostModel, predicted_speedup, predicted_workload_speedup

DEFAULT_GRID = (1, 2, 3, 5, 9, 17, 33, 65)  # N query tokens per row = depths 0, 1, 2, 4, ..., 64
DEFAULT_MEASURE_DEPTHS = (1, 2, 4, 8)


class Plan:
    """What :func:`plan` measured and recommends; JSON round trip via :meth:`save` / :meth:`load`.

    ``profile`` pools the sample prompts' acceptance (what ``"auto"`` starts new rows from);
    ``rows`` keeps each prompt's own (profile, new tokens): predictions for the sample workload
    served in static batches (:func:`~specgraph.perfmodel.predicted_workload_speedup`, slowest row
    first) use them, and the recommendation is the depth that serves that workload fastest."""

    def __init__(self, cost: CostModel, profile: AcceptanceProfile, recommended: dict[int, int],
                 predicted: dict[int, dict[int, float]], measured: dict[int, dict[int, float]] | None = None,
                 samples: list | None = None, meta: dict | None = None, rows=None):
        self.cost, self.profile = cost, profile
        self.rows = [(p if isinstance(p, AcceptanceProfile) else AcceptanceProfile.from_dict(p), int(n))
                     for p, n in (rows or [])]
        self.recommended = {int(b): int(g) for b, g in recommended.items()}
        self.predicted = {int(b): {int(g): float(s) for g, s in row.items()} for b, row in predicted.items()}
        self.measured = {int(b): {int(g): float(s) for g, s in row.items()} for b, row in (measured or {}).items()}
        self.samples = list(samples or [])
        self.meta = dict(meta or {})

    @classmethod
    def from_measurements(cls, cost: CostModel, profile: AcceptanceProfile, batch_sizes, depths, measured=None,
                          samples=None, meta=None, rows=None) -> "Plan":
        """Fit-side of :func:`plan`: recommend over ``depths`` (and 0) and tabulate predictions."""
        depths = sorted({0, *(int(d) for d in depths)})
        p = cls(cost, profile, {}, {}, measured, samples, meta, rows)
        for b in batch_sizes:
            s = {g: p.speedup(g, b) for g in depths}
            # a depth predicted less than auto's MARGIN faster than plain is not recommended: it
            # costs graphs and, within the fit's error, may be slower
            best = max(depths, key=lambda g: (s[g], -g))
            p.recommended[b] = best if s[best] > 1.0 + MARGIN else 0
        shown = sorted({*depths, *(g for row in p.measured.values() for g in row)})
        p.predicted = {b: {g: p.speedup(g, b) for g in shown} for b in batch_sizes}
        return p

    def speedup(self, gamma: int, batch: int = 1) -> float:
        """Predicted speedup of depth γ at batch B: for the sample workload in static batches when
        per-prompt measurements exist, else the steady-state per-round model."""
        if self.rows:
            return predicted_workload_speedup(self.rows, self.cost, gamma, batch)
        return self.steady_speedup(gamma, batch)

    def steady_speedup(self, gamma: int, batch: int = 1) -> float:
        """The per-round model (:func:`~specgraph.perfmodel.predicted_speedup`) with the pooled
        profile: rows i.i.d., batches kept full (what ``"auto"`` optimises each round)."""
        return predicted_speedup(self.profile, self.cost, gamma, batch)

    def errors(self) -> dict[int, dict[int, float]]:
        """Relative error of the predicted speedup against each measured one: (pred - meas) / meas."""
        return {b: {g: (self.speedup(g, b) - m) / m for g, m in row.items() if m > 0} for b, row in self.measured.items()}

    def table(self) -> str:
        """A text table: per batch size, t(1, B), c, the recommended γ and its predicted speedup, and
        measured speedups where taken."""
        lines = [f"acceptance: draft rate {self.profile.draft_rate:.2f}, survival per position "
                 + " ".join(f"{s:.2f}" for s in self.profile.survival[:12])]
        lines.append(f"{'batch':>5} {'t(1,B) ms':>10} {'c':>6} {'best γ':>7} {'pred x':>7}  predicted (measured) speedup by γ")
        for b in sorted(self.predicted):
            g = self.recommended[b]
            cells = []
            for gg, s in sorted(self.predicted[b].items()):
                if gg == 0:
                    continue
                m = self.measured.get(b, {}).get(gg)
                cells.append(f"{gg}:{s:.2f}" + (f"({m:.2f})" if m is not None else ""))
            lines.append(f"{b:>5} {1e3 * self.cost.target(1, b):>10.2f} {self.cost.draft_ratio(b):>6.3f} {g:>7} "
                         f"{self.speedup(g, b):>6.2f}x  " + " ".join(cells))
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "format": "specgraph-plan", "version": 1, "meta": self.meta, "cost": self.cost.to_dict(),
            "profile": self.profile.to_dict(), "recommended": {str(b): g for b, g in self.recommended.items()},
            "predicted": {str(b): {str(g): s for g, s in row.items()} for b, row in self.predicted.items()},
            "measured": {str(b): {str(g): s for g, s in row.items()} for b, row in self.measured.items()},
            "errors": {str(b): {str(g): e for g, e in row.items()} for b, row in self.errors().items()},
            "rows": [{"profile": p.to_dict(), "new_tokens": n} for p, n in self.rows],
            "samples": self.samples,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        if d.get("format") != "specgraph-plan":
            raise ValueError("not a specgraph plan (format field missing or different)")
        return cls(CostModel.from_dict(d["cost"]), AcceptanceProfile.from_dict(d["profile"]),
                   {int(b): g for b, g in d["recommended"].items()},
                   {int(b): {int(g): s for g, s in row.items()} for b, row in d["predicted"].items()},
                   {int(b): {int(g): s for g, s in row.items()} for b, row in d.get("measured", {}).items()},
                   d.get("samples"), d.get("meta"), [(r["profile"], r["new_tokens"]) for r in d.get("rows", [])])

    def save(self, out_dir, plot: bool = True) -> dict[str, Path | None]:
        """Write ``plan.json`` and (when matplotlib is installed) ``plan.png`` into ``out_dir``."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "plan.json").write_text(json.dumps(self.to_dict(), indent=1))
        png = plot_plan(self, out / "plan.png") if plot else None
        return {"json": out / "plan.json", "png": png}

    @classmethod
    def load(cls, path) -> "Plan":
        p = Path(path)
        if p.is_dir():
            p = p / "plan.json"
        return cls.from_dict(json.loads(p.read_text()))


def as_plan(plan):
    """``plan=`` as :func:`specgraph.compile` takes it: None, a :class:`Plan`, or a path to its JSON
    (or the directory holding ``plan.json``)."""
    if plan is None or isinstance(plan, Plan):
        return plan
    if isinstance(plan, (str, Path)):
        return Plan.load(plan)
    raise TypeError(f"plan must be a specgraph.planner.Plan or the path of its JSON, got {type(plan).__name__}")


def plot_plan(p: Plan, path) -> Path | None:
    """Predicted (lines) and measured (markers) speedup against γ, one colour per batch size. Returns
    None, with a message on stderr, when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("specgraph plan: matplotlib is not installed, so no PNG was written "
              "(pip install 'specgraph[plot]'); plan.json has every number", file=sys.stderr)
        return None
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    top = max(g for row in p.predicted.values() for g in row)
    gammas = list(range(0, max(top, 1) + 1))
    for i, b in enumerate(sorted(p.predicted)):
        color = f"C{i % 10}"
        ax.plot(gammas, [p.speedup(g, b) for g in gammas], color=color, label=f"B={b} predicted")
        if b in p.measured:
            row = sorted(p.measured[b].items())
            ax.plot([g for g, _ in row], [s for _, s in row], "o", color=color, label=f"B={b} measured")
        g = p.recommended[b]
        ax.plot([g], [p.speedup(g, b)], "*", color=color, markersize=12)
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xscale("symlog", base=2, linthresh=1)
    ax.set_xlabel("drafted tokens per round γ (star: recommended)")
    ax.set_ylabel("speedup over plain decoding")
    title = p.meta.get("title") or "specgraph plan"
    ax.set_title(title)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


# ----------------------------------------------------------------------------------------------
# measuring


def _say(progress, msg):
    if progress:
        print(f"[plan] {msg}", file=sys.stderr, flush=True)


def _rows(prompts) -> list[list[int]]:
    if isinstance(prompts, torch.Tensor):
        prompts = list(prompts)
    rows = [p.flatten().tolist() if isinstance(p, torch.Tensor) else [int(t) for t in p] for p in prompts]
    if not rows or not all(rows):
        raise ValueError("plan needs at least one non-empty prompt (token ids)")
    return rows


def left_pad(rows, pad):
    """rows of token ids -> (ids [B, T] left-padded with ``pad``, attention_mask [B, T])."""
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, T - len(r):] = torch.tensor(r)
        mask[b, T - len(r):] = 1
    return ids, mask


@torch.no_grad()
def measure_draft_costs(fast, batch_sizes, context: int, repeats: int = 5, progress=True) -> tuple[dict, dict]:
    """({B: seconds of one draft-model step}, {B: seconds of one prompt-lookup proposal})."""
    from specgraph.compiler import attend_width
    from specgraph.proposers.ngram import NGRAM_MAX, NGRAM_MIN
    from specgraph.lookup import ngram_propose
    from specgraph.warping import SamplingParams

    device = next(fast.model.parameters()).device
    V = fast.model.get_output_embeddings().out_features
    width = attend_width(context + fast.span, fast.slots, fast.min_attend, fast.width_step)
    step, per_round = {}, {}
    g = torch.Generator().manual_seed(1)
    for B in batch_sizes:
        if fast.draft == "model":
            fn = fast.draft_graph(B, 1, SamplingParams(0.0), width)
            kv = fast.kv_cache(B, "draft")
            tok = torch.randint(V, (B, 1), generator=g).to(device)
            last = torch.full((B,), context, dtype=torch.long, device=device)
            active = torch.ones(B, dtype=torch.bool, device=device)
            expo = torch.ones(B, 1, device=device)
            first, times = timed_calls(lambda: fn(tok, last, active, expo, *kv), device, repeats)
            step[B] = statistics.median(times)
            _say(progress, f"draft step B={B}: {1e3 * step[B]:.2f} ms (first call {first:.1f} s)")
        elif fast.draft == "ngram":
            hist = torch.randint(V, (B, fast.slots), generator=g).to(device)
            lens = torch.full((B,), context + 1, dtype=torch.long, device=device)
            active = torch.ones(B, dtype=torch.bool, device=device)

            def propose():
                drafts, matched = ngram_propose(hist, lens, max(fast.k, 1), NGRAM_MAX, NGRAM_MIN)
                return bool((matched * active).any())  # the proposal's host sync, as in a round

            _, times = timed_calls(propose, device, repeats)
            per_round[B] = statistics.median(times)
            _say(progress, f"prompt-lookup proposal B={B}: {1e3 * per_round[B]:.2f} ms")
    return step, per_round


def _token_kwargs(eos_token_id, pad_token_id) -> dict:
    """The EOS / pad arguments for generate, None meaning the model's own (passed explicitly, None
    would switch EOS off, as in transformers)."""
    return {k: v for k, v in (("eos_token_id", eos_token_id), ("pad_token_id", pad_token_id)) if v is not None}


@torch.no_grad()
def measure_acceptance(fast, rows, depth: int, max_new_tokens: int, eos_token_id=None, pad_token_id=None,
                       progress=True) -> tuple[AcceptanceProfile, list]:
    """Each prompt alone, greedy, at a fixed depth: survival per position from ``fast.stats``,
    pooled over the prompts, and per prompt (with its number of new tokens)."""
    from specgraph.adaptive import forced_depth

    acc, drafted, row_rounds, per_prompt = [], [], 0, []
    for i, r in enumerate(rows):
        ids = torch.tensor([r], device=next(fast.model.parameters()).device)
        with forced_depth(fast, depth):
            fast.generate(ids, max_new_tokens=max_new_tokens, **_token_kwargs(eos_token_id, pad_token_id))
        st = fast.stats
        for lst, new in ((acc, st.accepted_at), (drafted, st.drafted_at)):
            lst.extend([0] * (len(new) - len(lst)))
            for j, v in enumerate(new):
                lst[j] += v
        row_rounds += st.row_rounds
        per_prompt.append((AcceptanceProfile.from_counts(st.accepted_at, st.drafted_at, st.row_rounds), st.emitted))
        _say(progress, f"acceptance {i + 1}/{len(rows)} at depth {depth}: {st.mean_emitted:.2f} tokens per round")
    return AcceptanceProfile.from_counts(acc, drafted, row_rounds), per_prompt


@torch.no_grad()
def measure_speedups(fast, rows, batch_sizes, depths, max_new_tokens: int, runs: int = 1, eos_token_id=None,
                     pad_token_id=None, progress=True) -> tuple[dict, dict]:
    """({B: {γ: tokens/s at γ over tokens/s plain}}, {B: seconds per plain round}). At batch B the
    prompts run as consecutive batches of B rows (cycled to fill the last one, and to fill B when
    there are fewer prompts), so every B sees every prompt, like the acceptance run; each depth is
    warmed up once (compiles), then the median of ``runs`` over the whole set."""
    from specgraph.adaptive import forced_depth

    device = next(fast.model.parameters()).device
    pad = pad_token_id if pad_token_id is not None else 0
    speed, plain_round = {}, {}
    for B in batch_sizes:
        n_batches = -(-len(rows) // B)
        batches = []
        for i in range(n_batches):
            ids, mask = left_pad([rows[(i * B + j) % len(rows)] for j in range(B)], pad)
            batches.append((ids.to(device), mask.to(device)))
        tps, ref = {}, None
        for g in [0, *depths]:
            def run():
                outs, tokens, rounds = [], 0, 0
                with forced_depth(fast, g):
                    for ids, mask in batches:
                        outs.append(fast.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                                  **_token_kwargs(eos_token_id, pad)))
                        tokens, rounds = tokens + fast.stats.emitted, rounds + fast.stats.rounds
                return outs, tokens, rounds
            run()  # warm-up: compiles this depth's graphs
            vals, per_round = [], []
            for _ in range(runs):
                t0 = time.perf_counter()
                outs, tokens, rounds = run()
                dt = time.perf_counter() - t0
                vals.append(tokens / dt)
                per_round.append(dt / max(rounds, 1))
            tps[g] = statistics.median(vals)
            if g == 0:
                ref, plain_round[B] = outs, statistics.median(per_round)
            elif not all(torch.equal(a, b) for a, b in zip(outs, ref)):
                raise AssertionError(f"greedy output at depth {g} differs from plain decoding (batch {B}): a bug")
            _say(progress, f"measured B={B} γ={g}: {tps[g]:.1f} tokens/s, {tokens / max(rounds, 1) / B:.2f} "
                           "tokens per row per round")
        speed[B] = {g: tps[g] / tps[0] for g in depths}
    return speed, plain_round


def measure_cost_model(fast, batch_sizes, grid, context: int, repeats: int = 5, progress=True) -> tuple[CostModel, list]:
    """The cost side of :func:`plan` alone: t(N, B) fitted from compiled rounds plus the draft's
    costs, as a :class:`~specgraph.perfmodel.CostModel` (no loop overhead: that needs end-to-end
    runs), and the raw (B, N, seconds) samples. Enough for ``"auto"``, which learns acceptance
    online: ``fast.policy.cost = measure_cost_model(fast, ...)[0]``."""
    samples = measure_round_costs(fast, batch_sizes, grid, context, repeats, progress)
    draft_step, draft_round = measure_draft_costs(fast, batch_sizes, context, repeats, progress) \
        if fast.draft is not None else ({}, {})
    return CostModel(CostCurve.fit(samples), draft_step, draft_round), samples


def plan(fast, prompts, *, batch_sizes=None, grid=DEFAULT_GRID, max_new_tokens: int = 48, repeats: int = 5,
         measure_depths=DEFAULT_MEASURE_DEPTHS, measure_batch_sizes=(1,), profile_depth: int | None = None,
         runs: int = 1, eos_token_id=None, pad_token_id=None, progress=True, meta: dict | None = None,
         measure_recommended: bool = True) -> Plan:
    """Measure, fit and recommend (module docstring). ``fast``: a compiled chain object (``"ngram"``,
    ``"suffix"``, a draft model, a ChainDrafter; ``None``: costs only). ``prompts``: token-id lists
    (or 1-D tensors). ``batch_sizes``: where t(N, B) is measured (default: the object's buckets up
    to 8); ``grid``: the N values; ``measure_depths`` / ``measure_batch_sizes``: where speedup is
    also measured end to end; ``profile_depth``: the depth of the acceptance run (default: the
    largest measured depth); ``measure_recommended``: also measure, at each of
    ``measure_batch_sizes``, the depth the fit recommends when it is not among ``measure_depths``
    (the prediction that matters is the one at the recommended depth). Progress goes to stderr."""
    from specgraph.adaptive import AUTO_DRAFTS, bucket_sizes

    if fast.tree is not None or fast.learned is not None or (fast.draft is not None and fast.draft not in AUTO_DRAFTS):
        raise ValueError(f"plan measures chain drafters ({', '.join(AUTO_DRAFTS)}) or none, got draft={fast.draft!r}"
                         + (" with a tree" if fast.tree is not None else ""))
    rows = _rows(prompts)
    grid = sorted({int(n) for n in grid})
    if grid[0] < 1:
        raise ValueError(f"grid values are query tokens per row (>= 1), got {grid}")
    if 1 not in grid:
        grid = [1, *grid]  # t(1, B), plain decoding, is every speedup's baseline
    batch_sizes = sorted({int(b) for b in (batch_sizes or [b for b in bucket_sizes(fast.max_batch_size) if b <= 8])})
    if batch_sizes[-1] > fast.max_batch_size:
        raise ValueError(f"batch size {batch_sizes[-1]} exceeds the object's max_batch_size={fast.max_batch_size}")
    measure_batch_sizes = sorted({int(b) for b in measure_batch_sizes if b <= fast.max_batch_size})
    speculative = fast.draft is not None
    measure_depths = sorted({int(d) for d in measure_depths if d > 0}) if speculative else []
    context = max(len(r) for r in rows) + max_new_tokens // 2  # a typical committed length mid-generation
    if context + max(grid) + max_new_tokens // 2 + 1 > fast.max_seq_len:
        raise ValueError(f"grid up to N={max(grid)} with prompts of {max(len(r) for r in rows)} tokens and "
                         f"max_new_tokens={max_new_tokens} does not fit max_seq_len={fast.max_seq_len}")
    t_start = time.perf_counter()
    _say(progress, f"measuring t(N, B) for N in {grid}, B in {batch_sizes} ({len(grid) * len(batch_sizes)} graphs, "
                   "each compiled on first use)")
    base, samples = measure_cost_model(fast, batch_sizes, grid, context, repeats, progress)
    if speculative:
        pdepth = profile_depth or max(measure_depths or [max(grid) - 1])
        profile, per_prompt = measure_acceptance(fast, rows, pdepth, max_new_tokens, eos_token_id, pad_token_id,
                                                 progress)
    else:
        profile, per_prompt = AcceptanceProfile([0.0], 0.0), []
    measured, plain_round = ({}, {})
    if measure_batch_sizes and speculative:
        measured, plain_round = measure_speedups(fast, rows, measure_batch_sizes, measure_depths, max_new_tokens, runs,
                                                 eos_token_id, pad_token_id, progress)
    # the loop's own host time per round: the plain runs' wall time per round minus the graph's
    overhead = {b: max(0.0, plain_round[b] - base.target(1, b)) for b in plain_round}
    cost = CostModel(base.target, base.draft_step, base.draft_round, overhead)
    info = {
        "model": type(fast.model).__name__, "params": sum(p.numel() for p in fast.model.parameters()),
        "draft": fast.draft, "backend": fast.backend, "device": str(next(fast.model.parameters()).device),
        "torch": torch.__version__, "threads": torch.get_num_threads(), "grid": grid, "batch_sizes": batch_sizes,
        "repeats": repeats, "context": context, "max_new_tokens": max_new_tokens, "prompts": len(rows),
        "measure_depths": measure_depths, "measure_batch_sizes": measure_batch_sizes,
        "seconds": time.perf_counter() - t_start, **(meta or {}),
    }
    depths = range(0, max(grid)) if speculative else [0]  # γ + 1 <= the largest measured N: no extrapolation

    def fit() -> Plan:
        return Plan.from_measurements(cost, profile, batch_sizes, depths, measured, [list(s) for s in samples], info,
                                      per_prompt)

    p = fit()
    extra = _measure_recommended(fast, p, rows, max_new_tokens, runs, eos_token_id, pad_token_id, progress) \
        if measure_recommended else {}
    if extra:  # refit: the measured speedups are part of the plan (its table, plot and errors)
        for b, row in extra.items():
            measured[b].update(row)
        info["measure_recommended"] = {b: sorted(row) for b, row in extra.items()}
        info["seconds"] = time.perf_counter() - t_start
        p = fit()
    return p


def _measure_recommended(fast, p: Plan, rows, max_new_tokens, runs, eos_token_id, pad_token_id, progress) -> dict:
    """{B: {γ: measured speedup}} for each end-to-end batch size B whose recommended γ > 0 was not
    measured yet; each is timed against its own plain runs, like the others."""
    out = {}
    for b, row in p.measured.items():
        g = p.recommended.get(b, 0)
        if g > 0 and g not in row:
            _say(progress, f"measuring the recommended depth γ={g} at B={b}")
            out[b] = measure_speedups(fast, rows, [b], [g], max_new_tokens, runs, eos_token_id, pad_token_id,
                                      progress)[0][b]
    return out
