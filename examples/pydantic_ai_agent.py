"""A pydantic-ai agent, trained as it is: its OpenAI chat model is given the rollout's client.

``OpenAIChatModel(..., provider=OpenAIProvider(openai_client=client))`` is the only line that knows
where the model lives; the agent, its tool and its run are ordinary pydantic-ai. Train it with
``env.name: agent_program``, ``env.kwargs.agent: pydantic_ai_agent:unit_agent``::

    pip install "pydantic-ai-slim[openai]"

Task rows: ``{"prompt": "How many metres are 3.5 km?", "answer": "3500"}``.
"""

from __future__ import annotations

import re

import openai
from pydantic_ai import Agent
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

from agent_r1.envs.agent_program import AgentResult

SYSTEM = "Convert units with the convert tool, then give the number alone."
_FACTORS = {"mm": 0.001, "cm": 0.01, "m": 1.0, "km": 1000.0, "in": 0.0254, "ft": 0.3048, "mi": 1609.344}


def convert(value: float, from_unit: str, to_unit: str) -> str:
    """Convert a length between units (mm, cm, m, km, in, ft, mi).

    Args:
        value: the length in from_unit.
        from_unit: the unit of value.
        to_unit: the unit wanted.
    """
    if from_unit not in _FACTORS or to_unit not in _FACTORS:
        return f"Error: units must be among {sorted(_FACTORS)}"
    return f"{value * _FACTORS[from_unit] / _FACTORS[to_unit]:g}"


async def unit_agent(task: dict, client: openai.AsyncOpenAI) -> AgentResult:
    """Answer ``task["prompt"]``; the reward is 1.0 when the reply's last number is the answer."""
    model = OpenAIChatModel("policy", provider=OpenAIProvider(openai_client=client))
    agent = Agent(model, system_prompt=SYSTEM, tools=[convert])  # no instrumentation unless configured
    result = await agent.run(task["prompt"])
    answer = str(result.output)
    numbers = re.findall(r"-?\d+(?:\.\d+)?", answer)
    correct = bool(numbers) and float(numbers[-1]) == float(task["answer"])
    return AgentResult(reward=float(correct), answer=answer)
