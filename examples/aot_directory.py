"""Compile ahead of time into a directory, load it back and generate without compiling.

``specgraph.aot.compile_dir`` writes AOTInductor packages for every shape the decoding loop can
ask for (prefill chunks, the plain step and each prompt-lookup depth), the model's weights and
tokenizer, and a manifest with versions, a model fingerprint and every file's sha256.
``specgraph.aot.load_dir`` checks all of that and serves each round from the packages: no
``torch.compile`` at load time (the CLI equivalent: ``specgraph compile`` then
``specgraph generate DIR``). Greedy output must equal ``model.generate`` (exit status 1 if not).
Compiling SmolLM2's three packages takes about five minutes on a 2-core CPU; loading, seconds.

    python examples/aot_directory.py --out smol.sg         # the embedded SmolLM2-135M-Instruct
    python examples/aot_directory.py --model path/to/hf_folder --num-speculative-tokens 2 --max-new-tokens 24
"""
import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from specgraph.aot import compile_dir, load_dir
from specgraph.models import load_model

PROMPT = "import math\n\ndef area(r):\n    return math.pi * r * r\n\ndef circumference(r):\n    return"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default", help="'default' (SmolLM2-135M), a .gguf file or a local HF folder")
    p.add_argument("--out", default=None, help="the compiled directory (default: a temporary one)")
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    args = p.parse_args(argv)

    model, tok = load_model(args.model)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    ids = tok(args.prompt, return_tensors="pt").input_ids

    with tempfile.TemporaryDirectory() as tmp:
        out_dir = Path(args.out or Path(tmp) / "compiled")
        t0 = time.perf_counter()
        manifest = compile_dir(model, out_dir, tokenizer=tok, draft="ngram",
                               num_speculative_tokens=args.num_speculative_tokens, max_batch_size=1,
                               max_seq_len=ids.shape[1] + args.max_new_tokens + 32, modes=("greedy",),
                               overwrite=args.out is not None, progress=False)
        print(f"compiled {len(manifest['graphs'])} packages into {out_dir} in {time.perf_counter() - t0:.0f} s:",
              ", ".join(g["name"] for g in manifest["graphs"]))

        t0 = time.perf_counter()
        loaded = load_dir(out_dir)  # refuses changed files, other versions or another model
        print(f"loaded in {time.perf_counter() - t0:.1f} s")
        out = loaded.fast.generate(ids, max_new_tokens=args.max_new_tokens, pad_token_id=pad)
        print(loaded.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
        print("stats:", loaded.fast.stats)

    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                         do_sample=False, pad_token_id=pad)
    same = torch.equal(out, ref)
    print("greedy output from the compiled directory equals model.generate:", same)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
