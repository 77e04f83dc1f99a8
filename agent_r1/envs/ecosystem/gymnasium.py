"""Gymnasium environments as agent-r1 ``AgentEnv`` s: ``env.name: gymnasium``.

A Gymnasium env (``gymnasium.make(id, **make_kwargs)``) becomes a chat episode: each observation is
written as text by a **text hook** and shown as a user message, each model response is parsed back
into a Gymnasium action by the same hook, and the context policy (``append`` by default, as in
``ToolEnv``) turns the conversation into the next prompt, so under ``append`` every prompt is an
exact extension of the previous prompt + response.

| Gymnasium | agent-r1 |
|---|---|
| ``reset(seed=task["seed"], options=task["options"])`` | ``reset(task)``: system message (the hook's ``instructions``) + user message ``hook.render(obs, info, env)`` |
| observation | a user message ``hook.render(obs, info, env)``; ``Observation.state_key`` is that text |
| action | ``hook.parse(response_text, env)``; ``InvalidAction`` / ``ValueError`` or an action outside ``action_space``: an invalid-action message, the Gymnasium env is not stepped |
| reward | ``StepResult.reward`` (the immediate reward, every step); no ``outcome_reward``: the return is the sum of the steps' rewards (``Trajectory.total_reward``) |
| terminated / truncated | ``StepResult.terminated`` / ``truncated``; ``max_turns`` responses (invalid ones included) also truncate |
| success | on the last step, ``info["success"]``: Gymnasium's ``info["is_success"]`` when the env reports it, else ``hook.success(reward, terminated, info)`` when the hook has one, else ``terminated and reward > 0`` (FrozenLake's goal, Taxi's drop-off, a Blackjack win) |

Metrics (``StepResult.metrics``, logged as ``env/<name>``): ``invalid_actions`` on every step (the
share of responses that were not a valid action), ``return`` (the episode's summed Gymnasium reward)
and ``episode_success`` on the last step.

Text hooks ship for the toy-text envs, chosen by the id's name (any version): FrozenLake,
FrozenLake8x8, Taxi, Blackjack, CliffWalking, CliffWalkingSlippery (``TEXT_HOOKS``). Any other env
needs ``hook: "package.module:attr"``: an object (or a class, built without arguments) with

- ``render(observation, info, env) -> str``: the observation as text (``env`` is the unwrapped
  Gymnasium env, for its map or decoder);
- ``parse(text, env) -> action``: the response (end-of-turn token removed) as an action; raise
  ``InvalidAction(message)`` (a ``ValueError``) when it is none, the message telling the model what
  to write;

and optionally ``instructions`` (str, the system message) and ``success(reward, terminated, info) ->
bool``. See ``TextHook``.
"""

from __future__ import annotations

import importlib
import math
import string
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from transformers import PreTrainedTokenizerBase

from agent_r1.envs.base import AgentEnv, EnvKwargsError
from agent_r1.envs.context import ContextPolicy, ContextRequest, PreviousTurn, resolve_context_policy
from agent_r1.envs.ecosystem import require
from agent_r1.envs.registry import load_entry_point
from agent_r1.models.loading import require_chat_template
from agent_r1.types import Action, Message, Observation, StepResult, Task

__all__ = [
    "TEXT_HOOKS",
    "BlackjackText",
    "CliffWalkingText",
    "FrozenLakeText",
    "GymnasiumEnv",
    "InvalidAction",
    "TaxiText",
    "TextHook",
    "parse_choice",
]

EXTRA = "gymnasium"
TASK_FIELDS = ("id", "seed", "options", "make_kwargs")


class InvalidAction(ValueError):
    """A response that is not an action; the message is shown to the model."""


@runtime_checkable
class TextHook(Protocol):
    """Writes a Gymnasium observation as text and reads an action from the model's response.

    Optional members: ``instructions: str`` (the system message of every episode) and
    ``success(reward, terminated, info) -> bool`` (the last step's outcome; see the module docstring).
    """

    def render(self, observation: Any, info: dict[str, Any], env: Any) -> str: ...

    def parse(self, text: str, env: Any) -> Any: ...


