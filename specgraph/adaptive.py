"""``num_speculative_tokens="auto"``: the chain depth chosen each round from a running estimate of
acceptance and a cost model.

The compiled object holds one graph per depth in a small fixed set (0, a plain step, plus e.g.
2, 4, 8, or the depths a plan recommends): a round only ever picks one of them, so nothing is
compiled at run time beyond what a fixed-depth object would compile on first use.

Per sequence (row) the policy keeps an EWMA of the acceptance of the draft at each position given
the ones before it were accepted, read from the per-row emitted counts the generation loop fetches
anyway (no extra host sync). Positions a row has not been observed at borrow the estimate of the
position before (a geometric extrapolation), and a new row starts from a prior (the plan's
first-position acceptance, else 0.5) whose weight decays with each observation like the
observations' own. Later calls on the same object start new rows from what earlier calls saw
instead: the rows' counts are pooled per position at the end of each call into a memory whose
weight halves with every call, and while it holds at least one observation at a position its
acceptance there is the new rows' prior (a serving object learns its workload's acceptance once,
not once per request: relearning it costs a sizeable share of a short call's rounds). The
memory pools each call's whole counts (not the rows' EWMA, which weighs a call's last rounds), at
most ``CALL_OBS`` per position and call (a call is one sample of the workload, whatever its batch
size), and in a row's estimate it keeps the weight of up to ``pool_weight`` observations however
many the row has made: a row's EWMA holds ~6, too few to place an acceptance near the break-even
one on the right side (at B = 1 and 30% acceptance, where depth 2 pays from ~17%, three
rejections in a row would switch speculation off, and probes backing off to every 64 rounds rarely
switch it back on). How much more than that the memory, and the
batch's other rows, count for in a row's estimate is read off past calls as in a beta-binomial
model (up to ``POOL_MAX`` observations): the memory as much as it predicted each next call's
acceptance (a workload that changes from call to call keeps it at ``pool_weight``), the other rows
as much as rows of one call were seen to accept alike. Prompts that differ keep each row to its
own counts and the memory's ``pool_weight``; rows drawn from one acceptance (e.g. B = 4 rows at
60%) stop a single round that rejected every row's first draft from reading
as 32% and switching a call off.
Each round, the depth d minimising the predicted seconds until the batch is done

    E[max over live rows of the rounds to emit what ``max_new_tokens`` leaves the row](d) x round_cost(d, B)

(the last round priced as a plain one; :meth:`AutoDepth.finish_rounds`; without budgets, the one
maximising Σ_rows E_row[emitted](d) / round_cost(d, B)) over the set is chosen for the whole batch
(one graph per round), where round_cost is the plan's measured cost curve plus the
draft's cost (:class:`specgraph.perfmodel.CostModel`), or a conservative built-in curve
(:class:`specgraph.perfmodel.LinearCost`) when no plan is given, corrected by what rounds really
cost in the loop: every round's wall time (one choice to the next: drafting, the graph, the host
sync and the bookkeeping; not a round that compiled or loaded a graph) is kept per (batch bucket,
depth) as a ratio to the curve, a drafted round's divided by that of the plain rounds run nearest
it, and from the next call on plain rounds cost the curve times their median ratio and a drafted
depth that times its median relative ratio (a depth not yet timed borrows the nearest timed drafted
depth's, else none). Only costs relative to plain decoding decide a round, and a shared host's speed
can drift 2x within minutes: a few probes that run in slow stretches, compared with plain rounds
from quiet ones, price a cheap depth out. So a drafted round is timed only when a plain round of
the same call ran within
``COST_NEAR`` rounds of it, and a drafted depth never costs less than a plain round. While auto drafts
round after round and the choice is close, it re-checks those costs now and then (one plain round,
then one at the runner-up depth; :meth:`AutoDepth._recheck`), on a doubling schedule like the
probes'. Graph calls timed in isolation miss the drafting and the loop around them (a drafted round
can cost a plain step in isolation and clearly more in the loop), so priced from them "auto" would
draft where plain decoding wins. So that drafted rounds are compared with plain
rounds timed alike, the first ``COST_MIN_PLAIN`` rounds at a batch bucket are plain. A depth must
beat plain decoding by ``margin`` to be chosen. While speculation is off nothing is observed, so the
policy re-probes: after ``probe_every`` plain rounds it runs one round at the smallest depth (but
first at each drafted depth neither timed at the bucket nor run in the call, so each depth's in-loop
cost is read once before it is priced: :meth:`AutoDepth._probe_depth`), doubling the wait after each
probe that does not switch speculation back on (up to ``probe_max``, and to no more than keeps the
probes' predicted cost under ``PROBE_BUDGET`` of the time: a probe of a draft just short of paying
is nearly free) and resetting it once it does; the schedule carries
over from one call to the next at the same batch bucket. No probe runs in a round where no row has
more than one token left (it would emit nothing more than a plain round). Within a call the choices
are a pure function of the observed counts and of the state at the call's start (the round times
are folded in only between calls): the same seed on an object in the same state (a new one, or
after :meth:`AutoDepth.forget`) gives the same sequence of depths. With ``learn_cost=False`` the
times are not used at all.

The depth is a function of the past only, and every round samples the target's next tokens
exactly whatever its depth, so the output law (and greedy output) is unchanged.
"""
from __future__ import annotations

