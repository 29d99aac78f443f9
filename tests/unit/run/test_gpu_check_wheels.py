"""The GPU check finds every third-party module it imports on the GPU machine, which has no
registry: each is preinstalled there (``gpu_machine_packages.txt``, copied from the
machine's description) or among the wheels ``scripts/gpu_wheels.sh`` makes, and each
carried wheel's own requirements are met the same way (pip installs them ``--no-deps``).

Static: the imports are read with :mod:`ast`, nothing is imported or downloaded. The
check's code is its modules under ``benchmarks/``, ``tests/gpu/`` and what they import
from the repository, and the modules the processes it starts run (:data:`ENTRY_POINTS`:
``asyncrl launch``, each role, the reward workers). In those files every import counts,
inside functions too; in the package's modules only what runs when they are imported
(an import inside a function is an optional feature: aim, Ray, vLLM). The CPU rehearsal
of ``scripts/gpu_check.sh`` (docs/benchmarks.md) runs the rest.
"""

from __future__ import annotations

import ast
import re
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.helpers.scripts import script

ROOT = Path(__file__).resolve().parents[3]
_graph = script("import_graph")
module_files, package_dirs = _graph.module_files, _graph.package_dirs

PACKAGES = Path(__file__).with_name("gpu_machine_packages.txt")
WHEELS_SCRIPT = ROOT / "scripts" / "gpu_wheels.sh"
CHECK_FILES = [
    *sorted((ROOT / "benchmarks").glob("gpu_*.py")),
    *sorted((ROOT / "tests" / "gpu").glob("*.py")),
]
ENTRY_POINTS = [
    "asyncrl.run.cli",  # asyncrl launch
    "asyncrl.run.roles",  # each role process, which runs one of:
    "asyncrl.buffer.main",
    "asyncrl.learner.trainer",
    "asyncrl.generators.main",
    "asyncrl.generation.rewards.worker",  # the reward workers (python -c)
]
"""The modules the processes the check starts run as their main."""
GPU_PYTHON = {  # the machine's interpreter, for the wheels' requirement markers
    "python_version": "3.12", "python_full_version": "3.12.3", "os_name": "posix",
    "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
    "platform_python_implementation": "CPython", "implementation_name": "cpython", "extra": "",
}  # fmt: skip
SCRIPT_FOLDERS = [ROOT / "benchmarks"]
"""Folders whose scripts import each other by bare name (``gpu_check.py`` puts its own on
the import path): their modules are the repository's, not third-party."""
TEST_MODULES = {
    ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): path
    for path in sorted((ROOT / "tests").rglob("*.py"))
}
"""``{tests.gpu.test_x: its file}``: the test package, the repository's too."""


def preinstalled() -> dict[str, Version | None]:
    """``{distribution: version or None}`` of the GPU machine."""
    found = {}
    for line in PACKAGES.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            found[canonicalize_name(name)] = Version(version) if version else None
    return found


def carried(script: Path = WHEELS_SCRIPT) -> dict[str, Version]:
    """``{distribution: version}`` of every ``"NAME==VERSION"`` in the wheel script."""
    pins = re.findall(r'^\s*"([A-Za-z0-9_.-]+)==([^"\s]+)"\s*$', script.read_text(), re.M)
    return {canonicalize_name(name): Version(version) for name, version in pins}


def executed_imports(tree: ast.Module, everywhere: bool) -> list[ast.Import | ast.ImportFrom]:
    """Imports that run when the module is imported (``everywhere``: in functions too);
    never those under ``if TYPE_CHECKING:``."""
    found, stack = [], list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        elif isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            stack.extend(node.orelse)
        elif everywhere or not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            stack.extend(ast.iter_child_nodes(node))
    return found


