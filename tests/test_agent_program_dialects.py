"""Agent programs on the Responses and Messages APIs train unchanged: the OpenAI Agents SDK on its
default model class (``OpenAIResponsesModel``) and a tool loop over the ``anthropic`` SDK, each
through the ``agent_program`` env, in exact steps and through the real Trainer with the tiny model."""

from __future__ import annotations

import asyncio
import json

import anthropic
import pytest
import torch
from doubles import ScriptedEngine

from agent_r1.envs.agent_program import AgentProgramEnv, AgentResult
from agent_r1.flows.base import AgentEnvLoop
from agent_r1.train.config import config_from_dict
from agent_r1.train.trainer import Trainer
from agent_r1.types import SamplingParams, TrajectoryStatus

agents = pytest.importorskip("agents")

CALL = '<tool_call>{"name": "multiply", "arguments": {"a": 6, "b": 7}}</tool_call>'
TASK = {"id": "x", "prompt": "What is 6 * 7?", "answer": "42"}


@agents.function_tool
def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor.
        b: the second factor.
    """
    return a * b


async def responses_sdk_agent(task, client) -> AgentResult:
    """An ordinary Agents SDK program on its default Responses model, pointed at the gateway's client.
    A response cut by the call's token limit is ``incomplete``, which the SDK raises as
    ``ModelBehaviorError``: the agent then has no answer."""
    model = agents.OpenAIResponsesModel(model="policy", openai_client=client)
    agent = agents.Agent(name="calculator", instructions="Use the tools.", tools=[multiply], model=model)
    try:
        result = await agents.Runner.run(
            agent, task["prompt"], run_config=agents.RunConfig(tracing_disabled=True)
        )
    except agents.ModelBehaviorError:
        return AgentResult(reward=0.0, answer="")
    answer = result.final_output or ""
    return AgentResult(reward=float(answer.strip() == task.get("answer")), answer=answer)


async def streamed_sdk_agent(task, client) -> AgentResult:
    """The same agent, run streamed (``Runner.run_streamed``: the SDK reads the Responses events)."""
    model = agents.OpenAIResponsesModel(model="policy", openai_client=client)
    agent = agents.Agent(name="calculator", instructions="Use the tools.", tools=[multiply], model=model)
    result = agents.Runner.run_streamed(
        agent, task["prompt"], run_config=agents.RunConfig(tracing_disabled=True)
    )
    kinds = [event.type async for event in result.stream_events()]
    answer = result.final_output or ""
    return AgentResult(
        reward=float(answer.strip() == task["answer"]), answer=answer, info={"events": len(kinds)}
    )


MULTIPLY = {
    "name": "multiply",
    "description": "Multiply two integers.",
    "input_schema": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
    },
}


async def anthropic_agent(task, client: anthropic.AsyncAnthropic) -> AgentResult:
    """A tool loop over the anthropic SDK: tool_use blocks are run and answered with tool_result
    blocks; a text answer is asked to be checked once."""
    messages: list[dict] = [{"role": "user", "content": task["prompt"]}]
    answers = []
    for _ in range(4):
        message = await client.messages.create(
            model="policy", max_tokens=1024, system="Use the tools.", messages=messages, tools=[MULTIPLY]
        )
        messages.append(
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]}
        )
        uses = [b for b in message.content if b.type == "tool_use"]
        if uses:
            results = [
                {"type": "tool_result", "tool_use_id": u.id, "content": str(u.input["a"] * u.input["b"])}
                for u in uses
            ]
            messages.append({"role": "user", "content": results})
            continue
        answers.append("".join(b.text for b in message.content if b.type == "text"))
        if len(answers) == 2:
            break
        messages.append({"role": "user", "content": "Check your answer, then give it again."})
    answer = answers[-1] if answers else ""
    return AgentResult(reward=float(answer.strip() == task.get("answer")), answer=answer)


def run(tokenizer, script, agent, **env_kwargs):
    loop = AgentEnvLoop(
        lambda: AgentProgramEnv(tokenizer, agent, **env_kwargs), tokenizer, SamplingParams(max_tokens=128)
    )
    return asyncio.run(loop.run(ScriptedEngine(tokenizer, script), TASK))


def test_an_agents_sdk_agent_on_its_default_responses_model_runs_in_exact_steps(tiny_tokenizer):
    trajectory = run(tiny_tokenizer, [CALL, "42"], responses_sdk_agent)
    assert trajectory.status is TrajectoryStatus.OK, trajectory.error
    assert trajectory.outcome_reward == 1.0
    first, second = trajectory.steps
    assert first.info["gateway"]["tool_calls"] == 1
    assert "<tool_response>\n42\n</tool_response>" in tiny_tokenizer.decode(list(second.prompt_ids))
    assert "Use the tools." in tiny_tokenizer.decode(list(first.prompt_ids))  # the instructions
    assert second.info["gateway"]["prompt"] == "extends" and second.info["exact_fraction"] == 1.0


def test_the_agents_sdk_reads_the_streamed_responses_events(tiny_tokenizer):
    trajectory = run(tiny_tokenizer, [CALL, "42"], streamed_sdk_agent)
    assert trajectory.status is TrajectoryStatus.OK, trajectory.error
    assert trajectory.outcome_reward == 1.0 and trajectory.steps[-1].info["events"] > 0
    assert [s.info["gateway"]["prompt"] for s in trajectory.steps] == ["fresh", "extends"]


def test_an_anthropic_tool_loop_runs_in_exact_steps(tiny_tokenizer):
    trajectory = run(tiny_tokenizer, [CALL, "42", "42"], anthropic_agent, sdk="anthropic")
    assert trajectory.status is TrajectoryStatus.OK, trajectory.error
    assert trajectory.outcome_reward == 1.0 and len(trajectory.steps) == 3
    prompts = [tiny_tokenizer.decode(list(s.prompt_ids)) for s in trajectory.steps]
    assert "<tool_response>\n42\n</tool_response>" in prompts[1] and "Check your answer" in prompts[2]
    assert [s.info["gateway"]["prompt"] for s in trajectory.steps] == ["fresh", "extends", "extends"]
    assert trajectory.steps[-1].info["exact_fraction"] == 1.0
    with pytest.raises(ValueError, match="sdk must be 'openai' or 'anthropic'"):
        AgentProgramEnv(tiny_tokenizer, anthropic_agent, sdk="claude")


def test_a_missing_client_is_refused_at_the_start_naming_the_agents_extra(monkeypatch):
    """The base install has neither client; pyproject's ``agents`` extra installs both."""
    import importlib.util
    import re
    from pathlib import Path

    from agent_r1.envs.base import EnvKwargsError

    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert re.search(r'^agents = \["openai>=1\.0", "anthropic>=0\.40"\]', pyproject, re.M)
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "anthropic" else real(name, *a)
    )
    kwargs = {"agent": "test_agent_program_dialects:anthropic_agent", "sdk": "anthropic"}
    with pytest.raises(EnvKwargsError, match=r"pip install 'agent-r1\[agents\]'") as error:
        AgentProgramEnv.check_kwargs(kwargs)
    assert error.value.key == "sdk"