import contextlib
import time

import numpy as np
import torch

from specgraph.perfmodel import AcceptanceProfile, CostModel, LinearCost

DEFAULT_DEPTHS = (2, 4, 8)
PRIOR_ACCEPT = 0.5  # first-position acceptance assumed for a new row without a plan
PRIOR_WEIGHT = 2.0  # the prior counts as this many observations
HALFLIFE = 4.0  # an observation's weight halves after this many newer ones at that position
MEMORY_KEEP = 0.5  # the weight the pooled memory keeps with each later call
CALL_OBS = 16.0  # the most observations one call adds to the memory at a position
POOL_WEIGHT = 4.0  # observations the pooled memory counts as in a row's estimate at least (it does not fade)
POOL_MAX = 32.0  # the most the memory and the batch's other rows count as, when calls and rows accepted alike
PROBE_EVERY = 8  # plain rounds before the first re-probe
PROBE_MAX = 64  # the longest wait between re-probes
PROBE_BUDGET = 0.01  # the predicted share of plain decoding's time re-probes may cost
MARGIN = 0.02  # a depth must be predicted >= 2% faster than plain decoding
COST_KEEP = 16  # the latest timed rounds kept per (batch bucket, depth)
COST_MIN_PLAIN = 3  # plain rounds timed at a batch bucket before drafted ones are judged against them
COST_NEIGHBOURS = 4  # plain rounds, nearest in the call, a drafted round's time is taken relative to
COST_NEAR = 4  # a drafted round is timed only if a plain round of its call ran at most this many rounds away
RECHECK_FIRST = 16  # drafted rounds without a plain one before the first cost re-check at a batch bucket
RECHECK_BAND = 0.5  # re-check only while the runner-up's predicted rate is within this fraction of the best's
AUTO_DRAFTS = ("ngram", "suffix", "model", "custom")


def _beta_binomial_weight(num: float, den: float) -> float | None:
    """1 / rho - 1 in [0, POOL_MAX] for the correlation rho = num / den of two draws of one row (or
    call) read off squared deviations beyond binomial ones (None: no such pair drawn yet)."""
    if den <= 0.0:
        return None
    rho = max(num / den, 1.0 / (POOL_MAX + 1.0))
    return float(np.clip(1.0 / rho - 1.0, 0.0, POOL_MAX))


