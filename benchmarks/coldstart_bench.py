"""Cold start and tokens/s on SmolLM2: JIT ``specgraph.compile`` vs AOT packages vs ONNX Runtime.

Cold start = a fresh ``specgraph generate`` process, from spawn to the first byte of generated
text on its stdout (``--stream``: the first token):

* ``jit``  : ``specgraph generate default --stream --no-compare`` with an empty Inductor cache
             (``TORCHINDUCTOR_CACHE_DIR`` = a new temp dir): load + capture + compile + warm-up;
* ``jit-warm-cache``: the same with the Inductor cache the previous run filled (optional);
* ``aot``  : ``specgraph generate DIR --stream`` (AOTInductor packages, no compile);
* ``onnx`` : ``specgraph generate DIR --runtime onnx --max-new-tokens 1`` (the ONNX generator
             does not stream: one token, so its only output is the first token).

Tokens/s = one process, the three paths (plus HF generate) on the same prompts (``--prompts``:
``specgraph bench``'s code / summarize ...), greedy, median of ``--runs`` interleaved runs after a warm-up; the JIT object compiles the same shapes the DIR
holds (batch 1, ``max_seq_len`` of the DIR, prompt lookup K = 4).

    OMP_WAIT_POLICY=PASSIVE python benchmarks/coldstart_bench.py --dir ~/.cache/specgraph/aot/smollm2-s255 \\
        --out benchmarks/results/coldstart_cpu.json

The DIR is compiled first (``specgraph compile default --format pt2,onnx --modes greedy
--max-seq-len 255``) when it does not hold a valid manifest.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT = "Write a Python function that checks whether a string is a palindrome."


def _first_stdout_byte(cmd: list[str], env=None, timeout=3600) -> dict:
    """Spawn ``cmd``; seconds until its first stdout byte, total seconds, and its stderr."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    first = None
    out = b""
    while True:
        b = p.stdout.read(1)
        if not b:
            break
        if first is None and b.strip():
            first = time.perf_counter() - t0
        out += b
    err = p.stderr.read().decode(errors="replace")
    rc = p.wait(timeout=timeout)
    total = time.perf_counter() - t0
    if rc != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {rc}:\n{err[-3000:]}")
    return {"first_token_s": round(first, 2) if first is not None else None, "total_s": round(total, 2),
            "stdout": out.decode(errors="replace"), "stderr_tail": err.strip().splitlines()[-3:]}


def cold_starts(args, d: Path) -> dict:
    sg = [sys.executable, "-m", "specgraph.cli"]
    n = str(args.max_new_tokens)
    res = {}
    for i in range(args.cold_runs):
        res.setdefault("aot", []).append(_first_stdout_byte(
            sg + ["generate", str(d), "--prompt", args.prompt, "--max-new-tokens", n, "--stream"]))
        print(f"cold start aot: {res['aot'][-1]['first_token_s']} s", flush=True)
        if "onnx" in args.methods:
            res.setdefault("onnx", []).append(_first_stdout_byte(
                sg + ["generate", str(d), "--runtime", "onnx", "--prompt", args.prompt, "--max-new-tokens", "1"]))
            print(f"cold start onnx: {res['onnx'][-1]['first_token_s']} s", flush=True)
    if "jit" in args.methods:
        cache = tempfile.mkdtemp(prefix="specgraph-coldstart-inductor-")
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        try:
            cmd = sg + ["generate", "default", "--prompt", args.prompt, "--max-new-tokens", n, "--stream", "--no-compare"]
            res["jit"] = [_first_stdout_byte(cmd, env=env)]
            print(f"cold start jit (empty Inductor cache): {res['jit'][-1]['first_token_s']} s", flush=True)
            if args.jit_warm_cache:
                res["jit-warm-cache"] = [_first_stdout_byte(cmd, env=env)]
                print(f"cold start jit (warm Inductor cache): {res['jit-warm-cache'][-1]['first_token_s']} s", flush=True)
        finally:
            shutil.rmtree(cache, ignore_errors=True)
    return res


