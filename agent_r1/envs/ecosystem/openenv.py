"""OpenEnv environments as agent-r1 ``AgentEnv`` s (docs/ecosystem.md, "OpenEnv").

OpenEnv (``openenv-core``) environments subclass ``openenv.core.Environment``: ``reset(seed,
episode_id, **kwargs)`` and ``step(action)`` both return a typed pydantic ``Observation`` that
carries ``reward`` and ``done``; actions are typed pydantic ``Action`` s. OpenEnv serves an
environment with ``create_app(EnvClass, ActionClass, ObservationClass)`` (FastAPI, run by uvicorn)
and reaches it with an ``EnvClient`` over the server's WebSocket ``/ws``. MCP tool environments
(``MCPEnvironment``) take ``ListToolsAction`` / ``CallToolAction``.

**Where the environment runs** (exactly one of):

- ``environment: "module:Class"``: in this process, one instance per trajectory. Its methods are
  called as OpenEnv's server calls them: ``reset_async`` / ``step_async`` when the class overrides
  them, else the sync ``reset`` / ``step`` on one worker thread per episode (the server's
  per-session executor).
- ``server: {app: "module:app"}``: served by ``python -m uvicorn module:app --host 127.0.0.1
  --port <free>`` (how OpenEnv's own ``UVProvider`` starts one, without uv), started by the
  adapter on first use, once per process and app, and reached through OpenEnv's client.
- ``base_url: "http://host:port"``: a server already running, reached the same way.

**Sessions.** One server, one WebSocket session per trajectory. OpenEnv's server gives each
``/ws`` connection its own ``Environment`` instance (up to the app's ``max_concurrent_envs``,
default 1); its HTTP ``/reset`` and ``/step`` build a fresh environment per request, so a
multi-step episode needs the WebSocket. A session refused because the server is full waits and
retries until ``timeout_s`` (OpenEnv's template serves one session at a time; raise
``max_concurrent_envs`` in the app, as TRL's OpenEnv guide says, for concurrent rollouts).

**Mapping.** Chat mode: the observation (minus ``reward``/``done``/``metadata``) becomes a user
message (``render_observation``); the response text becomes an Action (``parse_action``); an
action that does not validate is an observation saying what is wrong (the episode goes on,
``env/invalid_actions``). Tool mode (an MCP environment): its tools, listed per session, become
agent-r1 ``Tool`` s and a ``ToolEnv`` parses the model's calls in ``format``; each call is a
``CallToolAction``. Both: OpenEnv's per-step ``reward`` is the step's immediate reward (the
rewards of a response's calls summed), ``done`` ends the episode (``terminated``), ``max_turns``
responses truncate it; no outcome reward. ``info["success"]``: the episode ended with ``done``
and its return reached ``success_threshold``.

**Failures.** A server that dies, closes the session or does not answer within ``timeout_s``
ends the trajectory with an error (``OpenEnvError``) naming the server and, for one the adapter
started, its exit code and last log lines; the next trajectory restarts a dead server. A step
that hangs holds its server session until it returns (OpenEnv cannot cancel it).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import inspect
import json
import logging
import os
import queue
import socket
import subprocess
import sys
import tempfile
import threading
import time
import typing
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from agent_r1.envs.base import AgentEnv
from agent_r1.envs.context import ContextRequest, PreviousTurn, resolve_context_policy, task_messages
from agent_r1.envs.ecosystem import require
from agent_r1.envs.registry import load_entry_point
from agent_r1.envs.tool_env import ToolEnv
from agent_r1.models.loading import require_chat_template
from agent_r1.tools import Tool, ToolArgumentError
from agent_r1.types import Action, Message, Observation, StepResult, Task

__all__ = ["LocalServer", "OpenEnvEnv", "OpenEnvError", "default_render_observation"]

logger = logging.getLogger(__name__)

SERVER_KEYS = ("app", "cwd", "env", "startup_timeout_s")
_LOG_TAIL_LINES = 20
_HOOK = "a callable or a 'module:function' entry point"


class OpenEnvError(RuntimeError):
    """The OpenEnv environment or its server failed: it died, hung past ``timeout_s``, raised, or
    cannot be reached. Raised into the rollout, which ends that trajectory with status ERROR."""


def _openenv(what: str = "the OpenEnv adapter (env.name: openenv)") -> Any:
    return require("openenv.core", "openenv", what)


# ------------------------------------------------------------------------------------------------
# Observations and actions
# ------------------------------------------------------------------------------------------------


def _fields(observation: Any) -> dict[str, Any]:
    """An observation's own fields: a pydantic model's or a dict's, less reward, done and metadata."""
    if hasattr(observation, "model_dump"):
        data = observation.model_dump()
    elif isinstance(observation, Mapping):
        data = dict(observation)
    else:
        return {"observation": observation}
    return {k: v for k, v in data.items() if k not in ("reward", "done", "metadata")}


