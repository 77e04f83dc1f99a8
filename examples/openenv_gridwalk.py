"""An environment written in OpenEnv's own format, served by OpenEnv's own server, trained by agent-r1.

Grid walk (``agent_r1/tasks/gridwalk.py``) as an OpenEnv environment: typed pydantic ``MoveAction``
and ``GoalObservation``, an ``Environment`` subclass, and ``app = create_app(...)`` as OpenEnv's
template writes it. Nothing here imports agent-r1. Serve it the way OpenEnv does::

    uvicorn openenv_gridwalk:app --app-dir examples --port 8001

or let agent-r1 start it (``benchmarks/eco_openenv.py``, docs/ecosystem.md)::

    env:
      name: openenv
      kwargs: {server: {app: "openenv_gridwalk:app", cwd: examples}}

``reset(dx, dy, budget)`` takes the goal's offset and the move budget (the columns of
``agent_r1.tasks.gridwalk.make_dataset``); each step answers the goal's new offset; reaching it is
``done`` with reward 1.0, running out of moves is ``done`` with reward 0.0. A move other than
E, W, N or S fails the Action's validation, and never reaches the environment.
"""

from __future__ import annotations

from typing import Any, Literal
from uuid import uuid4

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

MOVES = {"E": (1, 0), "W": (-1, 0), "N": (0, 1), "S": (0, -1)}


class MoveAction(Action):
    """One move toward the goal."""

    move: Literal["E", "W", "N", "S"] = Field(..., description="E (x+1), W (x-1), N (y+1) or S (y-1)")


class GoalObservation(Observation):
    """Where the goal is from here: the moves toward it, e.g. ``Goal 3E 2S``."""

    goal: str = Field(default="", description="the goal's offset as moves")


def goal_text(dx: int, dy: int) -> str:
    parts = [f"{abs(dx)}{'E' if dx > 0 else 'W'}"] if dx else []
    parts += [f"{abs(dy)}{'N' if dy > 0 else 'S'}"] if dy else []
    return " ".join(["Goal", *parts])


class GridWalkEnvironment(Environment):
    """Reach the goal one move per step within the budget."""

    SUPPORTS_CONCURRENT_SESSIONS: bool = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self.dx = self.dy = self.budget = 0

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> GoalObservation:
        self.dx, self.dy = int(kwargs.get("dx", 3)), int(kwargs.get("dy", 2))
        self.budget = int(kwargs.get("budget", abs(self.dx) + abs(self.dy) + 2))
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return GoalObservation(goal=goal_text(self.dx, self.dy), reward=0.0, done=False)

    def step(self, action: MoveAction, timeout_s: float | None = None, **kwargs: Any) -> GoalObservation:
        self._state.step_count += 1
        mx, my = MOVES[action.move]
        self.dx, self.dy = self.dx - mx, self.dy - my
        arrived = (self.dx, self.dy) == (0, 0)
        done = arrived or self._state.step_count >= self.budget
        return GoalObservation(goal=goal_text(self.dx, self.dy), reward=float(arrived), done=done)

    @property
    def state(self) -> State:
        return self._state


app = create_app(GridWalkEnvironment, MoveAction, GoalObservation, max_concurrent_envs=64)