class DepthPolicy:
    """Chooses each round's chain depth; the generation loop calls :meth:`start` once per
    ``generate`` call, :meth:`choose` before each round and :meth:`observe` after its host sync.

    For draft models it also keeps the draft's KV cache complete across plain rounds (the draft
    is not run then): before a drafted round it feeds the draft the committed tokens it missed."""

    def __init__(self):
        self.trace: list[int] = []  # the depth chosen for each round of the last call
        self.round_times: list[tuple[int, float]] = []  # (depth run, seconds) per timed round of the last call
        self.clock = time.perf_counter
        self._t_prev = self._k_prev = self._graphs_prev = None

    # generation-loop hooks --------------------------------------------------------------------

    def start(self, fast, rows, batch: int, device) -> None:
        self.fast, self.batch, self.n_rows, self.device = fast, batch, len(rows), device
        self.trace = []
        # last position each row's draft-model cache holds correctly: the prompt prefill writes all
        # prompt tokens but the last (the first root)
        self._draft_valid = [len(r) - 2 for r in rows] if fast.draft == "model" else None
        self._reset(len(rows), batch)
        self.round_times, self._t_prev, self._k_prev, self._graphs_prev = [], None, None, None

    def choose(self, done: list[bool], L_host: list[int], hist: torch.Tensor, left: list[int] | None = None) -> int:
        """This round's depth. ``left``: tokens each row may still emit (``max_new_tokens`` minus
        those emitted; None: unbounded)."""
        # a round runs from one choice to the next: the choice itself, any draft catch-up, the
        # drafting, the graph, the host sync and the loop's bookkeeping (the last round is not timed).
        # A round that built or loaded a graph (a new attended width, say) is not timed either: its
        # seconds are the compile's (a frozen graph can take minutes to compile on a CPU, and a
        # few such rounds among a bucket's kept times would price a depth out for good)
        now, graphs = self.clock(), self._graph_count()
        if self._k_prev is not None and graphs == self._graphs_prev:
            self.round_times.append((self._k_prev, now - self._t_prev))
        self._t_prev, self._k_prev, self._graphs_prev = now, None, graphs
        live = [not d for d in done[: self.n_rows]]
        left = None if left is None else np.maximum(1, np.asarray(left[: self.n_rows], dtype=np.int64))
        k = self._decide(live, left) if any(live) else 0
        self.trace.append(k)
        if k > 0 and self._draft_valid is not None:
            self._draft_catch_up(live, L_host, hist)
        return k

    def observe(self, k, n_emitted: list[int], done: list[bool], L_host: list[int]) -> None:
        """After a round at depth ``k`` (per-row drafted counts for trees: ignored) in which row b
        emitted ``n_emitted[b]`` tokens (accepted + 1), with ``L_host`` the rows' root positions
        before the round."""
        self._k_prev = None if isinstance(k, list) else int(k)  # the depth that ran (prompt lookup may not match)
        if isinstance(k, list) or k <= 0:
            return
        live = [not d for d in done[: self.n_rows]]
        if self._draft_valid is not None:
            # the draft fed the root's predecessor, the root and drafts 1..k-1: positions up to
            # L + min(accepted, k - 1) now hold the right tokens
            for b in range(self.n_rows):
                if live[b]:
                    self._draft_valid[b] = L_host[b] + min(n_emitted[b] - 1, k - 1)
        self._update(k, n_emitted[: self.n_rows], live)

    def _graph_count(self) -> int:
        """How many graphs the compiled object holds (built on first use, or loaded from a
        compiled directory): it grows in the rounds that paid for a compile or a load. Eager
        objects build plain functions, which cost nothing: 0."""
        if getattr(self.fast, "backend", None) == "eager":
            return 0
        return len(getattr(self.fast, "_fns", ())) + len(getattr(self.fast, "graphs_built", ()))

    # subclass hooks ---------------------------------------------------------------------------

    def _reset(self, n_rows: int, batch: int) -> None:
        pass

    def _decide(self, live: list[bool], left: np.ndarray | None = None) -> int:
        """The depth of this round; ``left``: [rows] tokens each row may still emit (None: unbounded)."""
        raise NotImplementedError

    def _update(self, k: int, n_emitted: list[int], live: list[bool]) -> None:
        pass

    # ------------------------------------------------------------------------------------------

    def _draft_catch_up(self, live, L_host, hist) -> None:
        """A drafted round feeds the draft the tokens at positions L-1 and L; every position before
        L-1 must already be in its cache. After plain rounds some are not: write them with one
        eager step of the draft (like the prompt prefill), then the round proceeds as usual."""
        from specgraph.rounds import prefill_logits

        fast = self.fast
        gaps = [(b, self._draft_valid[b] + 1, L_host[b] - 2) for b in range(self.n_rows)
                if live[b] and self._draft_valid[b] < L_host[b] - 2]
        if not gaps:
            return
        P = max(hi - lo + 1 for _, lo, hi in gaps)
        pos = torch.zeros(self.batch, P, dtype=torch.long)
        valid = torch.zeros(self.batch, P, dtype=torch.bool)
        for b, lo, hi in gaps:
            pos[b, : hi - lo + 1] = torch.arange(lo, hi + 1)
            valid[b, : hi - lo + 1] = True
            self._draft_valid[b] = hi
        pos, valid = pos.to(hist.device), valid.to(hist.device)
        ids = hist.gather(1, pos)  # hist holds every committed token up to the root
        prefill_logits(fast._eager_draft_step, ids, pos, valid, fast.kv_cache(self.batch, "draft"), fast.slots,
                       fast.draft_window)


class FixedDepth(DepthPolicy):
    """Every round at one depth (0 = plain decoding): the planner's and the benchmark's baseline,
    run on the same compiled object (and graphs) as ``"auto"``."""

    def __init__(self, depth: int):
        super().__init__()
        if depth < 0:
            raise ValueError(f"depth must be >= 0, got {depth}")
        self.depth = int(depth)

    def _decide(self, live, left=None):
        return self.depth