def parse_choice(text: str, choices: Mapping[str, int]) -> int:
    """The action named by ``text`` (case, surrounding spaces and full stops ignored); otherwise
    ``InvalidAction`` listing the names. The built-in hooks' parser, for your own hooks too."""
    word = text.strip().strip(".").strip().lower()
    if word in choices:
        return choices[word]
    raise InvalidAction(f"{text.strip()[:40]!r} is not an action; reply with one of: {', '.join(choices)}")


def _grid_text(rows: list[list[str]]) -> str:
    return "\n".join("".join(row) for row in rows)


class FrozenLakeText:
    """FrozenLake: the map with the player as ``P``; moves left, down, right, up (actions 0-3)."""

    instructions = (
        "You are P on a frozen lake: S start, F ice, H hole, G goal. Reach G without stepping into a "
        "hole. Reply with one move: left, down, right or up."
    )
    MOVES = {"left": 0, "down": 1, "right": 2, "up": 3}

    def render(self, observation: Any, info: dict[str, Any], env: Any) -> str:
        rows = [[c.decode() for c in row] for row in env.desc]
        row, col = divmod(int(observation), env.ncol)
        rows[row][col] = "P"
        return _grid_text(rows)

    def parse(self, text: str, env: Any) -> int:
        return parse_choice(text, self.MOVES)


class TaxiText:
    """Taxi: the map with the taxi as ``T``, where the passenger is and where they go; actions
    south, north, east, west, pickup, dropoff (0-5)."""

    instructions = (
        "You drive the taxi T. Walls are |, the pads are R, G, Y and B. Pick the passenger up at their "
        "pad and drop them off at their destination. Reply with one action: south, north, east, west, "
        "pickup or dropoff."
    )
    ACTIONS = {"south": 0, "north": 1, "east": 2, "west": 3, "pickup": 4, "dropoff": 5}
    PADS = "RGYB"

    def render(self, observation: Any, info: dict[str, Any], env: Any) -> str:
        taxi_row, taxi_col, passenger, destination = env.decode(int(observation))
        rows = [[c.decode() for c in row] for row in env.desc]
        rows[1 + taxi_row][1 + 2 * taxi_col] = "T"
        where = "in the taxi" if passenger == 4 else f"at {self.PADS[passenger]}"
        return f"{_grid_text(rows)}\nPassenger {where}, destination {self.PADS[destination]}."

    def parse(self, text: str, env: Any) -> int:
        return parse_choice(text, self.ACTIONS)


class BlackjackText:
    """Blackjack: the player's sum (and a usable ace) and the dealer's card; stick or hit (0, 1)."""

    instructions = (
        "Blackjack: get closer to 21 than the dealer without going over. Reply hit (take a card) or "
        "stick (stop)."
    )
    ACTIONS = {"stick": 0, "hit": 1}

    def render(self, observation: Any, info: dict[str, Any], env: Any) -> str:
        total, dealer, usable_ace = (int(x) for x in observation)
        ace = " with a usable ace" if usable_ace else ""
        return f"Your sum: {total}{ace}. Dealer shows: {'ace' if dealer == 1 else dealer}."

    def parse(self, text: str, env: Any) -> int:
        return parse_choice(text, self.ACTIONS)


class CliffWalkingText:
    """CliffWalking: the 4x12 grid with the cliff ``C`` and the player ``P``; moves up, right, down,
    left (0-3). Success is reaching G (every move there earns -1, so a positive reward never comes)."""

    instructions = (
        "You are P: walk from S to G. C is the cliff: stepping on it sends you back to S (reward -100); "
        "every move costs 1. Reply with one move: up, right, down or left."
    )
    MOVES = {"up": 0, "right": 1, "down": 2, "left": 3}

    def render(self, observation: Any, info: dict[str, Any], env: Any) -> str:
        nrow, ncol = env.shape
        rows = [["."] * ncol for _ in range(nrow)]
        rows[nrow - 1] = ["S", *["C"] * (ncol - 2), "G"]  # the cliff: the bottom row between S and G
        row, col = divmod(int(observation), ncol)
        rows[row][col] = "P"
        return _grid_text(rows)

    def parse(self, text: str, env: Any) -> int:
        return parse_choice(text, self.MOVES)

    def success(self, reward: float, terminated: bool, info: dict[str, Any]) -> bool:
        return terminated


