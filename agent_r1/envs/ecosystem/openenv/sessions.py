"""Sessions: one episode of an OpenEnv environment, in this process or on a server. Both answer
``reset`` and ``step`` with a ``Reply`` and turn every failure into an ``OpenEnvError`` naming where
it happened, kept in ``failure`` so that the episode's later calls fail the same way."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from agent_r1.envs.ecosystem.openenv.errors import ActionRejected, OpenEnvError
from agent_r1.envs.ecosystem.openenv.introspect import accepted, openenv_core
from agent_r1.envs.ecosystem.openenv.server import LocalServer
from agent_r1.tools.threads import DaemonThread, run_in_daemon_thread

__all__ = ["InProcessSession", "RemoteSession", "Reply"]


@dataclass(frozen=True)
class Reply:
    """What a reset or step returned: the observation as OpenEnv hands it over, reward and done."""

    observation: Any
    reward: float
    done: bool


def _reply(observation: Any, reward: Any, done: Any) -> Reply:
    return Reply(observation, 0.0 if reward is None else float(reward), bool(done))


class InProcessSession:
    """An OpenEnv ``Environment`` instance in this process, called as OpenEnv's server calls it."""

    def __init__(self, environment: type, kwargs: Mapping[str, Any], timeout_s: float) -> None:
        self.environment_class, self.kwargs, self.timeout_s = environment, dict(kwargs), timeout_s
        self.env: Any = None
        self.failure: OpenEnvError | None = None
        self.where = f"OpenEnv environment {environment.__module__}.{environment.__qualname__} (in-process)"
        self._thread = DaemonThread(f"openenv-{environment.__name__}")

    async def _call(self, what: str, function: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
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
        base = openenv_core().Environment
        if getattr(type(self.env), f"{name}_async", None) is not getattr(base, f"{name}_async"):
            return getattr(self.env, f"{name}_async")
        return getattr(self.env, name)

    async def reset(self, kwargs: Mapping[str, Any]) -> Reply:
        if self.env is None:
            self.env = await self._call("construction", self.environment_class, **self.kwargs)
        reset = self._method("reset")
        observation = await self._call("reset", reset, **accepted(reset, kwargs))
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
            return await asyncio.wait_for(
                run_in_daemon_thread("openenv-setup", function, self.base_url), self.timeout_s
            )
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
