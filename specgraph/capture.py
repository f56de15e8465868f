"""Capture one model step as an FX graph with every piece of state explicit.

Route: ``torch.export`` (non-strict) of :class:`Step`, which runs the *unmodified* HF model with a
tensor-backed cache (:class:`SlotCache`) and an explicit additive 4-D float mask. Why this route:

* transformers (>= 5) passes a prepared 4-D mask straight to the attention functions, so the
  captured graph has no causal-mask construction to fight, and every SDPA call reads the mask input;
* the cache writes are in-place ``index_put_`` on the K/V inputs at caller-given slots, per row, so
  rollback is free (rejected slots are masked and later overwritten) and rows of a batch advance
  independently;
* non-strict export takes ~1 s on tiny models (strict dynamo export works too but is slower, and
  strict export of HF's own StaticCache needs far more graph surgery: its write index is a shared
  counter, so per-row slots are impossible without rewriting it).

Step signature (all tensors)::

    forward(input_ids [B, Q] long, position_ids [B, Q] long, mask [B, 1, Q, S] float (0 / -inf),
            slots [B, Q] long, *kv)  ->  (logits [B, Q, V], last_hidden [B, Q, H])

``kv`` is k0, v0, k1, v1, ... each [B, H_kv, S, D], mutated in place.
"""
from __future__ import annotations

import inspect

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from specgraph.passes.window import banded_mask


class SlotLayer(CacheLayerMixin):
    """One layer's K/V, written at per-row slots; never concatenated."""

    is_compileable = True

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor):
        super().__init__()
        self.keys, self.values, self.slots = keys, values, slots  # [B, H, S, D] x2, [B, Q]
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states):
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        # index_put_ (not scatter_): Inductor re-inplaces index_put on graph inputs, whereas a
        # functionalized scatter_ copies the whole cache twice per layer per step.
        rows = torch.arange(key_states.shape[0], device=self.slots.device).unsqueeze(1)  # [B, 1]
        self.keys[rows, :, self.slots] = key_states.transpose(1, 2)  # [B, Q, H, D] at [b, :, slot]
        self.values[rows, :, self.slots] = value_states.transpose(1, 2)
        return self.keys, self.values

    def get_mask_sizes(self, query_length):
        return self.keys.shape[2], 0

    def get_seq_length(self):
        return 0  # only consulted when position_ids is None; Step always passes them

    def get_max_length(self):
        return self.keys.shape[2]


