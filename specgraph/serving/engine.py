"""Continuous batching on the compiled engine: requests join free rows between rounds and leave
the moment they finish.

One :class:`ServingEngine` owns a compiled object's largest batch bucket: its KV cache holds
``max_batch_size`` rows, and the rows in use are kept packed at the front (row i of the cache is
``rows[i]``), so a round runs the graph of the smallest bucket that holds them, on the first
rows of that cache (a ``t[:b]`` view is contiguous: the round writes straight into it). A row
that leaves is refilled by the last row, its cache slots copied over.

Each pass of the scheduler thread:

1. admits queued requests into free rows;
2. copies into the rows still being prefilled the KV of their longest prompt prefix already
   computed for another request (:mod:`specgraph.serving.prefix`), then computes at most
   ``prefill_chunk`` prompt tokens of them (a long prompt takes several passes, and the other
   rows keep decoding between them);
3. runs one round for the decoding rows: prompt-lookup drafts, the depth the load-aware policy
   (:class:`specgraph.serving.depth.LoadAwareDepth`) picks for this occupancy, then the round
   graph, once per sampling lane present (greedy rows and sampled rows run different graphs;
   the other lane's rows are inactive in each), or once for both when the graph cache serves
   the round with a package of mode "any" (a row at temperature 0 is verified greedily in it);
4. hands each row its new tokens and retires the rows that finished or were cancelled.

Rows never affect each other: every round is exact per row (a row attends only its own cache
slots), so a greedy request's output is ``model.generate``'s whatever shares the batch. A
sampled row draws the noise of sequence position p from its own seed and p alone, and
deterministic drafts are verified by the exponential race (:func:`specgraph.verify.
verify_chain_with_noise`): the token at p depends on that noise only, so a seeded request
reproduces whatever else is running, whatever depth the rounds ran at.
"""
from __future__ import annotations

import collections
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from specgraph.callrows import advance_rows
from specgraph.compiler import RoundExtras, SpecGraphModel
from specgraph.proposers.ngram import NGRAM_MAX, NGRAM_MIN
from specgraph.lookup import ngram_propose
from specgraph.generation import stop_at
from specgraph.graphcache import CachedGraphs, GreedyRows
from specgraph.graphset import batch_buckets
from specgraph.packages import package_key
from specgraph.serving.depth import LoadAwareDepth, measure_costs
from specgraph.serving.prefix import PrefixCache
from specgraph.verify import exponential_noise
from specgraph.warping import SamplingParams, check_sampling_params

PREFILL_CHUNK = 256  # prompt tokens written per scheduler pass (the decoding rows wait at most one chunk)
# a prefill call of up to this many tokens (all rows, padding included) costs about what a call of
# one token does: each call reads every weight once (~170 ms for SmolLM2 fp32 on 2 CPU cores)
SHORT_PREFILL = 64
PREFIX_CACHE_BYTES = 512 << 20  # the pool of reusable prompt blocks (:mod:`specgraph.serving.prefix`)
PREFIX_BLOCK = 32  # prompt tokens per reusable block
MAX_QUEUE = 256  # requests waiting for a row before submit() refuses


class QueueFull(RuntimeError):
    """The engine's queue is full: the caller should answer 429 and let the client retry."""


class EngineStopped(RuntimeError):
    """The engine is shutting down (or has stopped): no new requests."""


@dataclass
class ServeRequest:
    """One generation. ``temperature`` 0 = greedy; ``seed``: the sampling noise's seed (None: a
    fresh one). ``eos``: token ids that end the text (kept in the output, as ``generate`` keeps
    them). ``stop``: called with the row's new tokens after each round; returns how many of them
    to keep when a stop condition (e.g. a stop string) is met, else None."""

    prompt: list[int]
    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None
    eos: tuple[int, ...] = ()
    stop: Callable[[list[int]], int | None] | None = None
    logprobs: int | None = None  # None: none; n >= 0: each token's log-probability and the top n of its position


