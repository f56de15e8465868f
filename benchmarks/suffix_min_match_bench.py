"""Suffix decoding's minimum context match (SUFFIX_MIN_MATCH) on the multi-turn workload of suffix_bench.py:
specgraph ngram k8 vs suffix chains drafting after matches of >= 1 and >= 2 tokens, interleaved, 3 runs.

    OMP_WAIT_POLICY=PASSIVE MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=68719476736 \
    MALLOC_TOP_PAD_=1073741824 python benchmarks/suffix_min_match_bench.py
"""
import json, os, statistics, sys, time

import torch
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import specgraph, specgraph.proposers.suffix as C
from specgraph.models import load_model
from specgraph.suffix import SuffixIndex
from suffix_bench import build_workloads
model, tok = load_model("default")
eos = model.generation_config.eos_token_id; pad = model.generation_config.pad_token_id or eos
N = 64
calls = build_workloads(model, tok, N, eos, pad)["multiturn"]
kw = dict(backend="inductor", max_batch_size=1, max_seq_len=1024)
orig = C.suffix_chains
fasts = {"ngram_k8": (specgraph.compile(model, "ngram", num_speculative_tokens=8, **kw), None),
         "suffix_mm1": (specgraph.compile(model, "suffix", num_speculative_tokens=8, **kw), 1),
         "suffix_mm2": (specgraph.compile(model, "suffix", num_speculative_tokens=8, **kw), 2)}
def run(name):
    f, mm = fasts[name]
    if mm is not None:
        f.suffix_index = SuffixIndex()
        C.suffix_chains = lambda s, k, min_score=C.SUFFIX_MIN_SCORE, min_match=None: orig(s, k, min_score, mm)
    new = rounds = 0; t = 0.0; outs = []
    for ids in calls:
        t0 = time.perf_counter(); o = f.generate(ids, max_new_tokens=N, eos_token_id=eos, pad_token_id=pad); t += time.perf_counter() - t0
        new += o.shape[1] - ids.shape[1]; rounds += f.stats.rounds; outs.append(o)
    C.suffix_chains = orig
    return new / t, new / rounds, outs
for n in fasts:
    t0 = time.perf_counter(); run(n); print("warm", n, round(time.perf_counter() - t0), flush=True)
res = {n: [] for n in fasts}
for r in range(3):
    for n in fasts:
        tps, em, outs = run(n); res[n].append(tps); print(r, n, round(tps, 1), "tok/s", round(em, 2), "per round", flush=True)
base = statistics.median(res["ngram_k8"])
for n in fasts: print(n, "median", round(statistics.median(res[n]), 1), "ratio vs ngram", round(statistics.median(res[n]) / base, 3))
with open("benchmarks/results/suffix_min_match_cpu.json", "w") as fh:
    json.dump({"runs_tok_s": res, "ratio_vs_ngram": {n: statistics.median(v) / base for n, v in res.items()}}, fh, indent=1)
