"""The Ray driver: the single-process trainer's phases, with rollout on actors and updates on a group.

``RayTrainer`` subclasses ``agent_r1.train.trainer.Trainer`` and keeps its loop and phases (``fit``,
``train_step``, score, filter, prepare, advantages, update, dumps, metrics, the error budget)
unchanged. It replaces what the phases run on:

- **rollout** goes to a ``RolloutPool`` of ``distributed.num_rollout_actors`` engine actors;
- **log-probs and updates** go to a ``LearnerGroup`` of ``distributed.num_learner_workers``
  torch.distributed ranks (same interface as ``Learner``; ``distributed.strategy``: DDP or FSDP2);
- **the critic** (``gae_token``, ``gae_step``): each worker also holds the critic under the same
  strategy; ``self.critic`` is a ``CriticGroup`` with the critic ``Learner``'s interface;
- **sync** pushes rank 0's weights to every engine with the new policy version; each trajectory's
  steps record the version that sampled them;
- **checkpoints** are written by rank 0 and loaded by every rank (``--resume``).

The driver holds no model: only the config, the tasks, the tokenizer (to annotate dumps) and handles.

Async mode (``distributed.mode: async``): the rollout of step k+1 is submitted before the update of
step k and runs while it trains (one-step-off-policy pipelining, as in AReaL, arXiv 2505.24298, and
verl's one-step-off async trainer). A trajectory sampled by policy version v and trained by the update
that starts from version u has staleness u - v; engine weights are refreshed before a rollout is
submitted whenever its staleness would otherwise exceed ``distributed.max_staleness`` (so
``max_staleness: 1`` refreshes them every step, larger values save weight transfers). The config
requires an importance-sampling correction against the sampler's log-probs (``algorithm.tis_cap`` or
``algorithm.old_logprobs: sampler``). Deviation: resuming an async run re-samples the step after the
checkpoint with the restored policy (the in-flight rollout is not checkpointed).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import ray

from agent_r1.distributed.learner_group import LearnerGroup
from agent_r1.distributed.parts import TrainerParts, load_driver_tokenizer
from agent_r1.distributed.rollout_actor import RolloutJob, RolloutPool
from agent_r1.train.checkpoint import rng_state, set_rng_state
from agent_r1.train.config import ConfigError, TrainConfig
from agent_r1.train.resume import ResumeMode, resume_checkpoint
from agent_r1.train.trainer import (
    CRITIC_ESTIMATORS,
    RewardFn,
    Trainer,
    _mean,
    _rollout_seed,
    prefix_pair_cost,
    trajectory_success,
)
from agent_r1.types import Task, TrajectoryGroup, TrajectoryStatus

__all__ = ["RayTrainer", "absolute_paths", "actor_runtime_env", "train_on_ray"]


@dataclass
class _InFlight:
    step: int
    job: RolloutJob


class RayTrainer(Trainer):
    """``Trainer`` on a Ray cluster; the same config with ``distributed.backend: ray``.

    Args:
        config: the configuration tree.
        train_tasks / val_tasks / reward_fn / resume / allow_config_change: as for ``Trainer``.
        runtime_env: Ray runtime environment of the actors (e.g. ``{"env_vars": {"PYTHONPATH": ...}}``
            so they can import a custom environment's module).

    Starts a local Ray cluster when none is running and ``distributed.address`` is unset (and stops it
    in ``close``); otherwise joins the running one (``ray.init(address=...)``).
    """

    def __init__(
        self,
        config: TrainConfig,
        *,
        train_tasks: Any = None,
        val_tasks: Any = None,
        reward_fn: RewardFn | None = None,
        resume: ResumeMode = False,
        allow_config_change: bool = False,
        runtime_env: dict | None = None,
    ) -> None:
        # Trainer.__init__ builds a model, an engine and a Learner in this process; the driver needs
        # none of them, so it sets the attributes the inherited phases read, and builds handles.
        if config.distributed.backend != "ray":
            raise ConfigError(
                "distributed.backend", f"RayTrainer needs 'ray', got {config.distributed.backend!r}"
            )
        config = absolute_paths(config)
        self.config = config
        self.resume_from = resume_checkpoint(config, resume, allow_config_change=allow_config_change)
        self.tokenizer = load_driver_tokenizer(config)
        self.train_tasks = None
        if train_tasks is not None or config.data.train:
            self.train_tasks = self._tasks(train_tasks, config.data.train, config.data.split, "data.train")
        self.val_tasks = None
        if val_tasks is not None or config.data.val:
            self.val_tasks = self._tasks(val_tasks, config.data.val, config.data.val_split, "data.val")
            if config.data.max_val_tasks:
                self.val_tasks = self.val_tasks[: config.data.max_val_tasks]
        from transformers import AutoConfig

        self.pair_cost = prefix_pair_cost(config, AutoConfig.from_pretrained(config.model.path))
        parts = TrainerParts(config)
        self.sampling, self.eval_sampling = parts.sampling, parts.eval_sampling
        self.policy_loss, self.policy_loss_config = parts.policy_loss, parts.policy_loss_config
        from agent_r1.algos import AdvantageConfig

        algo = config.algorithm
        self.advantage_config = AdvantageConfig(gamma=algo.gamma, lam=algo.lam, norm_by_std=algo.norm_by_std)
        self.reward_fn = reward_fn
        self.critic = None
        self.policy_version = 0
        self.engine_version = 0
        self.step = 0
        self.run_dir = None
        self.resume = resume
        self._in_flight: _InFlight | None = None
        self._staleness: list[int] = []
        self._owns_ray = False
        if not ray.is_initialized():
            ray.init(address=config.distributed.address, include_dashboard=False)
            self._owns_ray = True
        self.rollouts = RolloutPool(config, runtime_env)
        try:
            self.learner = LearnerGroup(config, runtime_env)
            if config.algorithm.advantage in CRITIC_ESTIMATORS:
                self.critic = self.learner.critic()
        except BaseException:
            self.rollouts.shutdown()
            if self._owns_ray:
                ray.shutdown()
            raise

    # ------------------------------------------------------------------ phases that run remotely

    def train_step(self, step: int) -> dict[str, float]:
        self._staleness = []
        metrics = super().train_step(step)
        if self._staleness:
            metrics["async/staleness_mean"] = _mean([float(s) for s in self._staleness])
            metrics["async/staleness_max"] = float(max(self._staleness))
        metrics["rollout/actor_restarts"] = float(self.rollouts.restarts)
        return metrics

    def rollout(self, tasks: Sequence[Task], step: int, *, resample: int = 0) -> list[TrajectoryGroup]:
        """Phase 1 on the rollout actors; in async mode, also submit step + 1's rollout."""
        if self.config.distributed.mode == "sync":
            groups = self.rollouts.collect(self._submit(tasks, step, resample))
        else:
            groups = self._rollout_async(tasks, step)
        upcoming = self.policy_version  # the version this step's update starts from
        self._staleness = [
            upcoming - s.policy_version for g in groups for t in g.trajectories for s in t.steps
        ]
        return groups

    def _rollout_async(self, tasks: Sequence[Task], step: int) -> list[TrajectoryGroup]:
        if self._in_flight is None or self._in_flight.step != step:
            self._in_flight = _InFlight(step, self._submit(tasks, step))
        groups = self.rollouts.collect(self._in_flight.job)
        self._in_flight = None
        if step < self.config.trainer.steps:
            # The next rollout is trained by the update after this one (learner version + 1).
            if self.policy_version + 1 - self.engine_version > self.config.distributed.max_staleness:
                self._push_weights()
            self._in_flight = _InFlight(step + 1, self._submit(self.sampler.batch(step + 1), step + 1))
        return groups

    def _submit(self, tasks: Sequence[Task], step: int, resample: int = 0) -> RolloutJob:
        seed = _rollout_seed(self.config.trainer.seed, step, resample)
        return self.rollouts.submit(tasks, self.config.rollout.n, seed)

    def sync_weights(self) -> None:
        """Phase 7: a new policy version; sync mode pushes it to the engines now, async mode when the
        staleness bound requires (``rollout``)."""
        self.policy_version += 1
        if self.config.distributed.mode == "sync":
            self._push_weights()

    def _push_weights(self) -> None:
        self.rollouts.update_weights(self.learner.export_weights_ref(), self.policy_version)
        self.engine_version = self.policy_version

    def evaluate(self) -> dict[str, float]:
        """Evaluation on the actors with the newest weights (an in-flight async rollout is collected
        first, since weights change only between rollouts)."""
        if not self.val_tasks:
            return {}
        if self._in_flight is not None:
            self.rollouts.collect(self._in_flight.job)  # completes it; the step re-reads job.done
        if self.engine_version != self.policy_version:
            self._push_weights()
        base = f"{self.config.trainer.seed}:eval:{self.step}"
        job = self.rollouts.submit(self.val_tasks, self.config.rollout.eval_n, base, evaluation=True)
        groups = self.rollouts.collect(job)
        self.check_health(groups, self.step, evaluation=True)
        if self.reward_fn is not None:
            groups = self.score(groups, self.val_tasks)
        trajectories = [t for g in groups for t in g.trajectories]
        ok = [t.status is not TrajectoryStatus.ERROR for t in trajectories]
        return {
            "eval/error_fraction": _mean([float(not k) for k in ok]),
            "eval/reward": _mean(
                [t.total_reward if k else 0.0 for t, k in zip(trajectories, ok, strict=True)]
            ),
            "eval/success": _mean(
                [float(k and trajectory_success(t)) for t, k in zip(trajectories, ok, strict=True)]
            ),
        }

    # ------------------------------------------------------------------ checkpoints and shutdown

    def save_checkpoint(self, step: int) -> Path:
        assert self.run_dir is not None
        state = {"rng": rng_state(), "policy_version": self.policy_version}
        return Path(self.learner.save_checkpoint(str(self.run_dir.checkpoints), step, state))

    def _restore(self) -> int:
        checkpoint = self.resume_from
        if checkpoint is None:
            return 0
        trainer_state = self.learner.load_checkpoint(str(checkpoint))
        set_rng_state(trainer_state["rng"])
        self.policy_version = trainer_state["policy_version"]
        self._push_weights()
        self.step = trainer_state["step"]
        return self.step

    def close(self) -> None:
        """Stop the actors and workers (and the local Ray cluster if this trainer started it)."""
        self.rollouts.shutdown()
        self.learner.shutdown()
        if self._owns_ray:
            ray.shutdown()


def absolute_paths(config: TrainConfig) -> TrainConfig:
    """Make the paths that actors open absolute: actors may run in another working directory. Model
    paths that do not exist here stay as they are (hub names, or folders that exist only on the nodes)."""

    def local(path: str | None) -> str | None:
        return str(Path(path).resolve()) if path and Path(path).exists() else path

    model = replace(config.model, path=local(config.model.path), tokenizer=local(config.model.tokenizer))
    trainer = replace(config.trainer, run_dir=str(Path(config.trainer.run_dir).resolve()))
    return replace(config, model=model, trainer=trainer)


def train_on_ray(config: TrainConfig, **objects: Any) -> dict[str, float]:
    """``RayTrainer(config, **objects).fit()``."""
    return RayTrainer(config, **objects).fit()


def actor_runtime_env(extra_paths: Sequence[str]) -> dict:
    """A runtime env that puts ``extra_paths`` on the actors' ``PYTHONPATH`` (custom env modules)."""
    paths = [*extra_paths, os.environ.get("PYTHONPATH", "")]
    return {"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in paths if p)}}
