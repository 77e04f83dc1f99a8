"""The tools of an OpenEnv MCP environment as agent-r1 ``Tool`` s, and their results as text."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from agent_r1.envs.ecosystem.openenv.text import as_text
from agent_r1.tools import Tool

__all__ = ["OpenEnvTool", "ToolCaller", "tool_failed", "tool_text"]


class ToolCaller(Protocol):
    """What an ``OpenEnvTool`` runs its calls through: the env whose session the tool belongs to
    (``agent_r1.envs.ecosystem.openenv.env.OpenEnvEnv``). The env builds its tools and so imports this
    module; naming the env by this protocol keeps the import one way."""

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> str: ...


class OpenEnvTool(Tool):
    """One tool of an OpenEnv MCP environment; a call is a ``CallToolAction`` step of its session."""

    def __init__(
        self, name: str, description: str, input_schema: Mapping[str, Any], owner: ToolCaller
    ) -> None:
        super().__init__(
            name, description, dict(input_schema or {"type": "object", "properties": {}}), timeout=None
        )
        self.owner = owner  # the session enforces timeout_s

    async def run(self, arguments: dict[str, Any]) -> Any:
        return await self.owner.call_tool(self.name, arguments)


def tool_text(result: Any) -> str:
    """A tool result as text: MCP content's text parts, else its data, else the value itself."""
    if result is None:
        return ""
    content = result.get("content") if isinstance(result, Mapping) else getattr(result, "content", None)
    if isinstance(content, list):
        texts = [c.get("text") if isinstance(c, Mapping) else getattr(c, "text", None) for c in content]
        if texts and all(isinstance(t, str) for t in texts):
            return "\n".join(texts)
    data = result.get("data") if isinstance(result, Mapping) else getattr(result, "data", None)
    return as_text(data if data is not None else result)


def tool_failed(result: Any) -> bool:
    return bool(result.get("is_error") if isinstance(result, Mapping) else getattr(result, "is_error", False))
