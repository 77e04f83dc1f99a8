"""The step-level MDP as data.

| MDP element | type |
|---|---|
| state s_t | ``Step.prompt_ids`` (decided by the environment; see ``Observation``) |
| action a_t | ``Step.response_ids`` + ``Step.logprobs`` (see ``Action``) |
| reward r_t | ``Step.reward`` (immediate) and ``Trajectory.outcome_reward`` (once, at the end) |

Reward accounting: an environment's ``StepResult.reward`` is the *immediate* reward of that step and
is stored in ``Step.reward``; a final, outcome reward (e.g. "was the answer right") is reported once in
``StepResult.outcome_reward`` and stored in ``Trajectory.outcome_reward``. The return of a trajectory is
``sum(step.reward for step in steps) + outcome_reward`` (``Trajectory.total_reward``); no reward is ever
stored in both places, so nothing is counted twice.

Log-probs: ``Completion.logprobs`` / ``Step.logprobs`` are ``log softmax(logits / temperature)`` of each
sampled token over the full vocabulary — temperature applied, top-k / top-p truncation *not*
renormalised into them. The learner recomputes exactly this quantity, so for on-policy RL keep
``top_p=1`` and ``top_k=-1`` (the defaults) or accept the small bias. Every engine honours this.

Everything here is a frozen dataclass with a lossless JSON form (``to_dict`` / ``from_dict``) and
JSONL helpers (``write_jsonl`` / ``read_jsonl``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import Any

__all__ = [
    "Action",
    "Completion",
    "Message",
    "Observation",
    "SamplingParams",
    "Step",
    "StepResult",
    "StopReason",
    "Task",
    "Trajectory",
    "TrajectoryGroup",
    "TrajectoryStatus",
    "read_jsonl",
    "write_jsonl",
]

Message = dict[str, Any]
"""One chat message in the OpenAI / Hugging Face shape: ``{"role": ..., "content": ...}`` and,
for assistant tool calls, ``"tool_calls"``."""

Task = Mapping[str, Any]
"""One dataset row. ``task["id"]``, when present, names it in trajectories."""


class StopReason(str, Enum):
    """Why the sampler stopped generating one response."""

    STOP = "stop"  # an end-of-sequence / stop token or stop string was produced
    LENGTH = "length"  # max_tokens or the model's context length was reached
    ABORT = "abort"  # the request was cancelled or failed inside the engine


class TrajectoryStatus(str, Enum):
    OK = "ok"  # the episode ended normally (terminated, or max steps reached)
    TRUNCATED = "truncated"  # cut short: the prompt outgrew the context, or a time limit
    ERROR = "error"  # the environment, a flow or the engine raised; ``Trajectory.error`` says what


def _tuple_of_ints(values: Iterable[int]) -> tuple[int, ...]:
    return tuple(int(v) for v in values)


def _tuple_of_floats(values: Iterable[float]) -> tuple[float, ...]:
    return tuple(float(v) for v in values)


def _metrics(metrics: Mapping[str, float], owner: str) -> dict[str, float]:
    """``metrics`` as ``{str: float}`` (a bool counts 0 or 1); a name that is not a string or a value
    that is not a number raises, naming both (a counter the trainer cannot average is a bug in the env)."""
    checked = {}
    for name, value in metrics.items():
        if not isinstance(name, str) or not isinstance(value, int | float):
            raise TypeError(f"{owner}.metrics: {name!r} must be a str naming a number, got {value!r}")
        checked[name] = float(value)
    return checked


def _check_role(role: Any, owner: str) -> None:
    if role is not None and (not isinstance(role, str) or not role):
        raise TypeError(f"{owner} must be a non-empty str or None, got {role!r}")


def _float_to_json(x: float) -> float | str:
    # JSON has no NaN / inf; keep them losslessly as strings.
    return x if math.isfinite(x) else repr(x)


def _float_from_json(x: float | str) -> float:
    return float(x)


@dataclass(frozen=True)
class SamplingParams:
    """How one response is sampled. ``top_k=-1`` and ``top_p=1.0`` disable truncation."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings; the response ends after the first one (it is kept)
    seed: int | None = None
    role: str | None = None  # the role whose policy samples this request; None: the run's one policy

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):  # NaN fails every comparison
            raise ValueError(f"SamplingParams.temperature must be finite and >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}")
        _check_role(self.role, "SamplingParams.role")
        object.__setattr__(self, "stop_token_ids", _tuple_of_ints(self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(str(s) for s in self.stop))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "max_tokens": self.max_tokens,
            "stop_token_ids": list(self.stop_token_ids),
            "stop": list(self.stop),
            "seed": self.seed,
            **({} if self.role is None else {"role": self.role}),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SamplingParams:
        return cls(**d)


@dataclass(frozen=True)
class Completion:
    """What an engine returns for one prompt: generated token ids and their sampling log-probs.

    ``logprobs[i]`` is the log-probability of ``token_ids[i]`` under ``softmax(logits / temperature)``
    (see the module docstring). With ``temperature == 0`` (greedy) it is the log-softmax of the raw
    logits. ``error`` is set when ``finish_reason`` is ABORT because this request failed.
    ``policy_version``: the policy version whose weights sampled every token (set by
    ``agent_r1.rollout.versioned.VersionedEngine``; None when nothing tracks versions).
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: StopReason
    text: str | None = None
    error: str | None = None
    policy_version: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_ids", _tuple_of_ints(self.token_ids))
        object.__setattr__(self, "logprobs", _tuple_of_floats(self.logprobs))
        object.__setattr__(self, "finish_reason", StopReason(self.finish_reason))
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(
                f"Completion has {len(self.token_ids)} token ids but {len(self.logprobs)} logprobs"
            )


@dataclass(frozen=True)
class Observation:
    """What the environment shows the model next: exactly one of text, chat messages or token ids.

    - ``token_ids``: the full next prompt, used as is (the environment controls the context exactly).
    - ``messages``: the full conversation; the flow renders it with the tokenizer's chat template.
    - ``text``: a raw text prompt; the flow tokenises it without a template.

    ``state_key`` optionally names the state shown, whatever the prompt looks like: the flow copies it
    to the ``Step.state_key`` of the step taken from it, so step-grouped baselines (``step_grpo``)
    group steps from the same state even when their prompts differ (e.g. an appended history).

    ``role`` names who acts on this observation in an episode of several roles (a planner and an
    executor, the seats of a game): the flow samples the action from that role's policy and puts the
    step in that role's trajectory (docs/multi_agent.md). None: the episode has one role.
    """

    text: str | None = None
    messages: tuple[Message, ...] | None = None
    token_ids: tuple[int, ...] | None = None
    state_key: str | None = None
    role: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("text", "messages", "token_ids") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(
                f"Observation needs exactly one of text, messages, token_ids; got {given or 'none'}"
            )
        if self.state_key is not None and not isinstance(self.state_key, str):
            raise TypeError(
                f"Observation.state_key must be a str or None, got {type(self.state_key).__name__}"
            )
        _check_role(self.role, "Observation.role")
        if self.messages is not None:
            object.__setattr__(self, "messages", tuple(dict(m) for m in self.messages))
        if self.token_ids is not None:
            object.__setattr__(self, "token_ids", _tuple_of_ints(self.token_ids))

    def to_dict(self) -> dict[str, Any]:
        key = {} if self.state_key is None else {"state_key": self.state_key}
        if self.role is not None:
            key["role"] = self.role
        if self.text is not None:
            return {"text": self.text, **key}
        if self.messages is not None:
            return {"messages": [dict(m) for m in self.messages], **key}
        return {"token_ids": list(self.token_ids or ()), **key}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Observation:
        return cls(**d)


@dataclass(frozen=True)
class Action:
    """The model's whole response at one step: its token ids (what is trained on) and their text."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: StopReason = StopReason.STOP

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_ids", _tuple_of_ints(self.token_ids))
        object.__setattr__(self, "finish_reason", StopReason(self.finish_reason))


@dataclass(frozen=True)
class StepResult:
    """What ``AgentEnv.step`` returns (Gymnasium's contract, plus an outcome reward).

    ``terminated``: the task reached a terminal state (answered, failed for good).
    ``truncated``: the episode was cut short from outside the MDP (turn or time limit).
    ``reward``: the immediate reward of this step. ``outcome_reward``: the final reward of the whole
    episode, reported once, normally together with ``terminated``; see the module docstring. In an
    episode of several roles (``Observation.role``) a float is every role's outcome (a team) and a
    mapping ``{role: reward}`` gives each role its own (the seats of a game).
    ``policy_steps``: the policy's own calls that the environment made while computing this
    transition and wants trained (a summary of the history, ``agent_r1.envs.context``); the flow puts
    them into the trajectory right after this step, in order. Each carries its own immediate reward;
    the outcome reaches them, like any step, through the advantage estimator.
    ``metrics``: numbers the environment counts for this step (an invalid action, a win), copied to
    ``Step.metrics``; the trainer logs each name as ``env/<name>``, the mean over the steps of the
    batch that report it (so a name reported on the last step only is a per-trajectory rate). A
    name ending in ``_per_trajectory`` is a count instead: summed over each trajectory's steps and
    averaged over the rollout's trajectories (``context/summary_steps_per_trajectory``).
    """

    observation: Observation | None
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    outcome_reward: float | Mapping[str, float] | None = None
    policy_steps: tuple[Step, ...] = ()
    metrics: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.observation is None and not (self.terminated or self.truncated):
            raise ValueError("StepResult.observation may only be None when the episode has ended")
        object.__setattr__(self, "policy_steps", tuple(self.policy_steps))
        object.__setattr__(self, "metrics", _metrics(self.metrics, "StepResult"))
        if isinstance(self.outcome_reward, Mapping):
            for role, value in self.outcome_reward.items():
                _check_role(role, "a StepResult.outcome_reward key")
                if isinstance(value, bool) or not isinstance(value, int | float):
                    raise TypeError(f"StepResult.outcome_reward[{role!r}] must be a number, got {value!r}")
            object.__setattr__(self, "outcome_reward", {r: float(v) for r, v in self.outcome_reward.items()})


@dataclass(frozen=True)
class Step:
    """One RL transition: state (prompt ids), action (response ids + log-probs) and reward.

    ``response_mask[i] == 1`` when ``response_ids[i]`` is trained on (tokens the model generated);
    ``0`` for tokens it did not choose (e.g. forced by a tool-call format repair). ``state_key``
    optionally names the state for step-grouped baselines (GiGPO's anchor states); by default the
    estimators compare ``prompt_ids``. ``policy_version`` is the learner version that sampled it.
    ``metrics`` are the environment's counters for this step (``StepResult.metrics``).
    """

    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    response_mask: tuple[int, ...] = ()
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    stop_reason: StopReason = StopReason.STOP
    response_text: str = ""
    state_key: str | None = None
    policy_version: int = 0
    info: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "metrics", _metrics(self.metrics, "Step"))
        object.__setattr__(self, "prompt_ids", _tuple_of_ints(self.prompt_ids))
        object.__setattr__(self, "response_ids", _tuple_of_ints(self.response_ids))
        object.__setattr__(self, "logprobs", _tuple_of_floats(self.logprobs))
        mask = _tuple_of_ints(self.response_mask) if self.response_mask else (1,) * len(self.response_ids)
        object.__setattr__(self, "response_mask", mask)
        object.__setattr__(self, "stop_reason", StopReason(self.stop_reason))
        n = len(self.response_ids)
        if len(self.logprobs) != n or len(self.response_mask) != n:
            raise ValueError(
                f"Step: response_ids ({n}), logprobs ({len(self.logprobs)}) and response_mask "
                f"({len(self.response_mask)}) must have the same length"
            )

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_ids": list(self.prompt_ids),
            "response_ids": list(self.response_ids),
            "logprobs": [_float_to_json(x) for x in self.logprobs],
            "response_mask": list(self.response_mask),
            "reward": _float_to_json(self.reward),
            "terminated": self.terminated,
            "truncated": self.truncated,
            "stop_reason": self.stop_reason.value,
            "response_text": self.response_text,
            "state_key": self.state_key,
            "policy_version": self.policy_version,
            "info": self.info,
            "timings": self.timings,
            "metrics": self.metrics,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Step:
        d = dict(d)
        d["logprobs"] = [_float_from_json(x) for x in d["logprobs"]]
        d["reward"] = _float_from_json(d.get("reward", 0.0))
        return cls(**d)


