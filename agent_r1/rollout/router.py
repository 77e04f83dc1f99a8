"""An engine that sends each request to the engine of its role.

Several policies in one run (docs/multi_agent.md) may have roles that the local engine does not
sample: a frozen policy served by an OpenAI-compatible server (``policies.<name>.server``), a policy
with a model of its own (``policies.<name>.path``, an HF engine over it). ``RoleRouter`` sends a request whose ``SamplingParams.role`` has an engine of its own to that engine, and every other
request to the local engine. Weight updates, and every other attribute (``model``, ``sleep``,
the busy-time counters...), are the local engine's: a server's roles are not trained here, and a
policy's own HF engine shares the model its learner trains; ``close`` closes every engine, ``aclose``
the HTTP sessions of every engine on the running event loop.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from agent_r1.rollout.base import Engine, NamedTensors
from agent_r1.types import Completion, SamplingParams

__all__ = ["RoleRouter"]


class RoleRouter:
    """``local`` for every request but those of ``routes``' roles (``{role: engine}``)."""

    def __init__(self, local: Engine, routes: Mapping[str, Engine]) -> None:
        if not routes:
            raise ValueError("RoleRouter: routes must name at least one role")
        self.local, self.routes = local, dict(routes)

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Completion:
        return await self.routes.get(params.role, self.local).generate(prompt_ids, params)

    def update_weights(
        self, named_tensors: NamedTensors | Mapping[str, Any], version: int | None = None
    ) -> None:
        self.local.update_weights(named_tensors, version)

    async def aclose(self) -> None:
        """Close this event loop's HTTP sessions of every engine that holds some (``OpenAIEngine``)."""
        for engine in (self.local, *self.routes.values()):
            aclose = getattr(engine, "aclose", None)
            if aclose is not None:
                await aclose()

    def close(self) -> None:
        """Close every engine that has a ``close`` (the local one, a policy's own HF engine) once."""
        engines = {id(e): e for e in (self.local, *self.routes.values())}
        for engine in engines.values():
            close = getattr(engine, "close", None)
            if close is not None:
                close()

    @property
    def weight_version(self) -> int | None:
        return self.local.weight_version

    @weight_version.setter
    def weight_version(self, version: int | None) -> None:
        self.local.weight_version = version

    def __getattr__(self, name: str) -> Any:
        if name in ("local", "routes"):  # not set yet (copy, pickle)
            raise AttributeError(name)
        return getattr(self.local, name)
