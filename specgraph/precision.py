"""The precision of a compiled model's weights: ``compile(model, weights=...)``.

The target of speculative decoding is the model *at the chosen precision*: :func:`quantize`
returns that model, an HF model like the one given (its ``generate`` is the reference every
exactness test compares with), whose linear layers read one copy of their weights in the chosen
format. Every graph of a compiled object reads that one copy (the graphs are built unfrozen), so
a lower precision is both fewer bytes per step and no per-graph weight copies.

=============  ==============================================  ===================================
``weights``    linear layers' weights                          their matmul
=============  ==============================================  ===================================
float32        fp32 (the model as given)                       MKL / Inductor (frozen, prepacked)
bfloat16       bf16                                            fp32 activations and accumulation,
int8           int8, a scale per output channel (symmetric)    the weight dequantized in the
int4           int4, a scale and an offset per 32 inputs       fused matmul
native         a GGUF model's own blocks (:mod:`specgraph.gguf_weights`)
=============  ==============================================  ===================================

Only the linear layers (the LM head too) change, and only in their weights: activations,
embeddings, norms, attention, the KV cache and residuals stay fp32, and every product is summed
in fp32. Each layer calls one op of :mod:`specgraph.kernels.dequant_linear`: eagerly (``generate``,
the reference) it dequantizes the weight and runs an fp32 GEMM; in a compiled graph
(:func:`specgraph.passes.dequant_linear_pass`) it reads the stored weight and dequantizes it in
registers. The two differ only in summation order, as they do at ``float32``, so greedy output
equals ``generate`` on the quantized model just as it does at full precision.
A linear whose input count is not a multiple of 64 cannot take the int4 layout and stays bf16.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from specgraph.kernels import dequant_linear as dq

WEIGHTS = ("float32", "bfloat16", "int8", "int4", "native")
INT4_GROUP = dq.GROUP  # inputs per int4 scale/offset: GGUF's Q4 block size


class _StoredLinear(nn.Module):
    """A linear layer whose weight is stored in ``fmt`` (:mod:`specgraph.kernels.dequant_linear`);
    each subclass's ``stored()`` gives the op's weight arguments."""

    fmt: str

    def forward(self, x):  # [..., K] fp32 -> [..., N] fp32
        y = dq.OPS[self.fmt](x.reshape(-1, self.in_features), *self.stored())
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def dequantized(self) -> torch.Tensor:  # [N, K] float32
        return dq.WEIGHT[self.fmt](*self.stored())


class BF16Linear(_StoredLinear):
    """``y = x @ W.T + bias`` with ``W`` stored in bf16."""

    fmt = "bf16"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight_bf16", weight.detach().to(torch.bfloat16).contiguous())  # [N, K]
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def stored(self):
        return (self.weight_bf16,)


class Int8Linear(_StoredLinear):
    """``y = x @ (q * scale).T + bias``: weight-only int8, one scale per output channel."""

    fmt = "int8"

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = qweight.shape[1], qweight.shape[0]
        self.register_buffer("qweight", qweight)  # [N, K] int8
        self.register_buffer("scale", scale)  # [N] float32
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias) -> "Int8Linear":
        """Symmetric per-channel int8 of ``weight`` [N, K] (any float dtype)."""
        w = weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
        return cls(q, scale, None if bias is None else bias.detach().clone())

    def stored(self):
        return self.qweight, self.scale


class Int4Linear(_StoredLinear):
    """``y = x @ W.T + bias`` with ``W[n, k] = c[n, k] * scale[n, g] + low[n, g]``,
    ``g = k // 32``, codes ``c`` in 0..15 packed two per byte
    (:mod:`specgraph.kernels.dequant_linear`): a scale and an offset per 32 inputs."""

    fmt = "int4"

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, bias):
        super().__init__()
        self.out_features, self.in_features = codes.shape[0], 2 * codes.shape[1]
        self.register_buffer("codes", codes)  # [N, K / 2] uint8
        self.register_buffer("scale", scale)  # [N, K / 32] float32
        self.register_buffer("low", low)  # [N, K / 32] float32
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @staticmethod
    def fits(out_features: int, in_features: int) -> bool:
        """Whether a [N, K] weight takes the int4 layout (any N; see :func:`dequant_linear.int4_fits`)."""
        return dq.int4_fits(in_features)

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, bias) -> "Int4Linear":
        """The layer of codes [N, K] (0..15) with ``scale`` and ``low`` [N, K / 32]."""
        return cls(dq.pack_int4(codes), scale.float().contiguous(), low.float().contiguous(),
                   None if bias is None else bias.detach().clone())

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias) -> "Int4Linear":
        """Asymmetric int4 of ``weight`` [N, K] per 32 inputs: each group's range in 16 steps."""
        N, K = weight.shape
        w = weight.detach().float().reshape(N, K // INT4_GROUP, INT4_GROUP)
        lo, hi = w.amin(dim=-1), w.amax(dim=-1)
        scale = ((hi - lo) / 15).clamp(min=torch.finfo(torch.float32).tiny)
        codes = torch.round((w - lo[..., None]) / scale[..., None]).clamp(0, 15).reshape(N, K)
        return cls.from_codes(codes, scale, lo, bias)

    def stored(self):
        return self.codes, self.scale, self.low


def as_given(model) -> str:
    """The precision ``model`` runs at as it is: what :func:`quantize` gave it, else its dtype's name."""
    marked = getattr(model, "specgraph_weights", None)
    if marked is not None:
        return marked
    return str(next(model.parameters()).dtype).removeprefix("torch.")


def linear_weight(module) -> torch.Tensor | None:
    """The [N, K] weight of a linear layer: ``nn.Linear``, or transformers' ``Conv1D`` (GPT-2
    style, weight stored [K, N]); None for any other module."""
    if type(module) is nn.Linear:
        return module.weight
    if type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None and module.weight.dim() == 2:
        return module.weight.t()
    return None


def _quantized_linear(module, w: torch.Tensor, weights: str):
    if weights == "int8":
        return Int8Linear.quantize(w, module.bias)
    if weights == "int4" and Int4Linear.fits(*w.shape):
        return Int4Linear.quantize(w, module.bias)
    return BF16Linear(w, module.bias)


def quantize(model, weights: str, shared: dict | None = None):
    """``model`` at precision ``weights`` (one of :data:`WEIGHTS` but ``"native"``): a new model
    (``model`` itself is not changed; ``"float32"`` on an fp32 model returns it as is) whose
    ``generate`` is the reference for a compiled object with ``weights=weights``.

    Every linear layer (:func:`linear_weight`; the LM head too) is converted from ``model``'s
    own weights; the rest stays as it is (a tied embedding keeps its fp32 table beside the
    converted head). ``shared``: ``{id(tensor of model): tensor}``, tensors the copy takes as
    they are instead of copying them (:func:`specgraph.drafters.self_int4` shares the target's)."""
    if weights not in WEIGHTS or weights == "native":
        raise ValueError(f"quantize takes one of {tuple(w for w in WEIGHTS if w != 'native')}, got {weights!r}")
    current = as_given(model)
    if current == weights:
        return model
    device = next(model.parameters()).device
    if weights in ("int8", "int4") and device.type != "cpu":
        raise ValueError(f"weights={weights!r} is built and tested for the CPU; the model is on "
                         f"{device}: use weights='float32' or 'bfloat16' there")
    if current != "float32":
        raise ValueError(f"the model is already at weights={current!r}: quantize the original (fp32) model")
    return with_linears(model, lambda name, module, weight: _quantized_linear(module, weight, weights), weights,
                        shared)


def with_linears(model, convert, weights: str, shared: dict | None = None):
    """A copy of ``model``, marked as precision ``weights``, in which each linear layer
    (:func:`linear_weight`) is ``convert(name, layer, its [N, K] weight)`` unless that returns
    None (the replaced layers' float weights are never copied). ``shared``:
    ``{id(tensor of model): tensor}``, tensors the copy takes as they are."""
    memo = dict(shared or {})
    for name, module in model.named_modules():
        weight = linear_weight(module)
        if weight is not None and id(module) not in memo:
            replacement = convert(name, module, weight)
            if replacement is not None:
                memo[id(module)] = replacement
    out = copy.deepcopy(model, memo)
    out.specgraph_weights = weights
    return out.eval()
