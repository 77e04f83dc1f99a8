"""Tools: typed Python functions the model can call, described by OpenAI-style JSON schemas.

``@tool`` turns a typed function (sync or async) with a docstring into a ``Tool``::

    @tool(timeout=5.0)
    def add(a: int, b: int = 0) -> int:
        '''Add two integers.

        Args:
            a: the first addend.
            b: the second addend.
        '''
        return a + b

A ``Tool`` validates the model's arguments against its schema, runs the function (sync functions in a
worker thread), enforces its timeout and turns *every* failure — bad arguments, an exception, a
timeout — into a ``ToolResult(is_error=True)`` whose content the model can read and act on. Calling
a tool never raises (except cancellation). ``ToolSet`` holds the tools of one environment and runs a
response's calls concurrently, results in call order.

Schema mapping (parameters become ``{"type": "object", "properties": ..., "required": ...,
"additionalProperties": false}``):

| Python annotation | JSON schema |
|---|---|
| ``str`` / ``int`` / ``float`` / ``bool`` | ``{"type": "string" / "integer" / "number" / "boolean"}`` |
| ``Literal["a", "b"]`` | ``{"type": "string", "enum": ["a", "b"]}`` |
| an ``Enum`` subclass | ``{"type": ..., "enum": [member values]}``; the value is turned back into the member |
| ``list[X]`` | ``{"type": "array", "items": <schema of X>}`` |
| ``dict[str, X]`` | ``{"type": "object", "additionalProperties": <schema of X>}`` |
| ``X | None`` / ``Optional[X]`` | schema of X with ``"null"`` added to its type; not required |
| ``Annotated[X, "text"]`` | schema of X; "text" is the description unless the docstring has one |
| a default value | not required; ``"default"`` in the schema |

Validation deviates from full JSON Schema only by being a subset: it checks types (an integer is
accepted for a number and passed on as ``float``; an integral float such as ``3.0`` is accepted for an
integer and passed on as ``int``; a bool is never an integer or number), enum membership, required
arguments and unknown argument names.
"""

from __future__ import annotations

import asyncio
import enum
import inspect
import json
import re
import types
import typing
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agent_r1.tools.threads import run_in_daemon_thread

__all__ = [
    "Tool",
    "ToolArgumentError",
    "ToolCall",
    "ToolResult",
    "ToolSet",
    "tool",
    "truncate_output",
    "validate_arguments",
]

_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass(frozen=True)
class ToolCall:
    """One call the model asked for; ``id`` ("call_0", "call_1", ...) is assigned by the parser."""

    name: str
    arguments: dict[str, Any]
    id: str = ""


@dataclass(frozen=True)
class ToolResult:
    """What one call produced: the text the model reads. Failures are results too (``is_error``)."""

    call: ToolCall
    content: str
    is_error: bool = False


class ToolArgumentError(ValueError):
    """The model's arguments do not match the tool's schema; the message names the argument."""


# ---------------------------------------------------------------------------------------------------
# Validation of arguments against the schema subset that ``@tool`` generates
# ---------------------------------------------------------------------------------------------------


