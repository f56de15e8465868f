"""Drafter heads fed by the target's last hidden state: EAGLE (one decoder layer) and Medusa.

Both heads read the target's *final* feature: ``last_hidden`` of :class:`specgraph.capture.Step`,
i.e. HF's ``hidden_states[-1]``, which is taken after the final norm (``lm_head(last_hidden)`` is
the target's logits). Neither head stores an embedding or an LM head: they use the target's own
weights, bound at load time (:meth:`EagleHead.bind`), so a head file only holds the small trained
part. Logits are over a *draft vocabulary*: ``d2t`` [Vd] long maps draft index -> target token id
(by default the full vocabulary; a reduced one of the most frequent tokens cuts the head's GEMV:
for SmolLM2 the full LM head is 49152 x 576 = 28M weights, ~7x the head's decoder layer (4.2M),
while 8192 rows (98% of stdlib text tokens) cost about as much as the layer).

EAGLE (Li et al., 2024), our formulation. Head position p reads the token that *follows* p and
the feature at p::

    x_p   = fc([norm_e(embed(token_{p+1})), norm_f(feature_p)])      # [B, Q, H]
    h_p   = decoder_layer(x_p)   # Llama-style: RMSNorm, rotary, GQA attention, SwiGLU MLP
    g_p   = norm_o(h_p)          # predicted feature_{p+1}, in the target's final-feature space
    logits_p = W_lm[d2t] @ g_p   # predicted distribution of token_{p+2}

Drafting one token deeper feeds ``g_p`` back as the next feature. The attention takes an explicit
additive mask and explicit K/V tensors (written in place at per-row slots, like the target's
:class:`specgraph.capture.SlotCache`), so one head step is a static graph.

Medusa (Cai et al., 2024): K heads, head k (k = 1..K) maps feature_t to a feature whose LM-head
logits predict token_{t+k+1}, through residual SiLU blocks ``x + SiLU(W x + b)`` (W, b zero
initialised, so an untrained head repeats the target's next-token prediction). The heads share the
target's LM head (rows ``d2t``): each head then costs 0.33M weights for SmolLM2 instead of 28M,
which keeps the file at ~3 MB (a per-head LM head would be 57 MB per head in fp16) and the
per-round cost at K small GEMVs over the draft vocabulary. The price is capacity: a shared,
frozen LM head means the residual blocks must move the feature to where the target's own
head reads the future token; ``num_layers`` > 1 adds capacity.

Files: safetensors only (no pickle anywhere). The header's metadata records the format, the kind,
the head config, the target fingerprint (:func:`model_fingerprint`: sha256 of the target's config
JSON without volatile fields + its input-embedding matrix) and a short description of the target;
:func:`load_head` refuses a file whose fingerprint differs from the model it is loaded for.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from pathlib import Path

import torch
from torch import nn

HEAD_FORMAT = "specgraph-head"
HEAD_FORMAT_VERSION = "1"
KINDS = ("eagle", "medusa")
NEG_INF = float("-inf")


class HeadFileError(ValueError):
    """A head file is unreadable, not safetensors, or not a specgraph head."""


class HeadMismatchError(HeadFileError):
    """A head file was trained for another target model."""


# ----------------------------------------------------------------------------------------------
# fingerprint


# Config fields that change between loads of the same weights (paths, versions, dtype, runtime
# switches), that a loader may or may not fill in, or that users set for batching (special token
# ids) without changing what the network computes; everything else is structural and hashed.
_VOLATILE = {
    "bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "sep_token_id", "decoder_start_token_id",
    "initializer_range",
    "transformers_version", "dtype", "torch_dtype", "architectures", "use_cache", "output_hidden_states",
    "output_attentions", "return_dict", "quantization_config", "id2label", "label2id", "problem_type",
    "chunk_size_feed_forward", "tie_encoder_decoder", "torchscript", "pruned_heads", "finetuning_task",
    "tokenizer_class", "prefix", "task_specific_params", "attn_implementation", "use_return_dict",
    "name_or_path", "output_scores", "return_dict_in_generate", "dropout", "attention_dropout",
}


def _config_dict(model) -> dict:
    config = model.config
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    d = text.to_dict()
    return {k: v for k, v in d.items() if not k.startswith("_") and k not in _VOLATILE}


def model_fingerprint(model) -> str:
    """sha256 hex of the target's structural config (sorted-key JSON, volatile fields dropped) and
    of its input-embedding matrix.

    The embedding is hashed after a cast to bfloat16, so fp32 and bf16 loads of the same weights
    share a fingerprint (an fp16 load rounds differently and does not). Cached on the model per
    embedding tensor version (~0.1 s for SmolLM2 otherwise)."""
    emb = model.get_input_embeddings().weight
    key = (emb.data_ptr(), emb._version, tuple(emb.shape))
    cached = getattr(model, "_specgraph_fingerprint", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    h = hashlib.sha256()
    h.update(json.dumps(_config_dict(model), sort_keys=True, default=str).encode())
    h.update(str(tuple(emb.shape)).encode())
    w = emb.detach().to("cpu", torch.bfloat16).contiguous()
    h.update(w.view(torch.int16).numpy().tobytes())
    fp = h.hexdigest()
    try:
        model._specgraph_fingerprint = (key, fp)
    except Exception:  # noqa: BLE001 - a model that refuses attributes just recomputes
        pass
    return fp


def describe_model(model) -> dict:
    """A short human description of a target, stored beside the fingerprint for error messages."""
    c = _config_dict(model)
    name = getattr(model.config, "_name_or_path", "") or getattr(model, "name_or_path", "")
    keep = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size")
    return {"name": str(name), **{k: c.get(k) for k in keep}}


# ----------------------------------------------------------------------------------------------
# building blocks (plain torch, no HF modeling imports)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dt = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dt)


def rotary_cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, Q, D] for position ids [B, Q] (rotate-half convention)."""
    freqs = position_ids.to(torch.float32).unsqueeze(-1) * inv_freq  # [B, Q, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x):
    d = x.shape[-1] // 2
    return torch.cat([-x[..., d:], x[..., :d]], dim=-1)


