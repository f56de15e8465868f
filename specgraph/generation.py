"""``generate``'s arguments resolved the way ``model.generate`` resolves them.

Precedence is Hugging Face's: the model's ``generation_config``, then a passed ``GenerationConfig``,
then keyword arguments (later wins), with transformers' own merging, validation and global defaults
(``max_length`` 20 new tokens, ``top_k`` 50 when sampling, ...). The result is one
:class:`GenerationRequest`: what the engine runs. Every setting either reaches the engine or is
refused here with a message naming it; none is dropped.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput

from specgraph.processors import LogitsSpec
from specgraph.warping import SamplingParams

# settings with no effect on a decoder-only model's output (or ones the engine replaces: how to
# cache, compile, or batch is its job)
_INERT = {
    "bos_token_id", "decoder_start_token_id", "use_cache", "cache_implementation", "cache_config", "max_cache_len",
    "compile_config", "disable_compile", "prefill_chunk_size", "transformers_version", "_from_model_config",
    "continuous_batching_config", "is_assistant", "low_memory",
}
# beam-search-only settings: inert while num_beams == 1 (transformers warns, as here nothing happens)
_BEAM_ONLY = {"length_penalty", "early_stopping"}
# speculation knobs of transformers' own assisted generation: inert without an assistant
_ASSISTANT_KNOBS = {"num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold",
                    "assistant_lookbehind", "target_lookbehind", "assistant_early_exit", "max_matching_ngram_size",
                    "assistant_ensemble_weight"}
# handled by the engine (resolved below)
_HANDLED = {
    "max_length", "max_new_tokens", "min_length", "min_new_tokens", "do_sample", "temperature", "top_k", "top_p",
    "min_p", "repetition_penalty", "no_repeat_ngram_size", "bad_words_ids", "sequence_bias", "suppress_tokens",
    "begin_suppress_tokens", "forced_bos_token_id", "forced_eos_token_id", "eos_token_id", "pad_token_id",
    "num_return_sequences", "stop_strings", "return_dict_in_generate", "output_scores", "output_logits", "max_time",
    "renormalize_logits", "num_beams",
}
# refused settings: (name, value that means "off", what it is)
_REFUSED = [
    ("num_beam_groups", 1, "diverse beam search"),
    ("diversity_penalty", 0.0, "diverse beam search"),
    ("penalty_alpha", None, "contrastive search"),
    ("top_k_contrastive", None, "contrastive search"),
    ("dola_layers", None, "DoLa decoding"),
    ("guidance_scale", None, "classifier-free guidance"),
    ("typical_p", 1.0, "typical sampling"),
    ("epsilon_cutoff", 0.0, "epsilon sampling"),
    ("eta_cutoff", 0.0, "eta sampling"),
    ("top_h", None, "top-H sampling"),
    ("encoder_repetition_penalty", 1.0, "an encoder repetition penalty"),
    ("encoder_no_repeat_ngram_size", 0, "an encoder no-repeat n-gram size"),
    ("exponential_decay_length_penalty", None, "an exponential length penalty"),
    ("remove_invalid_values", False, "the inf/NaN remover"),
    ("watermarking_config", None, "watermarking"),
    ("constraints", None, "constrained beam search"),
    ("force_words_ids", None, "constrained beam search"),
    ("token_healing", False, "token healing"),
    ("output_attentions", False, "attention outputs"),
    ("output_hidden_states", False, "hidden-state outputs"),
    ("prompt_lookup_num_tokens", None, "transformers' prompt lookup (specgraph drafts with its own drafter)"),
    ("assistant_early_exit", None, "transformers' self-speculation (specgraph drafts with its own drafter)"),
    ("use_mtp", None, "multi-token prediction heads"),
    ("speculation_type", None, "transformers' speculation (specgraph drafts with its own drafter)"),
]
# keyword arguments of model.generate that are not generation settings
_REFUSED_ARGS = {
    "prefix_allowed_tokens_fn": "a prefix_allowed_tokens_fn",
    "assistant_model": "a second assistant model (specgraph's drafter is set at specgraph.compile)",
    "negative_prompt_ids": "negative prompts (classifier-free guidance)",
    "negative_prompt_attention_mask": "negative prompts (classifier-free guidance)",
    "custom_generate": "a custom generate function",
    "assistant_tokenizer": "a second assistant model",
    "inputs_embeds": "inputs_embeds (pass input_ids)",
}


class UnsupportedSetting(ValueError):
    """A generation setting specgraph cannot honour exactly."""


@dataclass(frozen=True)
class GenerationRequest:
    """One ``generate`` call, resolved. Lengths are per row, in new tokens."""

    max_new_tokens: int
    max_length: int  # padded prompt length + max_new_tokens
    params: SamplingParams
    eos: tuple[int, ...]
    pad_token_id: int
    pad_given: bool = True  # the pad id came from the settings (not the EOS / 0 default)
    logits: LogitsSpec | None = None  # None: no processor
    num_return_sequences: int = 1
    stopping: tuple = ()  # host-side StoppingCriteria (stop strings, the caller's own)
    max_time: float | None = None
    return_dict: bool = False
    output_scores: bool = False
    output_logits: bool = False
    renormalize_logits: bool = False
    logprobs: int = -1  # >= 0: emitted tokens' log-probabilities and the top-n per position
    grammar: object = field(default=None, compare=False)  # specgraph.grammar.Grammar: structured output
    config: object = field(default=None, compare=False)  # the resolved GenerationConfig


def _prepare_config(model, generation_config, kwargs: dict):
    """(resolved GenerationConfig, leftover keyword arguments), by transformers' own merge."""
    prepare = getattr(model, "_prepare_generation_config", None)
    if prepare is not None:
        return prepare(generation_config, **kwargs)
    # a stand-in model without GenerationMixin (a compiled directory's): the same precedence
    from transformers import GenerationConfig

    cfg = copy.deepcopy(generation_config) if generation_config is not None else GenerationConfig()
    defaults = getattr(GenerationConfig(), "_get_default_generation_params", dict)()
    for source in (model.generation_config.to_dict(), defaults):
        for k, v in source.items():
            if v is not None and getattr(cfg, k, None) is None and not k.startswith("_"):
                setattr(cfg, k, v)
    return cfg, cfg.update(**kwargs)