TEXT_HOOKS: dict[str, type] = {
    "FrozenLake": FrozenLakeText,
    "FrozenLake8x8": FrozenLakeText,
    "Taxi": TaxiText,
    "Blackjack": BlackjackText,
    "CliffWalking": CliffWalkingText,
    "CliffWalkingSlippery": CliffWalkingText,
}
"""Built-in text hooks by Gymnasium env name (the id without namespace and version)."""


def _jsonable(value: Any) -> Any:
    """Gymnasium info values (numpy arrays and scalars included) as JSON values."""
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if hasattr(value, "tolist"):  # numpy arrays and scalars
        return _jsonable(value.tolist())
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return repr(value)


def _spec(gym: Any, env_id: str) -> Any:
    """Gymnasium's spec of ``env_id`` (``"module:Env-v0"`` imports the module first, as
    ``gymnasium.make`` does); an unknown id is a ValueError listing the registered ids."""
    module, _, name = env_id.rpartition(":")
    if module:
        try:
            importlib.import_module(module)
        except ImportError as error:
            raise ValueError(f"gymnasium env {env_id!r}: cannot import module {module!r}: {error}") from error
    try:
        return gym.spec(name)
    except gym.error.Error as error:
        raise ValueError(
            f"unknown Gymnasium id {env_id!r} ({error}); available ids: {sorted(gym.registry)}"
        ) from None


