"""The llama.cpp peer (llama-cpp-python) on the stream of benchmarks/stream_prompts.py: start-up
and tokens/s at one precision, plain or with its prompt lookup.

Run by the llama.cpp venv's python (``benchmarks/llamacpp_setup.sh``), usually through
``benchmarks/stream_bench.py --llamacpp-python``:

    VENV/bin/python benchmarks/llamacpp_stream.py --hf-dir FOLDER --precision f32 --prompts IDS.json \\
        --method lookup

``--hf-dir`` is an HF checkpoint folder (for the default model, the folder
``specgraph.models.gguf_cache_folder()`` names), converted once per precision (``f32``, ``f16``,
``q8_0``) by the converter the llama-cpp-python sdist carries, into ``--gguf-cache``; ``--gguf``
runs a GGUF file as it is instead (the shipped Q4_1 file). ``--prompts`` is a JSON list of token-id
lists (the HF chat template's ids, written by stream_bench.py, so both sides see the same
tokens). Greedy, ``--threads`` threads, one warm-up call, then each prompt in turn until its
first EOS or ``--max-new-tokens``; ``lookup`` is llama-cpp-python's prompt-lookup drafting
(``LlamaPromptLookupDecoding``). The result is one JSON object on the stdout line that starts
with ``llamacpp_stream result: ``.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time

RESULT = "llamacpp_stream result: "
PRECISIONS = ("f32", "f16", "q8_0")


def converter() -> str:
    """The HF -> GGUF converter of the sdist that llamacpp_setup.sh unpacked into this venv."""
    found = sorted(glob.glob(os.path.join(sys.prefix, "src", "llama_cpp_python-*", "vendor", "llama.cpp",
                                          "convert_hf_to_gguf.py")))
    if not found:
        raise SystemExit(f"no convert_hf_to_gguf.py under {sys.prefix}/src: run benchmarks/llamacpp_setup.sh")
    return found[-1]


def converted(hf_dir: str, precision: str, cache: str) -> str:
    """``hf_dir`` as a GGUF file at ``precision`` (converted once, then reused from ``cache``)."""
    name = os.path.basename(os.path.normpath(hf_dir))
    out = os.path.join(cache, f"{name}-{precision}.gguf")
    if not os.path.exists(out):
        os.makedirs(cache, exist_ok=True)
        tmp = out + f".{os.getpid()}.tmp"
        print(f"converting {hf_dir} to {precision} GGUF ...", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, converter(), hf_dir, "--outtype", precision, "--outfile", tmp], check=True,
                       stdout=subprocess.DEVNULL)
        os.replace(tmp, out)
    return out


def generate(llm, prompt: list[int], max_new: int, eos: set[int]) -> list[int]:
    """Greedy new tokens of ``prompt``, up to and including the first EOS."""
    out = []
    for tok in llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
        out.append(int(tok))
        if tok in eos or len(out) >= max_new:
            break
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf-dir", help="an HF checkpoint folder, converted at --precision")
    src.add_argument("--gguf", help="a GGUF file, run at its own precision")
    ap.add_argument("--precision", choices=PRECISIONS, default="f32")
    ap.add_argument("--gguf-cache", default=os.path.expanduser("~/.cache/specgraph/llamacpp-gguf"))
    ap.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    ap.add_argument("--eos", default="", help="comma-separated EOS token ids (default: the model's)")
    ap.add_argument("--method", choices=["plain", "lookup"], default="plain")
    ap.add_argument("--num-pred-tokens", type=int, default=10, help="lookup: drafted tokens per step")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-seq-len", type=int, default=2048)
    args = ap.parse_args(argv)
    path = args.gguf or converted(args.hf_dir, args.precision, args.gguf_cache)
    prompts = json.loads(open(args.prompts).read())
    t0 = time.perf_counter()
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    draft = LlamaPromptLookupDecoding(num_pred_tokens=args.num_pred_tokens) if args.method == "lookup" else None
    # logits_all with a draft: llama-cpp-python sizes its logits buffer by this argument, not by the draft
    llm = Llama(model_path=path, n_ctx=args.max_seq_len, n_threads=args.threads, n_threads_batch=args.threads,
                n_batch=512, draft_model=draft, logits_all=draft is not None, seed=0, verbose=False)
    startup_s = time.perf_counter() - t0
    eos = {int(t) for t in args.eos.split(",") if t} or {llm.token_eos()}
    generate(llm, prompts[0][:16], 8, eos)  # warm-up
    outputs, tokens, seconds = [], 0, 0.0
    for p in prompts:
        t1 = time.perf_counter()
        new = generate(llm, p, args.max_new_tokens, eos)
        seconds += time.perf_counter() - t1
        outputs.append(new)
        tokens += len(new)
    label = args.precision.upper() if args.hf_dir else os.path.basename(path)
    print(RESULT + json.dumps({"method": f"llama.cpp {label} {args.method}", "gguf": path, "startup_s": startup_s,
                               "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
                               "threads": args.threads, "outputs": outputs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
