"""The three API dialects a model server speaks, as translators over one internal call.

OpenAI chat completions, the OpenAI Responses API and Anthropic's Messages API each say the same
thing differently: a conversation, some function tools, a tool choice, sampling fields. A ``Dialect``
translates a request body into one ``ChatRequest`` (chat-completions messages and tools, the tool
choice as ``"auto"`` / ``"none"`` / ``"required"`` / a function's name, and the sampling fields under
their chat-completions names), and one ``ChatResult`` (the assistant message, with ``tool_calls``,
the finish reason, the token counts) into that API's response object or its stream of server-sent
events. The servers that render, sample and record (the agent gateway, ``agent_r1.envs.gateway``,
and ``agent-r1 serve``, ``agent_r1.rollout.server``) are written once, over ``ChatRequest`` and
``ChatResult``; errors are answered in each API's own shape (``Dialect.error``).

What maps to what:

- Responses: ``instructions`` -> a leading system message; ``input`` (a string, or items) ->
  messages: a ``message`` item -> a message of its role (``developer`` -> system), consecutive
  ``function_call`` items -> one assistant message's ``tool_calls`` (joined to the assistant message
  just before them), ``function_call_output`` -> a role "tool" message; ``previous_response_id`` ->
  that response's conversation (its input, less its instructions, and its output) before ``input``,
  looked up in the caller's store; ``tools`` of type function -> chat tools; ``max_output_tokens`` ->
  ``max_tokens``. Output: a ``message`` item with the text (when there is any) and one
  ``function_call`` item per call; status ``incomplete`` (``max_output_tokens``) when the length ran
  out.
- Messages: ``system`` -> a system message; ``text`` blocks -> content, ``tool_use`` blocks ->
  ``tool_calls`` (``input`` as the arguments), ``tool_result`` blocks -> role "tool" messages (before
  the user's text of the same message, as the API orders them); ``tools`` (``input_schema``) -> chat
  tools; ``tool_choice`` ``auto`` / ``any`` / ``tool`` / ``none`` -> ``auto`` / ``required`` / the
  name / ``none``; ``stop_sequences`` -> ``stop``. Output: a ``text`` block and one ``tool_use`` block
  per call; ``stop_reason`` ``tool_use``, ``max_tokens`` or ``end_turn``.

Refused with a 400 in the API's own error shape: item or block types other than those above
(images, reasoning, built-in tool calls), a ``function_call_output`` / ``tool_result`` whose call id
no earlier call in the conversation has, built-in tools (``web_search``, ``computer_...``, Anthropic's
typed server tools), ``n`` other than 1, ``background``, stored prompts and conversations, structured
output formats, extended thinking, a final assistant message (Anthropic's prefill). Fields with no effect on one sampled answer (``store``,
``metadata``, ``include``, ``parallel_tool_calls``, ``truncation``, ``reasoning``, ...) are accepted
and ignored.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from agent_r1.rollout.openai_api import BadRequest
from agent_r1.rollout.openai_api import field as body_field
from agent_r1.types import Message, StopReason

__all__ = [
    "CHAT",
    "MESSAGES",
    "RESPONSES",
    "ChatRequest",
    "ChatResult",
    "Dialect",
    "assistant_message",
    "message_text",
    "normal_message",
    "send_events",
    "template_message",
]

ROLES = ("system", "developer", "user", "assistant", "tool")

Previous = Callable[[str], "tuple[Message, ...] | None"]
"""A response store's lookup: the conversation a stored response ended (its input and output), or None."""


# ---------------------------------------------------------------------------------------------------
# Chat messages: the internal form
# ---------------------------------------------------------------------------------------------------


