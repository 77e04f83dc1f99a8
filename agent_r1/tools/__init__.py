"""Tools the model can call, and the formats in which it calls them.

``from agent_r1.tools import tool, Tool, ToolSet, ToolCall, ToolResult, get_format``; see docs/tools.md.
"""

from agent_r1.tools.base import Tool, ToolArgumentError, ToolCall, ToolResult, ToolSet, tool, truncate_output
from agent_r1.tools.formats import FORMATS, ParsedResponse, ToolCallFormat, get_format, register_format

__all__ = [
    "FORMATS",
    "ParsedResponse",
    "Tool",
    "ToolArgumentError",
    "ToolCall",
    "ToolCallFormat",
    "ToolResult",
    "ToolSet",
    "get_format",
    "register_format",
    "tool",
    "truncate_output",
]
