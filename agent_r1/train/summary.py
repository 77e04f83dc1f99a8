"""What a rollout's trajectories say, in numbers: the step's rollout metrics (one walk over the
groups), the evaluation's, and the reward a ``reward_fn`` gives instead of the env's.

Environment-specific counters are the environments' own: each ``Step.metrics`` name (``StepResult.metrics``)
is averaged over the steps that report it — a name with a namespace (``tools/calls_per_step``) is
logged as it is, a bare one (``invalid_actions``) as ``env/<name>`` — and a count (a name ending in
``_per_trajectory``, e.g. the summary steps a context policy adds) is summed per trajectory and
averaged over the trajectories. Nothing here knows an env.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

from agent_r1.train.health import ErrorKind, add_error
from agent_r1.types import Step, Task, Trajectory, TrajectoryGroup, TrajectoryStatus

__all__ = [
    "RewardFn",
    "RolloutSummary",
    "env_metrics",
    "episode_count",
    "evaluation_metrics",
    "score_groups",
    "summarize_rollout",
    "trajectory_success",
]

PER_TRAJECTORY = "_per_trajectory"
"""The suffix of a ``Step.metrics`` name that counts per trajectory (``env_metrics``)."""

RewardFn = Callable[[Trajectory, Task], float]


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def trajectory_success(trajectory: Trajectory) -> bool:
    """``info["success"]`` when the environment reports it, else a positive total reward."""
    if "success" in trajectory.info:
        return bool(trajectory.info["success"])
    return trajectory.total_reward > 0


def env_metrics(steps: Iterable[Step]) -> dict[str, float]:
    """Each ``Step.metrics`` name's mean over the steps that report it (see the module docstring)."""
    reported: dict[str, list[float]] = {}
    for step in steps:
        for name, value in step.metrics.items():
            if name.endswith(PER_TRAJECTORY):
                continue  # a count: per trajectory (``trajectory_counts``)
            reported.setdefault(name if "/" in name else f"env/{name}", []).append(value)
    return {name: _mean(values) for name, values in sorted(reported.items())}


