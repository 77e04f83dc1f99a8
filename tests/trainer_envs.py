"""A small real environment for the trainer tests (importable by subprocesses via PYTHONPATH=tests).

``LowByteEnv``: a two-turn token-level episode. Each response earns the fraction of its tokens whose id
is below 128 (the lower half of the byte vocabulary) as an immediate reward; the next prompt is the
previous prompt + response + a fixed user turn (the "append" context, so steps merge into one
sequence). A random tiny model earns about 0.5 per turn; a policy gradient raises it quickly.

``echo_env``: a ``ToolEnv`` in which every response is a tool call, so episodes run to ``max_turns``
whatever a random model writes (for context policies such as ``summarize``).
"""

from __future__ import annotations

import asyncio
import os
import signal
from dataclasses import dataclass
from pathlib import Path

from agent_r1.envs.base import AgentEnv
from agent_r1.envs.tool_env import ToolEnv
from agent_r1.tools import ParsedResponse, ToolCall, ToolCallFormat, tool
from agent_r1.types import Action, Observation, StepResult, Task

TURNS = 2


class LowByteEnv(AgentEnv):
    def __init__(self, tokenizer, turns: int = TURNS) -> None:
        self.tokenizer = tokenizer
        self.turns = turns

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    async def reset(self, task: Task) -> Observation:
        self.turn = 0
        self.ids = self._encode(f"<|im_start|>user\n{task['prompt']}<|im_end|>\n<|im_start|>assistant\n")
        return Observation(token_ids=self.ids)

    async def step(self, action: Action) -> StepResult:
        self.turn += 1
        ids = action.token_ids
        reward = sum(1 for t in ids if t < 128) / max(len(ids), 1)
        done = self.turn >= self.turns
        self.ids = (
            self.ids
            + list(ids)
            + self._encode("\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n")
        )
        return StepResult(
            observation=None if done else Observation(token_ids=self.ids),
            reward=reward,
            terminated=done,
            info={"success": reward > 0.75},
        )


@tool
def echo(text: str) -> str:
    """Repeat the text.

    Args:
        text: what to repeat.
    """
    return text


class EveryResponseEchoes(ToolCallFormat):
    """A test format: every response is one call to ``echo``, so a random model keeps acting and the
    conversation grows turn by turn (as a context policy needs to be exercised)."""

    name = "test_every_response_echoes"

    def parse(self, text: str) -> ParsedResponse:
        return ParsedResponse("", (ToolCall("echo", {"text": text[:12]}, "call_0"),), ())

    def observation_messages(self, results, errors):
        return [{"role": "tool", "content": r.content} for r in results]

    def system_prompt(self, tool_schemas):
        return "Call echo."  # instead of the template's ~500-token tools block: shorter prompts


def echo_env(tokenizer, **kwargs) -> ToolEnv:
    """``ToolEnv`` with ``echo`` in the ``EveryResponseEchoes`` format; ``kwargs`` are ToolEnv's (a
    config's ``env.kwargs``: ``context``, ``context_kwargs``, ``max_turns``)."""
    return ToolEnv(tokenizer, [echo], format=EveryResponseEchoes(), **kwargs)


def tasks(n: int, offset: int = 0) -> list[dict]:
    return [{"id": f"t{i}", "prompt": f"task {i}"} for i in range(offset, offset + n)]


@dataclass(frozen=True)
class ReinforceObjective:
    """A custom per-token objective (plain REINFORCE, ``-A * log pi``, with a stat of its own): what a
    user passes as ``Trainer(objective=...)``. Defined in an importable module so that Ray workers can
    unpickle it."""

    scale: float = 1.0

    def __call__(self, logprobs_K, entropy_K, tokens):
        loss_K = -self.scale * tokens.advantages * logprobs_K * tokens.mask
        live = tokens.mask > 0
        mean_logprob = float((logprobs_K.detach() * live).sum() / live.sum().clamp(min=1))
        return loss_K, {"custom/mean_logprob": mean_logprob}


class KillOnceEnv(LowByteEnv):
    """``LowByteEnv`` that counts its resets in ``counter`` (a file) and SIGKILLs its own process at
    reset number ``kill_at``, once (``counter`` + ".killed" marks it): a crash at an exact point of a
    rollout, for the resume tests. Resets run on one event loop, one at a time."""

    def __init__(self, tokenizer, counter: str, kill_at: int) -> None:
        super().__init__(tokenizer)
        self.counter, self.kill_at = Path(counter), kill_at

    async def reset(self, task: Task) -> Observation:
        count = (int(self.counter.read_text()) if self.counter.exists() else 0) + 1
        self.counter.write_text(str(count))
        marker = Path(f"{self.counter}.killed")
        if count == self.kill_at and not marker.exists():
            marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)
        return await super().reset(task)


