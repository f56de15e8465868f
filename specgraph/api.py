"""``specgraph.compile``: the compiled object (:class:`specgraph.compiler.SpecGraphModel`), its
depth policy (:mod:`specgraph.adaptive` for ``num_speculative_tokens="auto"``), and its graph set
built or served from the persistent graph cache (:mod:`specgraph.graphcache`)."""
from __future__ import annotations

from specgraph import adaptive, compiler, gguf_weights, graphcache, learned, proposers
from specgraph.compiler import EngineConfig, SpecGraphModel, resolve_autotune
from specgraph.graphset import MODES
from specgraph.planner import as_plan


def compile(
    model,
    draft=None,
    *,
    num_speculative_tokens: int = 4,
    tree=None,
    backend: str = "inductor",
    max_batch_size: int = 8,
    max_seq_len: int | None = None,
    freeze: bool | None = None,
    weights: str | None = None,
    depths=None,
    plan=None,
    autotune="auto",
    tree_nodes="auto",
    warmup: bool | None = None,
    modes=MODES,
    progress: bool = True,
    cache=None,
    generation_config=None,
    structured_output: bool = False,
    refine: str = "auto",
    attention: str = "auto",
    packed_prefill: bool = False,
) -> SpecGraphModel:
    """Compile ``model`` (an HF causal LM in eval mode) for speculative generation.

    ``draft``: None (compiled plain decoding), ``"ngram"`` (prompt lookup), ``"suffix"``, a draft
    model, ``"layerskip"`` (the model's first layers as the draft, :func:`specgraph.drafters.layer_skip`),
    ``"self-int4"`` (the model's own weights at int4 drafting for the model at ``weights``,
    :func:`specgraph.drafters.self_int4`),
    or a learned head (:mod:`specgraph.learned`): ``"eagle"`` / ``"medusa"`` (the head file whose
    fingerprint matches ``model``; an error when there is none) or an ``EagleHead`` / ``MedusaHeads``
    bound to ``model``. EAGLE takes ``tree=None``, a static tree or ``"dynamic"`` (EAGLE-2 style);
    Medusa a chain or a static tree. ``backend="eager"``
    runs the same rewritten graphs without torch.compile.

    ``max_seq_len``: the longest prompt + new tokens a row holds (its static KV cache has that
    many slots, plus one). None (default): 2048, or the model's maximum positions when smaller;
    a value above the model's maximum is refused, and so is a KV cache (``max_batch_size`` rows)
    larger than the memory available now (:mod:`specgraph.limits`), with the numbers.

    ``warmup`` (default True): build every graph ``generate`` can ask for before returning
    (:meth:`SpecGraphModel.warmup`, with a progress bar on stderr unless ``progress=False``):
    one graph per (batch bucket, depth or tree shape, mode in ``modes``), whatever the prompt
    length; after that ``generate`` does not compile. ``warmup=False`` builds each graph on its
    first use instead. ``modes``: the sampling modes to build, ``("greedy", "sample")`` by default.

    ``weights``: the precision of the weights the compiled object runs (:mod:`specgraph.precision`):
    ``"float32"``, ``"bfloat16"``, ``"int8"`` (weight-only, a scale per output channel), ``"int4"``
    (weight-only, a scale and offset per 32 inputs) or ``"native"`` (a GGUF model at its file's own
    precision; ``specgraph.load_model`` records a GGUF model's file for it). None (default): the
    model as given (``"float32"`` for an fp32 model, also one dequantized from a GGUF file: the
    command line runs those at ``"native"`` unless ``--weights`` says otherwise).
    The target is the model at that precision, ``fast.model`` (``specgraph.quantize(model,
    weights)``); ``model`` itself is left as it is. Only the linear layers' weights change:
    activations and sums stay fp32, so greedy output equals ``fast.model.generate`` as it does
    at float32 (docs/weights.md).

    ``freeze=True`` lets Inductor treat the weights as constants (faster matmuls on CPU); each
    compiled graph then holds its own prepacked copy of the weights, and later changes to the
    model's weights are not seen. ``freeze=False`` saves that memory: every graph reads the one
    copy of the weights. None (default): frozen for ``weights="float32"``; the other precisions
    read the one copy, unfrozen. The copies of all objects of
    a process are kept within a budget (half the machine's memory, or ``SPECGRAPH_FREEZE_BUDGET_GB``;
    :mod:`specgraph.freezing`): past it, further graphs compile unfrozen, with a warning;
    ``fast.graph_frozen`` says which graphs were frozen.

    ``autotune=True`` lets Inductor pick, per GEMM shape, between its own GEMM template and the
    library call by benchmarking both (``max_autotune``): on a 2-core AVX-512 CPU SmolLM2's plain
    decoding runs faster (``benchmarks/autotune_bench.py``), and each graph takes about 12% longer
    to build (docs/architecture.md, "Build time"). ``"auto"``
    (default): on for frozen CPU models of at least ``AUTOTUNE_MIN_PARAMS`` parameters, off on CUDA,
    for small models and for unfrozen graphs (see :func:`resolve_autotune`).

    ``attention``: how the rounds' attention reads the KV cache. A round attends as many cache slots
    as its longest row needs; ``"block_sparse"`` has each row read only the 64-slot blocks its own
    mask shows (flex attention, :func:`specgraph.passes.block_sparse_attention_pass`), so the short
    rows of a batch cost what their own length costs. ``"sdpa"``: the model's own attention over
    the attended width. ``"auto"`` (default): block-sparse for Inductor on CPU, else ``"sdpa"``.
    Both are exact (the same attention up to float summation order).

    ``tree_nodes`` (EAGLE with ``tree="dynamic"``): drafted nodes verified per round. ``"auto"``
    (default): measured here, once: the target's cost of N query tokens and the head's step cost
    on this machine, in graphs compiled like this object's (a few minutes the first time on a CPU;
    cached per machine, model and compile settings under ``$SPECGRAPH_CACHE``), with the
    acceptance per depth recorded in the head file by ``train-drafter``,
    choose the depth (at most ``num_speculative_tokens``) and N with the most expected tokens per
    second (:func:`specgraph.learned.choose_dynamic_tree`; ``fast.tree_choice`` holds the
    measurements and predictions; a warning says when even the best tree is predicted less than
    ``specgraph.learned.TREE_GAIN_MARGIN`` faster than plain decoding). A head without recorded
    acceptance keeps depth ``num_speculative_tokens`` and ``EAGLE_TREE_NODES`` nodes. An int fixes N.

    ``depths``: for model-free chains (``"ngram"``, ``"suffix"``), the depths to move between
    (default: ``min(K, 4)`` and ``K``); the largest replaces ``num_speculative_tokens``.

    ``num_speculative_tokens="auto"`` (chains: ``"ngram"``, ``"suffix"``, a draft model, a
    :class:`specgraph.drafters.ChainDrafter`): each round's depth is chosen for the whole batch among
    0 (a plain step) and ``depths`` (default: those ``plan`` recommends, else 2, 4, 8) from per-row
    acceptance estimates and a cost model: ``plan`` (a :class:`specgraph.planner.Plan` or the path
    of its JSON, from :func:`specgraph.plan` / ``specgraph plan``) or a conservative built-in curve.
    See :mod:`specgraph.adaptive`; ``fast.policy.trace`` lists the depth of each round.

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

    ``refine``: when the graphs of batch buckets above 1 are built. ``"auto"`` (default): where a
    helper process builds beside this one (a second core, a model of 20M parameters or more),
    ``compile`` returns once the batch-1 graphs are built, and the helper builds the others in
    the background, at a lower CPU priority; each is adopted between calls as it arrives
    (``fast.refresh_graphs()``; ``fast.graphs_in_use().wait()`` waits for them), and until then
    a batch of B rows runs as B rounds of one row on the batch-1 graphs (the same tokens).
    Nothing compiles on the request path either way. ``"now"``: build them all before returning;
    ``"background"``: as "auto", warning when no helper can.

    ``packed_prefill``: the graph cache also builds the packed prefill graph
    (:meth:`SpecGraphModel.prefill_packed`: several rows' prompt chunks in one call, the model's
    step compiled with a dynamic token count), with the graphs of the larger buckets; the eager
    model prefills until it arrives. ``specgraph serve`` turns it on.

    ``generation_config``: a ``GenerationConfig`` whose logits processors (repetition penalty,
    no-repeat n-grams, ...) requests will use: their rounds are built (and cached) too, so those
    requests build nothing either. ``structured_output=True``: the same for requests with a
    ``response_format``, ``regex`` or ``grammar`` (one set of rounds serves every grammar).
    """
    fast = _engine(model, draft, num_speculative_tokens, tree, backend, max_batch_size, max_seq_len, freeze, depths,
                   plan, autotune, tree_nodes, attention, weights)
    if not (compiler.WARMUP_BY_DEFAULT if warmup is None else warmup) or fast.fallback_reason is not None:
        fast.source_model = None
        return fast
    if graphcache.enabled(cache):
        fast.graph_cache = graphcache.load_or_build(fast, modes, progress=progress, root=graphcache.root_of(cache),
                                                    refine=refine, packed_prefill=packed_prefill)
        fast.graph_cache_root = graphcache.root_of(cache)
    elif refine not in graphcache.REFINE:
        raise ValueError(f"refine must be one of {graphcache.REFINE}, got {refine!r}")
    fast.warmup(modes, progress=progress and fast.graph_cache is None)
    if generation_config is not None or structured_output:
        prepare_settings(fast, generation_config, modes, progress, refine=refine, structured_output=structured_output)
    fast.source_model = None  # the helper has its own copy: the object holds only its own weights
    return fast


