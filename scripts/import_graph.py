"""The project's import graph: its cycles, and the imports that break the layering.

Every ``.py`` under the folders that setup.py / pyproject.toml map onto packages
(``learner/`` installs as ``asyncrl.learner``, and so on) is parsed with :mod:`ast`,
without importing anything. An edge is any ``import`` or ``from ... import`` of a
project module, wherever it stands (inside functions too): a function-level import
hides a cycle from the interpreter, not from the design. The only imports left out
are those under ``if TYPE_CHECKING:``, which never run (except in a package that
hands out its names lazily, through a module ``__getattr__``: there they say what
it will import).

Run by hand from the repository root::

    python scripts/import_graph.py          # cycles, then layer violations; exit 1 if any

The layers are declared here (:data:`LAYERS`), as package prefixes: a module belongs
to the layer of the folder it is in. ``tests/unit/core/test_import_graph.py`` checks
them.
"""

from __future__ import annotations

import ast
import sys
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def package_dirs(root: Path = ROOT) -> dict[str, Path]:
    """``{package: folder}``: pyproject's ``[tool.setuptools] package-dir``, else the
    string-to-string dict literals of setup.py whose values are folders of ``root``
    (its ``MAPPED``), else the ``asyncrl`` folder alone."""
    pyproject = tomllib.loads((root / "pyproject.toml").read_text())
    declared = pyproject.get("tool", {}).get("setuptools", {}).get("package-dir", {})
    mapping = {package: root / folder for package, folder in declared.items() if package}
    setup_py = root / "setup.py"
    if not mapping and setup_py.is_file():
        for node in ast.walk(ast.parse(setup_py.read_text())):
            if isinstance(node, ast.Dict) and node.keys:
                pairs = [
                    (key.value, value.value)
                    for key, value in zip(node.keys, node.values, strict=True)
                    if isinstance(key, ast.Constant) and isinstance(value, ast.Constant)
                ]
                if len(pairs) == len(node.keys) and all(
                    isinstance(folder, str) and (root / folder).is_dir() for _, folder in pairs
                ):
                    mapping.update({package: root / folder for package, folder in pairs})
    return mapping or {"asyncrl": root / "asyncrl"}


def module_files(mapping: Mapping[str, Path]) -> dict[str, Path]:
    """``{dotted module name: file}`` for every ``.py`` under the mapped folders; a
    folder mapped to a package of its own (``generators/``) is not also counted as a
    subpackage of the folder it sits in."""
    claimed = {folder.resolve() for folder in mapping.values()}
    modules: dict[str, Path] = {}
    for package, folder in mapping.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if any(parent.resolve() in claimed for parent in _parents_between(path, folder)):
                continue  # under another mapped folder (none today; kept for safety)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


