"""Imports flow one way: core math <- engine <- drafters <- policy <- API <- serving <- export / runtime / CLI.

Every ``specgraph`` module is assigned a layer; a module may import its own layer and the layers
below. The engine reaches its drafters through the interface it defines (``specgraph.proposal``)
and its depth policy through the object it is given, so nothing goes the other way: the test
fails on any upward import, on an import cycle, and on importing another module's ``_private``
name. The negative controls feed the checker a synthetic upward import and a private import.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "specgraph"

LAYERS = [
    ("core", {"warping", "trees", "verify", "capture", "freezing", "artifacts", "models", "perfmodel", "graphset", "rounds",
              "processors", "generation", "templates", "lookup", "packing", "limits", "precision", "gguf_weights",
              "kernels", "passes"}),
    ("engine", {"compiler", "callrows", "eager", "loop", "packages", "proposal", "timing", "grammar"}),
    ("drafters", {"drafters", "suffix", "heads", "learned", "proposers"}),
    ("policy", {"adaptive", "planner"}),
    ("api", {"api", "graphcache", "buildworker"}),
    ("serve", {"serving"}),  # the specgraph.serving package, as one module
    ("export", {"aot", "onnx_export", "onnx", "cli", "train"}),
]
LEVEL = {m: i for i, (_, mods) in enumerate(LAYERS) for m in mods}


def imports_of(source: str) -> tuple[set, set]:
    """(specgraph modules imported, private names imported as module.name) of one module's source."""
    mods, private = set(), set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "specgraph":
            parts = node.module.split(".")
            if len(parts) > 1:
                mods.add(parts[1])
                private |= {f"{parts[1]}.{a.name}" for a in node.names if a.name.startswith("_") and not a.name.startswith("__")}
            else:
                mods |= {a.name for a in node.names if a.name in LEVEL}
        elif isinstance(node, ast.Import):
            mods |= {a.name.split(".")[1] for a in node.names if a.name.startswith("specgraph.")}
    return mods, private


def violations(graph: dict) -> tuple[set, set]:
    """(upward edges, private imports) of ``graph`` {module: (imports, private names)}."""
    upward = {(m, d) for m, (deps, _) in graph.items() for d in deps if d in LEVEL and LEVEL[d] > LEVEL[m]}
    private = {(m, p) for m, (_, names) in graph.items() for p in names}
    return upward, private


def module_graph() -> dict:
    graph = {p.stem: imports_of(p.read_text()) for p in sorted(SRC.glob("*.py")) if p.stem != "__init__"}
    for package in ("serving", "proposers"):  # a package: one node, its files' imports together
        mods, private = set(), set()
        for p in sorted((SRC / package).glob("*.py")):
            m, pv = imports_of(p.read_text())
            mods |= m - {package}
            private |= {x for x in pv if not x.startswith(f"{package}.")}
        graph[package] = (mods, private)
    return graph


def test_every_module_has_a_layer():
    assert sorted(set(module_graph()) - set(LEVEL)) == []


def test_imports_flow_one_way():
    upward, private = violations(module_graph())
    assert upward == set(), "imports against the layer order"
    assert private == set(), "imports of another module's private names"


def test_no_import_cycle():
    graph = {m: {d for d in deps if d in LEVEL} for m, (deps, _) in module_graph().items()}
    seen, stack = set(), []

    def visit(m):
        if m in stack:
            pytest.fail(f"import cycle: {' -> '.join(stack[stack.index(m):] + [m])}")
        if m in seen:
            return
        stack.append(m)
        for d in graph.get(m, ()):
            visit(d)
        stack.pop()
        seen.add(m)

    for m in graph:
        visit(m)


@pytest.mark.parametrize("source, kind", [
    ("from specgraph.cli import main", "upward"),          # the engine reaching the CLI
    ("from specgraph.compiler import _dense", "private"),  # another module's private name
])
def test_the_checker_sees_a_violation(source, kind):
    graph = module_graph()
    graph["verify"] = imports_of(source)
    upward, private = violations(graph)
    if kind == "upward":
        assert ("verify", "cli") in upward
    else:
        assert ("verify", "compiler._dense") in private
