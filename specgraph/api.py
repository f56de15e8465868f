"""``specgraph.compile``: the engine's compile (:func:`specgraph.compiler.compile`), with the
graph set served from the persistent graph cache (:mod:`specgraph.graphcache`) when it can be."""
from __future__ import annotations

from specgraph import compiler, graphcache
from specgraph.compiler import SpecGraphModel
from specgraph.graphset import MODES

def compile(
    model,
    draft=None,
    *,
    num_speculative_tokens: int = 4,
    tree=None,
    backend: str = "inductor",
    max_batch_size: int = 8,
    max_seq_len: int = 2048,
    freeze: bool = True,
    depths=None,
    plan=None,
    autotune="auto",
    tree_nodes="auto",
    warmup: bool | None = None,
    modes=MODES,
    progress: bool = True,
    cache=None,
    generation_config=None,
    refine: str = "auto",
) -> SpecGraphModel:
    fast = compiler.compile(model, draft, num_speculative_tokens=num_speculative_tokens, tree=tree, backend=backend,
                            max_batch_size=max_batch_size, max_seq_len=max_seq_len, freeze=freeze, depths=depths,
                            plan=plan, autotune=autotune, tree_nodes=tree_nodes, warmup=False)
    if not (compiler.WARMUP_BY_DEFAULT if warmup is None else warmup) or fast.fallback_reason is not None:
        return fast
    if graphcache.enabled(cache):
        fast.graph_cache = graphcache.load_or_build(fast, modes, progress=progress, root=graphcache.root_of(cache),
                                                    refine=refine)
        fast.graph_cache_root = graphcache.root_of(cache)
    elif refine not in graphcache.REFINE:
        raise ValueError(f"refine must be one of {graphcache.REFINE}, got {refine!r}")
    fast.warmup(modes, progress=progress and fast.graph_cache is None)
    if generation_config is not None:
        prepare_settings(fast, generation_config, modes, progress, refine=refine)
    return fast


def prepare_settings(fast: SpecGraphModel, generation_config, modes=MODES, progress: bool = True,
                     refine: str = "auto") -> None:
    """Build (or load from the graph cache, when ``fast`` is served by one) the rounds of
    ``generation_config``'s logits processors, so requests with them build nothing."""
    logits = fast.logits_spec(generation_config)
    if logits is None:
        return
    if fast.graph_cache is not None:
        extra = graphcache.load_or_build(fast, modes, progress=progress, root=fast.graph_cache_root,
                                         logits=logits, refine=refine)
        if extra is not None:
            info = fast.graph_cache
            fast.graph_cache = {**info, "hit": info["hit"] and extra["hit"], "built": info["built"] + extra["built"],
                                "helper_built": info["helper_built"] + extra["helper_built"],
                                "loaded": info["loaded"] + extra["loaded"], "frozen": info["frozen"] + extra["frozen"],
                                "refining": info["refining"] + extra["refining"],
                                "seconds": round(info["seconds"] + extra["seconds"], 2)}
    fast.warmup(modes, progress=progress and fast.graph_cache is None, generation_config=generation_config)


compile.__doc__ = compiler.compile.__doc__ + """
    ``cache`` (CPU, Inductor, plain decoding, ``"ngram"`` or ``"suffix"``): the graph set is kept
    on disk (:mod:`specgraph.graphcache`), keyed by every weight of the model, the compile
    settings, the library versions and the CPU, so the same compile in a new process loads its
    graphs in seconds instead of building them. The cached graphs are AOTInductor packages of the
    same rounds, frozen (each holds its own prepacked weight copy on disk) and autotuned as the
    object's settings say. ``None`` (default): on, under ``$SPECGRAPH_GRAPH_CACHE`` (default
    ``~/.cache/specgraph/graphs``; ``SPECGRAPH_GRAPH_CACHE=off`` turns the default off); a path:
    on, under that folder; ``False``: off (the JIT builds the set). ``fast.graph_cache`` says what
    happened (hit or built, seconds, packages loaded, graphs still refining), None when no
    cache served the object.

    ``refine``: per (mode, depth) one package whose batch is a dynamic dimension serves every
    batch; batch 1 and the smallest buckets also get a static package of their own, faster for
    them. ``"auto"`` (default): where a helper process builds beside this one (a second core, a
    model of 20M parameters or more), ``compile`` returns once the dynamic packages are built and
    the helper builds the static ones in the background, at a lower CPU priority; each is adopted
    between calls as it arrives (``fast.refresh_graphs()``; ``fast.graphs_in_use().wait()``
    waits for them). Nothing compiles on the request path either way. ``"now"``: build them all
    before returning; ``"background"``: as "auto", warning when no helper can; ``"never"``: the
    dynamic packages only (fewer weight copies, slower small batches).

    ``generation_config``: a ``GenerationConfig`` whose logits processors (repetition penalty,
    no-repeat n-grams, ...) requests will use: their rounds are built (and cached) too, so those
    requests build nothing either.
    """