def _engine(model, draft, num_speculative_tokens, tree, backend, max_batch_size, max_seq_len, freeze, depths, plan,
            autotune, tree_nodes, attention="auto", weights=None) -> SpecGraphModel:
    """The compiled object, its depths set (``num_speculative_tokens="auto"``: the adaptive
    policy, :mod:`specgraph.adaptive`), nothing built yet."""
    weights = gguf_weights.resolve(weights, model)
    source, model = model, gguf_weights.model_at(model, weights)
    if isinstance(draft, str) and draft == "self-int4":
        draft = _self_int4(source, model)
    if freeze is None:
        freeze = weights == "float32"
    auto = isinstance(num_speculative_tokens, str)
    if auto:
        if num_speculative_tokens != "auto":
            raise ValueError(f"num_speculative_tokens must be a positive int or 'auto', got {num_speculative_tokens!r}")
        plan = as_plan(plan)
        depths = adaptive.auto_depths(depths, plan)
        num_speculative_tokens = max(depths)
    elif plan is not None:
        raise ValueError("plan= is read by num_speculative_tokens='auto'")
    config = resolve_config(model, draft, num_speculative_tokens, tree, backend, max_batch_size, max_seq_len, freeze,
                            resolve_autotune(autotune, model, freeze), tree_nodes, attention)
    fast = SpecGraphModel(model, config, proposers.make_proposer)
    fast.source_model = source  # the model as given, while the graph set builds (a build helper loads it)
    if auto:
        adaptive.enable_auto(fast, depths, plan)
    elif depths is not None:
        fast.set_depths(depths)
    return fast


