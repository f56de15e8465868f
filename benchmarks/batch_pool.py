"""Pool several ``batch_bench.py`` sweeps of one policy into per-cell statistics over all their runs.

One sweep's cell is three runs of 24-token calls: a single draw of a noisy statistic (the sequence
simulator, ``auto_sequence_sim.py``, puts a sizeable share of seeds under 0.95x in cells whose
expected ratio is near 1). Sweeps taken at different times run at different absolute speeds (a
shared host drifts by tens of percent), so tokens per second are never pooled; each run is read
against the methods that ran beside it in the same round of methods:

* the best of (off, fixed γ): the method whose median over the pooled runs of its throughput over
  "off" in the same round is highest;
* ``auto_vs_best``: auto's median run-over-off ratio divided by the best method's (the sweep's own
  summary divides medians of tokens per second, which do not pool across days);
* ``paired``: the median over pooled runs of auto's throughput over the best method's in the same
  round (batch_bench's paired ratio, over more runs).

Targets as in ``batch_bench.py``: auto >= 0.95 x the best of (off, best fixed γ) at every B and
>= 0.90 x the best fixed γ at B = 1. Only sweeps of the same workloads, depths and call length are
pooled (checked); that they ran the same policy is the caller's claim (``meta.commit`` when the sweep
recorded one).

    python benchmarks/batch_pool.py A.json B.json [--out pooled.json]
"""
from __future__ import annotations

import argparse
import json
import statistics


def meets_targets(batch: int, auto_vs_best: float, auto_vs_best_fixed: float) -> bool:
    """The targets for one cell: auto >= 0.95 x the best of (off, best fixed γ), and at B = 1
    >= 0.90 x the best fixed γ."""
    return auto_vs_best >= 0.95 and (batch != 1 or auto_vs_best_fixed >= 0.90)


def _key(meta: dict) -> tuple:
    return tuple(meta.get(k) for k in ("backend", "gammas", "max_new_tokens"))


def load_runs(paths) -> tuple[dict, list[dict]]:
    """{(workload, batch): {method: [tokens/s per run, rounds of methods in order]}}, sweeps' metas."""
    cells, metas = {}, []
    for path in paths:
        with open(path) as f:
            sweep = json.load(f)
        if metas and _key(sweep["meta"]) != _key(metas[0]):
            raise SystemExit(f"{path}: backend / gammas / max_new_tokens {_key(sweep['meta'])} differ from "
                             f"{paths[0]}'s {_key(metas[0])}; only sweeps of one benchmark pool")
        metas.append(sweep["meta"])
        per_sweep: dict = {}
        for r in sweep["rows"]:
            per_sweep.setdefault((r["workload"], r["batch"]), {})[r["method"]] = r["runs"]
        for cell, methods in per_sweep.items():
            lengths = {len(v) for v in methods.values()}
            if len(lengths) != 1:
                raise SystemExit(f"{path}: {cell} has methods with different run counts {lengths}")
            pooled = cells.setdefault(cell, {})
            for m, runs in methods.items():
                pooled.setdefault(m, []).extend(runs)
    for cell, methods in cells.items():
        if len({len(v) for v in methods.values()}) != 1 or "off" not in methods or "auto" not in methods:
            raise SystemExit(f"{cell}: not every sweep ran off, the fixed depths and auto")
    return cells, metas


def cell_summary(methods: dict[str, list[float]], batch: int) -> dict:
    off = methods["off"]
    over_off = {m: [a / b for a, b in zip(v, off)] for m, v in methods.items()}  # [runs] per method
    fixed = [m for m in methods if m.startswith("gamma=")]
    med = {m: statistics.median(v) for m, v in over_off.items()}
    best = max(["off", *fixed], key=lambda m: med[m])
    best_fixed = max(fixed, key=lambda m: med[m])
    auto_vs_best = med["auto"] / med[best]
    auto_vs_best_fixed = med["auto"] / med[best_fixed]
    paired = statistics.median(a / b for a, b in zip(methods["auto"], methods[best]))
    return {"runs": len(off), "best_method": best, "over_off": med, "auto_vs_best": auto_vs_best,
            "auto_vs_best_fixed": auto_vs_best_fixed, "auto_vs_best_paired": paired,
            "meets_targets": meets_targets(batch, auto_vs_best, auto_vs_best_fixed),
            "paired_meets_targets": meets_targets(batch, paired, auto_vs_best_fixed)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("sweeps", nargs="+", help="batch_bench.py JSON files of one policy")
    ap.add_argument("--out", default=None, help="write the pooled table as JSON")
    args = ap.parse_args(argv)
    cells, metas = load_runs(args.sweeps)
    commits = [m.get("commit") or "commit not recorded" for m in metas]
    print("sweeps: " + ", ".join(f"{p} ({c})" for p, c in zip(args.sweeps, commits)))
    out = []
    print(f"{'workload':<24} {'B':>3} {'runs':>4} {'best':>8} {'best/off':>8} {'auto/off':>8} {'auto/best':>9}"
          f" {'paired':>7}")
    for (workload, batch), methods in sorted(cells.items()):
        s = {"workload": workload, "batch": batch, **cell_summary(methods, batch)}
        out.append(s)
        print(f"{workload:<24} {batch:>3} {s['runs']:>4} {s['best_method']:>8} {s['over_off'][s['best_method']]:8.2f}"
              f" {s['over_off']['auto']:8.2f} {s['auto_vs_best']:8.3f}x {s['auto_vs_best_paired']:6.3f}x"
              + ("" if s["meets_targets"] else "  (target missed)"))
    print(f"{sum(s['meets_targets'] for s in out)} of {len(out)} cells meet the targets by pooled medians, "
          f"{sum(s['paired_meets_targets'] for s in out)} by pooled paired ratios")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"sweeps": args.sweeps, "metas": metas, "cells": out}, f, indent=1)
    return out


if __name__ == "__main__":
    main()