def message_text(content: Any, where: str) -> str:
    """A message's content as text: a string, null, or a list of text parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in ("text", "output_text", "input_text"):
                raise BadRequest(f"{where}.content[{i}]: only text content parts are supported")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise BadRequest(f"{where}.content must be a string, a list of text parts, or null")


def _arguments(arguments: Any, where: str) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments) if arguments.strip() else {}
        except ValueError as e:
            raise BadRequest(f"{where}.function.arguments is not valid JSON: {e}") from e
    return arguments


def _tool_calls(message: dict, where: str) -> list[tuple[str | None, str, Any]]:
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list):
        raise BadRequest(f"{where}.tool_calls must be a list")
    out = []
    for i, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise BadRequest(f"{where}.tool_calls[{i}] needs function.name")
        out.append((call.get("id"), fn["name"], _arguments(fn.get("arguments"), f"{where}.tool_calls[{i}]")))
    return out


def normal_message(message: dict, where: str) -> str:
    """A message as a canonical string: what the conversation says, not how a client spells it
    (``content`` null or "" or text parts, arguments as a JSON string or an object, extra null keys)."""
    normal: dict[str, Any] = {"role": message["role"], "content": message_text(message.get("content"), where)}
    if message.get("tool_calls"):
        normal["tool_calls"] = _tool_calls(message, where)
    for key in ("tool_call_id", "name"):
        if message.get(key) is not None:
            normal[key] = message[key]
    return json.dumps(normal, sort_keys=True, ensure_ascii=False)


def template_message(message: dict, where: str) -> Message:
    """A client's message as chat templates take it (arguments as objects, content as text)."""
    out: Message = {"role": message["role"], "content": message_text(message.get("content"), where)}
    calls = _tool_calls(message, where)
    if calls:
        out["tool_calls"] = [
            {"id": i, "type": "function", "function": {"name": n, "arguments": a}} for i, n, a in calls
        ]
    for key in ("tool_call_id", "name"):
        if message.get(key) is not None:
            out[key] = message[key]
    return out


def assistant_message(
    content: str, fmt: Any, tool_choice: str | None, call_prefix: str
) -> tuple[Message, dict]:
    """The model's text as the assistant message: its tool calls parsed with ``fmt`` (a
    ``ToolCallFormat``) into chat ``tool_calls`` with ids ``<call_prefix>_<i>``, and what the parse
    found (``tool_calls``, ``tool_parse_errors``, ``near_miss``, ``tool_choice_unmet``). A response
    with a malformed call is the model's text, returned as such: the agent sees what it wrote."""
    parsed = fmt.parse(content)
    info: dict[str, Any] = {"tool_calls": len(parsed.calls), "tool_parse_errors": list(parsed.errors)}
    if parsed.is_final:
        near_miss = fmt.near_miss(content)
        if near_miss is not None:
            info["near_miss"] = near_miss
    if parsed.errors or not parsed.calls:
        message: Message = {"role": "assistant", "content": content}
    else:
        message = {
            "role": "assistant",
            "content": parsed.content or None,
            "tool_calls": [
                {
                    "id": f"{call_prefix}_{i}",
                    "type": "function",
                    "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)},
                }
                for i, c in enumerate(parsed.calls)
            ],
        }
    names = [c["function"]["name"] for c in message.get("tool_calls", [])]
    if (tool_choice == "required" and not names) or (
        tool_choice not in ("auto", "required", "none") and tool_choice not in names
    ):
        info["tool_choice_unmet"] = tool_choice
    return message, info


# ---------------------------------------------------------------------------------------------------
# The internal call
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChatRequest:
    """One call, whatever the dialect: chat-completions ``messages`` and ``tools``, the tool choice
    (``"auto"``, ``"none"``, ``"required"`` or a function's name), the sampling fields under their
    chat-completions names (for ``sampling_params``), and what the dialect's answer echoes."""

    messages: tuple[dict, ...]
    tools: tuple[dict, ...] | None
    tool_choice: str | None
    sampling: dict
    stream: bool = False
    echo: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ChatResult:
    """One sampled answer: the assistant message (chat form, ``tool_calls`` arguments as JSON
    strings), why sampling stopped, and the token counts."""

    message: Message
    finish_reason: StopReason
    prompt_tokens: int
    completion_tokens: int
    model: str


Events = list[tuple[str | None, dict]]


