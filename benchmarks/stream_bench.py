"""A stream of unseen requests: start-up and tokens/s over the whole stream, HF against specgraph.

What a user sees serving real traffic: each method loads and builds once (start-up, reported on
its own), takes one warm-up call, then answers a stream of varied prompts it has never seen (code,
chat, summarisation, math; prompt lengths from ~20 to ~600 tokens), greedy, batch 1. Methods run
interleaved, prompt by prompt, in one process; tokens/s = all new tokens / all seconds over the
stream. Every specgraph output is checked against HF's greedy output. ``--second-process`` also
starts each specgraph method again in a fresh process (Inductor's on-disk caches warm) and
reports that start-up.

    OMP_WAIT_POLICY=PASSIVE MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=68719476736 \
    MALLOC_TOP_PAD_=1073741824 python benchmarks/stream_bench.py --second-process \
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

import specgraph
from specgraph.models import load_model

sys.path.insert(0, os.path.dirname(__file__))
from batch_bench import _source_commit  # noqa: E402
from generate_bench import write_json  # noqa: E402
from width_profile import cpu_name  # noqa: E402

_CODE = '''import json
import os
from dataclasses import dataclass, field


@dataclass
class Task:
    name: str
    priority: int = 0
    done: bool = False
    tags: list[str] = field(default_factory=list)


class TaskStore:
    def __init__(self, path):
        self.path = path
        self.tasks = {}
        if os.path.exists(path):
            with open(path) as f:
                for row in json.load(f):
                    self.tasks[row["name"]] = Task(**row)

    def add(self, name, priority=0, tags=None):
        if name in self.tasks:
            raise KeyError(f"task {name} exists")
        self.tasks[name] = Task(name, priority, False, list(tags or []))

    def complete(self, name):
        self.tasks[name].done = True

    def pending(self):
        return sorted((t for t in self.tasks.values() if not t.done), key=lambda t: -t.priority)

    def by_tag(self, tag):
        return [t for t in self.tasks.values() if tag in t.tags]

    def save(self):
        rows = [t.__dict__ for t in self.tasks.values()]
        with open(self.path, "w") as f:
            json.dump(rows, f, indent=2)
'''

_REPORT = ("The city council met on Tuesday to review the water department's annual report. The report said "
           "that the average household used 312 litres of water a day, down from 340 the year before, after "
           "the council replaced 4,000 old meters and repaired leaks in the northern district. Spending on "
           "repairs rose by 18 percent, to 2.1 million, while income from water bills fell slightly because "
           "households used less. The department asked for a 5 percent rise in the base charge to cover the "
           "gap, arguing that the new meters would pay for themselves within six years. Two council members "
           "objected, saying that families on low incomes already struggled with bills, and proposed a "
           "reduced rate for the first 100 litres a day instead. The mayor asked the department to return "
           "next month with the cost of both options, and with a plan for the southern district, where "
           "pipes are older and leaks are still common. The report also noted that water quality tests met "
           "every national standard for the fourth year running, and that the reservoir was at 86 percent "
           "of capacity at the end of the summer, its highest level in a decade. ")

PROMPTS = [
    ("chat-short", "Hi! What is a good name for a grey cat?"),
    ("math-short", "What is 17 times 23? Show your working."),
    ("chat", "I'm planning a weekend trip to the mountains in autumn. What should I pack? Give a list."),
    ("code-write", "Write a Python function that checks whether a string is a palindrome, ignoring case and "
                   "punctuation, with a docstring and three examples."),
    ("math", "A shop sells pencils at 3 for 1.20 and pens at 2 for 3.50. How much do 12 pencils and 5 pens cost? "
             "Explain each step."),
    ("explain", "Explain the difference between a list and a tuple in Python, and when to use each."),
    ("code-review", "Review this code and list its bugs and style problems:\n\n" + _CODE),
    ("code-extend", "Add a method `remove(name)` and a method `rename(old, new)` to this class, and show the "
                    "whole class again:\n\n" + _CODE),
    ("summarise", "Summarise this report in five sentences, keeping the numbers:\n\n" + _REPORT),
    ("summarise-long", "Summarise the following two reports, then list what changed between them:\n\n" + _REPORT
     + "\n\nA year later: " + _REPORT.replace("312", "298").replace("18 percent", "9 percent")),
    ("questions", "Read this and answer: how much water did a household use a day, and what did the two council "
                  "members propose?\n\n" + _REPORT),
    ("code-tests", "Write unittest tests for every method of this class:\n\n" + _CODE),
]


def chat_ids(tok, text):
    enc = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt")
    return enc if isinstance(enc, torch.Tensor) else enc["input_ids"]


SG_METHODS = {  # name -> (draft, compile kwargs)
    "specgraph plain": (None, {}),
    "specgraph ngram": ("ngram", {}),
    "specgraph suffix": ("suffix", {}),
    "specgraph eagle": ("eagle", {}),
}


def build(model, name, args):
    draft, kw = SG_METHODS[name]
    t0 = time.perf_counter()
    fast = specgraph.compile(model, draft, max_batch_size=args.batch, max_seq_len=args.max_seq_len, modes=("greedy",),
                             **kw)
    return fast, time.perf_counter() - t0


def startup_only(args) -> int:
    """One process: load the model and build one method (what a second process pays)."""
    t0 = time.perf_counter()
    model, _ = load_model(args.model)
    load_s = time.perf_counter() - t0
    fast, build_s = build(model, args.startup_only, args)
    print(json.dumps({"load_s": load_s, "build_s": build_s, "graphs": len(fast.graphs_built)}))
    return 0


@torch.no_grad()
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1, help="prompts per call (left-padded batches of the stream)")
    ap.add_argument("--methods", default="hf plain,hf prompt lookup,specgraph plain,specgraph ngram,specgraph suffix")
    ap.add_argument("--prompt-lookup-tokens", type=int, default=10)
    ap.add_argument("--second-process", action="store_true", help="also time each specgraph start-up in a new process")
    ap.add_argument("--startup-only", default=None, help=argparse.SUPPRESS)
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
    gkw = dict(max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=pad)
    runners, startup = {}, {}
    for m in methods:
        if m == "hf plain":
            runners[m] = lambda ids, mask: model.generate(ids, attention_mask=mask, **gkw)
            startup[m] = {"load_s": load_s, "build_s": 0.0}
        elif m == "hf prompt lookup":
            runners[m] = lambda ids, mask: model.generate(ids, attention_mask=mask,
                                                          prompt_lookup_num_tokens=args.prompt_lookup_tokens, **gkw)
            startup[m] = {"load_s": load_s, "build_s": 0.0}
        else:
            print(f"building {m} ...", file=sys.stderr, flush=True)
            fast, build_s = build(model, m, args)
            runners[m] = lambda ids, mask, fast=fast: fast.generate(ids, attention_mask=mask, **gkw)
            startup[m] = {"load_s": load_s, "build_s": build_s, "graphs": len(fast.graphs_built)}
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
            totals[m]["tokens"] += int(((new != pad) | (new == eos)).sum()) if args.batch > 1 else new.shape[1]
            totals[m]["seconds"] += dt
            if fast is not None:
                totals[m]["rounds"] += fast.stats.rounds
                totals[m]["builds_in_stream"] += len(fast.graphs_built) - built
            outputs[m].append(out)
        print(f"{','.join(names)}: prompt {ids.shape[1]} tokens done", file=sys.stderr, flush=True)
    ref = outputs.get("hf plain")
    rows = []
    for m in methods:
        t = totals[m]
        equal = None if ref is None else all(torch.equal(a, b) for a, b in zip(outputs[m], ref))
        rows.append({"method": m, **t, "tokens_per_s": t["tokens"] / t["seconds"], **startup[m], "equal_to_hf": equal})
    hf = next((r["tokens_per_s"] for r in rows if r["method"] == "hf plain"), None)
    if args.second_process:
        for r in rows:
            if r["method"].startswith("specgraph"):
                cmd = [sys.executable, __file__, "--startup-only", r["method"], "--model", args.model, "--batch",
                       str(args.batch), "--max-seq-len", str(args.max_seq_len)]
                t0 = time.perf_counter()
                res = subprocess.run(cmd, capture_output=True, text=True, check=True)
                second = json.loads(res.stdout.strip().splitlines()[-1])
                r["second_process"] = {**second, "wall_s": time.perf_counter() - t0}
    print(f"\n{'method':<22} {'tok/s':>7} {'vs HF':>6} {'tokens':>7} {'start-up s':>11} {'2nd proc s':>11} "
          f"{'graphs':>6} {'built in stream':>15} {'== HF':>6}")
    for r in rows:
        second = r.get("second_process", {}).get("wall_s")
        print(f"{r['method']:<22} {r['tokens_per_s']:7.1f} {r['tokens_per_s'] / hf if hf else float('nan'):5.2f}x "
              f"{r['tokens']:7d} {r['load_s'] + r['build_s']:11.1f} {second if second else float('nan'):11.1f} "
              f"{r.get('graphs', 0):6d} {r['builds_in_stream']:15d} {str(r['equal_to_hf']):>6}")
    meta = dict(model=args.model, cpu=cpu_name(), torch=torch.__version__, batch=args.batch,
                max_new_tokens=args.max_new_tokens, max_seq_len=args.max_seq_len, prompts=[n for n, _ in PROMPTS],
                prompt_tokens=[int(ids.shape[1]) for _, ids in prompts], threads=torch.get_num_threads(),
                commit=_source_commit())
    if args.out:
        write_json(args.out, meta, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