def trajectory_counts(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """Each counted ``Step.metrics`` name (ending in ``_per_trajectory``): its sum over a trajectory's
    steps, averaged over ``trajectories`` (0 for one that reports none)."""
    totals: dict[str, float] = {}
    for t in trajectories:
        for step in t.steps:
            for name, value in step.metrics.items():
                if name.endswith(PER_TRAJECTORY):
                    totals[name] = totals.get(name, 0.0) + value
    return {name: total / len(trajectories) for name, total in sorted(totals.items())}


@dataclass(frozen=True)
class RolloutSummary:
    """A rollout in numbers (``summarize_rollout``): its ``metrics``, how many trajectories it has
    and its errors by kind (``agent_r1.train.health.error_budget`` reads them)."""

    metrics: dict[str, float]
    trajectories: int
    error_kinds: dict[str, ErrorKind]


def summarize_rollout(groups: Sequence[TrajectoryGroup], policy_version: int) -> RolloutSummary:
    """One walk over a rollout: its means over the non-ERROR trajectories, its error and ending
    fractions, the sampled tokens, the seconds a trajectory waited on its env and on the engine
    (``time/env_wait``, ``time/generate_wait``), the environments' own counters, (``async/*``) how
    many policy versions the samples lag ``policy_version`` (the version their update starts from),
    and its errors by kind. A mean over none is left out, not logged as nan (``rollout/error_fraction`` says why)."""
    total = errors = sampled = 0
    kinds: dict[str, ErrorKind] = {}
    rewards, successes, lengths, steps_per, truncated, step_limit = [], [], [], [], [], []
    staleness, mixed = [], []
    env_wait, generate_wait = [], []  # seconds per trajectory (Step.timings)
    reported: list[Step] = []
    usable: list[Trajectory] = []
    for group in groups:
        for index, t in enumerate(group.trajectories):
            total += 1
            sampled += t.num_response_tokens
            if any("env_step" in s.timings for s in t.steps):
                env_wait.append(sum(s.timings.get("env_step", 0.0) for s in t.steps))
            if any("generate" in s.timings for s in t.steps):
                generate_wait.append(sum(s.timings.get("generate", 0.0) for s in t.steps))
            if t.steps:
                versions = [s.policy_version for s in t.steps]
                staleness += [policy_version - v for v in versions]
                mixed.append(float(len(set(versions)) > 1))  # a weight update landed in it
            if t.status is TrajectoryStatus.ERROR:
                errors += 1
                add_error(kinds, group.group_id, index, t)
                continue
            rewards.append(t.total_reward)
            successes.append(float(trajectory_success(t)))
            steps_per.append(len(t.steps))
            truncated.append(float(t.status is TrajectoryStatus.TRUNCATED))
            # status OK covers both endings; these ran out of steps (the env's or the flow's limit)
            step_limit.append(
                float(t.status is TrajectoryStatus.OK and bool(t.steps) and t.steps[-1].truncated)
            )
            usable.append(t)
            lengths += [len(s.response_ids) for s in t.steps]
            reported += [s for s in t.steps if s.metrics]
    metrics = {
        "reward/mean": _mean(rewards),
        "success/mean": _mean(successes),
        "response_length/mean": _mean(lengths),
        "steps_per_trajectory/mean": _mean(steps_per),
        "rollout/error_fraction": errors / max(total, 1),
        "rollout/truncated_fraction": _mean(truncated),
        "rollout/step_limit_fraction": _mean(step_limit),
        "throughput/sampled_tokens": float(sampled),
    }
    if staleness:
        metrics["async/staleness_mean"] = _mean(staleness)
        metrics["async/staleness_max"] = float(max(staleness))
        metrics["async/mixed_version_fraction"] = _mean(mixed)
    if env_wait:  # a trajectory's seconds in env.step (its tools, its judge), mean and slowest
        metrics["time/env_wait"] = _mean(env_wait)
        metrics["time/env_wait_max"] = max(env_wait)
    if generate_wait:  # ... and waiting for the engine's responses (queueing included)
        metrics["time/generate_wait"] = _mean(generate_wait)
    metrics.update(env_metrics(reported))
    metrics.update(trajectory_counts(usable))
    metrics = {name: value for name, value in metrics.items() if not math.isnan(value)}
    return RolloutSummary(metrics, total, kinds)


def score_groups(
    groups: list[TrajectoryGroup], tasks: Sequence[Task], reward_fn: RewardFn | None
) -> list[TrajectoryGroup]:
    """``reward_fn(trajectory, task)`` as each non-ERROR trajectory's outcome reward (None: unchanged)."""
    if reward_fn is None:
        return groups
    return [
        replace(
            g,
            trajectories=tuple(
                t
                if t.status is TrajectoryStatus.ERROR
                else replace(t, outcome_reward=float(reward_fn(t, task)))
                for t in g.trajectories
            ),
        )
        for g, task in zip(groups, tasks, strict=True)
    ]


def episode_count(trajectories: Iterable[Trajectory]) -> int:
    """How many episodes ``trajectories`` come from: the trajectories of one episode of several roles
    share ``info["episode"]`` (``agent_r1.flows.base.rollout_group``) and count once; any other
    trajectory is an episode of its own."""
    linked: set[str] = set()
    alone = 0
    for t in trajectories:
        episode = t.info.get("episode")
        if isinstance(episode, str):
            linked.add(episode)
        else:
            alone += 1
    return len(linked) + alone


def evaluation_metrics(groups: Sequence[TrajectoryGroup]) -> dict[str, float]:
    """``eval/reward`` and ``eval/success`` over every trajectory (ERROR ones count as 0),
    ``eval/error_fraction`` (the share of trajectories in ERROR), and what they were measured on:
    ``eval/tasks`` (one group per task), ``eval/episodes`` (tasks x samples; an episode of several
    roles is one) and ``eval/trajectories`` (one per role of each episode). The report's headline
    reads "100 tasks x 4" from the first two."""
    trajectories = [t for g in groups for t in g.trajectories]
    ok = [t.status is not TrajectoryStatus.ERROR for t in trajectories]
    return {
        "eval/tasks": float(len(groups)),
        "eval/episodes": float(episode_count(trajectories)),
        "eval/trajectories": float(len(trajectories)),
        "eval/error_fraction": _mean([float(not k) for k in ok]),
        "eval/reward": _mean([t.total_reward if k else 0.0 for t, k in zip(trajectories, ok, strict=True)]),
        "eval/success": _mean(
            [float(k and trajectory_success(t)) for t, k in zip(trajectories, ok, strict=True)]
        ),
    }
