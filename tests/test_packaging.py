"""The wheel ships the whole package: ``pyproject.toml`` lists every package of the source tree
(folders with an ``__init__.py`` under ``specgraph/``, and ``passes/`` and ``kernels/``, which ship
inside the ``specgraph`` namespace), and the data files it names exist. A package left off the
list is missing from a non-editable install, where ``import specgraph`` then fails; ``.ci/run``
builds the wheel, installs it into a fresh venv and runs ``scripts/wheel_smoke.py`` there."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parent.parent


def setuptools_table(root: Path = ROOT) -> dict:
    return tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]


def packages_in_tree(root: Path, package_dir: dict) -> set[str]:
    """Every importable package of the source tree: each folder holding an ``__init__.py``,
    named by where it installs (``package_dir`` maps package names to source folders)."""
    found = set()
    for name, folder in {"specgraph": "specgraph", **package_dir}.items():
        base = root / folder
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base).parts
            if "__pycache__" not in rel:
                found.add(".".join((name, *rel)))
    return found


def listed_packages(table: dict) -> set[str]:
    return set(table["packages"])


def test_every_package_of_the_tree_is_listed():
    table = setuptools_table()
    assert listed_packages(table) == packages_in_tree(ROOT, table.get("package-dir", {}))


def test_a_package_missing_from_the_list_is_caught(tmp_path):
    """Negative control: a tree with one more package than the list fails the comparison."""
    table = setuptools_table()
    for pkg in packages_in_tree(ROOT, {}):
        (tmp_path / Path(*pkg.split("."))).mkdir(parents=True, exist_ok=True)
        (tmp_path / Path(*pkg.split(".")) / "__init__.py").touch()
    (tmp_path / "specgraph" / "newdrafters").mkdir()
    (tmp_path / "specgraph" / "newdrafters" / "__init__.py").touch()
    assert listed_packages(table) != packages_in_tree(tmp_path, {})


def test_package_data_exists():
    data = setuptools_table().get("package-data", {})
    for pkg, patterns in data.items():
        folder = ROOT / Path(*pkg.split("."))
        for pattern in patterns:
            assert list(folder.glob(pattern)), f"{pkg}: no file matches {pattern!r}"
