"""TRL-style environment classes as agent-r1 ``ToolEnv`` s: ``env.name: trl_environment``.

TRL's ``GRPOTrainer(environment_factory=...)`` (trl 1.16, ``trl/trainer/grpo_trainer.py``) trains a
class written like this; the same class trains here unchanged, TRL not installed::

    class CalculatorEnvironment:
        def reset(self, **row) -> str | None:     # the dataset row's fields; text joins the prompt
            self.memory = {...}
        def calculator(self, expression: str) -> str:   # a public method is a tool
            '''Evaluate one operation.

            Args:
                expression: e.g. x*y
            '''
        def get_reward(self) -> float:           # optional: the environment owns the reward
            ...

What maps to what, as TRL does it:

| TRL | here |
|---|---|
| a fresh instance per rollout (TRL pools and reuses instances; ``reset`` before each) | one instance per episode (agent-r1 builds a fresh env per trajectory), then ``reset`` |
| ``reset(**row)``: every field of the dataset row | ``reset(**task)``: every field of the task row |
| ``reset`` returns None or a str; a str is appended to the last prompt message's content | the same (a task without a prompt starts from one empty user message, as TRL's default) |
| tools: ``inspect.getmembers(type(env), inspect.isfunction)`` minus ``reset``, ``get_reward`` and ``_private`` names; schemas from type hints and Google docstrings | the same members, bound, made into ``Tool`` s by ``agent_r1.tools.tool`` (its schema builder); methods named as reward sources are not tools either |
| a response's calls run in order, one after another | the same: an instance's methods run one at a time, in call order (a lock), each under ``tool_timeout`` |
| reward: ``reward_funcs`` (``fn(prompts, completions, completion_ids, environments, trainer_state, log_extra, log_metric, **columns) -> list``), plus ``get_reward()`` (weight 1) when the class defines it; weighted sum, None skipped | ``reward``: the same functions, called once per episode with lists of one; ``get_reward`` included the same way; ``reward_weights`` as ``GRPOConfig.reward_weights`` |
| the rollout's reward | ``StepResult.outcome_reward`` on the step that ends the episode (a final answer or ``max_turns``); step rewards 0 |

``completions`` is TRL's form: the assistant messages (content outside the calls, ``tool_calls`` as
``[{"type": "function", "function": {"name", "arguments"}}]``) each followed by one ``{"role":
"tool", "name", "content"}`` message per call; a response with a malformed call is plain text with
no ``tool_calls`` (TRL's parser falls back the same way). ``completion_ids``: the tokens after the
first prompt (responses and the template's tool turns) when every prompt extends the previous one
(``append``), else the responses' tokens. ``trainer_state`` is None; ``log_metric(name, value)``
becomes ``StepResult.metrics`` (``env/<name>``), ``log_extra`` is accepted and dropped.

Differences kept: a tool's non-string result is JSON (TRL: ``str(result)``), a failing tool reads
``Error: tool 'name' raised Type: message`` (TRL: ``{'error': message}``), and the episode's control
is ``ToolEnv``'s (a malformed call is answered with an error by default; ``malformed_calls: answer``
ends the episode as TRL does). Set ``max_turns`` at most ``rollout.max_steps``: an episode the flow
cuts first gets no reward.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from transformers import PreTrainedTokenizerBase

from agent_r1.envs.base import EnvKwargsError
from agent_r1.envs.context import task_messages
from agent_r1.envs.registry import load_entry_point
from agent_r1.envs.tool_env import ToolEnv
from agent_r1.tools import Tool, tool
from agent_r1.types import Action, Message, Observation, StepResult, Task

__all__ = ["TRLEnvironment", "environment_tools"]

TOOL_ENV_OPTIONS = (
    "format",
    "context",
    "context_kwargs",
    "step_reward",
    "max_turns",
    "max_tool_output_chars",
    "system_prompt",
    "prompt_key",
    "success_threshold",
    "near_miss",
    "max_errors_shown",
    "malformed_calls",
)
NOT_TOOLS = ("reset", "get_reward")  # TRL's own exclusions
TRL_COLUMNS_LEFT_OUT = ("prompt", "completion", "completion_ids")  # as TRL's _calculate_rewards


class _SerialMethod(Tool):
    """A bound method of the environment as a tool, run under the instance's lock: TRL calls a
    response's tools one after another in call order, and the methods share the instance's state."""

    def __init__(self, method_tool: Tool, lock: asyncio.Lock) -> None:
        super().__init__(
            method_tool.name, method_tool.description, method_tool.parameters, timeout=method_tool.timeout
        )
        self.method_tool = method_tool
        self.lock = lock

    def validate(self, arguments: Mapping[str, Any]) -> dict[str, Any]:
        return self.method_tool.validate(arguments)

    async def run(self, arguments: dict[str, Any]) -> Any:
        async with self.lock:
            return await self.method_tool.run(arguments)


def environment_tools(
    instance: Any, *, exclude: Sequence[str] = (), timeout: float | None = 30.0
) -> list[Tool]:
    """The public methods of ``instance``'s class as tools, as TRL picks them (``reset``,
    ``get_reward``, ``_private`` names and ``exclude`` left out), sharing one lock."""
    lock = asyncio.Lock()
    tools = []
    for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction):
        if name in NOT_TOOLS or name in exclude or name.startswith("_"):
            continue
        try:
            method_tool = tool(getattr(instance, name), timeout=timeout)
        except (TypeError, ValueError) as error:
            raise TypeError(
                f"TRL environment {type(instance).__name__}: method {name!r} as a tool: {error}"
            ) from error
        tools.append(_SerialMethod(method_tool, lock))
    return tools


@dataclass(frozen=True)
class RewardSource:
    """One term of the episode's reward: ``score(**trl_reward_kwargs)`` -> a number or None."""

    name: str
    score: Callable[..., Awaitable[Any]]
    weight: float = 1.0
    member: bool = False  # a method or attribute of the environment (then not a tool)


