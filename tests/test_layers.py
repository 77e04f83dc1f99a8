"""The package layout is the architecture (docs/training.md): each package imports only packages
below it, so there is no upward import and no package loop, and only ``distributed/`` imports Ray."""

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


def _imports(path: Path) -> list[tuple[str, int]]:
    """Every module ``path`` imports (at the top or inside a function), with its line."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.module, node.lineno))
    return out


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
