"""What an OpenEnv environment's classes declare, and the entry points a config names them by."""

from __future__ import annotations

import contextlib
import inspect
import sys
import typing
from collections.abc import Callable, Mapping
from typing import Any

from agent_r1.envs.ecosystem import require
from agent_r1.envs.registry import load_entry_point

__all__ = ["HOOK", "accepted", "declared_action_class", "openenv_core", "resolve", "text_field"]

HOOK = "a callable or a 'module:function' entry point"


def openenv_core(what: str = "the OpenEnv adapter (env.name: openenv)") -> Any:
    """``openenv.core``, or one error naming the extra that installs it."""
    return require("openenv.core", "openenv", what)


def text_field(action_schema: Mapping[str, Any], action_name: str) -> str:
    """The Action field the response text goes to by default: its one string field (the one required
    string field if there are several string fields); else a ValueError saying to set ``parse_action``."""
    properties = {k: v for k, v in action_schema.get("properties", {}).items() if k != "metadata"}
    strings = [name for name, prop in properties.items() if prop.get("type") == "string"]
    required = [name for name in strings if name in action_schema.get("required", ())]
    for candidates in (strings, required):
        if len(candidates) == 1:
            return candidates[0]
    raise ValueError(
        f"OpenEnv action {action_name} has fields {sorted(properties)}, not one string field the "
        f"response text could fill; set env.kwargs.parse_action to {HOOK} turning the response "
        "text into the action (an Action instance or a dict of its fields)"
    )


def declared_action_class(cls: type, base: type) -> type | None:
    """The Action class ``cls`` declares: ``base[MyAction, ...]`` among its bases (an Environment or
    EnvClient subclass), else the annotation of its ``step``'s ``action`` parameter (the way
    OpenEnv's template writes it)."""
    action_base = openenv_core().Action
    for klass in cls.__mro__:
        for generic in getattr(klass, "__orig_bases__", ()):
            origin = typing.get_origin(generic)
            if isinstance(origin, type) and issubclass(origin, base):
                args = typing.get_args(generic)
                if args and isinstance(args[0], type) and issubclass(args[0], action_base):
                    return args[0]
    with contextlib.suppress(Exception):
        hint = typing.get_type_hints(cls.step).get("action")
        if isinstance(hint, type) and issubclass(hint, action_base) and hint is not action_base:
            return hint
    return None


def resolve(value: Any, kind: str) -> Any:
    """A callable or class given directly, or an entry point string from a config."""
    if isinstance(value, str):
        try:
            return load_entry_point(value)
        except ValueError as error:
            raise ValueError(f"OpenEnvEnv {kind}: {error}{_module_listing(value)}") from None
    return value


def _module_listing(entry_point: str) -> str:
    """For a missing class: the OpenEnv Environments its module does define (the available ids)."""
    module_name = entry_point.partition(":")[0]
    module = sys.modules.get(module_name)
    if module is None:
        return ""
    environment = openenv_core().Environment
    found = sorted(
        f"{module_name}:{name}"
        for name, obj in vars(module).items()
        if isinstance(obj, type) and issubclass(obj, environment) and obj.__module__ == module_name
    )
    return f"; OpenEnv Environments in {module_name!r}: {found}" if found else ""


def accepted(function: Callable[..., Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``kwargs`` less those ``function`` does not take, as OpenEnv's server filters reset kwargs."""
    parameters = inspect.signature(function).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return dict(kwargs)
    return {k: v for k, v in kwargs.items() if k in parameters}
