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
) -> SpecGraphModel:
    fast = compiler.compile(model, draft, num_speculative_tokens=num_speculative_tokens, tree=tree, backend=backend,
                            max_batch_size=max_batch_size, max_seq_len=max_seq_len, freeze=freeze, depths=depths,
                            plan=plan, autotune=autotune, tree_nodes=tree_nodes, warmup=False)
    if not (compiler.WARMUP_BY_DEFAULT if warmup is None else warmup) or fast.fallback_reason is not None:
        return fast
    if graphcache.enabled(cache):
        fast.graph_cache = graphcache.load_or_build(fast, modes, progress=progress, root=graphcache.root_of(cache))
    fast.warmup(modes, progress=progress and fast.graph_cache is None)
    return fast


compile.__doc__ = compiler.compile.__doc__ + """
    ``cache`` (CPU, Inductor, plain decoding, ``"ngram"`` or ``"suffix"``): the graph set is kept
    on disk (:mod:`specgraph.graphcache`), keyed by every weight of the model, the compile
    settings, the library versions and the CPU, so the same compile in a new process loads its
    graphs in seconds instead of building them. The cached graphs are AOTInductor packages of the
    same rounds, frozen (each holds its own prepacked weight copy on disk) and autotuned as the
    object's settings say. ``None`` (default): on, under ``$SPECGRAPH_GRAPH_CACHE`` (default
    ``~/.cache/specgraph/graphs``; ``SPECGRAPH_GRAPH_CACHE=off`` turns the default off); a path:
    on, under that folder; ``False``: off (the JIT builds the set). ``fast.graph_cache`` says what
    happened (hit or built, seconds, packages loaded), None when no cache served the object.
    """