@dataclass
class Event:
    """What a request's sink receives: ``tokens`` (new token ids, in order) and, last,
    ``finish`` ("stop", "length", "cancelled") or ``error`` (a message)."""

    tokens: list[int] = field(default_factory=list)
    finish: str | None = None
    error: str | None = None
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None  # per token: (its logprob, top n)


class Handle:
    """A submitted request: :meth:`cancel` frees its row at the next scheduler pass."""

    def __init__(self, engine: "ServingEngine", req: ServeRequest, sink: Callable[[Event], None]):
        self.engine, self.req, self.sink = engine, req, sink
        self.cancelled = False
        self.finish: str | None = None  # why it ended, once it has

    def cancel(self) -> None:
        self.cancelled = True
        self.engine._wake()


@dataclass
class Row:
    handle: Handle
    seed: int
    prefilled: int = 0  # prompt tokens written to the cache (all but the last are)
    new: list[int] = field(default_factory=list)
    acc: torch.Tensor | None = None  # per drafted position: decayed accepted / reached counts
    cnt: torch.Tensor | None = None

    @property
    def decoding(self) -> bool:
        return self.prefilled >= len(self.handle.req.prompt) - 1


@dataclass
class EngineStats:
    """Counters the server exports (``/metrics``); plain numbers, updated by the scheduler."""

    requests: int = 0
    finished: dict = field(default_factory=lambda: collections.Counter())
    tokens: int = 0
    rounds: int = 0
    prefill_tokens: int = 0  # prompt tokens computed by prefill
    prefix_tokens: int = 0  # prompt tokens copied from the prefix cache instead
    packed_prefills: int = 0  # prefill calls through SpecGraphModel.prefill_packed (rows' chunks as one sequence)
    depth_rounds: dict = field(default_factory=lambda: collections.Counter())  # depth -> rounds
    drafted: dict = field(default_factory=lambda: collections.Counter())  # position -> drafts verified there
    accepted: dict = field(default_factory=lambda: collections.Counter())  # position -> accepted there
    occupancy_sum: int = 0  # decoding rows summed over rounds
    joint_rounds: int = 0  # rounds whose greedy and sampled rows ran in one graph call
    recent: collections.deque = field(default_factory=lambda: collections.deque(maxlen=64))  # (time, tokens)

    def tokens_per_second(self, window: float = 10.0) -> float:
        now = time.perf_counter()
        pts = [(t, n) for t, n in self.recent if now - t <= window]
        if not pts:
            return 0.0
        return sum(n for _, n in pts) / max(now - pts[0][0], 1e-3) if len(pts) > 1 else 0.0