class AutoDepth(DepthPolicy):
    """The ``"auto"`` policy (module docstring). ``depths``: the positive precompiled depths;
    ``cost``: a :class:`~specgraph.perfmodel.CostModel`; ``prior``: an acceptance profile whose
    first-position acceptance (times its draft rate) new rows start from."""

    def __init__(self, depths, cost: CostModel, prior: AcceptanceProfile | None = None, *, halflife: float = HALFLIFE,
                 prior_weight: float = PRIOR_WEIGHT, probe_every: int = PROBE_EVERY, probe_max: int = PROBE_MAX,
                 margin: float = MARGIN, learn_cost: bool = True, pool_weight: float = POOL_WEIGHT):
        super().__init__()
        pos = sorted({int(d) for d in depths if int(d) > 0})
        if not pos:
            raise ValueError(f"auto needs at least one positive depth, got {list(depths)}")
        if probe_every < 1 or probe_max < probe_every or halflife <= 0 or prior_weight <= 0 or pool_weight < 0:
            raise ValueError("need probe_max >= probe_every >= 1, halflife > 0, prior_weight > 0 and pool_weight >= 0")
        self.depths = [0, *pos]
        self.cost = cost
        self.prior = PRIOR_ACCEPT if prior is None else prior.conditional(1) * prior.draft_rate
        self.decay = 0.5 ** (1.0 / halflife)
        self.prior_weight, self.probe_every, self.probe_max, self.margin = prior_weight, probe_every, probe_max, margin
        self.pool_weight = pool_weight
        self.learn_cost = learn_cost
        self.forget()

    def forget(self) -> None:
        """Drop what earlier calls observed (acceptance and round times): the next call's rows
        start from the static prior and its costs from the cost model."""
        K = self.depths[-1]
        self.mem_acc, self.mem_cnt = np.zeros(K), np.zeros(K)  # pooled counts per position, halved per call
        self.acc, self.cnt = np.zeros((0, K)), np.zeros((0, K))
        self.row_acc, self.row_cnt = np.zeros((0, K)), np.zeros((0, K))  # this call's counts per row, undecayed
        self.spread = np.zeros(2)  # rows' excess spread, its binomial scale: summed over calls, halved per call
        self.drift = np.zeros(2)  # the same for calls' acceptance around what the memory predicted
        self.timed: dict[int, dict[int, list[float]]] = {}  # batch -> depth -> latest (seconds / modelled cost)
        self.probe_state: dict[int, tuple[int, int]] = {}  # batch -> (plain rounds since the last probe, wait)
        self.recheck_state: dict[int, tuple[int, int]] = {}  # batch -> (drafted rounds since a plain one, wait)
        self.round_times, self.last_batch = [], None  # the bucket the last call (its times, its schedule) ran at

    def _reset(self, n_rows, batch):
        K = self.depths[-1]
        # fold the previous call's counts into the memory (rows that never drafted add nothing). Its
        # whole counts, not the rows' EWMA: those weigh a call's last ~6 rounds, and a call that ends
        # on a rejecting stretch would read as the workload's acceptance (a draft accepting 30% can
        # pool to ~10% and keep auto off where depth 2 pays). At most
        # CALL_OBS of them per position: a call is one sample of the workload whatever its batch, and
        # counted whole a B = 4 call drafting depth 4 (~50 observations) outweighs the later B = 2
        # calls mostly plain (2 per probe) for several calls after the workload changes
        seen_acc, seen_cnt = self.row_acc.sum(axis=0), self.row_cnt.sum(axis=0)
        self.drift = MEMORY_KEEP * self.drift + self._call_drift(seen_acc, seen_cnt)
        scale = np.minimum(1.0, CALL_OBS / np.maximum(seen_cnt, 1.0))
        self.mem_acc = MEMORY_KEEP * self.mem_acc + scale * seen_acc
        self.mem_cnt = MEMORY_KEEP * self.mem_cnt + scale * seen_cnt
        self.spread = MEMORY_KEEP * self.spread + self._row_spread()
        self._fold_round_times()
        if self.last_batch is not None:
            self.probe_state[self.last_batch] = (self.off_rounds, self.wait)
            self.recheck_state[self.last_batch] = (self.on_rounds, self.recheck_wait)
        self.acc = np.zeros((n_rows, K))  # decayed count of accepted drafts at each position
        self.cnt = np.zeros((n_rows, K))  # decayed count of drafts that reached each position
        self.row_acc, self.row_cnt = np.zeros((n_rows, K)), np.zeros((n_rows, K))
        # one round's cost at each depth for this batch bucket (the padded rows run too)
        self.last_batch = batch
        self.model_cost = np.array([self.cost.round_cost(d, batch) for d in self.depths])
        # a drafted round does a plain one's work and more: learned factors that price a drafted
        # depth below plain decoding (timing noise) would have auto draft a useless draft for good.
        # Drafted depths are not clamped to each other: on a CPU a GEMM over more rows can be faster
        # (N = 5 rounds cheaper than N = 3 ones, in the curve and in the loop), and pricing depth 4
        # at depth 2's cost would keep auto plain where depth 4 pays
        costs = self.model_cost * self.cost_factors(batch)
        self.round_cost = np.maximum(costs, costs[0])
        # the re-probe schedule goes on where the last call at this bucket left it: restarting it
        # at probe_every each call would re-probe a draft that never pays 3-4 times per call, each
        # probe round costing ~2-4 plain steps at large batches
        self.off_rounds, self.wait = self.probe_state.get(batch, (0, self.probe_every))
        self.on_rounds, self.recheck_wait = self.recheck_state.get(batch, (0, RECHECK_FIRST))
        self.neighbour = None  # the drafted depth a cost re-check runs right after its plain round
        self.plain_timed = len(self.timed.get(batch, {}).get(0, ()))

    def _fold_round_times(self) -> None:
        """The last call's round times join the per-(batch, depth) ratios to the cost model: plain
        rounds as seconds / modelled cost, drafted rounds as that ratio divided by the one of the
        plain rounds run nearest them in the call (:data:`COST_NEIGHBOURS`), so a drafted depth's
        factor says what it costs relative to plain decoding at the same stretch of host speed. A
        drafted round with no plain round within :data:`COST_NEAR` rounds of it is not timed: against
        plain rounds from minutes before (or the bucket's median from earlier calls) a slow
        stretch of drafted rounds reads as a dear depth, prices it out, and then only probes re-time
        it (tests/test_adaptive.py simulates a host slow 2.5x in stretches)."""
        if self.last_batch is None or not self.learn_cost:
            return
        model = dict(zip(self.depths, self.model_cost))  # the curve that call ran with, from its _reset
        ratios = [(i, d, sec / model[d]) for i, (d, sec) in enumerate(self.round_times) if d in model and model[d] > 0]
        plain = [(i, r) for i, d, r in ratios if d == 0]
        per = self.timed.setdefault(self.last_batch, {})
        for i, d, r in ratios:
            if d > 0:
                near = sorted((p for p in plain if abs(p[0] - i) <= COST_NEAR), key=lambda p: (abs(p[0] - i), p[0]))
                if not near:
                    continue
                r /= float(np.median([q for _, q in near[:COST_NEIGHBOURS]]))
            per[d] = (per.get(d, []) + [r])[-COST_KEEP:]

    def cost_factors(self, batch: int) -> np.ndarray:
        """[len(depths)] measured in-loop cost / modelled cost at each depth for ``batch``: plain,
        the median of its latest timed rounds' ratios (else 1); a drafted depth, that times the
        median of its rounds' ratios relative to their neighbouring plain rounds; an untimed drafted
        depth borrows the nearest timed drafted depth's relative ratio, else none (the plain factor)."""
        per = {d: float(np.median(v)) for d, v in self.timed.get(batch, {}).items() if v}
        plain = per.get(0, 1.0)
        drafted = [d for d in per if d > 0]

        def relative(d):
            if d == 0 or not drafted:
                return 1.0
            return per[d] if d in per else per[min(drafted, key=lambda e: (abs(e - d), e))]

        return np.array([plain * relative(d) for d in self.depths])

    def acceptance(self) -> np.ndarray:
        """[rows, K] estimated acceptance of draft j + 1 given drafts 1..j were accepted."""
        # the prior's weight decays with the observations like they do: with a fixed weight, an
        # EWMA holding ~6 observations never outweighs it, and a draft accepting nothing still
        # reads as 12% acceptance (and auto keeps speculating where plain decoding wins).
        # After n observations it is prior_weight * decay**n, and cnt = (1 - decay**n) / (1 - decay)
        pw = self.prior_weight * np.clip(1.0 - (1.0 - self.decay) * self.cnt, 0.0, 1.0)
        pooled = self.pooled_acceptance()
        # what the workload accepted over earlier calls keeps its weight (pool_weight observations,
        # more as memory_weight says): a row's EWMA holds ~6, and at B = 1 and 30% acceptance it
        # alone reads below the ~17% that pays for depth 2 after any three rejections in a row
        w_mem, w_rows = self.memory_weight(), self.rows_weight()
        mem_w = np.where(np.isnan(pooled), 0.0, np.minimum(max(self.pool_weight, w_mem), self.mem_cnt))
        # and so do the batch's other rows, as far as rows_weight says rows accept alike: then a
        # row's prior is the workload's acceptance as the memory and the other rows read it
        rows_on = float(bool(w_rows))
        other_cnt = mem_w + rows_on * (self.cnt.sum(axis=0) - self.cnt)  # [rows, K]
        other_acc = mem_w * np.nan_to_num(pooled) + rows_on * (self.acc.sum(axis=0) - self.acc)
        # what that prior is worth to one row: as much as rows were seen to differ; with only
        # one-row calls seen, as much as calls were (a call is a row then)
        cap = max(self.pool_weight, w_mem if w_rows is None else w_rows)
        alpha = np.empty_like(self.acc)
        prev = np.full(self.acc.shape[0], self.prior)
        for j in range(self.acc.shape[1]):
            known = other_cnt[:, j] >= 1.0
            prior = prev if np.isnan(pooled[j]) else np.full_like(prev, pooled[j])
            prior = np.where(known, other_acc[:, j] / np.where(known, other_cnt[:, j], 1.0), prior)
            w = np.maximum(pw[:, j], np.minimum(cap, other_cnt[:, j]))
            alpha[:, j] = (self.acc[:, j] + w * prior) / (self.cnt[:, j] + w)
            prev = alpha[:, j]
        return alpha

    def rows_weight(self) -> float | None:
        """How many observations a row's estimate gives the rest of the batch and the memory
        together, as far as the rows of earlier calls accepted alike (up to :data:`POOL_MAX`; None
        until a call with several rows has drafted). As a beta-binomial: rows' acceptances spread
        around the workload's with intra-row correlation rho (estimated from calls' per-row counts,
        :meth:`_row_spread`), and a row's fair prior weight is 1 / rho - 1 observations. Judged alone,
        a row's ~6 observations read a 60% draft as 34% after three rejections, and a batch runs
        until its slowest row is done, so the least lucky of B rows' estimates would decide the
        batch."""
        return _beta_binomial_weight(*self.spread)

    def memory_weight(self) -> float:
        """How many observations the pooled memory counts as (at least ``pool_weight``, up to
        :data:`POOL_MAX`, and no more than it holds): as many as it has predicted the next call's
        acceptance well (:meth:`_call_drift`, the same beta-binomial reading across calls). A
        memory worth 4 observations is outweighed by one B = 4 round: four rejections at a 60%
        draft (2.6% of rounds) read as 32% and switch a call off for good, while a workload that
        changes from call to call needs a memory that fades."""
        w = _beta_binomial_weight(*self.drift)
        return self.pool_weight if w is None else max(self.pool_weight, w)

    def _call_drift(self, x: np.ndarray, n: np.ndarray) -> np.ndarray:
        """[2]: the last call's squared deviation from what the memory predicted at each position
        beyond what binomial draws (and the memory's own count) explain, and its scale, summed over
        positions: with x accepted of n drafts ([K] each, the call's), p the memory's acceptance over
        M observations, E[(x - n p)^2] ~ n p (1 - p) (1 + n / M) + n^2 p (1 - p) rho."""
        p, M = self.pooled_acceptance(), self.mem_cnt
        ok = ~np.isnan(p) & (n >= 1)
        p, M, n, x = p[ok], M[ok], n[ok], x[ok]
        v = p * (1.0 - p)
        ok = v > 0
        num = (x - n * p) ** 2 - n * v * (1.0 + n / np.maximum(M, 1.0))
        return np.array([num[ok].sum(), (n * n * v)[ok].sum()])

    def _row_spread(self) -> np.ndarray:
        """[2]: the last call's rows' squared deviations from the batch's acceptance beyond what
        binomial draws give, and its scale, summed over positions (their ratio estimates rho, the
        correlation of two draws of one row). Rows with x_i accepted of n_i drafts at a position,
        N = sum n_i, m = sum x_i / N: E[sum (x_i - n_i m)^2] ~ m (1 - m) sum n_i (1 - n_i / N) (1 +
        (n_i - 1) rho), summed over the rows with n_i >= 2. A one-row call says nothing: (0, 0)."""
        n, x = self.row_cnt, self.row_acc  # [rows, K]
        N = n.sum(axis=0)
        m = x.sum(axis=0) / np.maximum(N, 1.0)
        v = m * (1.0 - m)
        share = 1.0 - n / np.maximum(N, 1.0)
        # a row drafted once at a position has no spread of its own to weigh: its term is noise
        two = n >= 2
        num = (two * ((x - n * m) ** 2 - v * n * share)).sum(axis=0)
        den = v * (two * n * (n - 1.0) * share).sum(axis=0)
        ok = (N >= 2) & (v > 0)
        return np.array([num[ok].sum(), den[ok].sum()])

    def pooled_acceptance(self) -> np.ndarray:
        """[K] what earlier calls observed at each position (NaN where under one observation)."""
        known = self.mem_cnt >= 1.0
        return np.where(known, self.mem_acc / np.where(known, self.mem_cnt, 1.0), np.nan)

    def _at_depths(self, terms: np.ndarray) -> np.ndarray:
        """[rows, len(depths)]: 1 + the sum of ``terms`` ([rows, K], per draft position) over the
        positions each depth drafts."""
        cum = np.concatenate([np.zeros((terms.shape[0], 1)), np.cumsum(terms, axis=1)], axis=1)
        return 1.0 + cum[:, self.depths]

    def expected_emitted(self) -> np.ndarray:
        """[rows, len(depths)]: each row's predicted tokens emitted per round at each depth."""
        return self._at_depths(np.cumprod(self.acceptance(), axis=1))

    def finish_rounds(self, live: list[bool], left: np.ndarray) -> np.ndarray:
        """[len(depths)] expected rounds until every live row has emitted its ``left`` tokens
        ([rows]) if each depth ran to the end. A batch runs until its slowest row finishes, so with
        short calls its rounds are the expected maximum of the rows' counts, not their mean (at
        beta = 0.3, B = 16 and 24-token calls the per-round rate favours depth 2 while the slowest of
        16 rows makes the batch take more rounds, and plain decoding wins). A row's count is taken
        as normal (renewal theory): with per-round emissions x of mean mu and variance v, (left + E[x (x - 1)] / (2 mu))
        / mu rounds, at least 1, and variance (left - 1) v / mu^3; plain decoding's is exact."""
        on = np.array(live, dtype=bool)
        n = np.asarray(left, dtype=np.float64)[on][:, None]  # [R, 1]
        surv = np.cumprod(self.acceptance()[on], axis=1)  # [R, K] P(drafts 1..j accepted)
        j = np.arange(1, surv.shape[1] + 1)
        # a round emits at most what the row has left: drafts past it are accepted for nothing, and
        # with short calls that waste grows with depth (at beta = 0.9 and 24-token calls depth 4
        # would be predicted ~4 tokens per row per round where ~3 are emitted)
        surv = np.where(j < n, surv, 0.0)
        mu, ex2 = self._at_depths(surv), self._at_depths((2 * j + 1) * surv)  # [R, D] E[x], E[x^2]
        # the last round overshoots the budget by E[x (x - 1)] / (2 mu) tokens on average
        m = np.maximum((n + (ex2 - mu) / (2 * mu)) / mu, 1.0)
        # a row with one token left finishes in one round; others' counts get a floor on their spread
        sd = np.maximum(np.sqrt((n - 1) * np.maximum(ex2 - mu**2, 0.0) / mu**3), np.where(n > 1, 0.25, 1e-6))
        m, sd = m[:, 1:], sd[:, 1:]  # plain decoding's column is exact: below
        lo, hi = float((m - 4 * sd).min()), float((m + 4 * sd).max())
        t = np.linspace(lo, hi, 129)
        # E[max_b T_b] = lo + integral over [lo, hi] of P(max > t); P(T_b <= t) by a tanh form of Phi
        z = (t - m[..., None]) / sd[..., None]  # [R, D - 1, T]
        cdf = 0.5 + 0.5 * np.tanh(z * (0.7978845608 + 0.0356774081 * z * z))
        tail = 1.0 - np.prod(cdf, axis=0)  # [D - 1, T]
        drafted = lo + (tail.sum(axis=1) - 0.5 * (tail[:, 0] + tail[:, -1])) * (t[1] - t[0])
        return np.concatenate([[float(n.max())], drafted])  # plain decoding: one token per round

    def _decide(self, live, left=None):
        if self.learn_cost and self.plain_timed < COST_MIN_PLAIN:
            return 0  # time plain rounds first: drafted rounds' costs are judged against them
        if left is None:  # open-ended rows: predicted tokens per second at each depth
            rate = probe_rate = self.expected_emitted()[np.array(live, dtype=bool)].sum(axis=0) / self.round_cost
        else:  # budgets left: the inverse of the predicted seconds until the batch finishes, the
            # last round priced as a plain one (few tokens are left then, and auto can drop depth)
            rounds = self.finish_rounds(live, left)
            rate = 1.0 / ((rounds - 1.0) * self.round_cost + self.round_cost[0])
            probe_rate = 1.0 / (rounds * self.round_cost)  # a probe round runs drafted whatever is left
        best = int(np.argmax(rate))  # first maximum: ties go to the smaller depth
        if best > 0 and rate[best] <= rate[0] * (1.0 + self.margin):
            best = 0
        if best > 0:
            self.off_rounds, self.wait = 0, self.probe_every
            return self._recheck(rate, best)
        self.off_rounds, self.on_rounds = self.off_rounds + 1, 0
        # re-probe: nothing is observed while off. Not in a round where no live row has more than
        # one token left: there a probe emits nothing more than a plain round and costs a drafted
        # round (otherwise a call's last round is often a probe, a few percent of a short call)
        last = left is not None and max((n for n, on in zip(left, live) if on), default=0) <= 1
        if not last and self.off_rounds > min(self.wait, self._probe_cap(probe_rate)):
            self.off_rounds, self.wait = 0, min(2 * self.wait, self.probe_max)
            return self._probe_depth()
        return 0

    def _probe_depth(self) -> int:
        """The depth a re-probe runs: the smallest drafted depth, unless a drafted depth has neither
        been timed at this bucket nor chosen in this call: then the smallest such one, so that every
        depth's in-loop cost is read once before it is priced (a call's choices, not its timed
        rounds: a round that built a graph is not timed, and must not change later choices). An
        untimed depth is priced from the cost curve times a timed neighbour's in-loop ratio, and the
        curve's own shape between depths is as noisy as a shared host: with only depth 2 probed,
        depth 2's rounds correct its own price while depth 4 keeps the curve's error, and auto can
        run plain where depth 4 pays (tests/test_adaptive.py)."""
        if self.learn_cost:
            ran = set(self.trace) | set(self.timed.get(self.last_batch, {}))
            untimed = [d for d in self.depths[1:] if d not in ran]
            if untimed:
                return untimed[0]
        return self.depths[1]

    def _probe_cap(self, rate: np.ndarray) -> int:
        """The longest wait between re-probes that keeps their predicted cost under
        :data:`PROBE_BUDGET` of plain decoding's time (at least ``probe_every``): a probe round at the
        smallest depth instead of a plain one costs about that depth's predicted shortfall times its
        round cost, in plain rounds. Where drafting is only just short of paying, a probe is nearly
        free, and a 64-round wait is slow to notice a workload that begins to accept more (after
        calls where depth 2 falls ~5% short, later calls that accept more run plain until a probe
        reads them; each call's rows also start from a pooled memory the earlier calls must not
        dominate: :data:`CALL_OBS`).
        ``rate`` prices every round at its depth, the last one included: the finish-time rates
        price the last round as plain at every depth, which read a probe near a call's end as free."""
        shortfall = max(0.0, 1.0 - float(rate[1] / rate[0]))
        loss = shortfall * float(self.round_cost[1] / self.round_cost[0])
        return max(self.probe_every, int(np.ceil(loss / PROBE_BUDGET)))

    def _recheck(self, rate: np.ndarray, best: int) -> int:
        """The drafted depth ``depths[best]``, or a cost re-check in its place: one plain round, and
        in the next round the runner-up drafted depth, so that both depths' rounds run within
        :data:`COST_NEAR` rounds of a plain one and are timed. Without it a call that only drafted
        adds no round times (a drafted round's cost is only read next to plain ones), so once auto
        drafts every round at a bucket its drafted costs stay what its first call read (a depth
        priced below its real cost in that call keeps being chosen, and a faster depth never runs
        again). A re-check comes after ``recheck_wait`` drafted rounds
        with no plain one, the wait doubling up to ``probe_max`` and carried over between calls at
        the bucket, and only while the choice is close: the runner-up (plain decoding included)
        predicted within :data:`RECHECK_BAND` of the best."""
        if self.neighbour is not None:
            k, self.neighbour = self.neighbour, None
            return k
        self.on_rounds += 1
        second = max((i for i in range(1, len(rate)) if i != best), key=lambda i: rate[i], default=None)
        runner_up = rate[0] if second is None else max(rate[0], rate[second])  # plain decoding included
        if (not self.learn_cost or self.on_rounds <= self.recheck_wait
                or rate[best] > (1.0 + RECHECK_BAND) * runner_up):
            return self.depths[best]
        self.on_rounds, self.recheck_wait = 0, min(2 * self.recheck_wait, self.probe_max)
        self.neighbour = None if second is None else self.depths[second]
        return 0

    def observe(self, k, n_emitted, done, L_host):
        if k == 0:
            self.plain_timed += 1
        super().observe(k, n_emitted, done, L_host)

    def _update(self, k, n_emitted, live):
        K = self.acc.shape[1]
        a = np.array(n_emitted, dtype=np.int64) - 1  # accepted drafts per row
        j = np.arange(K)
        # positions a row's round reached: its accepted drafts and the first rejected one (if any)
        reached = (j[None, :] <= a[:, None]) & (j[None, :] < k) & np.array(live, dtype=bool)[:, None]
        hit = (j[None, :] < a[:, None]).astype(np.float64)
        self.acc = np.where(reached, self.decay * self.acc + hit, self.acc)
        self.cnt = np.where(reached, self.decay * self.cnt + 1.0, self.cnt)
        self.row_acc += hit * reached
        self.row_cnt += reached


