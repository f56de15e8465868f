"""Generation speed of the ONNX export (onnxruntime) against the torch paths, batch 1, greedy.

Methods, interleaved per prompt: HF generate (plain), ``specgraph.compile(model, "ngram")`` (the torch
path, ``--backend``), and ``OnnxSpecGenerator`` on the graphs ``specgraph.export_onnx`` wrote for the
same compiled model (prompt lookup drafts, K = ``--k``). For each prompt and method: median tokens/s
over ``--runs``, mean emitted tokens per round, and greedy equality with HF. Also reports the export
time and the size of the files. Prints a table and writes JSON.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/onnx_bench.py --out benchmarks/results/onnx_cpu.json
    python benchmarks/onnx_bench.py --model tiny --max-new-tokens 32      # no download, seconds

The exported graphs are cached in ``--dir`` (default ``~/.cache/specgraph/onnx/<model>-k<K>-s<S>``)
and reused when their manifest still checks out.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import specgraph
from specgraph.onnx import OnnxSpecGenerator, load_manifest
from specgraph.onnx_export import export_onnx

PROMPTS = {
    "code": "Write a Python class `Stack` with push, pop, peek and is_empty methods, each with a docstring, "
            "then write unit tests for every method using unittest.",
    "summarize": "Summarize the following paragraph in three sentences, reusing its key terms.\n\n"
                 "Speculative decoding speeds up autoregressive generation by letting a cheap draft propose "
                 "several tokens that the target model verifies in a single forward pass. Verification uses "
                 "rejection sampling, so the output distribution is exactly the target model's distribution.",
}


def _tiny():
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                               max_position_embeddings=1024)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    pattern = [17, 64, 3, 88, 25, 9, 41]
    prompts = {"periodic": torch.tensor([(pattern * 10)[:60]]), "random": torch.randint(2, 127, (1, 60))}
    return model, prompts


def _ids(tok, prompt):
    enc = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt")
    return enc if isinstance(enc, torch.Tensor) else enc["input_ids"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", help="'default' (SmolLM2-135M), a local path/name, or 'tiny'")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--max-seq-len", type=int, default=512)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--backend", default="inductor", choices=["inductor", "eager"])
    ap.add_argument("--threads", type=int, default=None, help="intra-op threads for torch and onnxruntime")
    ap.add_argument("--dir", default=None, help="where the exported graphs live (reused when valid)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)

    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    if args.model == "tiny":
        model, prompts = _tiny()
    else:
        from specgraph.models import load_model

        model, tok = load_model(args.model)
        prompts = {name: _ids(tok, p) for name, p in PROMPTS.items()}
    name = "tiny" if args.model == "tiny" else Path(str(args.model)).name
    out_dir = Path(args.dir or Path.home() / ".cache" / "specgraph" / "onnx" / f"{name}-k{args.k}-s{args.max_seq_len}")

    fast = specgraph.compile(model, "ngram", num_speculative_tokens=args.k, backend=args.backend,
                             max_batch_size=1, max_seq_len=args.max_seq_len)
    export_s = None
    try:
        load_manifest(out_dir)
        print(f"reusing the exported graphs in {out_dir}")
    except (FileNotFoundError, ValueError):
        t0 = time.perf_counter()
        export_onnx(fast, out_dir, modes=("greedy",), progress=True)
        export_s = time.perf_counter() - t0
        print(f"exported to {out_dir} in {export_s:.1f} s")
    man = load_manifest(out_dir, check_files=False)
    files_mb = sum(f["bytes"] for f in man["files"].values()) / 2**20
    t0 = time.perf_counter()
    onnx_gen = OnnxSpecGenerator(out_dir, num_threads=threads)
    load_s = time.perf_counter() - t0

    n = args.max_new_tokens
    pad = model.generation_config.pad_token_id
    if pad is None:
        pad = 0

    def hf(ids):
        return model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=pad), None

    def sg(ids):
        out = fast.generate(ids, max_new_tokens=n, pad_token_id=pad)
        return out, fast.stats.mean_emitted

    def ox(ids):
        out = onnx_gen.generate(ids, max_new_tokens=n, pad_token_id=pad)
        return out, onnx_gen.stats.mean_emitted

    methods = {"hf_plain": hf, f"specgraph_ngram_{args.backend}": sg, "onnx_ngram": ox}
    results = []
    with torch.no_grad():
        for pname, ids in prompts.items():
            for m in methods.values():  # warm-up: compiles, onnxruntime sessions
                m(ids)
            times = {m: [] for m in methods}
            outs, emitted = {}, {}
            for _ in range(args.runs):
                for m, fn in methods.items():
                    t0 = time.perf_counter()
                    out, em = fn(ids)
                    times[m].append(time.perf_counter() - t0)
                    outs[m], emitted[m] = out, em
            for m in methods:
                new = outs[m].shape[1] - ids.shape[1]
                tps = new / statistics.median(times[m])
                results.append({
                    "prompt": pname, "method": m, "tokens_per_s": round(tps, 2), "new_tokens": new,
                    "mean_emitted_per_round": None if emitted[m] is None else round(emitted[m], 3),
                    "equal_to_hf": bool(torch.equal(outs[m], outs["hf_plain"])),
                })

    base = {r["prompt"]: r["tokens_per_s"] for r in results if r["method"] == "hf_plain"}
    print(f"\nmodel {name}, K={args.k}, S={man['slots']}, threads {threads}, export {export_s and round(export_s, 1)} s, "
          f"files {files_mb:.1f} MiB, onnxruntime load {load_s:.1f} s")
    print(f"{'prompt':<10} {'method':<26} {'tok/s':>8} {'vs HF':>6} {'emit/rd':>8} {'= HF':>5}")
    for r in results:
        em = "" if r["mean_emitted_per_round"] is None else f"{r['mean_emitted_per_round']:.2f}"
        print(f"{r['prompt']:<10} {r['method']:<26} {r['tokens_per_s']:>8.1f} {r['tokens_per_s'] / base[r['prompt']]:>5.2f}x "
              f"{em:>8} {str(r['equal_to_hf']):>5}")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "model": name, "k": args.k, "slots": man["slots"], "threads": threads, "backend": args.backend,
            "max_new_tokens": n, "runs": args.runs, "export_seconds": export_s, "files_mib": round(files_mb, 1),
            "onnxruntime_load_seconds": round(load_s, 2), "opset": man["opset"],
            "onnxruntime": __import__("onnxruntime").__version__, "results": results,
        }, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
