"""A LangGraph agent (its prebuilt ReAct agent over ``langchain-openai``), trained as it is.

Nothing here knows about agent-r1 except the function's signature: ``ChatOpenAI`` is pointed at the
client's base URL and key (the rollout's gateway session), the graph runs its tools, and the final
message is scored. Train it with ``env.name: agent_program``, ``env.kwargs.agent:
langgraph_agent:calculator_agent`` (this file beside the config, or in the working directory)::

    pip install langgraph langchain-openai

The task rows are ``{"prompt": "What is 3 * (4 + 5)?", "answer": "27"}``, or reasoning-gym rows whose
``prompt`` is ``[system, user]`` messages. ``demonstrations`` (optional, in ``agent_kwargs``) are
worked exchanges put before the question: ``(question, call expression, result, answer)`` tuples.
"""

from __future__ import annotations

import os
import re

# Offline and quiet: no LangSmith tracing (the default is off; a user's environment may turn it on).
os.environ["LANGSMITH_TRACING"] = "false"
os.environ["LANGCHAIN_TRACING_V2"] = "false"

import httpx  # noqa: E402
import openai  # noqa: E402
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402
from langchain_openai import ChatOpenAI  # noqa: E402
from langgraph.prebuilt import create_react_agent  # noqa: E402

from agent_r1.envs.agent_program import AgentResult  # noqa: E402
from agent_r1.tools.calculator import CalculatorError, evaluate, format_number  # noqa: E402

SYSTEM = (
    "Solve the arithmetic problem with the calculator tool, then give the result as <answer>NUMBER</answer>."
)
_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / and parentheses.

    Args:
        expression: e.g. 3 * (4 + 5)
    """
    try:
        return format_number(evaluate(expression))
    except CalculatorError as e:
        return f"Error: {e}"


def _call_text(expression: str) -> str:
    return f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}</tool_call>'


def demonstration_messages(demonstrations) -> list:
    """Worked exchanges as LangChain messages. Each call is both the model's raw text and the
    structured call (so templates that render only text, as SmolLM2's, still show it)."""
    messages: list = []
    for i, (question, expression, result, answer) in enumerate(demonstrations):
        call_id = f"demo_{i}"
        messages += [
            HumanMessage(question),
            AIMessage(
                _call_text(expression),
                tool_calls=[{"name": "calculator", "args": {"expression": expression}, "id": call_id}],
            ),
            ToolMessage(result, tool_call_id=call_id),
            AIMessage(f"<answer>{answer}</answer>"),
        ]
    return messages


def score(answer: str | None, expected: str) -> float:
    """1.0 when the last ``<answer>`` (or, without one, the last number) equals ``expected``."""
    if answer is None:
        return 0.0
    tagged = _ANSWER_RE.findall(answer)
    found = tagged[-1].strip() if tagged else (re.findall(r"-?\d+(?:\.\d+)?", answer) or [""])[-1]
    try:
        return float(abs(float(found) - float(expected)) <= 1e-9 * max(1.0, abs(float(expected))))
    except ValueError:
        return float(found == expected)


async def calculator_agent(
    task: dict,
    client: openai.AsyncOpenAI,
    *,
    demonstrations: list | None = None,
    max_turns: int = 4,
) -> AgentResult:
    """Answer ``task["prompt"]`` with LangGraph's ReAct agent and the calculator."""
    # Its own HTTP client, closed with the run: langchain-openai otherwise caches one per base URL,
    # i.e. one per rollout session, left to be closed after the rollout's event loop has ended.
    http = httpx.AsyncClient(timeout=None)
    model = ChatOpenAI(
        model="policy",
        base_url=str(client.base_url),
        api_key=client.api_key,
        max_retries=0,
        http_async_client=http,
    )
    prompt = task["prompt"]
    if isinstance(prompt, list):  # [system, user] chat messages (reasoning-gym rows)
        system, question = prompt[0]["content"], prompt[-1]["content"]
    else:
        system, question = SYSTEM, prompt
    agent = create_react_agent(model, [calculator], prompt=system)
    messages = [*demonstration_messages(demonstrations or ()), HumanMessage(question)]
    try:  # each model call + its tool run is two graph steps; one more for the final answer
        state = await agent.ainvoke({"messages": messages}, {"recursion_limit": 2 * max_turns + 1})
    finally:
        await http.aclose()
    final = state["messages"][-1]
    answer = final.content if isinstance(final, AIMessage) and isinstance(final.content, str) else None
    return AgentResult(reward=score(answer, str(task["answer"])), answer=answer)
