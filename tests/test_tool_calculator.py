"""The calculator evaluates arithmetic by walking the syntax tree and refuses everything else."""

from __future__ import annotations

import asyncio
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent_r1.tools import ToolCall, ToolSet
from agent_r1.tools.calculator import CalculatorError, calculator, evaluate, format_number


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("1 + 2 * 3", 7),
        ("(1 + 2) * 3", 9),
        ("7 / 2", 3.5),
        ("7 // 2", 3),
        ("-7 % 3", 2),
        ("2 ** 10", 1024),
        ("2 ^ 10", 1024),
        ("2 + 3 ^ 2", 11),
        ("2 ^ 3 ^ 2", 512),
        ("1.5 ** 2", 2.25),
        ("3 × 4 ÷ 6", 2.0),
        ("sqrt(16) + abs(-2)", 6.0),
        ("max(1, 5, 3) - min(4, 2)", 3),
        ("round(2.567, 2)", 2.57),
        ("factorial(5)", 120),
        ("gcd(12, 18)", 6),
        ("2 * pi", 2 * math.pi),
        ("1e3 + 0.5", 1000.5),
    ],
)
def test_evaluates_arithmetic(expression: str, expected: float) -> None:
    assert evaluate(expression) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("__import__('os').system('echo hi')", "unknown function"),
        ("().__class__.__bases__", "not allowed"),
        ("open('/etc/passwd')", "unknown function 'open'"),
        ("x + 1", "unknown name 'x'"),
        ("'a' * 3", "only numbers"),
        ("[1, 2]", "not allowed"),
        ("lambda: 1", "not allowed"),
        ("1 / 0", "division by zero"),
        ("2 ** 10 ** 10", "too large"),
        ("9 ^ 9 ^ 9", "too large"),
        ("10.0 ** 400", "too large"),
        ("factorial(100000)", "limited"),
        ("sqrt(-1)", "sqrt(-1)"),
        ("(-8) ** 0.5", "not a real number"),
        ("1 +", "cannot parse"),
        ("round(x=1)", "no keyword arguments"),
        ("True + 1", "only numbers"),
    ],
)
def test_refuses_with_a_clear_message(expression: str, message: str) -> None:
    with pytest.raises(CalculatorError, match=message.replace("(", r"\(").replace(")", r"\)")):
        evaluate(expression)


def test_format_number() -> None:
    assert format_number(14.0) == "14"
    assert format_number(3) == "3"
    assert format_number(0.1 + 0.2) == "0.30000000000000004"
    assert format_number(1e20) == "1e+20"
    assert format_number(float("inf")) == "inf"


@given(st.integers(-(10**6), 10**6), st.integers(-(10**6), 10**6), st.sampled_from(["+", "-", "*"]))
def test_agrees_with_python_on_integer_arithmetic(a: int, b: int, op: str) -> None:
    assert evaluate(f"{a} {op} ({b})") == {"+": a + b, "-": a - b, "*": a * b}[op]


def test_tool_results_and_errors() -> None:
    tools = ToolSet([calculator])
    calls = [
        ToolCall("calculator", {"expression": "(3 + 4) * 2"}, "call_0"),
        ToolCall("calculator", {"expression": "1/0"}, "call_1"),
        ToolCall("calculator", {"expr": "1"}, "call_2"),
    ]
    ok, div0, bad_args = asyncio.run(tools.execute(calls))
    assert (ok.content, ok.is_error) == ("14", False)
    assert (
        div0.is_error and div0.content == "Error: tool 'calculator' raised CalculatorError: division by zero"
    )
    assert bad_args.is_error and "unknown argument 'expr'" in bad_args.content
    schema = calculator.schema()["function"]
    assert schema["name"] == "calculator" and schema["parameters"]["required"] == ["expression"]
