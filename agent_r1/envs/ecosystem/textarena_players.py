"""Scripted TextArena players: fixed opponents (``opponent: "agent_r1.envs.ecosystem.textarena_players:tictactoe"``)
and demonstrators for a warm start (``play_scripted`` records the moves a player makes in an env).

Each reads the text a seat is shown (a TextArena observation, or a whole rendered prompt: they only
look for the game's own phrases) and answers one bracketed move.
"""

from __future__ import annotations

import asyncio
import random
import re
from collections.abc import Callable
from typing import Any

from transformers import PreTrainedTokenizerBase

from agent_r1.envs.base import AgentEnv
from agent_r1.types import Action, Observation, StepResult, Task

__all__ = ["GuessTheNumberPlayer", "TicTacToePlayer", "play_scripted", "tictactoe"]

_LINES = [(0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6)]
_ROW = re.compile(r"^\s*(\S)\s*\|\s*(\S)\s*\|\s*(\S)\s*$")
_MARK = re.compile(r"you will be '([XO])'")


def _last_board(text: str) -> list[str] | None:
    """The cells of the last Tic Tac Toe board in ``text`` (a digit: free; X or O: taken)."""
    cells: list[str] = []
    last = None
    for line in text.splitlines():
        row = _ROW.match(line)
        if row is None:
            continue
        cells.extend(row.groups())
        if len(cells) == 9:
            last, cells = cells, []
    return last


class TicTacToePlayer:
    """Win if it can, else block, else the centre, a corner, a side; with probability ``noise`` a
    random free cell instead. Its mark is read from the game's prompt (``you will be 'X'``)."""

    def __init__(self, noise: float = 0.0, seed: int | None = None) -> None:
        self.noise = noise
        self.rng = random.Random(seed)

    def __call__(self, text: str) -> str:
        board = _last_board(text)
        marks = _MARK.findall(text)
        if board is None:
            return "[4]"
        free = [i for i, c in enumerate(board) if c.isdigit()]
        if not free:
            return "[0]"
        if self.rng.random() < self.noise:
            return f"[{self.rng.choice(free)}]"
        mine = marks[-1] if marks else "O"
        theirs = "X" if mine == "O" else "O"
        for mark in (mine, theirs):  # complete my line, else block theirs
            for line in _LINES:
                values = [board[i] for i in line]
                if values.count(mark) == 2:
                    empty = [i for i in line if board[i].isdigit()]
                    if empty:
                        return f"[{empty[0]}]"
        for cell in (4, 0, 2, 6, 8, 1, 3, 5, 7):
            if cell in free:
                return f"[{cell}]"
        return f"[{free[0]}]"


def tictactoe(observation_text: str) -> str:
    """A deterministic decent Tic Tac Toe player (``TicTacToePlayer`` without noise), as an entry point."""
    return TicTacToePlayer()(observation_text)


class GuessTheNumberPlayer:
    """Binary search over the range the prompt states (``between 1 and 20``), reading the hint after
    each guess; with probability ``noise`` a random number of the range left instead of its middle.
    Keeps its own guesses, so make one per episode."""

    _RANGE = re.compile(r"between (\d+) and (\d+)")
    _HINT = re.compile(r"The target number is (higher|lower)")

    def __init__(self, noise: float = 0.0, seed: int | None = None) -> None:
        self.noise = noise
        self.rng = random.Random(seed)
        self.low: int | None = None
        self.high: int | None = None
        self.guess: int | None = None
        self.hints_seen = 0

    def __call__(self, text: str) -> str:
        if self.low is None:
            found = self._RANGE.search(text)
            self.low, self.high = (int(found.group(1)), int(found.group(2))) if found else (1, 20)
        hints = self._HINT.findall(text)
        if self.guess is not None and len(hints) > self.hints_seen:
            if hints[-1] == "higher":
                self.low = self.guess + 1
            else:
                self.high = self.guess - 1
        self.hints_seen = len(hints)
        assert self.low is not None and self.high is not None
        low, high = self.low, max(self.low, self.high)
        if self.rng.random() < self.noise:
            self.guess = self.rng.randint(low, high)
        else:
            self.guess = (low + high) // 2
        return f"[{self.guess}]"


def _shown_text(observation: Observation, tokenizer: PreTrainedTokenizerBase) -> str:
    if observation.token_ids is not None:
        return tokenizer.decode(list(observation.token_ids), skip_special_tokens=False)
    if observation.messages is not None:
        return "\n".join(str(m.get("content", "")) for m in observation.messages)
    return observation.text or ""


def play_scripted(
    env_factory: Callable[[], AgentEnv],
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    player: Callable[[str], str],
    *,
    max_moves: int = 64,
) -> tuple[list[str], Any]:
    """Play one episode with ``player`` reading each prompt; returns (its moves, the last StepResult).

    The moves replay the same game through ``agent_r1.train.sft.replay_demonstrations``: the game
    is seeded by the task and the env's opponents by the task's seed and seat."""

    async def play() -> tuple[list[str], Any]:
        env = env_factory()
        moves: list[str] = []
        try:
            observation = await env.reset(task)
            if isinstance(observation, StepResult):  # the game ended before the seat's first move
                return moves, observation
            for _ in range(max_moves):
                move = player(_shown_text(observation, tokenizer))
                moves.append(move)
                ids = [*tokenizer.encode(move, add_special_tokens=False), tokenizer.eos_token_id]
                result = await env.step(Action(move + tokenizer.eos_token, ids))
                if result.terminated or result.truncated:
                    return moves, result
                observation = result.observation
        finally:
            await env.close()
        raise RuntimeError(f"play_scripted: task {task.get('id')} did not end within {max_moves} moves")

    return asyncio.run(play())