# ----------------------------------------------------------------------------------------------
# wiring into specgraph.compile


def _param_count(model) -> int:
    return sum(p.numel() for p in model.parameters())


def default_cost(fast) -> CostModel:
    """The cost model without a plan: :class:`LinearCost` for the target and, for a draft model,
    one draft step = (draft parameters / target parameters) x a plain target step (decode steps
    are weight-bound)."""
    target = LinearCost()
    draft_step = {}
    if fast.draft_model is not None:
        c = _param_count(fast.draft_model) / _param_count(fast.model)
        b = 1
        while b <= fast.max_batch_size * 2:
            draft_step[b] = c * target(1, b)
            b *= 2
    return CostModel(target, draft_step)


def auto_depths(depths, plan) -> list[int]:
    """The positive depths an ``"auto"`` object precompiles: ``depths`` if given, else those a plan
    recommends for some batch size (plus 2: speculation needs one depth to probe with when the
    plan recommended none), else :data:`DEFAULT_DEPTHS`."""
    if depths is not None:
        try:
            out = sorted({int(d) for d in depths if int(d) > 0})
        except (TypeError, ValueError) as e:
            raise ValueError(f"depths must be integers, got {depths!r}") from e
        if not out:
            raise ValueError(f"depths needs at least one positive depth for 'auto', got {depths!r}")
        return out
    if plan is not None:
        rec = sorted({g for g in plan.recommended.values() if g > 0})
        return rec or [2]
    return list(DEFAULT_DEPTHS)


