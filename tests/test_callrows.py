"""CallRows: the rows of one generate call as the loop advances them (specgraph/callrows.py)."""
from __future__ import annotations

import torch

from specgraph.callrows import CallRows


def no_stop(b, emitted, room):
    return emitted[:room], False


def test_rows_start_at_their_prompt_ends_and_padding_rows_are_done():
    st = CallRows.start([[1, 2, 3], [4, 5]], 4, 16, "cpu")
    assert st.L.tolist() == [2, 1, 0, 0] and st.L_host == [2, 1, 0, 0]
    assert st.root.tolist() == [3, 5, 0, 0]
    assert st.done == [False, False, True, True] and st.live == [True, True, False, False]
    assert st.need(5) == 2 + 5  # the longest live row, plus the round's own slots


def test_commit_appends_what_each_row_keeps_and_moves_its_root():
    st = CallRows.start([[1, 2, 3], [4, 5]], 2, 16, "cpu")
    tokens = torch.tensor([[7, 8, 9], [6, -1, -1]])
    st.commit(tokens, [2, 1])
    assert st.hist[0, :5].tolist() == [1, 2, 3, 7, 8] and st.hist[1, :3].tolist() == [4, 5, 6]
    assert st.L.tolist() == [4, 2] and st.L_host == [4, 2]
    assert st.root.tolist() == [8, 6]
    st.commit(tokens, [0, 0])  # rows that do not advance keep everything
    assert st.L.tolist() == [4, 2] and st.root.tolist() == [8, 6]


def test_a_row_ends_at_max_new_tokens_or_a_stop():
    st = CallRows.start([[1, 2], [3, 4]], 2, 32, "cpu")
    assert st.keep(0, [5, 6, 7], 2, [9], no_stop) == [5, 6]  # cut at max_new_tokens
    assert st.done[0] and st.finished[0] and st.ended_at[0] == 2

    def eos_stop(b, emitted, room):
        cut = emitted.index(9) + 1 if 9 in emitted else len(emitted)
        return emitted[:min(cut, room)], 9 in emitted[:room]
    assert st.keep(1, [8, 9, 7], 5, [9], eos_stop) == [8, 9]
    assert st.done[1]
    assert st.advances([3, 2]) == [0, 0]


def test_a_stop_without_eos_keeps_the_row_decoding_until_every_row_ended():
    """As transformers: a row stopped by a criterion is padded only with an EOS token, so without
    one it keeps decoding; the call then ends at the longest ended row."""
    st = CallRows.start([[1], [2]], 2, 32, "cpu")
    stops_first = lambda b, emitted, room: (emitted[:1], b == 0)  # noqa: E731
    st.keep(0, [5, 6], 10, [], stops_first)
    assert st.finished[0] and not st.done[0]  # still decoded
    assert not st.end_when_all_finished()
    st.keep(0, [6, 6], 10, [], stops_first)  # a finished row takes what it is given
    st.keep(1, [7, 7, 7], 3, [], no_stop)
    assert st.end_when_all_finished()
    assert st.new == [[5, 6, 6], [7, 7, 7]] and all(st.done)
