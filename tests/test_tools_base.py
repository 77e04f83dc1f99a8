"""@tool schemas, argument validation, errors as results, timeouts, concurrency and truncation."""

import asyncio
import contextvars
import enum
import json
import re
import threading
from typing import Annotated, Literal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent_r1.tools import Tool, ToolArgumentError, ToolCall, ToolResult, ToolSet, tool, truncate_output


class Unit(enum.Enum):
    CELSIUS = "celsius"
    FAHRENHEIT = "fahrenheit"


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


def run(coro):
    return asyncio.run(coro)


def call(t: Tool, **arguments) -> ToolResult:
    return run(t(ToolCall(t.name, arguments, "call_0")))


# --------------------------------------------------------------------------------------- schemas


def test_schema_of_a_simple_function_with_google_docstring():
    @tool
    def add(a: int, b: int = 0) -> int:
        """Add two integers.

        Second paragraph, not part of the description.

        Args:
            a: The first addend,
                which may be negative.
            b (int): The second addend.

        Returns:
            The sum.
        """
        return a + b

    assert isinstance(add, Tool)
    assert add.timeout == 30.0
    assert add.schema() == {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "description": "The first addend, which may be negative."},
                    "b": {"type": "integer", "description": "The second addend.", "default": 0},
                },
                "required": ["a"],
                "additionalProperties": False,
            },
        },
    }


def test_schema_of_optional_literal_enum_list_and_async_with_rest_docstring():
    @tool(name="weather", timeout=5)
    async def get_weather(
        city: str,
        unit: Unit = Unit.CELSIUS,
        days: int | None = None,
        detail: Literal["short", "long"] = "short",
        hours: list[int] | None = None,
        level: Level = Level.LOW,
        strict: bool = False,
        scale: float = 1.5,
    ) -> str:
        """Get the weather forecast
        for a city.

        :param city: Name of the city.
        :param Unit unit: Temperature unit.
        :param days: How many days
            ahead.
        :returns: the forecast.
        """
        return city

    assert get_weather.name == "weather"
    assert get_weather.timeout == 5
    assert get_weather.description == "Get the weather forecast for a city."
    assert get_weather.parameters == {
        "type": "object",
        "properties": {
            "city": {"type": "string", "description": "Name of the city."},
            "unit": {
                "type": "string",
                "enum": ["celsius", "fahrenheit"],
                "description": "Temperature unit.",
                "default": "celsius",
            },
            "days": {"type": ["integer", "null"], "description": "How many days ahead.", "default": None},
            "detail": {"type": "string", "enum": ["short", "long"], "default": "short"},
            "hours": {"type": ["array", "null"], "items": {"type": "integer"}, "default": None},
            "level": {"type": "integer", "enum": [1, 2], "default": 1},
            "strict": {"type": "boolean", "default": False},
            "scale": {"type": "number", "default": 1.5},
        },
        "required": ["city"],
        "additionalProperties": False,
    }


def test_schema_of_nullable_without_default_annotated_and_dict():
    @tool()
    def f(
        note: Literal["a", "b"] | None,
        weights: dict[str, float],
        tags: Annotated[list[str], "labels to attach"],
        *,
        mode: Annotated[str, "ignored: the docstring wins"] = "x",
    ) -> None:
        """Do f.

        Args:
            mode: How.
        """

    assert f.parameters == {
        "type": "object",
        "properties": {
            "note": {"type": ["string", "null"], "enum": ["a", "b", None]},
            "weights": {"type": "object", "additionalProperties": {"type": "number"}},
            "tags": {"type": "array", "items": {"type": "string"}, "description": "labels to attach"},
            "mode": {"type": "string", "description": "How.", "default": "x"},
        },
        "required": ["weights", "tags"],
        "additionalProperties": False,
    }
    # a nullable parameter without a default is not required: it is passed as None
    assert f.validate({"weights": {}, "tags": []}) == {"weights": {}, "tags": [], "note": None}


