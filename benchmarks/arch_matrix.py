"""Which decoder families specgraph serves, and how: compiled graphs or the eager fallback, greedy
output equal to ``model.generate`` or not, with prompt lookup and with a draft model.

Tiny random configs (2 layers, hidden 64, vocabulary 128) of each family; where a family has
sliding-window attention the window is 8 tokens and the generation runs 52 tokens past an
8-token prompt, well past it. Prints a table and writes JSON.

    python benchmarks/arch_matrix.py --out benchmarks/results/arch_matrix.json
"""
from __future__ import annotations

import argparse
import json
import sys
import warnings

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import specgraph

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              vocab_size=128, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)
GQA = dict(num_key_value_heads=2, head_dim=16)  # families with grouped-query attention
NO_GQA = {"gpt_neox", "opt", "gpt2", "gptj", "gpt_bigcode", "falcon", "bloom"}
WINDOW = 8
FAMILIES = {  # family -> overrides of COMMON (window settings where the family has them)
    "llama": {}, "qwen3": {}, "gemma": {}, "cohere": {}, "olmo": {}, "olmo2": {}, "granite": {}, "helium": {},
    "glm": {}, "smollm3": {}, "stablelm": {}, "phi": {},
    "mistral (window)": dict(sliding_window=WINDOW),
    "ministral (window)": dict(sliding_window=WINDOW),
    "qwen2 (mixed windows)": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    "gemma2 (windows + soft-cap)": dict(sliding_window=WINDOW),
    "gemma3_text (windows)": dict(sliding_window=WINDOW, sliding_window_pattern=2),
    "cohere2 (windows)": dict(sliding_window=WINDOW),
    "starcoder2 (window)": dict(sliding_window=WINDOW, num_key_value_heads=2),
    "phi3 (window)": dict(sliding_window=WINDOW),
    "mixtral (MoE, window)": dict(sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe (MoE)": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, decoder_sparse_step=1),
    "qwen2_moe (MoE)": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                            shared_expert_intermediate_size=64),
    "bloom (ALiBi)": dict(n_layer=2, n_head=4),
    "falcon": dict(new_decoder_architecture=False, multi_query=False),
    "gpt_neox": dict(rotary_pct=0.25),
    "opt": dict(ffn_dim=128, word_embed_proj_dim=64, pad_token_id=1),
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_positions=256),
    "gptj": dict(n_embd=64, n_layer=2, n_head=4, n_positions=256, rotary_dim=8),
    "gpt_bigcode": dict(n_embd=64, n_layer=2, n_head=4, n_positions=256),
}


def tiny(family: str, seed: int):
    name = family.split(" ")[0]
    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(name, **{**COMMON, **({} if name in NO_GQA else GQA), **FAMILIES[family]})
    try:
        return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32).eval()
    except ValueError:  # families without an SDPA attention (Bloom's ALiBi): their eager attention
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32).eval()


def run(family: str, draft: str, new_tokens: int) -> dict:
    model = tiny(family, 0)
    ids = torch.tensor([[5, 9, 13, 9, 13, 9, 13, 21]])
    kw = dict(max_new_tokens=new_tokens, do_sample=False, eos_token_id=[], pad_token_id=0)
    ref = model.generate(ids, **kw)
    try:
        fast = specgraph.compile(model, tiny(family, 1) if draft == "model" else draft, backend="eager",
                                 max_seq_len=128, warmup=False)
    except Exception as e:  # noqa: BLE001 - recorded: a refusal at compile is a result
        return {"path": "refused", "reason": f"{type(e).__name__}: {e}"[:160], "equal": None}
    path = "compiled" if fast.fallback_reason is None else "eager fallback"
    try:
        out = fast.generate(ids, **kw)
    except Exception as e:  # noqa: BLE001
        return {"path": path, "reason": f"{type(e).__name__}: {e}"[:160], "equal": False}
    return {"path": path, "reason": fast.fallback_reason, "equal": bool(torch.equal(out, ref)),
            "accepted": fast.stats.accepted}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=52)
    ap.add_argument("--families", default=";".join(FAMILIES), help="semicolon-separated")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    rows = []
    for family in [f.strip() for f in args.families.split(";")]:
        row = {"family": family}
        for draft in ("ngram", "model"):
            row[draft] = run(family, draft, args.new_tokens)
        rows.append(row)
        cells = [f"{r['path']}{'' if r['equal'] is None else (' = HF' if r['equal'] else ' != HF')}"
                 for r in (row["ngram"], row["model"])]
        print(f"{family:<28} {cells[0]:<26} {cells[1]:<26}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"torch": torch.__version__, "new_tokens": args.new_tokens, "window": WINDOW, "rows": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
