"""A GGUF model at its file's own precision: ``compile(model, weights="native")``, and the
precision a model is compiled at (:func:`resolve`, :func:`model_at`).

transformers loads a GGUF file by dequantizing every tensor to floats. :func:`native_model` goes
back to the file for the linear layers and builds each from the file's own blocks:

- Q4_0 / Q4_1 (blocks of 32 codes with a scale, and for Q4_1 an offset) become an
  :class:`specgraph.precision.Int4Linear` with the file's own codes, scales and offsets (fp32,
  which holds the file's f16 values exactly): ``W = q d + low`` with ``low = -8 d`` (Q4_0) or
  ``m`` (Q4_1);
- every other quantized type (Q8_0, the K-quants, ...) becomes an
  :class:`specgraph.precision.Int8Linear` of the file's dequantized values, one scale per output
  channel;
- F16 / BF16 tensors become :class:`specgraph.precision.BF16Linear` layers; F32 ones stay fp32.

The file's tensors are found by value, not by name: each row of a dequantized GGUF tensor is the
row of the loaded model's weight it became, whatever renaming or row permutation (Llama's q / k
heads) the loader applied. A linear whose rows are not all found in one GGUF tensor is refused.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch

from specgraph.precision import (WEIGHTS, BF16Linear, Int4Linear, Int8Linear, as_given, quantize,
                                 with_linears)

FLOAT_TYPES = ("F32", "F16", "BF16", "F64")
INT4_TYPES = ("Q4_0", "Q4_1")


def gguf_path(model) -> Path | None:
    """The GGUF file ``model`` was loaded from (:func:`specgraph.models.load_model` records it), or None."""
    path = getattr(model, "specgraph_gguf", None)
    return None if path is None else Path(path)


def _row_key(row: np.ndarray) -> bytes:
    return hashlib.blake2b(np.ascontiguousarray(row, dtype=np.float32).tobytes(), digest_size=16).digest()


def _dequantized(tensor) -> np.ndarray:  # [N, K] float32
    from gguf import dequantize

    return np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(tensor.data.shape[0], -1)


def _q4_blocks(tensor, rows: np.ndarray):
    """(codes [N, K] 0..15, scale, low [N, K / 32]) of Q4 tensor ``tensor``'s rows ``rows``: the
    file's values are ``codes * scale + low`` (Q4_0: ``(q - 8) d``; Q4_1: ``q d + m``). A block
    is an f16 scale ``d`` (Q4_1: then an f16 offset ``m``) and 16 bytes: byte ``j`` holds code
    ``j`` in its low nibble and code ``j + 16`` in its high one."""
    kind = tensor.tensor_type.name
    size = 18 if kind == "Q4_0" else 20
    blocks = np.asarray(tensor.data)[rows].reshape(len(rows), -1, size)

    def f16(at: int) -> np.ndarray:  # [N, K / 32] float32: each block's f16 at byte ``at``
        return blocks[..., at:at + 2].copy().view(np.float16).astype(np.float32)[..., 0]

    d = f16(0)
    low = -8 * d if kind == "Q4_0" else f16(2)
    qs = blocks[..., size - 16:]
    codes = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(len(rows), -1)
    return torch.from_numpy(codes.astype(np.uint8)), torch.from_numpy(d), torch.from_numpy(low)


class _RowIndex:
    """Where each row of the file's 2-D tensors lies: row bytes -> (tensor, row)."""

    def __init__(self, reader):
        self.tensors = [t for t in reader.tensors if len(t.shape) == 2]
        self.where: dict[bytes, tuple[int, int]] = {}
        for i, t in enumerate(self.tensors):
            for r, row in enumerate(_dequantized(t)):
                self.where.setdefault(_row_key(row), (i, r))

    def find(self, weight: torch.Tensor):
        """(GGUF tensor, its row for each row of ``weight``), or None when not every row is in one tensor."""
        found = [self.where.get(_row_key(row)) for row in weight.detach().float().numpy()]
        if any(f is None for f in found) or len({f[0] for f in found}) != 1:
            return None
        return self.tensors[found[0][0]], np.array([f[1] for f in found])


def _native_linear(module, weight: torch.Tensor, index: _RowIndex, name: str):
    hit = index.find(weight)
    if hit is None:
        raise ValueError(f"weights='native': the rows of {name}.weight are not those of one tensor of the GGUF file "
                         "(was the model changed after loading?); use weights='float32', 'int8' or 'int4'")
    tensor, rows = hit
    kind = tensor.tensor_type.name
    if kind in FLOAT_TYPES:
        return None if kind in ("F32", "F64") else BF16Linear(weight, module.bias)
    N, K = weight.shape
    if kind in INT4_TYPES and Int4Linear.fits(N, K):
        return Int4Linear.from_codes(*_q4_blocks(tensor, rows), module.bias)
    return Int8Linear.quantize(weight, module.bias)


def native_model(model):
    """``model`` (loaded from a GGUF file by :func:`specgraph.models.load_model`) with its linear
    layers at the file's own precision (see the module docstring); the rest as loaded (fp32).
    A new model: ``model`` is not changed."""
    from gguf import GGUFReader

    path = gguf_path(model)
    device = next(model.parameters()).device
    if device.type != "cpu":
        raise ValueError(f"weights='native' is built and tested for the CPU; the model is on {device}")
    if path is None:
        raise ValueError("weights='native' keeps a GGUF model at its file's precision: load the model with "
                         "specgraph.load_model (which records its GGUF file), or pass weights='float32', 'bfloat16', "
                         "'int8' or 'int4'")
    index = _RowIndex(GGUFReader(path))
    return with_linears(model, lambda name, module, weight: _native_linear(module, weight, index, name), "native")


def resolve(weights, model) -> str:
    """``compile(weights=...)`` checked; None: the model as given (:func:`specgraph.precision.as_given`)."""
    if weights is None:
        return as_given(model)
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
    return weights


def model_at(model, weights: str):
    """``model`` at precision ``weights`` (from :func:`resolve`): ``model`` itself when it is
    already there, :func:`native_model` for ``"native"``, else :func:`specgraph.precision.quantize`."""
    if weights == as_given(model):
        return model
    if weights == "native":
        return native_model(model)
    return quantize(model, weights)


def default_weights(model, draft=None) -> str | None:
    """What the command line runs a MODEL at when ``--weights`` is not given: ``"native"`` for a
    model loaded from a GGUF file (its own blocks), except with a learned head (``"eagle"`` /
    ``"medusa"``: the shipped heads match the fp32 model); None (as loaded) otherwise."""
    if gguf_path(model) is None or hasattr(model, "specgraph_weights") or draft in ("eagle", "medusa"):
        return None
    return "native"
