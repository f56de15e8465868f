"""The built-in processors applied along drafted paths equal transformers' processor objects run on
each position's own prefix (chains and trees, padded rows, every processor at once)."""
from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    ForcedBOSTokenLogitsProcessor, ForcedEOSTokenLogitsProcessor, LogitsProcessorList, MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor, NoBadWordsLogitsProcessor, NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor, SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
)

from specgraph.processors import LogitsSpec, chain_paths, process_logits, tree_paths

V, PAD = 12, 0
EOS = (3,)


def hf_list(spec: LogitsSpec, T: int, pads: int, max_length: int) -> LogitsProcessorList:
    """transformers' processors for ``spec``, in generate's order."""
    procs = LogitsProcessorList()
    if spec.sequence_bias:
        procs.append(SequenceBiasLogitsProcessor({s: b for s, b in spec.sequence_bias}))
    if spec.repetition_penalty:
        procs.append(RepetitionPenaltyLogitsProcessor(spec.repetition_penalty, prompt_ignore_length=torch.tensor([pads])))
    if spec.no_repeat_ngram_size:
        procs.append(NoRepeatNGramLogitsProcessor(spec.no_repeat_ngram_size))
    if spec.bad_words:
        procs.append(NoBadWordsLogitsProcessor([list(s) for s, _ in spec.bad_words], list(EOS)))
    if spec.min_length:
        procs.append(MinLengthLogitsProcessor(spec.min_length, list(EOS)))
    if spec.min_new_tokens:
        procs.append(MinNewTokensLengthLogitsProcessor(T, spec.min_new_tokens, list(EOS)))
    if spec.forced_bos_token_id is not None:
        procs.append(ForcedBOSTokenLogitsProcessor(spec.forced_bos_token_id))
    if spec.forced_eos:
        procs.append(ForcedEOSTokenLogitsProcessor(max_length, list(spec.forced_eos)))
    if spec.suppress_tokens:
        procs.append(SuppressTokensLogitsProcessor(list(spec.suppress_tokens)))
    if spec.begin_suppress_tokens:
        procs.append(SuppressTokensAtBeginLogitsProcessor(list(spec.begin_suppress_tokens), T + spec.begin_offset))
    return procs


SPECS = {
    "repetition_penalty": LogitsSpec(repetition_penalty=1.7),
    "no_repeat_ngram": LogitsSpec(no_repeat_ngram_size=2),
    "no_repeat_trigram": LogitsSpec(no_repeat_ngram_size=3),
    "bad_words": LogitsSpec(bad_words=(((5,), float("-inf")),)),
    "everything": LogitsSpec(
        sequence_bias=(((4,), 2.5), ((1, 2), -1.5), ((2, 6, 7), 3.0)), repetition_penalty=1.3, no_repeat_ngram_size=2,
        bad_words=(((5,), float("-inf")), ((6, 8), float("-inf"))), min_length=9, min_new_tokens=3, eos=EOS,
        forced_eos=EOS, suppress_tokens=(9,), begin_suppress_tokens=(10, 11)),
}


def make_rows(B, S, gen):
    """Rows of a padded batch: (seq [B, 2S], meta [B, 3], L [B], padded prompt length T, padded histories)."""
    torch.manual_seed(gen)
    T = 7
    seq = torch.zeros(B, 2 * S, dtype=torch.long)
    meta = torch.zeros(B, 4, dtype=torch.long)
    L = torch.zeros(B, dtype=torch.long)
    hists = []
    for b in range(B):
        pads = b % 3
        n_new = int(torch.randint(0, 5, ()))
        toks = torch.randint(0, 9, (T - pads + n_new,))  # a small alphabet: repeats happen
        row = torch.cat([torch.full((pads,), PAD), toks])
        seq[b, : len(row)] = row
        meta[b] = torch.tensor([pads, T, T + 6, pads])
        L[b] = len(toks) - 1
        hists.append(row)
    return seq, meta, L, T, hists


@pytest.mark.parametrize("name", sorted(SPECS))
def test_chain_positions_equal_transformers(name):
    spec = SPECS[name]
    B, S, K = 4, 32, 4
    seq, meta, L, T, hists = make_rows(B, S, gen=1)
    drafts = torch.randint(0, 9, (B, K))
    logits = torch.randn(B, K + 1, V)
    out = process_logits(spec, logits, seq, meta, L, *chain_paths(drafts))
    for b in range(B):
        procs = hf_list(spec, T, int(meta[b, 0]), int(meta[b, 2]))
        for j in range(K + 1):
            ids = torch.cat([hists[b], drafts[b, :j]]).unsqueeze(0)
            want = procs(ids, logits[b, j].unsqueeze(0).clone())[0]
            torch.testing.assert_close(out[b, j], want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_tree_nodes_equal_transformers(name):
    spec = SPECS[name]
    B, S = 3, 32
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 3, 6])  # depth up to 4
    N, D = len(parents), 4
    seq, meta, L, T, hists = make_rows(B, S, gen=2)
    tokens = torch.randint(0, 9, (B, N))
    logits = torch.randn(B, N, V)
    path, depth = tree_paths(tokens, parents.expand(B, N), D)
    out = process_logits(spec, logits, seq, meta, L, path, depth)
    for b in range(B):
        procs = hf_list(spec, T, int(meta[b, 0]), int(meta[b, 2]))
        for q in range(N):
            anc, node = [], q
            while node > 0:
                anc.append(int(tokens[b, node]))
                node = int(parents[node])
            ids = torch.cat([hists[b], torch.tensor(anc[::-1], dtype=torch.long)]).unsqueeze(0)
            assert int(depth[b, q]) == len(anc)
            want = procs(ids, logits[b, q].unsqueeze(0).clone())[0]
            torch.testing.assert_close(out[b, q], want, rtol=0, atol=0, equal_nan=True)


def test_committed_prefix_only_differs():
    """Negative control: processing every position with the committed prefix alone (what a round
    that ignored its drafts would do) does not equal transformers along the path."""
    spec = SPECS["no_repeat_ngram"]
    B, S, K = 4, 32, 4
    seq, meta, L, T, hists = make_rows(B, S, gen=1)
    drafts = hists[0][-1].repeat(B, K)  # repeating the last token completes bigrams along the path
    logits = torch.randn(B, K + 1, V)
    path, depth = chain_paths(drafts)
    along = process_logits(spec, logits, seq, meta, L, path, depth)
    committed = process_logits(spec, logits, seq, meta, L, path, torch.zeros_like(depth))
    assert not torch.equal(along, committed)
