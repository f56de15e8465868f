"""specgraph.templates: Inductor's kernel templates compiled once per source, rendering what a
fresh compile renders."""
from __future__ import annotations

import jinja2
import pytest

from specgraph.compiler import inductor_settings
from specgraph.templates import memoize_kernel_templates

common = pytest.importorskip("torch._inductor.codegen.common")

SOURCE = "{% for i in range(n) %}{{ name }}[{{ i }}] = {{ i * scale }};\n{% endfor %}"


def test_configuring_inductor_memoizes_templates():
    import torch

    inductor_settings(torch.device("cpu"), freeze=True, autotune=True)
    make = common.KernelTemplate._template_from_string
    assert make(SOURCE) is make(SOURCE)
    assert make(SOURCE) is not make(SOURCE + " ")  # one template per source
    assert memoize_kernel_templates()  # idempotent
    assert common.KernelTemplate._template_from_string is make


def test_memoized_template_renders_as_a_fresh_compile():
    memoize_kernel_templates()
    make = common.KernelTemplate._template_from_string
    fresh = jinja2.Environment(undefined=jinja2.StrictUndefined).from_string(SOURCE)
    for args in (dict(n=3, name="acc", scale=2), dict(n=5, name="out", scale=-1)):
        assert make(SOURCE).render(**args) == fresh.render(**args)
    with pytest.raises(jinja2.UndefinedError):  # the environment's strictness is kept
        make(SOURCE).render(n=2)
    # Inductor's own filter is still registered on the memoized template's environment
    assert make("{{ x|indent_except_first(1) }}").render(x="a\nb") == "a\n    b"