class Dialect:
    """One API's translator. ``path`` is the route under ``/v1``."""

    name = ""
    path = ""
    id_prefix = ""
    done: bytes | None = None  # what ends a stream after its last event
    stores: bool = False  # whether answers are kept for ``previous_response_id``

    def new_id(self) -> str:
        return f"{self.id_prefix}{uuid.uuid4().hex}"

    def parse(self, body: dict, previous: Previous | None = None) -> ChatRequest:
        raise NotImplementedError

    def response(self, request: ChatRequest, result: ChatResult, response_id: str) -> dict:
        raise NotImplementedError

    def events(self, request: ChatRequest, result: ChatResult, response_id: str) -> Events:
        raise NotImplementedError

    def error(self, status: int, message: str, kind: str, param: str | None = None) -> dict:
        return {"error": {"message": message, "type": kind, "param": param, "code": status}}

    def conversation(self, request: ChatRequest, result: ChatResult) -> tuple[Message, ...]:
        """What a later ``previous_response_id`` continues (Responses only)."""
        return (*request.messages, result.message)


def _tool_choice(choice: str | None, tools: tuple[dict, ...] | None) -> str | None:
    if choice is None:
        return "auto" if tools else "none"
    if choice not in ("auto", "none", "required") and (
        not tools or choice not in {t["function"]["name"] for t in tools}
    ):
        raise BadRequest(
            f"'tool_choice' names function {choice!r}, which is not in 'tools'", param="tool_choice"
        )
    return choice


def _reject(body: dict, checks: Sequence[tuple[str, Callable[[Any], bool], str]]) -> None:
    for name, bad, why in checks:
        value = body.get(name)
        if value is not None and bad(value):
            raise BadRequest(f"'{name}' {why}", param=name)


def _usage_chat(result: ChatResult) -> dict:
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "total_tokens": result.prompt_tokens + result.completion_tokens,
    }


# ---------------------------------------------------------------------------------------------------
# OpenAI chat completions
# ---------------------------------------------------------------------------------------------------


class ChatDialect(Dialect):
    name = "chat completions"
    path = "/chat/completions"
    id_prefix = "chatcmpl-"
    done = b"data: [DONE]\n\n"

    def parse(self, body: dict, previous: Previous | None = None) -> ChatRequest:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise BadRequest("'messages' must be a non-empty list of message objects", param="messages")
        for i, m in enumerate(messages):
            if m.get("role") not in ROLES:
                raise BadRequest(
                    f"messages[{i}].role must be one of {', '.join(ROLES)}, got {m.get('role')!r}",
                    param=f"messages[{i}].role",
                )
        tools = body_field(body, "tools", list)
        checked = None
        if tools:
            for i, t in enumerate(tools):
                fn = t.get("function") if isinstance(t, dict) else None
                if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
                    raise BadRequest(
                        f'tools[{i}] must be {{"type": "function", "function": {{...}}}}', param="tools"
                    )
                if not isinstance(fn.get("name"), str) or not fn["name"]:
                    raise BadRequest(f"tools[{i}].function.name must be a non-empty string", param="tools")
            checked = tuple(tools)
        choice = body.get("tool_choice")
        if isinstance(choice, dict):
            name = (
                choice.get("function", {}).get("name") if isinstance(choice.get("function"), dict) else None
            )
            if not isinstance(name, str):
                raise BadRequest(
                    "'tool_choice' must be 'auto', 'none', 'required' or "
                    '{"type": "function", "function": {"name": ...}}',
                    param="tool_choice",
                )
            choice = name
        elif choice is not None and choice not in ("auto", "none", "required"):
            raise BadRequest(
                "'tool_choice' must be 'auto', 'none', 'required' or a function", param="tool_choice"
            )
        if body_field(body, "n", int, 1) != 1:
            raise BadRequest("'n' must be 1: each call is one sampled answer", param="n")
        response_format = body_field(body, "response_format", dict)
        if response_format is not None and response_format.get("type") != "text":
            raise BadRequest("'response_format' other than text is not supported", param="response_format")
        stream = body_field(body, "stream", bool, False)
        options = body_field(body, "stream_options", dict, {})
        return ChatRequest(
            tuple(messages),
            checked,
            _tool_choice(choice, checked),
            body,
            stream,
            {"include_usage": bool(options.get("include_usage"))},
        )

    @staticmethod
    def finish(result: ChatResult) -> str:
        return "tool_calls" if result.message.get("tool_calls") else result.finish_reason.value

    def response(self, request: ChatRequest, result: ChatResult, response_id: str) -> dict:
        return {
            "id": response_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": result.model,
            "choices": [
                {
                    "index": 0,
                    "message": result.message,
                    "logprobs": None,
                    "finish_reason": self.finish(result),
                }
            ],
            "usage": _usage_chat(result),
        }

    def events(self, request: ChatRequest, result: ChatResult, response_id: str) -> Events:
        """``chat.completion.chunk`` deltas: the role, the content, each tool call's id and name then
        its arguments, the finish reason, optionally the usage (then ``[DONE]``)."""
        head = {"id": response_id, "created": int(time.time()), "model": result.model}
        out: Events = []

        def chunk(delta: dict, finish_reason: str | None = None) -> None:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            out.append((None, {**head, "object": "chat.completion.chunk", "choices": [choice]}))

        message = result.message
        chunk({"role": "assistant", "content": ""})
        if message.get("content"):
            chunk({"content": message["content"]})
        for i, call in enumerate(message.get("tool_calls", [])):
            fn = call["function"]
            start = {
                "index": i,
                "id": call["id"],
                "type": "function",
                "function": {"name": fn["name"], "arguments": ""},
            }
            chunk({"tool_calls": [start]})
            chunk({"tool_calls": [{"index": i, "function": {"arguments": fn["arguments"]}}]})
        chunk({}, self.finish(result))
        if request.echo.get("include_usage"):
            out.append(
                (
                    None,
                    {**head, "object": "chat.completion.chunk", "choices": [], "usage": _usage_chat(result)},
                )
            )
        return out


