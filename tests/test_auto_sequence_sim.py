"""benchmarks/auto_sequence_sim.py: its replay masks are the benchmark's drafter's own, fixed depths
are priced exactly on them, and --mask-offsets' first pass is the benchmark's own masks."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))


def test_mask_accepted_stops_at_the_first_corrupted_draft():
    from auto_sequence_sim import mask_accepted

    bad = np.array([[False, False, True, False, False],  # row 0: indices 0, 1 clean, 2 corrupted
                    [False, False, False, False, False]])
    assert mask_accepted(bad, np.array([0, 0]), 4).tolist() == [2, 4]
    assert mask_accepted(bad, np.array([2, 3]), 4).tolist() == [0, 2]  # row 1 runs off the continuation's end
    assert mask_accepted(bad, np.array([3, 0]), 1).tolist() == [1, 1]


def test_replay_masks_are_the_replay_drafters_draws():
    from auto_sequence_sim import replay_masks

    from specgraph.drafters import replay_corruption

    m = replay_masks(1001, 3, 0.6, 24)
    assert m.shape == (3, 24)
    for b in range(3):
        assert m[b].tolist() == replay_corruption(1001, b, 24, 0.6)[0].tolist()
    assert 0.2 < m.mean() < 0.6  # P(corrupt) = 0.4 over 72 draws
    assert not replay_masks(1001, 2, 1.0, 24).any()


def test_fixed_depths_cost_their_rounds_on_the_masks():
    from auto_sequence_sim import fixed_seconds

    def price(k, B):
        return {(0, 2): 1.0, (2, 2): 1.5}[k, B]

    bad = np.zeros((2, 9), dtype=bool)  # nothing corrupted: 8 tokens left after the prefill's
    rng = np.random.default_rng(0)
    assert fixed_seconds(price, 2, 0.6, 0, 9, rng, bad=bad) == pytest.approx(8.0)
    assert fixed_seconds(price, 2, 0.6, 2, 9, rng, bad=bad) == pytest.approx(4.5)  # 3 per round: 3 + 3 + 2
    bad[1, :] = True  # row 1 accepts nothing: one token per round, 8 rounds
    assert fixed_seconds(price, 2, 0.6, 2, 9, rng, bad=bad) == pytest.approx(12.0)


def _result(path, gammas=(2, 4)):
    """A batch_bench-shaped JSON at B = 2: a cost curve and the fixed methods' in-loop round times."""
    table = {"2": {"1": 0.10, "3": 0.14, "5": 0.17}}
    rows = [{"method": "off", "gamma": None, "batch": 2, "round_ms_median": {"0": 100.0}}]
    rows += [{"method": f"gamma={g}", "gamma": g, "batch": 2, "round_ms_median": {str(g): 100.0 + 20 * g}}
             for g in gammas]
    path.write_text(json.dumps({"meta": {"models": {"llama1b": {"cost": {"target": {"table": table}}}}},
                                "rows": rows}))
    return str(path)


def _calls(text):
    return re.findall(r"auto / best per call ([\d. ]+)", text)


def test_mask_offsets_first_pass_is_the_benchmarks_masks(tmp_path, capsys):
    import auto_sequence_sim

    js = _result(tmp_path / "r.json")
    args = [js, "--in-loop", "--replay-masks", "--betas", "0.6", "--batch-sizes", "2"]
    auto_sequence_sim.main(args)
    (alone,) = _calls(capsys.readouterr().out)
    auto_sequence_sim.main([*args, "--mask-offsets", "3"])
    out = capsys.readouterr().out
    passes = _calls(out)
    assert len(passes) == 3 and passes[0] == alone  # pass 0: the benchmark's own masks, a new policy
    assert len(set(passes)) > 1  # other passes draw other masks
    share = float(re.search(r"beta 0.6 B  2: \S+\s+(\S+)", out.split("over 3 seeds")[1])[1])
    assert float(re.search(r"expected: (\S+) of 1", out)[1]) == pytest.approx(share, abs=0.01)  # one cell: its share


def test_in_loop_prices_need_every_depth_the_policy_may_run(tmp_path):
    import auto_sequence_sim

    js = _result(tmp_path / "r.json", gammas=(2,))
    with pytest.raises(SystemExit, match=r"\(4, 2\)"):
        auto_sequence_sim.main([js, "--in-loop", "--betas", "0.6", "--batch-sizes", "2"])
    with pytest.raises(SystemExit):
        auto_sequence_sim.main([js, "--mask-offsets", "2"])  # offsets without replay masks
