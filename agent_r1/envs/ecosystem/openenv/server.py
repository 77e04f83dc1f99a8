"""OpenEnv servers: an app served by uvicorn in a process the adapter starts, and the HTTP
questions asked of any OpenEnv server (its action schema, whether it serves MCP tools)."""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import typing
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any

from agent_r1.envs.ecosystem.openenv.errors import OpenEnvError

__all__ = ["SERVER_KEYS", "LocalServer", "RequestFailed", "action_schema", "serves_tools"]

logger = logging.getLogger(__name__)

SERVER_KEYS = ("app", "cwd", "env", "startup_timeout_s")
_LOG_TAIL_LINES = 20


# ``python -m uvicorn ...`` that also exits when the process that started it is gone: atexit does not
# run when the trainer is killed (SIGTERM, SIGKILL), and an orphaned server would run forever.
_SERVE_WHILE_PARENT_LIVES = """
import os, sys, threading, time
parent = os.getppid()
def watch():
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)
threading.Thread(target=watch, daemon=True).start()
from uvicorn.main import main
sys.argv[0] = "uvicorn"
main()
"""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class RequestFailed(OSError):
    """An HTTP request to an OpenEnv server got no JSON answer; the message names the request."""


def _http(url: str, payload: Mapping[str, Any] | None = None, timeout: float = 5.0) -> Any:
    """GET (or POST ``payload`` as JSON) and decode the JSON answer; proxies are bypassed (local).
    Any failure is a ``RequestFailed`` naming the method and URL tried."""
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    tried = f"{request.get_method()} {url}"
    try:
        with _NO_PROXY.open(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as error:
        raise RequestFailed(f"{tried}: the server answered HTTP {error.code} {error.reason}") from error
    except urllib.error.URLError as error:
        raise RequestFailed(f"{tried}: cannot connect: {error.reason}") from error
    except (OSError, ValueError) as error:  # a timeout or a broken connection while reading; not JSON
        raise RequestFailed(f"{tried}: {type(error).__name__}: {error}") from error


class LocalServer:
    """An OpenEnv app served by uvicorn (``uvicorn APP --host 127.0.0.1 --port PORT``) in a process
    of its own, shared by every env of this process that names the same app (``LocalServer.shared``).
    The server exits when this process does, also when it is killed.

    Its output goes to a log file whose last lines are quoted when it fails. ``stop_all`` (also run
    at exit) stops every server this process started.
    """

    _servers: typing.ClassVar[dict[tuple, LocalServer]] = {}
    _lock: typing.ClassVar[threading.Lock] = threading.Lock()

    def __init__(
        self,
        app: str,
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        startup_timeout_s: float = 180.0,
    ) -> None:
        self.app, self.cwd = app, os.path.abspath(cwd or os.getcwd())
        self.env, self.startup_timeout_s = dict(env or {}), startup_timeout_s
        self.process: subprocess.Popen | None = None
        self.base_url = ""
        descriptor, self.log_path = tempfile.mkstemp(prefix="openenv-server-", suffix=".log")
        os.close(descriptor)

    @classmethod
    def shared(cls, app: str, **options: Any) -> LocalServer:
        """The running server of ``app`` (with these options), started (or restarted) if need be.
        Blocks while it starts: call it from a worker thread."""
        key = (app, json.dumps(options, sort_keys=True, default=str))
        with cls._lock:
            server = cls._servers.get(key)
            if server is not None and not server.alive:
                logger.warning("OpenEnv server of %r died%s; starting a new one", app, server.diagnosis())
                server.stop()
                server = None
            if server is None:
                server = cls(app, **options)
                server.start()
                cls._servers[key] = server
            return server

    @classmethod
    def stop_all(cls) -> None:
        with cls._lock:
            servers, cls._servers = list(cls._servers.values()), {}
        for server in servers:
            server.stop()

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self) -> str:
        with contextlib.suppress(OSError), open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-_LOG_TAIL_LINES:]).strip()
        return ""

    def diagnosis(self) -> str:
        """For error messages: whether the process exited, with what code, and its last log lines."""
        if self.process is None:
            return ""
        with contextlib.suppress(subprocess.TimeoutExpired):  # a process that is dying: let it finish
            self.process.wait(0.5)
        code = self.process.poll()
        state = "still running" if code is None else f"exited with code {code}"
        tail = self.log_tail()
        return f"; the server process (pid {self.process.pid}) {state}" + (
            f"; its log ends:\n{tail}" if tail else ""
        )

    def start(self) -> None:
        for _attempt in range(3):  # a free port can be taken between choosing it and binding it
            port = _free_port()
            self.base_url = f"http://127.0.0.1:{port}"
            command = [sys.executable, "-c", _SERVE_WHILE_PARENT_LIVES, self.app, "--host", "127.0.0.1"]
            command += ["--port", str(port)]
            command += ["--app-dir", self.cwd, "--log-level", "warning"]
            with open(self.log_path, "wb") as log:  # the child keeps its own descriptor
                self.process = subprocess.Popen(
                    command,
                    cwd=self.cwd,
                    env={**os.environ, **self.env},
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            if self._wait_healthy():
                return
            if "address already in use" not in self.log_tail().lower():
                break
        failure = f"OpenEnv server for app {self.app!r} (cwd {self.cwd}) did not start{self.diagnosis()}"
        self.stop()
        raise OpenEnvError(failure)

    def _wait_healthy(self) -> bool:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if not self.alive:
                return False
            with contextlib.suppress(OSError, ValueError):
                if _http(f"{self.base_url}/health", timeout=2.0).get("status") == "healthy":
                    return True
            time.sleep(0.1)
        self.stop_process()
        with open(self.log_path, "a") as log:
            log.write(f"\n(no healthy /health within startup_timeout_s={self.startup_timeout_s}s)\n")
        return False

    def stop_process(self) -> None:
        if self.alive:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:  # e.g. a step still sleeping in the server's executor
                self.process.kill()
                self.process.wait(5)

    def stop(self) -> None:
        self.stop_process()
        with contextlib.suppress(OSError):
            os.unlink(self.log_path)


atexit.register(LocalServer.stop_all)

_SCHEMAS: dict[str, dict[str, Any]] = {}
_TOOL_SERVERS: dict[str, bool] = {}


def action_schema(base_url: str) -> dict[str, Any]:
    """The action JSON schema a server publishes at ``/schema`` (cached per server)."""
    if base_url not in _SCHEMAS:
        _SCHEMAS[base_url] = _http(f"{base_url}/schema")["action"]
    return _SCHEMAS[base_url]


def serves_tools(base_url: str) -> bool:
    """Whether a server's environment is an MCP tool environment: OpenEnv's own test, a stateless
    ``tools/list`` on ``/mcp`` (a non-MCP environment answers "does not support MCP"). Asked after
    ``GET /health``, so that a server that is not there fails as such, not as a failed MCP probe."""
    if base_url not in _TOOL_SERVERS:
        _http(f"{base_url}/health")
        answer = _http(f"{base_url}/mcp", {"jsonrpc": "2.0", "method": "tools/list", "params": {}, "id": 1})
        _TOOL_SERVERS[base_url] = "result" in answer and "tools" in (answer["result"] or {})
    return _TOOL_SERVERS[base_url]
