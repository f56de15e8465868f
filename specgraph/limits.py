"""What a compiled object may ask of its model and its machine, checked before anything is
allocated: the longest sequence the model's positions allow, and whether the static KV cache
fits in the memory left.

``compile(max_seq_len=None)`` takes :data:`DEFAULT_MAX_SEQ_LEN`, or the model's maximum positions
when that is smaller; an explicit ``max_seq_len`` above the model's maximum is refused (a model
with learned position embeddings has no row for those positions, and a rotary model was never
trained on them). The KV cache (every layer's keys and values for ``max_batch_size`` rows of
``max_seq_len + 1`` slots, the draft model's too) is allocated on first use; a cache larger than
the memory available now is refused at compile time with the numbers, instead of failing later
inside an allocation.
"""
from __future__ import annotations

import os

import torch

from specgraph.capture import UnsupportedModel, kv_layout
from specgraph.freezing import weight_bytes

DEFAULT_MAX_SEQ_LEN = 2048
# the config fields families use for their longest sequence, in the order they are looked up
POSITION_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


def max_positions(model) -> tuple[str, int] | None:
    """(config field, value) of the longest sequence ``model``'s config allows; None when it says none."""
    cfg = model.config.get_text_config(decoder=True)
    for name in POSITION_FIELDS:
        v = getattr(cfg, name, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return name, v
    return None


def resolve_max_seq_len(model, max_seq_len: int | None, default: int = DEFAULT_MAX_SEQ_LEN, draft_model=None) -> int:
    """``max_seq_len`` checked against the maximum positions of the model (and of the draft
    model, which holds the same sequences); None: ``default``, capped at that maximum. A
    ``ValueError`` says what to pass instead."""
    limits = [(who, lim) for who, m in (("model", model), ("draft model", draft_model))
              if m is not None and (lim := max_positions(m)) is not None]
    if max_seq_len is None:
        return min([default, *(value for _, (_, value) in limits)])
    if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 2:
        raise ValueError(f"max_seq_len must be an int >= 2, got {max_seq_len!r}")
    for who, (name, value) in limits:
        if max_seq_len > value:
            raise ValueError(f"max_seq_len={max_seq_len} exceeds the {who}'s maximum positions ({name}={value} in its "
                             f"config): pass max_seq_len <= {value}")
    return max_seq_len


def kv_cache_bytes(model, batch: int, slots: int) -> int | None:
    """Bytes of ``model``'s static KV cache for ``batch`` rows of ``slots`` slots (keys and values,
    every layer, the model's dtype); None when its config does not say the layout."""
    try:
        layers, kv_heads, head_dim = kv_layout(model)
    except UnsupportedModel:
        return None
    itemsize = next(model.parameters()).element_size()
    return 2 * layers * batch * kv_heads * slots * head_dim * itemsize


def available_bytes(device: torch.device) -> int | None:
    """Memory free for new allocations on ``device`` now (Linux's MemAvailable on the CPU, the
    CUDA driver's free memory on a GPU); None where it cannot be read."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_kv_fits(model, draft_model, max_batch_size: int, slots: int, available: int | None = None) -> None:
    """Refuse, with the numbers, a KV cache (the target's and the draft model's) larger than the
    memory available on the target's device. ``available``: that memory in bytes (default:
    :func:`available_bytes`)."""
    parts = [kv_cache_bytes(m, max_batch_size, slots) for m in (model, draft_model) if m is not None]
    if any(p is None for p in parts):
        return  # the eager fallback keeps the model's own cache
    need = sum(parts)
    device = next(model.parameters()).device
    available = available_bytes(device) if available is None else available
    if available is None or need <= available:
        return
    gib = 2 ** 30
    raise ValueError(f"the KV cache for max_batch_size={max_batch_size} x max_seq_len={slots - 1} needs "
                     f"{need / gib:.2f} GiB on {device.type} and {available / gib:.2f} GiB are available (the weights, "
                     f"{weight_bytes(model, draft_model) / gib:.2f} GiB, are already loaded): lower max_seq_len or "
                     "max_batch_size")
