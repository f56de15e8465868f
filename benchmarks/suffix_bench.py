"""Suffix decoding vs prompt lookup on workloads that repeat themselves (SmolLM2, batch 1, one process).

Workloads (each a sequence of generate calls; tokens/s = all new tokens / all time):
  repeated   the same 4 prompts asked 3 times in a row (agentic / repeated-task traffic);
  multiturn  a 3-turn chat whose later turns quote the earlier answers and ask to revise them;
  single     the 4 prompts once each (no repetition across calls).
Methods: HF plain, HF prompt lookup (3 and 10), specgraph "ngram" chain (K), "suffix" chain (K) and
"suffix" dynamic tree. The suffix index starts empty at the start of every workload run, so only
repetition *within* a workload helps. Greedy (with equality to HF plain) and, with --sample, T=0.7.

    OMP_WAIT_POLICY=PASSIVE MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=68719476736 \
    MALLOC_TOP_PAD_=1073741824 python benchmarks/suffix_bench.py --out benchmarks/results/suffix_cpu.json
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

import specgraph
from specgraph.models import load_model
from specgraph.suffix import SuffixIndex

sys.path.insert(0, os.path.dirname(__file__))
from generate_bench import PROMPTS, write_json  # noqa: E402

REVISE = ["Now repeat your previous answer exactly, but add a short title line at the top.",
          "Repeat that answer once more, replacing the title with 'Final version'."]


def chat_ids(tok, messages):
    enc = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    return enc if isinstance(enc, torch.Tensor) else enc["input_ids"]


def build_workloads(model, tok, n_new, eos, pad):
    """Prompt id tensors per workload; multi-turn answers come from HF greedy, so every method
    sees the same conversation."""
    singles = [chat_ids(tok, [{"role": "user", "content": p}]) for p in PROMPTS.values()]
    conv = [{"role": "user", "content": PROMPTS["code"]}]
    turns = []
    for follow in [None] + REVISE:
        if follow is not None:
            conv.append({"role": "user", "content": follow})
        ids = chat_ids(tok, conv)
        turns.append(ids)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new, do_sample=False,
                             eos_token_id=eos, pad_token_id=pad)
        conv.append({"role": "assistant", "content": tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)})
    return {"repeated": singles * 3, "multiturn": turns, "single": singles}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--sample", action="store_true", help="also run T=0.7 sampling")
    ap.add_argument("--settings", default=None,
                    help="comma list of greedy,T0.7 (overrides --sample): one setting per process bounds memory")
    ap.add_argument("--autotune", action="store_true", help="Inductor GEMM autotuning (about 12%% more build time per graph)")
    ap.add_argument("--workloads", default="repeated,multiturn,single")
    ap.add_argument("--out", default="benchmarks/results/suffix_bench.json")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    model, tok = load_model(args.model)
    eos = model.generation_config.eos_token_id
    pad = model.generation_config.pad_token_id or eos
    N = args.max_new_tokens
    kw = dict(backend="inductor", max_batch_size=1, max_seq_len=1024, autotune=args.autotune)
    fasts = {
        f"specgraph_ngram_k{args.k}": specgraph.compile(model, "ngram", num_speculative_tokens=args.k, **kw),
        f"specgraph_suffix_chain_k{args.k}": specgraph.compile(model, "suffix", num_speculative_tokens=args.k, **kw),
        f"specgraph_suffix_tree_d{args.k}": specgraph.compile(model, "suffix", num_speculative_tokens=args.k,
                                                              tree="dynamic", **kw),
    }
    workloads = build_workloads(model, tok, N, eos, pad)
    all_settings = {"greedy": dict(do_sample=False), "T0.7": dict(do_sample=True, temperature=0.7)}
    names = args.settings.split(",") if args.settings else ["greedy"] + (["T0.7"] if args.sample else [])
    unknown = [n for n in names if n not in all_settings]
    if unknown:
        ap.error(f"unknown setting(s) {unknown}; choose from {sorted(all_settings)}")
    settings = [(n, all_settings[n]) for n in names]

    def hf(**extra):
        def run(ids, sampling):
            return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N, eos_token_id=eos,
                                  pad_token_id=pad, **sampling, **extra), None
        return run

    def sg(fast):
        def run(ids, sampling):
            out = fast.generate(ids, max_new_tokens=N, eos_token_id=eos, pad_token_id=pad, **sampling)
            return out, fast.stats
        return run

    methods = {"hf_plain": hf(), "hf_prompt_lookup_3": hf(prompt_lookup_num_tokens=3),
               "hf_prompt_lookup_10": hf(prompt_lookup_num_tokens=10), **{k: sg(f) for k, f in fasts.items()}}

    def run_workload(name, fn, calls, sampling):
        for f in fasts.values():
            if f.draft == "suffix":
                f.suffix_index = SuffixIndex()  # only repetition within this workload run helps
        outs, new, rounds, secs = [], 0, 0, 0.0
        for ids in calls:
            t0 = time.perf_counter()
            out, stats = fn(ids, sampling)
            secs += time.perf_counter() - t0
            new += out.shape[1] - ids.shape[1]
            rounds += stats.rounds if stats is not None else 0
            outs.append(out)
        return new / secs, (new / rounds if rounds else None), outs

    meta = {"torch": torch.__version__, "max_new_tokens": N, "runs": args.runs, "k": args.k, "autotune": args.autotune,
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "calls": {w: len(c) for w, c in workloads.items()}}

    rows = []
    with torch.no_grad():
        for wname in args.workloads.split(","):
            calls = workloads[wname]
            for sname, sampling in settings:
                for name, fn in methods.items():  # warm-up: compiles every shape the workload needs
                    if name.startswith("hf_"):
                        continue
                    t0 = time.perf_counter()
                    # sampled runs reach lengths (attended widths, hence graphs) that depend on the
                    # seed: warm up under each timed seed, or a timed run compiles (and its tokens per
                    # second measure the compile)
                    for r in range(args.runs if sampling.get("do_sample") else 1):
                        if sampling.get("do_sample"):
                            torch.manual_seed(r)
                        run_workload(wname, fn, calls, sampling)
                    print(f"[warm-up] {wname} {sname} {name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
                tps = {m: [] for m in methods}
                outs, per_round = {}, {}
                for r in range(args.runs):
                    for name, fn in methods.items():
                        if sampling.get("do_sample"):
                            torch.manual_seed(r)
                        t, em, o = run_workload(wname, fn, calls, sampling)
                        tps[name].append(t)
                        outs[name], per_round[name] = o, em
                base = statistics.median(tps["hf_plain"])
                for name in methods:
                    med = statistics.median(tps[name])
                    equal = None
                    if not sampling.get("do_sample"):
                        equal = all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(outs[name], outs["hf_plain"]))
                    rows.append({"workload": wname, "setting": sname, "method": name, "tokens_per_s": med,
                                 "ratio_vs_hf_plain": med / base, "emitted_per_round": per_round[name],
                                 "greedy_equal_hf": equal, "runs": tps[name]})
                    ngram = statistics.median(tps[f"specgraph_ngram_k{args.k}"])
                    rows[-1]["ratio_vs_specgraph_ngram"] = med / ngram
                    em = "-" if per_round[name] is None else f"{per_round[name]:.2f}"
                    print(f"{wname:<10} {sname:<6} {name:<28} {med:7.1f} tok/s {med / base:6.2f}x HF plain "
                          f"{med / ngram:5.2f}x sg ngram  emitted/round {em:>5}  equal={equal}", flush=True)
                # a graph compiled past the freeze budget (specgraph.freezing) is slower: say so
                meta["unfrozen_graphs"] = {k: sorted(g for g, fr in f.graph_frozen.items() if not fr)
                                           for k, f in fasts.items()}
                if any(meta["unfrozen_graphs"].values()):
                    print(f"warning: unfrozen graphs {meta['unfrozen_graphs']}", file=sys.stderr, flush=True)
                write_json(args.out, meta, rows)  # after every workload and setting: a stopped run keeps it
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
