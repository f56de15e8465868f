"""Generate for a batch of prompts of different lengths, left-padded.

The tokenizer pads on the left and returns an ``attention_mask``; the compiled object gets
``max_batch_size`` and the same mask. Each row keeps its own KV cache slots and accepts its own
number of drafts per round, so every row must equal ``model.generate`` on the same padded batch
(the script checks each row; exit status 1 if any differs).

    python examples/left_padded_batch.py                   # the embedded SmolLM2-135M-Instruct
    python examples/left_padded_batch.py --model path/to/hf_folder --backend eager --max-new-tokens 24
"""
import argparse
import sys

import torch

import specgraph
from specgraph.models import load_model

PROMPTS = [
    "The capital of France is",
    "def is_even(n):\n    return n % 2 == 0\n\ndef is_odd(n):\n    return",
    "List three colours of the rainbow: red, orange,",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default", help="'default' (SmolLM2-135M), a .gguf file or a local HF folder")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--backend", default="inductor", choices=["inductor", "eager"])
    args = p.parse_args(argv)

    model, tok = load_model(args.model)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    batch = tok(PROMPTS, return_tensors="pt", padding=True)
    ids, mask = batch.input_ids, batch.attention_mask

    fast = specgraph.compile(model, draft="ngram", num_speculative_tokens=4, backend=args.backend,
                             max_batch_size=len(PROMPTS), max_seq_len=ids.shape[1] + args.max_new_tokens + 64)
    out = fast.generate(ids, attention_mask=mask, max_new_tokens=args.max_new_tokens, pad_token_id=tok.pad_token_id)
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=args.max_new_tokens, do_sample=False,
                         pad_token_id=tok.pad_token_id)

    ok = out.shape == ref.shape
    for b in range(len(PROMPTS)):
        same = out.shape == ref.shape and torch.equal(out[b], ref[b])
        ok = ok and same
        text = tok.decode(out[b, ids.shape[1]:], skip_special_tokens=True)
        print(f"row {b} ({int(mask[b].sum())} prompt tokens) equals model.generate: {same}\n  {text!r}")
    st = fast.stats
    print(f"{st.rounds} rounds for {st.emitted} tokens over {len(PROMPTS)} rows; "
          f"accepted {st.accepted} of {st.drafted} drafts")
    print("all rows equal model.generate:", ok)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
