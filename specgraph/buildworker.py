"""A helper process that builds graph-cache packages beside the compiling process.

Building a package is one core's work: Inductor's lowering and code generation are Python, and
the C++ compile that follows is one compiler process. On a machine with a second core the graph
cache (:func:`specgraph.graphcache.load_or_build`) starts this module as a subprocess and hands it
half the graphs, so two packages build at once.

Protocol (one JSON object per line; the helper's stdout carries nothing else):

    parent -> helper   {"model_dir", "model_class", "dtype", "attn_implementation", "settings",
                        "folder", "digest", "min_attend", "gguf"}
    helper -> parent   {"ready": true} | {"error": "..."}
    parent -> helper   {"graph": {GraphSpec fields}, "frozen": bool, "nice": n}      (repeated;
                       n > 0: build at that CPU niceness from now on, beside a serving parent)
    helper -> parent   {"built": name, "seconds": s} | {"error": "...", "export": bool}

The helper rebuilds the compiled object from the model the parent saved (:func:`specgraph.models.save_checkpoint`:
the model ``compile`` was given, before its precision was changed) and the parent's compile settings (the
precision among them, derived again here), then checks that the graph-cache key of its object (weights,
configuration, settings, versions, machine) is the parent's: a helper whose model or settings
differ in any way refuses to build. It writes each package into the cache folder exactly as the
parent would (:func:`specgraph.graphcache.write_package`), without opening it; the parent checks
the package's record and sha256, then opens it.
"""
from __future__ import annotations

import importlib
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path


def _answer(out, obj: dict) -> None:
    out.write(json.dumps(obj) + "\n")
    out.flush()


def _load_model(job: dict):
    import torch

    module, _, name = job["model_class"].rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    model = cls.from_pretrained(job["model_dir"], dtype=getattr(torch, job["dtype"]),
                                attn_implementation=job["attn_implementation"])
    if job.get("gguf") is not None:  # weights="native" reads the file's blocks (specgraph.gguf_weights)
        model.specgraph_gguf = job["gguf"]
    return model.eval()


def _compiled(job: dict):
    from specgraph import api, compiler, graphcache

    compiler.MIN_ATTEND = job["min_attend"]
    s = job["settings"]
    fast = api.compile(_load_model(job), s["draft"], num_speculative_tokens=s["num_speculative_tokens"],
                       max_batch_size=s["max_batch_size"], max_seq_len=s["max_seq_len"], freeze=s["freeze"],
                       autotune=s["autotune"], attention=s.get("attention", "auto"), weights=s.get("weights"),
                       warmup=False)
    digest = graphcache.key_digest(graphcache.entry_key(fast))
    if digest != job["digest"]:
        raise RuntimeError(f"the helper's graph-cache key {digest} is not the parent's {job['digest']}")
    return fast


def serve(inp, out) -> int:
    """Answer the protocol above on ``inp`` / ``out`` until ``inp`` closes."""
    import torch

    from specgraph import graphcache
    from specgraph.capture import UnsupportedModel
    from specgraph.graphset import GraphSpec

    job = json.loads(inp.readline())
    try:
        fast = _compiled(job)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which builds the graphs itself
        traceback.print_exc()
        _answer(out, {"error": f"{type(e).__name__}: {e}"})
        return 1
    _answer(out, {"ready": True})
    folder = Path(job["folder"])
    device = next(fast.model.parameters()).device
    for line in inp:
        req = json.loads(line)
        g = GraphSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in req["graph"].items()})
        if req.get("nice", 0) > 0 and hasattr(os, "nice") and os.nice(0) < req["nice"]:
            os.nice(req["nice"] - os.nice(0))  # background work: the parent process answers requests now
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                graphcache.write_package(fast, folder, job["digest"], g, req["frozen"], device, fast.vocab)
        except Exception as e:  # noqa: BLE001 - the parent builds this graph itself
            traceback.print_exc()
            export = isinstance(e, (torch._dynamo.exc.UserError, UnsupportedModel))
            _answer(out, {"error": f"{type(e).__name__}: {e}", "export": export})
            continue
        _answer(out, {"built": g.name, "seconds": round(time.perf_counter() - t0, 2)})
    return 0


def main() -> int:
    # terminated (the parent exits, or stops building): unwind, so the build's temporary folder goes too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    # the protocol owns the original stdout; anything else printed (Inductor, transformers) goes to stderr
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return serve(sys.stdin, out)


if __name__ == "__main__":
    sys.exit(main())