def _token_list(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, torch.Tensor):
        return tuple(int(v) for v in value.flatten().tolist())
    if isinstance(value, int):
        return (int(value),)
    return tuple(int(v) for v in value)


def _refuse_unsupported(cfg) -> None:
    for name, off, what in _REFUSED:
        value = getattr(cfg, name, off)
        if value is not None and value != off and not (name == "guidance_scale" and value == 1):
            raise UnsupportedSetting(f"{name}={value!r} ({what}) is not supported by specgraph; "
                                     "use model.generate for it")
    if getattr(cfg, "cache_implementation", None) == "quantized":
        raise UnsupportedSetting("cache_implementation='quantized' (a quantized KV cache changes the logits) is not "
                                 "supported by specgraph; use model.generate for it")
    if (cfg.num_beams or 1) > 1:
        raise UnsupportedSetting(f"num_beams={cfg.num_beams} (beam search) is not supported by specgraph: "
                                 "it speculates on sampling and greedy decoding; use model.generate for beam search")
    # a setting of this transformers version's GenerationConfig that is not handled here (a newer
    # one) is refused; custom entries of a model's config, which generate itself ignores, are not
    known = _INERT | _BEAM_ONLY | _ASSISTANT_KNOBS | _HANDLED | {n for n, _, _ in _REFUSED}
    fields = set(type(cfg)().to_dict())
    extra = {k for k in cfg.to_dict() if k in fields and k not in known and getattr(cfg, k, None) not in (None, False)}
    if extra:
        raise UnsupportedSetting(f"generation settings {sorted(extra)} are not known to specgraph; "
                                 "refusing rather than ignoring them")