def test_typing_optional_and_union_spellings_match_the_pipe_spelling():
    namespace: dict = {}
    # typing.Optional / typing.Union, as older code writes them (exec'd: the linter prefers `X | None`)
    exec(
        "from typing import Optional, Union\n"
        "def a(x: Optional[int], y: Union[str, None] = None):\n    'Doc.'\n"
        "def b(x: int | None, y: str | None = None):\n    'Doc.'\n",
        namespace,
    )
    assert tool(namespace["a"]).parameters == tool(namespace["b"]).parameters
    assert tool(namespace["b"]).parameters["properties"]["x"] == {"type": ["integer", "null"]}


def test_function_without_parameters():
    @tool
    def now() -> str:
        """The time."""
        return "noon"

    assert now.parameters == {"type": "object", "properties": {}, "additionalProperties": False}
    assert call(now) == ToolResult(ToolCall("now", {}, "call_0"), "noon")


def test_decorated_tool_keeps_the_function():
    def double(x: int) -> int:
        """Double x."""
        return 2 * x

    t = tool(double)
    assert t.fn is double
    assert json.loads(json.dumps(t.schema())) == t.schema()


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("def f(x):\n    '''Doc.'''", "@tool 'f' parameter 'x' has no type annotation"),
        (
            "def f(x: Any):\n    '''Doc.'''",
            "@tool 'f' parameter 'x' has unsupported type typing.Any: supported: str, int, float, bool,",
        ),
        ("def f(x: int | str):\n    '''Doc.'''", "unions other than `X | None` are not supported"),
        ("def f(x: list):\n    '''Doc.'''", "bare list needs a parameter, e.g. list[int]"),
        ("def f(x: dict[int, str]):\n    '''Doc.'''", "dict needs str keys and a value type"),
        ("def f(x: Literal[None, 1]):\n    '''Doc.'''", "has a value None that is not a JSON"),
        ("def f(*xs: int):\n    '''Doc.'''", "@tool 'f' parameter 'xs': *args, **kwargs"),
        ("def f(x: int, /):\n    '''Doc.'''", "positional-only"),
        ("def f(x: int):\n    pass", "@tool 'f' has no docstring"),
        ("def f(x: 'Missing'):\n    '''Doc.'''", "@tool 'f': cannot resolve its type annotations"),
    ],
)
def test_bad_signatures_fail_at_decoration_naming_function_and_parameter(source, message):
    namespace: dict = {}
    exec("from typing import Any, Literal\n" + source, namespace)
    with pytest.raises(TypeError) as info:
        tool(namespace["f"])
    assert message in str(info.value)


def test_bad_name_and_timeout_fail_at_decoration():
    def f() -> None:
        """Doc."""

    with pytest.raises(ValueError, match="tool name 'a b' is invalid"):
        tool(f, name="a b")
    with pytest.raises(ValueError, match="timeout must be positive"):
        tool(f, timeout=0)


# ------------------------------------------------------------------------------------ validation


@tool
def typed(
    n: int,
    x: float = 0.0,
    s: str = "",
    flag: bool = False,
    unit: Unit = Unit.CELSIUS,
    xs: list[int] | None = None,
    pick: Literal["a", 1] = "a",
) -> dict:
    """Echo the arguments it received, with their Python types."""
    return {
        "n": [n, type(n).__name__],
        "x": [x, type(x).__name__],
        "unit": type(unit).__name__ + "." + unit.name,
        "xs": xs,
    }