def _as_text(value: Any) -> str:
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
        return _as_text(next(iter(fields.values())))
    return "\n".join(f"{name}: {_as_text(value)}" for name, value in fields.items())


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
        f"response text could fill; set env.kwargs.parse_action to {_HOOK} turning the response "
        "text into the action (an Action instance or a dict of its fields)"
    )


def _validation_message(error: Exception) -> str:
    """A pydantic ValidationError in one line (``field: message; ...``), any other error as is."""
    errors = getattr(error, "errors", None)
    if callable(errors):
        with contextlib.suppress(Exception):
            return "; ".join(
                f"{'.'.join(str(p) for p in e.get('loc', ())) or 'action'}: {e.get('msg', '')}"
                for e in errors()
            )
    return str(error)


def _declared_action_class(cls: type, base: type) -> type | None:
    """The Action class ``cls`` declares: ``base[MyAction, ...]`` among its bases (an Environment or
    EnvClient subclass), else the annotation of its ``step``'s ``action`` parameter (the way
    OpenEnv's template writes it)."""
    action_base = _openenv().Action
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


def _resolve(value: Any, kind: str) -> Any:
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
    environment = _openenv().Environment
    found = sorted(
        f"{module_name}:{name}"
        for name, obj in vars(module).items()
        if isinstance(obj, type) and issubclass(obj, environment) and obj.__module__ == module_name
    )
    return f"; OpenEnv Environments in {module_name!r}: {found}" if found else ""


