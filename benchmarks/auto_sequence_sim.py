"""Replays ``num_speculative_tokens="auto"`` (:class:`specgraph.adaptive.AutoDepth`) over the call
sequence batch_bench.py runs for the 1B replay model, without a model: each call's rows draw their
accepted drafts from a replay acceptance β, rounds "take" the cost curve of a batch_bench JSON on a
fake clock (drafted rounds ``--drafted-slowdown`` dearer, as the loop measures them), and the
policy object carries its memory from call to call as it does in the benchmark.

    python benchmarks/auto_sequence_sim.py BATCH_BENCH_JSON \
        --betas 0.3,0.6,0.9 --batch-sizes 2,4 --seeds 3

Prints, per (β, B), the best fixed depth's expected time over auto's time for each call (warm-up
first; above 1: auto faster) and the last call's depths; with ``--traces``, every call's depths and
the pooled acceptance memory after it. Then, over all seeds, that ratio for the timed calls summed
(a call's own draws make single calls noisy: about ±0.02 at 30 seeds) and the share of seeds whose
median timed call, batch_bench's statistic, is under 0.95. It shows how auto's choices follow from
the pooled memory and the probe schedule over a call sequence (e.g. how long calls at one β steer
the next calls at another), without the model's run time.

With ``--replay-masks --mask-offsets N`` the calls draft with batch_bench's own replay masks (pass 0)
and N - 1 other draws of them, and the last line sums the shares into the cells a sweep is expected to
miss by its drafts' luck alone."""
from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import numpy as np

from specgraph.adaptive import AutoDepth
from specgraph.drafters import replay_corruption
from specgraph.perfmodel import CostCurve, CostModel


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def accepted(rng, B: int, k: int, beta: float) -> np.ndarray:
    """[B] drafts accepted per row: each draft accepted with probability beta, until the first miss."""
    return np.array([next((j for j in range(k) if rng.random() > beta), k) for _ in range(B)])


# --mask-offsets: pass o draws replay seed + o * this, above batch_bench's seeds (1000-4001 at --runs 3), so
# passes never share a seed
MASK_SEED_STRIDE = 7919


def replay_masks(seed: int, B: int, beta: float, n_new: int) -> np.ndarray:
    """[B, n_new] True where :class:`specgraph.drafters.ReplayDrafter` with replay seed ``seed``
    corrupts row b's continuation (its own draw, so a call here meets the benchmark's drafts)."""
    return np.stack([replay_corruption(seed, b, n_new, beta)[0].numpy() for b in range(B)])


def mask_accepted(bad: np.ndarray, emitted: np.ndarray, k: int) -> np.ndarray:
    """[B] drafts accepted: continuation indices emitted, emitted + 1, ... until a corrupted one, at most k."""
    a = np.zeros(len(bad), dtype=np.int64)
    for b, row in enumerate(bad):
        while a[b] < k and emitted[b] + a[b] < len(row) and not row[emitted[b] + a[b]]:
            a[b] += 1
    return a


def auto_call(pol, price, B, beta, n_new, rng, bad=None) -> tuple[list[int], float]:
    """``bad``: replay masks ([B, n_new], :func:`replay_masks`) instead of fresh draws; the prompt
    prefill emits the first token (continuation index 0) as in the benchmark."""
    pol.start(SimpleNamespace(draft="custom", backend="eager", _fns={}), [[1, 2, 3]] * B, B, "cpu")
    left, t0 = np.full(B, n_new - (bad is not None)), pol.clock.t
    while (left > 0).any():
        done = list(left <= 0)
        k = pol.choose(done, [2] * B, None, list(left))
        pol.clock.t += price(k, B) * rng.uniform(0.97, 1.03)
        a = accepted(rng, B, k, beta) if bad is None else mask_accepted(bad, n_new - left, k)
        pol.observe(k, list(a + 1), done, [2] * B)  # the loop reports acceptance, not the budget's cap
        left = left - np.where(left > 0, np.minimum(a + 1, left), 0)
    return list(pol.trace), pol.clock.t - t0


def fixed_seconds(price, B, beta, k, n_new, rng, reps=50, bad=None) -> float:
    total, reps = 0.0, reps if bad is None else 1
    for _ in range(reps):
        left = np.full(B, n_new - (bad is not None))
        while (left > 0).any():
            total += price(k, B)
            a = accepted(rng, B, k, beta) if bad is None else mask_accepted(bad, n_new - left, k)
            left = left - np.minimum(a + 1, np.maximum(left, 0))
    return total / reps


