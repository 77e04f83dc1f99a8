"""examples/custom_env.py: the env passes check_env, is reachable by name and entry point, and a
scripted binary-search policy (the ScriptedEngine test double) solves it."""

import asyncio
import re
import sys
from pathlib import Path

import pytest
from doubles import ScriptedEngine

from agent_r1.envs import EnvCheckError, check_env, make_env
from agent_r1.flows import AgentEnvLoop, rollout_group
from agent_r1.types import SamplingParams, TrajectoryStatus

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture(scope="module")
def custom_env():
    sys.path.insert(0, str(EXAMPLES))
    try:
        import custom_env

        yield custom_env
    finally:
        sys.path.remove(str(EXAMPLES))


TASK = {"id": "g", "secret": 37, "low": 1, "high": 100}


def binary_search(prompt: str) -> str:
    """A scripted policy: bisect using the "Higher."/"Lower." replies in the conversation so far."""
    low, high = 1, 100
    guesses = [int(g) for g in re.findall(r"<\|im_start\|>assistant\n(-?\d+)<\|im_end\|>", prompt)]
    replies = re.findall(r"<\|im_start\|>user\n(Higher|Lower)\.", prompt)
    for guess, reply in zip(guesses, replies, strict=True):
        low, high = (guess + 1, high) if reply == "Higher" else (low, guess - 1)
    return str((low + high) // 2)


def test_example_env_passes_check_env(custom_env, tiny_tokenizer):
    check_env(custom_env.GuessNumberEnv, TASK, actions=["50", "twenty", "37"], tokenizer=tiny_tokenizer)
    with pytest.raises(EnvCheckError, match="reset\\(task\\) raised KeyError: 'secret'"):
        check_env(custom_env.GuessNumberEnv, {"low": 1, "high": 2})


def test_example_env_by_name_and_entry_point(custom_env):
    assert isinstance(make_env("guess_number", max_guesses=3), custom_env.GuessNumberEnv)
    assert make_env("custom_env:GuessNumberEnv").max_guesses == 7


def test_scripted_binary_search_wins_and_bad_answers_cost(custom_env, tiny_tokenizer):
    flow = AgentEnvLoop(custom_env.GuessNumberEnv, tiny_tokenizer, SamplingParams(max_tokens=8), max_steps=10)
    won = asyncio.run(flow.run(ScriptedEngine(tiny_tokenizer, binary_search), TASK))
    assert won.status is TrajectoryStatus.OK and won.info == {"success": True}
    assert [s.response_text for s in won.steps] == ["50<|im_end|>", "25<|im_end|>", "37<|im_end|>"]
    assert won.total_reward == 1.0 and won.steps[-1].terminated

    group = asyncio.run(
        rollout_group(flow, ScriptedEngine(tiny_tokenizer, lambda p: "no idea"), TASK, 2, "g")
    )
    for lost in group.trajectories:
        assert len(lost.steps) == 7 and lost.steps[-1].truncated and lost.info == {"success": False}
        assert lost.total_reward == pytest.approx(-0.7)


def test_example_main_rolls_out_the_tiny_model(custom_env, capsys):
    custom_env.main()  # check_env, then 4 episodes with the tiny Qwen2 served by HFEngine
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 4 and all(line.startswith(("ok:", "truncated:")) for line in lines), lines
