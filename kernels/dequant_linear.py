"""Linear layers whose weights are stored in a low precision and whose activations stay fp32.

``y[m, n] = sum_k x[m, k] * W[n, k]`` with ``W`` the fp32 value of a stored weight:

=======  =====================================================  =========================================
format   stored                                                 ``W[n, k]``
=======  =====================================================  =========================================
int8     ``q`` [N, K] int8, ``scale`` [N] fp32                  ``q[n, k] * scale[n]``
int4     ``codes`` [N, K/2] uint8, ``scale``, ``low`` [N, K/32]  ``c[n, k] * scale[n, g] + low[n, g]``,
                                                                ``g = k // 32``
bf16     ``w`` [N, K] bf16                                      ``float(w[n, k])``
=======  =====================================================  =========================================

int4 codes ``c`` (0..15) are packed two per byte by halves: byte ``[n, j]`` holds ``c[n, j]`` in
its low nibble and ``c[n, j + K/2]`` in its high nibble, so both halves read ``x`` contiguously.

Each format is a custom op (``specgraph::int8_linear``, ``specgraph::int4_linear``,
``specgraph::bf16_linear``) whose eager kernel dequantizes ``W`` and calls ``F.linear``: that is
what ``generate`` on the quantized model runs, the reference. A compiled graph replaces each op
(:func:`specgraph.passes.dequant_linear_pass`) by one of two fp32 forms written here:

- :func:`rows_form` (few rows: decoding, verification) - one reduction over ``k`` per output,
  which Inductor turns into one loop nest reading the stored weight once and dequantizing it in
  registers: the bytes of the stored format per step, not those of an fp32 copy;
- :func:`dense_form` (many rows: prefill) - ``W`` dequantized once into a buffer, then a GEMM.

Both accumulate in fp32, so the compiled graph and ``generate`` differ only in summation order,
as they do at float32. (Rounding the activations to bf16 to use the CPU's bf16-input int8 / int4
kernels instead turns those fp32 differences into bf16 steps, and greedy output then departs
from ``generate`` at near-ties.)
"""
from __future__ import annotations

import torch

GROUP = 32  # inputs per int4 scale / offset: GGUF's Q4 block size
FORMATS = ("int8", "int4", "bf16")


# ---------------------------------------------------------------------------------------------
# dequantized weights (the reference)


