"""Model-free replay: prompt lookup vs suffix-decoding chains on the same greedy text (no timing noise).

With ``--temperature T --samples S`` the replayed texts are S seeded samples of the target per call
(see :func:`replay`: exact in distribution for deterministic drafts), so sampled settings can be
compared without timing noise too.

Greedy verification accepts exactly the longest prefix of the drafts that matches the target's own
greedy continuation, so given HF's greedy outputs for the suffix_bench workloads, every round of
``draft="ngram"`` and ``draft="suffix"`` (chains, the compiler's own proposal functions, depth ladder
and SUFFIX_* thresholds) can be replayed without the model: rounds, drafted tokens, accepted tokens,
the depth of each round, and the drafter's host time. ``--slope`` turns that into a speed estimate:
a round of depth k costs (1 + slope * k) plain steps (~0.1 for SmolLM2 on a 2-core CPU).

    python benchmarks/suffix_replay.py --max-new-tokens 96 --out benchmarks/results/suffix_replay.json
    python benchmarks/suffix_replay.py --temperature 0.7 --samples 8 --max-new-tokens 64 --out ...
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time

import torch

from specgraph import compiler as C
from specgraph.proposers import ngram as NG, suffix as SX
from specgraph.drafters import ngram_propose
from specgraph.models import load_model
from specgraph.suffix import AcceptanceCalibration, SuffixIndex

sys.path.insert(0, os.path.dirname(__file__))
from generate_bench import write_json  # noqa: E402
from suffix_bench import build_workloads  # noqa: E402


def replay(kind: str, prompt: list[int], cont: list[int], K: int, session=None, sampled: bool = False,
           calibrated: bool = True, **thresholds) -> dict:
    """One generation of ``cont`` after ``prompt``, round by round, as SpecGraphModel runs it.

    ``sampled``: ``cont`` is one sample of the target (e.g. T = 0.7). A deterministic draft x is
    accepted with probability p(x), the probability that the sample continues with x, and after a
    rejection the emitted token follows the residual, the sample's law given that it is not x: so
    counting a draft as accepted when it equals the sampled token replays the verification
    exactly in distribution. Suffix chains are then calibrated as in sampled rounds
    (``calibrated=False``: the uncalibrated threshold)."""
    ladder = C.default_ladder(K)
    k_now, hist, i = ladder[0], list(prompt), 0
    out = {"rounds": 0, "drafted": 0, "accepted": 0, "host_s": 0.0, "depths": {}}
    while i < len(cont):
        t0 = time.perf_counter()
        drafts = []
        if kind in ("suffix", "suffix|ngram"):
            drafts = SX.suffix_chains([session], k_now, calibrated=sampled and calibrated, **thresholds)[0]
            k = SX.chain_depth(SX.rungs_upto(ladder, k_now), len(drafts)) if drafts else 0
        if kind == "ngram" or (kind == "suffix|ngram" and not drafts):  # "suffix|ngram": prompt lookup where suffix has nothing
            if session is not None:  # a prompt-lookup round is not the suffix chain's to calibrate on
                session.drafted_scores = []
            d, m = ngram_propose(torch.tensor([hist]), torch.tensor([len(hist)]), k_now, NG.NGRAM_MAX, NG.NGRAM_MIN)
            drafts = d[0].tolist() if int(m[0]) else []
            k = k_now if drafts else 0
        out["host_s"] += time.perf_counter() - t0
        a = 0
        while a < len(drafts) and i + a < len(cont) and drafts[a] == cont[i + a]:
            a += 1
        new = cont[i:i + a + 1]
        hist += new
        i += len(new)
        if session is not None:
            t0 = time.perf_counter()
            session.extend(new)
            out["host_s"] += time.perf_counter() - t0
        if sampled and session is not None and k:
            SX.calibrate_suffix([session], [a + 1], [True])
        out["rounds"] += 1
        out["drafted"] += k
        out["accepted"] += a
        out["depths"][k] = out["depths"].get(k, 0) + 1
        if k:
            k_now = C.next_k(ladder, k_now, k, [len(new)])
    return out


def cut_at_eos(tokens: list[int], eos) -> list[int]:
    stop = set(eos if isinstance(eos, (list, tuple)) else [eos])
    for i, t in enumerate(tokens):
        if t in stop:
            return tokens[: i + 1]
    return tokens


def run_workload(kind: str, runs, K: int, slope: float, sampled: bool = False, **thresholds) -> dict:
    """Each run (a workload's calls in order) replayed and summed; within a run suffix methods share
    one index across the calls (as one ``fast`` object), and every run starts from an empty one."""
    tot = {"tokens": 0, "rounds": 0, "drafted": 0, "accepted": 0, "host_s": 0.0, "cost_steps": 0.0}
    calibration = {k: thresholds.pop(k) for k in ("cal_prior", "cal_decay") if k in thresholds}
    for calls in runs:
        index = SuffixIndex() if kind != "ngram" else None
        for prompt, cont in calls:
            session = index.start(prompt) if index is not None else None
            if "cal_prior" in calibration:  # the calibration's prior: this many accepted of as many predicted drafts
                session.calibration.predicted = session.calibration.accepted = calibration["cal_prior"]
            if "cal_decay" in calibration:
                session.calibration.DECAY = calibration["cal_decay"]
            r = replay(kind, prompt, cont, K, session, sampled, **thresholds)
            if index is not None:
                index.add_document(prompt + cont)
            tot["tokens"] += len(cont)
            for key in ("rounds", "drafted", "accepted", "host_s"):
                tot[key] += r[key]
            tot["cost_steps"] += sum(c * (1 + slope * k) for k, c in r["depths"].items())
    tot["tokens_per_round"] = tot["tokens"] / tot["rounds"]
    tot["tokens_per_step_cost"] = tot["tokens"] / tot["cost_steps"]
    return tot


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--slope", type=float, default=0.1,
                    help="cost of one drafted token, in plain steps (SmolLM2, 2-core CPU: a k=10 round ~2 steps)")
    ap.add_argument("--workloads", default="repeated,multiturn,single")
    ap.add_argument("--out", default="benchmarks/results/suffix_replay.json")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="> 0: replay samples of the target at this temperature (HF, seeded) instead of its greedy text")
    ap.add_argument("--samples", type=int, default=8, help="with --temperature: replicate workload runs (samples per call)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    eos = model.generation_config.eos_token_id
    pad = model.generation_config.pad_token_id or eos
    workloads = build_workloads(model, tok, args.max_new_tokens, eos, pad)
    sampled = args.temperature > 0
    variants = [("ngram", {}), ("suffix", {}), ("suffix", {"min_match": 1}), ("suffix", {"min_match": 3}),
                ("suffix", {"min_score": 0.3}), ("suffix|ngram", {})]
    if sampled:
        variants += [("suffix", {"calibrated": False}), ("suffix", {"min_score": 0.05}),
                     ("suffix", {"min_score": 0.2}), ("suffix", {"cal_prior": 1.0}),
                     ("suffix", {"cal_prior": 4.0, "cal_decay": 0.9}), ("suffix", {"cal_prior": 8.0, "cal_decay": 0.95}),
                     ("suffix", {"calibrated": False, "min_score": 0.2}), ("suffix", {"calibrated": False, "min_score": 0.3})]
    replicates = args.samples if sampled else 1
    rows, cache = [], {}  # prompt -> its continuations (greedy: one; sampled: one per use per replicate)
    with torch.no_grad():
        for wname in args.workloads.split(","):
            uses = collections.Counter(tuple(ids[0].tolist()) for ids in workloads[wname])
            for key, n in uses.items():
                if key in cache and len(cache[key]) >= n * replicates:
                    continue
                ids = torch.tensor([key])
                kw = dict(do_sample=True, temperature=args.temperature, top_k=0, top_p=1.0,
                          num_return_sequences=n * replicates) if sampled else dict(do_sample=False)
                if sampled:
                    torch.manual_seed(len(cache))
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                                     eos_token_id=eos, pad_token_id=pad, **kw)
                cache[key] = [cut_at_eos(row[ids.shape[1]:].tolist(), eos) for row in out]
            runs = []  # replicate r: the workload's calls, each prompt's j-th use taking its own continuation
            for r in range(replicates):
                seen, calls = {}, []
                for ids in workloads[wname]:
                    key = tuple(ids[0].tolist())
                    j = seen.get(key, 0)
                    seen[key] = j + 1
                    calls.append((list(key), cache[key][(r * uses[key] + j) % len(cache[key])]))
                runs.append(calls)
            base = None
            for kind, thr in variants:
                tot = run_workload(kind, runs, args.k, args.slope, sampled, **thr)
                base = base or tot["tokens_per_step_cost"]
                name = kind + "".join(f" {k}={v}" for k, v in thr.items())
                rows.append({"workload": wname, "method": name, **tot,
                             "est_speed_vs_ngram": tot["tokens_per_step_cost"] / base})
                print(f"{wname:<10} {name:<28} tokens/round {tot['tokens_per_round']:.3f}  drafted/round "
                      f"{tot['drafted'] / tot['rounds']:.2f}  host {1e3 * tot['host_s'] / tot['rounds']:.2f} ms/round  "
                      f"est. speed vs ngram {rows[-1]['est_speed_vs_ngram']:.3f}", flush=True)
    meta = {"max_new_tokens": args.max_new_tokens, "k": args.k, "slope": args.slope,
            "temperature": args.temperature, "samples": replicates,
            "suffix_min_score": SX.SUFFIX_MIN_SCORE, "suffix_min_match": SX.SUFFIX_MIN_MATCH,
            "calibration_prior": AcceptanceCalibration.PRIOR}
    write_json(args.out, meta, rows)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
