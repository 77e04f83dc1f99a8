"""Case team: two roles that need opposite behaviour from the same prompt (issue 50's specialisation
task, ``benchmarks/multi_agent.py``).

A task names a topic. Writer ``A`` and then writer ``B`` each write one short sentence about it; A
scores the fraction of its letters that are upper case, B the fraction that are lower case (0 for a
reply without letters). The team's outcome is the mean of the two, given to both roles (a
cooperative reward: ``StepResult.outcome_reward`` as a float is every role's). ``info["success"]``:
the team scored at least ``success_threshold`` (0.75).

Why this task: one policy that cannot tell the roles apart writes the same distribution for both,
so whatever it writes, A's score plus B's is 1 and the team's mean is at most 0.5 in expectation.
Telling them apart is the whole task. Three ways to do it, which the benchmark compares at equal
samples:

- ``role_prompt: false`` and one policy: the prompts are identical; the policy cannot specialise.
- ``role_prompt: true`` and one policy: each prompt names its writer ("You are writer A."); the
  policy must learn to condition on it.
- ``role_prompt: false`` and a policy per role (``policies: {A: {}, B: {}}``): each role's adapter
  learns its own case from the identical prompt.

Rows: ``{"id", "topic"}`` (``make_tasks``); train and held-out topics are disjoint (``split``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agent_r1.envs.base import AgentEnv
from agent_r1.types import Action, Observation, StepResult, Task

__all__ = ["ROLES", "TOPICS", "CaseTeamEnv", "case_score", "make_tasks", "split"]

ROLES = ("A", "B")
TOPICS = (
    "rain",
    "bread",
    "rivers",
    "clocks",
    "trains",
    "gardens",
    "winter",
    "music",
    "bees",
    "maps",
    "candles",
    "bridges",
    "lakes",
    "kites",
    "snow",
    "apples",
    "owls",
    "ships",
    "forests",
    "coffee",
    "stars",
    "books",
    "wind",
    "tea",
    "dogs",
    "cats",
    "roads",
    "hills",
    "fire",
    "glass",
    "paper",
    "boats",
    "stones",
    "birds",
    "clouds",
    "islands",
    "rockets",
    "flowers",
    "honey",
    "salt",
)


def case_score(text: str, role: str) -> float:
    """The fraction of ``text``'s letters in ``role``'s case (A: upper, B: lower); 0 without letters."""
    letters = [c for c in text if c.isalpha()]
    if not letters:
        return 0.0
    wanted = str.isupper if role == "A" else str.islower
    return sum(1 for c in letters if wanted(c)) / len(letters)


def make_tasks(topics: Sequence[str]) -> list[dict[str, Any]]:
    return [{"id": f"case/{topic}", "topic": topic} for topic in topics]


def split(held_out: int = 10) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train, held-out) rows: the last ``held_out`` topics are held out."""
    return make_tasks(TOPICS[:-held_out]), make_tasks(TOPICS[-held_out:])


class CaseTeamEnv(AgentEnv):
    """Writer A, then writer B, on one topic (see the module docstring).

    Args:
        role_prompt: name the writer in its prompt ("You are writer A."); False: the two prompts are
            identical.
        success_threshold: ``info["success"]`` when the team's score reaches it.
    """

    task_fields = ("id", "topic")

    def __init__(self, role_prompt: bool = False, success_threshold: float = 0.75) -> None:
        self.role_prompt = role_prompt
        self.success_threshold = success_threshold

    def _observation(self, role: str) -> Observation:
        ask = f"Write one short sentence about {self.topic}."
        text = f"You are writer {role}. {ask}" if self.role_prompt else ask
        return Observation(messages=({"role": "user", "content": text},), role=role)

    async def reset(self, task: Task) -> Observation:
        self.topic = str(task["topic"])
        self.scores: dict[str, float] = {}
        return self._observation(ROLES[0])

    async def step(self, action: Action) -> StepResult:
        role = ROLES[len(self.scores)]
        self.scores[role] = case_score(action.text, role)
        if len(self.scores) < len(ROLES):
            return StepResult(
                self._observation(ROLES[len(self.scores)]), metrics={f"score_{role}": self.scores[role]}
            )
        team = sum(self.scores.values()) / len(ROLES)
        return StepResult(
            None,
            terminated=True,
            outcome_reward=team,
            info={"success": team >= self.success_threshold, "scores": dict(self.scores)},
            metrics={f"score_{role}": self.scores[role]},
        )
