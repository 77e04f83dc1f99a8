"""Registries of plain functions selected by name (one dict per concept, owned by its module).

Adding an estimator or a loss is one function and one decorator::

    @register_advantage("my_estimator")
    def my_estimator(table: StepTable, cfg: AdvantageConfig) -> AdvantageOutput: ...

and it is then available everywhere by name (``get_advantage_estimator("my_estimator")``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

__all__ = ["lookup", "registrar"]

F = TypeVar("F", bound=Callable)


def registrar(registry: dict[str, F], kind: str) -> Callable[[str], Callable[[F], F]]:
    """A ``register(name)`` decorator factory for ``registry``; a duplicate name is a ValueError."""

    def register(name: str) -> Callable[[F], F]:
        def decorate(fn: F) -> F:
            if name in registry:
                raise ValueError(f"{kind} {name!r} is already registered (by {registry[name].__qualname__})")
            registry[name] = fn
            return fn

        return decorate

    return register


def lookup(registry: dict[str, F], kind: str, name: str) -> F:
    """``registry[name]``, or a ValueError that names the available choices."""
    try:
        return registry[name]
    except KeyError:
        raise ValueError(f"unknown {kind} {name!r}; available: {', '.join(sorted(registry))}") from None
