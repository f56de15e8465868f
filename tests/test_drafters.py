import torch

from specgraph.drafters import ngram_propose


def _propose(seq, k, **kw):
    h = torch.tensor([seq])
    return ngram_propose(h, torch.tensor([len(seq)]), k, **kw)


def test_longest_suffix_match_continues_history():
    # suffix (7, 8) occurs earlier followed by 9, 10, 11
    drafts, n = _propose([1, 7, 8, 9, 10, 11, 5, 7, 8], 3)
    assert drafts.tolist() == [[9, 10, 11]] and n.tolist() == [2]


def test_longer_ngram_wins_over_more_recent_shorter_one():
    # 1-gram "8" most recently followed by 4; the 2-gram (7, 8) is followed by 9
    drafts, n = _propose([7, 8, 9, 3, 8, 4, 7, 8], 1)
    assert drafts.tolist() == [[9]] and n.tolist() == [2]


def test_periodic_text_gets_full_length_drafts():
    drafts, _ = _propose([3, 4] * 5, 4)
    assert drafts.tolist() == [[3, 4, 3, 4]]


def test_no_match_repeats_last_token_and_reports_zero():
    drafts, n = _propose([1, 2, 3, 4], 3)
    assert drafts.tolist() == [[4, 4, 4]] and n.tolist() == [0]


def test_rows_are_independent_and_padding_ignored():
    h = torch.tensor([[5, 6, 7, 5, 6, 0, 0], [1, 2, 1, 2, 1, 2, 9]])
    drafts, n = ngram_propose(h, torch.tensor([5, 6]), 2)
    assert drafts[0].tolist() == [7, 5]
    assert drafts[1].tolist() == [1, 2]
