"""Environments by name: ``make_env("tool")`` or ``make_env("my_pkg.envs:GuessEnv", secret=7)``.

A registered factory may be a callable (a class or a function returning an ``AgentEnv``) or a lazy
entry point string ``"package.module:Attribute"`` that is imported only when the env is first made,
so registering an env costs nothing and a config file can name an env that is not registered at all.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from agent_r1.envs.base import AgentEnv

__all__ = ["available_envs", "get_env_factory", "load_entry_point", "make_env", "register_env"]

EnvFactory = Callable[..., AgentEnv]

_ENVS: dict[str, EnvFactory | str] = {}


def register_env(name: str, factory: EnvFactory | str) -> None:
    """Register ``factory`` (a callable, or a lazy ``"package.module:Attribute"``) as ``name``.

    Registering a different factory under a taken name raises; re-registering the same one is a no-op
    (modules may be imported twice).
    """
    if not name or ":" in name:
        raise ValueError(f"env name must be non-empty and contain no ':', got {name!r}")
    if isinstance(factory, str):
        _split_entry_point(factory)
    elif not callable(factory):
        raise TypeError(f"env {name!r}: factory must be callable or 'module:attr', got {factory!r}")
    if name in _ENVS and _ENVS[name] != factory:
        raise ValueError(f"env {name!r} is already registered as {_ENVS[name]!r}")
    _ENVS[name] = factory


def available_envs() -> list[str]:
    return sorted(_ENVS)


def get_env_factory(name_or_entry_point: str) -> EnvFactory:
    """The factory behind a registered name or an entry point, imported if lazy (e.g. to inspect its
    signature). Unknown names raise ``ValueError`` listing the registered envs."""
    factory = _ENVS.get(name_or_entry_point)
    if factory is None:
        if ":" not in name_or_entry_point:
            raise ValueError(
                f"unknown env {name_or_entry_point!r}; available: {available_envs()} "
                "(or give an entry point 'package.module:Class')"
            )
        factory = name_or_entry_point
    if isinstance(factory, str):
        factory = load_entry_point(factory)
        if not callable(factory):
            raise TypeError(
                f"entry point {name_or_entry_point!r} is a {type(factory).__name__}, not callable"
            )
    return factory


def make_env(name_or_entry_point: str, **kwargs: Any) -> AgentEnv:
    """A new env: a registered name, or any ``"package.module:Attribute"`` entry point.

    Unknown names raise ``ValueError`` listing the registered envs.
    """
    env = get_env_factory(name_or_entry_point)(**kwargs)
    if not isinstance(env, AgentEnv):
        raise TypeError(
            f"env {name_or_entry_point!r} built a {type(env).__name__}, which is not an agent_r1 AgentEnv"
        )
    return env


def _split_entry_point(entry_point: str) -> tuple[str, str]:
    module, sep, attribute = entry_point.partition(":")
    if not sep or not module or not attribute:
        raise ValueError(f"entry point must look like 'package.module:Attribute', got {entry_point!r}")
    return module, attribute


def load_entry_point(entry_point: str) -> Any:
    """Import ``"package.module:Attribute"`` (the attribute may be dotted) and return the object."""
    module_name, attribute = _split_entry_point(entry_point)
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"entry point {entry_point!r}: cannot import module {module_name!r}: {e}") from e
    for part in attribute.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"entry point {entry_point!r}: {module_name!r} has no attribute {attribute!r}")
        obj = getattr(obj, part)
    return obj


register_env("tool", "agent_r1.envs.tool_env:ToolEnv")
register_env("agent_program", "agent_r1.envs.agent_program:AgentProgramEnv")
register_env("gridwalk", "agent_r1.tasks.gridwalk:GridWalkEnv")
register_env("gridwalk_memory", "agent_r1.tasks.gridwalk_memory:GridMemoryEnv")
register_env("case_team", "agent_r1.tasks.case_team:CaseTeamEnv")
register_env("gymnasium", "agent_r1.envs.ecosystem.gymnasium:GymnasiumEnv")
register_env("trl_environment", "agent_r1.envs.ecosystem.trl:TRLEnvironment")
register_env("openenv", "agent_r1.envs.ecosystem.openenv:OpenEnvEnv")
register_env("textarena", "agent_r1.envs.ecosystem.textarena:TextArenaEnv")
register_env("verifiers", "agent_r1.envs.ecosystem.verifiers:VerifiersEnv")
