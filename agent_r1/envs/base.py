"""AgentEnv: the Gymnasium-style environment contract of the step-level MDP.

An environment decides the state: ``reset`` returns the first observation (the first prompt) and
``step`` turns the model's action into the next observation (the next prompt), a reward, and whether
the episode ended. Because each step stores its own prompt, an environment is free to truncate,
window, summarise or rewrite the history between steps.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agent_r1.types import Action, Completion, Observation, StepResult, Task

__all__ = ["AgentEnv", "EnvKwargsError", "LentPolicy", "unknown_fields_message"]


class EnvKwargsError(ValueError):
    """A bad keyword argument of an env, found by ``AgentEnv.check_kwargs``: ``key`` names it."""

    def __init__(self, key: str, why: str) -> None:
        super().__init__(f"{key}: {why}")
        self.key = key
        self.why = why


@dataclass(frozen=True)
class LentPolicy:
    """The model acting in an episode, lent by the flow to its environment for calls beyond the
    action (a summary of the history: ``agent_r1.envs.context``, ``summarizer="policy"``).

    ``generate(prompt_ids)`` samples from the policy with the flow's sampling params (``max_tokens``
    capped as for an action) and raises on an aborted request. A call the environment wants trained
    goes back to the flow as a Step in ``StepResult.policy_steps``.
    """

    generate: Callable[[Sequence[int]], Awaitable[Completion]]


class AgentEnv(ABC):
    """One episode at a time; a fresh instance per trajectory (flows build one per sample).

    Subclasses implement:

    - ``async reset(task) -> Observation | StepResult``: start an episode for one dataset row. An
      episode that is over before the model's first action (a game the other seats end before this
      seat moves) returns a ``StepResult`` that has ended instead (``terminated`` or ``truncated``,
      no observation, its ``outcome_reward`` and ``info``): the flow records a trajectory with no
      steps, so nothing is invented to train, and keeps the outcome and info on the trajectory
      (``Trajectory.info["ended_at_reset"]``). Never prompt the model for a placeholder move.
    - ``async step(action) -> StepResult``: apply the model's response; return the next observation,
      the immediate reward, ``terminated`` / ``truncated`` and info. Report a final outcome reward in
      ``StepResult.outcome_reward`` (once), never also inside ``reward``.
    - optionally ``async close()`` to release resources (sandboxes, connections).

    A flow lends the acting policy with ``lend_policy`` before ``reset`` (``AgentEnvLoop`` does);
    ``self.policy`` is None outside a flow.

    Run ``agent_r1.envs.check_env(env, task)`` to check that an environment honours this contract.

    ``required_fields`` declares the row fields the env (and its reward) reads: training refuses a row
    without one when the data is loaded, naming the row and the field, instead of scoring it 0. A
    factory function declares them as its own ``required_fields`` attribute.

    ``task_fields`` declares every row field the env reads, required or optional: a row with any
    other field (a misspelt ``seet``) is refused when the data is loaded (``agent-r1 check``,
    ``train``, ``eval``), naming the row, the field and the closest known one. None (the default)
    declares the rows free-form: fields passed on to a user's code, or read by a reward function.

    ``reset_calls_policy``: ``reset`` runs the model (an agent program's first model call happens
    inside it), so ``agent-r1 check``, which loads no weights, does not reset this env.
    """

    policy: LentPolicy | None = None
    required_fields: tuple[str, ...] = ()
    task_fields: tuple[str, ...] | None = None
    reset_calls_policy: bool = False

    def episode_roles(self) -> Sequence[str] | None:
        """The roles that may act in this env's episodes (``Observation.role``), when it knows them
        before they act (after ``reset``, or from its kwargs); None: one role, or not known ahead.
        ``agent-r1 check`` checks that a configured policy plays each one (docs/multi_agent.md)."""
        return None

    def lend_policy(self, policy: LentPolicy) -> None:
        """Give the environment the acting policy for calls beyond the action (see ``LentPolicy``)."""
        self.policy = policy

    @abstractmethod
    async def reset(self, task: Task) -> Observation | StepResult: ...

    @abstractmethod
    async def step(self, action: Action) -> StepResult: ...

    async def close(self) -> None:  # noqa: B027 - optional hook, empty by design
        return None

    @classmethod
    def check_kwargs(cls, kwargs: Mapping[str, Any]) -> None:  # noqa: B027 - optional hook
        """Refuse bad ``env.kwargs`` before anything expensive starts: the trainer and ``evaluate``
        call it on the configured kwargs before the tokenizer and the model load. Raise
        ``EnvKwargsError(key, why)``; the default accepts anything (the constructor checks the rest)."""
        return None


def unknown_fields_message(row: Mapping[str, Any], known: Sequence[str], env: str) -> str | None:
    """Why ``row`` is refused by an env reading only the ``known`` fields (its ``task_fields``), or
    None when it has no other field."""
    import difflib

    unknown = sorted(set(row) - set(known), key=str)
    if not unknown:
        return None
    hints = []
    for name in unknown:
        close = " or ".join(map(repr, difflib.get_close_matches(str(name), list(known), n=2)))
        hints.append(f"{name!r} (did you mean {close}?)" if close else repr(name))
    return (
        f"unknown field(s) {', '.join(hints)} for env {env!r}, which reads only {list(known)}: "
        "rename or remove them"
    )
