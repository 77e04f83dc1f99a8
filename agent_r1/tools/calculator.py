"""The ``calculator`` tool: safe arithmetic on one expression, by walking its syntax tree.

The expression is parsed with ``ast.parse(mode="eval")`` and evaluated node by node; only numbers,
``+ - * / // % **`` (and ``^`` as power, as people write it), parentheses, the names in ``CONSTANTS``
and calls of the functions in ``FUNCTIONS`` are allowed. Nothing is ever passed to ``eval``, so no
attribute access, import or other code can run. Results that would be huge are refused before they
are computed (``2 ** 10 ** 10`` would otherwise take the process down).

    evaluate("(3 + 4) * 2")   -> 14
    evaluate("sqrt(2) ^ 2")   -> 2.0000000000000004
    format_number(14.0)       -> "14"
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable

from agent_r1.tools.base import tool

__all__ = ["CONSTANTS", "FUNCTIONS", "CalculatorError", "calculator", "evaluate", "format_number"]

Number = int | float

CONSTANTS: dict[str, Number] = {"pi": math.pi, "e": math.e, "tau": math.tau}
FUNCTIONS: dict[str, Callable[..., Number]] = {
    "abs": abs,
    "round": round,
    "min": min,
    "max": max,
    "sqrt": math.sqrt,
    "exp": math.exp,
    "log": math.log,
    "log10": math.log10,
    "log2": math.log2,
    "sin": math.sin,
    "cos": math.cos,
    "tan": math.tan,
    "asin": math.asin,
    "acos": math.acos,
    "atan": math.atan,
    "floor": math.floor,
    "ceil": math.ceil,
    "factorial": math.factorial,
    "gcd": math.gcd,
    "lcm": math.lcm,
}
MAX_EXPRESSION_CHARS = 1000
MAX_RESULT_BITS = 4096  # integers beyond ~1200 decimal digits are refused
MAX_FACTORIAL = 500

_BINARY: dict[type[ast.operator], Callable[[Number, Number], Number]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Number], Number]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
# "^" means power on a calculator (rewritten before parsing, so it also binds like "**").
_SYMBOLS = {"^": "**", "×": "*", "÷": "/", "−": "-"}


class CalculatorError(ValueError):
    """The expression is not allowed or cannot be computed; the message says what and where."""


def _check_size(value: Number) -> Number:
    if isinstance(value, int) and value.bit_length() > MAX_RESULT_BITS:
        raise CalculatorError(f"result too large (more than {MAX_RESULT_BITS} bits)")
    return value


def _power(base: Number, exponent: Number) -> Number:
    exact = isinstance(base, int) and isinstance(exponent, int)
    if exact and abs(base) > 1 and base.bit_length() * exponent > MAX_RESULT_BITS:
        raise CalculatorError(f"result too large: {base} ** {exponent}")
    try:
        result = operator.pow(base, exponent)
    except OverflowError as e:
        raise CalculatorError(f"result too large: {base} ** {exponent}") from e
    if isinstance(result, complex):
        raise CalculatorError(f"{base} ** {exponent} is not a real number")
    return result


def _eval(node: ast.AST) -> Number:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise CalculatorError(f"only numbers are allowed, got {node.value!r}")
        return node.value
    if isinstance(node, ast.Name):
        if node.id not in CONSTANTS:
            raise CalculatorError(f"unknown name {node.id!r}; known constants: {', '.join(CONSTANTS)}")
        return CONSTANTS[node.id]
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            return _check_size(_power(left, right))
        try:
            return _check_size(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError as e:
            raise CalculatorError("division by zero") from e
        except OverflowError as e:
            raise CalculatorError("result too large") from e
    if isinstance(node, ast.Call):
        if not isinstance(node.func, ast.Name) or node.func.id not in FUNCTIONS:
            shown = ast.unparse(node.func)
            raise CalculatorError(f"unknown function {shown!r}; known functions: {', '.join(FUNCTIONS)}")
        if node.keywords:
            raise CalculatorError(f"{node.func.id}() takes no keyword arguments")
        args = [_eval(a) for a in node.args]
        if node.func.id == "factorial" and args and isinstance(args[0], int) and args[0] > MAX_FACTORIAL:
            raise CalculatorError(f"factorial is limited to n <= {MAX_FACTORIAL}")
        try:
            return _check_size(FUNCTIONS[node.func.id](*args))
        except (TypeError, ValueError, OverflowError) as e:
            raise CalculatorError(f"{node.func.id}({', '.join(map(format_number, args))}): {e}") from e
    raise CalculatorError(f"not allowed in an arithmetic expression: {ast.unparse(node)!r}")


def evaluate(expression: str) -> Number:
    """Evaluate an arithmetic expression; raises ``CalculatorError`` naming what is wrong."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    for symbol, replacement in _SYMBOLS.items():
        expression = expression.replace(symbol, replacement)
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise CalculatorError(f"cannot parse {expression!r}: {e.msg} at column {e.offset}") from e
    return _eval(tree)


def format_number(value: Number) -> str:
    """Integers as integers; integral floats without ``.0``; other floats with full precision."""
    if isinstance(value, float):
        if math.isfinite(value) and value.is_integer() and abs(value) < 1e16:
            return str(int(value))
        return repr(value)
    return str(value)


@tool(timeout=5.0)
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return the result.

    Args:
        expression: e.g. "(3 + 4) * 2" or "sqrt(2) / 3"; supports + - * / // % ** (or ^), parentheses,
            pi, e, and the functions abs, round, min, max, sqrt, exp, log, log10, log2, sin, cos, tan,
            asin, acos, atan, floor, ceil, factorial, gcd, lcm.
    """
    return format_number(evaluate(expression))
