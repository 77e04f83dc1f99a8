"""Blocking calls awaited from the event loop on daemon threads of their own.

Not ``asyncio.to_thread``: its shared executor has ``min(32, cpus + 4)`` workers, so with many
rollouts calls would queue (and spend their timeout waiting), and ``asyncio.run`` joins its threads
at exit, so one hung call would hang the program. A thread cannot be killed: after a timeout the call
runs to completion in the background while its caller has moved on; daemon, it never keeps the
program from exiting. Each call runs in a copy of the caller's context (``contextvars``), as
``asyncio.to_thread`` runs it.

Used by sync ``@tool`` functions (a thread per call) and by OpenEnv environments run in-process (a
thread per episode, its calls in order, like OpenEnv's per-session executor).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import queue
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["DaemonThread", "run_in_daemon_thread"]


class DaemonThread:
    """One daemon thread that runs the sync calls given to ``call`` one after another, in order."""

    def __init__(self, name: str) -> None:
        self._calls: queue.Queue[Any] = queue.Queue()
        threading.Thread(target=self._serve, name=name, daemon=True).start()

    def _serve(self) -> None:
        while (item := self._calls.get()) is not None:
            context, function, args, kwargs, loop, future = item
            try:
                outcome: tuple[Any, BaseException | None] = (context.run(function, *args, **kwargs), None)
            except BaseException as error:
                outcome = (None, error)
            with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits any more
                loop.call_soon_threadsafe(_deliver, future, *outcome)

    async def call(self, function: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """``function(*args, **kwargs)`` on this thread, in a copy of the caller's context."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._calls.put((contextvars.copy_context(), function, args, kwargs, loop, future))
        return await future

    def stop(self) -> None:
        """The thread ends after the calls already given (a call still running finishes first)."""
        self._calls.put(None)


def _deliver(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.cancelled():  # the caller timed out or was cancelled
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


async def run_in_daemon_thread(
    thread_name: str, function: Callable[..., Any], /, *args: Any, **kwargs: Any
) -> Any:
    """``function(*args, **kwargs)`` on a new daemon thread named ``thread_name``, awaited."""
    thread = DaemonThread(thread_name)
    try:
        return await thread.call(function, *args, **kwargs)
    finally:
        thread.stop()
