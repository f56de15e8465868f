"""Logit warping shared by target and draft.

Speculative sampling is exact only if the target distribution used for acceptance is the one the
user asked for and the draft distribution is the one the draft token was really drawn from. Both
sides therefore go through :func:`warp_logits` with the same settings. Everything here is plain
tensor ops on Python-scalar settings: no ``.item()``, no data-dependent Python branches, so it
traces into a single graph and never syncs with the device.

Semantics follow Hugging Face ``generate`` (temperature, then top-k, then top-p, then min-p):

* ``temperature == 0`` means greedy; :func:`is_greedy` tells callers to take the argmax path.
* ``top_k``: keep the k largest logits (ties with the k-th value are kept, as in HF).
* ``top_p``: keep the smallest set of most likely tokens whose mass reaches ``top_p``
  (always at least one token).
* ``min_p``: drop tokens whose probability is below ``min_p`` times the largest probability.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

NEG_INF = float("-inf")
# The smallest sampling temperature: logits are divided by it in float32 (max 3.4e38), so any
# |logit| below 3.4e8 stays finite, far above what a model emits. Below it the quotient can
# overflow to inf and the softmax to NaN (Hugging Face's sampler then raises); greedy is
# ``do_sample=False``.
MIN_TEMPERATURE = 1e-30


@dataclass(frozen=True)
class SamplingParams:
    """Warping settings; hashable so compiled graphs can be cached per setting."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None

    def __post_init__(self) -> None:
        check_sampling_params(self.temperature, self.top_k, self.top_p, self.min_p)

    @property
    def greedy(self) -> bool:
        return is_greedy(self.temperature)


def check_sampling_params(temperature, top_k, top_p, min_p) -> None:
    """Raise ``ValueError`` for settings that have no meaning (never silently clamp)."""
    if not isinstance(temperature, (int, float)) or temperature != temperature or temperature < 0:
        raise ValueError(f"temperature must be a float >= 0 (0 = greedy), got {temperature!r}")
    if temperature == float("inf"):
        raise ValueError("temperature must be finite")
    if 0 < temperature < MIN_TEMPERATURE:
        raise ValueError(f"temperature {temperature!r} is below {MIN_TEMPERATURE:g}: logits divided by it overflow float32; "
                         "use do_sample=False (or temperature=0) for greedy decoding")
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
        raise ValueError(f"top_k must be a positive int or None, got {top_k!r}")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be in (0, 1] or None, got {top_p!r}")
    if min_p is not None and not (isinstance(min_p, (int, float)) and 0.0 <= min_p <= 1.0):
        raise ValueError(f"min_p must be in [0, 1] or None, got {min_p!r}")


def is_greedy(temperature: float) -> bool:
    return temperature == 0


def warp_logits(
    logits: torch.Tensor,  # [..., V]
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
) -> torch.Tensor:  # [..., V] float32, -inf where a token is filtered out
    """Return the warped logits whose softmax is the sampling distribution.

    Greedy (``temperature == 0``) is not a distribution; callers branch on :func:`is_greedy`.
    """
    check_sampling_params(temperature, top_k, top_p, min_p)
    if is_greedy(temperature):
        raise ValueError("warp_logits is for sampling; temperature=0 means greedy (take the argmax)")
    x = logits.float()
    if temperature != 1.0:
        x = x / temperature
    vocab = x.shape[-1]
    if top_k is not None and top_k < vocab:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, NEG_INF)
    if top_p is not None and top_p < 1.0:
        x = _top_p_filter(x, top_p)
    if min_p is not None and min_p > 0.0:
        probs = torch.softmax(x, dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * min_p
        x = x.masked_fill(probs < threshold, NEG_INF)
    return x


def _top_p_filter(x: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_logits, order = torch.sort(x, dim=-1, descending=False)
    cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
    # Ascending order: drop the low tail whose mass is <= 1 - top_p; the largest token always stays.
    drop_sorted = cum <= (1.0 - top_p)
    drop_sorted[..., -1] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return x.masked_fill(drop, NEG_INF)


def warped_probs(
    logits: torch.Tensor,  # [..., V]
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
) -> torch.Tensor:  # [..., V] float32
    """The sampling distribution; for ``temperature == 0`` the one-hot argmax distribution."""
    check_sampling_params(temperature, top_k, top_p, min_p)
    if is_greedy(temperature):
        idx = logits.argmax(dim=-1, keepdim=True)
        return torch.zeros(logits.shape, dtype=torch.float32, device=logits.device).scatter(-1, idx, 1.0)
    return torch.softmax(warp_logits(logits, temperature, top_k, top_p, min_p), dim=-1)


def normalize_filters(vocab: int, top_k, top_p, min_p) -> tuple:
    """Warping settings normalised so that no-op values compare equal (None = off): top-k at or
    above the vocabulary, top-p at or above 1, min-p at or below 0."""
    top_k = None if top_k is None or top_k >= vocab else int(top_k)
    top_p = None if top_p is None or top_p >= 1.0 else float(top_p)
    min_p = None if min_p is None or min_p <= 0.0 else float(min_p)
    return top_k, top_p, min_p


def token_logprobs(
    logits: torch.Tensor,  # [B, Q, V] processed logits, temperature already applied when sampling
    tokens: torch.Tensor,  # [B, Q] long, the emitted token at each position (-1: none)
    top_n: int,
    sampling: bool,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probabilities under the distribution each token was chosen from (the processed logits,
    then top-k / top-p / min-p when sampling; greedy: the processed logits' softmax): (chosen
    [B, Q], top-n values [B, Q, n], top-n token ids [B, Q, n])."""
    x = warp_logits(logits, 1.0, top_k, top_p, min_p) if sampling else logits.float()
    lp = torch.log_softmax(x, dim=-1)
    chosen = lp.gather(-1, tokens.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    top = lp.topk(top_n, dim=-1) if top_n > 0 else (lp[..., :0], tokens.unsqueeze(-1)[..., :0])
    return chosen, top[0], top[1]