def ascii_share(result: AgentResult, task) -> float:
    """A dense reward for a random tiny model: the share of ASCII characters in its final answer."""
    answer = result.answer or ""
    return sum(ch.isascii() for ch in answer) / max(len(answer), 1)


def call_ascii_share(record, task) -> float:
    """The same, per call, on the call's text (the Agents SDK raises on a cut response, so the
    outcome carries no answer there)."""
    text = record.text
    return sum(ch.isascii() for ch in text) / max(len(text), 1)


def train(tmp_path, tiny_checkpoint, env_kwargs: dict) -> list[dict]:
    config = config_from_dict(
        {
            "model": {"path": str(tiny_checkpoint)},
            "env": {"name": "agent_program", "kwargs": env_kwargs},
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
    tasks = [
        {"id": f"t{i}", "prompt": f"What is {i} * {i + 1}?", "answer": str(i * (i + 1))} for i in range(4)
    ]
    trainer = Trainer(config, train_tasks=tasks)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.fit()
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    lines = (tmp_path / "trajectories" / "step_000002.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert len(records) == 8 and all(r["status"] == "ok" for r in records), [r.get("error") for r in records]
    return records


def test_training_an_agents_sdk_responses_agent(tiny_checkpoint, tmp_path):
    records = train(
        tmp_path,
        tiny_checkpoint,
        {
            "agent": "test_agent_program_dialects:responses_sdk_agent",
            "call_reward": "test_agent_program_dialects:call_ascii_share",
        },
    )
    for record in records:
        first = record["steps"][0]
        assert first["info"]["gateway"]["prompt"] == "fresh"
        assert "Use the tools." in first["info"]["prompt_text"] and "multiply" in first["info"]["prompt_text"]
        assert len(first["response_ids"]) == len(first["logprobs"]) > 0


def test_training_an_anthropic_tool_loop(tiny_checkpoint, tmp_path):
    records = train(
        tmp_path,
        tiny_checkpoint,
        {
            "agent": "test_agent_program_dialects:anthropic_agent",
            "reward_fn": "test_agent_program_dialects:ascii_share",
            "sdk": "anthropic",
        },
    )
    for record in records:
        steps = record["steps"]
        assert len(steps) == 2  # an answer, then its check (the tiny model calls no tool)
        assert [s["info"]["gateway"]["prompt"] for s in steps] == ["fresh", "extends"]
        assert "Check your answer" in steps[1]["info"]["prompt_text"]
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["gateway/exact_fraction"] for m in metrics if "reward/mean" in m] == [1.0, 1.0]
