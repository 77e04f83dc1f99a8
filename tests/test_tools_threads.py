"""The thread bridge (agent_r1/tools/threads.py): blocking calls awaited on daemon threads, each in a
copy of its caller's context; a DaemonThread runs its calls in order."""

import asyncio
import contextvars
import threading

import pytest

from agent_r1.tools.threads import DaemonThread, run_in_daemon_thread

episode = contextvars.ContextVar("episode", default="unset")


def where(label: str) -> tuple[str, str, str]:
    return label, episode.get(), threading.current_thread().name


def test_a_call_runs_on_a_named_daemon_thread_in_the_callers_context():
    async def main():
        episode.set("e1")
        return await run_in_daemon_thread("bridge-test", where, "a")

    assert asyncio.run(main()) == ("a", "e1", "bridge-test")


def test_a_daemon_thread_runs_calls_in_order_each_in_its_callers_context():
    thread = DaemonThread("episode-thread")
    order: list[str] = []

    async def as_episode(label: str):
        episode.set(label)
        return await thread.call(lambda: (order.append(label), where(label))[1])

    async def main():
        try:
            return await asyncio.gather(*(as_episode(f"e{i}") for i in range(3)))
        finally:
            thread.stop()

    assert asyncio.run(main()) == [(f"e{i}", f"e{i}", "episode-thread") for i in range(3)]
    assert order == ["e0", "e1", "e2"]


def test_an_error_is_raised_to_the_caller_and_keyword_arguments_are_the_functions():
    def fail(function: str, thread_name: str) -> None:
        raise ValueError(f"{function} {thread_name}")

    with pytest.raises(ValueError, match="f t"):
        asyncio.run(run_in_daemon_thread("bridge-test", fail, function="f", thread_name="t"))
