"""Scale-out on Ray (docs/distributed.md): rollout engine actors and a torch.distributed learner
group, the Ray implementations of the trainer's rollout and learner backends. The only package that
imports Ray; ``agent_r1.train.backends.make_backends`` reaches it through ``distributed.backend:
ray``."""

from agent_r1.distributed.learner_group import LearnerFailure, LearnerGroup
from agent_r1.distributed.ray_backends import actor_runtime_env, ray_backends
from agent_r1.distributed.rollout_actor import RolloutFailure, RolloutPool

__all__ = [
    "LearnerFailure",
    "LearnerGroup",
    "RolloutFailure",
    "RolloutPool",
    "actor_runtime_env",
    "ray_backends",
]
