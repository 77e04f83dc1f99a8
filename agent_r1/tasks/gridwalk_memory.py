"""Grid walk from memory: the goal is told once, early in the history, so what the context keeps
decides what the model knows.

The tasks, moves, budget and reward are ``gridwalk``'s (``agent_r1/tasks/gridwalk.py``: reach the
goal offset, 6-8 cells away, one move per turn, outcome reward 1.0 on reaching it and 0.0 when the
budget of distance + 2 moves runs out). What differs is the observation. The episode opens with a
look: the system prompt, an assistant ``look`` and the answer ``Goal 3E 2S`` (the whole offset,
told once). After each move the env answers only what is left *on the moved axis*
(``moved E, 2E left``; ``effect_text``). So the context grows by one turn per move, and the offset
left on the other axis is in an older turn: the goal's, or the last move along that axis. The
context policies (``agent_r1.envs.context``) really differ here, which they cannot on ``gridwalk``,
whose env rewrites the context each turn:

- ``append``: the whole history; for each axis the latest mention of it is the offset left there.
- ``sliding_window`` (``k`` turns): the head is the system prompt alone, so once ``k`` moves have
  been made the goal is gone; an axis not moved along in the last ``k`` moves is unknown.
- ``summarize`` (policy-written and trained, ``StepResult.policy_steps``): once more than
  ``max_turns`` turns pile up, the older ones are replaced by a summary the policy writes; the
  summary that helps is the offset left on both axes, ``Goal 2E 1S`` (``demonstrated_summary``: the
  latest mention of each axis, copied, no arithmetic), after which a short context is enough.

Why the goal is not in the task message (the head), as first planned: windowing policies always
keep the head, so nothing in it is ever lost, and with only ``moved E`` as the answer the one thing
the history would hold is a count of moves per axis, for the model to count and the summary to
subtract. Here the history holds facts to look up (the latest mention of each axis), which the
window loses and a summary can copy.

Why an ``AgentEnv`` and not ``ToolEnv`` with a ``move`` tool: a ToolEnv episode ends only on a
final answer, and a tool call costs ~60 bytes of JSON per move for the byte-level model; here the
env ends the episode when the goal is reached and a move is one byte, as on ``gridwalk``, so the
arms differ only in their context. The context policy is the real one (``ContextPolicy.build``, with
``PreviousTurn`` for token-level append), and its summary steps go to the flow as in ``ToolEnv``.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from agent_r1.envs.base import AgentEnv, LentPolicy
from agent_r1.envs.context import ContextPolicy, ContextRequest, PreviousTurn, resolve_context_policy
from agent_r1.models.loading import require_chat_template
from agent_r1.tasks.gridwalk import MOVES, SYSTEM_PROMPT, observation_text, parse_move, task_offset
from agent_r1.types import Action, Completion, Message, Observation, StepResult, StopReason

__all__ = [
    "LOOK",
    "SUMMARY_INSTRUCTION",
    "SUMMARY_KWARGS",
    "GridMemoryEnv",
    "demonstrate_axis_by_axis",
    "demonstrated_summary",
    "demonstrator_policy",
    "effect_text",
]

LOOK = "look"
SUMMARY_INSTRUCTION = "Write what is left of the goal."
SUMMARY_KWARGS: dict[str, Any] = {"instruction": SUMMARY_INSTRUCTION, "prefix": "Summary: "}
"""What ``summarize`` is given on this task unless ``context_kwargs`` say otherwise: a short request
and prefix (the tiny model reads every byte of them)."""

_GOAL = re.compile(r"Goal((?: \d+[EWNS])*)")
_EFFECT = re.compile(r"moved [EWNS], (\d+)([EWNS]) left")


def effect_text(move: str | None, dx: int, dy: int) -> str:
    """The env's answer to a move, ``(dx, dy)`` being the offset left after it: what is left on the
    moved axis only (``moved E, 2E left``; ``moved E, 1W left`` after an overshoot; ``moved N, 0N
    left`` when that axis is done), never the other axis."""
    if move is None:
        return "no move: answer E, W, N or S"
    horizontal = move in ("E", "W")
    left = dx if horizontal else dy
    if left == 0:
        letter = move
    elif horizontal:
        letter = "E" if left > 0 else "W"
    else:
        letter = "N" if left > 0 else "S"
    return f"moved {move}, {abs(left)}{letter} left"


class GridMemoryEnv(AgentEnv):
    """One episode of a grid walk task told once (see the module docstring).

    Args:
        tokenizer: the policy's tokenizer; it must have a chat template.
        context: the context policy's name (``agent_r1.envs.context.CONTEXT_POLICIES``) or an instance.
        context_kwargs: passed to a named policy, over ``SUMMARY_KWARGS`` for ``summarize``
            (e.g. ``{"k": 2}`` for ``sliding_window``, ``{"max_turns": 3, "keep_last": 1}``).

    Observations are token ids built by the context policy. Every step's ``info`` holds ``state``
    (the offset the step started from), ``move``, ``invalid`` and, while the episode runs,
    ``context`` (the policy's report); the last step holds ``success``.
    """

    required_fields = ("dx", "dy", "budget")
    task_fields = ("id", "dx", "dy", "budget")

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        *,
        context: str | ContextPolicy = "append",
        context_kwargs: dict[str, Any] | None = None,
    ) -> None:
        require_chat_template(tokenizer)
        self.tokenizer = tokenizer
        if context == "summarize":
            context_kwargs = {**SUMMARY_KWARGS, **(context_kwargs or {})}
        self.context = resolve_context_policy(context, context_kwargs, "GridMemoryEnv")
        self._messages: tuple[Message, ...] = ()
        self._prompt_ids: tuple[int, ...] = ()

    async def reset(self, task: Mapping[str, Any]) -> Observation:
        self.dx, self.dy, self.budget = task_offset(task)
        self.moves = 0
        # The look is the first turn, not the head: windowing policies drop it like any other turn.
        opening = (
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "assistant", "content": LOOK},
            {"role": "user", "content": observation_text(self.dx, self.dy)},
        )
        prompt = await self.context.build(self.tokenizer, ContextRequest(opening, policy=self.policy))
        self._messages, self._prompt_ids = prompt.messages, prompt.token_ids
        return Observation(token_ids=prompt.token_ids)

    async def step(self, action: Action) -> StepResult:
        state = f"{self.dx:+d},{self.dy:+d}"
        move = parse_move(action.text)
        self.moves += 1
        if move is not None:
            mx, my = MOVES[move]
            self.dx, self.dy = self.dx - mx, self.dy - my
        info: dict[str, Any] = {"state": state, "move": move, "invalid": move is None}
        if (self.dx, self.dy) == (0, 0):
            return StepResult(None, terminated=True, outcome_reward=1.0, info={**info, "success": True})
        if self.moves >= self.budget:
            return StepResult(None, truncated=True, outcome_reward=0.0, info={**info, "success": False})
        # The response less the end-of-turn token the model generated: the chat template adds it.
        content = action.text.removesuffix(self.tokenizer.eos_token or "")
        previous = PreviousTurn(self._prompt_ids, action.token_ids, num_messages=len(self._messages))
        messages = (
            *self._messages,
            {"role": "assistant", "content": content},
            {"role": "user", "content": effect_text(move, self.dx, self.dy)},
        )
        prompt = await self.context.build(
            self.tokenizer, ContextRequest(messages, previous=previous, policy=self.policy)
        )
        self._messages, self._prompt_ids = prompt.messages, prompt.token_ids
        return StepResult(
            Observation(token_ids=prompt.token_ids),
            info={**info, "context": prompt.info},
            policy_steps=prompt.steps,
        )


def demonstrate_axis_by_axis(task: Mapping[str, Any], rng: random.Random) -> list[str]:
    """The moves of one demonstration: every move along one axis of the goal (picked at random),
    then every move along the other; always toward the goal, so it succeeds on every task.

    The rule to learn is short: the first move is a letter of the goal, each next move repeats the
    last until the answer says ``0X left``, and then the other letter of the goal. Only that switch
    needs the history (the goal, told in the opening turn), which is what the context policies keep
    or lose: ``gridwalk.demonstrate``'s interleaved moves need a lookup of the latest mention of
    each axis at every step, which the tiny model did not learn from a short warm start
    (``benchmarks/HISTORY.md``, ``context.py``).
    """
    dx, dy, _ = task_offset(task)
    horizontal = ["E" if dx > 0 else "W"] * abs(dx)
    vertical = ["N" if dy > 0 else "S"] * abs(dy)
    return horizontal + vertical if rng.random() < 0.5 else vertical + horizontal


def demonstrated_summary(request_text: str) -> str:
    """The right summary for a summary request (its text, as the policy is shown it): the goal
    offset the request states last (the look's, or the previous summary's when it rolls one
    forward), each axis overwritten by the later move answers along it (``moved E, 1E left``),
    written as ``Goal 1E 2S``.

    A request that states no offset (a previous summary the policy wrote wrong, ``Goal`` alone or
    no ``Goal`` at all) starts from nothing left: the summary is then right about what the request
    shows, which is what ``benchmarks/context.py`` measures.
    """
    goals = list(_GOAL.finditer(request_text))
    left = {"x": 0, "y": 0}
    for part in goals[-1].group(1).split() if goals else ():
        _set_axis(left, int(part[:-1]), part[-1])
    for effect in _EFFECT.finditer(request_text, goals[-1].end() if goals else 0):
        _set_axis(left, int(effect.group(1)), effect.group(2))
    return observation_text(left["x"], left["y"])


def _set_axis(left: dict[str, int], cells: int, letter: str) -> None:
    mx, my = MOVES[letter]
    if mx:
        left["x"] = mx * cells
    else:
        left["y"] = my * cells


def demonstrator_policy(tokenizer: PreTrainedTokenizerBase) -> LentPolicy:
    """A scripted policy to lend the env while demonstrations are replayed: it answers each summary
    request with ``demonstrated_summary`` (and the end-of-turn token), so the summary steps of a
    demonstration are the right ones, in the prompts RL will show. Its log-probs are zeros (the warm
    start does not read them)."""

    async def generate(prompt_ids: Sequence[int]) -> Completion:
        text = demonstrated_summary(tokenizer.decode(list(prompt_ids), skip_special_tokens=False))
        ids = [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]
        return Completion(tuple(ids), (0.0,) * len(ids), StopReason.STOP, text=text)

    return LentPolicy(generate)