def _logits_spec(cfg, eos: tuple[int, ...], T: int, vocab: int) -> LogitsSpec | None:
    from transformers.generation.logits_process import NoBadWordsLogitsProcessor, SequenceBiasLogitsProcessor

    def in_vocab(name, ids):
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"{name} holds token ids outside the vocabulary [0, {vocab}): {bad}")
        return ids

    seq_bias = ()
    if cfg.sequence_bias is not None:  # transformers' own parsing and checks
        seq_bias = tuple(SequenceBiasLogitsProcessor(copy.deepcopy(cfg.sequence_bias)).sequence_bias.items())
    bad = ()
    if cfg.bad_words_ids is not None:
        bad = tuple(NoBadWordsLogitsProcessor(copy.deepcopy(cfg.bad_words_ids), list(eos) or None).sequence_bias.items())
    for name, entries in (("sequence_bias", seq_bias), ("bad_words_ids", bad)):
        for s, _ in entries:
            in_vocab(name, s)
    rp = cfg.repetition_penalty
    if rp is not None and (not isinstance(rp, (int, float)) or rp <= 0 or math.isnan(rp)):
        raise ValueError(f"repetition_penalty must be a positive float, got {rp!r}")
    begin = _token_list(cfg.begin_suppress_tokens)
    spec = LogitsSpec(
        sequence_bias=seq_bias,
        repetition_penalty=None if rp is None or rp == 1.0 else float(rp),
        no_repeat_ngram_size=max(int(cfg.no_repeat_ngram_size or 0), 0),
        bad_words=bad,
        # transformers replaces min_length by min_new_tokens + T when min_new_tokens is set: the same
        # condition as min_new_tokens' own, so the spec keeps one (and stays independent of T)
        min_length=int(cfg.min_length or 0) if eos and cfg.min_new_tokens is None else 0,
        min_new_tokens=int(cfg.min_new_tokens or 0) if eos else 0,
        eos=eos if (cfg.min_length or cfg.min_new_tokens) else (),  # only the minimum lengths read it
        forced_bos_token_id=cfg.forced_bos_token_id,
        forced_eos=in_vocab("forced_eos_token_id", _token_list(cfg.forced_eos_token_id)),
        suppress_tokens=in_vocab("suppress_tokens", _token_list(cfg.suppress_tokens)),
        begin_suppress_tokens=in_vocab("begin_suppress_tokens", begin),
        begin_offset=1 if (begin and T <= 1 and cfg.forced_bos_token_id is not None) else 0,
    )
    return spec if spec.names() else None


def _sampling_params(cfg) -> SamplingParams:
    if not cfg.do_sample:
        return SamplingParams(0.0)
    temperature = 1.0 if cfg.temperature is None else float(cfg.temperature)
    if temperature == 0:
        raise ValueError("do_sample=True needs temperature > 0 (use do_sample=False for greedy)")
    top_k = None if not cfg.top_k else int(cfg.top_k)
    top_p = None if cfg.top_p is None or cfg.top_p >= 1.0 else float(cfg.top_p)
    return SamplingParams(temperature, top_k, top_p, None if cfg.min_p is None else float(cfg.min_p))


def _stopping(cfg, stopping_criteria, tokenizer) -> tuple:
    crit = list(stopping_criteria or [])
    if cfg.stop_strings is not None:
        if tokenizer is None:
            raise ValueError("stop_strings needs the tokenizer: pass tokenizer=... to generate, as with model.generate")
        from transformers.generation.stopping_criteria import StopStringCriteria

        crit.append(StopStringCriteria(stop_strings=cfg.stop_strings, tokenizer=tokenizer))
    return tuple(crit)


def inferred_attention_mask(input_ids, attention_mask, req: GenerationRequest):
    """``attention_mask``, or the one transformers infers without it: the input's pad tokens
    masked, when a pad id was given, differs from every EOS id and occurs in the input."""
    if attention_mask is not None or not req.pad_given or req.pad_token_id in req.eos:
        return attention_mask
    pad = input_ids == req.pad_token_id
    return (~pad).long() if bool(pad.any()) else None


