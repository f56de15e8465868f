"""Inductor's kernel templates, compiled once per process.

With GEMM autotuning on the CPU, Inductor renders its C++ GEMM template (and its micro-kernel
templates) for every candidate blocking of every GEMM shape, and each render first compiles the
template's Jinja source again: ``KernelTemplate._template_from_string`` builds a new Jinja
environment and parses the same few sources thousands of times per graph. That parse was about a
quarter of the time to build an autotuned SmolLM2 round on a 2-core CPU.

:func:`memoize_kernel_templates` keeps one compiled template per source. A compiled Jinja
template is immutable and renders the same text for the same arguments, so the generated kernels
are unchanged; only the parsing is skipped. Installed the first time specgraph configures
Inductor (:func:`specgraph.compiler.inductor_settings`); a torch without that function is left
as it is.
"""
from __future__ import annotations

import functools

CACHE_SIZE = 512  # distinct template sources; a build uses a few dozen


def memoize_kernel_templates() -> bool:
    """Make ``KernelTemplate._template_from_string`` return one compiled template per source.
    Idempotent; returns whether the memo is in place."""
    try:
        from torch._inductor.codegen.common import KernelTemplate
    except ImportError:
        return False
    current = KernelTemplate.__dict__.get("_template_from_string")
    if not isinstance(current, staticmethod):
        return False
    if getattr(current.__func__, "specgraph_memo", False):
        return True
    memo = functools.lru_cache(maxsize=CACHE_SIZE)(current.__func__)
    memo.specgraph_memo = True
    KernelTemplate._template_from_string = staticmethod(memo)
    return True
