"""Flows: async programs that use an engine to produce one Trajectory per task.

``AgentFlow.run(engine, task)`` is the lowest layer: any workflow that calls the model and returns a
``Trajectory``. Two flows ship here:

- ``SingleStepFlow``: one prompt, one response, one reward (RLVR on single-turn tasks).
- ``AgentEnvLoop``: the step-level MDP loop (Agent-R1, arXiv 2511.14460, Alg. 1) — reset an
  ``AgentEnv``, then repeatedly generate an action from the current prompt and ``step`` the env, one
  ``Step`` per transition, until the env terminates or truncates, or ``max_steps`` is reached.

``rollout_group`` runs the n samples of one task concurrently (the unit of group baselines) and turns
an exception in one sample into an ERROR trajectory, so the other samples go on.
"""

from __future__ import annotations

import asyncio
import time
import traceback
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, Literal

from transformers import PreTrainedTokenizerBase

from agent_r1.envs.base import AgentEnv, LentPolicy
from agent_r1.envs.context import task_id, task_messages
from agent_r1.models.loading import require_chat_template
from agent_r1.models.tokens import decode_response, observation_ids
from agent_r1.rollout.base import Engine
from agent_r1.types import (
    Action,
    Completion,
    Observation,
    SamplingParams,
    Step,
    StepResult,
    StopReason,
    Task,
    Trajectory,
    TrajectoryGroup,
    TrajectoryStatus,
)

__all__ = [
    "AgentEnvLoop",
    "AgentFlow",
    "EngineError",
    "PromptTooLongError",
    "SingleStepFlow",
    "by_role",
    "reported_success",
    "rollout_group",
    "rollout_groups",
    "short_traceback",
    "split_roles",
    "task_group_id",
]

TRACEBACK_FRAMES = 4


class PromptTooLongError(ValueError):
    """A prompt outgrew ``max_prompt_tokens`` and the flow was configured to raise."""


class EngineError(RuntimeError):
    """The engine aborted a request (``Completion.finish_reason == ABORT``)."""


def short_traceback(error: BaseException, frames: int = TRACEBACK_FRAMES) -> str:
    """The exception and its last ``frames`` stack frames, as text."""
    return "".join(traceback.format_exception(type(error), error, error.__traceback__, limit=-frames))


class AgentFlow(ABC):
    """Anything that turns (engine, task) into a Trajectory. Subclass and implement ``run``.

    An episode of several roles returns a list: one Trajectory per role (``Trajectory.role``), each
    step in exactly one of them (docs/multi_agent.md)."""

    @abstractmethod
    async def run(self, engine: Engine, task: Task) -> Trajectory | list[Trajectory]: ...


OverflowMode = Literal["truncate", "raise"]


class _PromptLimits:
    """Shared prompt-length handling: the overflow check and the response cap."""

    def __init__(
        self,
        sampling_params: SamplingParams,
        max_prompt_tokens: int | None,
        max_total_tokens: int | None,
        on_prompt_overflow: OverflowMode,
    ) -> None:
        if on_prompt_overflow not in ("truncate", "raise"):
            raise ValueError(f"on_prompt_overflow must be 'truncate' or 'raise', got {on_prompt_overflow!r}")
        for name, value in (("max_prompt_tokens", max_prompt_tokens), ("max_total_tokens", max_total_tokens)):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {value}")
        self.sampling_params = sampling_params
        self.max_prompt_tokens = max_prompt_tokens
        self.max_total_tokens = max_total_tokens
        self.on_prompt_overflow = on_prompt_overflow

    def overflow(self, n_prompt: int) -> str | None:
        """Why a prompt of ``n_prompt`` tokens cannot be served, or None. Raises in 'raise' mode."""
        reason = None
        if self.max_prompt_tokens is not None and n_prompt > self.max_prompt_tokens:
            reason = f"prompt has {n_prompt} tokens > max_prompt_tokens={self.max_prompt_tokens}"
        elif self.max_total_tokens is not None and n_prompt >= self.max_total_tokens:
            reason = f"prompt has {n_prompt} tokens, leaving no room under max_total_tokens={self.max_total_tokens}"
        if reason and self.on_prompt_overflow == "raise":
            raise PromptTooLongError(reason)
        return reason

    def refused(self, completion: Completion) -> str | None:
        """Why the engine could not serve the prompt (no tokens, LENGTH: its context is full), or None.
        Raises in 'raise' mode."""
        if completion.token_ids or completion.finish_reason is not StopReason.LENGTH:
            return None
        reason = f"the engine has no room for a response: {completion.error or 'context full'}"
        if self.on_prompt_overflow == "raise":
            raise PromptTooLongError(reason)
        return reason

    def params_for(self, n_prompt: int) -> SamplingParams:
        """The sampling params, ``max_tokens`` capped so that prompt + response fits ``max_total_tokens``."""
        if self.max_total_tokens is None:
            return self.sampling_params
        room = self.max_total_tokens - n_prompt
        if room >= self.sampling_params.max_tokens:
            return self.sampling_params
        return replace(self.sampling_params, max_tokens=room)


