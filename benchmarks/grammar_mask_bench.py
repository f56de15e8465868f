"""Grammar mask time per token at the default model's vocabulary (49,152): xgrammar against
llguidance, the two grammar libraries on PyPI that structured output could be built on.

For each answer of benchmarks/json_prompts.py's schemas (a JSON answer written here per schema),
each library compiles the schema once, then walks the answer token by token: fill the next-token
bitmask, accept the token. Reported: compile time, and the median / mean / p99 of the fill time per
token over all answers, after one untimed walk (the libraries cache per-state work).

    pip install llguidance   # xgrammar comes with specgraph[grammar]
    python benchmarks/grammar_mask_bench.py --out benchmarks/results/grammar_mask_smollm2.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from specgraph.models import load_model

sys.path.insert(0, os.path.dirname(__file__))
from generate_bench import write_json  # noqa: E402
from json_prompts import EVENT, PERSON, PRODUCT, RECIPE, REVIEW, TASKS  # noqa: E402
from width_profile import cpu_name  # noqa: E402

ANSWERS = [
    (PERSON, {"name": "Maria Lopez", "age": 34, "city": "Valencia", "job": "architect"}),
    (TASKS, {"tasks": [{"title": "fix the login bug", "priority": "high", "done": False},
                       {"title": "write the release notes", "priority": "medium", "done": True}]}),
    (REVIEW, {"sentiment": "mixed", "score": 7, "pros": ["great sound", "long battery"],
              "cons": ["warm ear cushions", "app crashes"]}),
    (EVENT, {"event": "quarterly planning meeting", "date": "March 14", "location": "Blue Room",
             "attendees": ["Alice", "Bob", "Chen"]}),
    (PRODUCT, {"product": "Trailblazer backpack", "price": 89.99, "currency": "USD", "in_stock": True,
               "colors": ["black", "olive", "navy"]}),
    (RECIPE, {"dish": "pancakes", "servings": 4, "ingredients": ["flour", "eggs", "milk", "salt"], "minutes": 25}),
]


def walk_xgrammar(tok, vocab, eos):
    import xgrammar as xgr

    comp = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=[eos]))
    compile_s, fills = [], []
    for schema, answer in ANSWERS:
        ids = tok.encode(json.dumps(answer), add_special_tokens=False) + [eos]
        t0 = time.perf_counter()
        g = comp.compile_json_schema(json.dumps(schema))
        compile_s.append(time.perf_counter() - t0)
        mask = xgr.allocate_token_bitmask(1, vocab)
        for rep in range(2):
            m = xgr.GrammarMatcher(g)
            for t in ids:
                t0 = time.perf_counter()
                m.fill_next_token_bitmask(mask)
                dt = time.perf_counter() - t0
                assert m.accept_token(t)
                if rep:
                    fills.append(dt)
    return compile_s, fills


def walk_llguidance(tok, vocab, eos):
    import llguidance
    import llguidance.hf
    import llguidance.torch

    lt = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    compile_s, fills = [], []
    for schema, answer in ANSWERS:
        ids = tok.encode(json.dumps(answer), add_special_tokens=False) + [eos]
        t0 = time.perf_counter()
        g = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        llguidance.LLMatcher(lt, g)
        compile_s.append(time.perf_counter() - t0)
        mask = llguidance.torch.allocate_token_bitmask(1, vocab)
        for rep in range(2):
            m = llguidance.LLMatcher(lt, g)
            for t in ids:
                t0 = time.perf_counter()
                llguidance.torch.fill_next_token_bitmask(m, mask, 0)
                dt = time.perf_counter() - t0
                assert m.consume_token(t), m.get_error()
                if rep:
                    fills.append(dt)
    return compile_s, fills


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    model, tok = load_model(args.model)
    vocab = model.get_output_embeddings().out_features
    eos = model.generation_config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    rows = []
    for name, walk in (("xgrammar", walk_xgrammar), ("llguidance", walk_llguidance)):
        compile_s, fills = walk(tok, vocab, eos)
        us = sorted(1e6 * f for f in fills)
        rows.append({"library": name, "tokens": len(us), "compile_ms_median": 1e3 * statistics.median(compile_s),
                     "fill_us_median": statistics.median(us), "fill_us_mean": statistics.mean(us),
                     "fill_us_p99": us[int(0.99 * (len(us) - 1))]})
    print(f"{'library':12s} {'tokens':>6s} {'compile ms':>10s} {'fill us median':>14s} {'mean':>6s} {'p99':>6s}")
    for r in rows:
        print(f"{r['library']:12s} {r['tokens']:6d} {r['compile_ms_median']:10.1f} {r['fill_us_median']:14.1f} "
              f"{r['fill_us_mean']:6.1f} {r['fill_us_p99']:6.1f}")
    if args.out:
        write_json(args.out, {"model": args.model, "vocab": vocab, "cpu": cpu_name(), "torch": torch.__version__}, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
