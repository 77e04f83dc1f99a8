"""Train an existing agent program: every model call it makes through the gateway is one step.

The user writes (or already has) ``async def agent(task, client) -> float | AgentResult``, where
``client`` is an ``openai.AsyncOpenAI`` pointed at its own gateway session (``client.base_url`` and
``client.api_key`` serve code that builds its own client, or runs in a subprocess), or with
``sdk="anthropic"`` an ``anthropic.AsyncAnthropic`` (same session, Anthropic's base URL). The env, named
``agent_program`` in the env registry, runs it::

    env:
      name: agent_program
      kwargs: {agent: "my_pkg.agents:calculator_agent", reward_fn: "my_pkg.agents:score"}

How the inversion works: the trainer's ``AgentEnvLoop`` asks ``reset`` / ``step`` for prompts, while
the agent pushes requests. ``reset(task)`` starts a ``Gateway`` (``agent_r1.envs.gateway``) with one
session and the agent as a task, and waits for its first model call: that call's prompt ids are the
observation. The loop samples from them with the trainer's engine; ``step(action)`` hands the sampled
ids back to the waiting call (parsed into ``tool_calls``), then waits for the agent's next call (its
prompt ids are the next observation) or for the agent to return (the episode terminates; the reward
is the outcome reward). So the trained ids are exactly the sampled ones, the loop's seeding, limits
and timings apply unchanged, and the steps go through the same batching and credit assignment as any
env's (a prompt that extends the previous one is packed into the same training sequence).

Deviations, by design: sampling is the trainer's (``rollout.temperature``, ``rollout.max_tokens``; the
learner's log-probs need the sampler's temperature), so a request's sampling fields are not used and
its answer carries no log-probs (the Step has them); ``rollout.max_steps`` is the limit on calls per
session (reaching it truncates the episode and cancels the agent). Concurrent calls of one agent are
served one at a time, in arrival order.

``Step.info["gateway"]`` is the call's record info (``prompt``: ``"extends"`` or ``"fresh"`` with
``fresh_reason``; ``tool_calls``, ``tool_parse_errors``, ``near_miss``, ``tool_choice_unmet``,
``client_disconnected``); the last step also has ``exact_fraction`` (``gateway.exact_fraction``), and
reports it as the metric ``gateway/exact_fraction`` (``StepResult.metrics``: the trainer's mean over the
trajectories whose agent returned; a single call counts as exact, 1.0).
An agent that raises or outlives ``timeout_s`` ends the episode with the trajectory's status ERROR and
the agent's traceback.

Several roles (``roles: [planner, executor]``): each call's ``model`` names its role, and the
observation of that call carries it (``Observation.role``), so the loop samples it with that role's
policy and files the step in that role's trajectory; a model that is not a role is answered 404. The
reward is every role's outcome (a team), or a mapping ``{role: reward}`` gives each role its own.
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from agent_r1.envs.base import AgentEnv, EnvKwargsError
from agent_r1.envs.gateway import (
    TOOL_PROMPTS,
    CallRecord,
    Gateway,
    GatewaySession,
    PendingCall,
    exact_fraction,
    role_names,
)
from agent_r1.envs.registry import load_entry_point
from agent_r1.tools.formats import get_format
from agent_r1.types import Action, Observation, SamplingParams, StepResult, Task

__all__ = ["AgentProgramEnv", "AgentProgramError", "AgentResult"]


@dataclass(frozen=True)
class AgentResult:
    """What an agent may return instead of a bare reward.

    ``reward``: the outcome reward (None: ``reward_fn`` scores the result); with the env's ``roles``, a
    number is every role's outcome, and a mapping ``{role: reward}`` gives each role that was called
    its own. ``answer``: anything a ``reward_fn`` reads. ``success``: overrides ``reward >=
    success_threshold`` (per role: every role's reward reaches it). ``info``: kept in the last step's
    info.
    """

    reward: float | Mapping[str, float] | None = None
    answer: Any = None
    success: bool | None = None
    info: dict[str, Any] = field(default_factory=dict)


class AgentProgramError(RuntimeError):
    """The agent program raised, returned something unusable, made no call, or ran out of time."""


def _import(value: Any, key: str) -> Any:
    """What ``value`` names when it is an import path (else ``value``), callable, or ``EnvKwargsError``."""
    if isinstance(value, str):
        try:
            value = load_entry_point(value)
        except ValueError as e:
            hint = ""
            if isinstance(e.__cause__, ImportError):
                hint = (
                    " (a module is found beside the config file, in the working directory, or where "
                    "Python finds installed packages)"
                )
            raise EnvKwargsError(key, f"{e}{hint}") from None
        except Exception as e:  # the module itself failed: a syntax error, an error at import time
            raise EnvKwargsError(key, f"importing {value!r} raised {type(e).__name__}: {e}") from None
    if not callable(value):
        raise EnvKwargsError(key, f"must be callable or 'module:function', got {value!r}")
    return value


def _load(value: Any, what: str) -> Callable:
    obj = load_entry_point(value) if isinstance(value, str) else value
    if not callable(obj):
        raise TypeError(f"AgentProgramEnv: {what} must be callable or 'module:function', got {obj!r}")
    return obj


class AgentProgramEnv(AgentEnv):
    """Runs ``agent(task, client)`` against a gateway; each of its model calls is one step.

    Args:
        tokenizer: the policy's tokenizer (the trainer passes it).
        agent: ``async (task, client) -> float | bool | AgentResult``, or its ``"module:function"``.
        reward_fn: optional ``(result, task) -> float``, sync or async (an ``LLMJudge``), or its import
            path, scoring what the agent returned (its ``AgentResult``, or the bare value); without it the agent returns the reward.
        call_reward: optional ``(record: CallRecord, task) -> float``: the immediate reward of each call
            (e.g. a penalty for ``record.info["tool_parse_errors"]``).
        format: the tool-call format parsing responses into ``tool_calls`` (``hermes``).
        tool_prompt: how the agent's ``tools`` reach the prompt: ``"template"`` (the chat template's
            block of JSON schemas), ``"compact"`` (one line per tool in the system message) or
            ``"none"`` (the agent's own prompt describes them); see ``Gateway``.
        timeout_s: the whole agent run's time limit (None: none).
        success_threshold: ``info["success"]`` is ``reward >= success_threshold`` unless the agent says.
        agent_kwargs: extra keyword arguments for the agent.
        sdk: the client the agent gets: ``"openai"`` (``openai.AsyncOpenAI``; chat completions and
            the Responses API) or ``"anthropic"`` (``anthropic.AsyncAnthropic``; the Messages API).
        roles: the role names the agent calls as its model (``model="planner"``); each call is a step
            of its role. None: one role, any model name.
    """

    reset_calls_policy = True  # reset runs the agent up to its first model call

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        agent: Callable | str,
        *,
        reward_fn: Callable | str | None = None,
        call_reward: Callable | str | None = None,
        format: str = "hermes",
        tool_prompt: str = "template",
        timeout_s: float | None = 600.0,
        success_threshold: float = 1.0,
        agent_kwargs: dict[str, Any] | None = None,
        sdk: str = "openai",
        roles: Sequence[str] | None = None,
    ) -> None:
        self.agent = _load(agent, "agent")
        if not inspect.iscoroutinefunction(self.agent):
            raise TypeError(f"AgentProgramEnv: agent {agent!r} must be an async function (async def)")
        self.reward_fn = None if reward_fn is None else _load(reward_fn, "reward_fn")
        self.call_reward = None if call_reward is None else _load(call_reward, "call_reward")
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"AgentProgramEnv: timeout_s must be > 0 or None, got {timeout_s}")
        self.timeout_s = timeout_s
        self.success_threshold = success_threshold
        self.agent_kwargs = dict(agent_kwargs or {})
        if sdk not in ("openai", "anthropic"):
            raise ValueError(f"AgentProgramEnv: sdk must be 'openai' or 'anthropic', got {sdk!r}")
        self.sdk = sdk
        self.roles = role_names(roles)
        self.gateway = Gateway(tokenizer, format=format, tool_prompt=tool_prompt, roles=self.roles)
        self._session: GatewaySession | None = None
        self._agent_task: asyncio.Task | None = None
        self._waiting: asyncio.Queue | None = None
        self._pending: tuple[PendingCall, asyncio.Future] | None = None
        self._deadline: float | None = None
        self._task: Task | None = None

    def episode_roles(self) -> list[str] | None:
        """``env.kwargs.roles``: the model names that pick a role (None: one role)."""
        return None if self.roles is None else list(self.roles)

    @classmethod
    def check_kwargs(cls, kwargs: Mapping[str, Any]) -> None:
        """Import the agent and the reward functions and check the options, before any model loads:
        a bad import path is one ``EnvKwargsError`` naming the key."""
        known = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "tokenizer")]
        for key in kwargs:
            if key not in known:
                raise EnvKwargsError(key, f"not an agent_program option; the options are {known}")
        if kwargs.get("agent") is None:
            raise EnvKwargsError("agent", "required: the agent's import path, e.g. 'my_pkg.agents:solve'")
        for key in ("agent", "reward_fn", "call_reward"):
            if kwargs.get(key) is not None:
                obj = _import(kwargs[key], key)
                if key == "agent" and not inspect.iscoroutinefunction(obj):
                    raise EnvKwargsError(key, f"{kwargs[key]!r} must be an async function (async def)")
        if kwargs.get("tool_prompt", "template") not in TOOL_PROMPTS:
            raise EnvKwargsError(
                "tool_prompt", f"must be one of {TOOL_PROMPTS}, got {kwargs['tool_prompt']!r}"
            )
        sdk = kwargs.get("sdk", "openai")
        if sdk not in ("openai", "anthropic"):
            raise EnvKwargsError("sdk", f"must be 'openai' or 'anthropic', got {kwargs['sdk']!r}")
        if importlib.util.find_spec(sdk) is None:  # the base install has neither client
            raise EnvKwargsError("sdk", f"{sdk!r} needs the {sdk} package: pip install 'agent-r1[agents]'")
        if "format" in kwargs:
            try:
                get_format(kwargs["format"])
            except (ValueError, TypeError) as e:
                raise EnvKwargsError("format", str(e)) from None
        try:
            role_names(kwargs.get("roles"))
        except ValueError as e:
            raise EnvKwargsError("roles", str(e)) from None

    async def _sample(self, call: PendingCall, params: SamplingParams) -> Action:
        """The session's sampler: park the call until ``step`` brings its sampled action."""
        reply: asyncio.Future = asyncio.get_running_loop().create_future()
        self._waiting.put_nowait((call, reply))
        return await reply

    async def _run_agent(self, task: Task) -> Any:
        session = self._session
        if self.sdk == "anthropic":
            import anthropic

            client = anthropic.AsyncAnthropic(
                base_url=session.anthropic_base_url, api_key=session.api_key, max_retries=0
            )
        else:
            import openai

            client = openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
        try:
            return await self.agent(task, client, **self.agent_kwargs)
        finally:
            await client.close()

    async def reset(self, task: Task) -> Observation:
        self._task = task
        await self.gateway.start()
        self._session = self.gateway.open_session(self._sample)
        self._waiting = asyncio.Queue()
        self._deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        self._agent_task = asyncio.ensure_future(self._run_agent(task))
        call = await self._next_call()
        if call is None:
            self._agent_result()  # raises what the agent raised
            raise AgentProgramError("the agent returned without making a model call through its client")
        return Observation(token_ids=call.prompt_ids, role=call.role)

    async def _next_call(self) -> PendingCall | None:
        """The agent's next model call, or None once it has returned."""
        if self._waiting.empty():
            get = asyncio.ensure_future(self._waiting.get())
            timeout = None if self._deadline is None else max(0.0, self._deadline - time.monotonic())
            done, _ = await asyncio.wait(
                {get, self._agent_task}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
            if get not in done:
                get.cancel()
                if not done:
                    raise AgentProgramError(f"the agent ran longer than timeout_s={self.timeout_s}")
                return None
            self._pending = get.result()
        else:
            self._pending = self._waiting.get_nowait()
        return self._pending[0]

    def _agent_result(self) -> Any:
        error = self._agent_task.exception()
        if error is not None:
            text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
            raise AgentProgramError(f"the agent raised {type(error).__name__}: {error}\n{text}") from error
        return self._agent_task.result()

    async def _score(self, result: Any) -> tuple[float | dict[str, float], bool, dict]:
        task = self._task
        if self.reward_fn is not None:
            reward = self.reward_fn(result, task)
            if inspect.isawaitable(reward):  # an async reward, e.g. an LLM judge
                reward = await reward
        elif isinstance(result, AgentResult):
            reward = result.reward
        else:
            reward = result
        if isinstance(reward, Mapping):
            reward = self._per_role(reward)
            reached = all(r >= self.success_threshold for r in reward.values())
        elif isinstance(reward, bool | int | float):
            reward = float(reward)
            reached = reward >= self.success_threshold
        else:
            raise AgentProgramError(
                f"the agent returned {type(result).__name__} {result!r:.80}: return a number, or an "
                "AgentResult with reward, or configure reward_fn to score what it returns"
            )
        info = dict(result.info) if isinstance(result, AgentResult) else {}
        success = result.success if isinstance(result, AgentResult) and result.success is not None else None
        return reward, reached if success is None else success, info

    def _per_role(self, reward: Mapping) -> dict[str, float]:
        """A reward per role, checked: numbers, for roles only, and one for every role that was called."""
        if self.roles is None:
            raise AgentProgramError(
                f"the agent's reward {dict(reward)!r:.80} is per role, but the env has no roles: set "
                "env.kwargs.roles to the role names, or return one number"
            )
        for role, value in reward.items():
            if role not in self.roles:
                raise AgentProgramError(
                    f"the agent's reward names {role!r}, not one of the roles {list(self.roles)}"
                )
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise AgentProgramError(
                    f"the agent's reward for role {role!r} must be a number, got {value!r:.80}"
                )
        called = list(dict.fromkeys(record.role for record in self._session.records))
        missing = [role for role in called if role not in reward]
        if missing:
            raise AgentProgramError(
                f"the agent's reward {dict(reward)!r:.80} has none for {missing}, which it called: give "
                "every role it called a reward"
            )
        return {role: float(value) for role, value in reward.items()}

    async def step(self, action: Action) -> StepResult:
        if self._pending is None:
            raise RuntimeError("AgentProgramEnv.step called before reset(task) or after the episode ended")
        call, reply = self._pending
        self._pending = None
        if not reply.done():
            reply.set_result(action)
        record: CallRecord | None = await call.recorded
        info = {"gateway": record.info if record is not None else {**call.info, "client_disconnected": True}}
        reward = 0.0
        if self.call_reward is not None and record is not None:
            reward = float(self.call_reward(record, self._task))
        following = await self._next_call()
        if following is not None:
            return StepResult(
                observation=Observation(token_ids=following.prompt_ids, role=following.role),
                reward=reward,
                info=info,
            )
        outcome, success, agent_info = await self._score(self._agent_result())
        share = exact_fraction(self._session.records)
        info.update(agent_info, success=success, exact_fraction=share)
        return StepResult(
            observation=None,
            reward=reward,
            terminated=True,
            info=info,
            outcome_reward=outcome,
            metrics={} if share is None else {"gateway/exact_fraction": share},
        )

    async def close(self) -> None:
        task, self._agent_task = self._agent_task, None
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if self._session is not None:
            self.gateway.close_session(self._session)
        await self.gateway.stop()
