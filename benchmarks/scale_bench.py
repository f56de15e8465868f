"""Model size against precision: time to ready, memory, graph cache and plain decoding speed.

For each model and each ``weights=`` precision, in a fresh process with an empty graph cache:

- ready: seconds for ``specgraph.compile(model, "ngram", weights=w)`` with its defaults to return
  (the batch-1 graphs built; the larger batch buckets go on building in a helper, not counted);
- memory: the process's peak RSS, and its RSS once the model as loaded is dropped and only the
  compiled object remains, against the object's weight bytes + KV cache bytes;
- graph cache: bytes on disk once ``compile`` returned (the build helper's temporary copy of the
  model, there while it builds the larger buckets, not counted);
- plain decoding: ``compile(model, None, weights=w)`` on a prompt of random tokens, tokens/s
  against HF generate on the fp32 model and on the model at ``w`` (greedy outputs compared), and
  against the bandwidth limit: measured memory bandwidth / the weight bytes one step reads.

Models: ``smollm2`` (the embedded SmolLM2-135M-Instruct GGUF; ``native`` is its Q4_1 file) and
``tinyllama`` (a TinyLlama-shaped 1.1B Llama with random weights: hidden 2048, 22 layers, 32 heads,
4 KV heads, intermediate 5632, vocab 32000; speed and memory do not depend on the values).

    OMP_WAIT_POLICY=PASSIVE MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=68719476736 \\
    MALLOC_TOP_PAD_=1073741824 python benchmarks/scale_bench.py --models smollm2,tinyllama \\
        --weights float32,bfloat16,int8,int4,native --out benchmarks/results/scale.json
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from specgraph.freezing import weight_bytes

sys.path.insert(0, os.path.dirname(__file__))
from generate_bench import write_json  # noqa: E402
from width_profile import cpu_name  # noqa: E402

TINYLLAMA = dict(hidden_size=2048, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                 intermediate_size=5632, vocab_size=32000, max_position_embeddings=2048)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def bandwidth_gbs(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Memory read bandwidth: the best of ``repeats`` sums over a buffer much larger than the caches."""
    x = torch.ones(nbytes // 4)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def load(name: str):
    if name == "smollm2":
        from specgraph.models import load_model

        return load_model("default")[0]
    if name == "tinyllama":
        from transformers import AutoModelForCausalLM, LlamaConfig

        torch.manual_seed(0)
        cfg = LlamaConfig(**TINYLLAMA, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
        return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32).eval()
    raise ValueError(f"unknown model {name!r}")


def step_bytes(model) -> int:
    """Bytes one decoding step reads: every tensor but the input embedding table (one row is read)."""
    emb = model.get_input_embeddings().weight
    shared = any(t.data_ptr() == emb.data_ptr() for t in (*model.parameters(), *model.buffers()) if t is not emb)
    return weight_bytes(model) - (0 if shared else emb.numel() * emb.element_size())


def tok_per_s(fn, new_tokens: int, repeats: int = 2) -> tuple[float, torch.Tensor]:
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        with torch.no_grad():
            out = fn()
        best = min(best, time.perf_counter() - t0)
    return new_tokens / best, out


def one(model_name: str, weights: str, new_tokens: int, prompt_tokens: int) -> dict:
    """Everything for one (model, precision), in this process."""
    import specgraph
    from specgraph.limits import kv_cache_bytes

    cache = tempfile.mkdtemp(prefix="scale-bench-cache-")
    t0 = time.perf_counter()
    model = load(model_name)
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    fast = specgraph.compile(model, "ngram", weights=weights, cache=cache, progress=False)
    ready_s = time.perf_counter() - t0
    cache_bytes = sum(p.stat().st_size for p in Path(cache).rglob("*")  # not the helper's temporary model copy
                      if p.is_file() and not any(part.startswith(".helper-model") for part in p.parts))
    weight_b, kv_b = weight_bytes(fast.model), kv_cache_bytes(fast.model, fast.max_batch_size, fast.slots)
    graphs = fast.graph_cache["built"] + fast.graph_cache["loaded"] if fast.graph_cache else len(fast.graphs_built)
    plain = specgraph.compile(model, None, weights=weights, cache=cache, max_batch_size=1, max_seq_len=1024,
                              modes=("greedy",), progress=False)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 1000, (1, prompt_tokens), generator=g)
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, eos_token_id=[], pad_token_id=0)
    sg_tps, out = tok_per_s(lambda: plain.generate(ids, **kw), new_tokens)
    hf_tps, ref32 = tok_per_s(lambda: model.generate(ids, attention_mask=torch.ones_like(ids), **kw), new_tokens)
    if plain.model is model:
        hf_at_tps, ref = hf_tps, ref32
    else:
        hf_at_tps, ref = tok_per_s(lambda: plain.model.generate(ids, attention_mask=torch.ones_like(ids), **kw),
                                   new_tokens)
    bw = bandwidth_gbs()
    limit = bw * 1e9 / step_bytes(plain.model)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    del plain, model, ref32
    fast.source_model = None
    import gc

    gc.collect()
    return {"model": model_name, "weights": weights, "load_s": load_s, "ready_s": ready_s, "graphs": graphs,
            "graph_cache": fast.graph_cache, "graph_cache_bytes": cache_bytes, "weight_bytes": weight_b,
            "kv_bytes": kv_b, "peak_rss_bytes": peak, "object_rss_bytes": rss_bytes(),
            "plain_tok_s": sg_tps, "hf_fp32_tok_s": hf_tps, "hf_at_precision_tok_s": hf_at_tps,
            "equal_to_hf_at_precision": bool(torch.equal(out, ref)), "bandwidth_gbs": bw,
            "step_bytes": step_bytes(fast.model), "bandwidth_limit_tok_s": limit}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2,tinyllama")
    ap.add_argument("--weights", default="float32,bfloat16,int8,int4,native",
                    help="precisions (native: GGUF models only; skipped for the others)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per (model, precision) process")
    ap.add_argument("--one", nargs=2, metavar=("MODEL", "WEIGHTS"), help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(one(*args.one, args.new_tokens, args.prompt_tokens)), flush=True)
        return 0
    rows = []
    for model_name in args.models.split(","):
        for w in args.weights.split(","):
            if w == "native" and model_name != "smollm2":
                continue
            cmd = [sys.executable, __file__, "--one", model_name, w, "--new-tokens", str(args.new_tokens),
                   "--prompt-tokens", str(args.prompt_tokens)]
            print(f"{model_name} {w} ...", file=sys.stderr, flush=True)
            try:
                res = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
                row = json.loads(res.stdout.strip().splitlines()[-1]) if res.returncode == 0 else \
                    {"model": model_name, "weights": w, "error": res.stderr.strip().splitlines()[-1:]}
            except subprocess.TimeoutExpired:
                row = {"model": model_name, "weights": w, "error": f"over {args.timeout:.0f} s"}
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    gb = 1e9
    print(f"\n{'model':<10} {'weights':<9} {'ready s':>8} {'peak GB':>8} {'object GB':>9} {'w+KV GB':>8} "
          f"{'cache GB':>8} {'plain tok/s':>11} {'vs HF fp32':>10} {'vs HF at w':>10} {'of BW limit':>11} {'== HF':>6}")
    for r in rows:
        if "error" in r:
            print(f"{r['model']:<10} {r['weights']:<9} failed: {r['error']}")
            continue
        print(f"{r['model']:<10} {r['weights']:<9} {r['ready_s']:8.1f} {r['peak_rss_bytes'] / gb:8.2f} "
              f"{r['object_rss_bytes'] / gb:9.2f} {(r['weight_bytes'] + r['kv_bytes']) / gb:8.2f} "
              f"{r['graph_cache_bytes'] / gb:8.3f} {r['plain_tok_s']:11.2f} {r['plain_tok_s'] / r['hf_fp32_tok_s']:9.2f}x "
              f"{r['plain_tok_s'] / r['hf_at_precision_tok_s']:9.2f}x "
              f"{r['plain_tok_s'] / r['bandwidth_limit_tok_s']:10.0%} {str(r['equal_to_hf_at_precision']):>6}")
    if args.out:
        write_json(args.out, dict(cpu=cpu_name(), torch=torch.__version__, threads=torch.get_num_threads(),
                                  new_tokens=args.new_tokens, prompt_tokens=args.prompt_tokens), rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