async def _generate(engine: Engine, prompt_ids: list[int], params: SamplingParams) -> Completion:
    completion = await engine.generate(prompt_ids, params)
    if completion.finish_reason is StopReason.ABORT:
        raise EngineError(f"the engine aborted the request: {completion.error or 'no reason given'}")
    return completion


class SingleStepFlow(AgentFlow):
    """One prompt (``task[prompt_key]`` through the chat template), one response, one reward.

    ``reward_fn(response_text, task) -> float`` is the outcome reward; it may return a bool.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        sampling_params: SamplingParams,
        reward_fn: Callable[[str, Task], float],
        *,
        prompt_key: str = "prompt",
        max_prompt_tokens: int | None = None,
        max_total_tokens: int | None = None,
        on_prompt_overflow: OverflowMode = "truncate",
    ) -> None:
        require_chat_template(tokenizer)
        self.tokenizer = tokenizer
        self.reward_fn = reward_fn
        self.prompt_key = prompt_key
        self.limits = _PromptLimits(sampling_params, max_prompt_tokens, max_total_tokens, on_prompt_overflow)

    async def run(self, engine: Engine, task: Task) -> Trajectory:
        prompt_ids = observation_ids(
            Observation(messages=task_messages(task, self.prompt_key)), self.tokenizer
        )
        overflow = self.limits.overflow(len(prompt_ids))
        if overflow:
            return Trajectory(
                task_id(task), (), status=TrajectoryStatus.TRUNCATED, info={"truncated": overflow}
            )
        start = time.perf_counter()
        completion = await _generate(engine, prompt_ids, self.limits.params_for(len(prompt_ids)))
        generate_s = time.perf_counter() - start
        refused = self.limits.refused(completion)
        if refused:
            return Trajectory(
                task_id(task), (), status=TrajectoryStatus.TRUNCATED, info={"truncated": refused}
            )
        text = decode_response(self.tokenizer, completion)
        reward = float(self.reward_fn(text, task))
        step = Step(
            prompt_ids=prompt_ids,
            response_ids=completion.token_ids,
            logprobs=completion.logprobs,
            terminated=True,
            stop_reason=completion.finish_reason,
            response_text=text,
            policy_version=completion.policy_version or 0,
            timings={"generate": generate_s},
        )
        return Trajectory(task_id(task), (step,), outcome_reward=reward)


class AgentEnvLoop(AgentFlow):
    """The step-level MDP loop over an ``AgentEnv``.

    - ``env_factory()`` builds a fresh env per trajectory (a class, a lambda, or ``functools.partial``).
    - Observations become prompt ids: token ids as is, messages via the chat template (with the
      generation prompt), text encoded without special tokens.
    - Ends when the env reports ``terminated`` or ``truncated`` (status OK), or after ``max_steps``
      steps (status OK, the last step marked ``truncated``: a time limit outside the MDP).
    - A prompt with more than ``max_prompt_tokens`` tokens (or no room left under
      ``max_total_tokens``, or one the engine answers with no tokens and LENGTH: its context is full)
      ends the trajectory with status TRUNCATED (``on_prompt_overflow="truncate"``, the default) or
      raises ``PromptTooLongError`` (``"raise"``).
    - ``max_tokens`` is capped per step so that prompt + response fits ``max_total_tokens``.
    - Each Step carries ``timings = {"generate": s, "env_step": s}``.
    - Roles: an observation with ``role`` set is acted on by that role's policy (the request's
      ``SamplingParams.role``) and its step joins that role's trajectory; an episode whose
      observations name roles returns one trajectory per role, in the order each first acted, each
      with its own outcome when the env reports ``outcome_reward`` as ``{role: reward}`` (a float is
      every role's). ``max_steps`` counts the steps of all roles.
    - The env is lent the engine (``AgentEnv.lend_policy``) for policy calls of its own, sampled with
      the same params; the Steps it returns in ``StepResult.policy_steps`` (a summary) follow the
      step that caused them. They do not count towards ``max_steps``.
    - A ``reset`` that returns an ended ``StepResult`` (the episode was over before the first action,
      ``AgentEnv.reset``) gives a trajectory with no steps (the trainer drops it: nothing to train):
      its ``outcome_reward`` is the result's rewards, ``info["ended_at_reset"]`` the result's info,
      and ``info["success"]`` copied when the result has one.
    - An exception in the env (reset/step/close) or the engine ends the trajectory with status ERROR,
      ``error`` = a short traceback, and the completed steps kept, the sampled action whose
      ``env.step`` raised included (its ``info["env_error"]`` True): an ERROR trajectory is never
      trained (``keep_groups``), but its dump shows every call the model made. ``PromptTooLongError``
      is raised, not caught, in "raise" mode.
    """

    def __init__(
        self,
        env_factory: Callable[[], AgentEnv],
        tokenizer: PreTrainedTokenizerBase,
        sampling_params: SamplingParams,
        *,
        max_steps: int = 16,
        max_prompt_tokens: int | None = None,
        max_total_tokens: int | None = None,
        on_prompt_overflow: OverflowMode = "truncate",
    ) -> None:
        if not callable(env_factory):
            raise TypeError(f"env_factory must be callable (e.g. the env class), got {env_factory!r}")
        if max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps}")
        require_chat_template(tokenizer)
        self.env_factory = env_factory
        self.tokenizer = tokenizer
        self.max_steps = max_steps
        self.limits = _PromptLimits(sampling_params, max_prompt_tokens, max_total_tokens, on_prompt_overflow)

    async def run(self, engine: Engine, task: Task) -> Trajectory | list[Trajectory]:
        steps: list[Step] = []
        roles: list[str | None] = []  # the role of each step
        outcome_reward: float | dict[str, float] = 0.0
        info: dict[str, Any] = {}
        status = TrajectoryStatus.OK
        env: AgentEnv | None = None
        try:
            env = self.env_factory()
            acting: list[str | None] = [None]  # the role acting now: the lent policy samples as it
            env.lend_policy(LentPolicy(self._lent_generate(engine, acting)))
            observation = await env.reset(task)
            if isinstance(observation, StepResult):
                outcome_reward, info = _ended_at_reset(observation)
                finished, env = env, None
                await finished.close()
                return Trajectory(task_id(task), (), outcome_reward=outcome_reward, info=info)
            for _ in range(self.max_steps):
                prompt_ids = observation_ids(observation, self.tokenizer)
                overflow = self.limits.overflow(len(prompt_ids))
                if overflow:
                    status = TrajectoryStatus.TRUNCATED
                    info["truncated"] = overflow
                    break
                start = time.perf_counter()
                params = self.limits.params_for(len(prompt_ids))
                acting[0] = observation.role
                if observation.role is not None:
                    params = replace(params, role=observation.role)
                completion = await _generate(engine, prompt_ids, params)
                generate_s = time.perf_counter() - start
                refused = self.limits.refused(completion)
                if refused:
                    status = TrajectoryStatus.TRUNCATED
                    info["truncated"] = refused
                    break
                text = decode_response(self.tokenizer, completion)
                action = Action(text, completion.token_ids, completion.finish_reason)
                sampled = Step(
                    prompt_ids=prompt_ids,
                    response_ids=completion.token_ids,
                    logprobs=completion.logprobs,
                    stop_reason=completion.finish_reason,
                    response_text=text,
                    state_key=observation.state_key,
                    policy_version=completion.policy_version or 0,
                    timings={"generate": generate_s},
                )
                start = time.perf_counter()
                roles.append(observation.role)
                try:
                    result = await env.step(action)
                except Exception:
                    steps.append(replace(sampled, info={"env_error": True}))  # shown, never trained
                    raise
                env_step_s = time.perf_counter() - start
                steps.append(
                    replace(
                        sampled,
                        reward=float(result.reward),
                        terminated=result.terminated,
                        truncated=result.truncated,
                        info=dict(result.info),
                        timings={"generate": generate_s, "env_step": env_step_s},
                        metrics=result.metrics,
                    )
                )
                steps.extend(result.policy_steps)
                roles.extend([observation.role] * len(result.policy_steps))
                if isinstance(result.outcome_reward, dict):
                    outcome_reward = dict(result.outcome_reward)
                elif result.outcome_reward is not None:
                    outcome_reward = float(result.outcome_reward)
                if "success" in result.info:
                    info["success"] = reported_success(result.info["success"])
                if result.terminated or result.truncated:
                    break
                assert result.observation is not None  # StepResult enforces it for a running episode
                observation = result.observation
            else:
                steps[-1] = replace(steps[-1], truncated=True)
                info["truncated"] = f"max_steps={self.max_steps} reached"
            finished, env = env, None  # closed once, even if close() itself raises
            await finished.close()
        except PromptTooLongError:
            await _close_quietly(env)
            raise
        except Exception as error:
            await _close_quietly(env)
            return by_role(
                Trajectory(
                    task_id(task), (), status=TrajectoryStatus.ERROR, error=short_traceback(error), info=info
                ),
                steps,
                roles,
                outcome_reward,
            )
        return by_role(Trajectory(task_id(task), (), status=status, info=info), steps, roles, outcome_reward)

    def _lent_generate(
        self, engine: Engine, acting: list[str | None]
    ) -> Callable[[Sequence[int]], Awaitable[Completion]]:
        """The policy call lent to the env: this flow's sampling params and abort handling, sampled by
        the role acting (``acting[0]``), whose trajectory its steps join."""

        async def generate(prompt_ids: Sequence[int]) -> Completion:
            ids = list(prompt_ids)
            params = self.limits.params_for(len(ids))
            return await _generate(engine, ids, replace(params, role=acting[0]) if acting[0] else params)

        return generate


def reported_success(value: Any) -> bool | dict[str, bool]:
    """``info["success"]`` as the env reported it: a bool, or ``{role: bool}`` for each role's own."""
    if isinstance(value, Mapping):
        return {str(role): bool(v) for role, v in value.items()}
    return bool(value)


def by_role(
    episode: Trajectory,
    steps: Sequence[Step],
    roles: Sequence[str | None],
    outcome: float | dict[str, float],
) -> Trajectory | list[Trajectory]:
    """The episode's trajectory (``episode`` with ``steps`` and the outcome), or, when its steps name
    roles, one trajectory per role (in the order each first acted) holding that role's steps, its
    outcome (``outcome[role]`` from a mapping, else the one float) and the episode's status and info
    (``info["success"]`` as ``{role: bool}`` gives each role its own). The episode ends for every role
    where it ends: each role's last step takes the final step's ``terminated`` / ``truncated`` and
    its ``reason`` / ``rewards`` info, with ``info["ended_by"]`` naming the role that took it. A role
    that a mapping outcome names but that never acted gets no trajectory: it took no step."""
    named = list(dict.fromkeys(roles))
    if named in ([], [None]) and not isinstance(outcome, dict):
        return replace(episode, steps=tuple(steps), outcome_reward=outcome)
    if None in named:
        raise ValueError(
            "an episode mixed observations with and without a role: set Observation.role on every "
            "observation of an episode of several roles"
        )
    last = steps[-1]
    ending = {key: last.info[key] for key in ("reason", "rewards") if key in last.info}
    trajectories = []
    for role in named:
        if isinstance(outcome, dict) and role not in outcome and episode.status is TrajectoryStatus.OK:
            raise ValueError(f"outcome_reward {outcome} has no reward for role {role!r}, which acted")
        reward = outcome.get(role, 0.0) if isinstance(outcome, dict) else outcome
        own = [step for step, r in zip(steps, roles, strict=True) if r == role]
        if own[-1] is not last:  # the episode ended on another role's step: it ended for this role too
            own[-1] = replace(
                own[-1],
                terminated=last.terminated,
                truncated=last.truncated,
                info={**own[-1].info, **ending, "ended_by": roles[-1]},
            )
        info = dict(episode.info)
        if isinstance(info.get("success"), dict):
            info["success"] = info["success"].get(role, False)
        trajectories.append(replace(episode, steps=tuple(own), outcome_reward=reward, role=role, info=info))
    return trajectories


def _ended_at_reset(result: StepResult) -> tuple[float, dict[str, Any]]:
    """The outcome reward and trajectory info of an episode that ended at ``reset``."""
    if not (result.terminated or result.truncated):
        raise ValueError(
            "AgentEnv.reset returned a StepResult that has not ended; return an Observation to start "
            "the episode, or a StepResult with terminated/truncated when it is over before any action"
        )
    if result.policy_steps:
        raise ValueError("AgentEnv.reset returned a StepResult with policy_steps; reset has no action")
    info: dict[str, Any] = {"ended_at_reset": dict(result.info)}
    if "success" in result.info:
        info["success"] = reported_success(result.info["success"])
    if isinstance(result.outcome_reward, dict):
        raise ValueError(
            "AgentEnv.reset returned a StepResult with an outcome per role: no role acted, so there is "
            "no trajectory to give it to; report a float"
        )
    return float(result.reward) + float(result.outcome_reward or 0.0), info


async def _close_quietly(env: AgentEnv | None) -> None:
    # The trajectory already failed; its first error is the one to report, not one from close().
    if env is None:
        return
    try:
        await env.close()
    except Exception:
        return


async def rollout_group(
    flow: AgentFlow, engine: Engine, task: Task, n: int, group_id: str, *, first_sample: int = 0
) -> TrajectoryGroup:
    """Run ``n`` samples of ``task`` concurrently.

    An exception escaping one sample's ``flow.run`` becomes that trajectory's ERROR status with a short
    traceback (no steps, since the flow kept none); the other samples go on. ``PromptTooLongError``
    (a flow configured with ``on_prompt_overflow="raise"``) is re-raised once every sample has ended.

    A sample of several roles (a list from ``flow.run``) puts every role's trajectory in the group,
    each with ``info["episode"] = "<group_id>/<sample>"`` (samples numbered from ``first_sample``) so
    that the seats of one game can be shown side by side; ``split_roles`` makes the (task, role)
    groups that train.
    """
    if n < 1:
        raise ValueError(f"rollout_group: n must be >= 1, got {n}")
    outcomes = await asyncio.gather(*(flow.run(engine, task) for _ in range(n)), return_exceptions=True)
    trajectories = []
    for sample, outcome in enumerate(outcomes, first_sample):
        if isinstance(outcome, PromptTooLongError):
            raise outcome
        if isinstance(outcome, BaseException):
            if not isinstance(outcome, Exception):
                raise outcome
            outcome = Trajectory(
                task_id(task), (), status=TrajectoryStatus.ERROR, error=short_traceback(outcome)
            )
        if isinstance(outcome, list):
            episode = f"{group_id}/{sample}"
            trajectories += [
                replace(t, info={**t.info, "episode": episode}).with_group(group_id) for t in outcome
            ]
        else:
            trajectories.append(outcome.with_group(group_id))
    return TrajectoryGroup(group_id, task_id(task), trajectories)


def split_roles(groups: Sequence[TrajectoryGroup]) -> list[TrajectoryGroup]:
    """The (task, role) groups: each group whose trajectories have roles becomes one group per role
    (in the order the roles first appear, id ``"<group_id>@<role>"``), so that a group baseline
    compares a role's samples with that role's only. Groups of one role (None) are returned as they are.

    An ERROR trajectory without a role (a sample that raised before any role acted) joins the first
    role's group, so that the error budget counts it once; it is never trained."""
    out = []
    for group in groups:
        roles = list(dict.fromkeys(t.role for t in group.trajectories if t.role is not None))
        if not roles:
            out.append(group)
            continue
        for role in roles:
            role_id = f"{group.group_id}@{role}"
            members = [
                t.with_group(role_id)
                for t in group.trajectories
                if t.role == role or (t.role is None and role == roles[0])
            ]
            out.append(replace(group, group_id=role_id, trajectories=tuple(members), role=role))
    return out


def task_group_id(index: int, task: Task) -> str:
    """The group id of a rollout's task ``index``: ``"<index>"``, or ``"<index>:<task id>"`` when the
    task has an id; one formula for every backend (in one process and on Ray)."""
    return f"{index}:{task_id(task)}" if task_id(task) else str(index)


async def rollout_groups(
    flow: AgentFlow, engine: Engine, tasks: Sequence[Task], n: int
) -> list[TrajectoryGroup]:
    """``rollout_group`` for every task, all concurrently; group ids by ``task_group_id``."""
    return list(
        await asyncio.gather(
            *(rollout_group(flow, engine, t, n, task_group_id(i, t)) for i, t in enumerate(tasks))
        )
    )


async def seeded_rollout_groups(
    flow: AgentFlow, engine: Engine, tasks: Sequence[Task], n: int, seed_base: str
) -> list[TrajectoryGroup]:
    """``rollout_groups`` with every sample on its own ``SeededEngine`` over ``engine``, seeded by
    (``seed_base``, task index, sample index): sample i of task j samples the same tokens whatever
    order the samples' requests reach the engine in (``agent_r1.rollout.seeded``)."""
    from agent_r1.rollout.seeded import sample_engine

    async def group(index: int, task: Task) -> TrajectoryGroup:
        group_id = task_group_id(index, task)
        engines = [sample_engine(engine, seed_base, index, sample) for sample in range(n)]
        outcomes = await asyncio.gather(
            *(
                rollout_group(flow, seeded, task, 1, group_id, first_sample=sample)
                for sample, seeded in enumerate(engines)
            ),
            return_exceptions=True,
        )
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
        return TrajectoryGroup(group_id, task_id(task), [t for g in outcomes for t in g.trajectories])

    return list(await asyncio.gather(*(group(i, t) for i, t in enumerate(tasks))))
