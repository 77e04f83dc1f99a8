"""Grid walk: reach a goal cell one move per turn; the only reward is the outcome, at the end.

A task is the goal's offset from the start, ``(dx, dy)``, with ``|dx| + |dy|`` between 6 and 8, and
a move budget of that distance plus ``slack`` (2): every episode takes at least 6 decisions, and two
wasted moves end it in failure. Each turn the model answers one move, ``E`` (x + 1), ``W``, ``N``
(y + 1) or ``S``; the env answers with the new offset. Reaching the goal terminates the episode with
outcome reward 1.0; running out of moves truncates it with 0.0. There is no reward in between.

Why this task, for credit assignment (``benchmarks/credit.py``):

- **States recur across a group's samples.** The observation is the current offset alone (a
  compass), rendered the same way each time, so two samples that stand on the same cell see the
  same prompt ids, and ``step_grpo`` (GiGPO's anchor states, ``agent_r1.algos.step_table``) groups
  them without a ``state_key``. Every sample of a group shares its first state; most share several
  more. The history is dropped on purpose (the env chooses the context: docs/environments.md, "Context policies"); the
  budget is left out of the observation so that the same cell is the same state whenever it is
  reached: the best move does not depend on it, though the cell's value does (a cell revisited
  after a wasted pair of moves has less slack left).
- **One decision matters more than the others.** The demonstrator (``demonstrate``) is imperfect in
  a *systematic* way: when the goal is straight ahead on one axis (``dx == 0`` or ``dy == 0``) it
  sidesteps (a perpendicular move, which costs two moves) with probability ``error_rate`` (0.5). A
  model cloned from it repeats the habit; elsewhere it moves toward the goal. Trajectory-level
  credit (``grpo``) spreads a failure's blame over all 6-10 moves of the episode, most of them
  right; step-level credit can put it on the sidestep, at a state the group visits many times.
- **A 1M-parameter byte-level model learns it** from a short warm start: the moves toward the goal
  are written in the prompt (``Goal 3E 2S``), so the policy copies one of them; after the
  benchmark's warm start (400 demonstrations, 2 epochs) it moves toward the goal with probability
  0.96 off the axes and 0.52 on them (the demonstrator: 1.0 and 0.5), so RL has one clear thing to
  fix. The demonstrator succeeds on 34% of the tasks.
- **Why not an arithmetic chain** (one tool call per digit): its states recur only when samples
  agree on every earlier digit, and each wrong digit is final, so a group shares few states past
  the first error; here every wasted move can be undone and the cells meet again.

The plane is unbounded (no walls): a wall would make the best move depend on where the agent is,
not only on the offset, and the states would stop being the observation. Train and held-out tasks
are disjoint start offsets (a hash of the offset decides, whatever the seed); the cells visited on
the way overlap, as they do in any maze.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping
from typing import Any

from agent_r1.envs.base import AgentEnv
from agent_r1.types import Action, Observation, StepResult

__all__ = [
    "MOVES",
    "SYSTEM_PROMPT",
    "GridWalkEnv",
    "demonstrate",
    "make_dataset",
    "observation_text",
    "parse_move",
    "split_offsets",
    "task_offset",
]

MOVES = {"E": (1, 0), "W": (-1, 0), "N": (0, 1), "S": (0, -1)}
SYSTEM_PROMPT = "Reach the goal. Moves: E W N S."
MIN_DISTANCE, MAX_DISTANCE = 6, 8
DEFAULT_SLACK = 2
HELDOUT_FRACTION = 0.2
_END_MARKERS = ("<|im_end|>", "<|endoftext|>")


def observation_text(dx: int, dy: int) -> str:
    """What the model sees: the goal's offset from where it stands, one ``<cells><move>`` per axis
    that is not yet done, e.g. ``Goal 3E 2S`` for (+3, -2) and ``Goal 4N`` for (0, +4).

    The moves toward the goal are written in the prompt, so the policy only has to copy one of them:
    a first version showed signed numbers (``Goal +3,-2``), and after the benchmark's warm start the
    tiny model still chose among the four moves uniformly (P(toward) 0.50 off the axes).
    """
    parts = [f"{abs(dx)}{'E' if dx > 0 else 'W'}"] if dx else []
    parts += [f"{abs(dy)}{'N' if dy > 0 else 'S'}"] if dy else []
    return " ".join(["Goal", *parts])


def parse_move(text: str) -> str | None:
    """The move in a response (``E``, ``W``, ``N`` or ``S``, end-of-turn markers and whitespace
    stripped), or None when the response is anything else."""
    for marker in _END_MARKERS:
        text = text.replace(marker, "")
    text = text.strip()
    return text if text in MOVES else None


def task_offset(task: Mapping[str, Any]) -> tuple[int, int, int]:
    """``(dx, dy, budget)`` of a task row; a row without them, or with a budget shorter than the
    distance, raises ``ValueError`` naming the row and the field."""
    where = f"gridwalk task {task.get('id', '(no id)')!r}"
    values = []
    for name in ("dx", "dy", "budget"):
        if name not in task:
            raise ValueError(f"{where}: missing field {name!r} (rows need dx, dy and budget)")
        value = task[name]
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{where}: {name!r} must be an integer, got {value!r}")
        values.append(value)
    dx, dy, budget = values
    distance = abs(dx) + abs(dy)
    if distance == 0:
        raise ValueError(f"{where}: the goal is the start (dx = dy = 0): nothing to decide")
    if budget < distance:
        raise ValueError(f"{where}: 'budget' {budget} is below the distance {distance}: unsolvable")
    return dx, dy, budget


def _step_toward(dx: int, dy: int, move: str) -> tuple[int, int]:
    mx, my = MOVES[move]
    return dx - mx, dy - my


class GridWalkEnv(AgentEnv):
    """One episode of a grid walk task (``{"dx", "dy", "budget"}``; see the module docstring).

    Observations are chat messages (the system prompt and the current offset): the context is
    rewritten each turn, so equal cells give equal prompts. A response that is not one move is
    answered with ``Goal ...`` unchanged and costs its move (``info["invalid"]``). Every step's
    ``info`` holds ``state`` (the offset the step started from) and ``move``.
    """

    required_fields = ("dx", "dy", "budget")
    task_fields = ("id", "dx", "dy", "budget")

    async def reset(self, task: Mapping[str, Any]) -> Observation:
        self.dx, self.dy, self.budget = task_offset(task)
        self.moves = 0
        return self._observation()

    def _observation(self) -> Observation:
        return Observation(
            messages=(
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": observation_text(self.dx, self.dy)},
            )
        )

    async def step(self, action: Action) -> StepResult:
        state = f"{self.dx:+d},{self.dy:+d}"
        move = parse_move(action.text)
        self.moves += 1
        if move is not None:
            self.dx, self.dy = _step_toward(self.dx, self.dy, move)
        info: dict[str, Any] = {"state": state, "move": move, "invalid": move is None}
        if (self.dx, self.dy) == (0, 0):
            return StepResult(None, terminated=True, outcome_reward=1.0, info={**info, "success": True})
        if self.moves >= self.budget:
            return StepResult(None, truncated=True, outcome_reward=0.0, info={**info, "success": False})
        return StepResult(self._observation(), info=info)


def _is_heldout(dx: int, dy: int) -> bool:
    digest = hashlib.sha256(f"gridwalk {dx:+d},{dy:+d}".encode()).digest()
    return digest[0] < 256 * HELDOUT_FRACTION


def split_offsets(split: str) -> list[tuple[int, int]]:
    """Every start offset of ``split`` (``"train"`` or ``"test"``), in a fixed order."""
    if split not in ("train", "test"):
        raise ValueError(f"gridwalk: split must be 'train' or 'test', got {split!r}")
    return [
        (dx, dy)
        for distance in range(MIN_DISTANCE, MAX_DISTANCE + 1)
        for dx in range(-distance, distance + 1)
        for dy in sorted({distance - abs(dx), abs(dx) - distance})
        if _is_heldout(dx, dy) == (split == "test")
    ]


def make_dataset(
    n: int | None = None, *, split: str = "train", seed: int = 0, slack: int = DEFAULT_SLACK
) -> list[dict[str, Any]]:
    """Task rows ``{"id", "dx", "dy", "budget"}`` of ``split``, reproducible from ``seed``.

    ``n=None`` gives every start offset of the split once (the held-out set); otherwise ``n`` rows
    drawn uniformly from the split's offsets (with repeats: there are about 68 train offsets).
    """
    if slack < 0:
        raise ValueError(f"gridwalk: slack must be >= 0 (extra moves beyond the distance), got {slack}")
    offsets = split_offsets(split)
    if n is not None:
        if n < 1:
            raise ValueError(f"gridwalk: n must be >= 1 or None, got {n}")
        rng = random.Random(f"gridwalk-{split}-{seed}")
        offsets = [rng.choice(offsets) for _ in range(n)]
    return [
        {"id": f"{split}-{seed}-{i}", "dx": dx, "dy": dy, "budget": abs(dx) + abs(dy) + slack}
        for i, (dx, dy) in enumerate(offsets)
    ]


def demonstrate(task: Mapping[str, Any], rng: random.Random, *, error_rate: float = 0.5) -> list[str]:
    """The moves of one demonstration, played to the episode's end (success or out of moves).

    Toward the goal along a random useful axis, except when the goal is straight ahead on one axis:
    then, with probability ``error_rate``, a sidestep (a random perpendicular move). See the module
    docstring for why the habit is systematic.
    """
    if not 0.0 <= error_rate <= 1.0:
        raise ValueError(f"gridwalk: error_rate must be in [0, 1], got {error_rate}")
    dx, dy, budget = task_offset(task)
    moves: list[str] = []
    while (dx, dy) != (0, 0) and len(moves) < budget:
        useful = [m for m, (mx, my) in MOVES.items() if mx * dx > 0 or my * dy > 0]
        if (dx == 0 or dy == 0) and rng.random() < error_rate:
            useful = ["E", "W"] if dx == 0 else ["N", "S"]
        move = rng.choice(useful)
        moves.append(move)
        dx, dy = _step_toward(dx, dy, move)
    return moves
