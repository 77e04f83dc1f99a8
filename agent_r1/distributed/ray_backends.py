"""The Ray backends of the one RL loop (``agent_r1.train.trainer.Trainer``): a ``RolloutPool`` of
engine actors and a ``LearnerGroup`` of torch.distributed workers, each built in its actors from the
config (docs/distributed.md). ``agent_r1.train.backends.make_backends`` reaches ``ray_backends`` by
name for ``distributed.backend: ray``."""

from __future__ import annotations

import os
from collections.abc import Sequence

import ray

from agent_r1.distributed.learner_group import LearnerGroup
from agent_r1.distributed.rollout_actor import RolloutPool
from agent_r1.train.backends import BackendParts, Backends
from agent_r1.train.config import TrainConfig

__all__ = ["actor_runtime_env", "ray_backends"]


def ray_backends(config: TrainConfig, tokenizer, parts: BackendParts) -> Backends:
    """Start the rollout actors and the learner workers of ``config`` (``distributed.*``) with the
    runtime env ``parts.runtime_env``; the actors load their own tokenizer, models and engines.

    Starts a local Ray cluster when none is running and ``distributed.address`` is unset (the learner
    group stops it again on ``close``); otherwise joins the running one (``ray.init(address=...)``).
    With several policies the actors start from the learner's adapters (``agent_r1.train.policies``)."""
    from transformers import AutoConfig

    model_config = AutoConfig.from_pretrained(config.model.path)
    learner_device = "cuda" if config.distributed.learner_num_gpus > 0 else "cpu"
    owns_ray = False
    if not ray.is_initialized():
        ray.init(address=config.distributed.address, include_dashboard=False)
        owns_ray = True
    rollouts = None
    try:
        rollouts = RolloutPool(config, parts.runtime_env)
        learner = LearnerGroup(config, parts.runtime_env, owns_ray=owns_ray)
        if config.policies:  # every trained adapter, from the learner (a vLLM engine holds none yet)
            rollouts.update_weights(learner.weights(), 0)
    except BaseException:
        if rollouts is not None:
            rollouts.close()
        if owns_ray:
            ray.shutdown()
        raise
    return Backends(rollouts, learner, model_config, learner_device)


def actor_runtime_env(extra_paths: Sequence[str]) -> dict:
    """A runtime env that puts ``extra_paths`` on the actors' ``PYTHONPATH`` (custom env modules)."""
    paths = [*extra_paths, os.environ.get("PYTHONPATH", "")]
    return {"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in paths if p)}}