class GymnasiumEnv(AgentEnv):
    """A Gymnasium env as a chat episode; see the module docstring for the mapping.

    Config (``env.kwargs``)::

        env:
          name: gymnasium
          kwargs:
            id: FrozenLake-v1              # any id in gymnasium.registry ("module:Env-v0" imports first)
            make_kwargs: {is_slippery: false}  # gymnasium.make(id, **make_kwargs); a task's own
                                               # make_kwargs are merged over these (e.g. a map)
            hook: null                     # "package.module:attr": a TextHook; default: TEXT_HOOKS[name]
            context: append                # a context policy (agent_r1.envs.context) and its kwargs
            context_kwargs: null
            max_turns: null                # responses before truncation; null: the spec's
                                           # max_episode_steps (none: the flow's rollout.max_steps)
            system_prompt: null            # default: the hook's instructions
            invalid_action_reward: 0.0     # StepResult.reward of an invalid action

    Task rows: ``{"id": ..., "seed": 3}`` (``reset(seed=...)``, so a group's samples start alike),
    optional ``options`` (``reset(options=...)``) and ``make_kwargs``. Other fields are refused
    (a misspelt ``seed`` would otherwise go unnoticed).
    """

    task_fields = TASK_FIELDS

    @classmethod
    def check_kwargs(cls, kwargs: Mapping[str, Any]) -> None:
        """The id registered and the hook importable, before the model loads (``agent-r1 check``)."""
        try:
            import gymnasium as gym
        except ImportError:
            return  # the constructor says how to install it
        if isinstance(kwargs.get("id"), str):
            try:
                _spec(gym, kwargs["id"])
            except ValueError as error:
                raise EnvKwargsError("id", str(error)) from None
        if isinstance(kwargs.get("hook"), str):
            try:
                load_entry_point(kwargs["hook"])
            except ValueError as error:
                raise EnvKwargsError("hook", str(error)) from None

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        id: str,
        *,
        make_kwargs: Mapping[str, Any] | None = None,
        hook: str | TextHook | None = None,
        context: str | ContextPolicy = "append",
        context_kwargs: dict[str, Any] | None = None,
        max_turns: int | None = None,
        system_prompt: str | None = None,
        invalid_action_reward: float = 0.0,
    ) -> None:
        self.gym = require("gymnasium", EXTRA, "env.name: gymnasium")
        require_chat_template(tokenizer)
        self.spec = _spec(self.gym, id)
        self.id = id
        self.make_kwargs = dict(make_kwargs or {})
        _check_render_mode(self.make_kwargs, "env.kwargs.make_kwargs")
        self.hook = self._resolve_hook(hook)
        self.tokenizer = tokenizer
        self.context = resolve_context_policy(context, context_kwargs, "GymnasiumEnv")
        self.max_turns = max_turns if max_turns is not None else self.spec.max_episode_steps
        if self.max_turns is not None and self.max_turns < 1:
            raise ValueError(f"GymnasiumEnv: max_turns must be >= 1 or null, got {max_turns}")
        self.system_prompt = (
            system_prompt if system_prompt is not None else getattr(self.hook, "instructions", None)
        )
        self.invalid_action_reward = float(invalid_action_reward)
        self.env: Any = None
        self._messages: tuple[Message, ...] = ()
        self._prompt_ids: tuple[int, ...] = ()
        self._turn = 0
        self._return = 0.0

    def _resolve_hook(self, hook: str | TextHook | None) -> TextHook:
        if hook is None:
            builtin = TEXT_HOOKS.get(self.spec.name) if self.spec.namespace is None else None
            if builtin is None:
                raise ValueError(
                    f"Gymnasium env {self.spec.id!r} has no built-in text hook (built in: "
                    f"{', '.join(TEXT_HOOKS)}); pass env.kwargs.hook: 'package.module:attr', an object "
                    "with render(observation, info, env) -> str and parse(text, env) -> action"
                )
            return builtin()
        found = load_entry_point(hook) if isinstance(hook, str) else hook
        if isinstance(found, type):
            found = found()
        if not isinstance(found, TextHook):
            raise TypeError(
                f"env.kwargs.hook {hook!r} is a {type(found).__name__} without render(observation, info, "
                "env) and parse(text, env)"
            )
        return found

    @property
    def messages(self) -> tuple[Message, ...]:
        """The conversation as the context policy carries it."""
        return self._messages

    async def reset(self, task: Task) -> Observation:
        unknown = sorted(set(task) - set(TASK_FIELDS))
        where = f"task {task.get('id', '(no id)')!r}"
        if unknown:
            raise ValueError(
                f"{where}: unknown field(s) {unknown} for a gymnasium task; known: {list(TASK_FIELDS)}"
            )
        make_kwargs = {**self.make_kwargs, **dict(task.get("make_kwargs") or {})}
        _check_render_mode(make_kwargs, f"{where} make_kwargs")
        try:
            self.env = self.gym.make(self.id, **make_kwargs)
        except Exception as error:
            raise ValueError(
                f"{where}: gymnasium.make({self.id!r}, **{make_kwargs}) raised {type(error).__name__}: {error}"
            ) from error
        seed = task.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"{where}: 'seed' must be an integer or null, got {seed!r}")
        observation, info = self.env.reset(seed=seed, options=task.get("options"))
        self._turn, self._return = 0, 0.0
        text = self._render(observation, info)
        opening: list[Message] = [{"role": "user", "content": text}]
        if self.system_prompt:
            opening.insert(0, {"role": "system", "content": self.system_prompt})
        prompt = await self.context.build(self.tokenizer, ContextRequest(tuple(opening), policy=self.policy))
        self._messages, self._prompt_ids = prompt.messages, prompt.token_ids
        return Observation(token_ids=prompt.token_ids, state_key=text)

    def _render(self, observation: Any, info: dict[str, Any]) -> str:
        text = self.hook.render(observation, info, self.env.unwrapped)
        if not isinstance(text, str):
            raise TypeError(
                f"text hook {type(self.hook).__name__}.render returned {type(text).__name__}, not str"
            )
        return text

    def _content(self, action: Action) -> str:
        eos = self.tokenizer.eos_token
        return action.text[: -len(eos)] if eos and action.text.endswith(eos) else action.text

    def _parse(self, content: str) -> tuple[Any, str | None]:
        """(the action, None) or (None, what was wrong)."""
        try:
            parsed = self.hook.parse(content, self.env.unwrapped)
        except ValueError as error:  # InvalidAction included
            return None, str(error)
        if not self.env.action_space.contains(parsed):
            return (
                None,
                f"{_short(repr(parsed))} is not in the action space {space_text(self.env.action_space)}",
            )
        return parsed, None

    async def step(self, action: Action) -> StepResult:
        if self.env is None:
            raise RuntimeError("GymnasiumEnv.step called before reset(task)")
        self._turn += 1
        content = self._content(action)
        parsed, invalid = self._parse(content)
        info: dict[str, Any] = {"turn": self._turn}
        if invalid is not None:
            reward, terminated, truncated = self.invalid_action_reward, False, False
            info["invalid_action"] = invalid
            text = f"Invalid action: {invalid}"
            state = None
        else:
            observation, reward, terminated, truncated, gym_info = self.env.step(parsed)
            reward = float(reward)
            info.update(action=_jsonable(parsed), gym_reward=reward, gym_info=_jsonable(gym_info))
            text = state = None if terminated or truncated else self._render(observation, gym_info)
        self._return += reward
        metrics = {"invalid_actions": float(invalid is not None)}
        turn_limit = self.max_turns is not None and self._turn >= self.max_turns
        if terminated or truncated or turn_limit:
            if not (terminated or truncated):
                info["truncated"] = f"max_turns={self.max_turns} reached"
            success = bool(terminated) and self._success(reward, info.get("gym_info", {}))
            info["success"] = success
            metrics.update({"return": self._return, "episode_success": float(success)})
            return StepResult(
                None,
                reward,
                terminated=bool(terminated),
                truncated=not terminated,
                info=info,
                metrics=metrics,
            )
        assistant = {"role": "assistant", "content": content}
        previous = PreviousTurn(self._prompt_ids, action.token_ids, num_messages=len(self._messages))
        request = ContextRequest(
            (*self._messages, assistant, {"role": "user", "content": text}), None, previous, self.policy
        )
        prompt = await self.context.build(self.tokenizer, request)
        self._messages, self._prompt_ids = prompt.messages, prompt.token_ids
        info["context"] = prompt.info
        observation = Observation(token_ids=prompt.token_ids, state_key=state)
        return StepResult(observation, reward, info=info, metrics=metrics, policy_steps=prompt.steps)

    def _success(self, reward: float, gym_info: dict[str, Any]) -> bool:
        if "is_success" in gym_info:
            return bool(gym_info["is_success"])
        rule = getattr(self.hook, "success", None)
        if rule is not None:
            return bool(rule(reward, True, gym_info))
        return reward > 0

    async def close(self) -> None:
        if self.env is not None:
            self.env.close()


