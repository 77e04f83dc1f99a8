"""A custom environment in ~50 lines: guess a secret number, told "higher" or "lower" after each guess.

Written only against the public API (see docs/environments.md). Run it to check the env's contract
and roll out a few episodes with the tiny local model:

    python examples/custom_env.py
"""

from __future__ import annotations

import re

from agent_r1.envs import AgentEnv, check_env, register_env
from agent_r1.types import Action, Observation, StepResult


class GuessNumberEnv(AgentEnv):
    """Task: ``{"secret": 37, "low": 1, "high": 100}``. The model answers with a number each turn.

    Immediate reward: -0.1 per unparsable answer. Outcome reward: 1.0 when the number is guessed.
    Truncated after ``max_guesses`` turns.
    """

    def __init__(self, max_guesses: int = 7) -> None:
        self.max_guesses = max_guesses

    async def reset(self, task) -> Observation:
        self.secret, self.guesses = int(task["secret"]), 0
        self.messages = [
            {"role": "system", "content": "Reply with a single integer."},
            {"role": "user", "content": f"Guess my number between {task['low']} and {task['high']}."},
        ]
        return Observation(messages=self.messages)

    async def step(self, action: Action) -> StepResult:
        self.guesses += 1
        reply = action.text.removesuffix("<|im_end|>")
        self.messages = [*self.messages, {"role": "assistant", "content": reply}]
        match = re.search(r"-?\d+", reply)
        if match is None:
            feedback, reward = "That is not a number.", -0.1
        elif int(match.group()) == self.secret:
            return StepResult(None, terminated=True, outcome_reward=1.0, info={"success": True})
        else:
            feedback, reward = ("Higher." if int(match.group()) < self.secret else "Lower."), 0.0
        if self.guesses >= self.max_guesses:
            return StepResult(None, reward=reward, truncated=True, info={"success": False})
        self.messages = [*self.messages, {"role": "user", "content": feedback}]
        return StepResult(Observation(messages=self.messages), reward=reward)


register_env("guess_number", GuessNumberEnv)


def main() -> None:
    import asyncio

    from agent_r1.flows import AgentEnvLoop, rollout_group
    from agent_r1.models.tiny import build_tiny
    from agent_r1.rollout.hf import HFEngine
    from agent_r1.types import SamplingParams

    task = {"id": "g37", "secret": 37, "low": 1, "high": 100}
    check_env(GuessNumberEnv, task, actions=["50", "25", "37"])
    model, tokenizer = build_tiny(seed=0)  # random weights: it guesses badly until trained
    engine = HFEngine(model, tokenizer=tokenizer)
    flow = AgentEnvLoop(GuessNumberEnv, tokenizer, SamplingParams(max_tokens=8), max_steps=7)
    group = asyncio.run(rollout_group(flow, engine, task, n=4, group_id="demo"))
    engine.close()
    for trajectory in group.trajectories:
        guesses = [s.response_text for s in trajectory.steps]
        print(f"{trajectory.status.value}: reward {trajectory.total_reward:+.1f} after {guesses}")


if __name__ == "__main__":
    main()
