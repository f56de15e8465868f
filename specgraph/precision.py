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
bfloat16       bf16                                            oneDNN bf16, fp32 accumulation
int8           int8, a scale per output channel (symmetric)    ``aten._weight_int8pack_mm``
int4           int4, a scale and an offset per 32 inputs       ``aten._weight_int4pack_mm_for_cpu``
native         a GGUF model's own blocks (:mod:`specgraph.gguf_weights`)
=============  ==============================================  ===================================

Only the linear layers (the LM head too) change: each rounds its input to bf16, runs its kernel
(the CPU int8 / int4 weight-pack kernels are fast for bf16 inputs only, several times slower for
fp32 ones) and returns fp32. Everything between them (embeddings, norms, attention, the KV cache,
residuals) stays fp32. That keeps the model's law computable the same way by ``generate`` and by
the compiled rounds: each kernel gives a row the same bits whatever the rows beside it, and the
fp32 parts differ between the two only in summation order, as they do at ``float32``. (A whole
bf16 model is not: a bf16 attention's output rounding differs between HF's growing cache and a
static cache read under a mask, and bf16 logits tie often, so greedy output would drift.)
A linear the int4 kernel cannot take (an output count not a multiple of 16, or an input count not
a multiple of 32) is a bf16 layer.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

WEIGHTS = ("float32", "bfloat16", "int8", "int4", "native")
ACTIVATIONS = torch.bfloat16  # what a low-precision layer's kernel reads and writes (in and out: fp32)
INT4_GROUP = 32  # inputs per int4 scale/offset: GGUF's Q4 block size (64 and 128 run no faster here)


class BF16Linear(nn.Module):
    """``y = x @ W.T + bias`` with ``W`` in bf16: the input rounded to bf16, fp32 accumulation."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight_bf16", weight.detach().to(ACTIVATIONS).contiguous())  # [N, K]
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def forward(self, x):  # [..., K] -> [..., N], x's dtype
        y = nn.functional.linear(x.to(ACTIVATIONS), self.weight_bf16).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def dequantized(self) -> torch.Tensor:  # [N, K] float32
        return self.weight_bf16.float()


class Int8Linear(nn.Module):
    """``y = x @ (q * scale).T + bias``: weight-only int8, one scale per output channel."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = qweight.shape[1], qweight.shape[0]
        self.register_buffer("qweight", qweight)  # [N, K] int8
        self.register_buffer("scale", scale)  # [N], the activation dtype
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias, dtype=ACTIVATIONS) -> "Int8Linear":
        """Symmetric per-channel int8 of ``weight`` [N, K] (any float dtype; scales from fp32)."""
        w = weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
        return cls(q, scale.to(dtype), None if bias is None else bias.detach().clone())

    def forward(self, x):  # [..., K] -> [..., N], x's dtype
        a = x.reshape(-1, self.in_features).to(ACTIVATIONS)
        y = torch.ops.aten._weight_int8pack_mm(a, self.qweight, self.scale).to(x.dtype)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def dequantized(self) -> torch.Tensor:  # [N, K] float32
        return self.qweight.float() * self.scale.float()[:, None]


@torch.library.custom_op("specgraph::int4_mm", mutates_args=())
def int4_mm(a: torch.Tensor, packed: torch.Tensor, group: int, scale_zero: torch.Tensor) -> torch.Tensor:
    """``aten._weight_int4pack_mm_for_cpu`` as an opaque op: Inductor's own lowering of it adds
    the group size as a tensor constant of the graph, which an unfrozen AOTInductor package cannot
    bind to a model tensor; this op reaches the same kernel as an extern call."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(a, packed, group, scale_zero)


@int4_mm.register_fake
def _(a, packed, group, scale_zero):
    return a.new_empty(a.shape[0], packed.shape[0])


class Int4Linear(nn.Module):
    """``y = x @ W.T + bias`` with ``W[n, k] = (q[n, k] - 8) * scale[g, n] + zero[g, n]``,
    ``g = k // group``: weight-only int4 with a scale and an offset per ``group`` inputs, the
    weight in the CPU kernel's packed layout."""

    def __init__(self, packed: torch.Tensor, scale_zero: torch.Tensor, bias, in_features: int, group: int):
        super().__init__()
        self.in_features, self.out_features, self.group = in_features, packed.shape[0], group
        self.register_buffer("packed", packed)  # [N, K / 2] uint8
        self.register_buffer("scale_zero", scale_zero)  # [K / group, N, 2], the activation dtype
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @staticmethod
    def fits(out_features: int, in_features: int, group: int = INT4_GROUP) -> bool:
        return out_features % 16 == 0 and in_features % group == 0

    @classmethod
    def fit(cls, weight: torch.Tensor, bias, scale, zero, group: int = INT4_GROUP, dtype=ACTIVATIONS) -> "Int4Linear":
        """The int4 layer nearest ``weight`` [N, K] with ``scale`` and ``zero`` [N, K / group]
        (the formula above). The kernel reads scales and offsets in the activation dtype, so they
        are rounded to it first and the codes are rounded against the rounded values: each weight
        is then off by at most half a step, never by a whole block's rounded offset."""
        N, K = weight.shape
        scale, zero = scale.to(dtype).float(), zero.to(dtype).float()
        w = weight.detach().float().reshape(N, K // group, group)
        q = torch.round((w - zero[..., None]) / scale[..., None]) + 8
        q = q.clamp(0, 15).reshape(N, K).to(torch.int32).contiguous()
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 8)
        scale_zero = torch.stack([scale.t(), zero.t()], dim=-1).to(dtype).contiguous()
        return cls(packed, scale_zero, None if bias is None else bias.detach().clone(), K, group)

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias, group: int = INT4_GROUP, dtype=ACTIVATIONS) -> "Int4Linear":
        """Asymmetric int4 of ``weight`` per ``group`` inputs: each group's range in 16 steps."""
        N, K = weight.shape
        w = weight.detach().float().reshape(N, K // group, group)
        lo, hi = w.amin(dim=-1), w.amax(dim=-1)
        scale = ((hi - lo) / 15).clamp(min=torch.finfo(torch.float32).tiny)
        return cls.fit(weight, bias, scale, lo + 8 * scale, group, dtype)

    def forward(self, x):  # [..., K] -> [..., N], x's dtype
        a = x.reshape(-1, self.in_features).to(ACTIVATIONS)
        y = int4_mm(a, self.packed, self.group, self.scale_zero).to(x.dtype)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def dequantized(self) -> torch.Tensor:  # [N, K] float32, through the kernel (an identity input)
        eye = torch.eye(self.in_features, dtype=self.scale_zero.dtype)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, self.group, self.scale_zero).float().t()


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
        raise ValueError(f"weights={weights!r} runs the CPU's int8 / int4 weight-pack kernels; the model is on "
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