def resolve(model, input_ids, generation_config=None, *, logits_processor=None, stopping_criteria=None,
            tokenizer=None, synced_gpus=None, vocab: int | None = None, **kwargs) -> GenerationRequest:
    """Resolve one ``generate`` call as ``model.generate`` would, or raise naming what specgraph
    cannot honour. ``input_ids`` [B, T] (T = padded prompt length)."""
    for name, what in _REFUSED_ARGS.items():
        if kwargs.get(name) is not None:
            raise UnsupportedSetting(f"{name}: {what} is not supported by specgraph")
        kwargs.pop(name, None)
    if synced_gpus:
        raise UnsupportedSetting("synced_gpus=True is not supported by specgraph (one device per model)")
    if logits_processor:
        names = ", ".join(type(p).__name__ for p in logits_processor)
        raise UnsupportedSetting(
            f"custom logits processors ({names}) are not supported: the compiled round applies transformers' "
            "built-in processors exactly (repetition_penalty, no_repeat_ngram_size, bad_words_ids, sequence_bias, "
            "min_new_tokens, suppress_tokens, ...) along every drafted path, but cannot run arbitrary Python per "
            "drafted position; use those settings or model.generate")
    has_default_max = kwargs.get("max_length") is None and (
        generation_config is None or generation_config.max_length is None) and model.generation_config.max_length is None
    cfg, leftover = _prepare_config(model, generation_config, kwargs)
    _refuse_unsupported(cfg)
    leftover = {k: v for k, v in leftover.items() if k not in ("output_attentions", "output_hidden_states")}
    if leftover:
        raise TypeError(f"generate() got arguments specgraph does not know: {sorted(leftover)}")
    T = input_ids.shape[-1]
    # lengths, as transformers prepares them
    if cfg.max_new_tokens is not None:
        max_length = cfg.max_new_tokens + T
    elif has_default_max:
        max_length = cfg.max_length + T
        mpe = getattr(model.config, "max_position_embeddings", None)
        max_length = min(max_length, mpe) if mpe is not None else max_length
    else:
        max_length = cfg.max_length
    if T >= max_length:
        raise ValueError(f"Input length of input_ids is {T}, but `max_length` is set to {max_length}. "
                         "Consider increasing `max_length` or, better yet, setting `max_new_tokens`.")
    cfg.max_length = max_length
    eos = _token_list(cfg.eos_token_id)
    if any(t < 0 for t in eos):
        raise ValueError(f"eos_token_id should consist of positive integers, got {list(eos)}")
    pad_given = cfg.pad_token_id is not None
    pad = int(_token_list(cfg.pad_token_id)[0]) if pad_given else (eos[0] if eos else 0)
    if vocab is None:
        vocab = model.get_output_embeddings().out_features
    spec = _logits_spec(cfg, eos, T, vocab)
    nrs = int(cfg.num_return_sequences or 1)
    return GenerationRequest(
        max_new_tokens=max_length - T, max_length=max_length, params=_sampling_params(cfg), eos=eos,
        pad_token_id=pad, pad_given=pad_given, logits=spec, num_return_sequences=nrs, stopping=_stopping(cfg, stopping_criteria, tokenizer),
        max_time=cfg.max_time, return_dict=bool(cfg.return_dict_in_generate), output_scores=bool(cfg.output_scores),
        output_logits=bool(cfg.output_logits), renormalize_logits=bool(cfg.renormalize_logits), config=cfg,
    )


class StepStreamer:
    """Feeds a transformers streamer what ``generate`` feeds it: the prompt [B, T], then one
    tensor [B] per step (pad for rows that have ended), then ``end()``. Speculative rounds emit
    rows at different rates; a step goes out once every row has produced it or ended."""

    def __init__(self, streamer, prompt: torch.Tensor, rows: int, pad_token_id: int):
        self.streamer, self.rows, self.pad, self.sent = streamer, rows, pad_token_id, 0
        streamer.put(prompt.cpu())

    def advance(self, new: list[list[int]], done: list[bool], final: bool = False) -> None:
        while True:
            s = self.sent
            if not all(len(n) > s or d for n, d in zip(new, done)):
                return
            if all(len(n) <= s for n in new):  # every row has ended
                return
            self.streamer.put(torch.tensor([n[s] if len(n) > s else self.pad for n in new]))
            self.sent += 1

    def end(self) -> None:
        self.streamer.end()


