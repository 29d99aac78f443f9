"""The repository's scripts (``benchmarks/``, ``scripts/``), imported by file.

Those folders are not packages: run by hand, a script finds its neighbours (``import
common``) because its own folder heads the import path. Here each file is imported
by its path instead, under its bare name, after the neighbours it imports, so that
``import common`` inside it finds the module already imported.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"
SCRIPTS = REPO / "scripts"


def load(path: Path, name: str | None = None) -> ModuleType:
    """The file at ``path`` as module ``name`` (its stem by default), imported once: it is
    registered in ``sys.modules`` (as an import would, for its dataclasses and for
    ``from name import ...`` in code it runs), and a second call returns it."""
    name = name or path.stem
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        for neighbour in neighbours(path):
            load(neighbour)
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def neighbours(path: Path) -> list[Path]:
    """The files beside ``path`` that it imports by bare name, anywhere in it."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return [path.with_name(f"{n}.py") for n in sorted(names) if path.with_name(f"{n}.py").is_file()]


def benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py``, as the module ``name``."""
    return load(BENCHMARKS / f"{name}.py")


def script(name: str) -> ModuleType:
    """``scripts/<name>.py``, as the module ``name``."""
    return load(SCRIPTS / f"{name}.py")
