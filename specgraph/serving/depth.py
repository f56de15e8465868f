"""The depth of each serving round, for the batch as it is now.

Speculation pays at low occupancy (a round costs about what a plain step costs, and accepted
drafts come free) and costs at high occupancy (the GEMMs stop being weight-bound, and a round
over B x (k+1) tokens costs more than B plain tokens' worth of acceptance returns). Each round
the policy picks the depth d of the compiled set (0 = plain) that maximises the predicted tokens
per second of the rows decoding now,

    rate(d) = sum over rows of E_row[emitted](d) / cost(bucket, d)

with ``cost`` the measured seconds of a round at that batch bucket and depth (timed at start-up
by :func:`measure_costs`, then kept current by an average of the rounds the server runs) and
``E_row[emitted](d) = 1 + sum_{j=1..d} prod_{i<=j} a_i``: a_i the row's acceptance at drafted
position i (a decayed count of its own rounds, shrunk towards the average over all rows, which
new rows start from). Rows the drafter found nothing for emit 1 at any depth. A depth must beat
plain by ``margin``; while the policy keeps speculation off nothing is observed, so every
``probe_every`` plain rounds with a drafted row it runs one at the smallest depth.
"""
from __future__ import annotations

import math
import time

import torch

HALFLIFE = 8.0  # rounds: a row's acceptance counts halve over this many of its drafted rounds
PRIOR_WEIGHT = 2.0  # how many observations the all-rows average counts for in a row's estimate
MARGIN = 0.05
PROBE_EVERY = 16
COST_KEEP = 0.8  # weight of the running cost estimate against a new round's seconds


class LoadAwareDepth:
    """Chooses a depth among ``depths`` (0 and the compiled drafted depths) per round. ``cost``:
    prior seconds of a round, ``cost(depth, bucket)``, used until a (bucket, depth) is measured
    (default: a curve that doubles a plain step's cost at 10 tokens per row)."""

    def __init__(self, depths, cost=None, *, halflife: float = HALFLIFE, prior_weight: float = PRIOR_WEIGHT,
                 margin: float = MARGIN, probe_every: int = PROBE_EVERY, prior_accept: float = 0.5):
        self.depths = sorted({int(d) for d in depths} | {0})
        if self.depths[0] < 0:
            raise ValueError(f"depths must be >= 0, got {depths!r}")
        self.K = self.depths[-1]
        self.decay = 0.5 ** (1.0 / halflife)
        self.prior_weight, self.margin, self.probe_every = prior_weight, margin, probe_every
        self.prior_cost = cost if cost is not None else (lambda d, b: 1.0 + (d + 1) * b / 9.0)
        self.costs: dict[tuple[int, int], float] = {}
        K = max(self.K, 1)
        self.pool_acc, self.pool_cnt = torch.full((K,), prior_accept), torch.ones(K)
        self.off_rounds = 0

    # ------------------------------------------------------------------------------------------

    def cost(self, b: int, d: int) -> float:
        if (b, d) in self.costs:
            return self.costs[(b, d)]
        # unmeasured: the prior curve scaled to the bucket's measured plain round, if any
        if (b, 0) in self.costs:
            return self.costs[(b, 0)] * self.prior_cost(d, b) / self.prior_cost(0, b)
        return self.prior_cost(d, b)

    def set_cost(self, b: int, d: int, seconds: float) -> None:
        self.costs[(b, d)] = float(seconds)

    def acceptance(self, acc: torch.Tensor, cnt: torch.Tensor) -> torch.Tensor:
        """A row's acceptance per drafted position [K], shrunk towards the all-rows average."""
        pool = self.pool_acc / self.pool_cnt.clamp_min(1e-9)
        return (acc + self.prior_weight * pool) / (cnt + self.prior_weight)

    def expected_emitted(self, acc: torch.Tensor, cnt: torch.Tensor) -> list[float]:
        """E[emitted] at each depth of the set for a row with these counts."""
        a = self.acceptance(acc, cnt)
        reach = torch.cumprod(a, 0)  # P(the first j drafts are all accepted)
        return [1.0 + float(reach[:d].sum()) for d in self.depths]

    def choose(self, b: int, estimates: list[tuple[torch.Tensor, torch.Tensor]], drafted: list[bool]) -> int:
        """The depth of this round at batch bucket ``b``: ``estimates`` per row (acceptance
        counts), ``drafted`` whether the drafter has a proposal for the row (decoding rows only)."""
        if self.K == 0 or not any(drafted):
            return 0
        gain = [0.0] * len(self.depths)
        for (acc, cnt), on in zip(estimates, drafted):
            if on:
                for j, e in enumerate(self.expected_emitted(acc, cnt)):
                    gain[j] += e - 1.0
        live = len(estimates)
        rates = [(live + g) / self.cost(b, d) for g, d in zip(gain, self.depths)]
        best = max(range(len(rates)), key=lambda j: (rates[j], -j))
        if best > 0 and rates[best] > rates[0] * (1.0 + self.margin):
            self.off_rounds = 0
            return self.depths[best]
        self.off_rounds += 1
        if self.off_rounds >= self.probe_every:  # nothing is observed while off: look again now and then
            self.off_rounds = 0
            return self.depths[1]
        return 0

    def observe(self, b: int, d: int, seconds: float, lanes: int = 1) -> None:
        """A round at bucket ``b`` and depth ``d`` took ``seconds`` (``lanes`` graph calls)."""
        if lanes != 1 or not math.isfinite(seconds) or seconds <= 0:
            return
        old = self.costs.get((b, d))
        self.costs[(b, d)] = seconds if old is None else COST_KEEP * old + (1 - COST_KEEP) * seconds

    def pool(self, accepted: int, reached: int) -> None:
        """A row's drafted round: ``accepted`` drafts accepted, positions 1..``reached`` verified."""
        self.pool_acc *= self.decay
        self.pool_cnt *= self.decay
        self.pool_acc[:accepted] += 1
        self.pool_cnt[:reached] += 1


