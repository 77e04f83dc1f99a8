"""A synthetic multi-step tool task: ``a*b+c`` or ``a*b-c`` with a one-operation calculator.

The model is asked e.g. ``Compute 37*84-612`` (two-digit factors whose product has four digits,
a three-digit ``c``: every prompt and every call has the same length, so the numbers to copy sit at
fixed distances, which a tiny model learns far sooner than content-based copying). Its calculator takes exactly ONE binary operation per
call, and a byte-level model of a million parameters cannot multiply two-digit numbers in its head, so
a correct answer needs two calls (``37*84`` -> ``3108``, then ``3108-612`` -> ``2496``) and a final
``<answer>2496</answer>``. Every character is a token for the tiny tokenizer, so the prompt and the
calls are kept short.

The demonstrator (``demonstrate``) is deliberately imperfect, and its errors are *systematic*: for
some inputs its most likely action is wrong, so a model cloned from it by supervised learning makes
the same mistake under greedy decoding, and only reinforcement learning (which samples the rarer right
action and is rewarded for it) can fix it. Its two habits:

- **sign slip**: on subtraction tasks it usually adds ``c`` instead of subtracting it;
- **premature answer**: when the product is 5000 or more it usually answers the product itself,
  skipping the second call.

Train and held-out tasks are disjoint by construction: a task belongs to the held-out split when a
hash of its expression says so, whatever the seed.
"""

from __future__ import annotations

import ast
import hashlib
import json
import operator
import random
import re
from collections.abc import Mapping
from typing import Any

from agent_r1.tools import Tool, tool
from agent_r1.tools.formats import HermesFormat

__all__ = [
    "SYSTEM_PROMPT",
    "TOOL_NAME",
    "answer_text",
    "calculator",
    "calculator_schema",
    "demonstrate",
    "extract_answer",
    "make_env",
    "build_task",
    "make_dataset",
    "score",
    "tool_call_text",
    "tools",
]

TOOL_NAME = "calculator"
SYSTEM_PROMPT = "Use the calculator, one operation per call. End with <answer>N</answer>."
HELDOUT_FRACTION = 0.2
_ANSWER_RE = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
_SYMBOLS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def calculator(expression: str) -> str:
    """Evaluate ONE binary operation on two integers (``+``, ``-`` or ``*``), e.g. ``"37*84"``.

    Anything else (two operations, names, calls, floats, huge operands) raises ``ValueError`` with a
    message the model can read; parsing uses ``ast``, never ``eval``.
    """
    try:
        tree = ast.parse(str(expression).strip(), mode="eval").body
    except SyntaxError as e:
        raise ValueError(f"cannot parse {expression!r}: write one operation such as 12*7") from e
    if not isinstance(tree, ast.BinOp) or type(tree.op) not in _OPERATORS:
        raise ValueError(f"{expression!r} is not one operation of +, - or *, e.g. 12*7")
    operands = []
    for side in (tree.left, tree.right):
        if isinstance(side, ast.UnaryOp) and isinstance(side.op, ast.USub):
            side, sign = side.operand, -1
        else:
            sign = 1
        if not (isinstance(side, ast.Constant) and type(side.value) is int):
            raise ValueError(f"{expression!r}: both operands must be integers (one operation per call)")
        if abs(side.value) >= 10**12:
            raise ValueError(f"{expression!r}: operands must be below 10**12")
        operands.append(sign * side.value)
    return str(_OPERATORS[type(tree.op)](*operands))


def calculator_schema() -> dict[str, Any]:
    """The OpenAI function schema of ``calculator`` (for templates that render tool schemas)."""
    return {
        "type": "function",
        "function": {
            "name": TOOL_NAME,
            "description": "Evaluate one operation on two integers: +, - or *.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "e.g. 12*7"}},
                "required": ["expression"],
            },
        },
    }


def _is_heldout(expression: str) -> bool:
    digest = hashlib.sha256(expression.encode()).digest()
    return digest[0] < 256 * HELDOUT_FRACTION


