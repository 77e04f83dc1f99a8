"""Rollout actors (each holds one engine) and the driver's pool that feeds them samples and survives deaths.

The unit of work is one sample: ``(task index, sample index)`` of a step. The pool sends every sample of
a task to the same actor, collects the trajectories as they finish, and when an actor dies mid-rollout
(``RayActorError``) it starts a new actor in that slot, gives it the current weights and re-queues
exactly the samples that had not come back. Every ``(task, sample)`` is in the batch exactly once.

Seeding: an actor seeds requests with ``agent_r1.rollout.seeded.SeededEngine``, one per (step, task,
sample), by the same function as the single-process trainer (``sample_engine``), so a Ray rollout samples
the same trajectories as the single-process trainer, in the same order. A re-queued sample's attempt gives
it a fresh seed base (``:retry<k>``): its siblings' seeds are not reused, so a restart never duplicates a
trajectory.

Versions: an actor's engine swaps weights only between requests (``agent_r1.rollout.versioned``):
``update_weights`` waits for the requests being sampled and holds the next ones, so every step is
stamped with the one policy version that sampled it, also when the swap lands mid-trajectory
(``trainer.partial_rollouts``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import ray
from ray.exceptions import RayActorError

from agent_r1.distributed.placement import scheduling
from agent_r1.rollout.versioned import VersionedEngine
from agent_r1.train.config import TrainConfig
from agent_r1.types import Task, Trajectory, TrajectoryGroup

__all__ = ["RolloutActor", "RolloutFailure", "RolloutJob", "RolloutPool", "SampleKey", "SampleRequest"]


@dataclass(frozen=True, order=True)
class SampleKey:
    task_index: int
    sample_index: int


@dataclass(frozen=True)
class SampleRequest:
    """One sample to roll out: small and picklable (the actor builds everything heavy itself)."""

    key: SampleKey
    task: Task
    group_id: str
    seed_base: str
    evaluation: bool = False
    attempt: int = 0


class RolloutFailure(RuntimeError):
    """Rollout actors kept dying: more restarts in one rollout than ``distributed.max_actor_restarts``."""


@dataclass
class _GroupSeeds:
    """One group's seeded engine on an actor, and how many of its samples have started."""

    engine: Any
    starts: int = 0


class _OrderedSample:
    """One sample's view of its group's seeded engine. Its first request's position among the group's
    first requests is the occurrence number the seeded engine gives that (shared) prompt, i.e. the
    sample's position in the single-process trainer's group; the pool orders groups by it."""

    def __init__(self, group: _GroupSeeds) -> None:
        self.group = group
        self.order: int | None = None

    async def generate(self, prompt_ids, params):
        if self.order is None:
            self.order = self.group.starts
            self.group.starts += 1
        return await self.group.engine.generate(prompt_ids, params)


class RolloutActor:
    """A Ray actor (async: its samples run concurrently in one continuous batch) holding one engine
    and the configured train / eval flows, all built here from the config."""

    def __init__(self, config: TrainConfig, slot: int) -> None:
        from agent_r1.train.backends import routed_engine
        from agent_r1.train.builders import load_config_tokenizer, rollout_engine, rollout_flows
        from agent_r1.train.process import apply_process_settings

        apply_process_settings(config.trainer)
        self.slot = slot
        tokenizer = load_config_tokenizer(config)
        # The weights at model.path, frozen (the engine only samples; the learner pushes updates);
        # with several policies the HF engine holds every policy's adapter on them, and the roles of
        # a server's policy go to the server (agent_r1.train.policies).
        source = None
        if config.policies and config.rollout.engine == "hf":
            from agent_r1.train.policies import policy_model

            source = policy_model(config)
        self.engine = VersionedEngine(
            routed_engine(config, tokenizer, rollout_engine(config, tokenizer, source))
        )
        self.flow, self.eval_flow = rollout_flows(config, tokenizer)
        self._groups: dict[tuple[str, int, int], _GroupSeeds] = {}
        self._seed_base = ""

    def ready(self) -> int:
        return self.slot

    def _engine_for(self, request: SampleRequest) -> _OrderedSample:
        from agent_r1.rollout.seeded import sample_engine

        if request.seed_base != self._seed_base:
            self._seed_base, self._groups = request.seed_base, {}
        key = (request.seed_base, request.key.task_index, request.key.sample_index, request.attempt)
        if key not in self._groups:
            self._groups[key] = _GroupSeeds(sample_engine(self.engine, *key))
        return _OrderedSample(self._groups[key])

    async def sample(self, request: SampleRequest) -> tuple[tuple[Trajectory, ...], int, float]:
        """One sample's trajectories (one, or one per role of an episode of several, each with
        ``info["episode"]`` as ``rollout_group`` gives it), its start order within its group on this
        actor and when it finished (``time.time()``); a failing flow becomes an ERROR trajectory."""
        from agent_r1.flows.base import rollout_group

        flow = self.eval_flow if request.evaluation else self.flow
        engine = self._engine_for(request)
        watch = self.engine.watch()
        index = request.key.sample_index
        group = watch.stamp(
            await rollout_group(flow, engine, request.task, 1, request.group_id, first_sample=index)
        )
        # Ordered by sample index: each sample is seeded by its own identity (sample_seed_base).
        return tuple(group.trajectories), index, time.time()

    async def update_weights(self, named_tensors: Sequence[tuple[str, Any]], version: int) -> int:
        """Swap in new weights between requests (in-flight samples continue from their next step)."""
        raw = self.engine.engine
        await self.engine.swap(lambda: raw.update_weights(named_tensors, version), version)
        return version