@pytest.mark.parametrize(
    ("arguments", "error"),
    [
        ({"n": "abc"}, """tool 'typed' argument 'n': expected integer, got "abc\""""),
        ({"n": True}, "tool 'typed' argument 'n': expected integer, got true"),
        ({"n": 2.5}, "tool 'typed' argument 'n': expected integer, got 2.5"),
        ({"n": None}, "tool 'typed' argument 'n': expected integer, got null"),
        ({"n": 1, "x": "1.0"}, """tool 'typed' argument 'x': expected number, got "1.0\""""),
        ({"n": 1, "x": False}, "tool 'typed' argument 'x': expected number, got false"),
        ({"n": 1, "flag": 1}, "tool 'typed' argument 'flag': expected boolean (true/false), got 1"),
        ({"n": 1, "s": 5}, "tool 'typed' argument 's': expected string, got 5"),
        (
            {"n": 1, "unit": "kelvin"},
            """tool 'typed' argument 'unit': expected one of "celsius", "fahrenheit", got "kelvin\"""",
        ),
        ({"n": 1, "pick": True}, """tool 'typed' argument 'pick': expected one of "a", 1, got true"""),
        ({"n": 1, "xs": [1, "2"]}, """tool 'typed' argument 'xs[1]': expected integer, got "2\""""),
        ({"n": 1, "xs": 3}, "tool 'typed' argument 'xs': expected array or null, got 3"),
        ({}, "tool 'typed' missing required argument 'n' (expected integer)"),
        (
            {"n": 1, "m": 2},
            "tool 'typed' got unknown argument 'm'; its arguments are: n, x, s, flag, unit, xs, pick",
        ),
    ],
)
def test_validation_errors_name_tool_and_argument(arguments, error):
    with pytest.raises(ToolArgumentError) as info:
        typed.validate(arguments)
    assert str(info.value) == error
    result = call(typed, **arguments)
    assert result.is_error
    assert result.content == f"Error: {error}"


def test_validation_normalises_numbers_and_coerces_enums():
    result = call(typed, n=3.0, x=2, unit="fahrenheit", xs=[1, 2.0], pick=1)
    assert not result.is_error, result.content
    assert json.loads(result.content) == {
        "n": [3, "int"],
        "x": [2.0, "float"],
        "unit": "Unit.FAHRENHEIT",
        "xs": [1, 2],
    }
    assert json.loads(call(typed, n=1).content)["unit"] == "Unit.CELSIUS"  # the default stays a member


def test_arguments_that_are_not_an_object():
    result = run(typed(ToolCall("typed", ["n", 1])))  # type: ignore[arg-type]
    assert result.content == """Error: tool 'typed': arguments must be a JSON object, got array ["n", 1]"""


def test_int_enum_members_are_passed_to_the_function():
    seen = []

    @tool
    def setlevel(level: Level, levels: list[Level]) -> str:
        """Set it."""
        seen.append((level, levels))
        return "ok"

    assert call(setlevel, level=2, levels=[1, 2]).content == "ok"
    assert seen == [(Level.HIGH, [Level.LOW, Level.HIGH])]
    assert type(seen[0][0]) is Level


@given(
    st.dictionaries(
        st.sampled_from(["n", "x", "s", "flag", "unit", "xs", "pick", "zz"]),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
            lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=3), c, max_size=3),
            max_leaves=8,
        ),
    )
)
def test_calling_a_tool_never_raises(arguments):
    result = call(typed, **arguments)
    assert isinstance(result, ToolResult)
    assert result.is_error == result.content.startswith("Error: ")


# -------------------------------------------------------------------------------- running tools


def test_return_values_are_rendered_as_text():
    @tool
    def give(kind: str) -> object:
        """Return something."""
        return {"none": None, "text": "plain", "dict": {"a": [1, "é"]}, "set": {1}, "enum": Unit.CELSIUS}[
            kind
        ]

    assert call(give, kind="none").content == ""
    assert call(give, kind="text").content == "plain"
    assert call(give, kind="dict").content == '{"a": [1, "é"]}'
    assert call(give, kind="set").content == "{1}"
    assert call(give, kind="enum").content == "celsius"


def test_exceptions_become_error_results():
    @tool
    def div(a: int, b: int) -> float:
        """Divide a by b."""
        return a / b

    @tool
    async def fail() -> None:
        """Fail without a message."""
        raise ValueError

    result = call(div, a=1, b=0)
    assert result == ToolResult(
        ToolCall("div", {"a": 1, "b": 0}, "call_0"),
        "Error: tool 'div' raised ZeroDivisionError: division by zero",
        is_error=True,
    )
    assert call(fail).content == "Error: tool 'fail' raised ValueError"


