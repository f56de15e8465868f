"""Seconds of compiled calls: one call with its device work, a call repeated, and the (B, N,
seconds) samples of chain rounds that cost curves are fit to (:mod:`specgraph.perfmodel`)."""
from __future__ import annotations

import functools
import statistics
import sys
import time

import torch

from specgraph.compiler import attend_width
from specgraph.warping import SamplingParams


def _say(progress, msg):
    if progress:
        print(f"[plan] {msg}", file=sys.stderr, flush=True)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def call_seconds(fn, device) -> float:
    """Seconds of one call of ``fn``, its device work included."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def timed_calls(fn, device, repeats):
    """(first call's seconds: the compile, [seconds of each of ``repeats`` later calls])."""
    first = call_seconds(fn, device)
    return first, [call_seconds(fn, device) for _ in range(repeats)]


@torch.no_grad()
def measure_round_costs(fast, batch_sizes, grid, context: int, repeats: int = 5, progress=True,
                        warmup: int = 2) -> list:
    """(B, N, seconds) samples of one compiled greedy verification round over N query tokens per row
    (depth N - 1, random drafts) with ``context`` committed tokens per row, at each B.

    Every shape is built (compiled, or loaded) and called ``warmup`` more times before any is timed,
    then the timed calls go round the shapes in turn, ``repeats`` times. Timed right after its own
    compile, a shape's first calls run slow (caches, allocator, a busy host) and the curve can
    contradict itself (N = 1 dearer than N = 3); built first and timed in turn the curve stays
    monotone in N, and a slow stretch of a shared host spreads over every shape instead of
    landing on one."""
    device = next(fast.model.parameters()).device
    V = fast.model.get_output_embeddings().out_features
    width = attend_width(context + max(grid), fast.slots, fast.min_attend, fast.width_step)
    params = SamplingParams(0.0)
    g = torch.Generator().manual_seed(0)
    calls = {}  # (B, N) -> a call of that shape's round on fixed random inputs
    total = len(batch_sizes) * len(grid)
    for B in batch_sizes:
        kv = fast.kv_cache(B)
        for N in grid:
            k = N - 1
            fn = fast.round_graph(B, params, width, k)
            root = torch.randint(V, (B,), generator=g).to(device)
            L = torch.full((B,), context, dtype=torch.long, device=device)
            active = torch.ones(B, dtype=torch.bool, device=device)
            accept_u = torch.zeros(B, k, device=device)
            expo = torch.ones(B, k + 1, 1, device=device)
            drafts = torch.randint(V, (B, k), generator=g).to(device)
            calls[B, N] = functools.partial(fn, root, L, active, accept_u, expo, drafts, accept_u, *kv)
            first, _ = timed_calls(calls[B, N], device, warmup)
            _say(progress, f"cost {len(calls)}/{total}: built B={B} N={N} (first call {first:.1f} s)")
    times = {key: [] for key in calls}
    for _ in range(repeats):
        for key, call in calls.items():
            times[key].append(call_seconds(call, device))
    for (B, N), ts in times.items():
        _say(progress, f"cost B={B} N={N}: {1e3 * statistics.median(ts):.2f} ms")
    return [(B, N, t) for (B, N), ts in times.items() for t in ts]