def _show(value: Any, limit: int = 80) -> str:
    """A short JSON rendering of a value the model sent, for error messages."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _json_type_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, (list, tuple)):
        return "array"
    if isinstance(value, Mapping):
        return "object"
    return type(value).__name__


def _check_value(schema: Mapping[str, Any], value: Any, tool_name: str, path: str) -> Any:
    """Validate one value; return it normalised (int -> float for numbers, 3.0 -> 3 for integers).

    ``path`` names the value for messages: ``x``, ``xs[2]``, ``weights["a"]``.
    """
    where = f"tool {tool_name!r} argument {path!r}"
    allowed = schema.get("type")
    allowed_types = [allowed] if isinstance(allowed, str) else list(allowed or [])
    if "enum" in schema:
        choices = schema["enum"]
        # bool == 1 in Python: compare JSON types too, so True is not accepted for the choice 1.
        if not any(value == c and _json_type_of(value) == _json_type_of(c) for c in choices):
            raise ToolArgumentError(f"{where}: expected {_describe(schema)}, got {_show(value)}")
        return value
    if not allowed_types:
        return value
    for json_type in allowed_types:
        ok, normalised = _matches(json_type, schema, value, tool_name, path)
        if ok:
            return normalised
    raise ToolArgumentError(f"{where}: expected {_describe(schema)}, got {_show(value)}")


def _describe(schema: Mapping[str, Any]) -> str:
    """'integer', 'string or null', 'one of "a", "b"' — what a schema accepts, in words."""
    if "enum" in schema:
        return "one of " + ", ".join(_show(c) for c in schema["enum"])
    allowed = schema.get("type")
    allowed_types = [allowed] if isinstance(allowed, str) else list(allowed or [])
    return " or ".join(_TYPE_WORDS.get(t, t) for t in allowed_types) or "a value"


_TYPE_WORDS = {
    "string": "string",
    "integer": "integer",
    "number": "number",
    "boolean": "boolean (true/false)",
    "array": "array",
    "object": "object",
    "null": "null",
}


def _matches(
    json_type: str, schema: Mapping[str, Any], value: Any, tool_name: str, path: str
) -> tuple[bool, Any]:
    if json_type == "null":
        return value is None, None
    if json_type == "boolean":
        return isinstance(value, bool), value
    if json_type == "string":
        return isinstance(value, str), value
    if json_type == "integer":
        if isinstance(value, bool):
            return False, value
        if isinstance(value, int):
            return True, value
        if isinstance(value, float) and value.is_integer():
            return True, int(value)
        return False, value
    if json_type == "number":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False, value
        return True, float(value)
    if json_type == "array":
        if not isinstance(value, (list, tuple)):
            return False, value
        items = schema.get("items")
        if items is None:
            return True, list(value)
        return True, [_check_value(items, item, tool_name, f"{path}[{i}]") for i, item in enumerate(value)]
    if json_type == "object":
        if not isinstance(value, Mapping):
            return False, value
        extra = schema.get("additionalProperties")
        if not isinstance(extra, Mapping):
            return True, dict(value)
        return True, {k: _check_value(extra, v, tool_name, f"{path}[{_show(k)}]") for k, v in value.items()}
    raise ToolArgumentError(
        f"tool {tool_name!r} argument {path!r}: the schema has an unsupported type {json_type!r}"
    )


def validate_arguments(parameters: Mapping[str, Any], arguments: Any, tool_name: str) -> dict[str, Any]:
    """Check ``arguments`` against an object schema; return them normalised.

    Raises ``ToolArgumentError`` whose message names the tool and the argument, e.g.
    ``tool 'calc' argument 'x': expected integer, got "abc"``.
    """
    if not isinstance(arguments, Mapping):
        raise ToolArgumentError(
            f"tool {tool_name!r}: arguments must be a JSON object, got {_json_type_of(arguments)} "
            f"{_show(arguments)}"
        )
    properties: Mapping[str, Any] = parameters.get("properties", {})
    unknown = [key for key in arguments if key not in properties]
    if unknown and parameters.get("additionalProperties", True) is False:
        known = ", ".join(properties) or "(none)"
        raise ToolArgumentError(
            f"tool {tool_name!r} got unknown argument {unknown[0]!r}; its arguments are: {known}"
        )
    for key in parameters.get("required", []):
        if key not in arguments:
            raise ToolArgumentError(
                f"tool {tool_name!r} missing required argument {key!r} "
                f"(expected {_describe(properties.get(key, {}))})"
            )
    return {
        key: _check_value(properties[key], value, tool_name, key) if key in properties else value
        for key, value in arguments.items()
    }


def truncate_output(content: str, max_chars: int | None) -> str:
    """Keep the first ``max_chars`` characters and say how many were cut: ``...[truncated 12 chars]``."""
    if max_chars is None or len(content) <= max_chars:
        return content
    return f"{content[:max_chars]}\n...[truncated {len(content) - max_chars} chars]"


def _format_output(value: Any) -> str:
    """Render a tool's return value as the text the model reads."""
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)


# ---------------------------------------------------------------------------------------------------
# Tool
# ---------------------------------------------------------------------------------------------------


