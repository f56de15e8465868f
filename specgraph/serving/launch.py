"""Start-up of a server: load the model, compile its graph set, build the engine's rounds, then
open the port (``specgraph serve``), or hand the app to Ray Serve (:mod:`specgraph.serving.ray_app`)."""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass

from specgraph.serving.guard import LOCAL_HOSTS, checked_api_key


@dataclass
class ServeConfig:
    """What ``specgraph serve`` takes (its flags). ``draft``: None (plain decoding) or "ngram"."""

    model: str = "default"
    draft: str | None = "ngram"
    num_speculative_tokens: int = 4
    max_batch_size: int = 16
    max_seq_len: int | None = None  # None: 2048, or the model's maximum positions when smaller
    max_queue: int = 256
    max_logprobs: int | None = None
    request_timeout: float = 600.0
    prefill_chunk: int = 256
    prefix_cache_mb: int = 512  # the prompt-prefix KV pool (0: off)
    top_k: int | None = None  # None: the model's default sampling filters (what model.generate applies)
    top_p: float | None = None
    min_p: float | None = None
    served_model_name: str | None = None
    modes: tuple[str, ...] = ("greedy", "sample")
    autotune: object = "auto"
    backend: str = "inductor"  # "eager": no compiled graphs (tests, debugging)
    speculation: object = "auto"  # "auto" (depth per round, by load) or a fixed depth (0 = off, or K)
    threads: int | None = None
    progress: bool = True
    refine: str = "auto"  # specgraph.compile's refine: when the graphs of batch buckets above 1 are built
    attention: str = "auto"  # specgraph.compile's attention: "block_sparse" (CPU default) or "sdpa"
    packed_prefill: bool = True  # specgraph.compile's packed_prefill: prompt chunks through a compiled graph
    api_key: str | None = None  # the key (Authorization: Bearer) all routes but /health, /metrics need; None: none
    allowed_hosts: tuple[str, ...] | None = LOCAL_HOSTS  # the names a Host header may carry; None: any
    max_prompt_chars: int | None = None  # longest prompt tokenized (None: 32 characters per token of max_seq_len)
    weights: str | None = None  # compile(weights=...); None: native for a GGUF model, else as loaded

    def __post_init__(self):
        checked_api_key(self.api_key)


def _say(cfg: ServeConfig, msg: str) -> None:
    if cfg.progress:
        print(f"specgraph serve: {msg}", file=sys.stderr, flush=True)


def build_server(cfg: ServeConfig, compiled=None):
    """(FastAPI app, engine, start-up report): every graph built or loaded, the scheduler not yet
    started (the app's lifespan starts it). ``compiled``: (fast, tokenizer, baked sampling
    filters) of an object compiled elsewhere (a compiled directory: ``specgraph serve DIR``), or a
    function returning them (timed as the load), served instead of loading and compiling
    ``cfg.model``; ``cfg`` must describe it."""
    import torch

    import specgraph
    from specgraph.gguf_weights import default_weights
    from specgraph.models import load_model
    from specgraph.serving.engine import ServingEngine
    from specgraph.serving.server import DIR_FILTER_HINT, FILTER_HINT, create_app
    from specgraph.warping import SamplingParams

    if cfg.draft not in (None, "ngram"):
        raise ValueError(f"specgraph serve runs draft=None or 'ngram', got {cfg.draft!r}")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    t0 = time.perf_counter()
    _say(cfg, f"loading {cfg.model} ...")
    if compiled is not None:
        fast, tok, base = compiled() if callable(compiled) else compiled
        t_load, t_compile = time.perf_counter() - t0, 0.0
    else:
        model, tok = load_model(cfg.model)
        t_load = time.perf_counter() - t0
        # the rounds with log-probabilities are graphs of their own (built by the engine's warmup)
        plain_rounds = cfg.max_logprobs is None
        fast = specgraph.compile(model, cfg.draft, num_speculative_tokens=cfg.num_speculative_tokens,
                                 max_batch_size=cfg.max_batch_size, max_seq_len=cfg.max_seq_len,
                                 autotune=cfg.autotune, backend=cfg.backend, modes=cfg.modes, warmup=plain_rounds,
                                 progress=cfg.progress, refine=cfg.refine, attention=cfg.attention,
                                 packed_prefill=cfg.packed_prefill,
                                 weights=cfg.weights if cfg.weights is not None else default_weights(model, cfg.draft))
        t_compile = time.perf_counter() - t0 - t_load
        base = fast.default_sampling()
    sampling = SamplingParams(1.0, cfg.top_k if cfg.top_k is not None else base.top_k,
                              cfg.top_p if cfg.top_p is not None else base.top_p,
                              cfg.min_p if cfg.min_p is not None else base.min_p)
    policy = None
    if cfg.speculation != "auto":
        from specgraph.serving.depth import FixedServingDepth

        policy = FixedServingDepth(fast.chain_depths(), int(cfg.speculation))
    engine = ServingEngine(fast, max_queue=cfg.max_queue, prefill_chunk=cfg.prefill_chunk, sampling=sampling,
                           max_logprobs=cfg.max_logprobs, policy=policy, prefix_cache_bytes=cfg.prefix_cache_mb << 20)
    warm = engine.warmup(cfg.modes, progress=cfg.progress)
    name = cfg.served_model_name or cfg.model
    app = create_app(engine, tok, name, request_timeout=cfg.request_timeout,
                     filter_hint=FILTER_HINT if compiled is None else DIR_FILTER_HINT, api_key=cfg.api_key,
                     allowed_hosts=cfg.allowed_hosts, max_prompt_chars=cfg.max_prompt_chars)
    report = {"load_seconds": round(t_load, 2), "compile_seconds": round(t_compile, 2),
              "engine_seconds": warm["seconds"], "graphs": warm["graphs"], "graph_cache": fast.graph_cache,
              "startup_seconds": round(time.perf_counter() - t0, 2)}
    _say(cfg, f"ready in {report['startup_seconds']:.1f} s (load {t_load:.1f} s, graphs {t_compile:.1f} s, "
              f"engine {warm['seconds']:.1f} s; {warm['graphs']} rounds)")
    return app, engine, report


def run(cfg: ServeConfig, host: str = "127.0.0.1", port: int = 8000, log_level: str = "warning",
        compiled=None) -> None:
    """Build everything, then serve on host:port until interrupted (graceful: requests in
    flight finish, then the engine stops). ``compiled``: see :func:`build_server`."""
    import uvicorn

    app, _, _ = build_server(cfg, compiled)
    _say(cfg, f"listening on http://{host}:{port}/v1")
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=30)
