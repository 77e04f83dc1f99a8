"""Run health: trajectories that end in ERROR are reported on the console, and too many stop the run.

A flow turns an exception in one sample into an ERROR trajectory so that its siblings go on
(``agent_r1.flows.base``). That must not let a run fail silently, so after every rollout (a training
step's, an evaluation's):

- the first error of each kind (its exception type) is logged once, as a warning naming the
  trajectory that raised it, how many others raised the same, and where;
- when more than ``trainer.max_error_fraction`` of the rollout's trajectories ended in ERROR, or every
  one of them did (nothing is left to learn from or to score), ``rollout_health`` returns a
  ``TrainingHalted`` naming the first error; the trainer raises it, and ``agent-r1 train`` / ``eval``
  exit with code 3.

A run can also fail quietly without a single error: when (nearly) every sample of every task earns
the same reward, group baselines give zero advantage and nothing is learned, step after step.
``ZeroVarianceWatch`` turns that into one warning that names the likely cause and the fix.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from agent_r1.types import Trajectory, TrajectoryGroup, TrajectoryStatus

__all__ = [
    "ErrorKind",
    "TrainingHalted",
    "ZeroVarianceWatch",
    "add_error",
    "error_budget",
    "error_kinds",
    "error_summary",
    "rollout_health",
]

logger = logging.getLogger(__name__)

_QUALIFIED = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")
_FRAME = re.compile(r'^\s*File "(?P<file>.+)", line (?P<line>\d+), in (?P<func>.+)$')


class TrainingHalted(RuntimeError):
    """The run stopped: too many trajectories of one rollout ended in ERROR. ``first_error`` is the
    first one's summary (exception type and message)."""

    def __init__(self, message: str, first_error: str) -> None:
        super().__init__(message)
        self.first_error = first_error


def error_summary(error: str) -> tuple[str, str | None]:
    """``(exception line, root frame)`` of a trajectory's error text (``short_traceback``): e.g.
    ``("TypeError: f() got an unexpected keyword argument 'x'", "env.py:12 in __init__")``. Text that
    is not a traceback is its own summary, with no frame."""
    lines = error.rstrip().splitlines() or [""]
    # The exception lines are the unindented ones after the last frame (a chained exception's blocks
    # are separated by blank lines, so the walk stops at the final exception).
    start = len(lines)
    while start > 0 and lines[start - 1].strip() and not lines[start - 1][0].isspace():
        start -= 1
    tail = [line for line in lines[start:] if not line.startswith("Traceback (")] or lines[-1:]
    kind, sep, message = tail[0].partition(": ")
    if _QUALIFIED.match(kind):  # ConfigError, not agent_r1.train.config.ConfigError
        kind = kind.rsplit(".", 1)[-1]
    summary = " ".join([kind + sep + message, *tail[1:]]).strip()
    # Where it came from: the innermost frame of the first exception of a chain (the root cause, e.g.
    # inside an env's __init__, rather than the wrapper that re-raised it).
    first_exception = next(
        (
            i
            for i, line in enumerate(lines)
            if line.strip() and not line[0].isspace() and not line.startswith("Traceback (")
        ),
        start,
    )
    frames = [m for m in map(_FRAME.match, lines[:first_exception]) if m]
    where = f"{frames[-1]['file']}:{frames[-1]['line']} in {frames[-1]['func']}" if frames else None
    return summary, where


@dataclass(frozen=True)
class ErrorKind:
    """The first ERROR trajectory of one kind in a rollout, and how many trajectories share the kind."""

    trajectory: str  # "group 0:t0, sample 1": its place in the rollout (and in the step's dump)
    summary: str
    where: str | None
    count: int


def add_error(kinds: dict[str, ErrorKind], group_id: str, index: int, trajectory: Trajectory) -> None:
    """Count ``trajectory`` (sample ``index`` of group ``group_id``, status ERROR) in ``kinds``: kind
    (the exception type, or the whole summary of a plain-text error) -> its first occurrence."""
    summary, where = error_summary(trajectory.error or "")
    kind = summary.split(": ", 1)[0]
    if kind in kinds:
        first = kinds[kind]
        kinds[kind] = ErrorKind(first.trajectory, first.summary, first.where, first.count + 1)
    else:
        kinds[kind] = ErrorKind(f"group {group_id}, sample {index}", summary, where, 1)


def error_kinds(groups: Sequence[TrajectoryGroup]) -> dict[str, ErrorKind]:
    """Each kind of error in ``groups`` -> its first occurrence, in rollout order (``add_error``)."""
    kinds: dict[str, ErrorKind] = {}
    for group in groups:
        for index, trajectory in enumerate(group.trajectories):
            if trajectory.status is TrajectoryStatus.ERROR:
                add_error(kinds, group.group_id, index, trajectory)
    return kinds


def rollout_health(
    groups: Sequence[TrajectoryGroup], max_error_fraction: float, rollout: str, see: str | None = None
) -> TrainingHalted | None:
    """``error_budget`` of the errors in ``groups``."""
    total = sum(len(g.trajectories) for g in groups)
    return error_budget(error_kinds(groups), total, max_error_fraction, rollout, see)


