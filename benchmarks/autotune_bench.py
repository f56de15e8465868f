"""Inductor autotune vs default on SmolLM2: two compiled objects, interleaved, median tokens/s.

    OMP_WAIT_POLICY=PASSIVE MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=68719476736 \
    MALLOC_TOP_PAD_=1073741824 python benchmarks/autotune_bench.py [ngram]

Plain decoding (or the drafter given as the argument), 48 new tokens of a summarize prompt, 3 runs
after a warm-up that compiles every shape; prints each run, the medians and greedy equality with HF.
"""
import time, torch, sys, statistics
import specgraph
from specgraph.models import load_model
torch.manual_seed(0)
model, tok = load_model("default")
ids = tok.apply_chat_template([{"role": "user", "content": "Summarize: The quick brown fox jumps over the lazy dog. " * 5}], add_generation_prompt=True, return_tensors="pt")
ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
fasts = {}
for name, autotune in [("autotune_off", False), ("autotune", True)]:
    f = specgraph.compile(model, sys.argv[1] if len(sys.argv) > 1 else None, max_batch_size=1, max_seq_len=512,
                          autotune=autotune)
    t0 = time.perf_counter(); f.generate(ids, max_new_tokens=8); print(name, "warm", round(time.perf_counter()-t0,1), flush=True)
    fasts[name] = f
res = {n: [] for n in fasts}
outs = {}
for r in range(3):
    for n, f in fasts.items():
        t0 = time.perf_counter(); o = f.generate(ids, max_new_tokens=48); dt = time.perf_counter()-t0
        res[n].append(48/dt); outs[n] = o
        print(n, r, round(48/dt, 1), "tok/s", f.stats.as_dict().get("mean_emitted_per_round"), flush=True)
ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=48, do_sample=False)
for n in fasts: print(n, "median tok/s", round(statistics.median(res[n]),1), "equal HF", torch.equal(outs[n], ref))
import json, os
os.makedirs("benchmarks/results", exist_ok=True)
with open("benchmarks/results/autotune_cpu.json", "w") as fh:
    json.dump({"drafter": sys.argv[1] if len(sys.argv) > 1 else None, "torch": torch.__version__, "runs_tok_s": res,
               "median_tok_s": {n: statistics.median(v) for n, v in res.items()},
               "greedy_equal_hf": {n: torch.equal(outs[n], ref) for n in fasts}}, fh, indent=1)
print("wrote benchmarks/results/autotune_cpu.json")