class Tool:
    """A named callable with a JSON schema. Built by ``@tool``, or subclassed for hand-written tools.

    A subclass sets ``name``, ``description``, ``parameters`` (a JSON object schema) and ``timeout``
    (seconds, or None for no limit) — via ``Tool.__init__`` or as class attributes — and implements
    ``async run(arguments) -> Any``; ``arguments`` have been validated. The return value becomes the
    result text (str as is, None as "", anything else as JSON). Raise to report a failure: the
    exception becomes an error result the model reads.
    """

    name: str
    description: str
    parameters: dict[str, Any]
    timeout: float | None = 30.0

    def __init__(
        self,
        name: str,
        description: str,
        parameters: Mapping[str, Any] | None = None,
        *,
        timeout: float | None = 30.0,
    ) -> None:
        if not _NAME_RE.match(name):
            raise ValueError(
                f"tool name {name!r} is invalid: use 1-64 letters, digits, '_' or '-' (OpenAI's rule)"
            )
        if timeout is not None and not timeout > 0:
            raise ValueError(f"tool {name!r}: timeout must be positive seconds or None, got {timeout!r}")
        self.name = name
        self.description = description
        self.parameters = dict(parameters or {"type": "object", "properties": {}})
        self.timeout = timeout

    def schema(self) -> dict[str, Any]:
        """OpenAI function-tool form, as chat templates expect in ``apply_chat_template(tools=...)``."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    def validate(self, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """Check and normalise arguments; raises ``ToolArgumentError`` naming the argument."""
        return validate_arguments(self.parameters, arguments, self.name)

    async def run(self, arguments: dict[str, Any]) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must implement `async run(self, arguments)`")

    async def __call__(self, call: ToolCall) -> ToolResult:
        """Validate, run under the timeout, and report any failure as an error result.

        A ``ToolArgumentError`` raised by ``validate`` or by ``run`` (a tool may raise it for checks
        a schema cannot express, e.g. "x must be positive") reads ``Error: <message>``; any other
        exception reads ``Error: tool 'name' raised Type: message``.
        """

        async def guarded() -> ToolResult:
            # Exceptions raised by the tool are caught here, inside wait_for, so that a TimeoutError
            # raised by the tool itself is not mistaken for this tool's timeout.
            try:
                return ToolResult(call, _format_output(await self.run(self.validate(call.arguments))))
            except ToolArgumentError as e:
                return ToolResult(call, f"Error: {e}", is_error=True)
            except (Exception, SystemExit) as e:
                detail = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
                return ToolResult(call, f"Error: tool {self.name!r} raised {detail}", is_error=True)

        try:
            return await asyncio.wait_for(guarded(), timeout=self.timeout)
        except asyncio.TimeoutError:
            return ToolResult(
                call, f"Error: tool {self.name!r} timed out after {self.timeout}s", is_error=True
            )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, timeout={self.timeout!r})"


class FunctionTool(Tool):
    """A Tool that wraps a Python function; built by ``@tool``. ``fn`` is the original function."""

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        name: str,
        description: str,
        parameters: dict[str, Any],
        converters: dict[str, Callable[[Any], Any]],
        fill_none: tuple[str, ...],
        timeout: float | None,
    ) -> None:
        super().__init__(name, description, parameters, timeout=timeout)
        self.fn = fn
        self._converters = converters
        self._fill_none = fill_none
        self._is_async = inspect.iscoroutinefunction(fn)

    def validate(self, arguments: Mapping[str, Any]) -> dict[str, Any]:
        checked = super().validate(arguments)
        for key, convert in self._converters.items():
            if checked.get(key) is not None:
                checked[key] = convert(checked[key])
        for key in self._fill_none:
            checked.setdefault(key, None)
        return checked

    async def run(self, arguments: dict[str, Any]) -> Any:
        if self._is_async:
            return await self.fn(**arguments)
        return await run_in_daemon_thread(f"tool-{self.name}", self.fn, **arguments)


# ---------------------------------------------------------------------------------------------------
# Building a schema from a signature and docstring
# ---------------------------------------------------------------------------------------------------

_PRIMITIVES: dict[type, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}
_SECTION_RE = re.compile(
    r"^(Args|Arguments|Parameters|Params|Returns?|Yields?|Raises|Examples?|Notes?|Attributes|"
    r"Keyword Args|Keyword Arguments|See Also|Warnings?|Todo)\s*:\s*$"
)
_GOOGLE_ARG_RE = re.compile(r"^(\*{0,2}\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")
_REST_PARAM_RE = re.compile(r"^:param\s+(?:[^:]*\s)?(\w+)\s*:\s*(.*)$")


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """Return (first paragraph, {argument: description}) from a Google- or reST-style docstring."""
    lines = doc.splitlines()
    summary: list[str] = []
    for line in lines:
        stripped = line.strip()
        if not stripped or _SECTION_RE.match(stripped) or stripped.startswith(":"):
            break
        summary.append(stripped)
    descriptions: dict[str, str] = {}

    # Google style: an "Args:" header, entries indented under it, continuation lines indented more.
    in_args = False
    header_indent = entry_indent = 0
    current: str | None = None
    for line in lines:
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        if _SECTION_RE.match(stripped):
            in_args = stripped.split(":")[0] in ("Args", "Arguments", "Parameters", "Params")
            header_indent, entry_indent, current = indent, -1, None
            continue
        if not in_args or not stripped:
            continue
        if indent <= header_indent:
            in_args, current = False, None
            continue
        if entry_indent < 0:
            entry_indent = indent
        match = _GOOGLE_ARG_RE.match(stripped)
        if indent == entry_indent and match:
            current = match.group(1).lstrip("*")
            descriptions[current] = match.group(2).strip()
        elif current is not None and indent > entry_indent:
            descriptions[current] = f"{descriptions[current]} {stripped}".strip()

    # reST style: ":param x: text" (or ":param int x: text"), continuation lines indented.
    current = None
    for line in lines:
        stripped = line.strip()
        match = _REST_PARAM_RE.match(stripped)
        if match:
            current = match.group(1)
            descriptions[current] = match.group(2).strip()
        elif stripped.startswith(":") or not stripped:
            current = None
        elif current is not None and line[:1].isspace():
            descriptions[current] = f"{descriptions[current]} {stripped}".strip()
    return " ".join(summary), descriptions


class _UnsupportedType(TypeError):
    pass


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) is typing.Union or isinstance(tp, types.UnionType)


def _type_schema(tp: Any) -> tuple[dict[str, Any], Callable[[Any], Any] | None]:
    """(JSON schema, converter from the validated JSON value to the Python value, or None)."""
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        return _type_schema(typing.get_args(tp)[0])
    if tp in _PRIMITIVES:
        return {"type": _PRIMITIVES[tp]}, None
    if origin is typing.Literal:
        values = list(typing.get_args(tp))
        return {"type": _enum_json_type(values, repr(tp)), "enum": values}, None
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        values = [member.value for member in tp]
        return {"type": _enum_json_type(values, tp.__name__), "enum": values}, tp
    if origin in (list, Sequence):
        (item_tp,) = typing.get_args(tp) or (None,)
        if item_tp is None:
            raise _UnsupportedType("list needs an item type, e.g. list[int]")
        items, convert_item = _type_schema(item_tp)
        convert = None if convert_item is None else (lambda v: [convert_item(x) for x in v])
        return {"type": "array", "items": items}, convert
    if origin in (dict, Mapping):
        args = typing.get_args(tp)
        if len(args) != 2 or args[0] is not str:
            raise _UnsupportedType("dict needs str keys and a value type, e.g. dict[str, int]")
        values, convert_value = _type_schema(args[1])
        convert = None if convert_value is None else (lambda v: {k: convert_value(x) for k, x in v.items()})
        return {"type": "object", "additionalProperties": values}, convert
    if _is_union(tp):
        members = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(members) == 1 and len(typing.get_args(tp)) == 2:
            schema, convert = _type_schema(members[0])
            return _nullable(schema), convert
        raise _UnsupportedType("unions other than `X | None` are not supported")
    if tp in (list, dict):
        raise _UnsupportedType(f"bare {tp.__name__} needs a parameter, e.g. list[int] or dict[str, int]")
    raise _UnsupportedType("supported: str, int, float, bool, Literal, Enum, list[X], dict[str, X], X | None")


def _enum_json_type(values: list[Any], what: str) -> str | list[str]:
    kinds: list[str] = []
    for v in values:
        kind = _json_type_of(v)
        if kind not in ("string", "integer", "number", "boolean"):
            raise _UnsupportedType(f"{what} has a value {v!r} that is not a JSON string/number/bool")
        if kind not in kinds:
            kinds.append(kind)
    return kinds[0] if len(kinds) == 1 else kinds


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    schema = dict(schema)
    kinds = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    schema["type"] = [*kinds, "null"]
    if "enum" in schema:
        schema["enum"] = [*schema["enum"], None]
    return schema


def _annotated_description(tp: Any) -> str | None:
    if typing.get_origin(tp) is typing.Annotated:
        texts = [m for m in typing.get_args(tp)[1:] if isinstance(m, str)]
        return " ".join(texts) or None
    return None


def _build_tool(fn: Callable[..., Any], name: str | None, timeout: float | None) -> FunctionTool:
    where = f"@tool {getattr(fn, '__qualname__', fn)!r}"
    if not callable(fn):
        raise TypeError(f"{where}: expected a function, got {type(fn).__name__}")
    doc = inspect.getdoc(fn)
    if not doc:
        raise TypeError(f"{where} has no docstring: the model reads the tool's description from it")
    description, arg_docs = _parse_docstring(doc)
    try:
        hints = typing.get_type_hints(fn, include_extras=True)
    except Exception as e:
        raise TypeError(f"{where}: cannot resolve its type annotations ({type(e).__name__}: {e})") from e

    properties: dict[str, Any] = {}
    required: list[str] = []
    converters: dict[str, Callable[[Any], Any]] = {}
    fill_none: list[str] = []
    for param in inspect.signature(fn).parameters.values():
        if param.kind not in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
            raise TypeError(
                f"{where} parameter {param.name!r}: *args, **kwargs and positional-only parameters "
                "cannot be tool arguments"
            )
        if param.name not in hints:
            raise TypeError(f"{where} parameter {param.name!r} has no type annotation")
        annotation = hints[param.name]
        try:
            schema, convert = _type_schema(annotation)
        except _UnsupportedType as e:
            raise TypeError(
                f"{where} parameter {param.name!r} has unsupported type {annotation!r}: {e}"
            ) from e
        text = arg_docs.get(param.name) or _annotated_description(annotation)
        if text:
            schema = {**schema, "description": text}
        nullable = isinstance(schema["type"], list) and "null" in schema["type"]
        if param.default is not param.empty:
            default = param.default.value if isinstance(param.default, enum.Enum) else param.default
            if default is not None or nullable:
                schema = {**schema, "default": default}
        elif nullable:
            fill_none.append(param.name)
        else:
            required.append(param.name)
        properties[param.name] = schema
        if convert is not None:
            converters[param.name] = convert

    parameters: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        parameters["required"] = required
    parameters["additionalProperties"] = False
    return FunctionTool(
        fn,
        name=name or fn.__name__,
        description=description,
        parameters=parameters,
        converters=converters,
        fill_none=tuple(fill_none),
        timeout=timeout,
    )


@typing.overload
def tool(fn: Callable[..., Any], *, name: str | None = None, timeout: float | None = 30.0) -> Tool: ...


@typing.overload
def tool(
    fn: None = None, *, name: str | None = None, timeout: float | None = 30.0
) -> Callable[[Callable[..., Any]], Tool]: ...


def tool(
    fn: Callable[..., Any] | None = None, *, name: str | None = None, timeout: float | None = 30.0
) -> Tool | Callable[[Callable[..., Any]], Tool]:
    """Turn a typed function (sync or async) with a docstring into a ``Tool``.

    Use as ``@tool`` or ``@tool(name=..., timeout=...)``. The tool's description is the docstring's
    first paragraph; argument descriptions come from its ``Args:`` section (Google style) or
    ``:param x:`` lines (reST). A parameter without a type annotation, or with a type outside the
    supported set, is a ``TypeError`` here, naming the function and the parameter.
    ``timeout`` is in seconds (None: no limit).
    """
    if fn is None:
        return lambda f: _build_tool(f, name, timeout)
    return _build_tool(fn, name, timeout)


# ---------------------------------------------------------------------------------------------------
# ToolSet
# ---------------------------------------------------------------------------------------------------


class ToolSet:
    """The tools of one environment, by name. Runs a response's calls concurrently."""

    def __init__(self, tools: Iterable[Tool]) -> None:
        self._tools: dict[str, Tool] = {}
        for t in tools:
            if not isinstance(t, Tool):
                raise TypeError(f"ToolSet takes Tool objects (use @tool), got {type(t).__name__}: {t!r}")
            if t.name in self._tools:
                raise ValueError(f"duplicate tool name {t.name!r} in ToolSet")
            self._tools[t.name] = t

    @property
    def names(self) -> list[str]:
        return list(self._tools)

    def schemas(self) -> list[dict[str, Any]]:
        """OpenAI function schemas of all tools, in insertion order (for ``apply_chat_template(tools=...)``)."""
        return [t.schema() for t in self._tools.values()]

    def __getitem__(self, name: str) -> Tool:
        try:
            return self._tools[name]
        except KeyError:
            raise KeyError(f"unknown tool {name!r}; available tools: {self._available()}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __iter__(self) -> Iterator[Tool]:
        return iter(self._tools.values())

    def __len__(self) -> int:
        return len(self._tools)

    def _available(self) -> str:
        return ", ".join(self._tools) or "(none)"

    async def execute(
        self, calls: Sequence[ToolCall], max_output_chars: int | None = None
    ) -> list[ToolResult]:
        """Run all calls concurrently; results in call order, each content cut to ``max_output_chars``."""

        async def one(call: ToolCall) -> ToolResult:
            t = self._tools.get(call.name)
            if t is None:
                result = ToolResult(
                    call, f"Error: unknown tool {call.name!r}; available tools: {self._available()}", True
                )
            else:
                result = await t(call)
            return ToolResult(result.call, truncate_output(result.content, max_output_chars), result.is_error)

        awaitables: list[Awaitable[ToolResult]] = [one(c) for c in calls]
        return list(await asyncio.gather(*awaitables))
