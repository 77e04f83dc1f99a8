"""A real environment that fails, for the run-health tests (importable by Ray actors via PYTHONPATH=tests).

``FailingResetEnv`` is ``LowByteEnv`` (tests/trainer_envs.py) whose ``reset`` raises for the listed
task ids, or for every task: a broken environment, or one broken on part of the data.
"""

from __future__ import annotations

from trainer_envs import LowByteEnv

from agent_r1.types import Observation, Task


class FailingResetEnv(LowByteEnv):
    def __init__(self, tokenizer, failing: list[str] | None = None) -> None:
        super().__init__(tokenizer)
        self.failing = None if failing is None else set(failing)

    async def reset(self, task: Task) -> Observation:
        if self.failing is None or task["id"] in self.failing:
            raise RuntimeError(f"reset is broken for task {task['id']}")
        return await super().reset(task)