def enable_auto(fast, depths: list[int], plan=None, **policy_kwargs) -> None:
    """Make ``fast`` choose its chain depth per round (:class:`AutoDepth`) among ``depths`` (and 0)."""
    if fast.tree is not None or fast.draft not in AUTO_DRAFTS or fast.learned is not None:
        raise ValueError(
            "num_speculative_tokens='auto' chooses chain depths: use it with draft='ngram', 'suffix', a draft "
            f"model or a ChainDrafter, tree=None (got draft={fast.draft!r}, tree={'set' if fast.tree is not None else None})")
    if plan is not None:
        cost, prior = plan.cost, plan.profile
    else:
        cost, prior = default_cost(fast), None
    fast.k_ladder, fast.k, fast.span = list(depths), max(depths), max(depths) + 1
    fast.policy = AutoDepth(depths, cost, prior, **policy_kwargs)


@contextlib.contextmanager
def forced_depth(fast, depth: int):
    """Run ``fast.generate`` at one chain depth (0: plain decoding) inside the block, compiling that
    depth on first use if it is not precompiled; the object's own settings come back afterwards."""
    if fast.tree is not None or fast.learned is not None or (depth > 0 and fast.draft not in AUTO_DRAFTS):
        raise ValueError(f"a forced chain depth needs a chain drafter ({', '.join(AUTO_DRAFTS)}), got draft={fast.draft!r}")
    with fast._lock:
        saved = (fast.policy, fast.k, fast.span)  # read under the lock: another thread may hold a forced depth
        fast.policy = FixedDepth(depth)
        fast.k = max(fast.k, depth)
        fast.span = max(fast.span, depth + 1)
        try:
            yield fast.policy
        finally:
            fast.policy, fast.k, fast.span = saved


def bucket_sizes(max_batch: int) -> list[int]:
    """The batch buckets a compiled object can run (powers of two up to ``max_batch``, and it)."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return sorted({*out, max_batch})


__all__ = ["AutoDepth", "FixedDepth", "DepthPolicy", "enable_auto", "auto_depths", "default_cost", "forced_depth",
           "bucket_sizes", "DEFAULT_DEPTHS"]
