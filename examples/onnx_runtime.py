"""Export the speculative decoding graphs to ONNX and generate with ONNX Runtime.

``specgraph.export_onnx`` writes one ONNX graph per prompt-lookup depth (a plain step, then the
drafted rounds) plus a chunked prefill and a manifest with every file's sha256;
``specgraph.onnx.OnnxSpecGenerator`` loads that folder and runs the same loop as
``fast.generate`` on onnxruntime (no PyTorch graphs). Greedy output must equal ``model.generate``
token for token (exit status 1 if not). Needs ``pip install -e ".[onnx]"``; exporting SmolLM2
takes a few minutes on a 2-core CPU.

    python examples/onnx_runtime.py --out smol_onnx/        # the embedded SmolLM2-135M-Instruct
    python examples/onnx_runtime.py --model path/to/hf_folder --max-new-tokens 24
"""
import argparse
import sys
import tempfile

import torch

import specgraph
from specgraph.models import load_model
from specgraph.onnx import OnnxSpecGenerator

PROMPT = "Q: What is 12 + 7?\nA: 12 + 7 = 19.\nQ: What is 30 + 5?\nA: 30 + 5 = 35.\nQ: What is 8 + 9?\nA:"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default", help="'default' (SmolLM2-135M), a .gguf file or a local HF folder")
    p.add_argument("--out", default=None, help="folder for the ONNX files (default: a temporary one)")
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    args = p.parse_args(argv)

    model, tok = load_model(args.model)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    ids = tok(args.prompt, return_tensors="pt").input_ids
    # the exported graphs have a static KV cache of max_seq_len slots: size it for this request
    fast = specgraph.compile(model, draft="ngram", num_speculative_tokens=args.num_speculative_tokens, backend="eager",
                             max_batch_size=1, max_seq_len=ids.shape[1] + args.max_new_tokens + 32)

    with tempfile.TemporaryDirectory() as tmp:
        out_dir = args.out or tmp
        manifest = specgraph.export_onnx(fast, out_dir, modes=("greedy",), progress=False)
        print("exported:", ", ".join(g["name"] for g in manifest["graphs"]), "to", out_dir)
        gen = OnnxSpecGenerator(out_dir)  # checks every file against the manifest's sha256 first
        out = gen.generate(ids, max_new_tokens=args.max_new_tokens, pad_token_id=pad)
        print(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
        print("onnxruntime stats:", gen.stats)

    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                         do_sample=False, pad_token_id=pad)
    same = torch.equal(out, ref)
    print("ONNX Runtime greedy output equals model.generate:", same)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