# ---------------------------------------------------------------------------------------------------
# OpenAI Responses
# ---------------------------------------------------------------------------------------------------

_BUILT_IN = "built-in tools are not supported (this server samples a model: only function tools)"


class ResponsesDialect(Dialect):
    name = "responses"
    path = "/responses"
    id_prefix = "resp_"
    stores = True

    def parse(self, body: dict, previous: Previous | None = None) -> ChatRequest:
        _reject(
            body,
            [
                ("n", lambda v: v != 1, "must be 1: each call is one sampled answer"),
                ("background", bool, "(background responses) is not supported"),
                (
                    "conversation",
                    lambda v: True,
                    "(stored conversations) is not supported; use previous_response_id",
                ),
                ("prompt", lambda v: True, "(stored prompt templates) is not supported; send instructions"),
            ],
        )
        text = body_field(body, "text", dict, {})
        fmt = text.get("format")
        if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
            raise BadRequest("'text.format' other than text is not supported", param="text.format")
        messages: list[dict] = []
        instructions = body_field(body, "instructions", str)
        if instructions is not None:
            messages.append({"role": "system", "content": instructions})
        previous_id = body_field(body, "previous_response_id", str)
        if previous_id is not None:
            history = previous(previous_id) if previous is not None else None
            if history is None:
                raise BadRequest(
                    f"no response {previous_id!r} to continue here (responses are kept per session)",
                    param="previous_response_id",
                )
            messages.extend(history)
        raw_input = body.get("input")
        if isinstance(raw_input, str):
            messages.append({"role": "user", "content": raw_input})
        elif isinstance(raw_input, list):
            self._items(raw_input, messages)
        else:
            raise BadRequest("'input' must be a string or a list of input items", param="input")
        if not any(m["role"] != "system" for m in messages):
            raise BadRequest(
                "the request has no input (no message or item besides instructions)", param="input"
            )
        tools = self._tools(body_field(body, "tools", list) or [])
        choice = body.get("tool_choice")
        if isinstance(choice, dict):
            if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
                raise BadRequest(
                    f"'tool_choice' {json.dumps(choice)[:80]} is not supported: use 'auto', 'none', "
                    '\'required\' or {"type": "function", "name": ...}',
                    param="tool_choice",
                )
            choice = choice["name"]
        elif choice is not None and choice not in ("auto", "none", "required"):
            raise BadRequest(
                "'tool_choice' must be 'auto', 'none', 'required' or a function", param="tool_choice"
            )
        sampling = {k: body[k] for k in ("temperature", "top_p", "top_k", "seed") if body.get(k) is not None}
        if body.get("max_output_tokens") is not None:
            sampling["max_tokens"] = body_field(body, "max_output_tokens", int)
        echo = {
            "instructions": instructions,
            "previous_response_id": previous_id,
            "tools": body.get("tools") or [],
            "tool_choice": body.get("tool_choice") or "auto",
            "max_output_tokens": body.get("max_output_tokens"),
            "temperature": body.get("temperature"),
            "top_p": body.get("top_p"),
            "metadata": body.get("metadata") or {},
        }
        return ChatRequest(
            tuple(messages),
            tools,
            _tool_choice(choice, tools),
            sampling,
            body_field(body, "stream", bool, False),
            echo,
        )

    @staticmethod
    def _tools(tools: list) -> tuple[dict, ...] | None:
        out = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict):
                raise BadRequest(f"tools[{i}] must be an object", param="tools")
            if t.get("type") != "function":
                raise BadRequest(f"tools[{i}] has type {t.get('type')!r}: {_BUILT_IN}", param="tools")
            if not isinstance(t.get("name"), str) or not t["name"]:
                raise BadRequest(f"tools[{i}].name must be a non-empty string", param="tools")
            fn: dict[str, Any] = {"name": t["name"]}
            if t.get("description"):
                fn["description"] = t["description"]
            fn["parameters"] = t.get("parameters") or {"type": "object", "properties": {}}
            out.append({"type": "function", "function": fn})
        return tuple(out) or None

    @staticmethod
    def _items(items: list, messages: list[dict]) -> None:
        calls = {c["id"] for m in messages for c in m.get("tool_calls") or [] if isinstance(c, dict)}
        for i, item in enumerate(items):
            where = f"input[{i}]"
            if not isinstance(item, dict):
                raise BadRequest(f"{where} must be an object", param=where)
            kind = item.get("type") or ("message" if "role" in item else None)
            if kind == "message":
                role = item.get("role")
                if role not in ("user", "system", "developer", "assistant"):
                    raise BadRequest(
                        f"{where}.role must be user, system, developer or assistant, got {role!r}",
                        param=where,
                    )
                messages.append(
                    {
                        "role": "system" if role == "developer" else role,
                        "content": message_text(item.get("content"), where),
                    }
                )
            elif kind == "function_call":
                name, call_id, arguments = item.get("name"), item.get("call_id"), item.get("arguments", "")
                if (
                    not isinstance(name, str)
                    or not isinstance(call_id, str)
                    or not isinstance(arguments, str)
                ):
                    raise BadRequest(
                        f"{where}: a function_call needs name, call_id and arguments (strings)", param=where
                    )
                call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant":
                    last["tool_calls"] = [*(last.get("tool_calls") or []), call]
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                calls.add(call_id)
            elif kind == "function_call_output":
                call_id = item.get("call_id")
                if call_id not in calls:
                    raise BadRequest(
                        f"{where}: function_call_output for call_id {call_id!r}, which no function_call "
                        "before it in the conversation has",
                        param=where,
                    )
                output = item.get("output")
                content = output if isinstance(output, str) else message_text(output, where)
                messages.append({"role": "tool", "tool_call_id": call_id, "content": content})
            else:
                raise BadRequest(
                    f"{where}: item type {kind!r} is not supported (message, function_call, "
                    "function_call_output)",
                    param=where,
                )

    def conversation(self, request: ChatRequest, result: ChatResult) -> tuple[Message, ...]:
        messages = request.messages[1:] if request.echo.get("instructions") is not None else request.messages
        return (*messages, result.message)

    @staticmethod
    def _output(result: ChatResult, response_id: str) -> list[dict]:
        message = result.message
        out: list[dict] = []
        text = message.get("content") or ""
        if text or not message.get("tool_calls"):
            out.append(
                {
                    "type": "message",
                    "id": f"msg_{response_id.removeprefix('resp_')}",
                    "status": "completed",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
                }
            )
        for call in message.get("tool_calls", []):
            fn = call["function"]
            out.append(
                {
                    "type": "function_call",
                    "id": f"fc_{call['id']}",
                    "call_id": call["id"],
                    "name": fn["name"],
                    "arguments": fn["arguments"],
                    "status": "completed",
                }
            )
        return out

    def response(
        self, request: ChatRequest, result: ChatResult, response_id: str, *, done: bool = True
    ) -> dict:
        echo = request.echo
        incomplete = done and result.finish_reason is StopReason.LENGTH
        return {
            "id": response_id,
            "object": "response",
            "created_at": int(time.time()),
            "status": ("incomplete" if incomplete else "completed") if done else "in_progress",
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": echo.get("instructions"),
            "max_output_tokens": echo.get("max_output_tokens"),
            "model": result.model,
            "output": self._output(result, response_id) if done else [],
            "parallel_tool_calls": True,
            "previous_response_id": echo.get("previous_response_id"),
            "reasoning": None,
            "store": True,
            "temperature": echo.get("temperature"),
            "text": {"format": {"type": "text"}},
            "tool_choice": echo.get("tool_choice", "auto"),
            "tools": echo.get("tools", []),
            "top_p": echo.get("top_p"),
            "truncation": "disabled",
            "usage": {
                "input_tokens": result.prompt_tokens,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": result.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": result.prompt_tokens + result.completion_tokens,
            }
            if done
            else None,
            "metadata": echo.get("metadata", {}),
        }

    def events(self, request: ChatRequest, result: ChatResult, response_id: str) -> Events:
        """``response.created``, ``response.in_progress``; per output item ``output_item.added``, its
        text (``content_part.added``, ``output_text.delta`` / ``.done``, ``content_part.done``) or
        its arguments (``function_call_arguments.delta`` / ``.done``), ``output_item.done``; then
        ``response.completed`` (or ``response.incomplete``) with the whole response."""
        out: Events = []

        def event(kind: str, **data: Any) -> None:
            out.append((kind, {"type": kind, "sequence_number": len(out), **data}))

        pending = self.response(request, result, response_id, done=False)
        event("response.created", response=pending)
        event("response.in_progress", response=pending)
        for index, item in enumerate(self._output(result, response_id)):
            if item["type"] == "message":
                text = item["content"][0]["text"]
                event(
                    "response.output_item.added",
                    output_index=index,
                    item={**item, "status": "in_progress", "content": []},
                )
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                at = {"output_index": index, "item_id": item["id"], "content_index": 0}
                event("response.content_part.added", **at, part=part)
                if text:
                    event("response.output_text.delta", **at, delta=text, logprobs=[])
                event("response.output_text.done", **at, text=text, logprobs=[])
                event("response.content_part.done", **at, part={**part, "text": text})
            else:
                event(
                    "response.output_item.added",
                    output_index=index,
                    item={**item, "status": "in_progress", "arguments": ""},
                )
                event(
                    "response.function_call_arguments.delta",
                    output_index=index,
                    item_id=item["id"],
                    delta=item["arguments"],
                )
                event(
                    "response.function_call_arguments.done",
                    output_index=index,
                    item_id=item["id"],
                    name=item["name"],
                    arguments=item["arguments"],
                )
            event("response.output_item.done", output_index=index, item=item)
        final = self.response(request, result, response_id)
        event(
            "response.incomplete" if final["status"] == "incomplete" else "response.completed", response=final
        )
        return out