class SlotCache(Cache):
    def __init__(self, kv, slots):
        super().__init__(layers=[SlotLayer(kv[2 * i], kv[2 * i + 1], slots) for i in range(len(kv) // 2)])


class Step(torch.nn.Module):
    """``all_logits=False`` is for steps run only to write the cache (a prompt's prefill, a draft's
    catch-up): logits at the last position only where the model's forward takes
    ``logits_to_keep``, and no features (returns ``(logits, None)``). The full [B, P, V] logits of
    a prefill are 0.6 GB at B = 32 for SmolLM2's prompts, all thrown away."""

    def __init__(self, model, all_logits: bool = True):
        super().__init__()
        self.model = model
        self.all_logits = all_logits
        self.trim = not all_logits and "logits_to_keep" in inspect.signature(model.forward).parameters

    def forward(self, input_ids, position_ids, mask, slots, *kv):
        windows = layer_windows(self.model)
        if uses_alibi(self.model):  # no mask: transformers' ALiBi biases then count slots (= positions); the
            mask = None             # pipeline points each layer's score mask at the step's mask input
        elif windows is not None:  # each layer kind its mask (transformers takes the mapping as is)
            mask = {"full_attention": mask, "sliding_attention": banded_mask(mask, position_ids, windows[1])}
        out = self.model(
            input_ids=input_ids, position_ids=position_ids, attention_mask=mask,
            past_key_values=SlotCache(kv, slots), use_cache=True, output_hidden_states=self.all_logits,
            **({"logits_to_keep": 1} if self.trim else {}),
        )
        return out.logits, out.hidden_states[-1] if self.all_logits else None


class UnsupportedModel(ValueError):
    """The model cannot be captured/rewritten; callers fall back to the eager path."""


def kv_layout(model) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) from the config."""
    c = model.config.get_text_config(decoder=True)
    layers = getattr(c, "num_hidden_layers", None)
    heads = getattr(c, "num_attention_heads", None)
    if layers is None or heads is None:
        raise UnsupportedModel(f"{type(model).__name__}: config has no num_hidden_layers/num_attention_heads")
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    return layers, kv_heads, head_dim


def new_kv_cache(model, batch: int, slots: int, dtype=None, device=None) -> list[torch.Tensor]:
    layers, kv_heads, head_dim = kv_layout(model)
    p = next(model.parameters())
    shape = (batch, kv_heads, slots, head_dim)
    return [torch.zeros(shape, dtype=dtype or p.dtype, device=device or p.device) for _ in range(2 * layers)]


def check_supported(model) -> None:
    """Reject, with the reason, models the capture route does not handle."""
    c = model.config.get_text_config(decoder=True)
    if getattr(c, "is_encoder_decoder", False):
        raise UnsupportedModel("encoder-decoder models are not supported (causal LMs only)")
    impl = getattr(model.config, "_attn_implementation", None)
    if impl not in ATTENTION:  # others (flash, flex, ...) take no additive float mask: the eager fallback serves them
        raise UnsupportedModel(f"attention implementation {impl!r} is not supported; load with "
                               "attn_implementation='sdpa' (or 'eager')")
    if getattr(c, "alibi", False) and getattr(c, "model_type", None) != "bloom" or getattr(c, "model_type", None) == "mpt":
        raise UnsupportedModel("this ALiBi attention builds its position biases from a 2-D padding mask, which the "
                               "captured step replaces with its own 4-D mask")
    layer_types = getattr(c, "layer_types", None) or []
    other = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if other:
        raise UnsupportedModel(f"attention layer types {other} are not encoded in specgraph's masks")
    kv_layout(model)


# attention implementations whose captured step reads the step's additive float mask: SDPA (the
# passes rewrite its calls) and transformers' eager attention (it adds the prepared mask to the
# scores as it is; with the whole cache as keys: see full_width)
ATTENTION = ("sdpa", "eager")


def uses_alibi(model) -> bool:
    """Bloom's ALiBi: position biases from the key's index in the cache (slot = position for every
    committed key and every chain draft; tree nodes are not at their positions, so trees are refused)."""
    return getattr(model.config, "model_type", None) == "bloom"


def full_width(model) -> bool:
    """Whether the model's attention reads the whole cache (eager attention: its key length is
    fixed in the captured graph), so every round passes a mask over all slots."""
    return getattr(model.config, "_attn_implementation", None) != "sdpa"


def layer_windows(model) -> tuple[list[str], int] | None:
    """(layer types, window) of a model whose layers mix sliding-window and full attention; None
    when every layer attends the same way (a uniform window is part of the step's mask itself)."""
    c = model.config.get_text_config(decoder=True)
    types = list(getattr(c, "layer_types", None) or [])
    window = getattr(c, "sliding_window", None)
    if window is None or "sliding_attention" not in types or all(t == "sliding_attention" for t in types):
        return None
    return types, int(window)


@torch.no_grad()
def capture_step(model, batch: int, q_len: int, slots: int, max_batch: int | None = None) -> torch.fx.GraphModule:
    """Export one step for static shapes (B, Q, S) and return it as a flat-argument GraphModule.
    ``max_batch``: the batch is a dynamic dimension instead, 2 .. ``max_batch`` (traced at
    ``batch``, which must lie in that range): the graph reads its batch from its inputs' shapes."""
    check_supported(model)
    if max_batch is not None and not 2 <= batch <= max_batch:
        raise ValueError(f"a dynamic-batch step is traced at a batch in 2..{max_batch}, got {batch}")
    p = next(model.parameters())
    args = (
        torch.zeros(batch, q_len, dtype=torch.long, device=p.device),
        torch.arange(q_len, device=p.device).expand(batch, q_len).contiguous(),
        torch.zeros(batch, 1, q_len, slots, dtype=p.dtype, device=p.device),
        torch.arange(q_len, device=p.device).expand(batch, q_len).contiguous(),
        *new_kv_cache(model, batch, slots),
    )
    dynamic = None
    if max_batch is not None:
        b = torch.export.Dim("batch", min=2, max=max_batch)
        dynamic = {"input_ids": {0: b}, "position_ids": {0: b}, "mask": {0: b}, "slots": {0: b},
                   "kv": tuple({0: b} for _ in args[4:])}
    try:
        ep = torch.export.export(Step(model), args, dynamic_shapes=dynamic, strict=False)
    except Exception as e:  # noqa: BLE001 - any capture failure means: not rewritable
        raise UnsupportedModel(f"torch.export failed for {type(model).__name__}: {type(e).__name__}: {e}") from e
    gm = ep.module()
    # ep.module() checks input shapes against the example inputs; passes change the mask width
    # on purpose (attend_prefix_pass), and the compiled round fixes shapes anyway.
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn":
            gm.graph.erase_node(node)
    # ep.module() wraps inputs/outputs in pytree specs; the passes add and rewire placeholders, so
    # switch to plain positional codegen (forward(*flat_args) -> tuple).
    gm.graph._codegen = torch.fx.graph.CodeGen()
    gm.recompile()
    return gm
