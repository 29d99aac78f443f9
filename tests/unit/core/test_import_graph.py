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

A module may import its own layer and those below it. The layers are package
prefixes declared in ``scripts/import_graph.py`` (``LAYERS``): a new module joins the
layer of the folder it is created in.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers.scripts import script

ROOT = Path(__file__).resolve().parents[3]


_script = script("import_graph")
Layer, cycles, import_graph = _script.Layer, _script.cycles, _script.import_graph
imported_modules, layer_of = _script.imported_modules, _script.layer_of
layer_violations, role_violations = _script.layer_violations, _script.role_violations
module_files, package_dirs = _script.module_files, _script.package_dirs
LAYERS, ROLES = _script.LAYERS, _script.ROLES


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
        "Add each to LAYERS in scripts/import_graph.py"
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
