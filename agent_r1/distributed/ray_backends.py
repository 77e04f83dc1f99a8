"""The Ray backends of the one RL loop (``agent_r1.train.trainer.Trainer``): a ``RolloutPool`` of
engine actors and a ``LearnerGroup`` of torch.distributed workers, each built in its actors from the
config (docs/distributed.md)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import ray

from agent_r1.distributed.learner_group import LearnerGroup
from agent_r1.distributed.rollout_actor import RolloutPool
from agent_r1.train.config import TrainConfig

__all__ = ["absolute_paths", "actor_runtime_env", "ray_backends"]


def ray_backends(config: TrainConfig, runtime_env: dict | None = None) -> tuple[RolloutPool, LearnerGroup]:
    """Start the rollout actors and the learner workers of ``config`` (``distributed.*``).

    Starts a local Ray cluster when none is running and ``distributed.address`` is unset (the learner
    group stops it again on ``close``); otherwise joins the running one (``ray.init(address=...)``)."""
    owns_ray = False
    if not ray.is_initialized():
        ray.init(address=config.distributed.address, include_dashboard=False)
        owns_ray = True
    rollouts = None
    try:
        rollouts = RolloutPool(config, runtime_env)
        return rollouts, LearnerGroup(config, runtime_env, owns_ray=owns_ray)
    except BaseException:
        if rollouts is not None:
            rollouts.close()
        if owns_ray:
            ray.shutdown()
        raise


def absolute_paths(config: TrainConfig) -> TrainConfig:
    """Make the paths that actors open absolute: actors may run in another working directory. Model
    paths that do not exist here stay as they are (hub names, or folders that exist only on the nodes)."""

    def local(path: str | None) -> str | None:
        return str(Path(path).resolve()) if path and Path(path).exists() else path

    model = replace(config.model, path=local(config.model.path), tokenizer=local(config.model.tokenizer))
    trainer = replace(config.trainer, run_dir=str(Path(config.trainer.run_dir).resolve()))
    return replace(config, model=model, trainer=trainer)


def actor_runtime_env(extra_paths: Sequence[str]) -> dict:
    """A runtime env that puts ``extra_paths`` on the actors' ``PYTHONPATH`` (custom env modules)."""
    paths = [*extra_paths, os.environ.get("PYTHONPATH", "")]
    return {"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in paths if p)}}