@dataclass(frozen=True)
class Trajectory:
    """One episode of one role: the steps of one task that the role took, and how it ended.

    ``role``: who acted (``Observation.role``); None in an episode of one role. An episode of several
    roles gives one trajectory per role, each step in exactly one of them, linked by
    ``info["episode"]`` (``agent_r1.flows.base.rollout_group``); the role's policy is the config's
    (``policies`` / ``roles``, docs/multi_agent.md).
    """

    task_id: str
    steps: tuple[Step, ...]
    group_id: str = ""
    outcome_reward: float = 0.0
    status: TrajectoryStatus = TrajectoryStatus.OK
    error: str | None = None
    info: dict[str, Any] = field(default_factory=dict)
    role: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "steps", tuple(self.steps))
        object.__setattr__(self, "status", TrajectoryStatus(self.status))
        object.__setattr__(self, "task_id", str(self.task_id))
        if self.status is TrajectoryStatus.ERROR and not self.error:
            raise ValueError("a Trajectory with status ERROR needs its error text")
        _check_role(self.role, "Trajectory.role")

    @property
    def total_reward(self) -> float:
        """The return: every immediate step reward plus the outcome reward, each counted once."""
        return sum(s.reward for s in self.steps) + self.outcome_reward

    @property
    def num_response_tokens(self) -> int:
        return sum(len(s.response_ids) for s in self.steps)

    def to_dict(self) -> dict[str, Any]:
        return {
            "task_id": self.task_id,
            "group_id": self.group_id,
            "steps": [s.to_dict() for s in self.steps],
            "outcome_reward": _float_to_json(self.outcome_reward),
            "status": self.status.value,
            "error": self.error,
            "info": self.info,
            **({} if self.role is None else {"role": self.role}),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Trajectory:
        d = dict(d)
        d["steps"] = tuple(Step.from_dict(s) for s in d["steps"])
        d["outcome_reward"] = _float_from_json(d.get("outcome_reward", 0.0))
        return cls(**d)

    def with_group(self, group_id: str) -> Trajectory:
        return replace(self, group_id=group_id)


@dataclass(frozen=True)
class TrajectoryGroup:
    """The n samples of one task by one role (the unit of group baselines such as GRPO and RLOO):
    groups are (task, role), so each role's baseline is its own."""

    group_id: str
    task_id: str
    trajectories: tuple[Trajectory, ...]
    info: dict[str, Any] = field(default_factory=dict)
    role: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "trajectories", tuple(self.trajectories))
        _check_role(self.role, "TrajectoryGroup.role")

    @property
    def rewards(self) -> list[float]:
        return [t.total_reward for t in self.trajectories]

    def to_dict(self) -> dict[str, Any]:
        return {
            "group_id": self.group_id,
            "task_id": self.task_id,
            "trajectories": [t.to_dict() for t in self.trajectories],
            "info": self.info,
            **({} if self.role is None else {"role": self.role}),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TrajectoryGroup:
        d = dict(d)
        d["trajectories"] = tuple(Trajectory.from_dict(t) for t in d["trajectories"])
        return cls(**d)


_JSONL_TYPES: dict[str, type] = {
    "Trajectory": Trajectory,
    "TrajectoryGroup": TrajectoryGroup,
    "Step": Step,
}


def write_jsonl(path: str | Path, items: Iterable[Trajectory | TrajectoryGroup | Step]) -> None:
    """Write items one JSON object per line (appending is safe: each line stands alone)."""
    with open(path, "a", encoding="utf-8") as f:
        for item in items:
            record = {"type": type(item).__name__, **item.to_dict()}
            f.write(json.dumps(record, ensure_ascii=False) + "\n")


def read_jsonl(path: str | Path) -> Iterator[Trajectory | TrajectoryGroup | Step]:
    """Read back what ``write_jsonl`` wrote, as the same types."""
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            kind = record.pop("type", None)
            if kind not in _JSONL_TYPES:
                raise ValueError(f"{path}:{line_no}: unknown record type {kind!r}")
            yield _JSONL_TYPES[kind].from_dict(record)