class ScoreLog:
    """Per row, the processed scores and raw logits [V] of each emitted token, as transformers'
    ``output_scores`` / ``output_logits`` report them."""

    def __init__(self, rows: int, req: GenerationRequest):
        self.req = req
        self.scores: list[list[torch.Tensor]] = [[] for _ in range(rows)]
        self.logits: list[list[torch.Tensor]] = [[] for _ in range(rows)]
        self.chosen: list[list[torch.Tensor]] = [[] for _ in range(rows)]
        self.top: list[list[torch.Tensor]] = [[] for _ in range(rows)]
        self.top_ids: list[list[torch.Tensor]] = [[] for _ in range(rows)]

    def add_logprobs(self, row: int, chosen: torch.Tensor, top: torch.Tensor, top_ids: torch.Tensor) -> None:
        """``chosen`` [n], ``top`` / ``top_ids`` [n, top-n] for the row's kept tokens."""
        self.chosen[row].extend(chosen.unsqueeze(-1).unbind(0))
        self.top[row].extend(top.unbind(0))
        self.top_ids[row].extend(top_ids.unbind(0))

    def add(self, row: int, processed: torch.Tensor, raw: torch.Tensor) -> None:
        """``processed`` [n, V] (before the sampling warpers), ``raw`` [n, V]: the row's kept tokens."""
        from specgraph.warping import warp_logits

        p = self.req.params
        x = processed.float() if p.greedy else warp_logits(processed, p.temperature, p.top_k, p.top_p, p.min_p)
        if self.req.renormalize_logits:
            x = torch.log_softmax(x, dim=-1)
        self.scores[row].extend(x.unbind(0))
        self.logits[row].extend(raw.float().unbind(0))

    @staticmethod
    def _steps(per_row: list[list[torch.Tensor]], fill=float("nan")) -> tuple:
        """One [B, X] tensor per step; rows that ended earlier hold ``fill`` there (NaN)."""
        n = max(len(r) for r in per_row)
        if n == 0:
            return ()
        like = next(t for r in per_row for t in r)
        pad = torch.full(like.shape, fill, dtype=like.dtype)
        return tuple(torch.stack([r[s] if s < len(r) else pad for r in per_row]) for s in range(n))

    def output(self, sequences: torch.Tensor, req: GenerationRequest):
        lp = req.logprobs >= 0
        return SpecGenerateOutput(
            sequences=sequences,
            scores=self._steps(self.scores) if req.output_scores else None,
            logits=self._steps(self.logits) if req.output_logits else None,
            logprobs=tuple(t.squeeze(-1) for t in self._steps(self.chosen)) if lp else None,
            top_logprobs=self._steps(self.top) if lp else None,
            top_tokens=self._steps(self.top_ids, -1) if lp else None,
        )


@dataclass
class SpecGenerateOutput(GenerateDecoderOnlyOutput):
    """transformers' ``GenerateDecoderOnlyOutput`` plus, with ``output_logprobs=n``, per step:
    ``logprobs`` [B] (the emitted token's log-probability), ``top_logprobs`` [B, n] and
    ``top_tokens`` [B, n] (the position's n most likely tokens). Rows that ended hold NaN / -1."""

    logprobs: tuple | None = None
    top_logprobs: tuple | None = None
    top_tokens: tuple | None = None


def stop_at(tokens: list[int], budget: int, eos, criteria=(), history: list[int] = (), started: float | None = None,
            max_time: float | None = None) -> tuple[list[int], bool]:
    """A row's share of a round: its emitted tokens cut to the remaining budget, after the first EOS
    (kept) and after the first token at which a stopping criterion fires (kept, as transformers
    checks criteria after appending). ``history``: the row so far as generate sees it (padding
    included), read by the criteria. Returns (kept tokens, whether the row stopped)."""
    import time

    keep = tokens[:budget]
    for i, t in enumerate(keep):
        if t in eos:
            return keep[: i + 1], True
        if criteria:
            ids = torch.tensor([list(history) + keep[: i + 1]])
            if any(bool(torch.as_tensor(c(ids, None)).any()) for c in criteria):
                return keep[: i + 1], True
    if max_time is not None and started is not None and time.perf_counter() - started > max_time:
        return keep, True
    return keep, False
