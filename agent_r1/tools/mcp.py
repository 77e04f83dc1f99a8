"""Tools served by a Model Context Protocol server over stdio, as agent-r1 ``Tool`` objects.

    tools = mcp_tools(["python", "my_server.py"])      # starts the server, lists its tools
    env = ToolEnv(tokenizer, tools, ...)                  # each keeps its MCP name, description, schema

The client speaks MCP's stdio transport itself (newline-delimited JSON-RPC 2.0:
``initialize`` -> ``notifications/initialized`` -> ``tools/list`` -> ``tools/call``; spec:
https://modelcontextprotocol.io/specification/2025-11-25) rather than through the ``mcp`` SDK, whose
client API changes between major versions; any conforming server works (the tests use the official
SDK's server). It runs on its own event-loop thread, so one server connection can be shared by all
environments whatever event loop calls them. ``isError`` results and a server that dies become
error ``ToolResult``s the model reads; nothing raises into the rollout.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import contextlib
import itertools
import json
import os
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any

from agent_r1.tools.base import Tool

__all__ = ["MCPClient", "MCPError", "MCPTool", "mcp_tools"]

PROTOCOL_VERSION = "2025-11-25"
_STDERR_TAIL_LINES = 20
_MAX_MESSAGE_BYTES = 64 * 2**20


class MCPError(RuntimeError):
    """The MCP server failed: it could not start, died, answered with a JSON-RPC error or timed out."""


class MCPClient:
    """One stdio MCP server process and its session. Thread-safe; usable from any event loop.

    ``command`` is the server's argv; ``env`` is added to this process's environment.
    """

    def __init__(
        self,
        command: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        request_timeout: float = 60.0,
        startup_timeout: float = 60.0,
    ) -> None:
        if not command:
            raise ValueError("MCPClient needs the server command, e.g. ['python', 'server.py']")
        self.command = list(command)
        self.request_timeout = request_timeout
        self.server_info: dict[str, Any] = {}
        self._env = {**os.environ, **(env or {})}
        self._cwd = cwd
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._stderr: collections.deque[str] = collections.deque(maxlen=_STDERR_TAIL_LINES)
        self._process: asyncio.subprocess.Process | None = None
        self._dead: MCPError | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="mcp-client", daemon=True)
        self._thread.start()
        try:
            self._submit(self._start()).result(startup_timeout)
        except BaseException as e:
            self.close()
            if isinstance(e, MCPError):
                raise
            raise MCPError(f"MCP server {self._name()} did not start: {type(e).__name__}: {e}") from e
        atexit.register(self.close)

    # -- public API --------------------------------------------------------------------------------

    def list_tools(self) -> list[dict[str, Any]]:
        """The server's tool descriptions (``name``, ``description``, ``inputSchema``), all pages."""
        return self._submit(self._list_tools()).result()

    def call_tool(self, name: str, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """Blocking ``tools/call``; returns the raw MCP result (``content``, ``isError``, ...)."""
        return self._submit(
            self._request("tools/call", {"name": name, "arguments": dict(arguments)})
        ).result()

    async def acall_tool(self, name: str, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """``call_tool`` for any event loop."""
        call = self._request("tools/call", {"name": name, "arguments": dict(arguments)})
        return await asyncio.wrap_future(self._submit(call))

    def close(self) -> None:
        """Stop the server (stdin closed, then terminate, then kill) and the client's thread."""
        if not self._loop.is_closed() and self._thread.is_alive():
            with contextlib.suppress(Exception):  # tearing down anyway; close() must not fail
                self._submit(self._stop()).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
        if not self._loop.is_running() and not self._loop.is_closed():
            self._loop.close()
        atexit.unregister(self.close)

    def __enter__(self) -> MCPClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- on the client's event loop ----------------------------------------------------------------

    def _name(self) -> str:
        return " ".join(self.command)

    def _submit(self, coro: Any) -> Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def _start(self) -> None:
        try:
            self._process = await asyncio.create_subprocess_exec(
                *self.command,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=self._env,
                cwd=self._cwd,
                limit=_MAX_MESSAGE_BYTES,
            )
        except OSError as e:
            raise MCPError(f"cannot start MCP server {self._name()}: {e}") from e
        self._reader = asyncio.ensure_future(self._read_stdout())
        self._stderr_reader = asyncio.ensure_future(self._read_stderr())
        result = await self._request(
            "initialize",
            {
                "protocolVersion": PROTOCOL_VERSION,
                "capabilities": {},
                "clientInfo": {"name": "agent-r1", "version": "0.1.0"},
            },
        )
        self.server_info = dict(result.get("serverInfo") or {})
        await self._send({"jsonrpc": "2.0", "method": "notifications/initialized"})

    async def _list_tools(self) -> list[dict[str, Any]]:
        tools: list[dict[str, Any]] = []
        cursor = None
        while True:
            result = await self._request("tools/list", {"cursor": cursor} if cursor else {})
            tools.extend(result.get("tools") or [])
            cursor = result.get("nextCursor")
            if not cursor:
                return tools

    async def _send(self, message: dict[str, Any]) -> None:
        if self._dead is not None:
            raise self._dead
        assert self._process is not None and self._process.stdin is not None
        self._process.stdin.write(json.dumps(message).encode() + b"\n")
        try:
            await self._process.stdin.drain()
        except (BrokenPipeError, ConnectionResetError) as e:
            raise self._server_died() from e

    async def _request(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        request_id = next(self._ids)
        future: asyncio.Future[Any] = self._loop.create_future()
        self._pending[request_id] = future
        try:
            await self._send({"jsonrpc": "2.0", "id": request_id, "method": method, "params": params})
            return await asyncio.wait_for(future, self.request_timeout)
        except asyncio.TimeoutError:
            raise MCPError(
                f"MCP server {self._name()} did not answer {method} within {self.request_timeout}s"
            ) from None
        finally:
            self._pending.pop(request_id, None)

    async def _read_stdout(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        while True:
            try:
                line = await self._process.stdout.readline()
            except (ValueError, asyncio.LimitOverrunError):
                line = b""  # a message over the size limit: treat the stream as broken
            if not line:
                break
            try:
                message = json.loads(line)
            except json.JSONDecodeError:
                self._stderr.append(f"(non-JSON on stdout) {line[:200]!r}")
                continue
            if isinstance(message, dict):
                await self._dispatch(message)
        # Wait briefly for the exit code and the last stderr lines, so the error can show them.
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.gather(self._process.wait(), self._stderr_reader), 2.0)
        error = self._server_died()
        for future in self._pending.values():
            if not future.done():
                future.set_exception(error)

    async def _dispatch(self, message: dict[str, Any]) -> None:
        if "method" in message:  # a request or notification from the server
            if "id" in message:
                reply: dict[str, Any] = {"jsonrpc": "2.0", "id": message["id"]}
                if message["method"] == "ping":
                    reply["result"] = {}
                else:
                    reply["error"] = {
                        "code": -32601,
                        "message": f"method {message['method']!r} not supported",
                    }
                await self._send(reply)
            return
        future = self._pending.get(message.get("id"))  # type: ignore[arg-type]
        if future is None or future.done():
            return
        if "error" in message:
            error = message["error"] or {}
            future.set_exception(
                MCPError(
                    f"MCP server {self._name()}: {error.get('message', error)} (code {error.get('code')})"
                )
            )
        else:
            future.set_result(message.get("result") or {})

    async def _read_stderr(self) -> None:
        assert self._process is not None and self._process.stderr is not None
        async for line in self._process.stderr:
            self._stderr.append(line.decode("utf-8", "replace").rstrip())

    def _server_died(self) -> MCPError:
        if self._dead is None:
            code = self._process.returncode if self._process else None
            tail = "\n".join(self._stderr) or "(nothing on stderr)"
            self._dead = MCPError(
                f"MCP server {self._name()} closed its output"
                + (f" (exit code {code})" if code is not None else "")
                + f"; last stderr lines:\n{tail}"
            )
        return self._dead

    async def _stop(self) -> None:
        process = self._process
        if process is None or process.returncode is not None:
            return
        if process.stdin is not None:
            process.stdin.close()
        for action in (None, process.terminate, process.kill):
            if action is not None:
                try:
                    action()
                except ProcessLookupError:
                    return
            try:
                await asyncio.wait_for(process.wait(), 2.0)
                return
            except asyncio.TimeoutError:
                continue


def _render_content(result: Mapping[str, Any]) -> str:
    """MCP result content as text: text items as is, other items as short placeholders."""
    parts = []
    for item in result.get("content") or []:
        kind = item.get("type")
        if kind == "text":
            parts.append(item.get("text", ""))
        elif kind == "resource" and isinstance(item.get("resource"), Mapping) and "text" in item["resource"]:
            parts.append(item["resource"]["text"])
        else:
            parts.append(f"[{kind} content: {item.get('mimeType') or item.get('uri') or 'not shown'}]")
    if not parts and result.get("structuredContent") is not None:
        parts.append(json.dumps(result["structuredContent"], ensure_ascii=False))
    return "\n".join(parts)


class MCPTool(Tool):
    """One tool of an MCP server: its name (optionally prefixed), description and input schema."""

    def __init__(
        self, client: MCPClient, spec: Mapping[str, Any], *, prefix: str = "", timeout: float = 60.0
    ):
        self.client = client
        self.remote_name = spec["name"]
        parameters = dict(spec.get("inputSchema") or {"type": "object", "properties": {}})
        super().__init__(
            prefix + self.remote_name, spec.get("description") or "", parameters, timeout=timeout
        )

    async def run(self, arguments: dict[str, Any]) -> str:
        result = await self.client.acall_tool(self.remote_name, arguments)
        text = _render_content(result)
        if result.get("isError"):
            raise MCPError(text or "the tool reported an error without a message")
        return text


def mcp_tools(
    command: Sequence[str] | MCPClient,
    *,
    env: Mapping[str, str] | None = None,
    prefix: str = "",
    include: Sequence[str] | None = None,
    timeout: float = 60.0,
) -> list[Tool]:
    """Start an MCP server (or use a running ``MCPClient``) and return its tools as ``Tool`` objects.

    ``include`` keeps only the named tools (unknown names are an error listing the server's tools);
    ``prefix`` is prepended to every tool name (to combine servers whose tool names clash).
    """
    client = (
        command if isinstance(command, MCPClient) else MCPClient(command, env=env, request_timeout=timeout)
    )
    specs = client.list_tools()
    if include is not None:
        available = [s["name"] for s in specs]
        missing = [name for name in include if name not in available]
        if missing:
            raise ValueError(
                f"MCP server {' '.join(client.command)} has no tool {missing[0]!r}; its tools: {', '.join(available)}"
            )
        specs = [s for s in specs if s["name"] in include]
    return [MCPTool(client, spec, prefix=prefix, timeout=timeout) for spec in specs]
