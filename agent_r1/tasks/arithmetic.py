"""A synthetic multi-step tool task: ``x*y+z`` (``z`` may be negative) with a one-operation calculator.

The model is asked e.g. ``Compute x*y+z for x=37, y=84, z=-612``. Its calculator takes exactly ONE
binary operation per call and knows the task's values by name (``x``, ``y``, ``z``) plus ``ans``,
its previous result, like a pocket calculator's memory. A byte-level model of a million parameters
cannot multiply two-digit numbers in its head, so a correct answer needs two calls (``x*y`` ->
``3108``, then ``ans+z`` -> ``2496``) and a final ``<answer>ans</answer>`` (``<answer>2496</answer>``
is accepted too). Deviations from a plain calculator task, and why:

- values are referred to by name: the tiny model learns to copy digits only after far more
  supervised steps than a minutes-long CPU run affords;
- there is one operation form, with the sign carried by ``z``: a first version mixed ``x*y+z`` and
  ``x*y-z``, and after the quickstart's 150 supervised steps the model's choice of ``+`` or ``-`` in
  its second call ignored the task (measured: P(``-``) 0.45 on either kind, even with a
  demonstrator that never chose the wrong sign): the operator sits ~150 tokens back in the prompt.
  Half the tasks were then out of reach of both the warm start and a minutes-long RL run.

What is left to learn, and what RL improves, is when to stop calling the calculator.

The demonstrator (``demonstrate``) is deliberately imperfect, and its error is *systematic*: for
some inputs its most likely action is wrong, so a model cloned from it by supervised learning makes
the same mistake under greedy decoding, and only reinforcement learning (which samples the rarer right
action and is rewarded for it) can fix it. Its habit, **premature answer**: when the product is
3000 or more (about half the tasks) it usually answers the product itself, skipping the second call.
The decision depends on the calculator's last result, a few tokens back, which a tiny model can
condition on.

Every prompt and call has about the same length (two-digit factors with a four-digit product, a
three-digit ``z``). Train and held-out tasks are disjoint: a task belongs to the held-out split when
a hash of its expression says so, whatever the seed.
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

from agent_r1.envs.tool_env import ToolEnv
from agent_r1.tools import Tool, tool
from agent_r1.tools.formats import HermesFormat

__all__ = [
    "SYSTEM_PROMPT",
    "TOOL_NAME",
    "ArithmeticEnv",
    "CalculatorMemory",
    "answer_text",
    "build_task",
    "calculator",
    "demonstrate",
    "extract_answer",
    "make_dataset",
    "make_env",
    "score",
    "tool_call_text",
    "tools",
]

TOOL_NAME = "calculator"
SYSTEM_PROMPT = (
    "Use the calculator, one operation per call; it knows x, y, z and ans (its last result). "
    "End with <answer>ans</answer>."
)
HELDOUT_FRACTION = 0.2
_ANSWER_RE = re.compile(r"<answer>\s*(-?\d+|ans)\s*</answer>")
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
PREMATURE_PRODUCT = 3000  # the demonstrator's habit applies from this product on


def calculator(expression: str, names: Mapping[str, int] | None = None) -> str:
    """Evaluate ONE binary operation (``+``, ``-`` or ``*``) on integers or ``names``, e.g. ``"x*y"``.

    Anything else (two operations, unknown names, calls, floats, huge operands) raises ``ValueError``
    with a message the model can read; parsing uses ``ast``, never ``eval``.
    """
    names = names or {}
    try:
        tree = ast.parse(str(expression).strip(), mode="eval").body
    except SyntaxError as e:
        raise ValueError(f"cannot parse {expression!r}: write one operation such as x*y") from e
    if not isinstance(tree, ast.BinOp) or type(tree.op) not in _OPERATORS:
        raise ValueError(f"{expression!r} is not one operation of +, - or *, e.g. x*y")
    operands = []
    for side in (tree.left, tree.right):
        sign = 1
        if isinstance(side, ast.UnaryOp) and isinstance(side.op, ast.USub):
            side, sign = side.operand, -1
        if isinstance(side, ast.Name):
            if side.id not in names:
                known = ", ".join(sorted(names)) or "none"
                raise ValueError(f"{expression!r}: unknown name {side.id!r} (known: {known})")
            operands.append(sign * names[side.id])
            continue
        if not (isinstance(side, ast.Constant) and type(side.value) is int):
            raise ValueError(f"{expression!r}: both operands must be integers or names (one operation)")
        if abs(side.value) >= 10**12:
            raise ValueError(f"{expression!r}: operands must be below 10**12")
        operands.append(sign * side.value)
    return str(_OPERATORS[type(tree.op)](*operands))


class CalculatorMemory:
    """One episode's calculator state: the task's values (x, y, z) and ``ans``, the last result."""

    def __init__(self) -> None:
        self.names: dict[str, int] = {}

    def reset(self, task: Mapping[str, Any]) -> None:
        self.names = {"x": int(task["a"]), "y": int(task["b"]), "z": int(task["c"])}

    def evaluate(self, expression: str) -> str:
        result = calculator(expression, self.names)
        self.names["ans"] = int(result)
        return result

    def resolve(self, answer: str | None) -> str | None:
        """An extracted answer with ``ans`` replaced by the last result (None if there is none)."""
        if answer == "ans":
            return str(self.names["ans"]) if "ans" in self.names else None
        return answer


def _is_heldout(expression: str) -> bool:
    digest = hashlib.sha256(expression.encode()).digest()
    return digest[0] < 256 * HELDOUT_FRACTION


def make_dataset(n: int, *, split: str = "train", seed: int = 0) -> list[dict[str, Any]]:
    """``n`` distinct tasks of the given split (``"train"`` or ``"test"``), reproducible from ``seed``.

    Each row: ``id``, ``prompt`` (the opening chat messages: the compact system prompt and the
    question), ``expression``, ``a``, ``b``, ``c`` (the signed ``z``) and ``answer`` (the integer
    ``a*b+c``, as a string).
    """
    if split not in ("train", "test"):
        raise ValueError(f"make_dataset: split must be 'train' or 'test', got {split!r}")
    rng = random.Random(f"arithmetic-{split}-{seed}")
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    while len(rows) < n:
        a, b, c = rng.randint(10, 99), rng.randint(10, 99), rng.choice((-1, 1)) * rng.randint(100, 999)
        expression = f"{a}*{b}{c:+d}"
        if a * b < 1000 or expression in seen or _is_heldout(expression) != (split == "test"):
            continue
        seen.add(expression)
        rows.append(
            {
                "id": f"{split}-{seed}-{len(rows)}",
                "prompt": [
                    {"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": f"Compute x*y+z for x={a}, y={b}, z={c}"},
                ],
                "expression": expression,
                "a": a,
                "b": b,
                "c": c,
                "answer": str(a * b + c),
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
    """The content (an integer or ``ans``) of the last ``<answer>...</answer>`` of ``text``, or None."""
    found = _ANSWER_RE.findall(text)
    return found[-1] if found else None


def score(answer: str | None, task: Mapping[str, Any]) -> float:
    """1.0 when the (resolved) answer equals the task's answer, else 0.0."""
    if answer is None:
        return 0.0
    try:
        return float(int(answer) == int(task["answer"]))
    except (TypeError, ValueError):
        return 0.0