class FixedServingDepth(LoadAwareDepth):
    """Every round at one depth (0 = plain) when the drafter has a proposal for some row, else
    plain: the baselines ``auto`` is measured against, on the same graphs."""

    def __init__(self, depths, depth: int):
        super().__init__(depths)
        if depth not in self.depths:
            raise ValueError(f"depth {depth} is not among the compiled depths {self.depths}")
        self.depth = depth

    def choose(self, b, estimates, drafted):
        return self.depth if any(drafted) else 0


def measure_costs(engine, repeats: int = 3, buckets=None) -> dict[tuple[int, int], float]:
    """Time a greedy round of every (batch bucket, depth) of ``engine``'s set (``buckets``: of
    those buckets only), with the engine's extras, on the graph set's placeholder inputs (all
    rows active: run while the cache holds no request) and give the policy the medians. Returns
    {(bucket, depth): seconds}."""
    from specgraph.graphset import GraphSpec, batch_buckets, example_inputs
    from specgraph.warping import SamplingParams

    fast, out = engine.fast, {}
    width = fast.round_width(fast.min_attend)
    with torch.no_grad():
        for b in batch_buckets(engine.B) if buckets is None else buckets:
            kv = [t[:b] for t in engine.kv]
            for d in engine.depths:
                if fast.row_by_row(b, SamplingParams(0.0), d, engine.extras) and (1, d) in out:  # b rounds of one row
                    out[(b, d)] = b * out[(1, d)]
                    engine.policy.set_cost(b, d, out[(b, d)])
                    continue
                fn = fast.round_graph(b, SamplingParams(0.0), width, d, engine.extras)
                args, _ = example_inputs(fast, GraphSpec("round", b, None, "greedy", d), engine.V)
                fn(*args, *kv)
                times = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    fn(*args, *kv)[1].tolist()
                    times.append(time.perf_counter() - t0)
                out[(b, d)] = sorted(times)[len(times) // 2]
                engine.policy.set_cost(b, d, out[(b, d)])
    return out


__all__ = ["LoadAwareDepth", "FixedServingDepth", "measure_costs"]
