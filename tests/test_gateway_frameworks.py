"""Real agent frameworks train unchanged through the gateway: a LangGraph ReAct agent (over
``langchain-openai``) and a pydantic-ai agent, from ``examples/``, offline.

Each framework: one scripted episode (the tiny tokenizer, a scripted engine: a tool call, the
framework runs its tool, the answer) shows the round trip and exactness; then a few real training
steps with the tiny model through the real ``Trainer`` and the ``agent_program`` env, configured by
import path as a user would.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from doubles import ScriptedEngine

from agent_r1.envs.agent_program import AgentProgramEnv, AgentResult
from agent_r1.flows.base import AgentEnvLoop
from agent_r1.train.config import config_from_dict
from agent_r1.train.trainer import Trainer
from agent_r1.types import SamplingParams, TrajectoryStatus

os.environ["LANGSMITH_TRACING"] = "false"  # offline: no tracing, whatever the user's environment says
os.environ["LANGCHAIN_TRACING_V2"] = "false"
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture(scope="module", autouse=True)
def examples_on_path():
    sys.path.insert(0, str(EXAMPLES))
    yield
    sys.path.remove(str(EXAMPLES))


def episode(tokenizer, agent, script, task, **env_kwargs):
    loop = AgentEnvLoop(
        lambda: AgentProgramEnv(tokenizer, agent, **env_kwargs), tokenizer, SamplingParams(max_tokens=128)
    )
    return asyncio.run(loop.run(ScriptedEngine(tokenizer, script), task))


def check_round_trip(tokenizer, trajectory, tool_name: str, result: str) -> None:
    assert trajectory.status is TrajectoryStatus.OK, trajectory.error
    assert trajectory.outcome_reward == 1.0
    first, second = trajectory.steps
    assert first.info["gateway"]["tool_calls"] == 1 and first.info["gateway"]["prompt"] == "fresh"
    assert second.info["gateway"]["prompt"] == "extends" and second.info["exact_fraction"] == 1.0
    assert second.prompt_ids[: len(first.prompt_ids) + len(first.response_ids)] == (
        *first.prompt_ids,
        *first.response_ids,
    )
    assert f'"name": "{tool_name}"' in tokenizer.decode(
        list(first.prompt_ids)
    )  # the schema reached the prompt
    delta = tokenizer.decode(list(second.prompt_ids[len(first.prompt_ids) + len(first.response_ids) :]))
    assert f"<tool_response>\n{result}\n</tool_response>" in delta  # the framework ran its tool


def test_a_langgraph_react_agent_round_trip(tiny_tokenizer):
    pytest.importorskip("langgraph")
    import langgraph_agent

    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "3 * (4 + 5)"}}</tool_call>'
    task = {"id": "x", "prompt": "What is 3 * (4 + 5)?", "answer": "27"}
    trajectory = episode(
        tiny_tokenizer, langgraph_agent.calculator_agent, [call, "<answer>27</answer>"], task
    )
    check_round_trip(tiny_tokenizer, trajectory, "calculator", "27")


def test_a_pydantic_ai_agent_round_trip(tiny_tokenizer):
    pytest.importorskip("pydantic_ai")
    import pydantic_ai_agent

    call = '<tool_call>{"name": "convert", "arguments": {"value": 3.5, "from_unit": "km", "to_unit": "m"}}</tool_call>'
    task = {"id": "x", "prompt": "How many metres are 3.5 km?", "answer": "3500"}
    trajectory = episode(tiny_tokenizer, pydantic_ai_agent.unit_agent, [call, "3500"], task)
    check_round_trip(tiny_tokenizer, trajectory, "convert", "3500")


def ascii_share(result: AgentResult, task) -> float:
    """A dense reward for the random tiny model: the share of ASCII characters in its final answer."""
    answer = result.answer or ""
    return sum(ch.isascii() for ch in answer) / max(len(answer), 1)


@pytest.mark.parametrize(
    ("module", "agent", "signature", "tasks"),
    [
        (
            "langgraph",
            "langgraph_agent:calculator_agent",
            "calculator(expression: string) - Evaluate",
            [{"id": f"t{i}", "prompt": f"What is {i} * 7?", "answer": str(7 * i)} for i in range(4)],
        ),
        (
            "pydantic_ai",
            "pydantic_ai_agent:unit_agent",
            "convert(value: number, from_unit: string, to_unit: string) - Convert",
            [
                {"id": f"t{i}", "prompt": f"How many metres are {i} km?", "answer": str(1000 * i)}
                for i in range(4)
            ],
        ),
    ],
)
def test_a_framework_agent_trains_with_the_trainer(
    module, agent, signature, tasks, tiny_checkpoint, tmp_path
):
    pytest.importorskip(module)
    config = config_from_dict(
        {
            "model": {"path": str(tiny_checkpoint)},
            "env": {
                "name": "agent_program",
                "kwargs": {
                    "agent": agent,
                    "reward_fn": "test_gateway_frameworks:ascii_share",
                    "tool_prompt": "compact",
                },
            },
            "rollout": {"n": 4, "max_tokens": 8, "max_steps": 2},
            "trainer": {
                "steps": 2,
                "tasks_per_step": 2,
                "lr": 3e-3,
                "run_dir": str(tmp_path),
                "eval_every": 0,
            },
            "logging": {"progress": False},
        }
    )
    trainer = Trainer(config, train_tasks=tasks)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.fit()
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward/mean" in r] == [1, 2]
    for step in (1, 2):
        lines = (tmp_path / "trajectories" / f"step_{step:06d}.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines]
        assert len(records) == 8 and all(r["status"] == "ok" for r in records), records[0].get("error")
        for record in records:
            steps = record["steps"]
            assert steps[0]["info"]["gateway"]["prompt"] == "fresh"
            assert all(s["info"]["gateway"]["prompt"] == "extends" for s in steps[1:])
            prompt = steps[0]["info"]["prompt_text"]
            assert f"# Tools\n{signature}" in prompt and "<tools>" not in prompt  # the compact tool block
            assert all(len(s["response_ids"]) == len(s["logprobs"]) > 0 for s in steps)