def error_budget(
    kinds: dict[str, ErrorKind], total: int, max_error_fraction: float, rollout: str, see: str | None = None
) -> TrainingHalted | None:
    """Log the first error of each kind of a rollout of ``total`` trajectories (named by ``rollout``,
    e.g. "step 3"); return the ``TrainingHalted`` to raise when more than ``max_error_fraction`` of its
    trajectories, or all of them, ended in ERROR (``see``: where the full tracebacks are). A halt's
    message names the first kind, so that kind is not logged as well: each error is said once."""
    errors = sum(k.count for k in kinds.values())
    halts = bool(errors) and (errors == total or errors > max_error_fraction * total)
    for kind in list(kinds.values())[1 if halts else 0 :]:
        logger.warning(
            "%s: %d of %d trajectories ended in ERROR with %s (first: %s%s)",
            rollout,
            kind.count,
            total,
            kind.summary,
            kind.trajectory,
            f", at {kind.where}" if kind.where else "",
        )
    if not halts:
        return None
    if errors == total:
        what = f"every trajectory ({errors} of {total}) ended in ERROR"
    else:
        what = (
            f"{errors} of {total} trajectories ended in ERROR, more than "
            f"trainer.max_error_fraction={max_error_fraction:g} allows"
        )
    first = next(iter(kinds.values()))
    message = f"{rollout}: {what}. First error ({first.trajectory}): {first.summary}"
    if first.where:
        message += f" (at {first.where})"
    if see:
        message += f". Full tracebacks: {see}"
    return TrainingHalted(message, first.summary)


@dataclass
class ZeroVarianceWatch:
    """Warns once when most groups have had zero reward variance for several consecutive steps.

    A group whose samples all earn the same reward has zero advantage under a group baseline (GRPO,
    RLOO, ...; DAPO's ``dynamic_filter`` drops it), so a run where that is true of nearly every group
    trains on nothing. The usual cause is a policy that never succeeds (a randomly initialised or too
    weak model, no warm start), sometimes one that always does (tasks too easy, or learned).

    Feed it every training step: ``observe(step, zero_variance_groups, groups, reward_mean,
    success_mean)`` with the step's ``filter/zero_variance_groups``, the number of groups rolled out,
    ``reward/mean`` and ``success/mean`` (which cause the warning names: a model that never succeeds, one
    that has learned the tasks, or tasks each always or never solved). It
    returns the warning text once, at the ``patience``-th consecutive step on which at least
    ``threshold`` of the groups had zero variance, and None otherwise. A step without groups (every
    trajectory ended in ERROR: the error budget's business) neither counts nor breaks the streak.
    ``group_baseline``: whether the estimator's baseline is the group's (``grpo``, ``rloo``...;
    ``Needs.min_group_size`` > 1); without one (``reinforce_pp``, ``rae``, a critic) a group whose
    samples agree still learns, and the watch stays silent.
    """

    threshold: float = 0.9
    patience: int = 3
    group_baseline: bool = True
    streak: int = field(default=0, init=False)
    warned: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        if not 0 < self.threshold <= 1:
            raise ValueError(f"ZeroVarianceWatch.threshold must be in (0, 1], got {self.threshold}")
        if self.patience < 1:
            raise ValueError(f"ZeroVarianceWatch.patience must be >= 1, got {self.patience}")

    def observe_step(self, step: int, metrics: Mapping[str, float]) -> None:
        """``observe`` with the step's metrics (``filter/zero_variance_groups``, ``filter/groups``,
        ``reward/mean``, ``success/mean``), its warning logged."""
        warning = self.observe(
            step,
            metrics["filter/zero_variance_groups"],
            int(metrics["filter/groups"]),
            metrics.get("reward/mean"),
            metrics.get("success/mean"),
        )
        if warning:
            logger.warning(warning)

    def observe(
        self,
        step: int,
        zero_variance_groups: float,
        groups: int,
        reward_mean: float | None = None,
        success_mean: float | None = None,
    ) -> str | None:
        if groups <= 0 or not self.group_baseline:
            return None
        if zero_variance_groups < self.threshold * groups:
            self.streak = 0
            return None
        self.streak += 1
        if self.warned or self.streak < self.patience:
            return None
        self.warned = True
        reward = "" if reward_mean is None else f" (reward/mean {reward_mean:.3g})"
        head = (
            f"step {step}: {zero_variance_groups:g} of {groups} groups had zero reward variance{reward}, "
            f"and at least {self.threshold:.0%} did for {self.streak} steps in a row: every sample of a "
            "task earns the same reward, so its advantages are zero and the policy is not learning. "
        )
        look = " Look at a few trajectories: agent-r1 view RUN_DIR."
        warm_start = (
            "warm-start it on demonstrations first (agent_r1.train.sft, see docs/tutorial.md, 'Warm start')"
        )
        if success_mean is None:
            return (
                f"{head}Most likely the model never succeeds (a randomly initialised or too weak model): "
                f"{warm_start}; if it always succeeds, the tasks are too easy.{look}"
            )
        success = f"(success/mean {success_mean:.3g})"
        if success_mean >= 0.9:
            return (
                f"{head}Nearly every sample succeeds {success}: the model has learned these tasks, so "
                f"further steps train on little; give it harder tasks, or stop here.{look}"
            )
        if success_mean <= 0.1:
            return (
                f"{head}The model almost never succeeds {success}: a randomly initialised or too weak "
                f"model; {warm_start}, or give it easier tasks.{look}"
            )
        return (
            f"{head}Some tasks are always solved and the others never {success}: each task's samples "
            "agree, so sampling does not explore; a higher temperature or a larger group (rollout.n) "
            f"lets a group disagree, tasks nearer the model's threshold do too.{look}"
        )
