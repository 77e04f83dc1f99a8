"""``check_env``: run one episode of an environment and report every way it breaks the AgentEnv contract.

Like Gymnasium's ``check_env``, meant for environment authors: run it in a test of your own env.

    from agent_r1.envs import check_env
    check_env(MyEnv, {"prompt": "...", "answer": 3}, actions=["<guess>5</guess>", "<guess>3</guess>"])
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from agent_r1.envs.base import AgentEnv, LentPolicy
from agent_r1.models.tokens import decode_response, observation_ids, render_messages
from agent_r1.rollout.base import Engine
from agent_r1.types import Action, Observation, SamplingParams, Step, StepResult, StopReason, Task

__all__ = ["EnvCheckError", "check_env"]

DEFAULT_ACTION = "I do not know."


class EnvCheckError(AssertionError):
    """The environment breaks the contract; ``problems`` lists each finding."""

    def __init__(self, env_name: str, problems: list[str]) -> None:
        self.problems = problems
        listing = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{env_name} fails check_env with {len(problems)} problem(s):\n{listing}")


def check_env(
    env_or_factory: AgentEnv | Callable[[], AgentEnv],
    task: Task,
    *,
    actions: Sequence[str | Action] | None = None,
    engine: Engine | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    sampling_params: SamplingParams | None = None,
    max_steps: int = 20,
) -> None:
    """Run one episode of the env on ``task`` and raise ``EnvCheckError`` listing all problems found.

    The actions come from ``actions`` (strings are encoded with ``tokenizer`` when one is given), or
    from ``engine`` (needs ``tokenizer``; observations are rendered as ``AgentEnvLoop`` does), or
    default to a plain "I do not know." answer repeated. Checked: ``reset``/``step``/``close`` are
    coroutines; ``reset`` returns an ``Observation`` (or an ended ``StepResult``) whose messages have string roles and contents
    and whose token ids fit the tokenizer; ``step`` returns a ``StepResult`` with a finite float
    reward, bool flags, a JSON-serialisable ``info`` dict (trajectories are written as JSONL), an
    ``outcome_reward`` reported at most once, ``policy_steps`` that are Steps, and a valid next
    observation while the episode runs; exceptions from any call are reported with their type and
    message. With ``engine`` the env is lent the policy (``AgentEnv.lend_policy``) as a flow would.
    """
    if engine is not None and tokenizer is None:
        raise ValueError("check_env: an engine needs the tokenizer to render observations into prompts")
    asyncio.run(_check(env_or_factory, task, actions, engine, tokenizer, sampling_params, max_steps))


async def _check(
    env_or_factory: Any,
    task: Task,
    actions: Sequence[str | Action] | None,
    engine: Engine | None,
    tokenizer: PreTrainedTokenizerBase | None,
    sampling_params: SamplingParams | None,
    max_steps: int,
) -> None:
    problems: list[str] = []
    env = env_or_factory
    if not isinstance(env, AgentEnv) and callable(env):
        try:
            env = env_or_factory()
        except Exception as e:
            raise EnvCheckError(_name(env_or_factory), [f"the factory raised {_describe(e)}"]) from e
    name = _name(env)
    if not isinstance(env, AgentEnv):
        raise EnvCheckError(name, [f"{name} is not a subclass of agent_r1.envs.AgentEnv"])
    for method in ("reset", "step", "close"):
        if not inspect.iscoroutinefunction(getattr(env, method)):
            problems.append(f"{method}() must be 'async def'")
    if problems:
        raise EnvCheckError(name, problems)
    if engine is not None:  # as AgentEnvLoop does, so envs that ask the policy themselves run too
        params = sampling_params or SamplingParams()
        env.lend_policy(LentPolicy(lambda prompt_ids: engine.generate(list(prompt_ids), params)))

    try:
        observation = await env.reset(task)
    except Exception as e:
        raise EnvCheckError(name, [f"reset(task) raised {_describe(e)}"]) from e
    outcome_reported_at: int | None = None
    if isinstance(observation, StepResult):  # the episode was over before any action (AgentEnv.reset)
        problems += _result_problems("reset(task)", observation)
        if not (observation.terminated or observation.truncated):
            problems.append("reset(task) returned a StepResult that has not ended; return an Observation")
        max_steps = 0
    else:
        problems += _observation_problems("reset(task)", observation, tokenizer)

    for t in range(max_steps):
        if problems:
            break
        try:
            action = await _next_action(t, actions, engine, tokenizer, sampling_params, observation)
        except Exception as e:
            problems.append(f"producing action {t} raised {_describe(e)}")
            break
        if action is None:
            break
        try:
            result = await env.step(action)
        except Exception as e:
            problems.append(f"step(action {t}) raised {_describe(e)}")
            break
        where = f"step {t}"
        if not isinstance(result, StepResult):
            problems.append(f"{where}: step() returned {type(result).__name__}, expected StepResult")
            break
        problems += _result_problems(where, result)
        if result.outcome_reward is not None:
            if outcome_reported_at is not None:
                problems.append(
                    f"{where}: outcome_reward reported again (first at step {outcome_reported_at}); "
                    "report it once, normally with terminated=True"
                )
            outcome_reported_at = t
        if result.terminated or result.truncated:
            break
        problems += _observation_problems(f"{where} observation", result.observation, tokenizer)
        observation = result.observation
    try:
        await env.close()
    except Exception as e:
        problems.append(f"close() raised {_describe(e)}")
    if problems:
        raise EnvCheckError(name, problems)


async def _next_action(
    t: int,
    actions: Sequence[str | Action] | None,
    engine: Engine | None,
    tokenizer: PreTrainedTokenizerBase | None,
    sampling_params: SamplingParams | None,
    observation: Observation,
) -> Action | None:
    if engine is not None:
        assert tokenizer is not None
        completion = await engine.generate(
            observation_ids(observation, tokenizer), sampling_params or SamplingParams()
        )
        return Action(decode_response(tokenizer, completion), completion.token_ids, completion.finish_reason)
    if actions is None:
        actions = [DEFAULT_ACTION]
        t = 0
    if t >= len(actions):
        return None
    action = actions[t]
    if isinstance(action, Action):
        return action
    token_ids = tokenizer.encode(action, add_special_tokens=False) if tokenizer is not None else ()
    return Action(action, token_ids, StopReason.STOP)


def _observation_problems(
    where: str, observation: Any, tokenizer: PreTrainedTokenizerBase | None
) -> list[str]:
    if not isinstance(observation, Observation):
        return [f"{where} returned {type(observation).__name__}, expected agent_r1.types.Observation"]
    problems = []
    if observation.messages is not None:
        if not observation.messages:
            problems.append(f"{where}: the observation has an empty message list")
        for i, message in enumerate(observation.messages):
            if not isinstance(message.get("role"), str):
                problems.append(f"{where}: message {i} has no string 'role'")
            if not isinstance(message.get("content"), str):
                problems.append(f"{where}: message {i} ({message.get('role')}) has no string 'content'")
        if tokenizer is not None and not problems:
            try:
                render_messages(tokenizer, observation.messages)
            except Exception as e:
                problems.append(f"{where}: the chat template cannot render the messages: {_describe(e)}")
    if observation.token_ids is not None:
        if not observation.token_ids:
            problems.append(f"{where}: the observation has no token ids")
        if tokenizer is not None:
            bad = [i for i in observation.token_ids if not 0 <= i < len(tokenizer)]
            if bad:
                problems.append(f"{where}: token ids outside the tokenizer's vocabulary: {bad[:5]}")
    return problems


def _result_problems(where: str, result: StepResult) -> list[str]:
    problems = []
    if isinstance(result.reward, bool) or not isinstance(result.reward, (int, float)):
        problems.append(f"{where}: reward must be a float, got {type(result.reward).__name__}")
    elif not math.isfinite(result.reward):
        problems.append(f"{where}: reward is {result.reward}")
    # A mapping {role: reward} gives each role of the episode its own outcome (the seats of a game).
    outcomes = (
        result.outcome_reward.values()
        if isinstance(result.outcome_reward, Mapping)
        else [result.outcome_reward]
    )
    if result.outcome_reward is not None and any(
        isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r) for r in outcomes
    ):
        problems.append(
            f"{where}: outcome_reward must be a finite float, a mapping of roles to finite floats, or None, "
            f"got {result.outcome_reward!r}"
        )
    for flag in ("terminated", "truncated"):
        if not isinstance(getattr(result, flag), bool):
            problems.append(f"{where}: {flag} must be a bool, got {type(getattr(result, flag)).__name__}")
    for i, step in enumerate(result.policy_steps):
        if not isinstance(step, Step):
            problems.append(f"{where}: policy_steps[{i}] must be a Step, got {type(step).__name__}")
    if not isinstance(result.info, dict):
        problems.append(f"{where}: info must be a dict, got {type(result.info).__name__}")
    else:
        try:
            json.dumps(result.info)
        except (TypeError, ValueError) as e:
            problems.append(f"{where}: info is not JSON-serialisable (trajectories are saved as JSONL): {e}")
    return problems


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def _name(obj: Any) -> str:
    return obj.__name__ if isinstance(obj, type) else type(obj).__name__