def _accepted(function: Callable[..., Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``kwargs`` less those ``function`` does not take, as OpenEnv's server filters reset kwargs."""
    parameters = inspect.signature(function).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return dict(kwargs)
    return {k: v for k, v in kwargs.items() if k in parameters}


# ------------------------------------------------------------------------------------------------
# Sessions: one episode of the environment, in this process or on a server
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reply:
    """What a reset or step returned: the observation as OpenEnv hands it over, reward and done."""

    observation: Any
    reward: float
    done: bool


def _reply(observation: Any, reward: Any, done: Any) -> Reply:
    return Reply(observation, 0.0 if reward is None else float(reward), bool(done))


class ActionRejected(ValueError):
    """The environment's server refused the action as invalid (OpenEnv's VALIDATION_ERROR)."""


class _EpisodeThread:
    """One daemon thread that runs an in-process environment's sync calls in order, like the
    per-session executor of OpenEnv's server. Daemon: a call that hangs past its timeout cannot
    be killed, and must not keep the program from exiting."""

    def __init__(self, name: str) -> None:
        self._calls: queue.Queue[Any] = queue.Queue()
        threading.Thread(target=self._serve, name=name, daemon=True).start()

    def _serve(self) -> None:
        while (item := self._calls.get()) is not None:
            function, args, kwargs, loop, future = item
            try:
                outcome: tuple[Any, BaseException | None] = (function(*args, **kwargs), None)
            except BaseException as error:
                outcome = (None, error)
            with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits any more
                loop.call_soon_threadsafe(_deliver, future, *outcome)

    async def call(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._calls.put((function, args, kwargs, loop, future))
        return await future

    def stop(self) -> None:
        self._calls.put(None)


def _deliver(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


class InProcessSession:
    """An OpenEnv ``Environment`` instance in this process, called as OpenEnv's server calls it."""

    def __init__(self, environment: type, kwargs: Mapping[str, Any], timeout_s: float) -> None:
        self.environment_class, self.kwargs, self.timeout_s = environment, dict(kwargs), timeout_s
        self.env: Any = None
        self.failure: OpenEnvError | None = None
        self.where = f"OpenEnv environment {environment.__module__}.{environment.__qualname__} (in-process)"
        self._thread = _EpisodeThread(f"openenv-{environment.__name__}")

    async def _call(self, what: str, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self.failure is not None:
            raise self.failure
        call = (
            function(*args, **kwargs)
            if inspect.iscoroutinefunction(function)
            else (self._thread.call(function, *args, **kwargs))
        )
        try:
            return await asyncio.wait_for(call, self.timeout_s)
        except asyncio.TimeoutError:
            self.failure = OpenEnvError(
                f"{self.where}: {what} did not return within timeout_s={self.timeout_s}s"
            )
        except Exception as error:
            self.failure = OpenEnvError(f"{self.where}: {what} raised {type(error).__name__}: {error}")
            self.failure.__cause__ = error
        raise self.failure

    def _method(self, name: str) -> Callable[..., Any]:
        """``reset_async`` / ``step_async`` when the class overrides them (OpenEnv's server rule), else
        the sync method (run on the episode's thread)."""
        base = _openenv().Environment
        if getattr(type(self.env), f"{name}_async", None) is not getattr(base, f"{name}_async"):
            return getattr(self.env, f"{name}_async")
        return getattr(self.env, name)

    async def reset(self, kwargs: Mapping[str, Any]) -> Reply:
        if self.env is None:
            self.env = await self._call("construction", self.environment_class, **self.kwargs)
        reset = self._method("reset")
        observation = await self._call("reset", reset, **_accepted(reset, kwargs))
        return _reply(observation, getattr(observation, "reward", None), getattr(observation, "done", False))

    async def step(self, action: Any) -> Reply:
        observation = await self._call("step", self._method("step"), action)
        return _reply(observation, getattr(observation, "reward", None), getattr(observation, "done", False))

    @property
    def is_tool_env(self) -> bool:
        """OpenEnv's server's test for MCP support: the environment has an MCP client or server."""
        return (
            getattr(self.env, "mcp_client", None) is not None
            or getattr(self.env, "mcp_server", None) is not None
        )

    async def close(self) -> None:
        try:
            if self.env is not None and self.failure is None:  # a failed env may be stuck: leave it
                await self._call("close", self.env.close)
        finally:
            self._thread.stop()


class RemoteSession:
    """One WebSocket session on an OpenEnv server, through OpenEnv's client (``client_class``)."""

    def __init__(
        self, base_url: str, client_class: type | None, timeout_s: float, server: LocalServer | None = None
    ) -> None:
        self.base_url, self.client_class, self.timeout_s, self.server = (
            base_url,
            client_class,
            timeout_s,
            server,
        )
        self.where = f"OpenEnv server {base_url}" + (f" (app {server.app!r})" if server else "")
        self.client: Any = None
        self.failure: OpenEnvError | None = None
        self._lock = asyncio.Lock()  # one message at a time on the session's WebSocket

    def _client(self) -> Any:
        return self.client_class(
            base_url=self.base_url, connect_timeout_s=self.timeout_s, message_timeout_s=self.timeout_s
        )

    def _failed(self, what: str, error: BaseException) -> OpenEnvError:
        if isinstance(error, asyncio.TimeoutError):
            reason = f"no answer to {what} within timeout_s={self.timeout_s}s"
        else:
            reason = f"{what} failed: {type(error).__name__}: {error}"
        self.failure = OpenEnvError(f"{self.where}: {reason}{self.server.diagnosis() if self.server else ''}")
        return self.failure

    async def query(self, function: Callable[[str], Any], what: str) -> Any:
        """A blocking HTTP question to the server (``function(base_url)``), bounded by ``timeout_s``."""
        try:
            return await asyncio.wait_for(_in_thread(function, self.base_url), self.timeout_s)
        except (OSError, ValueError, KeyError, asyncio.TimeoutError) as error:
            raise self._failed(what, error) from error

    async def reset(self, kwargs: Mapping[str, Any]) -> Reply:
        """Open the session and reset; a server at capacity is retried until ``timeout_s``."""
        from websockets.exceptions import ConnectionClosedOK

        deadline, pause = time.monotonic() + self.timeout_s, 0.05
        while True:
            self.client = self._client()
            try:
                result = await asyncio.wait_for(self.client.reset(**kwargs), self.timeout_s)
                return _reply(result.observation, result.reward, result.done)
            except (ConnectionClosedOK, RuntimeError) as error:
                # A full server accepts the WebSocket, then closes it (after a CAPACITY_REACHED error).
                full = isinstance(error, ConnectionClosedOK) or "CAPACITY_REACHED" in str(error)
                await self._disconnect()
                if not full:
                    raise self._failed("reset", error) from error
                if time.monotonic() + pause > deadline:
                    raise self._failed(
                        "opening a session",
                        TimeoutError(f"the server stayed full (at capacity) for {self.timeout_s}s"),
                    ) from error
                await asyncio.sleep(pause)
                pause = min(2 * pause, 1.0)
            except Exception as error:
                await self._disconnect()
                raise self._failed("reset", error) from error

    async def step(self, action: Any) -> Reply:
        if self.failure is not None:
            raise self.failure
        async with self._lock:
            try:
                result = await asyncio.wait_for(self.client.step(action), self.timeout_s)
            except RuntimeError as error:
                if "VALIDATION_ERROR" in str(error):
                    shown = action if isinstance(action, Mapping) else getattr(action, "__dict__", action)
                    raise ActionRejected(
                        f"the environment's server rejected {json.dumps(shown, default=str)} (VALIDATION_ERROR)"
                    ) from error
                raise self._failed("step", error) from error
            except Exception as error:
                raise self._failed("step", error) from error
        return _reply(result.observation, result.reward, result.done)

    async def _disconnect(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            with contextlib.suppress(Exception):  # the session is over either way
                await asyncio.wait_for(client.close(), 5.0)

    async def close(self) -> None:
        await self._disconnect()


# ------------------------------------------------------------------------------------------------
# A server started by the adapter
# ------------------------------------------------------------------------------------------------


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


def _http(url: str, payload: Mapping[str, Any] | None = None, timeout: float = 5.0) -> Any:
    """GET (or POST ``payload`` as JSON) and decode the JSON answer; proxies are bypassed (local)."""
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with _NO_PROXY.open(request, timeout=timeout) as response:
        return json.loads(response.read())


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


def _action_schema(base_url: str) -> dict[str, Any]:
    """The action JSON schema a server publishes at ``/schema`` (cached per server)."""
    if base_url not in _SCHEMAS:
        _SCHEMAS[base_url] = _http(f"{base_url}/schema")["action"]
    return _SCHEMAS[base_url]


def _serves_tools(base_url: str) -> bool:
    """Whether a server's environment is an MCP tool environment: OpenEnv's own test, a stateless
    ``tools/list`` on ``/mcp`` (a non-MCP environment answers "does not support MCP")."""
    if base_url not in _TOOL_SERVERS:
        answer = _http(f"{base_url}/mcp", {"jsonrpc": "2.0", "method": "tools/list", "params": {}, "id": 1})
        _TOOL_SERVERS[base_url] = "result" in answer and "tools" in (answer["result"] or {})
    return _TOOL_SERVERS[base_url]


async def _in_thread(function: Callable[..., Any], *args: Any) -> Any:
    """Run a blocking call (starting a server, an HTTP request) on a daemon thread of its own."""
    thread = _EpisodeThread("openenv-setup")
    try:
        return await thread.call(function, *args)
    finally:
        thread.stop()


# ------------------------------------------------------------------------------------------------
# Tools of an MCP environment
# ------------------------------------------------------------------------------------------------


class OpenEnvTool(Tool):
    """One tool of an OpenEnv MCP environment; a call is a ``CallToolAction`` step of its session."""

    def __init__(
        self, name: str, description: str, input_schema: Mapping[str, Any], owner: OpenEnvEnv
    ) -> None:
        super().__init__(
            name, description, dict(input_schema or {"type": "object", "properties": {}}), timeout=None
        )
        self.owner = owner  # the session enforces timeout_s

    async def run(self, arguments: dict[str, Any]) -> Any:
        return await self.owner.call_tool(self.name, arguments)


def _tool_text(result: Any) -> str:
    """A tool result as text: MCP content's text parts, else its data, else the value itself."""
    if result is None:
        return ""
    content = result.get("content") if isinstance(result, Mapping) else getattr(result, "content", None)
    if isinstance(content, list):
        texts = [c.get("text") if isinstance(c, Mapping) else getattr(c, "text", None) for c in content]
        if texts and all(isinstance(t, str) for t in texts):
            return "\n".join(texts)
    data = result.get("data") if isinstance(result, Mapping) else getattr(result, "data", None)
    return _as_text(data if data is not None else result)


def _tool_failed(result: Any) -> bool:
    return bool(result.get("is_error") if isinstance(result, Mapping) else getattr(result, "is_error", False))


# ------------------------------------------------------------------------------------------------
# The adapter
# ------------------------------------------------------------------------------------------------


class OpenEnvEnv(AgentEnv):
    """An OpenEnv environment as an agent-r1 env (``env.name: openenv``); module docstring for the mapping.

    Config (``env.kwargs``); exactly one of ``environment``, ``server``, ``base_url``:

    - ``environment``: ``"module:Class"``, an OpenEnv ``Environment`` subclass run in this process,
      one instance per trajectory, built with ``environment_kwargs``.
    - ``server``: ``{app: "module:app", cwd: folder the module is imported from (default: the
      working directory), env: {VAR: value} for the server process, startup_timeout_s: 180}``; the
      adapter starts uvicorn on 127.0.0.1 at a free port, once per process and app.
    - ``base_url``: ``"http://host:port"`` of a server already running.
    - ``client``: ``"module:Class"``, the environment's own ``EnvClient`` subclass (typed
      observations); default OpenEnv's ``GenericEnvClient`` (dict observations), or
      ``MCPToolClient`` for a tool environment.
    - ``action``: ``"module:Class"``, the environment's Action class; default: the one the
      environment class (or ``client``) declares, else (a served environment) its published
      ``/schema``.
    - ``render_observation``: observation -> text, a ``"module:function"`` (default
      ``default_render_observation``).
    - ``parse_action``: response text (end-of-turn token removed) -> an Action instance or a dict of
      its fields; raise ValueError to reject it (the message is shown to the model). Default: the
      text is the Action's one string field.
    - ``tools``: None (default: an MCP environment is a tool environment), True or False.
    - ``format`` (tool mode): the tool-call format, default ``hermes``. ``context`` /
      ``context_kwargs``: the context policy (default ``append``: exact token ids).
    - ``system_prompt``: an opening system message; ``prompt_key``: a task field (a string or chat
      messages) shown before the first observation, if the task has it.
    - ``max_turns``: responses before the episode is truncated (default 8).
    - ``success_threshold``: ``info["success"]`` is "ended with done and the return >= this"
      (default 1.0; None: no success reported).
    - ``timeout_s``: the longest any reset, step or tool call may take (default 60).

    Task fields other than ``id`` and ``prompt_key`` are passed to ``reset`` as keyword arguments
    (as TRL passes dataset columns), less those ``reset`` does not take, as OpenEnv's server does;
    ``id`` becomes ``episode_id``.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        environment: str | type | None = None,
        environment_kwargs: Mapping[str, Any] | None = None,
        server: Mapping[str, Any] | None = None,
        base_url: str | None = None,
        client: str | type | None = None,
        action: str | type | None = None,
        render_observation: str | Callable[[Any], str] | None = None,
        parse_action: str | Callable[[str], Any] | None = None,
        tools: bool | None = None,
        format: str = "hermes",
        context: str = "append",
        context_kwargs: Mapping[str, Any] | None = None,
        system_prompt: str | None = None,
        prompt_key: str = "prompt",
        max_turns: int = 8,
        success_threshold: float | None = 1.0,
        timeout_s: float = 60.0,
    ) -> None:
        core = _openenv()
        require_chat_template(tokenizer)
        given = [
            name
            for name, value in (("environment", environment), ("server", server), ("base_url", base_url))
            if value
        ]
        if len(given) != 1:
            raise ValueError(
                "OpenEnvEnv needs exactly one of environment ('module:Class', run in-process), server "
                f"({{app: 'module:app'}}, served by uvicorn) or base_url (a running server); got {given or 'none'}"
            )
        if max_turns < 1:
            raise ValueError(f"OpenEnvEnv: max_turns must be >= 1, got {max_turns}")
        if not timeout_s > 0:
            raise ValueError(f"OpenEnvEnv: timeout_s must be > 0 seconds, got {timeout_s}")
        self.tokenizer = tokenizer
        self.environment = _resolve(environment, "environment") if environment else None
        if self.environment is not None and not (
            isinstance(self.environment, type) and issubclass(self.environment, core.Environment)
        ):
            raise TypeError(f"OpenEnvEnv environment: {environment!r} is not an OpenEnv Environment subclass")
        self.environment_kwargs = dict(environment_kwargs or {})
        if environment_kwargs and not environment:
            raise ValueError("OpenEnvEnv: environment_kwargs apply to an in-process environment only")
        self.server = dict(server) if server else None
        if self.server is not None:
            unknown = sorted(set(self.server) - set(SERVER_KEYS))
            if unknown or "app" not in self.server:
                raise ValueError(
                    f"OpenEnvEnv server: keys are {list(SERVER_KEYS)} ('app' required), got {sorted(self.server)}"
                )
        self.base_url = base_url.rstrip("/") if base_url else None
        self.client_class = _resolve(client, "client") if client else None
        if self.client_class is not None and not (
            isinstance(self.client_class, type) and issubclass(self.client_class, core.EnvClient)
        ):
            raise TypeError(f"OpenEnvEnv client: {client!r} is not an OpenEnv EnvClient subclass")
        if self.client_class is not None and self.environment is not None:
            raise ValueError("OpenEnvEnv: client applies to a served environment (server or base_url) only")
        self.action_class = _resolve(action, "action") if action else self._declared_action()
        if self.action_class is not None and not (
            isinstance(self.action_class, type) and issubclass(self.action_class, core.Action)
        ):
            raise TypeError(f"OpenEnvEnv action: {action!r} is not an OpenEnv Action subclass")
        self.render_observation = (
            _resolve(render_observation, "render_observation") or default_render_observation
        )
        self.parse_action = _resolve(parse_action, "parse_action")
        for name, hook in (
            ("render_observation", self.render_observation),
            ("parse_action", self.parse_action),
        ):
            if hook is not None and not callable(hook):
                raise TypeError(f"OpenEnvEnv {name} must be {_HOOK}, got {hook!r}")
        self.text_field: str | None = None
        self.rejection_hint = ""
        if self.parse_action is None and self.action_class is not None and tools is not True:
            # Checked here so a config error shows before any rollout (a tool environment needs none).
            text_field(self.action_class.model_json_schema(), self.action_class.__name__)
        self.tools, self.format = tools, format
        self.context = resolve_context_policy(context, context_kwargs, "OpenEnvEnv")
        self.context_name, self.context_kwargs = context, dict(context_kwargs or {})
        self.system_prompt, self.prompt_key = system_prompt, prompt_key
        self.max_turns, self.success_threshold, self.timeout_s = max_turns, success_threshold, timeout_s
        self.session: InProcessSession | RemoteSession | None = None
        self.tool_env: ToolEnv | None = None

    def _declared_action(self) -> type | None:
        core = _openenv()
        if self.environment is not None:
            return _declared_action_class(self.environment, core.Environment)
        if self.client_class is not None:
            return _declared_action_class(self.client_class, core.EnvClient)
        return None

    # -- the episode ------------------------------------------------------------------------------

    async def _open_session(self) -> tuple[InProcessSession | RemoteSession, bool]:
        """The episode's session, and whether the environment is a tool environment."""
        if self.environment is not None:
            session = InProcessSession(self.environment, self.environment_kwargs, self.timeout_s)
            return session, self.tools
        server = None
        if self.server is not None:
            options = {k: v for k, v in self.server.items() if k != "app"}
            server = await _in_thread(lambda: LocalServer.shared(self.server["app"], **options))
        session = RemoteSession(
            server.base_url if server else self.base_url, self.client_class, self.timeout_s, server
        )
        tools = self.tools
        if tools is None:
            tools = await session.query(_serves_tools, "asking /mcp whether it serves tools")
        if session.client_class is None:
            core = _openenv()
            session.client_class = core.MCPToolClient if tools else core.GenericEnvClient
        return session, tools

    async def reset(self, task: Task) -> Observation:
        await self.close()
        self.task, self.turn, self.episode_return, self.done = task, 0, 0.0, False
        self.pending_reward, self.tool_env = 0.0, None
        kwargs = {k: v for k, v in task.items() if k not in ("id", self.prompt_key)}
        if "id" in task:
            kwargs["episode_id"] = str(task["id"])
        self.session, tools = await self._open_session()
        first = await self.session.reset(kwargs)
        if tools is None:  # in-process: OpenEnv's server's test, on the instance
            tools = self.session.is_tool_env
        opening = self._opening_messages(task, first.observation)
        if tools:
            return await self._reset_tools(opening)
        await self._find_text_field()
        prompt = await self.context.build(self.tokenizer, ContextRequest(tuple(opening), policy=self.policy))
        self.messages, self.prompt_ids = prompt.messages, prompt.token_ids
        return Observation(token_ids=prompt.token_ids)

    async def _find_text_field(self) -> None:
        """Chat mode without ``parse_action``: the Action field the response text fills."""
        if self.text_field is not None or self.parse_action is not None:
            return
        if self.action_class is not None:
            schema = self.action_class.model_json_schema()
        elif self.environment is not None:
            raise OpenEnvError(
                f"{self.session.where}: {self.environment.__name__} declares no Action class (neither "
                "Environment[MyAction, ...] nor step(self, action: MyAction)); give action: 'module:Class'"
            )
        else:
            schema = await self.session.query(_action_schema, "reading the action schema at /schema")
            # The server says only "Invalid message" for an action it rejects: show the model the fields.
            fields = {
                name: {k: v for k, v in spec.items() if k not in ("title", "description")}
                for name, spec in schema.get("properties", {}).items()
                if name != "metadata"
            }
            self.rejection_hint = f"; the action's fields: {json.dumps(fields)[:300]}"
        try:
            self.text_field = text_field(schema, schema.get("title", "Action"))
        except ValueError as error:
            raise OpenEnvError(f"{self.session.where}: {error}") from None

    def _opening_messages(self, task: Task, observation: Any) -> list[Message]:
        messages: list[Message] = (
            [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        )
        if self.prompt_key in task:
            messages += task_messages(task, self.prompt_key)
        text = self.render_observation(observation)
        if text or not messages:
            messages.append({"role": "user", "content": text})
        return messages

    def _content(self, action: Action) -> str:
        eos = self.tokenizer.eos_token
        return action.text[: -len(eos)] if eos and action.text.endswith(eos) else action.text

    def _to_action(self, text: str) -> Any:
        """The response as an OpenEnv action; ValueError (a pydantic ValidationError is one) if invalid."""
        value = self.parse_action(text) if self.parse_action is not None else {self.text_field: text}
        if self.action_class is not None and not isinstance(value, self.action_class):
            return self.action_class.model_validate(value)
        return value

    def _ending(self, info: dict[str, Any]) -> dict[str, Any]:
        if self.success_threshold is not None:
            info["success"] = self.done and self.episode_return >= self.success_threshold
        return info

    async def step(self, action: Action) -> StepResult:
        if self.session is None:
            raise RuntimeError("OpenEnvEnv.step called before reset(task)")
        if self.tool_env is not None:
            return await self._step_tools(action)
        self.turn += 1
        content = self._content(action)
        info: dict[str, Any] = {"turn": self.turn}
        try:
            reply: Reply | None = await self.session.step(self._to_action(content))
            invalid = None
        except ActionRejected as error:
            reply, invalid = None, f"Invalid action: {error}{self.rejection_hint}"
        except ValueError as error:  # the hook or the Action's validation refused it
            reply, invalid = None, f"Invalid action: {_validation_message(error)}"
        metrics = {"invalid_actions": float(invalid is not None)}
        reward = reply.reward if reply else 0.0
        self.episode_return += reward
        if invalid is not None:
            info["invalid_action"] = invalid
        if reply is not None and reply.done:
            self.done = True
            info = self._ending(info)
            return StepResult(None, reward=reward, terminated=True, info=info, metrics=metrics)
        if self.turn >= self.max_turns:
            info = self._ending({**info, "truncated": f"max_turns={self.max_turns} reached"})
            return StepResult(None, reward=reward, truncated=True, info=info, metrics=metrics)
        shown = invalid if invalid is not None else self.render_observation(reply.observation)
        assistant = {"role": "assistant", "content": content}
        previous = PreviousTurn(self.prompt_ids, action.token_ids, num_messages=len(self.messages))
        request = ContextRequest(
            (*self.messages, assistant, {"role": "user", "content": shown}),
            previous=previous,
            policy=self.policy,
        )
        prompt = await self.context.build(self.tokenizer, request)
        self.messages, self.prompt_ids = prompt.messages, prompt.token_ids
        info["context"] = prompt.info
        return StepResult(
            Observation(token_ids=prompt.token_ids),
            reward=reward,
            info=info,
            policy_steps=prompt.steps,
            metrics=metrics,
        )

    # -- tool mode --------------------------------------------------------------------------------

    async def _reset_tools(self, opening: list[Message]) -> Observation:
        core = _openenv()
        reply = await self._session_step(core.ListToolsAction())
        listed = getattr(reply.observation, "tools", None)
        if listed is None and isinstance(reply.observation, Mapping):
            listed = reply.observation.get("tools")
        if not listed:
            raise OpenEnvError(
                f"{self.session.where}: ListToolsAction returned no tools ({reply.observation!r})"
            )
        tools = []
        for spec in listed:
            spec = spec.model_dump() if hasattr(spec, "model_dump") else dict(spec)
            try:
                tools.append(
                    OpenEnvTool(spec["name"], spec.get("description", ""), spec.get("input_schema", {}), self)
                )
            except ValueError as error:
                raise OpenEnvError(f"{self.session.where}: tool {spec.get('name')!r}: {error}") from None
        self.tool_env = ToolEnv(
            self.tokenizer,
            tools,
            format=self.format,
            context=self.context_name,
            context_kwargs=self.context_kwargs or None,
            outcome_reward=lambda answer, task: 0.0,  # OpenEnv rewards come with its steps
            step_reward=self._take_reward,
            max_turns=self.max_turns,
            prompt_key="messages",
        )
        if self.policy is not None:
            self.tool_env.lend_policy(self.policy)
        return await self.tool_env.reset({"messages": opening})

    def _take_reward(self, parsed: Any, results: Any, task: Task) -> float:
        reward, self.pending_reward = self.pending_reward, 0.0
        return reward

    async def _session_step(self, action: Any) -> Reply:
        try:
            return await self.session.step(action)
        except ActionRejected as error:
            raise OpenEnvError(f"{self.session.where}: {error}") from None

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        """One tool call of the model: a ``CallToolAction`` step; its reward and done are kept."""
        if self.done:
            raise ToolArgumentError("the episode is over (done); no more tool calls")
        reply = await self._session_step(_openenv().CallToolAction(tool_name=name, arguments=arguments))
        self.pending_reward += reply.reward
        self.episode_return += reply.reward
        self.done = self.done or reply.done
        observation = reply.observation
        error = getattr(observation, "error", None)
        if isinstance(observation, Mapping):
            error = observation.get("error")
        if error:
            message = error.get("message") if isinstance(error, Mapping) else getattr(error, "message", error)
            raise ToolArgumentError(str(message))
        result = (
            observation.get("result")
            if isinstance(observation, Mapping)
            else getattr(observation, "result", None)
        )
        if _tool_failed(result):
            raise ToolArgumentError(_tool_text(result))
        return _tool_text(result)

    async def _step_tools(self, action: Action) -> StepResult:
        result = await self.tool_env.step(action)
        failure = getattr(self.session, "failure", None)
        if failure is not None:  # the server died or hung during a call: the episode cannot go on
            raise failure
        counts = result.info.get("tool_counts", {})
        metrics = {"invalid_actions": float(bool(counts.get("parse_errors") or counts.get("tool_errors")))}
        info = dict(result.info)
        info.pop("success", None)
        if self.done:
            return replace(
                result,
                observation=None,
                terminated=True,
                truncated=False,
                outcome_reward=None,
                info=self._ending(info),
                metrics=metrics,
            )
        if result.terminated or result.truncated:  # the model stopped calling tools, or max_turns
            return replace(result, outcome_reward=None, info=self._ending(info), metrics=metrics)
        return replace(result, info=info, metrics=metrics)

    async def close(self) -> None:
        if self.session is not None:
            session, self.session = self.session, None
            await session.close()