def _self_int4(source, target):
    """``draft="self-int4"``: the target's own weights at int4 (:func:`specgraph.drafters.self_int4`)."""
    from specgraph.drafters import self_int4
    from specgraph.precision import as_given

    if as_given(source) != "float32":
        raise ValueError(f"draft='self-int4' quantizes the model's fp32 weights; this model is {as_given(source)}")
    if as_given(target) == "int4":
        raise ValueError("draft='self-int4' drafts at int4 for a target at a higher precision; the target is int4 "
                         "already (use weights='float32', 'bfloat16', 'int8' or 'native')")
    return self_int4(source, target)


def resolve_config(model, draft, num_speculative_tokens, tree, backend, max_batch_size, max_seq_len, freeze=True,
                   autotune=False, tree_nodes="auto", attention="auto") -> EngineConfig:
    """:func:`compile`'s arguments as the engine's :class:`specgraph.compiler.EngineConfig`, or a
    ``ValueError`` that says what to pass instead: the drafter resolved
    (:func:`specgraph.proposers.resolve_draft`), the settings validated
    (:func:`specgraph.compiler.engine_config`), and EAGLE-2 trees sized from this machine's costs
    when ``tree_nodes="auto"`` (:func:`specgraph.learned.size_dynamic_tree`)."""
    auto_nodes = isinstance(tree_nodes, str) and tree_nodes == "auto"
    config = compiler.engine_config(model, proposers.resolve_draft(model, draft), num_speculative_tokens, tree, backend,
                                    max_batch_size, max_seq_len, freeze, autotune, None if auto_nodes else tree_nodes,
                                    attention)
    if auto_nodes and config.tree == "dynamic" and config.draft == "eagle":
        config = learned.size_dynamic_tree(model, config, stacklevel=5)
    return config


def prepare_settings(fast: SpecGraphModel, generation_config, modes=MODES, progress: bool = True,
                     refine: str = "auto", structured_output: bool = False) -> None:
    """Build (or load from the graph cache, when ``fast`` is served by one) the rounds of
    ``generation_config``'s logits processors (None: none), with a grammar's mask when
    ``structured_output``, so requests with them build nothing."""
    logits = fast.logits_spec(generation_config, structured_output)
    if logits is None:
        return
    if fast.graph_cache is not None:
        # rounds with logits processors have no helper process: built now ("background" would warn)
        extra = graphcache.load_or_build(fast, modes, progress=progress, root=fast.graph_cache_root,
                                         logits=logits, refine="auto" if refine == "background" else refine)
        if extra is not None:
            info = fast.graph_cache
            fast.graph_cache = {**info, "hit": info["hit"] and extra["hit"], "built": info["built"] + extra["built"],
                                "helper_built": info["helper_built"] + extra["helper_built"],
                                "loaded": info["loaded"] + extra["loaded"], "frozen": info["frozen"] + extra["frozen"],
                                "refining": info["refining"] + extra["refining"],
                                "seconds": round(info["seconds"] + extra["seconds"], 2)}
    fast.warmup(modes, progress=progress and fast.graph_cache is None, generation_config=generation_config,
                structured_output=structured_output)