class JitteryLowByteEnv(LowByteEnv):
    """``LowByteEnv`` whose resets and steps return after a random pause (0-20 ms, drawn from the OS,
    not from any seeded generator): which turns the engine finds live together then changes from run
    to run, as it does under load. For the determinism tests: a run's result must not depend on it."""

    async def _jittered_reset(self, task: Task) -> Observation:
        await asyncio.sleep(int.from_bytes(os.urandom(1), "little") / 255 * 0.02)
        return await super().reset(task)

    async def step(self, action: Action) -> StepResult:
        await asyncio.sleep(int.from_bytes(os.urandom(1), "little") / 255 * 0.02)
        return await super().step(action)

    _resets = 0  # in this process

    async def reset(self, task: Task) -> Observation:
        """``JITTER_PAUSE="RESET:SECONDS:MARKER"``: at this process's RESET-th reset, if MARKER does not
        exist yet, create it and pause (a rollout in progress, for a test to signal or kill)."""
        JitteryLowByteEnv._resets += 1
        pause = os.environ.get("JITTER_PAUSE")
        if pause:
            count, seconds, marker = pause.split(":", 2)
            if JitteryLowByteEnv._resets == int(count) and not Path(marker).exists():
                Path(marker).touch()
                await asyncio.sleep(float(seconds))
        return await self._jittered_reset(task)


class SignalAtStepEnv(LowByteEnv):
    """``LowByteEnv`` whose ``step`` sends its own process ``signum`` (once, at the process's
    ``at``-th env step), synchronously inside the coroutine: Python then runs the signal handler in
    the middle of the env's own code, not while the event loop waits.

    ``stall_at``: the process's ``stall_at``-th reset instead waits ``stall_s`` seconds (a trajectory
    still running when the signal lands); ``stalled`` records how that wait ended: "cancelled" or
    "finished"."""

    steps = 0
    resets = 0
    stalled: str | None = None

    def __init__(self, tokenizer, signum: int, at: int, stall_at: int = 0, stall_s: float = 0.0) -> None:
        super().__init__(tokenizer)
        self.signum, self.at = signum, at
        self.stall_at, self.stall_s = stall_at, stall_s

    async def reset(self, task: Task) -> Observation:
        SignalAtStepEnv.resets += 1
        if SignalAtStepEnv.resets == self.stall_at:
            try:
                await asyncio.sleep(self.stall_s)
            except asyncio.CancelledError:
                SignalAtStepEnv.stalled = "cancelled"
                raise
            SignalAtStepEnv.stalled = "finished"
        return await super().reset(task)

    async def step(self, action: Action) -> StepResult:
        SignalAtStepEnv.steps += 1
        if SignalAtStepEnv.steps == self.at:
            os.kill(os.getpid(), self.signum)
            sum(range(1000))  # bytecode after the signal: the handler runs here, inside this coroutine
        return await super().step(action)


class LowHighEnv(AgentEnv):
    """Two roles that want opposite things from near-identical prompts: ``low`` earns the fraction of
    its response's token ids below 128, then ``high`` earns the fraction at or above 128, each as the
    immediate reward of its own step (so a role's trajectory holds exactly its own reward). One shared
    policy cannot serve both; a policy per role can (issue 50's specialisation task, in miniature)."""

    task_fields = ("id", "prompt")

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def _prompt(self, role: str, text: str) -> Observation:
        ids = self.tokenizer.encode(
            f"<|im_start|>user\n{text} ({role})<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
        )
        return Observation(token_ids=ids, role=role)

    async def reset(self, task: Task) -> Observation:
        self.task, self.role = task, "low"
        return self._prompt("low", task["prompt"])

    async def step(self, action: Action) -> StepResult:
        ids = action.token_ids
        low = sum(1 for t in ids if t < 128) / max(len(ids), 1)
        if self.role == "low":
            self.role = "high"
            return StepResult(self._prompt("high", self.task["prompt"]), reward=low)
        return StepResult(None, reward=1.0 - low, terminated=True)
