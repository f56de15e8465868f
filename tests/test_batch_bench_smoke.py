"""benchmarks/batch_bench.py --smoke end to end (tiny random models, eager): the script runs, every
method's greedy output equals speculation off, and the JSON carries what its results report
(throughput per method, auto's ratios, in-loop round times, auto's learned cost factors and its
share of rounds at the fastest method's depth, and its run-by-run ratio to that method)."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))

pytestmark = pytest.mark.filterwarnings("ignore:.*past_key_values.*deprecated:FutureWarning")


def _git_head(root: Path) -> str | None:
    import subprocess

    try:
        return subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def test_batch_bench_smoke_writes_equal_outputs_and_the_figures(tmp_path):
    import batch_bench

    out = tmp_path / "batch.json"
    assert batch_bench.main(["--smoke", "--models", "smollm2", "--gammas", "2", "--runs", "3", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert {r["batch"] for r in rows} == {1, 2} and {r["method"] for r in rows} == {"off", "gamma=2", "auto"}
    assert all(r["equal_to_off"] and r["tokens_per_s"] > 0 for r in rows)
    assert all(r["round_ms_median"] for r in rows)  # every method timed its rounds in the loop
    auto = [r for r in rows if r["method"] == "auto"]
    assert all(set(r["cost_factors"]) == {"0", "2"} and all(f > 0 for f in r["cost_factors"].values()) for r in auto)
    assert [s["batch"] for s in data["summary"]] == [1, 2]
    for s in data["summary"]:  # auto's share of rounds at the fastest method's depth, from its histogram
        best = next(r for r in rows if r["batch"] == s["batch"] and r["method"] == s["best_method"])
        ran = next(r["depths"] for r in auto if r["batch"] == s["batch"])
        assert s["auto_share_at_best_depth"] == pytest.approx(ran.get(str(best["gamma"]), 0) / sum(ran.values()))
        # the paired ratio: auto's run i against the fastest method's run i (the same round of methods)
        auto_runs = next(r["runs"] for r in auto if r["batch"] == s["batch"])
        ratios = sorted(a / b for a, b in zip(auto_runs, best["runs"]))
        assert s["auto_vs_best_paired"] == pytest.approx(ratios[len(ratios) // 2])
        # how much auto's rows leaned on the memory (>= its pool_weight floor) and on each other
        assert s["memory_weight"] >= 4.0 and (s["rows_weight"] is None or s["rows_weight"] >= 0.0)
    # the commit the imported specgraph came from, when it came from a git checkout (CI: a clean clone)
    commit = data["meta"]["commit"]
    head = _git_head(Path(batch_bench.specgraph.__file__).parent.parent)
    assert commit == head if head is None else commit in (head, head + "-dirty")
    for r in auto:  # every timed call's depths, per run: at least the rounds the last run's histogram counts
        assert len(r["calls"]) == 3 and sum(len(c[0]) for run in r["calls"] for c in run) >= sum(r["depths"].values())


class _RecordingFast:
    """Stands in for a compiled object under auto: records the replay seed each ``generate`` call
    starts with (the drafter reads it there)."""

    def __init__(self, drafter):
        self.chain_drafter, self.seeds = drafter, []
        self.stats = SimpleNamespace(emitted=1, rounds=1)
        self.policy = SimpleNamespace(trace=[0], round_times=[])

    def generate(self, ids, **kw):
        self.seeds.append(self.chain_drafter.seed)
        return ids


def test_run_batches_reseeds_the_replay_drafter_per_run_and_batch():
    import batch_bench
    import torch
    from specgraph.drafters import ReplayDrafter

    fast = _RecordingFast(ReplayDrafter({(5, 6): [7, 8]}, beta=0.5, vocab_size=16, seed=0))
    batches = [(torch.tensor([[5, 6]]), torch.ones(1, 2, dtype=torch.long))] * 3
    for run in (-1, 0, 1):  # warm-up, then two timed runs
        batch_bench.run_batches(fast, batches, 2, 0, "auto", None, run)
    warm, run0, run1 = fast.seeds[:3], fast.seeds[3:6], fast.seeds[6:]
    # every batch of a run draws its own corruptions, and no run replays another's
    assert all(len(set(s)) == 3 for s in (warm, run0, run1))
    assert not set(warm) & set(run0) and not set(run0) & set(run1) and not set(warm) & set(run1)
    batch_bench.run_batches(fast, batches, 2, 0, "auto", None, 0)  # the same run index replays its seeds
    assert fast.seeds[9:] == run0