def _apply_rotary(x, cos, sin):  # x [..., Q, D], cos/sin broadcastable
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    """GQA attention with an explicit additive mask; K/V come and go as tensors.

    Queries are grouped per KV head ([B, Hkv, G, Q, D]) so the keys are never repeated."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)

    def project(self, x, cos, sin):
        """q [B, Hkv, G, Q, D], k and v [B, Hkv, Q, D] (rotary applied to q and k)."""
        B, Q, _ = x.shape
        G, D = self.heads // self.kv_heads, self.head_dim
        q = self.q_proj(x).view(B, Q, self.kv_heads, G, D).permute(0, 2, 3, 1, 4)
        k = self.k_proj(x).view(B, Q, self.kv_heads, D).transpose(1, 2)
        v = self.v_proj(x).view(B, Q, self.kv_heads, D).transpose(1, 2)
        q = _apply_rotary(q, cos.unsqueeze(1).unsqueeze(1), sin.unsqueeze(1).unsqueeze(1))
        k = _apply_rotary(k, cos.unsqueeze(1), sin.unsqueeze(1))
        return q, k, v

    def attend(self, q, k, v, mask):
        """q [B, Hkv, G, Q, D]; k, v [B, Hkv, S, D]; mask [B or 1, 1, Q, S] additive -> [B, Q, hidden]."""
        B, Hkv, G, Q, D = q.shape
        scores = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)) * (1.0 / math.sqrt(D))  # [B, Hkv, G, Q, S]
        scores = scores + mask.unsqueeze(2).to(scores.dtype)
        probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
        out = torch.matmul(probs, v.unsqueeze(2))  # [B, Hkv, G, Q, D]
        return self.o_proj(out.permute(0, 3, 1, 2, 4).reshape(B, Q, Hkv * G * D))


class DecoderLayer(nn.Module):
    """Pre-norm Llama block: x + attn(norm(x)), then + SwiGLU(norm(x))."""

    def __init__(self, cfg: dict):
        super().__init__()
        H, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.input_norm = RMSNorm(H, eps)
        self.attn = Attention(H, cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"])
        self.post_norm = RMSNorm(H, eps)
        self.gate_proj = nn.Linear(H, cfg["intermediate_size"], bias=False)
        self.up_proj = nn.Linear(H, cfg["intermediate_size"], bias=False)
        self.down_proj = nn.Linear(cfg["intermediate_size"], H, bias=False)

    def mlp(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def _rope_theta(c) -> float:
    params = getattr(c, "rope_parameters", None) or {}
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    for name in ("rope_theta", "rotary_emb_base"):
        v = getattr(c, name, None)
        if v:
            return float(v)
    return 10000.0


def eagle_config(target_config) -> dict:
    """The head's shapes from the target's (HF) config: the same hidden size, heads and MLP width
    as one target layer. The head's rotary embedding is its own (plain RoPE with the target's
    theta); it does not need the target's rope scaling."""
    c = target_config.get_text_config(decoder=True) if hasattr(target_config, "get_text_config") else target_config
    H = c.hidden_size
    heads = c.num_attention_heads
    kv = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or H // heads
    inter = getattr(c, "intermediate_size", None) or getattr(c, "n_inner", None) or 4 * H
    eps = getattr(c, "rms_norm_eps", None) or getattr(c, "layer_norm_eps", None) or getattr(c, "layer_norm_epsilon", None) or 1e-6
    return dict(
        hidden_size=int(H), intermediate_size=int(inter), num_attention_heads=int(heads), num_key_value_heads=int(kv),
        head_dim=int(head_dim), rms_norm_eps=float(eps), rope_theta=_rope_theta(c), vocab_size=int(c.vocab_size),
    )


