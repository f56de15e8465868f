"""Where a learned-drafter round's time goes: the head's proposal graph, the target's verification
round, and the rest (host work, eager prefill), per method, SmolLM2, batch 1, greedy.

Wraps the compiled objects' proposal and round functions with timers (after a warm-up call that
compiles them), then runs each prompt; optionally a ``torch.profiler`` table of the top operators
over one generate call per method.

    OMP_WAIT_POLICY=PASSIVE MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=68719476736 \\
    MALLOC_TOP_PAD_=1073741824 python benchmarks/learned_profile.py --learned eagle_chain,eagle_tree \\
        --out benchmarks/results/learned_profile.json
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from generate_bench import PROMPTS, _ids, add_learned_arguments, learned_objects, write_json  # noqa: E402

from specgraph.models import load_model  # noqa: E402


def _wrap(obj, name, record, key):
    """Replace ``obj.name`` (a factory returning a callable, or the callable itself) by a timed one."""
    orig = getattr(obj, name)

    def timed_call(fn):
        def run(*a, **kw):
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            record[key].append(time.perf_counter() - t0)
            return out
        return run

    if name.endswith("_fn"):  # factories: (B, ...) -> compiled callable
        setattr(obj, name, lambda *a, **kw: timed_call(orig(*a, **kw)))
    else:
        setattr(obj, name, timed_call(orig))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    add_learned_arguments(ap, default="eagle_chain,eagle_tree,medusa_chain,medusa_tree")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-seq-len", type=int, default=512)
    ap.add_argument("--prompts", default=",".join(PROMPTS))
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--autotune", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument("--torch-profile", action="store_true", help="also print torch.profiler's top operators")
    ap.add_argument("--out", default="benchmarks/results/learned_profile.json")
    args = ap.parse_args(argv)
    model, tok = load_model(args.model)
    objs = learned_objects(model, args, "auto" if args.autotune is None else args.autotune)
    eos = model.generation_config.eos_token_id
    rows = []
    for name, fast in objs.items():
        record = collections.defaultdict(list)
        _wrap(fast, "_round_fn", record, "target_round")
        _wrap(fast, "_tree_round_fn", record, "target_round")
        for p in ("propose_chain", "propose_tree"):
            _wrap(fast.learned, p, record, "head_proposal")
        total, rounds, emitted = 0.0, 0, 0
        for pname in args.prompts.split(","):
            ids = _ids(tok, PROMPTS[pname])
            fast.generate(ids, max_new_tokens=args.max_new_tokens, eos_token_id=eos, pad_token_id=eos)  # compile
            record.clear()
            t0 = time.perf_counter()
            fast.generate(ids, max_new_tokens=args.max_new_tokens, eos_token_id=eos, pad_token_id=eos)
            total += time.perf_counter() - t0
            rounds += fast.stats.rounds
            emitted += fast.stats.emitted
            row_parts = {k: sum(v) for k, v in record.items()}
            medians = {k: 1e3 * statistics.median(v) for k, v in record.items() if v}
            stats = (time.perf_counter() - t0, fast.stats.rounds, fast.stats.emitted)
            if args.torch_profile and pname == args.prompts.split(",")[0]:
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    fast.generate(ids, max_new_tokens=args.max_new_tokens, eos_token_id=eos, pad_token_id=eos)
                print(f"== {name}: torch.profiler, one generate call ({pname})")
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
            rows.append({"method": name, "prompt": pname, "seconds": stats[0],
                         "rounds": stats[1], "emitted": stats[2], **{f"{k}_s": v for k, v in row_parts.items()},
                         "median_ms": medians,
                         "tree_choice": {k: v for k, v in (fast.tree_choice or {}).items() if k != "candidates"}})
        sub = [r for r in rows if r["method"] == name]
        secs = sum(r.get("head_proposal_s", 0) for r in sub), sum(r.get("target_round_s", 0) for r in sub)
        other = total - sum(secs)
        print(f"{name:<14} {emitted / total:6.1f} tok/s  {emitted / max(rounds, 1):.2f} tok/round  per round: head "
              f"{1e3 * secs[0] / rounds:6.1f} ms ({secs[0] / total:4.0%}), target {1e3 * secs[1] / rounds:6.1f} ms "
              f"({secs[1] / total:4.0%}), other {1e3 * other / rounds:5.1f} ms ({other / total:4.0%})", flush=True)
    write_json(args.out, {"torch": torch.__version__, "threads": torch.get_num_threads(), "k": args.k,
                          "max_new_tokens": args.max_new_tokens}, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
