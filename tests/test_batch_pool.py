"""benchmarks/batch_pool.py: sweeps of one benchmark pool run by run against the methods beside each
run (never raw tokens per second across sweeps), and sweeps of different benchmarks refuse to pool."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))


def _sweep(path, speed, auto_over_best, runs=3, max_new_tokens=24):
    """One cell (B = 1): off, γ = 2 at 1.5x off and auto at ``auto_over_best`` x γ = 2, every run at
    the host's ``speed``."""
    off = [speed * (1.0 + 0.01 * i) for i in range(runs)]
    g2 = [1.5 * x for x in off]
    auto = [a * x for a, x in zip(auto_over_best, g2)]
    rows = [{"workload": "w", "batch": 1, "method": m, "runs": v}
            for m, v in (("off", off), ("gamma=2", g2), ("auto", auto))]
    meta = {"backend": "eager", "gammas": [2], "max_new_tokens": max_new_tokens}
    path.write_text(json.dumps({"meta": meta, "rows": rows}))
    return str(path)


def test_sweeps_at_different_speeds_pool_by_their_ratios(tmp_path):
    import batch_pool

    # the second day's host runs 30% slower: pooled tokens per second would blur the ratios, pooled ratios do not
    a = _sweep(tmp_path / "a.json", 10.0, [0.90, 0.96, 0.97])
    b = _sweep(tmp_path / "b.json", 7.0, [0.98, 0.99, 0.99])
    (cell,) = batch_pool.main([a, b, "--out", str(tmp_path / "pooled.json")])
    assert cell["runs"] == 6 and cell["best_method"] == "gamma=2"
    assert cell["auto_vs_best_paired"] == pytest.approx(0.975)  # median of the six run-by-run ratios
    assert cell["over_off"]["gamma=2"] == pytest.approx(1.5)
    assert cell["meets_targets"] and cell["paired_meets_targets"]
    (alone,) = batch_pool.main([a])
    assert alone["runs"] == 3 and alone["auto_vs_best"] == pytest.approx(0.96) and alone["meets_targets"]
    (miss,) = batch_pool.main([_sweep(tmp_path / "c.json", 10.0, [0.90, 0.93, 0.99])])
    assert miss["auto_vs_best_paired"] == pytest.approx(0.93) and not miss["paired_meets_targets"]
    assert not miss["meets_targets"]
    assert json.loads((tmp_path / "pooled.json").read_text())["cells"][0]["runs"] == 6


def test_sweeps_of_different_benchmarks_do_not_pool(tmp_path):
    import batch_pool

    a = _sweep(tmp_path / "a.json", 10.0, [1.0, 1.0, 1.0])
    b = _sweep(tmp_path / "b.json", 10.0, [1.0, 1.0, 1.0], max_new_tokens=64)
    with pytest.raises(SystemExit, match="max_new_tokens"):
        batch_pool.main([a, b])
