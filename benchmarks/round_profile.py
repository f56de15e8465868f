"""Per-round wall time by depth: ngram vs suffix vs a second ngram object (single workload, greedy, interleaved).

Times every compiled round call per depth k, and the rest of each generate call per round (host work +
eager prefill), for three objects in one process: it separates drafter quality from per-round cost.

    OMP_WAIT_POLICY=PASSIVE MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=68719476736 \
    MALLOC_TOP_PAD_=1073741824 python benchmarks/round_profile.py 4 > benchmarks/results/round_profile_s4.txt
"""
import json, os, sys, time, statistics, collections, torch
sys.path.insert(0, os.path.dirname(__file__))
import specgraph
from specgraph.models import load_model
from specgraph.suffix import SuffixIndex
from suffix_bench import build_workloads
model, tok = load_model("default")
eos = model.generation_config.eos_token_id; pad = model.generation_config.pad_token_id or eos
calls = build_workloads(model, tok, 64, eos, pad)["single"]
K = int(sys.argv[1]) if len(sys.argv) > 1 else 4
kw = dict(num_speculative_tokens=K, backend="inductor", max_batch_size=1, max_seq_len=1024, autotune=False)
fasts = {"ngram": specgraph.compile(model, "ngram", **kw), "suffix": specgraph.compile(model, "suffix", **kw),
         "ngram_b": specgraph.compile(model, "ngram", **kw)}
rec = {n: collections.defaultdict(list) for n in fasts}
def instrument(name, fast):
    orig = fast._round_fn
    def round_fn(B, params, width, k):
        fn = orig(B, params, width, k)
        def timed(*a):
            t0 = time.perf_counter(); out = fn(*a); rec[name][k].append(time.perf_counter() - t0); return out
        return timed
    fast._round_fn = round_fn
for n, f in fasts.items(): instrument(n, f)
tot = {n: [] for n in fasts}
with torch.no_grad():
    for run in range(4):
        for n, f in fasts.items():
            if f.draft == "suffix": f.suffix_index = SuffixIndex()
            if run == 0: rec[n].clear()
            t0 = time.perf_counter(); toks = 0; rounds = 0
            for ids in calls:
                out = f.generate(ids, max_new_tokens=64, eos_token_id=eos, pad_token_id=pad); toks += out.shape[1] - ids.shape[1]; rounds += f.stats.rounds
            dt = time.perf_counter() - t0
            if run == 0:
                print("warm", n, round(dt, 1), flush=True); [rec[m].clear() for m in rec]; continue
            tot[n].append((toks / dt, rounds, dt))
            print(run, n, f"{toks/dt:.1f} tok/s rounds {rounds}", flush=True)
res = {}
for n in fasts:
    r = rec[n]; nr = sum(len(v) for v in r.values()); rt = sum(sum(v) for v in r.values())
    wall = sum(x[2] for x in tot[n])
    print(n, "median tok/s %.2f" % statistics.median(x[0] for x in tot[n]),
          {k: (len(v), round(1e3 * statistics.median(v), 1)) for k, v in sorted(r.items())},
          "host+prefill ms/round %.2f" % (1e3 * (wall - rt) / nr))
    res[n] = {"tokens_per_s": [x[0] for x in tot[n]], "round_ms_by_k": {k: [1e3 * t for t in v] for k, v in r.items()},
              "host_prefill_ms_per_round": 1e3 * (wall - rt) / nr}
with open(os.path.join(os.path.dirname(__file__), "results", f"round_profile_k{K}.json"), "w") as f:
    json.dump({"meta": {"K": K, "torch": torch.__version__, "autotune": False}, "objects": res}, f)