def third_party_imports(files: list[Path], entry_points: list[str]) -> dict[str, set[str]]:
    """``{top-level module: the files that import it}``, following the repository's modules
    from ``files`` (all their imports) and ``entry_points`` (as imported)."""
    package = module_files(package_dirs())
    scripts = {p.stem: p for folder in SCRIPT_FOLDERS for p in folder.glob("*.py")}
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    todo = [(path, True) for path in files] + [(package[name], False) for name in entry_points]
    seen: set[Path] = set()
    found: dict[str, set[str]] = {}
    while todo:
        path, everywhere = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for node in executed_imports(ast.parse(path.read_text()), everywhere):
            if isinstance(node, ast.ImportFrom) and node.level:
                continue  # relative: the repository's own (the package imports absolutely)
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [
                node.module or "", *(f"{node.module}.{a.name}" for a in node.names)
            ]  # fmt: skip
            for name in names:
                top = name.split(".")[0]
                if name in package:
                    todo.append((package[name], False))
                elif name in TEST_MODULES:
                    todo.append((TEST_MODULES[name], True))
                elif top in scripts:
                    todo.append((scripts[top], True))
                elif top not in stdlib and top not in ("asyncrl", "tests"):
                    found.setdefault(top, set()).add(shown(path))
    return found


def shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def distributions_of(modules: dict[str, set[str]]) -> dict[str, str]:
    """``{module: its distribution}``, as installed here (the suite's environment has every
    module the check imports)."""
    installed = metadata.packages_distributions()
    unknown = sorted(m for m in modules if m not in installed)
    assert not unknown, f"no installed distribution provides {unknown}, imported by " + str(
        {m: sorted(modules[m]) for m in unknown}
    )
    return {m: canonicalize_name(installed[m][0]) for m in modules}


def missing_on_the_gpu_machine(files: list[Path], entry_points: list[str]) -> dict[str, list]:
    """``{distribution: files importing it}`` for what is neither preinstalled nor carried."""
    modules = third_party_imports(files, entry_points)
    there = set(preinstalled()) | set(carried())
    missing: dict[str, list] = {}
    for module, distribution in distributions_of(modules).items():
        if distribution not in there:
            missing.setdefault(distribution, []).extend(sorted(modules[module]))
    return missing


def test_every_module_the_gpu_check_imports_is_on_the_gpu_machine_or_carried():
    missing = missing_on_the_gpu_machine(CHECK_FILES, ENTRY_POINTS)
    assert not missing, (
        f"the GPU machine lacks {missing}: add each as NAME==VERSION to scripts/gpu_wheels.sh"
    )


def test_every_carried_wheels_requirements_are_on_the_gpu_machine_or_carried_too():
    wheels, there = carried(), preinstalled()
    assert {"pyzmq", "msgspec", "pydantic"} <= set(wheels), wheels  # the script was read
    problems = []
    for name, version in wheels.items():
        try:
            requirements = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            problems.append(f"{name} is carried but not installed here: its needs are unknown")
            continue
        for text in requirements:
            need = Requirement(text)
            if need.marker is not None and not need.marker.evaluate(GPU_PYTHON):
                continue  # an extra, or for another interpreter
            wanted = canonicalize_name(need.name)
            have = wheels.get(wanted, there.get(wanted))
            if wanted not in wheels and wanted not in there:
                problems.append(f"{name} {version} needs {need}, neither carried nor there")
            elif have is not None and not need.specifier.contains(have, prereleases=True):
                problems.append(f"{name} {version} needs {need}; {wanted} {have} is what it gets")
    assert not problems, problems


def test_the_check_would_name_a_package_the_gpu_machine_lacks(tmp_path):
    check = tmp_path / "gpu_fake_check.py"  # Ray is installed here, not there, not carried
    check.write_text("import msgspec\n\ndef run():\n    import ray\n")
    assert missing_on_the_gpu_machine([check], []) == {"ray": [str(check)]}


def test_the_gpu_machine_package_list_holds_what_the_issue_names():
    there = preinstalled()
    assert there["torch"] == Version("2.11.0") and there["transformers"] == Version("5.17.0")
    assert {"numpy", "safetensors", "tokenizers", "msgpack", "uvloop", "pyarrow"} <= set(there)
    assert not {"pydantic", "pyzmq", "msgspec", "vllm", "ray"} & set(there)
