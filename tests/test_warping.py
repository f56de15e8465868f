"""warp_logits / warped_probs against Hugging Face's own logits processors."""
from __future__ import annotations

import itertools

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from specgraph import SamplingParams, is_greedy, warp_logits, warped_probs

V = 97  # deliberately not a power of two




def _hf_warp(logits: torch.Tensor, temperature, top_k, top_p, min_p) -> torch.Tensor:
    """HF's processors in generate()'s order: temperature -> top_k -> top_p -> min_p."""
    ids = torch.zeros(logits.shape[0], 1, dtype=torch.long)
    x = TemperatureLogitsWarper(float(temperature))(ids, logits)
    if top_k is not None:
        x = TopKLogitsWarper(top_k)(ids, x)
    if top_p is not None:
        x = TopPLogitsWarper(top_p)(ids, x)
    if min_p is not None:
        x = MinPLogitsWarper(min_p)(ids, x)
    return x


def _logit_batches() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    smooth = 3.0 * torch.randn(16, V, generator=g)
    masked = smooth.clone()
    masked[torch.rand(16, V, generator=g) < 0.3] = float("-inf")  # a pre-masked vocabulary
    masked[:, 0] = 1.0  # every row keeps at least one finite entry
    ties = torch.randint(-3, 4, (16, V), generator=g).float()  # many exact ties
    peaked = torch.randn(16, V, generator=g)
    peaked[:, 5] += 12.0  # one dominant token
    return {"smooth": smooth, "masked": masked, "ties": ties, "peaked": peaked}


LOGITS = _logit_batches()

GRID = list(
    itertools.product(
        [0.3, 1.0, 1.7],  # temperature
        [None, 1, 5, 40, V, V + 10],  # top_k
        [None, 0.2, 0.9, 1.0],  # top_p
        [None, 0.0, 0.05, 0.5],  # min_p
    )
)


def _assert_same_warp(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.dtype == torch.float32
    assert ours.shape == theirs.shape
    assert torch.equal(torch.isneginf(ours), torch.isneginf(theirs)), "different set of filtered tokens"
    assert torch.isfinite(ours[~torch.isneginf(ours)]).all()
    fin = torch.isfinite(theirs)
    torch.testing.assert_close(ours[fin], theirs[fin], rtol=0.0, atol=1e-6)


@pytest.mark.parametrize("kind", sorted(LOGITS))
def test_matches_hf_processors_on_grid(kind):
    logits = LOGITS[kind]
    for temperature, top_k, top_p, min_p in GRID:
        ours = warp_logits(logits, temperature, top_k, top_p, min_p)
        theirs = _hf_warp(logits, temperature, top_k, top_p, min_p)
        try:
            _assert_same_warp(ours, theirs)
        except AssertionError as e:  # name the failing setting
            raise AssertionError(f"{kind} T={temperature} top_k={top_k} top_p={top_p} min_p={min_p}: {e}") from e


def test_matches_hf_with_leading_batch_dims():
    logits = LOGITS["smooth"].reshape(4, 4, V)
    for setting in [(0.8, 10, 0.7, 0.1), (1.2, None, 0.5, None), (0.5, 3, None, 0.2)]:
        ours = warp_logits(logits, *setting)
        theirs = _hf_warp(logits.reshape(16, V), *setting).reshape(4, 4, V)
        _assert_same_warp(ours, theirs)


def test_top_k_keeps_ties_with_kth_value():
    logits = torch.tensor([[5.0, 3.0, 3.0, 3.0, 1.0, 0.0]])
    out = warp_logits(logits, top_k=2)
    assert torch.isfinite(out).tolist() == [[True, True, True, True, False, False]]


def test_top_p_keeps_smallest_set_reaching_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    keep = lambda p: torch.isfinite(warp_logits(logits, top_p=p)).tolist()[0]  # noqa: E731
    assert keep(0.4) == [True, False, False, False]
    assert keep(0.7) == [True, True, False, False]
    assert keep(0.9) == [True, True, True, False]
    assert keep(0.99) == [True, True, True, True]
    assert keep(1.0) == [True, True, True, True]
    assert keep(1e-9) == [True, False, False, False]  # at least one token always stays


def test_min_p_threshold_relative_to_max():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    out = warp_logits(probs.log(), min_p=0.25)  # threshold 0.125
    assert torch.isfinite(out).tolist() == [[True, True, True, False]]
    out = warp_logits(probs.log(), min_p=1.0)
    assert torch.isfinite(out).tolist() == [[True, False, False, False]]


def test_half_precision_input_returns_float32():
    logits = LOGITS["smooth"].to(torch.bfloat16)
    out = warp_logits(logits, 0.7, top_k=20)
    assert out.dtype == torch.float32
    _assert_same_warp(out, _hf_warp(logits.float(), 0.7, 20, None, None))


@pytest.mark.parametrize("kind", sorted(LOGITS))
def test_warped_probs_is_a_distribution(kind):
    logits = LOGITS[kind]
    for temperature, top_k, top_p, min_p in GRID[::5]:
        p = warped_probs(logits, temperature, top_k, top_p, min_p)
        assert p.dtype == torch.float32
        assert (p >= 0).all()
        torch.testing.assert_close(p.sum(-1), torch.ones(p.shape[0]), rtol=0, atol=1e-5)
        # zero exactly where the warp filtered a token
        filtered = torch.isneginf(warp_logits(logits, temperature, top_k, top_p, min_p))
        assert (p[filtered] == 0).all()
        torch.testing.assert_close(p, torch.softmax(_hf_warp(logits, temperature, top_k, top_p, min_p), -1))


@pytest.mark.parametrize("kind", sorted(LOGITS))
def test_greedy_is_one_hot_argmax(kind):
    logits = LOGITS[kind]
    p = warped_probs(logits, temperature=0.0)
    assert p.dtype == torch.float32 and p.shape == logits.shape
    assert torch.equal(p.sum(-1), torch.ones(logits.shape[0]))
    assert torch.equal(p.argmax(-1), logits.argmax(-1))
    assert torch.equal((p == 1).sum(-1), torch.ones(logits.shape[0], dtype=torch.long))
    assert ((p == 0) | (p == 1)).all()
    # other settings are irrelevant for greedy
    assert torch.equal(warped_probs(logits, 0.0, top_k=3, top_p=0.5, min_p=0.1), p)


def test_greedy_flags():
    assert is_greedy(0) and is_greedy(0.0) and not is_greedy(1e-6)
    assert SamplingParams(temperature=0.0).greedy and not SamplingParams().greedy
    with pytest.raises(ValueError, match="greedy"):
        warp_logits(LOGITS["smooth"], temperature=0.0)


BAD = [
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(temperature="1.0"), "temperature"),
    (dict(top_k=0), "top_k"),
    (dict(top_k=-1), "top_k"),
    (dict(top_k=1.5), "top_k"),
    (dict(top_k=False), "top_k"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=-0.1), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(min_p=-0.1), "min_p"),
    (dict(min_p=1.01), "min_p"),
    (dict(min_p=float("nan")), "min_p"),
]


@pytest.mark.parametrize("kw, match", BAD, ids=[str(kw) for kw, _ in BAD])
def test_invalid_settings_raise(kw, match):
    logits = LOGITS["smooth"]
    with pytest.raises(ValueError, match=match):
        warp_logits(logits, **kw)
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)
    with pytest.raises(ValueError, match=match):
        warped_probs(logits, **kw)
    if "temperature" not in kw:  # greedy must not skip the check of the other settings
        with pytest.raises(ValueError, match=match):
            warped_probs(logits, temperature=0.0, **kw)
