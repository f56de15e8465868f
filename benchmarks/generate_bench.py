"""End-to-end generation speed on SmolLM2-135M-Instruct (fp32, batch 1), methods interleaved in one process.

Methods: HF generate plain; HF prompt lookup (prompt_lookup_num_tokens=3 and 10); HF assisted generation
with a layer-truncated SmolLM2 draft; specgraph without draft (compiled plain decoding); specgraph
"ngram" chain (K = --k, and K = --k-long, which climbs from depth 4 to K on long copies); specgraph "ngram"
tree (--tree, paths of match ranks); specgraph with the same layer-truncated draft model. For each prompt and method: median
tokens/s over --runs, the ratio to HF plain on the same prompt, mean emitted tokens per round, and
greedy equality with HF plain. Prints a table and writes JSON.

    OMP_WAIT_POLICY=PASSIVE MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=68719476736 \
    MALLOC_TOP_PAD_=1073741824 python benchmarks/generate_bench.py --out benchmarks/results/generate_cpu.json
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch

import specgraph
from specgraph.models import load_model
from specgraph.suffix import SuffixIndex

PROMPTS = {
    "code": "Write a Python class `Stack` with push, pop, peek and is_empty methods, each with a docstring, "
            "then write unit tests for every method using unittest.",
    "summarize": "Summarize the following paragraph in three sentences, reusing its key terms.\n\n"
                 "Speculative decoding speeds up autoregressive generation by letting a cheap draft propose "
                 "several tokens that the target model verifies in a single forward pass. Verification uses "
                 "rejection sampling, so the output distribution is exactly the target model's distribution. "
                 "The speedup depends on the acceptance rate of the drafted tokens and on how cheap the draft is "
                 "compared with the target model.",
    "chat": "Hi! I'm planning a weekend trip to the mountains. What should I pack? Please give a list.",
    "math": "Solve step by step: a train travels 120 km in 1.5 hours, then 80 km in 1 hour. "
            "What is its average speed over the whole trip? Show each step.",
}


def _ids(tok, prompt):
    enc = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt")
    return enc if isinstance(enc, torch.Tensor) else enc["input_ids"]


def truncated_draft(model, layers: int):
    """The target's first `layers` decoder layers + final norm + LM head, sharing its weights."""
    from transformers import AutoModelForCausalLM

    cfg = copy.deepcopy(model.config)
    cfg.num_hidden_layers = layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[:layers]
    draft = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=next(model.parameters()).dtype)
    keep = {k: v for k, v in model.state_dict().items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    missing, unexpected = draft.load_state_dict(keep, strict=False, assign=True)
    if unexpected or [m for m in missing if "lm_head" not in m]:
        raise RuntimeError(f"truncated draft: missing {missing}, unexpected {unexpected}")
    draft.tie_weights()
    return draft.eval()


def write_json(path, meta, rows):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


def parse_paths(text: str) -> list[tuple[int, ...]]:
    """'0;1;0,0' -> [(0,), (1,), (0, 0)]: a tree as paths of child ranks."""
    return [tuple(int(r) for r in p.split(",")) for p in text.split(";")]


def add_learned_arguments(ap, default: str) -> None:
    """The learned-drafter options of this script and ``learned_profile.py`` (one definition, so the
    profile measures the objects the benchmark runs)."""
    ap.add_argument("--learned", default=default,
                    help="learned drafters to add: comma list of eagle_chain, eagle_tree (EAGLE-2 dynamic), "
                         "medusa_chain, medusa_tree (default Medusa tree); heads from --eagle-head / --medusa-head "
                         "or the shipped head matching the model")
    ap.add_argument("--medusa-tree", default="0;1;2;0,0;0,1;1,0;0,0,0;0,0,1;0,0,0,0",
                    help="Medusa static tree as ';'-separated paths of ranks (cut to the heads' depth)")
    ap.add_argument("--eagle-head", default=None, help="EAGLE head .safetensors (default: the shipped one)")
    ap.add_argument("--tree-nodes", type=lambda v: v if v == "auto" else int(v), default="auto",
                    help="eagle_tree: drafted nodes per round (an int fixes N and uses --tree-depth as the depth)")
    ap.add_argument("--tree-depth", type=int, default=6,
                    help="eagle_tree: the deepest dynamic tree (the depth and node count are chosen by "
                         "compile's tree_nodes='auto' from this machine's costs)")
    ap.add_argument("--medusa-head", default=None, help="Medusa head .safetensors (default: the shipped one)")


def learned_objects(model, args, autotune) -> dict:
    """Compiled objects for ``--learned``: EAGLE / Medusa heads (a given file, else the shipped head)."""
    from specgraph.heads import find_head, load_head

    wanted = [w for w in args.learned.split(",") if w]
    known = {"eagle_chain": ("eagle", None), "eagle_tree": ("eagle", "dynamic"), "medusa_chain": ("medusa", None),
             "medusa_tree": ("medusa", "default")}
    unknown = [w for w in wanted if w not in known]
    if unknown:
        raise SystemExit(f"unknown --learned {unknown}; known: {list(known)}")
    heads, out = {}, {}
    for w in wanted:
        kind, tree = known[w]
        if kind not in heads:
            path = {"eagle": args.eagle_head, "medusa": args.medusa_head}[kind] or find_head(model, kind)
            heads[kind] = load_head(path, model)
        if tree == "default":  # the --medusa-tree paths, cut to the heads' depth
            tree = [p for p in parse_paths(args.medusa_tree) if len(p) <= heads[kind].num_heads]
        k = min(args.k, heads[kind].num_heads) if kind == "medusa" else args.k  # a head per drafted token
        if tree == "dynamic":  # the deepest EAGLE-2 tree; compile's tree_nodes="auto" picks depth <= it and N
            k = args.tree_depth
        sized = {"tree_nodes": args.tree_nodes} if tree == "dynamic" else {}
        out[w] = specgraph.compile(model, heads[kind], num_speculative_tokens=k, tree=tree, backend=args.backend,
                                   max_batch_size=1, max_seq_len=args.max_seq_len, autotune=autotune, **sized)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--k", type=int, default=4, help="speculative tokens for specgraph ngram")
    ap.add_argument("--k-long", type=int, default=10, help="a second ngram chain with this K (0 = skip)")
    ap.add_argument("--suffix-k", type=int, default=10,
                    help="a suffix-decoding chain with this K (0 = skip); repeated and multi-turn workloads, "
                         "where suffix decoding's global index pays, are in benchmarks/suffix_bench.py")
    ap.add_argument("--tree", default="0;1;0,0;1,0;0,0,0;0,0,0,0;0,0,0,0,0;0,0,0,0,0,0",
                    help="ngram tree as ';'-separated paths of ranks ('' = skip)")
    ap.add_argument("--prompts", default=",".join(PROMPTS))
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--autotune", action=argparse.BooleanOptionalAction, default=None,
                    help="compile every specgraph object with autotune on / off (Inductor GEMM template vs MKL); "
                         "default: compile()'s 'auto' (on for SmolLM2 on CPU)")
    ap.add_argument("--draft-layers", type=int, default=6, help="layers of the truncated draft model (0 = skip)")
    ap.add_argument("--device", default="cpu", help="cpu | cuda (CUDA: rounds replay as CUDA graphs)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--max-seq-len", type=int, default=1024)
    add_learned_arguments(ap, default="")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="> 0: sample at this temperature (seeded per run; no equality check) instead of greedy")
    ap.add_argument("--methods", default="",
                    help="comma-separated subset of method names to run, in this order ('' = all)")
    ap.add_argument("--out", default="benchmarks/results/generate_bench.json")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    model, tok = load_model(args.model, dtype=getattr(torch, args.dtype))
    model = model.to(args.device)
    eos = model.generation_config.eos_token_id
    pad = model.generation_config.pad_token_id or eos
    N = args.max_new_tokens
    autotune = "auto" if args.autotune is None else args.autotune
    sg_plain = specgraph.compile(model, None, backend=args.backend, max_batch_size=1, max_seq_len=args.max_seq_len,
                                 autotune=autotune)
    sg_ngram = specgraph.compile(model, "ngram", num_speculative_tokens=args.k, backend=args.backend,
                                 max_batch_size=1, max_seq_len=args.max_seq_len, autotune=autotune)

    sg_long = None if not args.k_long else specgraph.compile(
        model, "ngram", num_speculative_tokens=args.k_long, backend=args.backend, max_batch_size=1, max_seq_len=args.max_seq_len,
        autotune=autotune)
    sg_suffix = None if not args.suffix_k else specgraph.compile(
        model, "suffix", num_speculative_tokens=args.suffix_k, backend=args.backend, max_batch_size=1,
        max_seq_len=args.max_seq_len, autotune=autotune)
    tree = parse_paths(args.tree) if args.tree else None
    sg_tree = None if tree is None else specgraph.compile(
        model, "ngram", tree=tree, backend=args.backend, max_batch_size=1, max_seq_len=args.max_seq_len, autotune=autotune)

    draft = truncated_draft(model, args.draft_layers) if args.draft_layers else None
    sg_draft = None if draft is None else specgraph.compile(
        model, draft, num_speculative_tokens=args.k, backend=args.backend, max_batch_size=1, max_seq_len=args.max_seq_len,
        autotune=autotune)

    learned = learned_objects(model, args, autotune)

    def sync():
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    sampling = dict(do_sample=True, temperature=args.temperature) if args.temperature > 0 else dict(do_sample=False)

    def hf(ids, **kw):
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N, pad_token_id=pad,
                             eos_token_id=eos, **sampling, **kw)
        return out, None

    def sg(fast):
        def run(ids):
            if fast.draft == "suffix":  # each call starts empty: earlier runs of the same prompt would be drafted
                fast.suffix_index = SuffixIndex()
            out = fast.generate(ids, max_new_tokens=N, eos_token_id=eos, pad_token_id=pad, **sampling)
            st = fast.stats.as_dict()  # survival_per_position[j]: drafts at depth j + 1 accepted / drafted
            return out, (st["mean_emitted_per_round"], st["survival_per_position"])
        run.fast = fast
        return run

    methods = {
        "hf_plain": lambda ids: hf(ids),
        "hf_prompt_lookup_3": lambda ids: hf(ids, prompt_lookup_num_tokens=3),
        "hf_prompt_lookup_10": lambda ids: hf(ids, prompt_lookup_num_tokens=10),
        "specgraph_plain": sg(sg_plain),
        f"specgraph_ngram_k{args.k}": sg(sg_ngram),
    }
    if sg_long is not None:
        methods[f"specgraph_ngram_k{args.k_long}"] = sg(sg_long)
    if sg_suffix is not None:
        methods[f"specgraph_suffix_k{args.suffix_k}"] = sg(sg_suffix)
    if sg_tree is not None:
        methods[f"specgraph_ngram_tree{sg_tree.tree.num_nodes}"] = sg(sg_tree)
    if draft is not None:
        methods[f"hf_assisted_{args.draft_layers}L"] = lambda ids: hf(ids, assistant_model=draft)
        methods[f"specgraph_draft_{args.draft_layers}L_k{args.k}"] = sg(sg_draft)
    for name, fast in learned.items():
        methods[f"specgraph_{name}"] = sg(fast)
    if args.methods:
        unknown = [m for m in args.methods.split(",") if m not in methods]
        if unknown:
            raise SystemExit(f"unknown methods {unknown}; known: {list(methods)}")
        methods = {m: methods[m] for m in args.methods.split(",")}
    if "hf_plain" not in methods:
        raise SystemExit("--methods must include hf_plain (the ratios' baseline)")
    meta = {"torch": torch.__version__, "threads": torch.get_num_threads(), "max_new_tokens": N, "runs": args.runs,
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "backend": args.backend, "tree": args.tree,
            "k": args.k, "k_long": args.k_long, "suffix_k": args.suffix_k, "draft_layers": args.draft_layers, "autotune": sg_plain.autotune,
            "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device,
            "dtype": args.dtype, "max_seq_len": args.max_seq_len, "temperature": args.temperature,
            "learned": args.learned, "eagle_head": args.eagle_head, "medusa_head": args.medusa_head,
            "tree_choices": {name: {k: v for k, v in fast.tree_choice.items() if k != "candidates"}
                             for name, fast in learned.items() if fast.tree_choice is not None}}
    for name, ch in meta["tree_choices"].items():
        print(f"[{name}] dynamic tree: depth {ch['depth']}, {ch['nodes']} nodes, predicted "
              f"{ch['predicted_speedup']:.2f}x a plain step ({ch['expected_emitted']:.2f} tokens/round)", file=sys.stderr)
    rows = []
    for pname in args.prompts.split(","):
        ids = _ids(tok, PROMPTS[pname]).to(args.device)
        with torch.no_grad():
            warmup = {}
            for name, fn in methods.items():  # warm-up (compiles specgraph graphs on first use)
                t0 = time.perf_counter()
                # sampled lengths decide the attended widths (hence graphs): warm up under every
                # timed seed, or a timed run may compile one
                for r in range(args.runs if args.temperature > 0 else 1):
                    if args.temperature > 0:
                        torch.manual_seed(r)
                    fn(ids)
                sync()
                warmup[name] = time.perf_counter() - t0
                print(f"[warm-up] {pname} {name}: {warmup[name]:.1f} s", file=sys.stderr, flush=True)
            times = {m: [] for m in methods}
            outs, emitted = {}, {}
            for r in range(args.runs):
                for name, fn in methods.items():
                    if args.temperature > 0:
                        torch.manual_seed(r)
                    t0 = time.perf_counter()
                    out, em = fn(ids)
                    sync()
                    dt = time.perf_counter() - t0
                    times[name].append((out.shape[1] - ids.shape[1]) / dt)
                    outs[name], emitted[name] = out, em
        base = statistics.median(times["hf_plain"])
        for name in methods:
            tps = statistics.median(times[name])
            em, per_depth = emitted[name] if emitted[name] is not None else (None, None)
            equal = None if args.temperature > 0 else bool(
                outs[name].shape == outs["hf_plain"].shape and torch.equal(outs[name], outs["hf_plain"]))
            rows.append({
                "prompt": pname, "method": name, "tokens_per_s": tps, "ratio_vs_hf_plain": tps / base,
                "mean_emitted_per_round": em, "acceptance_per_depth": per_depth,
                "new_tokens": outs[name].shape[1] - ids.shape[1],
                "greedy_equal_hf": equal, "runs": times[name], "warmup_s": warmup[name],
            })
            r = rows[-1]
            em = "-" if r["mean_emitted_per_round"] is None else f"{r['mean_emitted_per_round']:.2f}"
            print(f"{pname:<10} {name:<26} {tps:8.1f} tok/s {r['ratio_vs_hf_plain']:6.2f}x  emitted/round {em:>5}  "
                  f"equal={r['greedy_equal_hf']}", flush=True)
        # a graph compiled past the freeze budget (specgraph.freezing) runs slower matmuls: say so
        meta["unfrozen_graphs"] = {name: sorted(g for g, fr in fn.fast.graph_frozen.items() if not fr)
                                   for name, fn in methods.items() if hasattr(fn, "fast")}
        if any(meta["unfrozen_graphs"].values()):
            print(f"warning: unfrozen graphs {meta['unfrozen_graphs']}", file=sys.stderr, flush=True)
        write_json(args.out, meta, rows)  # after every prompt: a run cut short still leaves its results
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