_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64
_MIX1, _MIX2 = -4658895280553007687, -7723592293110705685  # splitmix64's multipliers, signed


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 tensors (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors (wrapping arithmetic): a bijection whose outputs
    for consecutive inputs are statistically independent."""
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    return x ^ _shr(x, 31)


def position_noise(seeds, starts, count: int, V: int) -> torch.Tensor:
    """Exp(1) noise [R, count, V] for sequence positions starts[r] .. starts[r] + count - 1 of
    rows with ``seeds`` [R] (ints or an int64 tensor): entry (r, j, v) is a hash of (seed,
    position, v), so a position's noise depends on its seed and position alone, whatever the
    round that draws it. Uniforms have 24 bits, as ``torch.rand``'s float32 ones."""
    seeds = torch.as_tensor(seeds, dtype=torch.long).view(-1, 1, 1)
    pos = torch.as_tensor(starts, dtype=torch.long).view(-1, 1, 1) + torch.arange(count).view(1, -1, 1)
    key = _mix64(_mix64(seeds) + pos * _GOLDEN)  # [R, count, 1]
    bits = _shr(_mix64(key + torch.arange(V).view(1, 1, -1) * _GOLDEN), 40)  # [R, count, V], 24 bits
    u = (bits.to(torch.float64) + 0.5) * 2.0 ** -24  # in (0, 1): no draw is 0 or inf
    return (-torch.log(u)).to(torch.float32)


def serving_support(fast: SpecGraphModel) -> str | None:
    """Why ``fast`` cannot be served by the engine (None: it can)."""
    if fast.fallback_reason is not None:
        return f"this model runs on the eager fallback ({fast.fallback_reason})"
    if fast.tree is not None or fast.draft not in (None, "ngram") or fast.learned is not None:
        return "the serving engine runs plain decoding or prompt-lookup chains (draft=None or 'ngram', tree=None)"
    if fast.full_width:
        return "eager attention reads the whole cache; load the model with attn_implementation='sdpa'"
    return None


class ServingEngine:
    """The scheduler over a compiled object (module docstring). ``submit`` is thread-safe;
    :meth:`start` runs the scheduler in a daemon thread (or call :meth:`step` yourself)."""

    def __init__(self, fast: SpecGraphModel, *, max_queue: int = MAX_QUEUE, prefill_chunk: int = PREFILL_CHUNK,
                 policy: LoadAwareDepth | None = None, sampling: SamplingParams | None = None,
                 max_logprobs: int | None = None, prefix_cache_bytes: int = PREFIX_CACHE_BYTES,
                 prefix_block: int = PREFIX_BLOCK):
        why = serving_support(fast)
        if why is not None:
            raise ValueError(f"cannot serve this compiled object: {why}")
        if max_queue < 1 or prefill_chunk < 1:
            raise ValueError("max_queue and prefill_chunk must be >= 1")
        self.fast = fast
        self.B, self.S, self.V = fast.max_batch_size, fast.slots, fast.vocab
        self.device = next(fast.model.parameters()).device
        self.depths = fast.chain_depths()  # [0] for plain decoding; [0, K, ...] for prompt lookup
        self.K = max(self.depths)
        self.sampling = sampling if sampling is not None else fast.default_sampling()
        self.policy = policy if policy is not None else LoadAwareDepth(self.depths)
        self.max_queue, self.prefill_chunk = max_queue, prefill_chunk
        # with max_logprobs, every round computes the emitted tokens' log-probabilities and the
        # top max_logprobs of each position (round graphs of their own); without, requests for them are refused
        if max_logprobs is not None and (isinstance(max_logprobs, bool) or max_logprobs < 0):
            raise ValueError(f"max_logprobs must be None or an int >= 0, got {max_logprobs!r}")
        self.max_logprobs = max_logprobs
        self.extras = None if max_logprobs is None else RoundExtras(logprobs=max_logprobs)
        self.kv = fast.kv_cache(self.B)
        if prefix_cache_bytes < 0 or prefix_block < 1:
            raise ValueError("prefix_cache_bytes must be >= 0 and prefix_block >= 1")
        blocks = prefix_cache_bytes // PrefixCache.bytes_per_block(self.kv, prefix_block)
        self.prefix = PrefixCache(self.kv, prefix_block, blocks) if blocks > 0 else None
        self.hist = torch.zeros(self.B, self.S, dtype=torch.long, device=self.device)
        self.L = torch.zeros(self.B, dtype=torch.long, device=self.device)
        self.root = torch.zeros(self.B, dtype=torch.long, device=self.device)
        self.rows: list[Row] = []
        self.queue: collections.deque[Handle] = collections.deque()
        self.stats = EngineStats()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._running = False
        self._stopping = False
        self._remeasure: set[int] = set()  # buckets whose graphs changed since the policy's costs were measured

    # ------------------------------------------------------------------------------------------
    # requests

    def check(self, req: ServeRequest) -> None:
        """Raise ValueError (with the reason) for a request this engine cannot run."""
        if not req.prompt:
            raise ValueError("the prompt is empty")
        if any(not 0 <= t < self.V for t in req.prompt):
            raise ValueError(f"prompt token ids must be in [0, {self.V})")
        if not isinstance(req.max_tokens, int) or req.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {req.max_tokens!r}")
        check_sampling_params(req.temperature, None, None, None)
        if req.logprobs is not None:
            if self.max_logprobs is None:
                raise ValueError("this server computes no log-probabilities (start it with --max-logprobs N)")
            if not 0 <= req.logprobs <= self.max_logprobs:
                raise ValueError(f"logprobs must be in [0, {self.max_logprobs}] on this server, got {req.logprobs}")
        need = len(req.prompt) + req.max_tokens + self.K + 1
        if need > self.fast.max_seq_len:
            raise ValueError(f"prompt ({len(req.prompt)} tokens) + max_tokens ({req.max_tokens}) + {self.K + 1} "
                             f"speculative slots = {need} exceeds this server's max_seq_len={self.fast.max_seq_len}")

    def submit(self, req: ServeRequest, sink: Callable[[Event], None]) -> Handle:
        """Queue ``req``; ``sink`` receives its :class:`Event` s (from the scheduler thread).
        Raises ValueError for a bad request, :class:`QueueFull`, or :class:`EngineStopped`."""
        self.check(req)
        h = Handle(self, req, sink)
        with self._cv:
            if self._stopping:
                raise EngineStopped("the server is shutting down")
            if len(self.queue) >= self.max_queue:
                raise QueueFull(f"{len(self.queue)} requests are already waiting (max_queue={self.max_queue})")
            self.queue.append(h)
            self.stats.requests += 1
            self._cv.notify()
        return h

    @property
    def running(self) -> bool:
        """Whether the scheduler thread is up."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def queue_depth(self) -> int:
        return len(self.queue)

    @property
    def occupancy(self) -> int:
        return len(self.rows)

    def warmup(self, modes=("greedy", "sample"), progress: bool = True) -> dict:
        """Build (or load) every round this engine can run: each batch bucket x depth x sampling
        lane, with the engine's extras (log-probabilities), then time the greedy rounds for the
        depth policy (:func:`specgraph.serving.depth.measure_costs`). After it no request
        compiles. Returns {"graphs": n, "seconds": build seconds, "costs": {(bucket, depth): s}}."""
        from specgraph.graphset import Progress

        t0 = time.perf_counter()
        # a round whose package is still being built runs the batch-1 one, already warm
        combos = [(b, d, m) for b in batch_buckets(self.B) for d in self.depths for m in modes
                  if not self.fast.row_by_row(b, SamplingParams(0.0) if m == "greedy" else self.sampling, d, self.extras)]
        bar = Progress(len(combos), progress, verb="building")
        width = self.fast.round_width(self.fast.min_attend)
        with torch.no_grad():
            for b, d, mode in combos:
                name = f"serve_b{b}_k{d}_{mode}"
                bar.start(name)
                t1 = time.perf_counter()
                active = torch.zeros(b, dtype=torch.bool, device=self.device)  # writes go to the scratch slot
                self._run_lane(b, d, width, torch.zeros(b, d, dtype=torch.long, device=self.device), active,
                               mode == "greedy", [0] * b, [t[:b] for t in self.kv])
                bar.advance(name, time.perf_counter() - t1)
            bar.close()
        costs = measure_costs(self)
        return {"graphs": len(combos), "seconds": round(time.perf_counter() - t0, 2), "costs": costs}

    # ------------------------------------------------------------------------------------------
    # the scheduler thread

    def start(self) -> None:
        if self._thread is not None:
            return
        self._running = True
        self._thread = threading.Thread(target=self._run, name="specgraph-scheduler", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Refuse new requests, end every queued and running one with an error event (each gets
        an answer), and stop the scheduler thread."""
        with self._cv:
            self._stopping = True
            self._running = False
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        with self._cv:
            pending, self.queue = list(self.queue), collections.deque()
        for h in pending:
            h.sink(Event(error="the server is shutting down"))
        for row in self.rows:
            row.handle.sink(Event(error="the server is shutting down"))
        self.rows = []

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while self._running and not self.queue and not self.rows:
                    self._cv.wait()
                if not self._running:
                    return
            try:
                self.step()
            except Exception as e:  # noqa: BLE001 - a failed round ends its requests with the reason, not the server
                for row in self.rows:
                    row.handle.sink(Event(error=f"generation failed: {type(e).__name__}: {e}"))
                self.rows = []

    @torch.no_grad()
    def step(self) -> None:
        """One scheduler pass: adopt graphs built in the background, admit, prefill a chunk, run
        a round, retire."""
        self._adopt_graphs()
        self._drop_cancelled()
        self._admit()
        self._prefill()
        if any(r.decoding for r in self.rows):
            self._round()

    # ------------------------------------------------------------------------------------------

    def _adopt_graphs(self) -> None:
        """Take the graphs the graph cache built in the background (batch buckets above 1), and
        once no row is decoding, time the rounds of those buckets again for the depth policy (a
        few rounds per bucket and depth: the costs it holds were measured on the row-by-row
        rounds they replace)."""
        self._remeasure.update(self.fast.refresh_graphs())
        if self._remeasure and not self.rows:
            measure_costs(self, buckets=sorted(self._remeasure))
            self._remeasure = set()

    def _admit(self) -> None:
        with self._cv:
            while self.queue and len(self.rows) < self.B:
                h = self.queue.popleft()
                seed = h.req.seed if h.req.seed is not None else secrets.randbits(63)
                self.rows.append(Row(h, seed, acc=torch.zeros(max(self.K, 1)), cnt=torch.zeros(max(self.K, 1))))
                if self.rows[-1].decoding:  # a one-token prompt: nothing to prefill
                    self._start_decoding(len(self.rows) - 1)

    def _drop_cancelled(self) -> None:
        with self._cv:
            for h in [h for h in self.queue if h.cancelled]:
                self.queue.remove(h)
                h.sink(Event(finish="cancelled"))
                self.stats.finished["cancelled"] += 1
        for i in reversed(range(len(self.rows))):
            if self.rows[i].handle.cancelled:
                self.rows[i].handle.sink(Event(finish="cancelled"))
                self.stats.finished["cancelled"] += 1
                self._retire(i)

    def _prefill(self) -> None:
        """Copy in every waiting row's prompt blocks that the prefix cache holds, then compute up
        to ``prefill_chunk`` prompt tokens, oldest waiting row first, keeping their whole blocks
        (a row that waits behind another with the same prompt copies what that one computed).

        While more rows wait for their prompt than decode, the pass computes twice as many: fewer
        rounds come between a burst of requests and its last first token, and the rounds then
        serve the fewer rows. A prompt whose rest is within a quarter of the chunk is finished
        now rather than left for a call of its own. The chunks go through one call, packed
        (:meth:`SpecGraphModel.prefill_packed`) where the model allows it and either its packed
        prefill graph is built or the rows' chunks do not form one run of equal lengths; else a
        call of the eager model per run of neighbouring rows (:meth:`_prefill_runs`)."""
        waiting = sum(not r.decoding for r in self.rows)
        budget = self.prefill_chunk * (2 if 2 * waiting > len(self.rows) else 1)
        plan: list[tuple[int, int]] = []
        for i, row in enumerate(self.rows):
            if row.decoding:
                continue
            prompt = row.handle.req.prompt
            if self.prefix is not None:
                have = row.prefilled
                row.prefilled = self.prefix.load(prompt[:-1], self.kv, i, have)
                self.stats.prefix_tokens += row.prefilled - have
            if row.decoding:
                self._start_decoding(i)
            elif budget > 0 and not self._computed_by(i, plan):
                left = len(prompt) - 1 - row.prefilled
                n = left if left - budget <= self.prefill_chunk // 4 else budget
                plan.append((i, n))
                budget -= n
        runs = self._prefill_runs(plan)
        padding = sum(len(run) * max(n for _, n in run) - sum(n for _, n in run) for run in runs)
        if plan and self.fast.packs_prefill and (len(runs) > 1 or padding or self.fast.packed_prefill_compiled):
            self.fast.prefill_packed(self.kv, [i for i, _ in plan], [self.rows[i].prefilled for i, _ in plan],
                                     [torch.tensor(self._next_prompt_tokens(i, n)) for i, n in plan])
            runs = []
            self.stats.packed_prefills += 1
            self._prefilled(plan)
        for run in runs:
            lo, hi = run[0][0], run[-1][0] + 1
            C = max(n for _, n in run)
            ids = torch.zeros(hi - lo, C, dtype=torch.long)
            for i, n in run:
                ids[i - lo, :n] = torch.tensor(self._next_prompt_tokens(i, n))
            self.fast.prefill_chunk([t[lo:hi] for t in self.kv], ids.to(self.device),
                                    [self.rows[i].prefilled for i, _ in run], [n for _, n in run])
            self._prefilled(run)

    def _next_prompt_tokens(self, i: int, n: int) -> list[int]:
        row = self.rows[i]
        return row.handle.req.prompt[row.prefilled: row.prefilled + n]

    def _prefilled(self, plan: list[tuple[int, int]]) -> None:
        """Rows i have n more prompt tokens in their cache: store whole blocks for reuse, and
        start decoding the rows whose prompt is in."""
        for i, n in plan:
            row = self.rows[i]
            row.prefilled += n
            self.stats.prefill_tokens += n
            if self.prefix is not None:
                self.prefix.store(row.handle.req.prompt[: row.prefilled], self.kv, i)
            if row.decoding:
                self._start_decoding(i)

    def _computed_by(self, i: int, plan: list[tuple[int, int]]) -> bool:
        """Whether a row already planned this pass computes a whole prompt block that row i needs
        next (the same tokens from position 0): row i then waits a pass and copies it instead."""
        if self.prefix is None:
            return False
        row, block = self.rows[i], self.prefix.block
        need = (row.prefilled // block + 1) * block  # row i's next block boundary
        mine = row.handle.req.prompt
        if need > len(mine) - 1:
            return False
        for j, n in plan:
            theirs = self.rows[j].handle.req.prompt
            if self.rows[j].prefilled + n >= need and mine[:need] == theirs[:need]:
                return True
        return False

    @staticmethod
    def _prefill_runs(plan: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
        """Group the planned (row, tokens) into runs of adjacent rows (a run is one call on a view
        of its rows' cache) whose padding to the run's longest chunk stays under a third of the
        call, or whose call stays within SHORT_PREFILL tokens: short chunks (the tails after a
        cached prefix) share a call, long ones go alone."""
        runs: list[list[tuple[int, int]]] = []
        for i, n in plan:
            run = runs[-1] if runs else None
            if run is not None and i == run[-1][0] + 1:
                total = sum(m for _, m in run) + n
                padded = (len(run) + 1) * max(n, max(m for _, m in run))
                if padded <= SHORT_PREFILL or padded * 2 <= total * 3:
                    run.append((i, n))
                    continue
            runs.append([(i, n)])
        return runs

    def _start_decoding(self, i: int) -> None:
        prompt = self.rows[i].handle.req.prompt
        self.hist[i, : len(prompt)] = torch.tensor(prompt, device=self.device)
        self.L[i] = len(prompt) - 1
        self.root[i] = prompt[-1]

    def _round(self) -> None:
        t0 = time.perf_counter()
        # the round covers the rows up to the last decoding one: rows still prefilling after it
        # (the newest, mostly) do not make it run a larger bucket
        m = 1 + max(i for i, r in enumerate(self.rows) if r.decoding)
        b = next(x for x in batch_buckets(self.B) if x >= m)
        live = [r.decoding for r in self.rows[:m]] + [False] * (b - m)
        L_host = self.L[:b].tolist()
        need = max(L_host[i] for i in range(m) if live[i]) + self.K + 1
        width = self.fast.round_width(need)
        drafts, matched = self._propose(b, live)
        on = [i for i in range(m) if live[i]]
        k = self.policy.choose(b, [(self.rows[i].acc, self.rows[i].cnt) for i in on], [matched[i] for i in on])
        drafts = drafts[:, :k]
        kv = [t[:b] for t in self.kv]
        greedy = [live[i] and self.rows[i].handle.req.temperature == 0 for i in range(m)] + [False] * (b - m)
        sampled = [live[i] and not greedy[i] for i in range(m)] + [False] * (b - m)
        tokens = torch.zeros(b, k + 1, dtype=torch.long, device=self.device)
        n = torch.zeros(b, dtype=torch.long, device=self.device)
        logprobs = None
        lanes = ((greedy, True), (sampled, False))
        if any(greedy) and any(sampled) and self._one_call_for_both_lanes(b, k):
            lanes = (([g or s for g, s in zip(greedy, sampled)], False),)  # greedy rows at temperature 0
            self.stats.joint_rounds += 1
        for lane, greedy_lane in lanes:
            if not any(lane):
                continue
            active = torch.tensor(lane, device=self.device)
            t_lane, n_lane, *lp = self._run_lane(b, k, width, drafts, active, greedy_lane, L_host, kv)
            tokens = torch.where(active.unsqueeze(1), t_lane, tokens)
            n = torch.where(active, n_lane, n)
            if lp:  # (chosen [b, k+1], top values [b, k+1, n], top ids [b, k+1, n])
                logprobs = lp if logprobs is None else [
                    torch.where(active.view(-1, *([1] * (x.dim() - 1))), x, y) for x, y in zip(lp, logprobs)]
        tokens_h, n_h = tokens.tolist(), n.tolist()  # the round's one host sync
        lp_h = None if logprobs is None else [x.tolist() for x in logprobs]
        adv = self._deliver(tokens_h, n_h, live, k, lp_h)
        self.L[:b], self.root[:b] = advance_rows(self.hist[:b], self.L[:b], self.root[:b], tokens,
                                                 torch.tensor(adv, device=self.device))
        seconds = time.perf_counter() - t0
        self.policy.observe(b, k, seconds, lanes=sum(any(lane) for lane, _ in lanes))
        st = self.stats
        st.rounds += 1
        st.depth_rounds[k] += 1
        st.occupancy_sum += sum(live)
        self._finish_rows()

    def _propose(self, b: int, live: list[bool]):
        """Prompt-lookup drafts at the deepest depth [b, K] and which rows matched."""
        if self.K == 0:
            return self.hist[:b, :0], [False] * b
        drafts, matched = ngram_propose(self.hist[:b], self.L[:b] + 1, self.K, NGRAM_MAX, NGRAM_MIN)
        return drafts, [bool(x) for x in (matched > 0).tolist()]

    def _one_call_for_both_lanes(self, b: int, k: int) -> bool:
        """Whether this round's greedy rows can run in its sampling graph: the graph cache serves
        the round with one package for both modes (mode "any", where a row at temperature 0 is
        verified greedily) and bakes this server's filters into it."""
        graphs = self.fast.graphs_in_use()
        if self.extras is not None or not isinstance(graphs, CachedGraphs) or graphs.sampling != self.sampling:
            return False
        lane = graphs.packages.get(package_key("round", b, k, "greedy"))
        return isinstance(lane, GreedyRows) and graphs.packages.get(package_key("round", b, k, "sample")) is lane.package

    def _run_lane(self, b, k, width, drafts, active, greedy, L_host, kv):
        """One round graph over the rows of one sampling lane (the others inactive)."""
        accept_u = torch.zeros(b, k, device=self.device)
        if greedy:
            params, expo, temp = SamplingParams(0.0), torch.ones(b, k + 1, 1, device=self.device), ()
        else:
            params = self.sampling
            expo = torch.ones(b, k + 1, self.V)
            temps = torch.ones(b)
            on = [i for i, a in enumerate(active.tolist()) if a]
            expo[on] = position_noise([self.rows[i].seed for i in on], [L_host[i] + 1 for i in on], k + 1, self.V)
            temps[on] = torch.tensor([self.rows[i].handle.req.temperature for i in on])
            expo, temp = expo.to(self.device), (temps.to(self.device),)
        fn = self.fast.round_graph(b, params, width, k, self.extras)
        return fn(self.root[:b], self.L[:b], active, accept_u, expo, drafts, accept_u, *temp, *kv)

    def _deliver(self, tokens_h, n_h, live, k, lp_h=None) -> list[int]:
        """Hand each decoding row its tokens (cut at a stop), record acceptance; returns the
        tokens each cache row advances by."""
        adv = [0] * len(tokens_h)
        now = time.perf_counter()
        emitted = 0
        for i, row in enumerate(self.rows[: len(live)]):
            if not live[i]:
                continue
            got = tokens_h[i][: n_h[i]]
            self._observe_acceptance(row, k, n_h[i])
            req = row.handle.req
            keep, eos = stop_at(got, req.max_tokens - len(row.new), req.eos)
            finish = "stop" if eos else None
            if req.stop is not None and keep:
                cut = req.stop(row.new + keep)
                if cut is not None:
                    keep, finish = (row.new + keep)[len(row.new): cut], "stop"
            row.new.extend(keep)
            if finish is None and len(row.new) >= req.max_tokens:
                finish = "length"
            adv[i] = n_h[i]
            emitted += len(keep)
            row.handle.finish = finish
            lps = None
            if req.logprobs is not None and lp_h is not None:
                chosen, top_v, top_i = (x[i] for x in lp_h)
                lps = [(chosen[j], list(zip(top_i[j][: req.logprobs], top_v[j][: req.logprobs]))) for j in range(len(keep))]
            row.handle.sink(Event(tokens=keep, finish=finish, logprobs=lps))
            if finish is not None:
                self.stats.finished[finish] += 1
        self.stats.tokens += emitted
        self.stats.recent.append((now, emitted))
        return adv

    def _observe_acceptance(self, row: Row, k: int, n: int) -> None:
        if k == 0:
            return
        a = n - 1  # accepted drafts
        reached = min(a + 1, k)  # positions verified: the accepted ones and the first rejected one
        decay = self.policy.decay
        row.acc[:reached] *= decay
        row.cnt[:reached] *= decay
        row.acc[:a] += 1
        row.cnt[:reached] += 1
        for j in range(reached):
            self.stats.drafted[j + 1] += 1
            self.stats.accepted[j + 1] += int(j < a)
        self.policy.pool(a, reached)

    def _finish_rows(self) -> None:
        for i in reversed(range(len(self.rows))):
            if self.rows[i].handle.finish is not None:
                self._retire(i)

    def _retire(self, i: int) -> None:
        """Free row i: the last row moves into it (its cache slots, history and state)."""
        last = len(self.rows) - 1
        if i != last:
            row = self.rows[last]
            n = int(self.L[last]) + 1 if row.decoding else row.prefilled
            if n > 0:
                for t in self.kv:
                    t[i, :, :n] = t[last, :, :n]
            self.hist[i] = self.hist[last]
            self.L[i], self.root[i] = self.L[last], self.root[last]
            self.rows[i] = row
        self.rows.pop()


__all__ = ["ServingEngine", "ServeRequest", "Event", "Handle", "EngineStats", "QueueFull", "EngineStopped",
           "position_noise", "serving_support", "PREFILL_CHUNK", "MAX_QUEUE", "PREFIX_CACHE_BYTES", "PREFIX_BLOCK"]
