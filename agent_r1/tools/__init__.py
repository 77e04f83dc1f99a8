"""Tools the model can call, and the formats in which it calls them.

``from agent_r1.tools import tool, Tool, ToolSet, ToolCall, ToolResult, get_format``; see docs/tools.md.
"""

from agent_r1.tools.base import Tool, ToolArgumentError, ToolCall, ToolResult, ToolSet, tool, truncate_output

__all__ = [
    "Tool",
    "ToolArgumentError",
    "ToolCall",
    "ToolResult",
    "ToolSet",
    "tool",
    "truncate_output",
]
