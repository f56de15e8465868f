"""One round definition, several executors: tokens/s of the same graphs run by each, in one process.

Executors of SmolLM2's graph set (greedy, batch 1, the same prompts, interleaved call by call):
the Inductor JIT (frozen weights, GEMM autotuning: ``specgraph.compile(cache=False)``), the JIT
unfrozen (``freeze=False``), the graph cache's frozen, autotuned AOTInductor packages
(``specgraph.compile``'s default), a compiled directory's unfrozen AOTInductor packages
(``compile_dir``'s default) and ONNX Runtime (``export_onnx`` + ``OnnxSpecGenerator``). Reports
build (or export) seconds, load seconds and median tokens/s over the runs, and checks every output
against HF's greedy output.

    SPECGRAPH_GRAPH_CACHE=$(mktemp -d) \\
    OMP_WAIT_POLICY=PASSIVE MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=68719476736 \\
    MALLOC_TOP_PAD_=1073741824 python benchmarks/executor_bench.py --draft ngram \\
        --out benchmarks/results/executors_smollm2_ngram_b1.json
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import specgraph
from specgraph.models import load_model

sys.path.insert(0, os.path.dirname(__file__))
from batch_bench import _source_commit  # noqa: E402
from generate_bench import write_json  # noqa: E402
from stream_bench import chat_ids  # noqa: E402
from stream_prompts import PROMPTS  # noqa: E402
from width_profile import cpu_name  # noqa: E402

EXECUTORS = ("jit frozen", "jit unfrozen", "aot frozen (graph cache)", "aot unfrozen (compile_dir)", "onnx runtime")


def build(name, model, tok, args, work: Path):
    """(generate(ids) -> output ids, build seconds, load seconds) for executor ``name``."""
    draft = None if args.draft == "none" else args.draft
    kw = dict(num_speculative_tokens=4, max_batch_size=1, max_seq_len=args.max_seq_len, modes=("greedy",), progress=False)
    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
    t0 = time.perf_counter()
    if name.startswith("jit"):
        fast = specgraph.compile(model, draft, cache=False, freeze=name == "jit frozen", **kw)
        return (lambda ids: fast.generate(ids, **gen)), time.perf_counter() - t0, 0.0
    if name.startswith("aot frozen"):
        fast = specgraph.compile(model, draft, **kw)
        info = fast.graph_cache or {}
        return (lambda ids: fast.generate(ids, **gen)), time.perf_counter() - t0, info.get("seconds", 0.0)
    if name.startswith("aot unfrozen"):
        from specgraph.aot import compile_dir, load_dir

        compile_dir(model, work / "aot", tokenizer=tok, draft=draft or None, num_speculative_tokens=4,
                    max_seq_len=args.max_seq_len, modes=("greedy",), progress=False)
        built = time.perf_counter() - t0
        t1 = time.perf_counter()
        loaded = load_dir(work / "aot", model=model, tokenizer=False)
        return (lambda ids: loaded.fast.generate(ids, **gen)), built, time.perf_counter() - t1
    from specgraph.onnx import OnnxSpecGenerator

    fast = specgraph.compile(model, draft, backend="eager", warmup=False, **{k: v for k, v in kw.items() if k != "modes"})
    specgraph.export_onnx(fast, work / "onnx", modes=("greedy",), progress=False)
    built = time.perf_counter() - t0
    t1 = time.perf_counter()
    runner = OnnxSpecGenerator(work / "onnx")
    return (lambda ids: runner.generate(ids, **gen)), built, time.perf_counter() - t1


@torch.no_grad()
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--draft", default="ngram", choices=["none", "ngram", "suffix"])
    ap.add_argument("--executors", default=",".join(EXECUTORS))
    ap.add_argument("--prompts", type=int, default=4, help="prompts of the stream set, each run --runs times")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-seq-len", type=int, default=1024)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    model, tok = load_model(args.model)
    names = [e.strip() for e in args.executors.split(",")]
    prompts = [chat_ids(tok, text) for _, text in PROMPTS[:args.prompts]]
    refs = [model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                           do_sample=False) for ids in prompts]
    runners, rows = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in names:
            print(f"building {n} ...", file=sys.stderr, flush=True)
            run, build_s, load_s = build(n, model, tok, args, Path(tmp) / n.split()[0] / n.split()[1])
            run(prompts[0][:, :8])  # one warm-up call
            runners[n] = run
            rows[n] = {"executor": n, "build_s": round(build_s, 1), "load_s": round(load_s, 2), "tok_s": [],
                       "equal_to_hf": True}
        for _ in range(args.runs):
            for ids, ref in zip(prompts, refs):
                for n, run in runners.items():  # interleaved, call by call
                    t0 = time.perf_counter()
                    out = run(ids)
                    dt = time.perf_counter() - t0
                    rows[n]["tok_s"].append((out.shape[1] - ids.shape[1]) / dt)
                    rows[n]["equal_to_hf"] &= torch.equal(out, ref)
    base = statistics.median(rows[names[0]]["tok_s"])
    print(f"\n{'executor':<28} {'build s':>8} {'load s':>7} {'tok/s':>7} {'vs ' + names[0]:>16} {'== HF':>6}")
    for n in names:
        r = rows[n]
        r["median_tok_s"] = statistics.median(r["tok_s"])
        print(f"{n:<28} {r['build_s']:8.1f} {r['load_s']:7.2f} {r['median_tok_s']:7.1f} "
              f"{r['median_tok_s'] / base:15.2f}x {str(r['equal_to_hf']):>6}")
    meta = dict(model=args.model, draft=args.draft, cpu=cpu_name(), torch=torch.__version__, batch=1,
                max_new_tokens=args.max_new_tokens, max_seq_len=args.max_seq_len, runs=args.runs,
                prompts=[n for n, _ in PROMPTS[:args.prompts]], threads=torch.get_num_threads(), commit=_source_commit())
    if args.out:
        write_json(args.out, meta, list(rows.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
