"""Built-in tasks by name: a dataset generator, the tools, the prompt, the answer rule and the reward.

``get_task("arithmetic")`` returns a ``TaskSpec``. Adding a task is one line in ``TASKS``: its name and
a plain builder function ``() -> TaskSpec`` (given as ``"module:function"``, imported on first use).
"""

from __future__ import annotations

import importlib
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from agent_r1.types import Task

__all__ = ["TASKS", "TaskSpec", "available_tasks", "get_task"]


@dataclass(frozen=True)
class TaskSpec:
    """Everything an environment and a trainer need to know about one task.

    - ``make_dataset(n, *, split, seed)``: ``n`` rows of ``split`` (``"train"`` or ``"test"``); rows
      hold ``id``, ``prompt`` (the opening chat messages) and ``answer``; the two splits are disjoint.
    - ``tools()``: fresh ``agent_r1.tools.Tool`` objects for one environment.
    - ``tool_format()``: the tool-call format (a name or a ``ToolCallFormat`` instance) for ``ToolEnv``.
    - ``extract_answer(text)``: the final answer in a response, or None.
    - ``reward(answer, task)``: the outcome reward of an answer.
    - ``demonstrate(task, rng)``: the assistant responses of one demonstration, for a supervised warm
      start (None when the task has no demonstrator).
    - ``max_turns``: responses per episode that comfortably fit a correct solution.
    - ``make_env(tokenizer, **env_kwargs)``: optional; builds the env itself when the task's tools keep
      per-episode state bound to the task (otherwise ``ToolEnv`` is built from the fields above).
    - ``required_fields``: the row fields the env and the reward read; training refuses a row without
      one when the data is loaded (``agent_r1.train.data.config_tasks``), naming the row and the field.
    """

    name: str
    make_dataset: Callable[..., list[dict[str, Any]]]
    tools: Callable[[], Sequence[Any]]
    tool_format: Callable[[], Any]
    extract_answer: Callable[[str], str | None]
    reward: Callable[[str, Task], float]
    demonstrate: Callable[[Task, random.Random], list[str]] | None = None
    max_turns: int = 4
    make_env: Callable[..., Any] | None = None  # (tokenizer, **env_kwargs) -> env, for stateful tools
    required_fields: tuple[str, ...] = ("prompt",)


TASKS: dict[str, str] = {
    "arithmetic": "agent_r1.tasks.arithmetic:build_task",
    "reasoning_gym": "agent_r1.tasks.reasoning_gym:build_task",
    "gsm_symbolic": "agent_r1.tasks.reasoning_gym:gsm_symbolic",
    "basic_arithmetic": "agent_r1.tasks.reasoning_gym:basic_arithmetic",
    "multihop_qa": "agent_r1.tasks.multihop_qa:build_task",
    "multihop_world": "agent_r1.tasks.multihop_world:build_task",
    "code": "agent_r1.tasks.code:build_task",
    "household": "agent_r1.tasks.household:build_task",
    "shop": "agent_r1.tasks.shop:build_task",
}


def available_tasks() -> list[str]:
    return sorted(TASKS)


def get_task(name: str) -> TaskSpec:
    """The task registered as ``name``; an unknown name raises ValueError listing the known ones."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; available tasks: {', '.join(available_tasks())}")
    module_name, _, function_name = TASKS[name].partition(":")
    return getattr(importlib.import_module(module_name), function_name)()