def test_sync_tool_past_its_timeout():
    release = threading.Event()

    @tool(timeout=0.05)
    def search(query: str) -> str:
        """Search slowly."""
        release.wait(10)
        return "late"

    try:
        result = call(search, query="q")
    finally:
        release.set()  # let the worker thread finish; threads cannot be killed
    assert result.is_error
    assert result.content == "Error: tool 'search' timed out after 0.05s"


def test_async_tool_past_its_timeout_is_cancelled():
    events = []

    @tool(timeout=0.05)
    async def search(query: str) -> str:
        """Search slowly."""
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            events.append("cancelled")
            raise
        return "late"

    assert call(search, query="q").content == "Error: tool 'search' timed out after 0.05s"
    assert events == ["cancelled"]


def test_a_timeout_error_raised_by_the_tool_is_not_its_timeout():
    @tool(timeout=None)
    async def fetch() -> str:
        """Fetch."""
        raise TimeoutError("upstream took too long")

    assert call(fetch).content == "Error: tool 'fetch' raised TimeoutError: upstream took too long"


def test_hand_written_tool_subclass():
    class Echo(Tool):
        def __init__(self) -> None:
            super().__init__(
                "echo",
                "Echo the text.",
                {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
                timeout=1.0,
            )

        async def run(self, arguments):
            return arguments["text"] * 2

    echo = Echo()
    assert call(echo, text="ab").content == "abab"
    assert call(echo, text=1).content == "Error: tool 'echo' argument 'text': expected string, got 1"
    assert call(echo, text="a", extra=1).content == "aa"  # the schema allows additional properties
    assert call(Tool("bare", "No run."), x=1).content.startswith(
        "Error: tool 'bare' raised NotImplementedError: Tool must implement `async run(self, arguments)`"
    )


# ------------------------------------------------------------------------------------------ ToolSet


@tool
def upper(text: str) -> str:
    """Upper-case the text."""
    return text.upper()


def test_toolset_lookup_and_schemas():
    tools = ToolSet([upper, typed])
    assert tools.names == ["upper", "typed"]
    assert [s["function"]["name"] for s in tools.schemas()] == ["upper", "typed"]
    assert tools["upper"] is upper
    assert "typed" in tools and "nope" not in tools
    assert len(tools) == 2 and list(tools) == [upper, typed]
    with pytest.raises(KeyError, match="unknown tool 'nope'; available tools: upper, typed"):
        tools["nope"]
    with pytest.raises(ValueError, match="duplicate tool name 'upper'"):
        ToolSet([upper, upper])
    with pytest.raises(TypeError, match="ToolSet takes Tool objects"):
        ToolSet([len])


def test_execute_keeps_call_order_and_reports_unknown_tools():
    @tool
    async def slow(text: str) -> str:
        """Answer late."""
        await asyncio.sleep(0.05)
        return text

    tools = ToolSet([upper, slow])
    calls = [
        ToolCall("slow", {"text": "first"}, "call_0"),
        ToolCall("upper", {"text": "second"}, "call_1"),
        ToolCall("python", {"code": "1"}, "call_2"),
        ToolCall("upper", {"txt": "x"}, "call_3"),
    ]
    results = run(tools.execute(calls))
    assert [r.call for r in results] == calls
    assert [(r.content, r.is_error) for r in results] == [
        ("first", False),
        ("SECOND", False),
        ("Error: unknown tool 'python'; available tools: upper, slow", True),
        ("Error: tool 'upper' got unknown argument 'txt'; its arguments are: text", True),
    ]


def test_execute_runs_async_calls_concurrently():
    events = []

    @tool
    async def wait(label: str) -> str:
        """Wait a while."""
        events.append(("start", label))
        await asyncio.sleep(0.3)
        events.append(("end", label))
        return label

    results = run(
        ToolSet([wait]).execute([ToolCall("wait", {"label": "a"}), ToolCall("wait", {"label": "b"})])
    )
    assert [r.content for r in results] == ["a", "b"]
    # both started before either ended: the calls overlapped
    assert sorted(events[:2]) == [("start", "a"), ("start", "b")]
    assert sorted(events[2:]) == [("end", "a"), ("end", "b")]


def test_execute_runs_sync_calls_concurrently_in_threads():
    barrier = threading.Barrier(2, timeout=10)

    @tool
    def meet(label: str) -> str:
        """Wait for the other call at a barrier: this only returns if both run at once."""
        barrier.wait()
        return label

    calls = [ToolCall("meet", {"label": "a"}), ToolCall("meet", {"label": "b"})]
    results = run(ToolSet([meet]).execute(calls))
    assert [(r.content, r.is_error) for r in results] == [("a", False), ("b", False)]


def test_a_sync_tool_sees_the_callers_context_variables():
    request_id = contextvars.ContextVar("request_id", default="unset")

    @tool
    def whose(name: str) -> str:
        """Say which request this call belongs to (``name``: an argument the thread bridge must not take)."""
        return f"{name}:{request_id.get()}"

    async def as_request(label: str) -> ToolResult:
        request_id.set(label)  # each task runs in its own context
        return await whose(ToolCall("whose", {"name": "n"}))

    async def two_requests() -> list[ToolResult]:
        return await asyncio.gather(as_request("r1"), as_request("r2"))

    assert [r.content for r in run(two_requests())] == ["n:r1", "n:r2"]


def test_execute_truncates_long_outputs_with_a_marker():
    @tool
    def long(n: int) -> str:
        """Return n characters."""
        return "x" * n

    tools = ToolSet([long])
    results = run(
        tools.execute(
            [ToolCall("long", {"n": 100}), ToolCall("long", {"n": 10}), ToolCall("long", {"n": "?"})], 10
        )
    )
    assert results[0].content == "x" * 10 + "\n...[truncated 90 chars]"
    assert results[1].content == "x" * 10
    assert results[2].content.startswith("Error: too") and results[2].content.endswith("chars]")
    assert results[2].is_error
    assert run(tools.execute([ToolCall("long", {"n": 100})]))[0].content == "x" * 100


def test_truncate_output():
    assert truncate_output("abcdef", 3) == "abc\n...[truncated 3 chars]"
    assert truncate_output("abc", 3) == "abc"
    assert truncate_output("abc", None) == "abc"


def test_many_sync_calls_do_not_queue_behind_a_small_thread_pool():
    # asyncio's default executor has min(32, cpus + 4) workers; 40 calls that each wait for all the
    # others would deadlock there. Each call gets a thread of its own.
    barrier = threading.Barrier(40, timeout=20)

    @tool(timeout=30)
    def meet(i: int) -> int:
        """Wait until all 40 calls are running."""
        barrier.wait()
        return i

    results = run(ToolSet([meet]).execute([ToolCall("meet", {"i": i}) for i in range(40)]))
    assert [r.content for r in results] == [str(i) for i in range(40)]


def test_sys_exit_in_a_tool_is_an_error_result():
    @tool
    def quit_now() -> None:
        """Exit."""
        raise SystemExit(3)

    assert call(quit_now).content == "Error: tool 'quit_now' raised SystemExit: 3"


def test_tools_may_raise_argument_errors_for_checks_a_schema_cannot_express():
    @tool
    def sqrt(x: float) -> float:
        """Square root."""
        if x < 0:
            raise ToolArgumentError(f"tool 'sqrt' argument 'x' must be >= 0, got {x}")
        return x**0.5

    assert call(sqrt, x=-1).content == "Error: tool 'sqrt' argument 'x' must be >= 0, got -1.0"
    assert call(sqrt, x=4).content == "2.0"


def test_a_validate_override_that_raises_becomes_an_error_result():
    class Picky(Tool):
        def validate(self, arguments):
            raise KeyError("no")

    assert call(Picky("picky", "Never happy.")).content == "Error: tool 'picky' raised KeyError: 'no'"


def test_the_example_in_docs_tools_md_produces_the_schema_shown_there():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "tools.md").read_text()
    example = re.findall(r"```python\n(.*?)```", doc, re.S)[1]
    shown = re.findall(r"```json\n(.*?)```", doc, re.S)[0]
    namespace: dict = {}
    exec(example, namespace)
    assert namespace["weather"].schema() == json.loads(shown)
    assert call(namespace["weather"], city="Paris").content == "Paris: 21 degrees celsius"