@dataclass
class RolloutJob:
    """Samples submitted to the pool and not yet collected."""

    tasks: list[Task]
    n: int
    # object ref -> (request, actor slot, generation of the actor in that slot when it was sent)
    pending: dict[Any, tuple[SampleRequest, int, int]] = field(default_factory=dict)
    done: dict[SampleKey, tuple[Trajectory, ...]] = field(default_factory=dict)  # a trajectory per role
    # sort key of each sample inside its group: (attempt, start order on its actor, sample index)
    order: dict[SampleKey, tuple[int, int, int]] = field(default_factory=dict)
    requeued: list[SampleKey] = field(default_factory=list)
    started: float = field(default_factory=time.time)  # wall-clock submit time
    finished: float | None = None  # when its last sample finished on its actor


class RolloutPool:
    """The driver's handle on ``distributed.num_rollout_actors`` rollout actors: the Ray rollout
    backend (``agent_r1.train.backends.RolloutBackend``)."""

    def __init__(self, config: TrainConfig, runtime_env: dict | None = None) -> None:
        dist = config.distributed
        self.config = config
        self._remote = ray.remote(RolloutActor)
        self._options = dict(
            num_cpus=dist.rollout_num_cpus,
            num_gpus=dist.rollout_num_gpus,
            max_restarts=0,
            max_concurrency=1000,
            runtime_env=runtime_env,
        )
        self.actors = [self._start(slot) for slot in range(dist.num_rollout_actors)]
        self.generations = [0] * dist.num_rollout_actors
        self.restarts = 0
        self._weights: tuple[Any, int] | None = None  # (object ref of the named tensors, version)
        ray.get([a.ready.remote() for a in self.actors])

    def _start(self, slot: int):
        return self._remote.options(
            **self._options, **scheduling(self.config, slot, self._options["num_gpus"])
        ).remote(self.config, slot)

    def _restart(self, slot: int) -> None:
        self.actors[slot] = self._start(slot)
        self.generations[slot] += 1
        self.restarts += 1
        ray.get(self.actors[slot].ready.remote())
        if self._weights is not None:
            ray.get(self.actors[slot].update_weights.remote(*self._weights))

    def _send(self, job: RolloutJob, request: SampleRequest) -> None:
        slot = request.key.task_index % len(self.actors)
        ref = self.actors[slot].sample.remote(request)
        job.pending[ref] = (request, slot, self.generations[slot])

    def submit(
        self,
        tasks: Sequence[Task],
        n: int,
        seed_base: str,
        *,
        evaluation: bool = False,
    ) -> RolloutJob:
        """Send ``n`` samples of every task; group ids by ``agent_r1.flows.base.task_group_id``."""
        from agent_r1.flows.base import task_group_id

        job = RolloutJob(list(tasks), n)
        for i, task in enumerate(tasks):
            group_id = task_group_id(i, task)
            for j in range(n):
                self._send(job, SampleRequest(SampleKey(i, j), task, group_id, seed_base, evaluation))
        return job

    def collect(
        self, job: RolloutJob, on_result: Callable[[SampleKey, int], None] | None = None
    ) -> list[TrajectoryGroup]:
        """Wait for every sample of ``job``; restart dead actors and re-queue their unfinished samples.

        ``on_result(key, slot)`` is called as each sample arrives (progress reporting; tests use it to
        kill an actor mid-rollout)."""
        from agent_r1.envs.context import task_id
        from agent_r1.flows.base import task_group_id

        restarts_here = 0
        while job.pending:
            (ref,), _ = ray.wait(list(job.pending), num_returns=1)
            request, slot, generation = job.pending.pop(ref)
            try:
                trajectories, order, finished = ray.get(ref)
            except RayActorError as error:
                if generation == self.generations[slot]:
                    restarts_here += 1
                    if restarts_here > self.config.distributed.max_actor_restarts:
                        raise RolloutFailure(
                            f"rollout actor {slot} died {restarts_here} times in one rollout "
                            f"(distributed.max_actor_restarts = "
                            f"{self.config.distributed.max_actor_restarts}): {error}"
                        ) from error
                    self._restart(slot)
                job.requeued.append(request.key)
                self._send(job, replace(request, attempt=request.attempt + 1))
                continue
            if request.key in job.done:
                raise RuntimeError(f"sample {request.key} came back twice")
            job.done[request.key] = trajectories
            job.finished = max(job.finished or finished, finished)
            job.order[request.key] = (request.attempt, order, request.key.sample_index)
            if on_result is not None:
                on_result(request.key, slot)
        groups = []
        for i, task in enumerate(job.tasks):
            keys = sorted((SampleKey(i, j) for j in range(job.n)), key=job.order.__getitem__)
            trajectories = tuple(t for k in keys for t in job.done[k])
            groups.append(TrajectoryGroup(task_group_id(i, task), task_id(task), trajectories))
        return groups

    def update_weights(self, weights_ref: Any, version: int) -> None:
        """Give every actor the weights behind ``weights_ref`` (an object ref of named tensors, or with
        several policies of every trained adapter, passed through Ray without the driver
        materialising them); kept for actors started later, which therefore get the whole policy."""
        self._weights = (weights_ref, version)
        ray.get([a.update_weights.remote(weights_ref, version) for a in self.actors])

    def sleep(self) -> None:
        """Nothing to free: each engine has its own devices (the learner trains elsewhere)."""

    def wake(self) -> None:
        pass

    def metrics(self) -> dict[str, float]:
        return {"rollout/actor_restarts": float(self.restarts)}

    def close(self) -> None:
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
