"""Drive an environment with scripted replies (a helper for the task tests)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from agent_r1.types import Action


def play_replies(env, task: Mapping[str, Any], replies: Sequence[str]):
    """The first observation and every StepResult of ``env``'s episode of ``task`` driven by
    ``replies`` (one response each), stopping when the episode ends."""

    async def run():
        first = await env.reset(task)
        results = []
        for reply in replies:
            results.append(await env.step(Action(reply, ())))
            if results[-1].terminated or results[-1].truncated:
                break
        return first, results

    return asyncio.run(run())
