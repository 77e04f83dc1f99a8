"""What the text tasks whose prompt lists the admissible actions share (``household``, ``shop``):
a reply naming a listed action by its number, the env factory's one argument, and the end of an
episode whose action budget is spent."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from agent_r1.types import StepResult

__all__ = ["check_env_arguments", "listed_action", "out_of_budget"]


def listed_action(admissible: Sequence[str], response: str) -> str:
    """The action a parsed response names: a listed action's number (``3``, ``3.``) stands for that
    action; anything else is read as the action's text."""
    number = response.removesuffix(".")
    if number.isdigit() and 1 <= int(number) <= len(admissible):
        return admissible[int(number) - 1]
    return response


def check_env_arguments(task: str, max_turns: int | None, kwargs: Mapping[str, Any]) -> None:
    """``make_env``'s arguments: only ``max_turns`` (None, or a cap of at least one action)."""
    if kwargs:
        raise ValueError(f"{task}: make_env takes only max_turns, got {sorted(kwargs)}")
    if max_turns is not None and max_turns < 1:
        raise ValueError(f"{task}: max_turns must be >= 1, got {max_turns}")


def out_of_budget(info: Mapping[str, Any]) -> StepResult:
    """The step that spends the budget without reaching the goal: truncated, outcome 0.0."""
    return StepResult(None, truncated=True, outcome_reward=0.0, info={**info, "success": False})
