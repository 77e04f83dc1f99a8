"""OpenEnv environments written in OpenEnv's own format for the adapter's tests (served by uvicorn
from this folder, or made in-process). Nothing here imports agent-r1.

``TextEnvironment`` (chat): the observation echoes the last message. ``stop`` ends the episode
with reward 1.0; ``sleep`` hangs (until ``RELEASE`` is set, in-process); ``crash`` raises.
``GuessEnvironment`` (MCP tools): guess the secret number with the ``guess`` tool; the right guess
ends the episode with reward 1.0.
"""

from __future__ import annotations

import threading
from typing import Any

from fastmcp import FastMCP
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

RELEASE = threading.Event()


class TextAction(Action):
    message: str = Field(..., description="what to say")


class TextObservation(Observation):
    echoed: str = Field(default="")
    turns: int = Field(default=0)


class TextEnvironment(Environment[TextAction, TextObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS: bool = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(step_count=0)
        self.greeting = ""

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, greeting: str = "hi"
    ) -> TextObservation:
        self._state = State(episode_id=episode_id, step_count=0)
        self.greeting = greeting
        return TextObservation(echoed=f"{greeting} (episode {episode_id})", reward=0.0)

    def step(self, action: TextAction, timeout_s: float | None = None, **kwargs: Any) -> TextObservation:
        self._state.step_count += 1
        if action.message == "sleep":
            RELEASE.wait(3600)
        if action.message == "crash":
            raise RuntimeError("boom")
        done = action.message == "stop"
        return TextObservation(
            echoed=action.message, turns=self._state.step_count, reward=1.0 if done else 0.25, done=done
        )

    @property
    def state(self) -> State:
        return self._state


class GuessEnvironment(MCPEnvironment):
    SUPPORTS_CONCURRENT_SESSIONS: bool = True

    def __init__(self) -> None:
        mcp = FastMCP("guess")
        self.secret, self.won, self.tries = 0, False, 0

        @mcp.tool
        def guess(number: int) -> str:
            """Guess the secret number.

            Args:
                number: the guess
            """
            self.tries += 1
            if number == self.secret:
                self.won = True
                return "correct"
            return "higher" if number < self.secret else "lower"

        super().__init__(mcp)

    def reset(self, seed: int | None = None, episode_id: str | None = None, secret: int = 7, **kwargs: Any):
        self.secret, self.won, self.tries = int(secret), False, 0
        return Observation(done=False, reward=0.0)

    def _scored(self, action: Action, observation: Observation) -> Observation:
        if isinstance(action, CallToolAction):
            observation.reward, observation.done = float(self.won), self.won
        return observation

    def step(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return self._scored(action, super().step(action, timeout_s=timeout_s, **kwargs))

    async def step_async(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return self._scored(action, await super().step_async(action, timeout_s=timeout_s, **kwargs))

    def _step_impl(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return Observation(done=False, reward=0.0)

    @property
    def state(self) -> State:
        return State(step_count=self.tries)


text_app = create_app(TextEnvironment, TextAction, TextObservation, max_concurrent_envs=4)
guess_app = create_app(GuessEnvironment, CallToolAction, CallToolObservation, max_concurrent_envs=4)
