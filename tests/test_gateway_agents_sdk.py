"""An agent written with the OpenAI Agents SDK (``openai-agents``) runs through the gateway, offline."""

from __future__ import annotations

import asyncio

import pytest
from doubles import ScriptedEngine

from agent_r1.envs.agent_program import AgentProgramEnv, AgentResult
from agent_r1.flows.base import AgentEnvLoop
from agent_r1.types import SamplingParams, TrajectoryStatus

agents = pytest.importorskip("agents")

CALL = '<tool_call>{"name": "multiply", "arguments": {"a": 6, "b": 7}}</tool_call>'


@agents.function_tool
def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor.
        b: the second factor.
    """
    return a * b


async def sdk_agent(task, client) -> AgentResult:
    """An ordinary Agents SDK program; only its model is pointed at the gateway's client."""
    model = agents.OpenAIChatCompletionsModel(model="policy", openai_client=client)
    agent = agents.Agent(name="calculator", instructions="Use the tools.", tools=[multiply], model=model)
    result = await agents.Runner.run(
        agent, task["prompt"], run_config=agents.RunConfig(tracing_disabled=True)
    )
    return AgentResult(
        reward=float(result.final_output.strip() == task["answer"]), answer=result.final_output
    )


def test_an_agents_sdk_agent_trains_through_the_gateway(tiny_tokenizer):
    loop = AgentEnvLoop(
        lambda: AgentProgramEnv(tiny_tokenizer, sdk_agent), tiny_tokenizer, SamplingParams(max_tokens=128)
    )
    engine = ScriptedEngine(tiny_tokenizer, [CALL, "42"])
    trajectory = asyncio.run(loop.run(engine, {"id": "x", "prompt": "What is 6 * 7?", "answer": "42"}))
    assert trajectory.status is TrajectoryStatus.OK, trajectory.error
    assert trajectory.outcome_reward == 1.0
    first, second = trajectory.steps
    assert first.info["gateway"]["tool_calls"] == 1
    second_prompt = tiny_tokenizer.decode(list(second.prompt_ids))
    assert "<tool_response>\n42\n</tool_response>" in second_prompt  # the SDK ran the tool
    assert "multiply" in tiny_tokenizer.decode(list(first.prompt_ids))
    assert second.info["gateway"]["prompt"] == "extends", second.info["gateway"]
