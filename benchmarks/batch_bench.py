"""Batch throughput with speculation off, at fixed depths γ, and with ``num_speculative_tokens="auto"``
for B = 1, 2, 4, 8, 16, 32.

Workloads (each a list of prompts cycled into static batches of B rows; all rows generate
--max-new-tokens greedily, EOS disabled so every method produces the same number of tokens):

* ``smollm2-ngram``: SmolLM2-135M-Instruct (``specgraph.models.load_model("default")``, fp32), the
  package's sample prompts (``specgraph.cli.BENCH_PROMPTS``) with prompt lookup drafts;
* ``smollm2-draft6L``: the same with SmolLM2's first 6 of 30 layers as a draft model (prompt lookup
  is not used): a draft whose cost is not repaid by its acceptance on a 2-core CPU, which "auto" must
  switch off;
* ``llama1b-replay-β``: a random-weight Llama of about 1.1B parameters (``LlamaConfig`` built here,
  fp32) on seeded random prompts, drafted by :class:`specgraph.drafters.ReplayDrafter`: the
  target's own greedy continuation (HF ``generate``, once per prompt), each token corrupted with
  probability 1 - β, so acceptance is i.i.d. β per position. All β share one compiled object.

Per workload one compiled object serves every method (same graphs; ``specgraph.adaptive.forced_depth``
pins the depth for "off" and "γ=k"); "auto" chooses among the fixed depths and 0, with a cost
model measured on that object first (``specgraph.planner.measure_cost_model``; acceptance is
learned online; like a serving object, "auto" keeps what earlier calls observed, so its warm-up
call teaches the timed ones the workload's acceptance). Throughput = new tokens summed over the
batch / wall time (the eager prompt prefill included), median of --runs after a warm-up run of
every method (which compiles); each timed run goes round the methods in its own seeded random
order. The summary adds auto's paired ratio (median over runs of auto's throughput over the
fastest method's in the same run) and its share of rounds at that method's depth.
Every method's output is checked against "off" (greedy: equal).

Targets: auto >= 0.95 x max(off, best fixed γ) at every B; auto >= 0.90 x best fixed γ at B = 1.

    python benchmarks/batch_bench.py --out benchmarks/results/batch_cpu.json         # full run: hours on 2 CPU cores
    python benchmarks/batch_bench.py --smoke --out /tmp/batch_smoke.json              # tiny models, B in 1,2

Memory: ``--freeze`` gives every compiled graph its own prepacked weight copy (1B fp32: 4.4 GB
each), so it is off by default.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import torch

import specgraph
from specgraph.adaptive import forced_depth
from specgraph.drafters import ReplayDrafter
from specgraph.planner import left_pad, measure_cost_model

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # batch_pool beside it, however this is run
from batch_pool import meets_targets  # noqa: E402


def say(msg: str) -> None:
    print(f"[batch_bench] {msg}", file=sys.stderr, flush=True)


def llama_1b(smoke: bool):
    """Random-weight Llama: ~1.1B parameters (TinyLlama's shape) or, for --smoke, a tiny one."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    if smoke:
        cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    else:
        cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                          num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def smollm2(smoke: bool):
    """(model, token-id prompts): SmolLM2 with its chat template, or a tiny random Llama on
    repetitive prompts for --smoke (prompt lookup then finds matches)."""
    if smoke:
        model = llama_1b(True)
        g = torch.Generator().manual_seed(1)
        prompts = []
        for i in range(4):
            pattern = torch.randint(2, 120, (2 + i,), generator=g).tolist()
            prompts.append((pattern * 20)[: 12 + 3 * i])
        return model, prompts
    from specgraph.cli import BENCH_PROMPTS
    from specgraph.models import load_model

    model, tok = load_model("default")
    prompts = []
    for text in BENCH_PROMPTS.values():
        enc = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt")
        prompts.append((enc if isinstance(enc, torch.Tensor) else enc["input_ids"])[0].tolist())
    return model, prompts


def random_prompts(vocab: int, n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (int(torch.randint(lo, hi + 1, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@torch.no_grad()
def run_batches(fast, batches, max_new_tokens, pad, method, gamma, run=-1):
    """All batches once under ``method``: (outputs, new tokens, rounds, depth histogram, round
    seconds by the depth that ran). A replay drafter corrupts batch i of timed run ``run`` (-1: the
    warm-up) with its own seed, the same for every method in that run: one seed for every call
    would replay one draw of ~24 corruptions per row for the whole benchmark (at B = 1 and β = 0.3
    a handful of clean positions, clustered, and every probe of auto's landing on the same ones)."""
    outs, tokens, rounds, depths, times, calls = [], 0, 0, {}, {}, []
    replay = getattr(fast, "chain_drafter", None)
    replay = replay if isinstance(replay, ReplayDrafter) else None
    ctx = forced_depth(fast, 0 if method == "off" else gamma) if method != "auto" else None
    if ctx is not None:
        ctx.__enter__()
    try:
        for i, (ids, mask) in enumerate(batches):
            if replay is not None:
                replay.seed = 1000 * (run + 1) + i
            outs.append(fast.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                                      eos_token_id=[], pad_token_id=pad))
            tokens += fast.stats.emitted
            rounds += fast.stats.rounds
            for d in fast.policy.trace:
                depths[d] = depths.get(d, 0) + 1
            for d, sec in fast.policy.round_times:
                times.setdefault(d, []).append(sec)
            # each call's depths (and, under auto, the acceptance memory after it): where a cell went wrong
            memory = getattr(fast.policy, "pooled_acceptance", None)
            calls.append("".join(map(str, fast.policy.trace)) if memory is None else
                         ["".join(map(str, fast.policy.trace)), [round(float(a), 3) for a in memory()]])
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)
    return outs, tokens, rounds, depths, times, calls


def _source_commit() -> str | None:
    """The git commit the imported specgraph came from (+ "-dirty" when its tree has changes): which
    policy a sweep measured, so that only sweeps of one policy are pooled (batch_pool.py)."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(specgraph.__file__)))
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--", "specgraph", "passes", "kernels"],
                               capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None  # installed from a wheel, or no git
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def _kind(method: str) -> str:
    return "fixed" if method.startswith("gamma") else method


def bench_workload(name, fast, prompts, args, batch_sizes, gammas, extra=None):
    rows = []
    pad = 0
    for B in batch_sizes:
        n_batches = max(1, -(-len(prompts) // B))
        batches = [left_pad([prompts[(i * B + j) % len(prompts)] for j in range(B)], pad) for i in range(n_batches)]
        methods = [("off", 0)] + [(f"gamma={g}", g) for g in gammas] + [("auto", None)]
        # every method is warmed up (compiled) first, then the timed runs go round the methods in
        # turn, so a slow stretch of this shared machine hits them all alike
        for method, g in methods:
            t0 = time.perf_counter()
            run_batches(fast, batches, args.max_new_tokens, pad, _kind(method), g)
            say(f"{name} B={B} {method}: warm-up {time.perf_counter() - t0:.1f} s")
        tps, last, traces = {m: [] for m, _ in methods}, {}, {m: [] for m, _ in methods}
        for run in range(args.runs):
            # each run goes round the methods in its own (seeded) order: with a fixed order auto always
            # runs right after the deepest γ, and on a drifting host its plain rounds can read up to 2x
            # off's for the same graph; a rotation keeps those neighbours
            for method, g in random.Random(run).sample(methods, len(methods)):
                t0 = time.perf_counter()
                last[method] = run_batches(fast, batches, args.max_new_tokens, pad, _kind(method), g, run)
                tps[method].append(last[method][1] / (time.perf_counter() - t0))
                traces[method].append(last[method][5])
        ref, results = last["off"][0], {}
        for method, g in methods:
            outs, tokens, rounds, hist, times, _ = last[method]
            equal = all(torch.equal(a, b) for a, b in zip(outs, ref))
            results[method] = statistics.median(tps[method])
            # in-loop round times (last timed run) by the depth that ran (prompt lookup without a match: 0)
            round_ms = {d: 1e3 * statistics.median(v) for d, v in sorted(times.items())}
            rows.append({"workload": name, **(extra or {}), "batch": B, "method": method, "gamma": g,
                         "tokens_per_s": results[method], "runs": tps[method], "new_tokens": tokens,
                         "tokens_per_row_round": tokens / max(rounds, 1) / B, "depths": hist,
                         "round_ms_median": round_ms, "equal_to_off": equal})
            if method == "auto":  # what auto learned: in-loop cost / cost curve, per depth (0 first)
                rows[-1]["cost_factors"] = dict(zip(fast.policy.depths, fast.policy.cost_factors(B).tolist()))
                rows[-1]["modelled_round_ms"] = dict(zip(fast.policy.depths,
                                                         [1e3 * fast.policy.cost.round_cost(d, B) for d in fast.policy.depths]))
                # how much a row's estimate leans on the other rows and on the memory (observations)
                rows[-1]["rows_weight"] = fast.policy.rows_weight()
                rows[-1]["memory_weight"] = fast.policy.memory_weight()
                # every timed call's depths and the memory after it, per run ("4440000..."; the pooled
                # memory is folded in when the next call starts, so it lags one call)
                rows[-1]["calls"] = traces[method]
            say(f"{name} B={B} {method}: {results[method]:.1f} tok/s, {rows[-1]['tokens_per_row_round']:.2f} "
                f"per row per round, depths {dict(sorted(hist.items()))}, round ms "
                f"{ {d: round(t, 1) for d, t in round_ms.items()} }, equal={equal}")
        best_fixed = max(results[f"gamma={g}"] for g in gammas)
        for r in rows[-len(methods):]:
            r["ratio_vs_off"] = r["tokens_per_s"] / results["off"]
        rows[-1]["auto_vs_best_of_off_and_fixed"] = results["auto"] / max(results["off"], best_fixed)
        rows[-1]["auto_vs_best_fixed"] = results["auto"] / best_fixed
    return rows


def summary(rows) -> list[dict]:
    out = []
    for r in rows:
        if r["method"] != "auto":
            continue
        # a check the host's noise cannot blur: did auto run the depths of the fastest method?
        same = [q for q in rows if q["workload"] == r["workload"] and q["batch"] == r["batch"] and q["method"] != "auto"]
        best = max(same, key=lambda q: q["tokens_per_s"])
        ran = {int(d): n for d, n in r["depths"].items()}
        # run by run, auto against the fastest method's run in the same round of methods (minutes
        # apart at most): the host's drift between rounds of methods cancels
        paired = statistics.median(a / b for a, b in zip(r["runs"], best["runs"]))
        out.append({"workload": r["workload"], "batch": r["batch"], "auto_vs_best": r["auto_vs_best_of_off_and_fixed"],
                    "auto_vs_best_fixed": r["auto_vs_best_fixed"],
                    "meets_targets": meets_targets(r["batch"], r["auto_vs_best_of_off_and_fixed"], r["auto_vs_best_fixed"]),
                    "best_method": best["method"], "auto_vs_best_paired": paired, "auto_depths": ran,
                    "auto_share_at_best_depth": ran.get(best["gamma"], 0) / max(sum(ran.values()), 1),
                    "rows_weight": r.get("rows_weight"), "memory_weight": r.get("memory_weight")})
    return out


def plot(rows, path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        say("matplotlib is not installed: no PNG (pip install 'specgraph[plot]'); the JSON has every number")
        return None
    names = list(dict.fromkeys(r["workload"] for r in rows))
    cols = min(3, len(names))
    nrows = -(-len(names) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5 * cols, 3.8 * nrows), squeeze=False)
    for ax, name in zip(axes.flat, names):
        sub = [r for r in rows if r["workload"] == name]
        for i, method in enumerate(dict.fromkeys(r["method"] for r in sub)):
            pts = sorted((r["batch"], r["tokens_per_s"]) for r in sub if r["method"] == method)
            style = dict(linewidth=2.5, color="black") if method == "auto" else dict(color=f"C{i}")
            ax.plot([b for b, _ in pts], [t for _, t in pts], "o-", label=method, **style)
        ax.set_xscale("log", base=2)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("batch size B")
        ax.set_ylabel("tokens/s (summed over the batch)")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def ints(v):
    return [int(x) for x in v.split(",") if x.strip()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny random models, B in 1,2, few tokens, eager backend")
    ap.add_argument("--models", default="smollm2,llama1b",
                    help="workload families: smollm2 (prompt lookup), smollm2-draft6L (its first 6 layers as a "
                         "draft model), llama1b (replay drafts at set acceptance rates)")
    ap.add_argument("--batch-sizes", type=ints, default=None, help="default 1,2,4,8,16,32 (smoke: 1,2)")
    ap.add_argument("--gammas", type=ints, default=None, help="fixed depths, also auto's depth set (default 2,4,8)")
    ap.add_argument("--betas", type=lambda v: [float(x) for x in v.split(",")], default=None,
                    help="replay acceptance rates for llama1b (default 0.3,0.6,0.9)")
    ap.add_argument("--prompts-1b", type=int, default=8, help="distinct random prompts for llama1b (cycled to fill B)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default 64 (smoke: 12)")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--backend", default=None, help="inductor or eager (default inductor; smoke: eager)")
    ap.add_argument("--freeze", action="store_true", help="Inductor freezing (a weight copy per graph)")
    ap.add_argument("--autotune", action=argparse.BooleanOptionalAction, default=None,
                    help="Inductor GEMM autotuning (default: compile()'s 'auto'; off halves compile time)")
    ap.add_argument("--cost-repeats", type=int, default=3, help="timed calls per (N, B) of the cost curve")
    ap.add_argument("--out", default="benchmarks/results/batch_bench.json")
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error("--runs must be >= 1")
    smoke = args.smoke
    batch_sizes = args.batch_sizes or ([1, 2] if smoke else [1, 2, 4, 8, 16, 32])
    gammas = sorted(set(args.gammas or [2, 4, 8]))
    betas = args.betas or ([0.5] if smoke else [0.3, 0.6, 0.9])
    args.max_new_tokens = args.max_new_tokens or (12 if smoke else 64)
    backend = args.backend or ("eager" if smoke else "inductor")
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    max_b = max(batch_sizes)
    tag = "tiny-" if smoke else ""  # smoke runs stand tiny random models in for both families
    rows, meta_models = [], {}
    t_start = time.perf_counter()

    def compiled(model, draft, prompts):
        longest = max(len(p) for p in prompts) + args.max_new_tokens + max(gammas) + 2
        fast = specgraph.compile(model, draft, num_speculative_tokens="auto", depths=gammas, backend=backend,
                                 max_batch_size=max_b, max_seq_len=max(longest, 64), freeze=args.freeze,
                                 autotune="auto" if args.autotune is None else args.autotune)
        say(f"measuring the cost curve for auto (B in {batch_sizes}, depths {gammas})")
        context = max(len(p) for p in prompts) + args.max_new_tokens // 2
        cost, samples = measure_cost_model(fast, batch_sizes, [1] + [g + 1 for g in gammas], context,
                                           args.cost_repeats, progress=True)
        fast.policy.cost = cost
        return fast, cost

    for fam in models:
        if fam == "smollm2":
            model, prompts = smollm2(smoke)
            fast, cost = compiled(model, "ngram", prompts)
            meta_models[fam] = {"params": sum(p.numel() for p in model.parameters()), "prompts": len(prompts),
                                "cost": cost.to_dict()}
            rows += bench_workload(f"{tag}{fam}-ngram", fast, prompts, args, batch_sizes, gammas)
        elif fam == "smollm2-draft6L":  # a draft too slow for its acceptance: auto must gate it off
            sys.path.insert(0, os.path.dirname(__file__))
            from generate_bench import truncated_draft

            model, prompts = smollm2(smoke)
            layers = 1 if smoke else 6
            fast, cost = compiled(model, truncated_draft(model, layers), prompts)
            meta_models[fam] = {"params": sum(p.numel() for p in model.parameters()), "prompts": len(prompts),
                                "draft_layers": layers, "cost": cost.to_dict()}
            rows += bench_workload(f"{tag}{fam}", fast, prompts, args, batch_sizes, gammas)
        elif fam == "llama1b":
            model = llama_1b(smoke)
            V = model.config.vocab_size
            prompts = random_prompts(V, 4 if smoke else args.prompts_1b, 8 if smoke else 32, 16 if smoke else 64, seed=2)
            t0 = time.perf_counter()
            replay = ReplayDrafter.from_model(model, prompts, args.max_new_tokens, beta=betas[0], seed=0, eos_token_id=[])
            say(f"replay continuations (HF greedy generate) in {time.perf_counter() - t0:.1f} s")
            fast, cost = compiled(model, replay, prompts)
            meta_models[fam] = {"params": sum(p.numel() for p in model.parameters()), "prompts": len(prompts),
                                "cost": cost.to_dict(), "config": model.config.to_dict() if not smoke else "tiny"}
            for beta in betas:
                replay.beta = beta  # read at every generate call's start: one compiled object for every β
                rows += bench_workload(f"{tag}{fam}-replay-{beta:g}", fast, prompts, args, batch_sizes, gammas,
                                       {"beta": beta})
        else:
            ap.error(f"unknown model family {fam!r} (smollm2, smollm2-draft6L, llama1b)")
    summ = summary(rows)
    print(f"\n{'workload':<24} {'B':>3} {'off':>8} " + " ".join(f"{'γ=' + str(g):>8}" for g in gammas)
          + f" {'auto':>8} {'auto/best':>10}  {'best':>8} {'paired':>7} {'auto at its depth':>17}")
    for s in summ:
        sub = {r["method"]: r["tokens_per_s"] for r in rows if r["workload"] == s["workload"] and r["batch"] == s["batch"]}
        print(f"{s['workload']:<24} {s['batch']:>3} {sub['off']:8.1f} " + " ".join(f"{sub[f'gamma={g}']:8.1f}" for g in gammas)
              + f" {sub['auto']:8.1f} {s['auto_vs_best']:9.2f}x  {s['best_method']:>8} {s['auto_vs_best_paired']:6.2f}x {s['auto_share_at_best_depth']:16.0%}"
              + ("" if s["meets_targets"] else "  (target missed)"))
    meta = {"torch": torch.__version__, "threads": torch.get_num_threads(), "backend": backend, "freeze": args.freeze,
            "autotune": args.autotune,
            "smoke": smoke, "batch_sizes": batch_sizes, "gammas": gammas, "betas": betas,
            "max_new_tokens": args.max_new_tokens, "runs": args.runs, "models": meta_models,
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "seconds": time.perf_counter() - t_start,
            "commit": _source_commit()}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "summary": summ, "rows": rows}, f, indent=1)
    png = plot(rows, os.path.splitext(args.out)[0] + ".png")
    say(f"wrote {args.out}" + (f" and {png}" if png else ""))
    if not all(r["equal_to_off"] for r in rows):
        say("ERROR: some method's greedy output differs from speculation off")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