def demonstrate(task: Mapping[str, Any], rng: random.Random, *, error_rate: float = 0.7) -> list[str]:
    """The assistant responses of one demonstration (without the end-of-turn token).

    When the product is ``PREMATURE_PRODUCT`` or more, the demonstrator answers right after the
    first call with probability ``error_rate`` (see the module docstring), so for those inputs its
    most common action is wrong when ``error_rate > 0.5``.
    """
    first = tool_call_text("x*y")
    if int(task["a"]) * int(task["b"]) >= PREMATURE_PRODUCT and rng.random() < error_rate:
        return [first, answer_text("ans")]
    return [first, tool_call_text("ans+z"), answer_text("ans")]


class SystemPromptHermes(HermesFormat):
    """Hermes calls whose tools the task's own system prompt describes: no JSON schemas are rendered.

    ``ToolEnv`` renders the chat template's ``# Tools`` block (hundreds of characters of JSON schema)
    unless the format supplies its own system-prompt text; returning an empty text tells it to render
    neither. A byte-level model pays one token per character, so the compact ``SYSTEM_PROMPT``
    replaces the schema block.
    """

    def system_prompt(self, tool_schemas: list[dict]) -> str:
        return ""


def tools(memory: CalculatorMemory | None = None) -> list[Tool]:
    """The task's one tool, ``calculator``, over one episode's ``memory``."""
    memory = memory or CalculatorMemory()

    def calculator_tool(expression: str) -> str:
        """Evaluate one operation (+, - or *) on integers or the names x, y, z and ans.

        Args:
            expression: e.g. x*y or ans+z
        """
        return memory.evaluate(expression)

    return [tool(calculator_tool, name=TOOL_NAME, timeout=5.0)]


REQUIRED_FIELDS = ("prompt", "a", "b", "c", "answer")


class ArithmeticEnv(ToolEnv):
    """``ToolEnv`` whose calculator memory is bound to each task and whose ``ans`` answer resolves."""

    required_fields = REQUIRED_FIELDS

    def __init__(self, tokenizer, *, max_turns: int = 4, context: str = "append", **kwargs: Any) -> None:
        self.memory = CalculatorMemory()
        kwargs.setdefault("format", SystemPromptHermes())
        super().__init__(
            tokenizer,
            tools(self.memory),
            context=context,
            outcome_reward=lambda answer, task: score(self.memory.resolve(answer), task),
            extract_answer=extract_answer,
            max_turns=max_turns,
            **kwargs,
        )

    async def reset(self, task: Mapping[str, Any]):
        self.memory.reset(task)
        return await super().reset(task)

    async def step(self, action):
        result = await super().step(action)
        if result.info.get("answer") == "ans":
            # What "ans" stood for, for the report's outcome line ("gave ans = 2496, expected 2508").
            result.info["answer_value"] = self.memory.resolve("ans")
        return result


def make_env(tokenizer, *, max_turns: int = 4, context: str = "append", **kwargs: Any) -> ArithmeticEnv:
    """An ``ArithmeticEnv``: the calculator, the compact prompt, ``<answer>`` scoring.

    Usable as ``env.name: agent_r1.tasks.arithmetic:make_env`` in a training config.
    """
    return ArithmeticEnv(tokenizer, max_turns=max_turns, context=context, **kwargs)


make_env.required_fields = REQUIRED_FIELDS  # type: ignore[attr-defined]  # checked at data load


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
        make_env=make_env,
        required_fields=REQUIRED_FIELDS,
    )
