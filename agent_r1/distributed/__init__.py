"""Scale-out on Ray (docs/distributed.md): rollout engine actors, a torch.distributed learner group and
a driver that runs the single-process trainer's phases on them. The only package that imports Ray."""

from agent_r1.distributed.driver import RayTrainer, actor_runtime_env, train_on_ray
from agent_r1.distributed.learner_group import LearnerFailure, LearnerGroup
from agent_r1.distributed.rollout_actor import RolloutFailure, RolloutPool

__all__ = [
    "LearnerFailure",
    "LearnerGroup",
    "RayTrainer",
    "RolloutFailure",
    "RolloutPool",
    "actor_runtime_env",
    "train_on_ray",
]
