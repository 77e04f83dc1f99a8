"""The keys the trajectory viewer reads, added to each dumped Step's info (``agent_r1.report.run``
reads them back): the decoded prompt, the response token by token, and the step's advantage."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from agent_r1.types import Step, Trajectory, TrajectoryGroup

__all__ = ["annotate"]


def annotate(
    groups: Sequence[TrajectoryGroup],
    tokenizer,
    success: Callable[[Trajectory], bool],
    step_advantages: Mapping[int, float] | None = None,
) -> list[Trajectory]:
    """The groups' trajectories with ``prompt_text``, ``response_tokens`` and ``advantage`` (the mean
    over the step's trained tokens; 0 for a step that was not trained) in each ``Step.info``, and
    ``success(trajectory)`` in each ``Trajectory.info``. ``step_advantages``: ``id(step)`` -> its
    advantage, for the steps the update trained."""
    advantage_of = step_advantages or {}
    decode = tokenizer.decode

    def annotated(step: Step) -> Step:
        info = {
            **step.info,
            "prompt_text": decode(list(step.prompt_ids)),
            "response_tokens": [decode([token]) for token in step.response_ids],
            "advantage": advantage_of.get(id(step), 0.0),
        }
        return replace(step, info=info)

    return [
        replace(t, steps=tuple(annotated(s) for s in t.steps), info={**t.info, "success": success(t)})
        for group in groups
        for t in group.trajectories
    ]