def in_loop_price(rows, depths, sizes):
    """(depth, B) -> seconds of a round: the median over β of the fixed methods' in-loop round times
    (off: depth 0, γ = k: depth k) in a batch_bench JSON, which must hold every depth in ``depths``
    (and 0) at every batch size in ``sizes``."""
    times = {}
    for r in rows:
        if r["method"] == "off" or r["method"].startswith("gamma="):
            for d, ms in r["round_ms_median"].items():
                if int(d) == (r["gamma"] or 0):
                    times.setdefault((int(d), r["batch"]), []).append(ms / 1e3)
    table = {key: float(np.median(v)) for key, v in times.items()}
    missing = [(k, B) for B in sizes for k in [0, *depths] if (k, B) not in table]
    if missing:
        raise SystemExit(f"--in-loop: the JSON has no fixed method's rounds at (depth, B) {missing}; "
                         "pass --depths among its --gammas and --batch-sizes among its batch sizes")
    return lambda k, B: table[k, B]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("result", help="a batch_bench JSON with a llama1b cost curve")
    ap.add_argument("--betas", default="0.3,0.6,0.9")
    ap.add_argument("--batch-sizes", default=None, help="default: the JSON's")
    ap.add_argument("--depths", default="2,4")
    ap.add_argument("--calls", type=int, default=4, help="calls per (β, B): batch_bench's warm-up + runs")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--drafted-slowdown", type=float, default=1.05)
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--traces", action="store_true")
    ap.add_argument("--in-loop", action="store_true",
                    help="rounds take the fixed methods' in-loop round times (median over β), while the policy "
                         "starts from the JSON's cost curve: a curve that misjudges some depths, as measured")
    ap.add_argument("--replay-masks", action="store_true",
                    help="batch_bench's own calls instead of fresh draws: per (β, B) the warm-up and --runs runs, "
                         "batch i of ceil(--prompts / B) drafted with ReplayDrafter's masks for seed "
                         "1000 (run + 1) + i (--seeds ignored); each call against the fixed depths on "
                         "the same masks")
    ap.add_argument("--mask-offsets", type=int, default=1,
                    help="with --replay-masks: passes, pass o drawing replay seeds offset by o x "
                         f"{MASK_SEED_STRIDE} (pass 0: the benchmark's own masks), each from a new policy: how "
                         "often a sweep's cell misses by its draft's luck alone")
    ap.add_argument("--runs", type=int, default=3, help="with --replay-masks: batch_bench's --runs")
    ap.add_argument("--prompts", type=int, default=2, help="with --replay-masks: batch_bench's --prompts-1b")
    args = ap.parse_args(argv)
    if args.replay_masks:
        args.seeds = args.mask_offsets
    elif args.mask_offsets != 1:
        ap.error("--mask-offsets needs --replay-masks")
    result = json.load(open(args.result))
    meta = result["meta"]
    table = meta["models"]["llama1b"]["cost"]["target"]["table"]
    curve = CostCurve({int(b): {int(n): t for n, t in row.items()} for b, row in table.items()})
    sizes = [int(b) for b in (args.batch_sizes or ",".join(table)).split(",")]
    depths = [int(d) for d in args.depths.split(",")]
    price = in_loop_price(result["rows"], depths, sizes) if args.in_loop else \
        (lambda k, B: curve(k + 1, B) * (args.drafted_slowdown if k else 1.0))
    timed = {}  # (beta, B) -> [best expected seconds, auto seconds] summed over seeds' timed calls
    medians = {}  # (beta, B) -> per seed, the median of the timed calls' ratios (batch_bench's statistic)
    for seed in range(args.seeds):
        rng = np.random.default_rng(seed)
        pol = AutoDepth(depths, CostModel(curve))
        pol.clock = Clock()
        print(f"seed {seed}")
        for beta in (float(b) for b in args.betas.split(",")):
            for B in sizes:
                if args.replay_masks:
                    n_batches = -(-args.prompts // B)
                    masks = [replay_masks(1000 * (run + 1) + i + MASK_SEED_STRIDE * seed, B, beta, args.max_new_tokens)
                             for run in range(-1, args.runs) for i in range(n_batches)]
                else:
                    n_batches, masks = 1, [None] * args.calls
                    best = min(fixed_seconds(price, B, beta, k, args.max_new_tokens, rng) for k in [0, *depths])
                ratios = []
                for bad in masks:
                    if bad is not None:
                        best = min(fixed_seconds(price, B, beta, k, args.max_new_tokens, rng, bad=bad)
                                   for k in [0, *depths])
                    trace, sec = auto_call(pol, price, B, beta, args.max_new_tokens, rng, bad)
                    ratios.append(best / sec)
                    if len(ratios) > n_batches:  # the warm-up run's calls are not timed in batch_bench
                        cell = timed.setdefault((beta, B), [0.0, 0.0])
                        cell[0], cell[1] = cell[0] + best, cell[1] + sec
                    if args.traces:
                        print("    " + "".join(map(str, trace)), np.round(pol.pooled_acceptance(), 2))
                medians.setdefault((beta, B), []).append(float(np.median(ratios[n_batches:])))
                print(f"  beta {beta:g} B {B:2d}: auto / best per call " + " ".join(f"{r:.2f}" for r in ratios)
                      + f"   last call {''.join(map(str, trace))}")
    print(f"over {args.seeds} seeds, timed calls: best fixed depth's expected time / auto's time, and the share"
          " of seeds whose median timed call is under 0.95 of it")
    for (beta, B), (best, sec) in timed.items():
        print(f"  beta {beta:g} B {B:2d}: {best / sec:.3f}   {np.mean(np.array(medians[beta, B]) < 0.95):.2f}")
    misses = sum(float(np.mean(np.array(m) < 0.95)) for m in medians.values())
    print(f"cells under 0.95 per sweep, expected: {misses:.2f} of {len(medians)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
