"""Speed up your own Hugging Face model with prompt-lookup speculation.

Loads a causal LM and its tokenizer with ``from_pretrained``, compiles it with
``specgraph.compile(model, draft="ngram")`` and generates greedily. Speculation is lossless: the
output must equal ``model.generate`` token for token, which the script checks (exit status 1 if
not). ``compile`` builds every graph greedy generation can use (about three minutes for SmolLM2 on
a 2-core CPU) and keeps them in the graph cache, so a second run loads them in seconds; the calls
after it only run them, and the round statistics (``fast.stats``) are printed.

    python examples/own_model.py                           # the embedded SmolLM2-135M-Instruct
    python examples/own_model.py --model path/to/hf_folder --backend eager --max-new-tokens 32
"""
import argparse
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import specgraph
from specgraph.models import load_model

PROMPT = "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\ndef"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default", help="a local HF checkpoint folder, or 'default' (SmolLM2-135M)")
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--backend", default="inductor", choices=["inductor", "eager"],
                   help="eager runs the rewritten graphs without torch.compile (no compile wait)")
    args = p.parse_args(argv)

    if args.model == "default":  # shipped as a GGUF file: load_model dequantizes it once and caches it
        model, tok = load_model("default")
    else:
        tok = AutoTokenizer.from_pretrained(args.model)
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    ids = tok(args.prompt, return_tensors="pt").input_ids

    t0 = time.perf_counter()  # compile builds every graph generate can use (greedy here), with a progress bar
    fast = specgraph.compile(model, draft="ngram", num_speculative_tokens=args.num_speculative_tokens,
                             backend=args.backend, max_batch_size=1, modes=("greedy",),
                             max_seq_len=ids.shape[1] + args.max_new_tokens + 64)
    print(f"compile ({len(fast.graph_plan(('greedy',)))} graphs): {time.perf_counter() - t0:.1f} s")
    t0 = time.perf_counter()
    fast.generate(ids, max_new_tokens=args.max_new_tokens, pad_token_id=pad)
    print(f"first call: {time.perf_counter() - t0:.1f} s")
    out = fast.generate(ids, max_new_tokens=args.max_new_tokens, pad_token_id=pad)
    print(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    print("stats:", fast.stats)
    print("acceptance per draft position:", [round(a, 2) for a in fast.stats.as_dict()["survival_per_position"]])

    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                         do_sample=False, pad_token_id=pad)
    same = torch.equal(out, ref)
    print("greedy output equals model.generate:", same)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
