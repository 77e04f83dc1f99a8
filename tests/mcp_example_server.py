"""A small MCP server for tests/test_tool_mcp.py, built with the official ``mcp`` SDK; stdio transport."""

from __future__ import annotations

import os
import sys

try:
    from mcp.server.mcpserver import MCPServer
    from mcp.server.mcpserver.exceptions import ToolError
except ImportError:  # mcp 1.x
    from mcp.server.fastmcp import FastMCP as MCPServer
    from mcp.server.fastmcp.exceptions import ToolError

server = MCPServer("agent-r1-test-server")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def shout(text: str, times: int = 1) -> str:
    """Upper-case a text and repeat it."""
    return " ".join([text.upper()] * times)


@server.tool()
def refuse(reason: str) -> str:
    """Always fails with the given reason."""
    raise ToolError(f"refused: {reason}")


@server.tool()
def crash() -> str:
    """Kills the server process (to test a server that dies)."""
    print("about to crash", file=sys.stderr, flush=True)
    os._exit(3)


if __name__ == "__main__":
    server.run()
