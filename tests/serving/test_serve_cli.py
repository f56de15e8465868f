"""`specgraph serve`'s command line: bad flags exit 2 with the reason, before anything loads."""
from __future__ import annotations

import pytest

from specgraph.cli import main
from specgraph.serving.depth import FixedServingDepth


@pytest.mark.parametrize("argv, message", [
    (["--speculation", "7"], "--speculation must be auto, off or 4"),
    (["--speculation", "sometimes"], "--speculation must be auto, off or 4"),
    (["--max-queue", "0"], "--max-queue must be >= 1"),
    (["--max-batch-size", "0"], "--max-batch-size must be >= 1"),
])
def test_bad_flags_exit_2(tmp_path, capsys, argv, message):
    folder = tmp_path / "m"
    folder.mkdir()  # an existing folder: the flags are checked before it is loaded
    with pytest.raises(SystemExit) as e:
        main(["serve", str(folder), *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_fixed_depth_must_be_compiled():
    assert FixedServingDepth([0, 4], 4).choose(1, [], [True]) == 4
    assert FixedServingDepth([0, 4], 4).choose(1, [], [False]) == 0  # nothing drafted: plain
    with pytest.raises(ValueError, match="not among the compiled depths"):
        FixedServingDepth([0, 4], 2)