# ---------------------------------------------------------------------------------------------------
# Anthropic Messages
# ---------------------------------------------------------------------------------------------------

_ANTHROPIC_ERRORS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    410: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
}


class MessagesDialect(Dialect):
    name = "messages"
    path = "/messages"
    id_prefix = "msg_"

    def error(self, status: int, message: str, kind: str, param: str | None = None) -> dict:
        return {
            "type": "error",
            "error": {"type": _ANTHROPIC_ERRORS.get(status, "api_error"), "message": message},
        }

    def parse(self, body: dict, previous: Previous | None = None) -> ChatRequest:
        _reject(
            body,
            [
                ("n", lambda v: v != 1, "must be 1: each call is one sampled answer"),
                (
                    "thinking",
                    lambda v: not (isinstance(v, dict) and v.get("type") == "disabled"),
                    "(extended thinking) is not supported",
                ),
                ("mcp_servers", bool, "is not supported"),
                ("container", lambda v: True, "is not supported"),
            ],
        )
        out: list[dict] = []
        system = body.get("system")
        if system is not None:
            if not isinstance(system, (str, list)):
                raise BadRequest("'system' must be a string or a list of text blocks")
            out.append({"role": "system", "content": message_text(system, "system")})
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise BadRequest("'messages' must be a non-empty list of message objects")
        calls: set[str] = set()
        for i, m in enumerate(messages):
            self._message(m, f"messages.{i}", out, calls)
        if messages[-1].get("role") == "assistant":
            raise BadRequest(
                f"messages.{len(messages) - 1}: a final assistant message (prefilling the answer) is not "
                "supported; end with a user message"
            )
        tools = self._tools(body_field(body, "tools", list) or [])
        choice = body.get("tool_choice")
        if choice is not None:
            kind = choice.get("type") if isinstance(choice, dict) else None
            if kind == "tool" and isinstance(choice.get("name"), str):
                choice = choice["name"]
            elif kind in ("auto", "any", "none"):
                choice = {"auto": "auto", "any": "required", "none": "none"}[kind]
            else:
                raise BadRequest(
                    'tool_choice must be {"type": "auto"}, {"type": "any"}, {"type": "none"} or '
                    '{"type": "tool", "name": ...}'
                )
        sampling = {
            k: body[k] for k in ("temperature", "top_p", "top_k", "max_tokens") if body.get(k) is not None
        }
        if body.get("stop_sequences") is not None:
            sampling["stop"] = body["stop_sequences"]
        return ChatRequest(
            tuple(out), tools, _tool_choice(choice, tools), sampling, body_field(body, "stream", bool, False)
        )

    @staticmethod
    def _tools(tools: list) -> tuple[dict, ...] | None:
        out = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict):
                raise BadRequest(f"tools.{i} must be an object")
            if t.get("type") not in (None, "custom"):
                raise BadRequest(f"tools.{i} has type {t.get('type')!r}: {_BUILT_IN}")
            if not isinstance(t.get("name"), str) or not t["name"]:
                raise BadRequest(f"tools.{i}.name must be a non-empty string")
            if not isinstance(t.get("input_schema"), dict):
                raise BadRequest(f"tools.{i}.input_schema must be a JSON schema object")
            fn: dict[str, Any] = {"name": t["name"]}
            if t.get("description"):
                fn["description"] = t["description"]
            fn["parameters"] = t["input_schema"]
            out.append({"type": "function", "function": fn})
        return tuple(out) or None

    @staticmethod
    def _message(m: dict, where: str, out: list[dict], calls: set[str]) -> None:
        role, content = m.get("role"), m.get("content")
        if role not in ("user", "assistant"):
            raise BadRequest(f"{where}.role must be 'user' or 'assistant', got {role!r}")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            return
        if not isinstance(content, list):
            raise BadRequest(f"{where}.content must be a string or a list of content blocks")
        texts: list[str] = []
        tool_calls: list[dict] = []
        results: list[dict] = []
        for j, block in enumerate(content):
            at = f"{where}.content.{j}"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                texts.append(str(block.get("text", "")))
            elif kind == "tool_use" and role == "assistant":
                if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                    raise BadRequest(f"{at}: a tool_use block needs id and name")
                arguments = json.dumps(block.get("input") or {}, ensure_ascii=False)
                tool_calls.append(
                    {
                        "id": block["id"],
                        "type": "function",
                        "function": {"name": block["name"], "arguments": arguments},
                    }
                )
                calls.add(block["id"])
            elif kind == "tool_result" and role == "user":
                call_id = block.get("tool_use_id")
                if call_id not in calls:
                    raise BadRequest(
                        f"{at}: tool_result for tool_use_id {call_id!r}, which no tool_use block before it "
                        "in the conversation has"
                    )
                value = block.get("content")
                text = value if isinstance(value, str) else message_text(value, at)
                results.append({"role": "tool", "tool_call_id": call_id, "content": text})
            else:
                raise BadRequest(
                    f"{at}: block type {kind!r} is not supported in a {role} message "
                    f"({'text, tool_use' if role == 'assistant' else 'text, tool_result'})"
                )
        if role == "assistant":
            message: dict = {"role": "assistant", "content": "".join(texts)}
            if tool_calls:
                message["tool_calls"] = tool_calls
            out.append(message)
        else:
            out.extend(results)
            if texts or not results:
                out.append({"role": "user", "content": "".join(texts)})

    @staticmethod
    def stop_reason(result: ChatResult) -> str:
        if result.message.get("tool_calls"):
            return "tool_use"
        return "max_tokens" if result.finish_reason is StopReason.LENGTH else "end_turn"

    @staticmethod
    def _content(result: ChatResult) -> list[dict]:
        message = result.message
        blocks: list[dict] = []
        if message.get("content") or not message.get("tool_calls"):
            blocks.append({"type": "text", "text": message.get("content") or ""})
        for call in message.get("tool_calls", []):
            arguments = json.loads(call["function"]["arguments"])
            blocks.append(
                {
                    "type": "tool_use",
                    "id": call["id"],
                    "name": call["function"]["name"],
                    "input": arguments if isinstance(arguments, dict) else {"arguments": arguments},
                }
            )
        return blocks

    def response(self, request: ChatRequest, result: ChatResult, response_id: str) -> dict:
        return {
            "id": response_id,
            "type": "message",
            "role": "assistant",
            "model": result.model,
            "content": self._content(result),
            "stop_reason": self.stop_reason(result),
            "stop_sequence": None,
            "usage": {"input_tokens": result.prompt_tokens, "output_tokens": result.completion_tokens},
        }

    def events(self, request: ChatRequest, result: ChatResult, response_id: str) -> Events:
        """``message_start``; per block ``content_block_start``, a ``text_delta`` or
        ``input_json_delta``, ``content_block_stop``; ``message_delta`` (the stop reason, the
        output tokens); ``message_stop``."""
        out: Events = []

        def event(kind: str, **data: Any) -> None:
            out.append((kind, {"type": kind, **data}))

        start = {
            **self.response(request, result, response_id),
            "content": [],
            "stop_reason": None,
            "usage": {"input_tokens": result.prompt_tokens, "output_tokens": 0},
        }
        event("message_start", message=start)
        for index, block in enumerate(self._content(result)):
            if block["type"] == "text":
                event("content_block_start", index=index, content_block={"type": "text", "text": ""})
                if block["text"]:
                    event(
                        "content_block_delta",
                        index=index,
                        delta={"type": "text_delta", "text": block["text"]},
                    )
            else:
                event("content_block_start", index=index, content_block={**block, "input": {}})
                event(
                    "content_block_delta",
                    index=index,
                    delta={
                        "type": "input_json_delta",
                        "partial_json": json.dumps(block["input"], ensure_ascii=False),
                    },
                )
            event("content_block_stop", index=index)
        event(
            "message_delta",
            delta={"stop_reason": self.stop_reason(result), "stop_sequence": None},
            usage={"output_tokens": result.completion_tokens},
        )
        event("message_stop")
        return out


CHAT = ChatDialect()
RESPONSES = ResponsesDialect()
MESSAGES = MessagesDialect()


async def send_events(request: web.Request, events: Events, done: bytes | None) -> web.StreamResponse:
    """Server-sent events: ``event: <name>`` (when named) and ``data: <json>`` each, then ``done``."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    for name, data in events:
        head = f"event: {name}\n" if name else ""
        await response.write(f"{head}data: {json.dumps(data, ensure_ascii=False)}\n\n".encode())
    if done is not None:
        await response.write(done)
    await response.write_eof()
    return response
