"""A calculator agent written only with the ``openai`` package, trained as it is.

The agent is an ordinary tool loop: tools as OpenAI function schemas, ``chat.completions.create``,
run the ``tool_calls``, send the results back, stop at an answer. Nothing in it knows about agent-r1:
pointed at ``https://api.openai.com`` it runs against OpenAI; pointed at the trainer's gateway (the
``agent_program`` env) every call it makes is one training step. Train it with::

    agent-r1 train configs/my_run.yaml env.name=agent_program \\
        env.kwargs='{"agent": "openai_agent:calculator_agent"}'   # examples/ on PYTHONPATH

The task rows are ``{"prompt": "What is 3 * (4 + 5)?", "answer": "27"}``. The agent returns an
``AgentResult``: the reward (1.0 for the right number in the final answer, else 0.0) and the answer
text, so a ``reward_fn`` in ``env.kwargs`` may score the answer another way instead.
"""

from __future__ import annotations

import ast
import json
import operator
import re

import openai

from agent_r1.envs.agent_program import AgentResult

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculate",
            "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "e.g. 3 * (4 + 5)"}},
                "required": ["expression"],
            },
        },
    }
]
SYSTEM = "Solve the arithmetic problem. Use the calculate tool, then give the final number alone."

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculate(expression: str) -> str:
    """The tool: arithmetic only (no names, no calls), or an error message for the model to read."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError(f"unsupported expression element {type(node).__name__}")

    try:
        result = value(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as e:
        return f"Error: {e}"
    return str(int(result)) if float(result).is_integer() else str(result)


async def calculator_agent(task: dict, client: openai.AsyncOpenAI, *, max_turns: int = 4) -> AgentResult:
    """Answer ``task["prompt"]`` with the calculator; the reward is 1.0 for ``task["answer"]``."""
    messages: list[dict] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": task["prompt"]},
    ]
    for _ in range(max_turns):
        response = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            answer = message.content or ""
            numbers = re.findall(r"-?\d+(?:\.\d+)?", answer)
            return AgentResult(
                reward=float(bool(numbers) and numbers[-1] == str(task["answer"])), answer=answer
            )
        for call in message.tool_calls:
            try:
                expression = json.loads(call.function.arguments).get("expression", "")
            except (ValueError, AttributeError):
                expression = ""
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculate(str(expression))})
    return AgentResult(reward=0.0, answer=None)