def _check_render_mode(make_kwargs: Mapping[str, Any], where: str) -> None:
    mode = make_kwargs.get("render_mode")
    if mode not in (None, "ansi"):
        raise ValueError(
            f"{where}: render_mode {mode!r} is not supported (it draws pictures or opens a window); "
            "observations are written by the text hook. Leave it unset, or 'ansi'."
        )


_CHARACTER_CLASSES = (
    ("lowercase letters", string.ascii_lowercase),
    ("uppercase letters", string.ascii_uppercase),
    ("digits", string.digits),
    ("punctuation", string.punctuation),
    ("whitespace", string.whitespace),
)


def _short(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def space_text(space: Any) -> str:
    """A Gymnasium space in a few words, for the invalid-action message the model reads: a ``Text``
    space's own repr pastes its whole character set (``string.printable``: 100 characters)."""
    from gymnasium import spaces

    if isinstance(space, spaces.Discrete):
        low = int(space.start)
        return f"Discrete({space.n}): an integer from {low} to {low + int(space.n) - 1}"
    if isinstance(space, spaces.Text):
        chars = set(space.character_set)
        named = [name for name, members in _CHARACTER_CLASSES if set(members) <= chars]
        rest = chars - {c for name, members in _CHARACTER_CLASSES if name in named for c in members}
        if len(rest) > 8:
            listed = [f"{len(rest)} {'other ' if named else ''}characters"]
        else:
            listed = [f"the characters {''.join(sorted(rest))!r}"] if rest else []
        what = ", ".join(named + listed)
        return f"Text: {space.min_length} to {space.max_length} characters ({what})"
    return _short(str(space), 80)