class TRLEnvironment(ToolEnv):
    """A TRL ``environment_factory`` class as a ``ToolEnv``; see the module docstring.

    Config (``env.kwargs``)::

        env:
          name: trl_environment
          kwargs:
            environment: my_pkg.envs:CalculatorEnvironment  # the class (or a zero-argument factory)
            reward: my_pkg.rewards:correct      # TRL reward function(s) "module:fn", or the name of a
                                                # method / numeric attribute of the environment; a list
                                                # for several. The class's get_reward is added as TRL does.
            reward_weights: null                # one per `reward` entry (get_reward's weight is 1)
            tool_timeout: 30.0                  # seconds per method call (null: no limit)
            # ... and ToolEnv's options: format, context, context_kwargs, max_turns, system_prompt,
            # prompt_key, success_threshold, near_miss, max_errors_shown, malformed_calls, ...

    ``info["success"]`` is ``outcome_reward >= success_threshold`` (default 1.0), as in ``ToolEnv``;
    ``info["trl_rewards"]`` holds each reward source's value (None when it returned None).
    """

    @classmethod
    def check_kwargs(cls, kwargs: Mapping[str, Any]) -> None:
        """The environment class and every ``"module:fn"`` reward imported, before the model loads
        (a reward without ``:`` names a member of the class, checked when it is built)."""
        rewards = kwargs.get("reward")
        rewards = [rewards] if isinstance(rewards, str) else list(rewards or [])
        entries = [("environment", kwargs.get("environment"))] + [("reward", r) for r in rewards]
        for key, value in entries:
            if isinstance(value, str) and ":" in value:
                try:
                    load_entry_point(value)
                except ValueError as error:
                    raise EnvKwargsError(key, str(error)) from None

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        environment: str | Callable[[], Any],
        *,
        reward: str | Callable | Sequence[str | Callable] | None = None,
        reward_weights: Sequence[float] | None = None,
        tool_timeout: float | None = 30.0,
        **options: Any,
    ) -> None:
        unknown = sorted(set(options) - set(TOOL_ENV_OPTIONS))
        if unknown:
            raise ValueError(
                f"trl_environment: unknown option(s) {unknown}; known: environment, reward, reward_weights, "
                f"tool_timeout, {', '.join(TOOL_ENV_OPTIONS)} (the tools come from the class, the reward "
                "from `reward` and get_reward)"
            )
        factory = load_entry_point(environment) if isinstance(environment, str) else environment
        if not callable(factory):
            raise TypeError(f"trl_environment: environment {environment!r} is not a class or factory")
        self.instance = factory()
        if not callable(getattr(self.instance, "reset", None)):
            raise TypeError(
                f"trl_environment: {type(self.instance).__name__} has no reset method; TRL's convention: "
                "reset(**row) -> str | None, public methods are the tools"
            )
        self.rewards = self._reward_sources(reward, reward_weights)
        members = [source.name for source in self.rewards if source.member]
        super().__init__(
            tokenizer,
            environment_tools(self.instance, exclude=members, timeout=tool_timeout),
            outcome_reward=lambda answer, task: 0.0,  # replaced when the episode ends (step)
            **options,
        )
        self._row: Task = {}
        self._opening: list[Message] = []
        self._completion: list[Message] = []
        self._first_prompt: tuple[int, ...] = ()
        self._last_prompt: tuple[int, ...] = ()
        self._response_ids: list[int] = []
        self._extends = True

    def _reward_sources(self, reward: Any, weights: Sequence[float] | None) -> list[RewardSource]:
        """The reward's terms in TRL's order: ``reward`` then get_reward."""
        given = [] if reward is None else list(reward) if isinstance(reward, list | tuple) else [reward]
        if weights is not None and len(weights) != len(given):
            raise ValueError(
                f"trl_environment: {len(weights)} reward_weights for {len(given)} reward function(s); "
                "give one weight per `reward` entry (get_reward's weight is 1, as in TRL)"
            )
        sources = []
        for item, weight in zip(given, weights or [1.0] * len(given), strict=True):
            if isinstance(item, str) and ":" not in item:
                sources.append(RewardSource(item, self._member_reward(item), float(weight), member=True))
                continue
            fn = load_entry_point(item) if isinstance(item, str) else item
            if not callable(fn):
                raise TypeError(f"trl_environment: reward {item!r} is not callable")
            name = getattr(fn, "__name__", str(item))
            sources.append(RewardSource(name, self._function_reward(fn), float(weight)))
        if callable(getattr(self.instance, "get_reward", None)) and "get_reward" not in given:
            sources.append(RewardSource("get_reward", self._member_reward("get_reward"), member=True))
        if not sources:
            raise ValueError(
                f"trl_environment: no reward source: pass `reward` (a TRL reward function 'module:fn', or a "
                f"method or attribute of {type(self.instance).__name__}) or define get_reward() on the class"
            )
        return sources

    def _member_reward(self, name: str) -> Callable[..., Any]:
        if not hasattr(self.instance, name):
            raise ValueError(
                f"trl_environment: reward {name!r}: {type(self.instance).__name__} has no such method or "
                "attribute (a reward function is given as 'module:fn')"
            )

        async def member(**_: Any) -> Any:
            value = getattr(self.instance, name)
            value = value() if callable(value) else value
            return await value if inspect.isawaitable(value) else value

        return member

    def _function_reward(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        async def function(**kwargs: Any) -> Any:
            values = fn(**kwargs)
            values = await values if inspect.isawaitable(values) else values
            if not isinstance(values, Sequence) or len(values) != 1:
                raise ValueError(
                    f"reward function {getattr(fn, '__name__', fn)!r} returned {values!r}; it must return a "
                    "list with one reward per completion (here one)"
                )
            return values[0]

        return function

    async def reset(self, task: Task) -> Observation:
        text = self.instance.reset(**task)
        text = await text if inspect.isawaitable(text) else text
        if text is not None and not isinstance(text, str):
            raise TypeError(
                f"{type(self.instance).__name__}.reset returned {type(text).__name__}; TRL's convention is "
                "None or a str (multimodal content is not supported here)"
            )
        opening = (
            task_messages(task, self.prompt_key)
            if self.prompt_key in task
            else [{"role": "user", "content": ""}]
        )
        if text:
            opening[-1] = {**opening[-1], "content": f"{opening[-1]['content']}{text}"}
        self._row, self._opening, self._completion, self._response_ids = task, opening, [], []
        observation = await super().reset({**task, self.prompt_key: opening})
        self._first_prompt = self._last_prompt = observation.token_ids or ()
        self._extends = True
        return observation

    async def step(self, action: Action) -> StepResult:
        before = self._last_prompt
        result = await super().step(action)
        self._response_ids.extend(action.token_ids)
        eos = self.tokenizer.eos_token
        self._record(action.text.removesuffix(eos) if eos else action.text, result.info)
        if result.observation is not None:
            self._last_prompt = result.observation.token_ids or ()
            sampled = (*before, *action.token_ids)
            self._extends &= self._last_prompt[: len(sampled)] == sampled
            return result
        completion_ids = (
            [*before[len(self._first_prompt) :], *action.token_ids]
            if self._extends
            else list(self._response_ids)
        )
        reward, by_source, logged = await self._score(completion_ids)
        info = {**result.info, "success": reward >= self.success_threshold, "trl_rewards": by_source}
        return replace(result, outcome_reward=reward, info=info, metrics={**result.metrics, **logged})

    def _record(self, content: str, info: Mapping[str, Any]) -> None:
        """The response (and its tool results) as TRL's completion messages."""
        calls = info.get("tool_calls") or []
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["content"] = self.format.parse(content).content
            message["tool_calls"] = [
                {"type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                for c in calls
            ]
        self._completion.append(message)
        for call, output in zip(calls, info.get("tool_results", []), strict=False):
            self._completion.append({"role": "tool", "name": call["name"], "content": output})

    async def _score(
        self, completion_ids: list[int]
    ) -> tuple[float, dict[str, float | None], dict[str, float]]:
        """TRL's reward of the episode: the weighted sum of the sources, None skipped (nansum)."""
        logged: dict[str, float] = {}
        columns = {k: [v] for k, v in self._row.items() if k not in TRL_COLUMNS_LEFT_OUT}
        kwargs = {
            **columns,
            "prompts": [list(self._opening)],
            "completions": [list(self._completion)],
            "completion_ids": [completion_ids],
            "environments": [self.instance],
            "trainer_state": None,
            "log_extra": lambda column, values: None,
            "log_metric": lambda name, value: logged.__setitem__(name, float(value)),
        }
        total, by_source = 0.0, {}
        for source in self.rewards:
            value = await source.score(**kwargs)
            by_source[source.name] = None if value is None else float(value)
            if value is not None:
                total += source.weight * float(value)
        return total, by_source, logged
