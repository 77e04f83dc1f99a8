"""The package layout is the architecture (docs/training.md): each package imports only packages
below it, so there is no upward import and no package loop, no loop of imports between modules (of
any length), and only ``distributed/`` imports Ray."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parent.parent / "agent_r1"

# Lower ranks first; a package may import only packages of a lower rank (and itself).
RANKS = {
    "types": 0,
    "tools": 1,
    "models": 1,
    "algos": 1,
    "report": 1,
    "rollout": 2,  # engines know nothing of envs
    "envs": 3,  # envs, the gateway that serves agent programs, context policies
    "flows": 4,
    "tasks": 5,
    "train": 6,
    "distributed": 7,  # reached by train/ through an entry-point string, never an import
    "commands": 8,
    "cli": 8,
    "__init__": 9,
}


def _package(path: Path) -> str:
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) > 1 else parts[0].removesuffix(".py")


def _module_name(path: Path) -> str:
    """``agent_r1/train/phases.py`` -> ``agent_r1.train.phases``; a package's ``__init__.py`` is the
    package itself."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_statements(path: Path) -> list[tuple[str, tuple[str, ...], int]]:
    """Every import in ``path`` (at the top, inside a function or under ``TYPE_CHECKING``) as the module
    it names, the names it takes from it (none for ``import a.b``) and its line; a relative import is
    made absolute."""
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    package_parts, out = package.split("."), []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(alias.name, (), node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package_parts[: len(package_parts) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            out.append((module, tuple(alias.name for alias in node.names), node.lineno))
    return out


def _imports(path: Path) -> list[tuple[str, int]]:
    """Every module ``path`` imports, with its line."""
    return [(module, line) for module, _, line in _import_statements(path)]


MODULES = sorted(PACKAGE.rglob("*.py"))


def test_every_package_has_a_rank():
    assert {_package(path) for path in MODULES} <= set(RANKS)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_a_package_imports_only_packages_below_it(path):
    package = _package(path)
    upward = [
        f"line {line}: {name}"
        for name, line in _imports(path)
        if name.startswith("agent_r1.")
        and (target := name.split(".")[1]) != package
        and RANKS[target] >= RANKS[package]
    ]
    assert not upward, f"{package}/ imports a package at or above it: {upward}"


def test_only_distributed_imports_ray():
    importers = [
        str(path.relative_to(PACKAGE))
        for path in MODULES
        if _package(path) != "distributed"
        and any(name == "ray" or name.startswith("ray.") for name, _ in _imports(path))
    ]
    assert importers == []


# Import loops that are known and being untied, each as the set of its modules. Any other loop fails
# the test, and so does an entry here whose loop is gone (delete the entry then).
def _module_graph() -> dict[str, dict[str, int]]:
    """Each module of agent_r1 -> the modules of agent_r1 it imports, with the line of an import.

    ``from agent_r1.x import y`` imports ``agent_r1.x.y`` when that is a module, else the module that
    defines ``y``: the submodule that ``agent_r1/x/__init__.py`` re-exports it from, or ``agent_r1.x``
    itself. A package's imports of its own submodules are not edges: its ``__init__`` lists names, it
    does not use them. Counted, they would close a false loop wherever a submodule takes a name that
    its package defines (``TaskSpec`` from ``agent_r1.tasks``) while the package re-exports that
    submodule. Following a re-exported name to the module that defines it keeps a real loop behind a
    re-export in the graph (``a`` takes ``B`` from ``agent_r1.x``, which has it from ``agent_r1.x.b``,
    which imports ``a``)."""
    paths = {_module_name(path): path for path in MODULES}
    reexports = {  # package -> {name: the submodule its __init__ imports the name from}
        package: {
            name: module
            for module, names, _ in _import_statements(path)
            if module.startswith(package + ".") and module in paths
            for name in names
        }
        for package, path in paths.items()
        if path.name == "__init__.py"
    }

    def defining_module(module: str, name: str) -> str:
        while f"{module}.{name}" not in paths and name in reexports.get(module, {}):
            module = reexports[module][name]
        return f"{module}.{name}" if f"{module}.{name}" in paths else module

    graph: dict[str, dict[str, int]] = {}
    for importer, path in paths.items():
        edges = graph.setdefault(importer, {})
        for module, names, line in _import_statements(path):
            if module not in paths:  # not agent_r1
                continue
            for target in [defining_module(module, name) for name in names] or [module]:
                own_submodule = path.name == "__init__.py" and target.startswith(importer + ".")
                if target != importer and not own_submodule:
                    edges.setdefault(target, line)
    return graph


def _import_cycles() -> dict[frozenset[str], list[str]]:
    """Each set of modules that import one another in a loop (any length; a strongly connected
    component of the import graph), with its imports written ``a -> b (line n)``."""
    graph = _module_graph()
    reach = {}
    for start in graph:
        seen, todo = set(), [start]
        while todo:
            for target in graph[todo.pop()]:
                if target not in seen:
                    seen.add(target)
                    todo.append(target)
        reach[start] = seen
    cycles = {frozenset({m} | {n for n in reach[m] if m in reach[n]}) for m in graph if m in reach[m]}
    return {
        cycle: [
            f"{a} -> {b} (line {line})"
            for a in sorted(cycle)
            for b, line in sorted(graph[a].items())
            if b in cycle
        ]
        for cycle in cycles
    }


def test_no_import_cycle_between_modules():
    cycles = _import_cycles()
    message = "\n".join(
        f"{', '.join(sorted(cycle))} import one another: " + "; ".join(edges)
        for cycle, edges in sorted(cycles.items(), key=lambda item: sorted(item[0]))
    )
    assert not cycles, f"import cycles between modules of agent_r1:\n{message}"


def test_every_distributed_backend_has_a_builder():
    import typing

    from agent_r1.train.backends import BACKENDS
    from agent_r1.train.config import DistributedConfig

    choices = typing.get_args(typing.get_type_hints(DistributedConfig)["backend"])
    assert set(BACKENDS) == set(choices)
    for kind in BACKENDS.values():  # read, not imported: the Ray builder's module imports Ray
        module, _, function = kind.build.partition(":")
        source = PACKAGE.parent / (module.replace(".", "/") + ".py")
        tree = ast.parse(source.read_text(encoding="utf-8"))
        assert function in {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}, kind.build
