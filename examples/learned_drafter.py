"""Train a small learned drafter head, then generate with it.

``specgraph.train`` (the ``specgraph train-drafter`` command) caches the target's features on
standard-library text and trains an EAGLE head (one decoder layer on the target's last hidden
state) or Medusa heads by self-distillation; here only a few steps, so the head drafts poorly.
That changes the speed, never the output: verification keeps greedy output equal to
``model.generate`` whatever the head proposes (checked; exit status 1 if not), and the script
prints how many drafts were accepted.

    python examples/learned_drafter.py                     # the embedded SmolLM2-135M-Instruct, a few minutes
    python examples/learned_drafter.py --model path/to/hf_folder --steps 4 --max-tokens 1500 --backend eager
"""
import argparse
import sys
import tempfile
from pathlib import Path

import torch

import specgraph
from specgraph import train
from specgraph.heads import load_head
from specgraph.models import load_model

PROMPT = "def count_words(text):\n    counts = {}\n    for word in text.split():\n        counts[word] ="


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default", help="'default' (SmolLM2-135M), a .gguf file or a local HF folder")
    p.add_argument("--kind", default="eagle", choices=["eagle", "medusa"])
    p.add_argument("--out", default=None, help="training folder (head.safetensors, train_log.json; default: temporary)")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps")
    p.add_argument("--max-tokens", type=int, default=6000, help="target tokens to cache for training")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--backend", default="inductor", choices=["inductor", "eager"])
    args = p.parse_args(argv)

    model, tok = load_model(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = Path(args.out or tmp)
        log = train.run(train.build_parser().parse_args([
            "--kind", args.kind, "--out", str(out_dir), "--max-steps", str(args.steps),
            "--max-tokens", str(args.max_tokens), "--seq-len", str(args.seq_len),
            "--batch-tokens", str(2 * args.seq_len), "--checkpoint-every", str(args.steps),
            "--gen-engine", "hf", "--gen-new-tokens", "16", "--gen-batch", "4", "--time-budget", "30", "--no-progress",
        ]), model=model, tok=tok)
        held_out = (log["final_eval"] or {}).get("all", {})
        print(f"trained {log['steps']} steps on {log['cache_tokens']} tokens; held-out top-1 agreement at depth 1:",
              held_out.get("top1_depth1"))
        head = load_head(out_dir / "head.safetensors", model)  # refuses a head trained for another model

    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    ids = tok(PROMPT, return_tensors="pt").input_ids
    fast = specgraph.compile(model, draft=head, num_speculative_tokens=3, backend=args.backend, max_batch_size=1,
                             max_seq_len=ids.shape[1] + args.max_new_tokens + 32)
    out = fast.generate(ids, max_new_tokens=args.max_new_tokens, pad_token_id=pad)
    print(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    st = fast.stats.as_dict()
    print(f"{args.kind} head: accepted {st['accepted']} of {st['drafted']} drafts, "
          f"{st['mean_emitted_per_round']:.2f} tokens per round; acceptance per position:",
          [round(a, 2) for a in st["survival_per_position"]])

    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                         do_sample=False, pad_token_id=pad)
    same = torch.equal(out, ref)
    print("greedy output with the learned drafter equals model.generate:", same)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
