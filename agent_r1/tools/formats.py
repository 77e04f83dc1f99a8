"""Tool-call formats: how a model writes tool calls in its response, and how results go back to it.

A ``ToolCallFormat`` parses one response into the text outside the call markup, the well-formed calls
and one readable error per malformed call. A malformed call is never silently "no tool call" (which
an environment would take for the final answer): the error goes back to the model as an observation
so it can fix the call. ``parse`` never raises, on any string. ``near_miss`` recognises, in a response
that ``parse`` reads as final, a call the model plainly meant but misspelt (``<TOOL_CALL>``, the call
JSON in a code fence, ``action:`` in lower case), and returns a message that shows the correct form.

Registered formats (select by name with ``get_format``):

- ``hermes`` — Hermes / Qwen2.5 / Qwen3: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  results as role "tool" messages, which these chat templates render inside
  ``<tool_response>...</tool_response>``. The chat template renders the tool list itself.
- ``react`` — ReAct (Yao et al. 2022, arXiv 2210.03629) with JSON inputs, as popularised by LangChain:
  ``Action: <name>`` then ``Action Input: {json}``; results as a user message ``Observation: ...``.
  Works with any chat model: ``system_prompt`` describes the tools and the format.
- ``llama3_json`` — Llama 3.1 / 3.2 JSON tool calls: the response is ``{"name": ..., "parameters":
  {...}}`` (optionally after ``<|python_tag|>``; several calls separated by ``;``); results as role
  "tool" messages, which the Llama 3.1+ chat templates render under the ipython header. The chat
  template renders the tool list itself.

Unknown tool names and argument type errors are not the format's business: ``ToolSet.execute`` turns
them into error results whose content starts with ``Error:``.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from agent_r1.tools.base import ToolCall, ToolResult

__all__ = [
    "FORMATS",
    "HermesFormat",
    "Llama3JsonFormat",
    "ParsedResponse",
    "ReActFormat",
    "TOOL_PROMPTS",
    "ToolCallFormat",
    "compact_tools_text",
    "get_format",
    "with_tool_prompt",
    "register_format",
]


@dataclass(frozen=True)
class ParsedResponse:
    """One response, parsed: the text outside call markup, the calls, and one error per bad call."""

    content: str
    calls: tuple[ToolCall, ...] = ()
    errors: tuple[str, ...] = ()

    @property
    def is_final(self) -> bool:
        """True when the response holds neither a call nor a malformed attempt at one."""
        return not self.calls and not self.errors


class ToolCallFormat(ABC):
    """Parses tool calls out of a response and renders results as chat messages."""

    name: ClassVar[str]

    @abstractmethod
    def parse(self, text: str) -> ParsedResponse:
        """Split a response into content, calls and errors. Never raises."""

    @abstractmethod
    def observation_messages(self, results: Sequence[ToolResult], errors: Sequence[str]) -> list[dict]:
        """Chat messages carrying results (in call order), then parse errors, back to the model."""

    def system_prompt(self, tool_schemas: list[dict]) -> str | None:
        """Text for the system message when the chat template does not render tools; else None."""
        return None

    def near_miss(self, text: str) -> str | None:
        """For a response that ``parse`` reads as final: an error message when it holds what is plainly
        a tool call in a spelling this format does not accept (ending with the correct form), else None.
        Never raises. The default recognises nothing."""
        return None


FORMATS: dict[str, type[ToolCallFormat]] = {}

F = TypeVar("F", bound=type[ToolCallFormat])


def register_format(cls: F) -> F:
    """Class decorator: make a format available to ``get_format(cls.name)``."""
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"{cls.__name__} needs a class attribute `name` (a non-empty string)")
    if name in FORMATS and FORMATS[name] is not cls:
        raise ValueError(f"tool-call format {name!r} is already registered by {FORMATS[name].__name__}")
    FORMATS[name] = cls
    return cls


def get_format(name: str) -> ToolCallFormat:
    """A new instance of the named format; ValueError naming the available ones."""
    try:
        return FORMATS[name]()
    except KeyError:
        raise ValueError(
            f"unknown tool-call format {name!r}; available formats: {', '.join(sorted(FORMATS))}"
        ) from None


# ---------------------------------------------------------------------------------------------------
# Shared JSON handling
# ---------------------------------------------------------------------------------------------------


def _show(value: Any, limit: int = 60) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def _json_error(e: Exception, source: str) -> str:
    """Say what is wrong with some JSON and where, with the text around the spot."""
    if isinstance(e, json.JSONDecodeError):
        near = source[max(0, e.pos - 20) : e.pos + 20]
        return f"{e.msg} (line {e.lineno} column {e.colno}, near {near!r})"
    if isinstance(e, RecursionError):
        return "nested too deeply"
    return str(e)


def _loads(source: str) -> tuple[Any, str | None]:
    """(value, None) or (None, readable error). Catches what ``json.loads`` raises on any string."""
    try:
        return json.loads(source), None
    except (ValueError, RecursionError) as e:
        return None, _json_error(e, source)


def _as_arguments(value: Any, where: str, label: str) -> dict[str, Any] | str:
    """The arguments as a dict, or an error message. A JSON-encoded string holding an object is
    decoded (some models emit arguments so)."""
    if isinstance(value, str):
        decoded, error = _loads(value)
        if error is not None:
            return f"{where}: {label} is a string that is not valid JSON: {error}"
        if not isinstance(decoded, dict):
            return f"{where}: {label} must be a JSON object, got a string holding {_json_kind(decoded)} {_show(decoded)}"
        return decoded
    if not isinstance(value, dict):
        return f"{where}: {label} must be a JSON object, got {_json_kind(value)} {_show(value)}"
    return value


def _call_from_object(obj: Any, where: str, call_id: str) -> ToolCall | str:
    """Turn ``{"name": ..., "arguments": {...}}`` into a ToolCall, or return an error message.

    "parameters" is accepted for "arguments" (Llama's spelling); missing arguments mean ``{}``.
    """
    if not isinstance(obj, dict):
        return f'{where}: expected a JSON object {{"name": ..., "arguments": {{...}}}}, got {_json_kind(obj)} {_show(obj)}'
    if "name" not in obj:
        keys = ", ".join(json.dumps(k) for k in obj) or "none"
        return f'{where}: missing "name" (the object has keys: {keys})'
    name = obj["name"]
    if not isinstance(name, str) or not name.strip():
        return f'{where}: "name" must be a non-empty string, got {_show(name)}'
    key = "parameters" if "parameters" in obj and "arguments" not in obj else "arguments"
    arguments = _as_arguments(obj.get(key, {}), where, f'"{key}"')
    if isinstance(arguments, str):
        return arguments
    return ToolCall(name=name.strip(), arguments=arguments, id=call_id)


def _error_content(message: str) -> str:
    return message if message.startswith("Error:") else f"Error: {message}"


# ---------------------------------------------------------------------------------------------------
# Near misses: a call the model plainly meant, in a spelling the format does not accept
# ---------------------------------------------------------------------------------------------------

# Every call spelling holds a "name" or an "action" key; text without one is skipped at regex cost.
_CALL_KEY_RE = re.compile(r'"(?:name|action)"\s*:')
_JSON_OPEN_RE = re.compile(r"[\[{]")
_FENCE_LINE_RE = re.compile(r"^[ \t]*```", re.MULTILINE)
# Each "{" or "[" outside the values already decoded is decoded from there; on adversarial text
# (thousands of unclosed brackets) that is quadratic, so only the first ones are tried: a model's
# calls are among them.
_MAX_JSON_CANDIDATES = 64
_SHOWN_CALL_CHARS = 300


@dataclass(frozen=True)
class _JsonCalls:
    """Tool calls found written as plain JSON: ``(name, arguments)`` each, and where they were."""

    calls: tuple[tuple[str, Any], ...]
    in_fence: bool  # inside a ``` code fence
    at_start: bool  # the JSON opens the response (nothing but whitespace before it)


def _as_call(value: Any) -> tuple[str, Any] | None:
    """``(name, arguments)`` when ``value`` has exactly the keys of a call in a common spelling:
    ``{"name", "arguments" | "parameters"}``, OpenAI's ``{"type": "function", "function": {...}}`` or
    LangChain's ``{"action", "action_input"}`` (but not its "Final Answer" action), each optionally
    with an "id". JSON with any other key (a record, a schema) is not a call."""
    if not isinstance(value, dict):
        return None
    keys = set(value) - {"id"}
    if keys == {"type", "function"} and value["type"] == "function":
        return _as_call(value["function"])
    if keys == {"action", "action_input"}:
        name, arguments = value["action"], value["action_input"]
        if isinstance(name, str) and name.strip().lower() == "final answer":
            return None
    elif keys == {"name", "arguments"} or keys == {"name", "parameters"}:
        name, arguments = value["name"], value.get("arguments", value.get("parameters"))
    else:
        return None
    if not isinstance(name, str) or not name.strip() or not isinstance(arguments, dict | str):
        return None
    if isinstance(arguments, str):
        decoded, error = _loads(arguments)
        if error is None and isinstance(decoded, dict):
            arguments = decoded
    return name.strip(), arguments


def _find_json_calls(text: str) -> _JsonCalls | None:
    """The calls in ``text`` written as JSON values that are a call or a non-empty list of calls (see
    ``_as_call``), and where the first one was. Values are decoded from the left, so a call-shaped
    object inside other JSON is data, not a call."""
    if not _CALL_KEY_RE.search(text):
        return None
    decoder = json.JSONDecoder()
    skip_to = 0  # the end of the last JSON value decoded: what is inside it is part of that value
    tried = 0
    found: list[tuple[str, Any]] = []
    first = 0
    for match in _JSON_OPEN_RE.finditer(text):
        start = match.start()
        if start < skip_to:
            continue
        if tried == _MAX_JSON_CANDIDATES:
            break
        tried += 1
        try:
            value, skip_to = decoder.raw_decode(text, start)
        except (ValueError, RecursionError):
            continue
        items = value if isinstance(value, list) else [value]
        calls = tuple(call for call in map(_as_call, items) if call is not None)
        if calls and len(calls) == len(items):
            if not found:
                first = start
            found += calls
    if not found:
        return None
    return _JsonCalls(
        calls=tuple(found),
        in_fence=len(_FENCE_LINE_RE.findall(text, 0, first)) % 2 == 1,
        at_start=not text[:first].strip(),
    )


def _type_text(schema: Any) -> str:
    if not isinstance(schema, dict):
        return "any"
    if "enum" in schema:
        return "|".join(json.dumps(v, ensure_ascii=False) for v in schema["enum"])
    kind = schema.get("type")
    if isinstance(kind, list):
        return "|".join(str(k) for k in kind)
    if kind == "array":
        return f"{_type_text(schema.get('items'))}[]"
    return str(kind) if kind else "any"


def compact_tools_text(tool_schemas: Sequence[dict], fmt: ToolCallFormat) -> str:
    """The tools in one line each, for a system prompt in place of the chat template's JSON schema block:
    ``name(arg: type, optional?: type) - the first line of its description``, then how ``fmt`` writes a
    call (its ``HINT``). Kept: names, types, enums, which arguments are required; dropped: parameter
    descriptions, defaults, nested object schemas (shown as ``object``)."""
    hint = getattr(fmt, "HINT", None)
    if not hint:
        raise ValueError(f"tool-call format {fmt.name!r} has no HINT saying how a call is written")
    lines = ["# Tools"]
    for schema in tool_schemas:
        fn = schema.get("function", schema)
        parameters = fn.get("parameters") or {}
        required = set(parameters.get("required") or ())
        arguments = ", ".join(
            f"{name}{'' if name in required else '?'}: {_type_text(spec)}"
            for name, spec in (parameters.get("properties") or {}).items()
        )
        description = (fn.get("description") or "").strip().split("\n")[0].strip()
        lines.append(f"{fn['name']}({arguments})" + (f" - {description}" if description else ""))
    lines.append(hint)
    return "\n".join(lines)


TOOL_PROMPTS = ("template", "compact", "none")
"""How a request's ``tools`` reach the prompt (``with_tool_prompt``): the chat template's own block,
one line per tool in the system message, or nothing."""


def with_tool_prompt(
    messages: Sequence[dict], tools: Sequence[dict] | None, tool_prompt: str, fmt: ToolCallFormat
) -> tuple[tuple[dict, ...], tuple[dict, ...] | None]:
    """The messages and tools to render under ``tool_prompt``: ``"template"`` leaves both as they are
    (the chat template writes its block of JSON schemas), ``"none"`` drops the tools (the caller's own
    prompt describes them), ``"compact"`` appends ``compact_tools_text`` to the first system message
    (a new one when there is none) and drops the tools. The same for every call of a conversation,
    so a prompt that extends the previous one still does. Shared by the agent gateway and
    ``agent-r1 serve``."""
    if tool_prompt not in TOOL_PROMPTS:
        raise ValueError(f"tool_prompt must be one of {TOOL_PROMPTS}, got {tool_prompt!r}")
    messages = tuple(messages)
    if tools is None or tool_prompt == "template":
        return messages, None if tools is None else tuple(tools)
    if tool_prompt == "none":
        return messages, None
    text = compact_tools_text(tools, fmt)
    if messages and messages[0].get("role") == "system":
        content = messages[0].get("content")
        if isinstance(content, list):  # content parts (the OpenAI API allows them)
            content = [*content, {"type": "text", "text": f"\n\n{text}"}]
        else:
            content = f"{content or ''}\n\n{text}"
        return ({**messages[0], "content": content}, *messages[1:]), None
    return ({"role": "system", "content": text}, *messages), None


def _shorten(text: str) -> str:
    return text if len(text) <= _SHOWN_CALL_CHARS else text[: _SHOWN_CALL_CHARS - 3] + "..."


# ---------------------------------------------------------------------------------------------------
# Hermes / Qwen
# ---------------------------------------------------------------------------------------------------

_HERMES_TAG_RE = re.compile(r"</?tool_call>")
# What a model writes when it means <tool_call>: other case, spaces, a dash, no separator, a plural.
_HERMES_TAG_VARIANT_RE = re.compile(r"<\s*/?\s*tool[ \t_-]?calls?\s*>", re.IGNORECASE)


@register_format
class HermesFormat(ToolCallFormat):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call, results in
    role "tool" messages (Hermes 2 Pro function calling; Qwen2.5 and Qwen3 chat templates)."""

    name = "hermes"
    HINT = 'Write each call as <tool_call>{"name": "<tool name>", "arguments": {<arguments>}}</tool_call>.'

    def parse(self, text: str) -> ParsedResponse:
        content: list[str] = []
        calls: list[ToolCall] = []
        errors: list[str] = []
        open_at: int | None = None  # end of the currently open <tool_call> tag
        block = 0  # 1-based number of the <tool_call> block, for messages
        cursor = 0  # start of text not yet assigned to content or a block

        def close_block(body: str) -> None:
            where = f"<tool_call> #{block}"
            if not body.strip():
                errors.append(f"{where} is empty. {self.HINT}")
                return
            obj, error = _loads(body)
            if error is not None:
                errors.append(f"{where}: invalid JSON: {error}. {self.HINT}")
                return
            call = _call_from_object(obj, where, f"call_{len(calls)}")
            if isinstance(call, str):
                errors.append(f"{call}. {self.HINT}")
            else:
                calls.append(call)

        for tag in _HERMES_TAG_RE.finditer(text):
            if tag.group() == "<tool_call>":
                if open_at is not None:
                    errors.append(
                        f"<tool_call> #{block} is not closed: another <tool_call> starts before "
                        f"its </tool_call>. {self.HINT}"
                    )
                else:
                    content.append(text[cursor : tag.start()])
                block += 1
                open_at = cursor = tag.end()
            elif open_at is None:
                content.append(text[cursor : tag.start()])
                errors.append(
                    f"stray </tool_call> at character {tag.start()} without an opening <tool_call>. {self.HINT}"
                )
                cursor = tag.end()
            else:
                close_block(text[open_at : tag.start()])
                open_at = None
                cursor = tag.end()
        if open_at is not None:
            errors.append(
                f"<tool_call> #{block} is not closed: the response ends before </tool_call>. {self.HINT}"
            )
        else:
            content.append(text[cursor:])
        return ParsedResponse("".join(content).strip(), tuple(calls), tuple(errors))

    def near_miss(self, text: str) -> str | None:
        """A ``<tool_call>`` tag in another case or spacing (``<TOOL_CALL>``, ``<tool-call>``,
        ``<tool_call >``, ...), or a call written as JSON without the tags (bare or in a code fence)."""
        tag = next(
            (
                t
                for t in _HERMES_TAG_VARIANT_RE.finditer(text)
                if t.group() not in ("<tool_call>", "</tool_call>")
            ),
            None,
        )
        found = _find_json_calls(text)
        if tag is not None:
            message = (
                f"{tag.group()} at character {tag.start()} is not a tool-call tag: the tags are exactly "
                "<tool_call> and </tool_call>."
            )
        elif found is not None:
            where = " in a ``` code fence" if found.in_fence else ""
            message = f"a tool call written as JSON{where} without <tool_call> tags is not a call."
        else:
            return None
        if found is not None:
            correct = "".join(
                f"<tool_call>{json.dumps({'name': n, 'arguments': a}, ensure_ascii=False)}</tool_call>"
                for n, a in found.calls
            )
            message += f" Correctly written: {_shorten(correct)}"
        return f"{message} {self.HINT}"

    def observation_messages(self, results: Sequence[ToolResult], errors: Sequence[str]) -> list[dict]:
        messages: list[dict] = [
            {"role": "tool", "name": r.call.name, "tool_call_id": r.call.id, "content": r.content}
            for r in results
        ]
        messages += [{"role": "tool", "content": _error_content(e)} for e in errors]
        return messages


# ---------------------------------------------------------------------------------------------------
# ReAct
# ---------------------------------------------------------------------------------------------------

_REACT_LINE_RE = re.compile(r"^[ \t]*(Action Input|Action|Observation)[ \t]*:[ \t]*(.*)$", re.MULTILINE)
# An "Action:" / "Action Input:" line as models misspell it: any case, "_" or "-" in "Action Input",
# markdown decoration (a bullet, a heading, **bold**, `code`).
_REACT_VARIANT_RE = re.compile(
    r"^[ \t]*(?:[-*>#]+[ \t]+)?[*_`]*(?P<keyword>action(?:[ \t_-]*input)?)[*_`]*[ \t]*:[*_`]*[ \t]*(?P<rest>.*)$",
    re.IGNORECASE | re.MULTILINE,
)
_DECORATION = " \t*_`"
_NAME_DECORATION = " \t*`"  # "_" is a name character ("get_", "_private"), not decoration there


@register_format
class ReActFormat(ToolCallFormat):
    """ReAct with JSON action inputs (Yao et al. 2022; LangChain's "structured chat" spelling)::

        Thought: I need the population first.
        Action: search
        Action Input: {"query": "population of Paris"}

    Several Action / Action Input pairs in one response are several calls. Generation should stop at
    "Observation:" (put it in the stop strings): a line starting with "Observation:" is the model
    imagining a tool's answer, so parsing ends there and the rest is dropped. Results come back as one
    user message of ``Observation: ...`` blocks; the answer is written after ``Final Answer:``.
    """

    name = "react"
    HINT = 'Write each call as two lines: "Action: <tool name>" then "Action Input: {<JSON arguments>}".'

    def parse(self, text: str) -> ParsedResponse:
        calls: list[ToolCall] = []
        errors: list[str] = []
        content: list[str] = []
        cursor = 0
        pending: tuple[str, int] | None = None  # (tool name, number) of an Action awaiting its input
        action = 0
        decoder = json.JSONDecoder()

        def missing_input(name: str, number: int) -> str:
            return f'Action #{number} ({name!r}) has no "Action Input:" line after it. {self.HINT}'

        for line in _REACT_LINE_RE.finditer(text):
            if line.start() < cursor:
                continue  # inside an Action Input JSON that spanned several lines
            keyword, rest = line.group(1), line.group(2).strip()
            if keyword == "Observation":
                if action == 0:
                    continue  # no call made yet: ordinary text
                content.append(text[cursor : line.start()])
                cursor = len(text)
                break
            content.append(text[cursor : line.start()])
            cursor = line.end()
            if keyword == "Action":
                if pending is not None:
                    errors.append(missing_input(*pending))
                action += 1
                if not rest:
                    errors.append(f"Action #{action} names no tool. {self.HINT}")
                    pending = None
                else:
                    pending = (rest, action)
                continue
            if pending is None:
                errors.append(
                    f'"Action Input:" at character {line.start()} follows no "Action:" line. {self.HINT}'
                )
                continue
            name, number = pending
            pending = None
            where = f"Action #{number} ({name!r})"
            start = line.start(2)
            if not rest:
                errors.append(
                    f"{where}: Action Input is empty; give the arguments as a JSON object. {self.HINT}"
                )
                continue
            try:
                arguments, end = decoder.raw_decode(text, start)
            except (ValueError, RecursionError) as e:
                errors.append(f"{where}: Action Input is not valid JSON: {_json_error(e, text)}. {self.HINT}")
                continue
            cursor = max(cursor, end)
            checked = _as_arguments(arguments, where, "Action Input")
            if isinstance(checked, str):
                errors.append(f"{checked}. {self.HINT}")
            else:
                calls.append(ToolCall(name=name, arguments=checked, id=f"call_{len(calls)}"))
        if pending is not None:
            errors.append(missing_input(*pending))
        content.append(text[cursor:])
        return ParsedResponse("".join(content).strip(), tuple(calls), tuple(errors))

    def near_miss(self, text: str) -> str | None:
        """An "Action:" line directly followed by an "Action Input:" line, either misspelt (``action:``,
        ``ACTION:``, ``Action_Input:``, ``**Action:**``, ...); or a call written as JSON (as
        ``{"name", "arguments"}``, or as LangChain's ``{"action", "action_input"}`` blob)."""
        lines = list(_REACT_VARIANT_RE.finditer(text))
        for action, action_input in zip(lines, lines[1:], strict=False):
            name = action.group("rest").strip(_NAME_DECORATION)
            if (
                "input" in action.group("keyword").lower()
                or "input" not in action_input.group("keyword").lower()
                or not name
                or text[action.end() : action_input.start()].strip()
            ):
                continue
            try:
                arguments, _ = json.JSONDecoder().raw_decode(text, action_input.start("rest"))
                shown = json.dumps(arguments, ensure_ascii=False)
            except (ValueError, RecursionError):
                shown = action_input.group("rest").strip(_DECORATION)
            line = text.count("\n", 0, action.start()) + 1
            correct = _shorten(f"Action: {name}\nAction Input: {shown}")
            return (
                f"{action.group().strip()!r} and {action_input.group().strip()[:40]!r} (line {line}) are not "
                'an action: the keywords are exactly "Action:" and "Action Input:", capitalised so, at the '
                f"start of a line. Correctly written:\n{correct}\n{self.HINT}"
            )
        found = _find_json_calls(text)
        if found is None:
            return None
        where = " in a ``` code fence" if found.in_fence else ""
        correct = "\n".join(
            f"Action: {n}\nAction Input: {json.dumps(a, ensure_ascii=False)}" for n, a in found.calls
        )
        return (
            f"a tool call written as JSON{where} is not an action. Correctly written:\n{_shorten(correct)}\n"
            f"{self.HINT}"
        )

    def observation_messages(self, results: Sequence[ToolResult], errors: Sequence[str]) -> list[dict]:
        blocks = [f"Observation: {r.content}" for r in results]
        blocks += [f"Observation: {_error_content(e)}" for e in errors]
        return [{"role": "user", "content": "\n\n".join(blocks)}] if blocks else []

    def system_prompt(self, tool_schemas: list[dict]) -> str | None:
        lines = ["You can use the following tools:", ""]
        names = []
        for schema in tool_schemas:
            fn = schema.get("function", schema)
            names.append(fn["name"])
            lines.append(f"- {fn['name']}: {fn.get('description', '')}".rstrip())
            lines.append(
                f"  arguments (JSON schema): {json.dumps(fn.get('parameters', {}), ensure_ascii=False)}"
            )
        lines += [
            "",
            "Use this format:",
            "",
            "Thought: think about what to do next",
            f"Action: the tool to use, one of [{', '.join(names)}]",
            "Action Input: the tool's arguments as a JSON object",
            "Observation: the tool's result (written for you; stop after Action Input and wait for it)",
            "... (Thought / Action / Action Input / Observation may repeat)",
            "Thought: I now know the final answer",
            "Final Answer: the final answer",
        ]
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------
# Llama 3.1 / 3.2 JSON
# ---------------------------------------------------------------------------------------------------

_PYTHON_TAG = "<|python_tag|>"


@register_format
class Llama3JsonFormat(ToolCallFormat):
    """Llama 3.1 / 3.2 JSON tool calling: the whole response is ``{"name": ..., "parameters": {...}}``,
    optionally after ``<|python_tag|>``; several calls are separated by ``;`` (as vLLM's parser reads
    them). A response whose text starts with ``{`` is read as tool calls, so a final answer must not
    start with a JSON object — the cost of a format without call markers. Results go back as role
    "tool" messages (OpenAI's role, which the Llama 3.1+ chat templates render exactly as Meta's
    "ipython" role).
    """

    name = "llama3_json"
    HINT = 'Write a call as {"name": "<tool name>", "parameters": {<arguments>}}; separate several calls with ";".'

    def parse(self, text: str) -> ParsedResponse:
        body = text.strip()
        tagged = body.startswith(_PYTHON_TAG)
        if tagged:
            body = body[len(_PYTHON_TAG) :].strip()
        if not body.startswith("{"):
            if tagged:
                return ParsedResponse(
                    body, (), (f"<|python_tag|> is not followed by a JSON object. {self.HINT}",)
                )
            return ParsedResponse(body)
        calls: list[ToolCall] = []
        errors: list[str] = []
        decoder = json.JSONDecoder()
        position, number = 0, 0
        while position < len(body):
            number += 1
            where = f"tool call #{number}"
            try:
                obj, end = decoder.raw_decode(body, position)
            except (ValueError, RecursionError) as e:
                errors.append(f"{where}: invalid JSON: {_json_error(e, body)}. {self.HINT}")
                break
            call = _call_from_object(obj, where, f"call_{len(calls)}")
            if isinstance(call, str):
                errors.append(f"{call}. {self.HINT}")
            else:
                calls.append(call)
            rest = body[end:].lstrip()
            if not rest:
                break
            if not rest.startswith(";"):
                errors.append(f"{where}: unexpected text after the JSON object: {rest[:40]!r}. {self.HINT}")
                break
            rest = rest[1:].lstrip()
            position = len(body) - len(rest)
        return ParsedResponse("", tuple(calls), tuple(errors))

    def near_miss(self, text: str) -> str | None:
        """A call written as JSON where this format does not read it: as a JSON list of calls, in a
        code fence, or after other text."""
        found = _find_json_calls(text)
        if found is None:
            return None
        if found.in_fence:
            problem = "in a ``` code fence"
        elif not found.at_start:
            problem = "after other text"
        else:  # at the start and still final: only a list, since parse reads a leading "{" as calls
            problem = "as a JSON list"
        correct = "; ".join(
            json.dumps({"name": n, "parameters": a}, ensure_ascii=False) for n, a in found.calls
        )
        return (
            f"tool-call JSON written {problem} is not a call: the response must be the call alone (several "
            f'separated by ";", without brackets). Correctly written: {_shorten(correct)} {self.HINT}'
        )

    def observation_messages(self, results: Sequence[ToolResult], errors: Sequence[str]) -> list[dict]:
        messages: list[dict] = [
            {"role": "tool", "name": r.call.name, "tool_call_id": r.call.id, "content": r.content}
            for r in results
        ]
        messages += [{"role": "tool", "content": _error_content(e)} for e in errors]
        return messages
