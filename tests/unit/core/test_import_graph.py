"""The project's modules import each other without cycles, and only downwards.

The graph comes from ``scripts/import_graph.py`` (``ast``, the setup.py /
pyproject package-dir mapping, imports inside functions included, only
``if TYPE_CHECKING:`` left out). The layers, bottom first:

- core: what every process needs and nothing else: the config schema, messages,
  transport, security, paths, weights;
- generation: what a generator runs: tasks, prompt data, rewards, environments, models;
- roles: ``asyncrl.learner``, ``asyncrl.generators``, ``asyncrl.buffer``, which never
  import one another;
- run: what starts and watches the roles: the command line, the launcher, Ray,
  the console and status.

A module may import its own layer and those below it. A new module belongs in
one of them: add it to :data:`LAYERS`.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _import_graph_script():
    """``scripts/import_graph.py`` (not a package), imported by its path. By hand, not
    through ``tests.helpers``: the script imports this module in turn, from a process
    where only ``tests/unit/core/`` is on the import path."""
    if "import_graph" in sys.modules:
        return sys.modules["import_graph"]
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts/import_graph.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # before it runs: its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


_script = _import_graph_script()
Layer, cycles, import_graph = _script.Layer, _script.cycles, _script.import_graph
imported_modules, layer_of = _script.imported_modules, _script.layer_of
layer_violations, role_violations = _script.layer_violations, _script.role_violations
module_files, package_dirs = _script.module_files, _script.package_dirs


def package(name: str) -> tuple[str, str]:
    """A package and every module in it."""
    return (name, f"{name}.")


LAYERS = [
    # the wire, sockets, keys, the config schema and the weight paths
    Layer(
        "core",
        (
            "asyncrl",
            *package("asyncrl.core"),
            *package("asyncrl.config"),
            *package("asyncrl.weights"),
        ),
    ),
    # prompts, rewards, environments and the sandbox, models
    Layer("generation", package("asyncrl.generation")),
    Layer("roles", ("asyncrl.learner", "asyncrl.generators", "asyncrl.buffer")),
    # the command line, the launcher, Ray, supervision; the multi-host test bed
    Layer("run", ("asyncrl.__main__", *package("asyncrl.run"), *package("asyncrl.testbed"))),
]
"""Each layer's modules: a name, or a prefix ending in ``.`` for a package's modules."""

ROLES = ["asyncrl.learner", "asyncrl.generators", "asyncrl.buffer"]
"""Packages that run as separate processes and talk only through messages."""

# the roles' modules: the packages' own prefixes, beside their __init__ names above
LAYERS[2] = Layer("roles", (*LAYERS[2].modules, *(f"{role}." for role in ROLES)))


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(ROOT)


def test_the_deployment_folders_map_onto_asyncrl_subpackages():
    mapping = package_dirs(ROOT)
    assert mapping["asyncrl.learner"] == ROOT / "learner"
    files = module_files(mapping)
    assert files["asyncrl.generators.worker"] == ROOT / "generators" / "worker.py"
    envs = ROOT / "asyncrl" / "generation" / "envs"
    assert files["asyncrl.generation.envs"] == envs / "__init__.py"
    assert not any(name.startswith(("learner", "generators", "buffer")) for name in files)


def test_function_level_imports_count_and_type_checking_ones_do_not(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    for name in ("a", "b", "c", "d", "sub/__init__", "sub/e", "sub/f"):
        (package / f"{name}.py").write_text("")
    source = package / "sub" / "e.py"
    source.write_text(
        textwrap.dedent(
            """
            from typing import TYPE_CHECKING
            import os
            if TYPE_CHECKING:
                from pkg import a
            else:
                from pkg import b
            def later():
                from pkg.c import something
            from . import f
            from .. import d
            import pkg.sub.f.not_a_module
            """
        )
    )
    known = module_files({"pkg": package})
    assert imported_modules("pkg.sub.e", source, known) == {"pkg.b", "pkg.c", "pkg.sub.f", "pkg.d"}


def test_cycles_are_reported_as_chains_one_per_import_on_them():
    graph = {"a": {"b"}, "b": {"c", "a"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "a"], ["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles(graph):
    found = cycles(graph)
    assert not found, "import cycles (cut one import in each):\n" + "\n".join(
        " -> ".join(chain) for chain in found
    )


def test_every_module_has_a_layer(graph):
    unplaced = sorted(module for module in graph if layer_of(module, LAYERS) is None)
    assert not unplaced, (
        f"modules in no layer: {', '.join(unplaced)}. "
        "Add each to LAYERS in tests/unit/core/test_import_graph.py"
    )


def test_no_module_imports_from_a_layer_above_its_own(graph):
    found = layer_violations(graph, LAYERS)
    assert not found, "imports that go up a layer:\n" + "\n".join(found)


def test_the_roles_never_import_one_another(graph):
    found = role_violations(graph, ROLES)
    assert not found, "imports between roles (they talk through messages):\n" + "\n".join(found)


def test_layer_violations_name_both_ends():
    layers = [Layer("low", ("x",)), Layer("high", ("y", "y."))]
    assert layer_violations({"x": {"y.z"}, "y.z": {"x"}}, layers) == ["x (low) imports y.z (high)"]
    assert role_violations({"r.a": {"s.b", "r.c"}}, ["r", "s"]) == ["r.a imports s.b"]


def test_importing_the_config_schema_loads_no_sandbox_rewards_or_environments():
    code = (
        "import sys, asyncrl.config; "
        "print(sorted(m for m in sys.modules if m.startswith('asyncrl.generation')))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert result.stdout.strip() == "[]"


def test_the_script_run_by_hand_finds_the_same_clean_graph():
    """``python scripts/import_graph.py``: what a contributor runs to see the problems
    (it reads the layers from this file, wherever the tests live)."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "import_graph.py")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().endswith(" 0 problems")
