"""AgentEnv: the Gymnasium-style environment contract of the step-level MDP.

An environment decides the state: ``reset`` returns the first observation (the first prompt) and
``step`` turns the model's action into the next observation (the next prompt), a reward, and whether
the episode ended. Because each step stores its own prompt, an environment is free to truncate,
window, summarise or rewrite the history between steps.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from agent_r1.types import Action, Observation, StepResult, Task

__all__ = ["AgentEnv"]


class AgentEnv(ABC):
    """One episode at a time; a fresh instance per trajectory (flows build one per sample).

    Subclasses implement:

    - ``async reset(task) -> Observation``: start an episode for one dataset row.
    - ``async step(action) -> StepResult``: apply the model's response; return the next observation,
      the immediate reward, ``terminated`` / ``truncated`` and info. Report a final outcome reward in
      ``StepResult.outcome_reward`` (once), never also inside ``reward``.
    - optionally ``async close()`` to release resources (sandboxes, connections).

    Run ``agent_r1.envs.check_env(env, task)`` to check that an environment honours this contract.
    """

    @abstractmethod
    async def reset(self, task: Task) -> Observation: ...

    @abstractmethod
    async def step(self, action: Action) -> StepResult: ...

    async def close(self) -> None:  # noqa: B027 - optional hook, empty by design
        return None
