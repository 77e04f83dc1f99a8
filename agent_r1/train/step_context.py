"""What a learning phase is (``agent_r1.train.phases``): a unit ``(batch, context) -> (batch,
metrics)`` and the ``StepContext`` it reads besides the batch. Both live apart from the sequence of
phases so that a phase kept with what it serves (``agent_r1.train.critic``, ``agent_r1.train.teacher``,
``agent_r1.train.update``) names its context without importing the module that lists it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agent_r1.algos import Needs, ValueObjective
from agent_r1.train.batch import TrainBatch
from agent_r1.train.config import TrainConfig
from agent_r1.train.learner import TokenLoss
from agent_r1.train.role_baseline import RoleBaselines

__all__ = ["Phase", "StepContext"]


@dataclass(frozen=True)
class StepContext:
    """What the learning phases of step ``step`` read besides the batch: the configuration, the
    learner and rollout backends (``agent_r1.train.backends``), the objectives, what the
    configured estimator needs (``agent_r1.algos.Needs``) and the state the phases keep from step to
    step (``baselines``: ``rae``'s running mean per role, ``agent_r1.train.role_baseline``)."""

    config: TrainConfig
    learner: Any  # a LearnerBackend
    rollouts: Any  # a RolloutBackend (the update puts its engine to sleep)
    step: int
    objective: TokenLoss
    value_objective: ValueObjective
    needs: Needs
    baselines: RoleBaselines | None = None


Phase = Callable[[TrainBatch, StepContext], tuple[TrainBatch, dict[str, float]]]