def make_dataset(n: int, *, split: str = "train", seed: int = 0) -> list[dict[str, Any]]:
    """``n`` distinct tasks of the given split (``"train"`` or ``"test"``), reproducible from ``seed``.

    Each row: ``id``, ``prompt`` (the opening chat messages: the compact system prompt and the
    question), ``expression``, ``a``, ``b``, ``c``, ``op`` (``"+"`` or ``"-"``) and ``answer`` (the
    integer, as a string).
    """
    if split not in ("train", "test"):
        raise ValueError(f"make_dataset: split must be 'train' or 'test', got {split!r}")
    rng = random.Random(f"arithmetic-{split}-{seed}")
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    while len(rows) < n:
        a, b, c = rng.randint(10, 99), rng.randint(10, 99), rng.randint(100, 999)
        op = rng.choice("+-")
        expression = f"{a}*{b}{op}{c}"
        if a * b < 1000 or expression in seen or _is_heldout(expression) != (split == "test"):
            continue
        seen.add(expression)
        answer = _SYMBOLS[op](a * b, c)
        rows.append(
            {
                "id": f"{split}-{seed}-{len(rows)}",
                "prompt": [
                    {"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": f"Compute {expression}"},
                ],
                "expression": expression,
                "a": a,
                "b": b,
                "c": c,
                "op": op,
                "answer": str(answer),
            }
        )
    return rows


def tool_call_text(expression: str) -> str:
    """A calculator call in the Hermes / Qwen2.5 format, exactly as the chat template renders one."""
    call = json.dumps({"name": TOOL_NAME, "arguments": {"expression": expression}})
    return f"<tool_call>\n{call}\n</tool_call>"


def answer_text(value: int | str) -> str:
    return f"<answer>{value}</answer>"


def extract_answer(text: str) -> str | None:
    """The integer inside the last ``<answer>...</answer>`` of ``text``, or None."""
    found = _ANSWER_RE.findall(text)
    return found[-1] if found else None


def score(answer: str | None, task: Mapping[str, Any]) -> float:
    """1.0 when the extracted answer equals the task's answer, else 0.0."""
    if answer is None:
        return 0.0
    try:
        return float(int(answer) == int(task["answer"]))
    except (TypeError, ValueError):
        return 0.0


def demonstrate(task: Mapping[str, Any], rng: random.Random, *, error_rate: float = 0.7) -> list[str]:
    """The assistant responses of one demonstration (without the end-of-turn token).

    With probability ``error_rate`` the demonstrator follows its bad habit where one applies (see
    the module docstring), so for those inputs its most common action is wrong when
    ``error_rate > 0.5``. The tool results it expects are what ``calculator`` returns.
    """
    a, b, c, op = int(task["a"]), int(task["b"]), int(task["c"]), task["op"]
    product = a * b
    first = tool_call_text(f"{a}*{b}")
    if product >= 5000 and rng.random() < error_rate:
        return [first, answer_text(product)]
    if op == "-" and rng.random() < error_rate:
        op = "+"
    return [first, tool_call_text(f"{product}{op}{c}"), answer_text(_SYMBOLS[op](product, c))]


class SystemPromptHermes(HermesFormat):
    """Hermes calls whose tools the task's own system prompt describes: no JSON schemas are rendered.

    ``ToolEnv`` renders the chat template's ``# Tools`` block (hundreds of characters of JSON schema)
    unless the format supplies its own system-prompt text; returning an empty text tells it to render
    neither. A byte-level model pays one token per character, so the arithmetic task's compact
    ``SYSTEM_PROMPT`` replaces the schema block.
    """

    def system_prompt(self, tool_schemas: list[dict]) -> str:
        return ""


def tools() -> list[Tool]:
    """The task's one tool, ``calculator`` (see ``calculator``)."""
    return [tool(calculator, name=TOOL_NAME, timeout=5.0)]


def make_env(tokenizer, *, max_turns: int = 4, context: str = "append"):
    """A ``ToolEnv`` for this task: the calculator, compact prompt, ``<answer>`` scoring.

    Usable as ``env.name: agent_r1.tasks.arithmetic:make_env`` in a training config.
    """
    from agent_r1.envs.tool_env import ToolEnv

    return ToolEnv(
        tokenizer,
        tools(),
        format=SystemPromptHermes(),
        context=context,
        outcome_reward=score,
        extract_answer=extract_answer,
        max_turns=max_turns,
    )


def build_task():
    """The ``arithmetic`` entry of ``agent_r1.tasks.TASKS``."""
    from agent_r1.tasks import TaskSpec

    return TaskSpec(
        name="arithmetic",
        make_dataset=make_dataset,
        tools=tools,
        tool_format=SystemPromptHermes,
        extract_answer=extract_answer,
        reward=score,
        demonstrate=demonstrate,
        max_turns=4,
    )
