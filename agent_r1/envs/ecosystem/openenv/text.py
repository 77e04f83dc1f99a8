"""OpenEnv observations as the text the model reads."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from typing import Any

__all__ = ["as_text", "default_render_observation", "validation_message"]


def _fields(observation: Any) -> dict[str, Any]:
    """An observation's own fields: a pydantic model's or a dict's, less reward, done and metadata."""
    if hasattr(observation, "model_dump"):
        data = observation.model_dump()
    elif isinstance(observation, Mapping):
        data = dict(observation)
    else:
        return {"observation": observation}
    return {k: v for k, v in data.items() if k not in ("reward", "done", "metadata")}


def as_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)


def default_render_observation(observation: Any) -> str:
    """The default observation -> text hook: the observation's fields without ``reward``, ``done``
    and ``metadata``; a single field as its value, several as ``name: value`` lines, none as "".

    ``observation`` is what OpenEnv hands over: the environment's typed Observation in-process, the
    client's parsed observation when served (typed with a typed ``client``, a dict with OpenEnv's
    ``GenericEnvClient``). OpenEnv's server does not send ``metadata``.
    """
    fields = _fields(observation)
    if len(fields) == 1:
        return as_text(next(iter(fields.values())))
    return "\n".join(f"{name}: {as_text(value)}" for name, value in fields.items())


def validation_message(error: Exception) -> str:
    """A pydantic ValidationError in one line (``field: message; ...``), any other error as is."""
    errors = getattr(error, "errors", None)
    if callable(errors):
        with contextlib.suppress(Exception):
            return "; ".join(
                f"{'.'.join(str(p) for p in e.get('loc', ())) or 'action'}: {e.get('msg', '')}"
                for e in errors()
            )
    return str(error)