def int8_weight(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:  # [N, K] int8, [N] -> [N, K] fp32
    return q.float() * scale[:, None]


def int4_codes(codes: torch.Tensor) -> torch.Tensor:  # [N, K/2] uint8 -> [N, K] codes 0..15, uint8
    return torch.cat([codes & 15, codes >> 4], dim=1)


def pack_int4(c: torch.Tensor) -> torch.Tensor:  # [N, K] codes 0..15 -> [N, K/2] uint8 (halves)
    half = c.shape[1] // 2
    c = c.to(torch.uint8)
    return (c[:, :half] | (c[:, half:] << 4)).contiguous()


def int4_weight(codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """[N, K/2] uint8, [N, G] fp32 x2 -> [N, K] fp32."""
    N, G = scale.shape
    c = int4_codes(codes).float().view(N, G, GROUP)
    return (c * scale[..., None] + low[..., None]).view(N, G * GROUP)


def bf16_weight(w: torch.Tensor) -> torch.Tensor:  # [N, K] bf16 -> [N, K] fp32
    return w.float()


WEIGHT = {"int8": int8_weight, "int4": int4_weight, "bf16": bf16_weight}


# ---------------------------------------------------------------------------------------------
# the ops: what a quantized layer calls, and the eager reference kernel


@torch.library.custom_op("specgraph::int8_linear", mutates_args=())
def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` [M, K] fp32 -> [M, N]: ``x @ (q * scale).T``."""
    return torch.nn.functional.linear(x, int8_weight(q, scale))


@torch.library.custom_op("specgraph::int4_linear", mutates_args=())
def int4_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """``x`` [M, K] fp32 -> [M, N]: ``x @ W.T``, ``W`` the int4 weight of the module docstring."""
    return torch.nn.functional.linear(x, int4_weight(codes, scale, low))


@torch.library.custom_op("specgraph::bf16_linear", mutates_args=())
def bf16_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x`` [M, K] fp32 -> [M, N]: ``x @ float(w).T``."""
    return torch.nn.functional.linear(x, bf16_weight(w))


@int8_linear.register_fake
def _(x, q, scale):
    return x.new_empty(x.shape[0], q.shape[0])


@int4_linear.register_fake
def _(x, codes, scale, low):
    return x.new_empty(x.shape[0], codes.shape[0])


@bf16_linear.register_fake
def _(x, w):
    return x.new_empty(x.shape[0], w.shape[0])


OPS = {"int8": torch.ops.specgraph.int8_linear.default, "int4": torch.ops.specgraph.int4_linear.default,
       "bf16": torch.ops.specgraph.bf16_linear.default}


# ---------------------------------------------------------------------------------------------
# the compiled forms


def _per_row(x, dot):
    """``[dot(x[m]) for m]`` stacked [M, N]: ``dot(xm [K]) -> [N]``, the reduction over K of one
    row. A static M unrolls into M reductions of one loop nest (Inductor fuses them: each weight
    element is loaded and dequantized once for all M rows); a dynamic M broadcasts instead."""
    M = x.shape[0]
    if isinstance(M, int):
        return torch.stack([dot(x[m]) for m in range(M)])
    return dot(x[:, None, :]).reshape(M, -1)


def _rows_int8(x, q, scale):  # [M, K], [N, K] int8, [N] -> [M, N]
    w = q.float()
    return _per_row(x, lambda xm: (w * xm).sum(-1)) * scale


def _int4_half(c, scale, low):  # [N, H] float codes, [N, H / GROUP] x2 -> [N, H] fp32 weights
    N, H = c.shape
    return (c.view(N, H // GROUP, GROUP) * scale[..., None] + low[..., None]).view(N, H)


def _rows_int4(x, codes, scale, low):  # [M, K], [N, K/2] uint8, [N, G] x2 -> [M, N]
    H, g = codes.shape[1], scale.shape[1] // 2
    c = codes.to(torch.int32)  # nibbles of 32-bit lanes: ~25% faster in Inductor's CPU loops than of bytes
    lo = _int4_half((c & 15).float(), scale[:, :g], low[:, :g])
    hi = _int4_half((c >> 4).float(), scale[:, g:], low[:, g:])
    return _per_row(x, lambda xm: (lo * xm[..., :H]).sum(-1) + (hi * xm[..., H:]).sum(-1))


def _rows_bf16(x, w):  # [M, K], [N, K] bf16 -> [M, N]
    wf = w.float()
    return _per_row(x, lambda xm: (wf * xm).sum(-1))


_ROWS = {"int8": _rows_int8, "int4": _rows_int4, "bf16": _rows_bf16}


def rows_form(fmt: str):
    """``(x [M, K], *stored) -> [M, N]`` as a reduction over K per output: for few rows."""
    return _ROWS[fmt]


def _dense_int8(x, q, scale):
    return x @ int8_weight(q, scale).t()


def _dense_int4(x, codes, scale, low):
    return x @ int4_weight(codes, scale, low).t()


def _dense_bf16(x, w):
    return x @ bf16_weight(w).t()


_DENSE = {"int8": _dense_int8, "int4": _dense_int4, "bf16": _dense_bf16}


def dense_form(fmt: str):
    """``(x [M, K], *stored) -> [M, N]`` as the dequantized weight and a GEMM: for many rows."""
    return _DENSE[fmt]


def int4_fits(in_features: int) -> bool:
    """Whether a weight with K = ``in_features`` has the int4 layout: whole groups in each half of K."""
    return in_features % (2 * GROUP) == 0