def _d2t_tensor(draft_vocab, vocab: int) -> torch.Tensor:
    if draft_vocab is None:
        return torch.arange(vocab, dtype=torch.long)
    if isinstance(draft_vocab, int):  # placeholder ids, filled by load_state_dict
        if not 0 < draft_vocab <= vocab:
            raise ValueError(f"draft vocabulary size {draft_vocab} must be in 1..{vocab}")
        return torch.arange(draft_vocab, dtype=torch.long)
    d2t = torch.as_tensor(draft_vocab, dtype=torch.long).flatten().clone()
    if d2t.numel() == 0 or int(d2t.min()) < 0 or int(d2t.max()) >= vocab:
        raise ValueError(f"draft vocabulary ids must be in 0..{vocab - 1}")
    if torch.unique(d2t).numel() != d2t.numel():
        raise ValueError("draft vocabulary ids must be distinct")
    return d2t


class TargetBound(nn.Module):
    """Shared parts: the draft vocabulary map and the target's embedding / LM-head rows, which are
    non-persistent buffers (never saved; set by :meth:`bind`)."""

    kind = ""

    def _init_vocab(self, draft_vocab, vocab: int):
        self.register_buffer("d2t", _d2t_tensor(draft_vocab, vocab))  # persistent: saved in the file
        self.register_buffer("embed_weight", None, persistent=False)
        self.register_buffer("lm_weight", None, persistent=False)
        self.register_buffer("lm_bias", None, persistent=False)
        self.target_fingerprint: str | None = None
        self.target_description: dict | None = None

    @property
    def draft_vocab_size(self) -> int:
        return self.d2t.shape[0]

    @property
    def full_vocab(self) -> bool:
        return self.draft_vocab_size == self.config["vocab_size"] and bool(
            (self.d2t == torch.arange(self.draft_vocab_size, device=self.d2t.device)).all())

    def bind(self, target_model, fingerprint: bool = True):
        """Use the target's input embedding and LM head (rows ``d2t``). Returns self.

        The embedding is shared (no copy); the LM-head rows are a copy when the draft vocabulary is
        reduced (Vd x H, e.g. 18 MB in fp32 for 8192 x 576), else shared."""
        emb = target_model.get_input_embeddings().weight
        out = target_model.get_output_embeddings()
        if out is None or getattr(out, "weight", None) is None:
            raise ValueError(f"{type(target_model).__name__} has no output embedding (LM head) to share")
        if emb.shape[0] < self.config["vocab_size"] or out.out_features < self.config["vocab_size"] \
                or emb.shape[1] != self.config["hidden_size"]:
            raise HeadMismatchError(
                f"head shapes (vocab {self.config['vocab_size']}, hidden {self.config['hidden_size']}) do not fit "
                f"the target (embedding {tuple(emb.shape)}, LM head of {out.out_features} outputs)")
        d2t = self.d2t.to(out.weight.device)
        with torch.no_grad():
            self.embed_weight = emb.detach()
            self.lm_weight = out.weight.detach() if self.full_vocab else out.weight.detach().index_select(0, d2t)
            bias = getattr(out, "bias", None)
            self.lm_bias = None if bias is None else (bias.detach() if self.full_vocab else bias.detach().index_select(0, d2t))
        if fingerprint:
            self.target_fingerprint = model_fingerprint(target_model)
            self.target_description = describe_model(target_model)
        return self

    def _need_bound(self):
        if self.lm_weight is None:
            raise RuntimeError(f"{type(self).__name__} is not bound to a target: call head.bind(target_model) first")

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [..., Vd] of features [..., H] (map indices with ``d2t``)."""
        self._need_bound()
        return nn.functional.linear(features.to(self.lm_weight.dtype), self.lm_weight, self.lm_bias)


class EagleHead(TargetBound):
    """One-decoder-layer EAGLE drafter over the target's final features (see the module doc).

    ``EagleHead(target_config, draft_vocab=None)``: ``draft_vocab`` is None (full vocabulary), a
    1-D tensor/list of target ids (the reduced vocabulary, draft index -> target id), or an int
    (size only; the ids come from a checkpoint). Call :meth:`bind` with the target model before
    use; :func:`load_head` does that."""

    kind = "eagle"

    def __init__(self, target_config, draft_vocab=None):
        super().__init__()
        cfg = dict(target_config) if isinstance(target_config, dict) else eagle_config(target_config)
        self._init_vocab(draft_vocab, cfg["vocab_size"])
        cfg["draft_vocab_size"] = int(self.d2t.shape[0])
        self.config = cfg
        H, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.embed_norm = RMSNorm(H, eps)
        self.feature_norm = RMSNorm(H, eps)
        self.fc = nn.Linear(2 * H, H, bias=True)
        self.layer = DecoderLayer(cfg)
        self.out_norm = RMSNorm(H, eps)
        D = cfg["head_dim"]
        # a plain attribute, not a buffer: it stays fp32 whatever dtype the head is cast to
        self._inv_freq = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
        self._init_weights()

    def _init_weights(self):
        g = torch.Generator().manual_seed(0)
        std = 0.02
        for m in self.modules():
            if isinstance(m, nn.Linear):
                with torch.no_grad():
                    m.weight.copy_(torch.randn(m.weight.shape, generator=g) * std)
                    if m.bias is not None:
                        m.bias.zero_()
        with torch.no_grad():  # start as "residual = fused input": small residual writes
            self.layer.attn.o_proj.weight.mul_(0.5)
            self.layer.down_proj.weight.mul_(0.5)

    # -- pieces -------------------------------------------------------------------------------
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        self._need_bound()
        return nn.functional.embedding(tokens, self.embed_weight)

    def fuse(self, tokens, features):
        """fc([norm(embed(tokens)), norm(features)]) -> [B, Q, H]."""
        e = self.embed(tokens).to(self.fc.weight.dtype)
        f = features.to(self.fc.weight.dtype)
        return self.fc(torch.cat([self.embed_norm(e), self.feature_norm(f)], dim=-1))

    def rotary(self, position_ids):
        if self._inv_freq.device != position_ids.device:
            self._inv_freq = self._inv_freq.to(position_ids.device)
        return rotary_cos_sin(position_ids, self._inv_freq, self.fc.weight.dtype)

    def _finish(self, x, attn_out):
        h = x + attn_out
        h = h + self.layer.mlp(self.layer.post_norm(h))
        return self.out_norm(h)

    # -- cache step (capturable) -------------------------------------------------------------
    def forward(self, tokens, features, position_ids, mask, slots, k_cache, v_cache):
        """One draft step over Q queries with a slot cache.

        tokens [B, Q] long (target ids: the token that follows each feature's position),
        features [B, Q, H] (target last_hidden, or the head's own previous output),
        position_ids [B, Q] long, mask [B, 1, Q, S] additive float (0 / -inf; row b query i may
        see the slots it is allowed to), slots [B, Q] long (where this step's K/V are written),
        k_cache, v_cache [B, Hkv, S, D] (mutated in place: ``index_put_`` at ``slots``).
        Returns the predicted next features [B, Q, H]; ``logits(out)`` gives the draft logits.
        """
        x = self.fuse(tokens, features)
        cos, sin = self.rotary(position_ids)
        q, k, v = self.layer.attn.project(self.layer.input_norm(x), cos, sin)
        rows = torch.arange(tokens.shape[0], device=slots.device).unsqueeze(1)
        k_cache[rows, :, slots] = k.transpose(1, 2).to(k_cache.dtype)
        v_cache[rows, :, slots] = v.transpose(1, 2).to(v_cache.dtype)
        a = self.layer.attn.attend(q, k_cache.to(q.dtype), v_cache.to(q.dtype), mask)
        return self._finish(x, a)

    step = forward

    # -- functional form (training, unrolled drafting) ----------------------------------------
    def forward_seq(self, tokens, features, position_ids, mask, past_k=None, past_v=None):
        """Like :meth:`forward` without a slot cache: the keys are ``cat(past_k, own keys)``.

        mask [B or 1, 1, Q, P + Q] over (past, own). Returns (out [B, Q, H], k, v [B, Hkv, Q, D])."""
        x = self.fuse(tokens, features)
        cos, sin = self.rotary(position_ids)
        q, k, v = self.layer.attn.project(self.layer.input_norm(x), cos, sin)
        ka = k if past_k is None else torch.cat([past_k, k], dim=2)
        va = v if past_v is None else torch.cat([past_v, v], dim=2)
        return self._finish(x, self.layer.attn.attend(q, ka, va, mask)), k, v

    def new_cache(self, batch: int, slots: int, dtype=None, device=None):
        """Zeroed (k_cache, v_cache) [batch, Hkv, slots, D]."""
        shape = (batch, self.config["num_key_value_heads"], slots, self.config["head_dim"])
        p = self.fc.weight
        return (torch.zeros(shape, dtype=dtype or p.dtype, device=device or p.device),
                torch.zeros(shape, dtype=dtype or p.dtype, device=device or p.device))


class ResBlock(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x):
        return x + nn.functional.silu(self.linear(x))


class MedusaHeads(TargetBound):
    """K Medusa heads over the target's final feature, sharing the target's LM head (rows d2t).

    ``forward(features [B, Q, H]) -> [B, Q, K, H]``; ``logits`` of that is [B, Q, K, Vd]; head k
    (k = 1..K, index k-1) at position t predicts token t+k+1 (the target's own head predicts t+1)."""

    kind = "medusa"

    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int = 4, num_layers: int = 1, draft_vocab=None):
        super().__init__()
        if num_heads < 1 or num_layers < 1:
            raise ValueError(f"need num_heads >= 1 and num_layers >= 1, got {num_heads}, {num_layers}")
        self._init_vocab(draft_vocab, vocab_size)
        self.config = dict(hidden_size=int(hidden_size), vocab_size=int(vocab_size), num_heads=int(num_heads),
                           num_layers=int(num_layers), draft_vocab_size=int(self.d2t.shape[0]))
        self.heads = nn.ModuleList(
            nn.Sequential(*[ResBlock(hidden_size) for _ in range(num_layers)]) for _ in range(num_heads))

    @classmethod
    def for_target(cls, target_config, num_heads: int = 4, num_layers: int = 1, draft_vocab=None):
        c = target_config.get_text_config(decoder=True) if hasattr(target_config, "get_text_config") else target_config
        return cls(c.hidden_size, c.vocab_size, num_heads, num_layers, draft_vocab)

    @classmethod
    def from_config(cls, cfg: dict, draft_vocab=None):
        return cls(cfg["hidden_size"], cfg["vocab_size"], cfg["num_heads"], cfg["num_layers"],
                   draft_vocab if draft_vocab is not None else cfg["draft_vocab_size"])

    @property
    def num_heads(self) -> int:
        return len(self.heads)

    def forward(self, features):
        x = features.to(self.heads[0][0].linear.weight.dtype)
        return torch.stack([h(x) for h in self.heads], dim=-2)


def build_head(kind: str, config: dict, draft_vocab=None) -> TargetBound:
    if kind == "eagle":
        return EagleHead(dict(config), draft_vocab if draft_vocab is not None else config.get("draft_vocab_size"))
    if kind == "medusa":
        return MedusaHeads.from_config(config, draft_vocab)
    raise HeadFileError(f"unknown head kind {kind!r} (expected one of {KINDS})")


# ----------------------------------------------------------------------------------------------
# files


def save_head(head: TargetBound, path, meta: dict | None = None, dtype=torch.float16) -> Path:
    """Write ``head`` as safetensors (floats cast to ``dtype``; None keeps them) with metadata:
    format, kind, config, the target fingerprint (from ``meta['fingerprint']`` or the target the
    head is bound to), the target description and ``meta`` (JSON). Atomic (temp file + rename)."""
    from safetensors.torch import save_file

    meta = dict(meta or {})
    fp = meta.pop("fingerprint", None) or head.target_fingerprint
    if not fp:
        raise ValueError("save_head needs the target's fingerprint: bind the head to its target model "
                         "(head.bind(model)) or pass meta={'fingerprint': model_fingerprint(model)}")
    target = meta.pop("target", None) or head.target_description or {}
    tensors = {}
    for name, t in head.state_dict().items():
        t = t.detach().to("cpu")
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        tensors[name] = t.contiguous()
    metadata = {
        "format": HEAD_FORMAT, "format_version": HEAD_FORMAT_VERSION, "kind": head.kind,
        "config": json.dumps(head.config, sort_keys=True), "fingerprint": fp,
        "draft_vocab_size": str(head.draft_vocab_size), "target": json.dumps(target, sort_keys=True),
        "meta": json.dumps(meta, sort_keys=True, default=str),
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    save_file(tensors, str(tmp), metadata=metadata)
    os.replace(tmp, path)
    return path


def read_safetensors_header(path) -> dict:
    """The JSON header of a safetensors file, checked by hand before any loader touches it.

    A safetensors file starts with an 8-byte little-endian header length and a JSON object; a
    pickle starts with 0x80, a ``torch.save`` zip with ``PK``. Anything else is refused."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head8 = f.read(8)
            if len(head8) < 8:
                raise HeadFileError(f"{path}: {size} bytes, too short to be a safetensors file")
            (n,) = struct.unpack("<Q", head8)
            if n < 2 or n > min(size - 8, 100 * 2**20):
                kind = ("a pickle" if head8[:1] == b"\x80" else "a zip archive (torch.save)" if head8[:2] == b"PK"
                        else "not safetensors")
                raise HeadFileError(
                    f"{path} is {kind}: head files must be safetensors (specgraph never unpickles weights)")
            raw = f.read(n)
    except OSError as e:
        raise HeadFileError(f"cannot read head file {path}: {e}") from e
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HeadFileError(f"{path} is not a safetensors file (its header is not JSON): head files must be "
                            "safetensors (specgraph never unpickles weights)") from e
    if not isinstance(header, dict):
        raise HeadFileError(f"{path} is not a safetensors file")
    return header


def read_head_metadata(path) -> dict:
    """The specgraph metadata of a head file (format checked), with ``config``/``target``/``meta`` parsed."""
    md = read_safetensors_header(path).get("__metadata__") or {}
    if md.get("format") != HEAD_FORMAT:
        raise HeadFileError(f"{path} is a safetensors file but not a specgraph head (metadata format "
                            f"{md.get('format')!r}, expected {HEAD_FORMAT!r})")
    if md.get("format_version") != HEAD_FORMAT_VERSION:
        raise HeadFileError(f"{path}: head format version {md.get('format_version')!r} is not supported "
                            f"(this specgraph reads version {HEAD_FORMAT_VERSION})")
    if md.get("kind") not in KINDS:
        raise HeadFileError(f"{path}: unknown head kind {md.get('kind')!r}")
    out = dict(md)
    for key in ("config", "target", "meta"):
        try:
            out[key] = json.loads(md.get(key) or "{}")
        except json.JSONDecodeError as e:
            raise HeadFileError(f"{path}: metadata field {key!r} is not JSON") from e
    return out


def _mismatch_message(path, md, model, fp) -> str:
    want = md.get("target") or {}
    have = describe_model(model)
    return (
        f"{path} is a {md['kind']} head for another model: it was trained for fingerprint {md['fingerprint'][:16]}... "
        f"({_fmt_desc(want)}), this model's fingerprint is {fp[:16]}... ({_fmt_desc(have)}). The fingerprint covers "
        "the config and the embedding weights, so a fine-tune, a different quantization or an fp16 load also "
        f"differ. Train a head for this model: specgraph train-drafter --model <this model> --kind {md['kind']} --out DIR"
    )


def _fmt_desc(d: dict) -> str:
    parts = [f"{k}={d[k]}" for k in ("model_type", "hidden_size", "num_hidden_layers", "vocab_size") if d.get(k) is not None]
    if d.get("name"):
        parts.insert(0, repr(str(d["name"])[-60:]))
    return ", ".join(parts) or "unknown model"


def load_head(path, target_model, *, check_fingerprint: bool = True, dtype=None, device=None) -> TargetBound:
    """Load a head file for ``target_model`` (bound to it, eval mode).

    Refuses, with :class:`HeadFileError`, anything that is not a specgraph safetensors head (never
    unpickles), and, with :class:`HeadMismatchError`, a head whose fingerprint differs from the
    model's (``check_fingerprint=False`` skips that, at your own risk: the shapes must still fit).
    ``dtype``/``device`` default to the target's."""
    from safetensors.torch import load_file

    md = read_head_metadata(path)
    fp = model_fingerprint(target_model)
    if check_fingerprint and md.get("fingerprint") != fp:
        raise HeadMismatchError(_mismatch_message(path, md, target_model, fp))
    p = next(target_model.parameters())
    dtype, device = dtype or p.dtype, device or p.device
    try:
        tensors = load_file(str(path))
    except Exception as e:  # noqa: BLE001 - a corrupt body
        raise HeadFileError(f"{path}: cannot read the tensors: {e}") from e
    if "d2t" not in tensors:
        raise HeadFileError(f"{path}: no d2t (draft vocabulary) tensor")
    head = build_head(md["kind"], md["config"], draft_vocab=tensors["d2t"])
    try:
        head.load_state_dict(tensors, strict=True)
    except RuntimeError as e:
        raise HeadFileError(f"{path}: tensors do not match the {md['kind']} head config: {e}") from e
    head = head.to(device=device, dtype=dtype).eval()  # d2t stays long (to(dtype) only casts floats)
    head.bind(target_model)
    head.requires_grad_(False)
    head.file_meta = md
    return head


def head_search_dirs() -> list[Path]:
    """Where :func:`find_head` looks: ``$SPECGRAPH_HEADS`` (os.pathsep separated), the package's
    ``weights/`` folder (shipped heads), then ``$SPECGRAPH_CACHE/heads``."""
    from specgraph.models import cache_dir

    dirs = [Path(p) for p in os.environ.get("SPECGRAPH_HEADS", "").split(os.pathsep) if p]
    dirs += [Path(__file__).parent / "weights", cache_dir() / "heads"]
    return dirs


def find_head(model, kind: str, dirs=None) -> Path:
    """The first head file of ``kind`` whose fingerprint matches ``model`` (headers only are read).

    Raises :class:`HeadMismatchError` naming the heads that exist and what they were trained for."""
    if kind not in KINDS:
        raise ValueError(f"unknown head kind {kind!r} (expected one of {KINDS})")
    fp = model_fingerprint(model)
    seen = []
    for d in (dirs if dirs is not None else head_search_dirs()):
        d = Path(d)
        if not d.is_dir():
            continue
        for f in sorted(d.glob("*.safetensors")):
            try:
                md = read_head_metadata(f)
            except HeadFileError:
                continue
            if md["kind"] != kind:
                continue
            if md["fingerprint"] == fp:
                return f
            seen.append(f"{f} ({_fmt_desc(md.get('target') or {})})")
    have = _fmt_desc(describe_model(model))
    listing = "; ".join(seen) if seen else "none"
    raise HeadMismatchError(
        f"no {kind} head matches this model ({have}, fingerprint {fp[:16]}...). {kind} heads found for other "
        f"models: {listing}. Train one with: specgraph train-drafter --model <this model> --kind {kind} --out DIR, "
        f"then pass the file (or put it in $SPECGRAPH_HEADS)")
