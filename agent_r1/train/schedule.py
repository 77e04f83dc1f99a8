"""Which rollout a training step trains on, and when the rollout engine takes the learner's weights.

``trainer.mode: sync``: a step's rollout runs when the step asks for it, with the newest weights, and
a preemption signal stops it (``agent_r1.train.preemption``). ``trainer.mode: async``: the rollout of
step k + 1 is submitted before the update of step k and runs while it trains (one-step-off-policy
pipelining, as in AReaL, arXiv 2505.24298, and verl's one-step-off async trainer), on a rollout thread
in this process or on Ray's actors. Sampling is paced by the learner, never dropped: at most one
rollout runs ahead. With ``trainer.partial_rollouts`` every update is pushed into the rollout in
flight (its trajectories continue with the new weights from their next step); otherwise the engine's
weights are refreshed before a rollout is submitted whenever its staleness (the version its update
starts from minus the version that sampled it) would exceed ``trainer.max_staleness``.

Every rollout is seeded by (run seed, step, DAPO resampling round): each request's sampling seed is
derived from it (``agent_r1.rollout.seeded``). A checkpoint holds the schedule's ``state``: the policy
version and, in async mode, the next step's finished rollout, so a resumed run trains exactly those
samples — none lost, none sampled twice.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from agent_r1.train.config import TrainConfig
from agent_r1.train.preemption import PreemptionGuard
from agent_r1.types import Task, TrajectoryGroup

__all__ = ["Rollout", "RolloutSchedule"]


@dataclass(frozen=True)
class Rollout:
    """A rollout's groups and when it ran (``time.time()``; None where unknown: restored from a
    checkpoint)."""

    groups: list[TrajectoryGroup]
    started: float | None = None
    finished: float | None = None


@dataclass
class _InFlight:
    """An async rollout submitted ahead of the step that trains on it (``done``: collected, or
    restored from a checkpoint)."""

    step: int
    job: Any = None
    done: Rollout | None = None


class RolloutSchedule:
    """The rollouts of a run over a rollout backend, and the policy versions it samples with."""

    def __init__(self, config: TrainConfig, rollouts, learner, preemption: PreemptionGuard) -> None:
        self.config = config
        self.rollouts = rollouts
        self.learner = learner
        self.preemption = preemption
        self.policy_version = 0  # the learner's: one per update
        self.engine_version = 0  # the version the rollout backend samples with
        self.in_flight: _InFlight | None = None

    def rollout(
        self,
        tasks: Sequence[Task],
        step: int,
        *,
        resample: int = 0,
        next_tasks: Callable[[], Sequence[Task]] | None = None,
    ) -> Rollout:
        """``rollout.n`` samples of every task, all concurrently; in async mode the rollout submitted
        ahead for ``step`` (``next_tasks``: the tasks of step + 1, submitted before this returns)."""
        cfg = self.config.trainer
        if cfg.mode == "sync":
            with self.preemption.stoppable():  # a preemption signal stops a sync rollout
                return self._collect(self._submit(tasks, step, resample))
        if self.in_flight is None or self.in_flight.step != step:
            self.in_flight = _InFlight(step, self._submit(tasks, step))
        rollout = self.finish_in_flight()
        self.in_flight = None
        if next_tasks is not None and step < cfg.steps:
            # The next rollout is trained by the update after this one (learner version + 1).
            if self.policy_version + 1 - self.engine_version > cfg.max_staleness:
                self.push_weights()
            self.in_flight = _InFlight(step + 1, self._submit(next_tasks(), step + 1))
        return rollout

    def finish_in_flight(self) -> Rollout | None:
        """The rollout in flight, waited for (collected once: by its step, a checkpoint or an
        evaluation that must sample with the newest weights only); None when there is none."""
        in_flight = self.in_flight
        if in_flight is None:
            return None
        if in_flight.done is None:
            in_flight.done = self._collect(in_flight.job)
        return in_flight.done

    def new_version(self) -> None:
        """The learner took an update: sync mode and partial rollouts give the rollout backend the
        new weights now (a rollout in flight takes them between requests), async mode without partial
        rollouts when the staleness bound requires (``rollout``)."""
        self.policy_version += 1
        if self.config.trainer.mode == "sync" or self.config.trainer.partial_rollouts:
            self.push_weights()

    def newest_weights(self) -> None:
        """Before an evaluation: the rollout in flight finishes, and the engine samples with the
        newest weights."""
        self.finish_in_flight()
        if self.engine_version != self.policy_version:
            self.push_weights()

    def push_weights(self) -> None:
        self.rollouts.update_weights(self.learner.weights(), self.policy_version)
        self.engine_version = self.policy_version

    def state(self) -> dict[str, Any]:
        """What a checkpoint records: the policy version and (async) the next step's finished rollout."""
        state: dict[str, Any] = {"policy_version": self.policy_version}
        if self.in_flight is not None:
            state["in_flight"] = {"step": self.in_flight.step, "groups": self.finish_in_flight().groups}
        return state

    def restore(self, state: dict[str, Any]) -> None:
        """The schedule a checkpoint's ``state`` recorded; the engine takes the restored weights."""
        self.policy_version = state["policy_version"]
        self.push_weights()
        in_flight = state.get("in_flight")
        if in_flight is not None and self.config.trainer.mode == "async":
            self.in_flight = _InFlight(in_flight["step"], done=Rollout(in_flight["groups"]))

    def _submit(self, tasks: Sequence[Task], step: int, resample: int = 0) -> Any:
        seed = f"{self.config.trainer.seed}:train:{step}" + (f":resample{resample}" if resample else "")
        return self.rollouts.submit(tasks, self.config.rollout.n, seed)

    def _collect(self, job: Any) -> Rollout:
        groups = self.rollouts.collect(job)
        return Rollout(groups, getattr(job, "started", None), getattr(job, "finished", None))