def throughput(args, d: Path) -> list[dict]:
    import torch

    import specgraph
    from specgraph.aot import load_dir, load_hf_model
    from specgraph.cli import _chat_ids

    if args.threads:
        torch.set_num_threads(args.threads)
    from specgraph.cli import BENCH_PROMPTS

    ld = load_dir(d)
    model, tok, man = load_hf_model(d), ld.tokenizer, ld.manifest  # the HF model: baseline and JIT path
    s = man["settings"]
    eos = model.generation_config.eos_token_id
    pad = model.generation_config.pad_token_id if model.generation_config.pad_token_id is not None else eos
    gkw = dict(max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=pad)
    gens = {"hf_plain": (lambda ids: model.generate(ids, attention_mask=torch.ones_like(ids), **gkw), None)}
    if "jit" in args.methods:
        jit = specgraph.compile(model, s["draft"], num_speculative_tokens=s["num_speculative_tokens"],
                                max_batch_size=1, max_seq_len=s["max_seq_len"])
        gens["jit_ngram"] = (lambda ids: jit.generate(ids, **gkw), jit)
        if args.jit_unfrozen:
            jit_nf = specgraph.compile(model, s["draft"], num_speculative_tokens=s["num_speculative_tokens"],
                                       max_batch_size=1, max_seq_len=s["max_seq_len"], freeze=False)
            gens["jit_ngram_unfrozen"] = (lambda ids: jit_nf.generate(ids, **gkw), jit_nf)
    gens["aot_ngram"] = (lambda ids: ld.fast.generate(ids, **gkw), ld.fast)
    if "onnx" in args.methods:
        from specgraph.onnx import OnnxSpecGenerator

        gen = OnnxSpecGenerator(d / man["onnx"]["dir"], num_threads=torch.get_num_threads())
        gens["onnx_ngram"] = (lambda ids: gen.generate(ids, **gkw), gen)
    rows = []
    for pname in args.prompts.split(","):
        ids = _chat_ids(tok, BENCH_PROMPTS[pname])
        with torch.no_grad():
            for name, (fn, _) in gens.items():  # warm-up (JIT: compiles on the first prompt)
                t0 = time.perf_counter()
                fn(ids)
                print(f"warm-up {pname} {name}: {time.perf_counter() - t0:.1f} s", flush=True)
            times = {m: [] for m in gens}
            outs, emitted = {}, {}
            for _ in range(args.runs):
                for name, (fn, obj) in gens.items():
                    t0 = time.perf_counter()
                    outs[name] = fn(ids)
                    times[name].append(time.perf_counter() - t0)
                    emitted[name] = None if obj is None else obj.stats.mean_emitted
        for name in gens:
            new = outs[name].shape[1] - ids.shape[1]
            rows.append({"prompt": pname, "method": name, "tokens_per_s": round(new / statistics.median(times[name]), 2),
                         "new_tokens": new,
                         "mean_emitted_per_round": None if emitted[name] is None else round(emitted[name], 3),
                         "equal_to_hf": bool(torch.equal(outs[name], outs["hf_plain"])),
                         "seconds": [round(t, 3) for t in times[name]]})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=str(Path.home() / ".cache" / "specgraph" / "aot" / "smollm2-s255"))
    ap.add_argument("--prompt", default=PROMPT, help="the cold-start prompt")
    ap.add_argument("--prompts", default="code,summarize", help="tokens/s prompts (specgraph bench's built-in ones)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-seq-len", type=int, default=255, help="for the DIR when it is compiled here")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--cold-runs", type=int, default=2)
    ap.add_argument("--methods", default="jit,aot,onnx", help="which of jit, aot, onnx to run (aot always)")
    ap.add_argument("--jit-warm-cache", action="store_true", help="also time a JIT start with a warm Inductor cache")
    ap.add_argument("--jit-unfrozen", action="store_true", help="also time JIT with freeze=False (the AOT weights mode)")
    ap.add_argument("--skip-cold", action="store_true")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    args.methods = {m.strip() for m in args.methods.split(",")} | {"aot"}
    d = Path(args.dir)

    from specgraph.aot import is_compiled_dir

    compile_s = None
    if not is_compiled_dir(d):
        formats = "pt2,onnx" if "onnx" in args.methods else "pt2"
        print(f"compiling {d} ({formats}) ...", flush=True)
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "specgraph.cli", "compile", "default", "--out", str(d), "--format",
                            formats, "--modes", "greedy", "--max-seq-len", str(args.max_seq_len), "--force"])
        if r.returncode != 0:
            return r.returncode
        compile_s = round(time.perf_counter() - t0, 1)
    man = json.loads((d / "manifest.json").read_text())
    result = {
        "prompt": args.prompt, "max_new_tokens": args.max_new_tokens, "dir": str(d), "compile_s": compile_s,
        "aot_graph_seconds": {g["name"]: g.get("seconds") for g in man["graphs"]},
        "dir_mib": round(sum(f["bytes"] for f in man["files"].values()) / 2**20, 1),
        "pt2_mib": round(sum(f["bytes"] for n, f in man["files"].items() if n.startswith("pt2/")) / 2**20, 1),
        "versions": man["versions"], "cpu_count": os.cpu_count(),
        "load_average_start": os.getloadavg(),
    }
    if not args.skip_cold:
        result["cold_start"] = cold_starts(args, d)
    if not args.skip_throughput:
        result["throughput"] = throughput(args, d)
    result["load_average_end"] = os.getloadavg()

    print("\ncold start (spawn -> first token on stdout), seconds")
    for m, runs in result.get("cold_start", {}).items():
        print(f"  {m:<16} " + ", ".join(str(r["first_token_s"]) for r in runs))
    if "throughput" in result:
        print(f"\n{'prompt':<10} {'method':<22} {'tok/s':>8} {'emitted/round':>14} {'== HF':>6}")
        for r in result["throughput"]:
            em = "-" if r["mean_emitted_per_round"] is None else f"{r['mean_emitted_per_round']:.2f}"
            print(f"{r['prompt']:<10} {r['method']:<22} {r['tokens_per_s']:8.1f} {em:>14} {str(r['equal_to_hf']):>6}")
    if args.out:
        for runs in result.get("cold_start", {}).values():
            for r in runs:
                r.pop("stdout", None)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
