"""The decoding loop (specgraph/loop.py) on a toy target: an executor that verifies chains against
a deterministic next-token rule, so the loop's bookkeeping (drafts, stops, depths, commits) is
checked without compiling anything. The compiled and ONNX executors are checked against
``model.generate`` in test_compile / test_onnx."""
from __future__ import annotations

import torch

from specgraph.callrows import CallRows
from specgraph.eager import GenerationStats
from specgraph.loop import LadderDepth, RoundResult, decode, next_k
from specgraph.proposal import ChainProposal, Proposer
from specgraph.warping import SamplingParams

V = 11


def target(seq):
    """The toy target's greedy next token."""
    return (7 * sum(seq) + len(seq)) % V


def greedy(prompt, n):
    seq = list(prompt)
    for _ in range(n):
        seq.append(target(seq))
    return seq[len(prompt):]


class ToyRounds:
    """Verifies each row's chain greedily against ``target``: the accepted drafts, then the
    target's token. ``trust_drafts``: emit the drafts unverified (the negative control)."""

    def __init__(self, trust_drafts=False):
        self.trust, self.depths = trust_drafts, []

    def width(self, state):
        return state.hist.shape[1]

    def chain(self, view, chain):
        B, k = view.batch, chain.k
        self.depths.append(k)
        tokens, n = torch.full((B, k + 1), -1), torch.zeros(B, dtype=torch.long)
        for b in range(B):
            if not view.active[b]:
                continue
            seq = view.hist[b, : int(view.L[b]) + 1].tolist()
            out = []
            for j in range(k):
                d = int(chain.drafts[b, j])
                if not self.trust and d != target(seq):
                    break
                out.append(d)
                seq.append(d)
            out.append(target(seq))
            tokens[b, : len(out)], n[b] = torch.tensor(out), len(out)
        return RoundResult(tokens, n)

    def tree(self, view, tree):
        raise AssertionError("chains only")

    def record(self, result, state, kept, adv):
        pass


class ToyDrafter(Proposer):
    """Drafts the target's own tokens, except every ``wrong``-th draft of a chain (0: never)."""

    def __init__(self, wrong=0):
        self.wrong = wrong

    def propose(self, view, k):
        drafts = torch.zeros(view.batch, k, dtype=torch.long)
        for b in range(view.batch):
            seq = view.hist[b, : int(view.L[b]) + 1].tolist()
            for j in range(k):
                t = target(seq)
                if self.wrong and (j + 1) % self.wrong == 0:
                    t = (t + 1) % V
                drafts[b, j] = t
                seq.append(t)
        return ChainProposal(k, drafts)


def run(rows, drafter, rounds, ladder, max_new_tokens=20, eos=(), B=None):
    B = B or len(rows)
    state = CallRows.start(rows, B, 64, "cpu")
    stats = GenerationStats()
    eos = list(eos)

    def stop(b, emitted, room):
        keep = emitted[:room]
        for i, t in enumerate(keep):
            if t in eos:
                return keep[: i + 1], True
        return keep, False
    depth = LadderDepth(ladder)
    depth.start(None, rows, B, "cpu")
    decode(state, drafter, rounds, depth, params=SamplingParams(0.0), generator=None, vocab=V, trees=False,
           max_new_tokens=max_new_tokens, eos=eos, stop=stop, stats=stats)
    return state.new, stats


ROWS = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10]]


def test_greedy_output_is_the_targets_whatever_the_drafts():
    want = [greedy(r, 20) for r in ROWS]
    for wrong in (0, 1, 2, 3):
        new, stats = run(ROWS, ToyDrafter(wrong), ToyRounds(), [2, 4])
        assert new == want
    new, stats = run(ROWS, Proposer(), ToyRounds(), [0])  # no drafter: plain steps
    assert new == want and stats.rounds == 20


def test_unverified_drafts_change_the_output():
    """Negative control: an executor that trusts wrong drafts emits another sequence."""
    new, _ = run(ROWS, ToyDrafter(2), ToyRounds(trust_drafts=True), [2, 4])
    assert new != [greedy(r, 20) for r in ROWS]


def test_exact_drafts_climb_the_ladder_and_bad_ones_step_down():
    rounds = ToyRounds()
    new, stats = run([[1, 2, 3]], ToyDrafter(0), rounds, [2, 4, 8], max_new_tokens=40)
    assert rounds.depths[:3] == [2, 4, 8]  # every draft accepted: one rung up per round
    assert stats.rounds < 40 / 4
    rounds = ToyRounds()
    run([[1, 2, 3]], ToyDrafter(1), rounds, [2, 4, 8], max_new_tokens=40)
    assert set(rounds.depths) == {2}  # nothing accepted: stays at the bottom rung
    assert next_k([2, 4, 8], 4, 4, [1]) == 2 and next_k([2, 4, 8], 4, 0, [1]) == 4


def test_rows_stop_at_eos_and_padding_rows_never_run():
    want = [greedy(r, 20) for r in ROWS]
    eos = want[0][3]
    new, _ = run(ROWS, ToyDrafter(3), ToyRounds(), [2, 4], eos=[eos], B=4)
    for got, full in zip(new, want):
        cut = full.index(eos) + 1 if eos in full else len(full)
        assert got == full[:cut]
