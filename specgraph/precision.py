"""The precision of a compiled model's weights: ``compile(model, weights=...)``.

The target of speculative decoding is the model *at the chosen precision*: :func:`quantize`
returns that model, an HF model like the one given (its ``generate`` is the reference every
exactness test compares with), whose linear layers read one copy of their weights in the chosen
format. Every graph of a compiled object reads that one copy (the graphs are built unfrozen), so
quantized weights are both fewer bytes per step and no per-graph weight copies.

=============  ========================  ==========================  ============================
``weights``    linear weights            everything else             matmul
=============  ========================  ==========================  ============================
float32        fp32 (the model as given) fp32                        MKL / Inductor (frozen)
bfloat16       bf16                      bf16                        oneDNN bf16, fp32 accumulation
int8           int8, a scale per output  bf16                        ``aten._weight_int8pack_mm``
               channel (symmetric)
int4           int4, a scale and offset  bf16                        ``aten._weight_int4pack_mm_for_cpu``
               per 32 inputs
native         a GGUF model at its own precision (:func:`specgraph.gguf_weights.native_model`)
=============  ========================  ==========================  ============================

Quantized linears compute with bf16 activations: the CPU int8 / int4 weight-pack kernels are fast
for bf16 inputs and several times slower for fp32 ones. A linear the int4 kernel cannot take (an
output count not a multiple of 16, or an input count not a multiple of 32) stays bf16.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

WEIGHTS = ("float32", "bfloat16", "int8", "int4", "native")
ACTIVATIONS = torch.bfloat16  # the activation dtype of the quantized precisions
INT4_GROUP = 32  # inputs per int4 scale/offset: GGUF's Q4 block size (64 and 128 run no faster here)


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
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        return cls(q, scale.to(dtype), None if bias is None else bias.detach().to(dtype))

    def forward(self, x):  # [..., K] -> [..., N]
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, self.in_features), self.qweight, self.scale)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def dequantized(self) -> torch.Tensor:  # [N, K] float32
        return self.qweight.float() * self.scale.float()[:, None]


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
    def from_codes(cls, q, scale, zero, bias, group: int = INT4_GROUP, dtype=ACTIVATIONS) -> "Int4Linear":
        """From codes ``q`` [N, K] in 0..15 and ``scale``, ``zero`` [N, K / group] (the formula
        above): what GGUF's Q4 blocks hold, after :func:`int4_codes` or a file's own values."""
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 8)
        scale_zero = torch.stack([scale.t(), zero.t()], dim=-1).to(dtype).contiguous()
        return cls(packed, scale_zero, None if bias is None else bias.detach().to(dtype), q.shape[1], group)

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias, group: int = INT4_GROUP, dtype=ACTIVATIONS) -> "Int4Linear":
        q, scale, zero = int4_codes(weight, group)
        return cls.from_codes(q, scale, zero, bias, group, dtype)

    def forward(self, x):  # [..., K] -> [..., N]
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, self.in_features), self.packed, self.group,
                                                       self.scale_zero)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def dequantized(self) -> torch.Tensor:  # [N, K] float32, through the kernel (an identity input)
        eye = torch.eye(self.in_features, dtype=self.scale_zero.dtype)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, self.group, self.scale_zero).float().t()


def int4_codes(weight: torch.Tensor, group: int = INT4_GROUP):
    """Asymmetric int4 codes of ``weight`` [N, K] per ``group`` inputs: (q [N, K] in 0..15,
    scale [N, K / group], zero [N, K / group]) with ``W ~ (q - 8) * scale + zero``."""
    N, K = weight.shape
    w = weight.detach().float().reshape(N, K // group, group)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    scale = ((hi - lo) / 15).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round((w - lo[..., None]) / scale[..., None]).clamp(0, 15).reshape(N, K)
    return q, scale, lo + 8 * scale


def as_given(model) -> str:
    """The precision ``model`` runs at as it is: what :func:`quantize` gave it, else its dtype's name."""
    marked = getattr(model, "specgraph_weights", None)
    if marked is not None:
        return marked
    return str(next(model.parameters()).dtype).removeprefix("torch.")


def resolve(weights, model) -> str:
    """``weights`` checked; None: the model as given (:func:`as_given`)."""
    if weights is None:
        return as_given(model)
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
    return weights


def model_at(model, weights: str):
    """``model`` at precision ``weights`` (from :func:`resolve`): ``model`` itself when it is
    already there, else :func:`quantize`."""
    if weights == as_given(model):
        return model
    return quantize(model, weights)


def _quantized_linear(module: nn.Linear, weights: str):
    if weights == "int8":
        return Int8Linear.quantize(module.weight, module.bias)
    if Int4Linear.fits(module.out_features, module.in_features):
        return Int4Linear.quantize(module.weight, module.bias)
    return None  # stays a bf16 Linear


def quantize(model, weights: str):
    """``model`` at precision ``weights`` (one of :data:`WEIGHTS` but ``"native"``): a new model
    (``model`` itself is not changed; ``"float32"`` on an fp32 model returns it as is) whose
    ``generate`` is the reference for a compiled object with ``weights=weights``.

    ``int8`` / ``int4`` quantize every ``nn.Linear`` (the LM head too) from ``model``'s own
    weights and cast the rest to bf16; a tied embedding stays bf16 beside its quantized head."""
    if weights not in WEIGHTS or weights == "native":
        raise ValueError(f"quantize takes one of {tuple(w for w in WEIGHTS if w != 'native')}, got {weights!r}")
    current = as_given(model)
    if current == weights:
        return model
    if current not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"the model is already at weights={current!r}: quantize the original model")
    if weights == "float32":
        raise ValueError(f"weights='float32' needs an fp32 model, got {current}")
    memo = {}
    if weights in ("int8", "int4"):
        for module in model.modules():
            if type(module) is nn.Linear:
                q = _quantized_linear(module, weights)
                if q is not None:
                    memo[id(module)] = q
    # the deep copy takes the quantized linears in place of the originals (their fp32 weights
    # are never copied), and copies the rest, which is then cast
    out = copy.deepcopy(model, memo)
    out.to(torch.bfloat16)
    out.specgraph_weights = weights
    return out.eval()


def weight_bytes_by_format(model) -> dict[str, int]:
    """Bytes of ``model``'s distinct tensors by dtype name (tied tensors counted once)."""
    seen, out = set(), {}
    for t in (*model.parameters(), *model.buffers()):
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        name = str(t.dtype).removeprefix("torch.")
        out[name] = out.get(name, 0) + t.numel() * t.element_size()
    return out
