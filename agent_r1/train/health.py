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
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass

from agent_r1.types import TrajectoryGroup, TrajectoryStatus

__all__ = ["ErrorKind", "TrainingHalted", "error_kinds", "error_summary", "rollout_health"]

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


def error_kinds(groups: Sequence[TrajectoryGroup]) -> dict[str, ErrorKind]:
    """Kind (the exception type, or the whole summary of a plain-text error) -> its first occurrence,
    in rollout order."""
    kinds: dict[str, ErrorKind] = {}
    for group in groups:
        for index, trajectory in enumerate(group.trajectories):
            if trajectory.status is not TrajectoryStatus.ERROR:
                continue
            summary, where = error_summary(trajectory.error or "")
            kind = summary.split(": ", 1)[0]
            if kind in kinds:
                first = kinds[kind]
                kinds[kind] = ErrorKind(first.trajectory, first.summary, first.where, first.count + 1)
            else:
                kinds[kind] = ErrorKind(f"group {group.group_id}, sample {index}", summary, where, 1)
    return kinds


def rollout_health(
    groups: Sequence[TrajectoryGroup], max_error_fraction: float, rollout: str, see: str | None = None
) -> TrainingHalted | None:
    """Log the first error of each kind in ``groups`` (a rollout, named by ``rollout``, e.g. "step 3");
    return the ``TrainingHalted`` to raise when more than ``max_error_fraction`` of its trajectories, or
    all of them, ended in ERROR (``see``: where the full tracebacks are, for the message)."""
    total = sum(len(g.trajectories) for g in groups)
    kinds = error_kinds(groups)
    for kind in kinds.values():
        logger.warning(
            "%s: %d of %d trajectories ended in ERROR with %s (first: %s%s)",
            rollout,
            kind.count,
            total,
            kind.summary,
            kind.trajectory,
            f", at {kind.where}" if kind.where else "",
        )
    errors = sum(k.count for k in kinds.values())
    if not errors or (errors < total and errors <= max_error_fraction * total):
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