def _parents_between(path: Path, folder: Path) -> list[Path]:
    """The folders strictly between ``folder`` and ``path``."""
    return [p for p in path.parents if p != folder and folder in p.parents]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.Module) -> Iterable[ast.Import | ast.ImportFrom]:
    """Every import statement, skipping the bodies of ``if TYPE_CHECKING:`` (their
    ``else:`` branches run, and count).

    Except in a module with a module-level ``__getattr__`` (a package that imports its
    names on first use): there the ``TYPE_CHECKING`` imports name what ``__getattr__``
    will import, so they count."""
    lazy = any(
        isinstance(node, ast.FunctionDef) and node.name == "__getattr__" for node in tree.body
    )
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test) and not lazy:
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute name ``from <here> import ...`` refers to."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def imported_modules(module: str, path: Path, known: Iterable[str]) -> set[str]:
    """The project modules ``module`` imports: ``import a.b`` gives ``a.b``, ``from a
    import b`` gives ``a.b`` when that is a module and ``a`` otherwise."""
    known = set(known)
    found: set[str] = set()
    is_package = path.name == "__init__.py"
    for node in _imports(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            source = _absolute(module, is_package, node)
            targets = [
                f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source
                for alias in node.names
            ]
        for target in targets:
            while target and target not in known:  # ``import a.b.c`` of a name in a.b
                target = target.rpartition(".")[0]
            if target and target != module:
                found.add(target)
    return found


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """``{module: the project modules it imports}``."""
    files = module_files(package_dirs(root))
    return {name: imported_modules(name, path, files) for name, path in files.items()}


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """Import cycles as chains ``[a, b, c, a]``, each step an import: for every import
    that lies on a cycle, the shortest cycle through it, each cycle listed once. So
    every edge to cut shows, not only one loop per tangle."""
    found: dict[tuple[str, ...], list[str]] = {}
    for component in _tangles(graph):
        for module in sorted(component):
            for target in sorted(graph[module] & component):
                back = _shortest_path(graph, target, module, component)
                loop = [module, *back]
                turn = loop.index(min(loop[:-1]))  # one rotation per cycle
                key = tuple(loop[turn:-1] + loop[:turn])
                found.setdefault(key, [*key, key[0]])
    return sorted(found.values())


def _tangles(graph: Mapping[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[set[str]] = []

    def enter(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        work.append((node, iter(sorted(graph.get(node, ())))))

    for start in sorted(graph):
        if start in index:
            continue
        work: list = []
        enter(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while (member := stack.pop()) != node:
                        on_stack.discard(member)
                        component.add(member)
                    on_stack.discard(node)
                    component.add(node)
                    if len(component) > 1:
                        components.append(component)
            elif child not in index:
                enter(child)
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return components


def _shortest_path(
    graph: Mapping[str, set[str]], start: str, end: str, within: set[str]
) -> list[str]:
    """The modules from ``start`` to ``end`` along imports inside ``within``, both ends
    included (breadth first)."""
    previous: dict[str, str] = {start: start}
    frontier = [start]
    while end not in previous:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & within):
                if child not in previous:
                    previous[child] = node
                    following.append(child)
        if not following:
            raise AssertionError(f"no path from {start} to {end}")
        frontier = following
    chain = [end]
    while chain[-1] != start:
        chain.append(previous[chain[-1]])
    return chain[::-1]


@dataclass(frozen=True)
class Layer:
    """Modules (a name, or a prefix ending in ``.``) that import only from the layers
    below them and from themselves."""

    name: str
    modules: tuple[str, ...]


def package(name: str) -> tuple[str, str]:
    """A package and every module in it."""
    return (name, f"{name}.")


ROLES = ["asyncrl.learner", "asyncrl.generators", "asyncrl.buffer"]
"""Packages that run as separate processes and talk only through messages."""

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
    Layer("roles", tuple(name for role in ROLES for name in package(role))),
    # the command line, the launcher, Ray, supervision; the multi-host test bed
    Layer("run", ("asyncrl.__main__", *package("asyncrl.run"), *package("asyncrl.testbed"))),
]
"""Each layer's modules: a name, or a prefix ending in ``.`` for a package's modules."""


def layer_of(module: str, layers: Iterable[Layer]) -> int | None:
    """The position of the most specific layer holding ``module``: an exact name beats
    a prefix, a longer prefix a shorter one."""
    best: tuple[int, int] | None = None
    for position, layer in enumerate(layers):
        for pattern in layer.modules:
            exact = module == pattern
            if exact or (pattern.endswith(".") and module.startswith(pattern)):
                rank = 10_000 if exact else len(pattern)
                if best is None or rank > best[0]:
                    best = (rank, position)
    return None if best is None else best[1]


def layer_violations(graph: Mapping[str, set[str]], layers: list[Layer]) -> list[str]:
    """``a (layer) imports b (higher layer)`` for each import that goes up."""
    found = []
    for module in sorted(graph):
        mine = layer_of(module, layers)
        for target in sorted(graph[module]):
            theirs = layer_of(target, layers)
            if mine is not None and theirs is not None and theirs > mine:
                found.append(
                    f"{module} ({layers[mine].name}) imports {target} ({layers[theirs].name})"
                )
    return found


def role_violations(graph: Mapping[str, set[str]], roles: Iterable[str]) -> list[str]:
    """``a imports b`` for each import from one role's package into another's."""
    roles = list(roles)

    def role(module: str) -> str | None:
        return next((r for r in roles if module == r or module.startswith(r + ".")), None)

    return [
        f"{module} imports {target}"
        for module in sorted(graph)
        for target in sorted(graph[module])
        if role(module) and role(target) and role(module) != role(target)
    ]


def main() -> int:
    graph = import_graph()
    problems = 0
    for chain in cycles(graph):
        print("cycle:", " -> ".join(chain))
        problems += 1
    for line in layer_violations(graph, LAYERS) + role_violations(graph, ROLES):
        print("layering:", line)
        problems += 1
    for module in sorted(graph):
        if layer_of(module, LAYERS) is None:
            print("no layer:", module)
            problems += 1
    print(f"{len(graph)} modules, {sum(map(len, graph.values()))} imports, {problems} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
