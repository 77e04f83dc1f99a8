"""The agent gateway: an OpenAI-compatible chat endpoint that turns every model call into one exact step.

A user's agent program (a tool loop written with the ``openai`` client, the OpenAI Agents SDK, ...)
talks to a ``GatewaySession`` as it would to the OpenAI API; each rollout gets its own session, at
its own URL path with its own key, so concurrent agents never mix::

    POST {base_url}/chat/completions     base_url = http://HOST:PORT/sessions/<id>/v1
    GET  {base_url}/models               Authorization: Bearer <the session's api_key>

Each call renders the messages and ``tools`` with the tokenizer's chat template, samples token-in /
token-out through the session's sampler (an ``Engine``, or the trainer's loop: see
``agent_r1.envs.agent_program``), parses tool calls in the configured format (``hermes`` by default)
into OpenAI ``tool_calls``, and records a ``CallRecord``: prompt ids, response ids, sampler
log-probs, finish reason, timing and ``info``.

Exact by construction: when a call's messages are an earlier call's messages + the assistant message
that call returned + new messages (tool results, user turns), with the same tools, its prompt ids are
that call's prompt ids + its sampled response ids + the ids of the template's delta — the ``append``
context policy (``agent_r1.envs.context.AppendContext``), so the model's output is never decoded and
re-encoded. Assistant messages the gateway returned are rendered from the model's raw text (as
``ToolEnv`` keeps them), whatever the client sends back for them. Otherwise (the first call, or an
agent that rewrote, dropped or reordered its history) the whole conversation is rendered afresh.
``info["prompt"]`` says which (``"extends"`` with ``"extends_call"``, or ``"fresh"`` with
``"fresh_reason"``).

Deviations from the OpenAI API: ``n`` must be 1 (one call is one step); ``tool_choice`` ``"required"``
or a named function cannot be enforced on sampling (no constrained decoding): a response without the
call is returned as is and flagged in ``info["tool_choice_unmet"]``; a streamed answer is generated
whole, then sent as the API's chunks. A response with a malformed call comes back as text content
(no ``tool_calls``) with the format's errors in ``info["tool_parse_errors"]``, never as an error.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from aiohttp import web
from transformers import PreTrainedTokenizerBase

from agent_r1.envs.context import AppendContext, ContextError, ContextRequest, PreviousTurn
from agent_r1.models.loading import require_chat_template
from agent_r1.rollout.openai_api import (
    ApiError,
    BadRequest,
    NotFound,
    bearer_matches,
    engine_error,
    error_response,
    json_endpoint,
    key_digest,
    sampling_params,
)
from agent_r1.rollout.openai_api import (
    field as body_field,
)
from agent_r1.tools.formats import ToolCallFormat, compact_tools_text, get_format
from agent_r1.types import Action, Completion, Message, SamplingParams, Step, StopReason

__all__ = [
    "CallRecord",
    "Gateway",
    "GatewaySession",
    "PendingCall",
    "Sampler",
    "TOOL_PROMPTS",
    "engine_sampler",
    "exact_fraction",
]

_ROLES = ("system", "developer", "user", "assistant", "tool")
TOOL_PROMPTS = ("template", "compact", "none")


@dataclass(frozen=True)
class PendingCall:
    """A call whose prompt is built, waiting for its sample. ``recorded`` resolves to its
    ``CallRecord``, or to None when the request ended first (the client went away)."""

    index: int
    prompt_ids: tuple[int, ...]
    info: dict[str, Any]
    recorded: asyncio.Future


@dataclass(frozen=True)
class CallRecord:
    """One model call as sampled: the step it is. ``logprobs`` is None when the sampler handed back
    an ``Action`` (the trainer's loop keeps the log-probs in its own Step). ``step()`` puts ``info``
    at ``Step.info["gateway"]``, where the ``agent_program`` env's steps have it too."""

    index: int
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None
    finish_reason: StopReason
    text: str
    message: Message
    info: dict[str, Any]
    generate_s: float
    policy_version: int = 0

    def step(self) -> Step:
        if self.logprobs is None:
            raise ValueError(f"call {self.index} was sampled without log-probs; it cannot be a Step")
        return Step(
            prompt_ids=self.prompt_ids,
            response_ids=self.response_ids,
            logprobs=self.logprobs,
            stop_reason=self.finish_reason,
            response_text=self.text,
            policy_version=self.policy_version,
            info={"gateway": self.info},
            timings={"generate": self.generate_s},
        )


Sampler = Callable[[PendingCall, SamplingParams], Awaitable["Completion | Action"]]
"""Samples one call's response: a ``Completion`` (ids and log-probs) or an ``Action`` (ids only)."""


def engine_sampler(engine: Any) -> Sampler:
    """A sampler over an ``Engine``; an engine failure answers the call with the API's error."""

    async def sample(call: PendingCall, params: SamplingParams) -> Completion:
        completion = await engine.generate(list(call.prompt_ids), params)
        if completion.error is not None or completion.finish_reason is StopReason.ABORT:
            raise engine_error(completion)
        return completion

    return sample


def exact_fraction(calls: Sequence[CallRecord | Step]) -> float | None:
    """The share of calls after the first whose prompt extended an earlier call exactly (None for
    fewer than two calls): 1.0 means every step's prompt is the previous prompt + sampled ids +
    template delta, so the trajectory packs into merged training sequences."""
    infos = [c.info.get("gateway", c.info) for c in calls][1:]
    if not infos:
        return None
    return sum(i.get("prompt") == "extends" for i in infos) / len(infos)


# ---------------------------------------------------------------------------------------------------
# Messages
# ---------------------------------------------------------------------------------------------------


def _text(content: Any, where: str) -> str:
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


def _normal(message: dict, where: str) -> str:
    """A message as a canonical string: what the conversation says, not how a client spells it
    (``content`` null or "" or text parts, arguments as a JSON string or an object, extra null keys)."""
    normal: dict[str, Any] = {"role": message["role"], "content": _text(message.get("content"), where)}
    if message.get("tool_calls"):
        normal["tool_calls"] = _tool_calls(message, where)
    for key in ("tool_call_id", "name"):
        if message.get(key) is not None:
            normal[key] = message[key]
    return json.dumps(normal, sort_keys=True, ensure_ascii=False)


def _template_message(message: dict, where: str) -> Message:
    """A client's message as chat templates take it (arguments as objects, content as text)."""
    out: Message = {"role": message["role"], "content": _text(message.get("content"), where)}
    calls = _tool_calls(message, where)
    if calls:
        out["tool_calls"] = [
            {"id": i, "type": "function", "function": {"name": n, "arguments": a}} for i, n, a in calls
        ]
    for key in ("tool_call_id", "name"):
        if message.get(key) is not None:
            out[key] = message[key]
    return out


def _check_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise BadRequest("'messages' must be a non-empty list of message objects")
    for i, m in enumerate(messages):
        if m.get("role") not in _ROLES:
            raise BadRequest(f"messages[{i}].role must be one of {', '.join(_ROLES)}, got {m.get('role')!r}")
    return messages


def _check_tools(body: dict) -> tuple[dict, ...] | None:
    tools = body_field(body, "tools", list)
    if not tools:
        return None
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise BadRequest(f'tools[{i}] must be {{"type": "function", "function": {{...}}}}')
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise BadRequest(f"tools[{i}].function.name must be a non-empty string")
    return tuple(tools)


def _check_tool_choice(body: dict, tools: tuple[dict, ...] | None) -> str | None:
    """``"auto"``, ``"none"``, ``"required"`` or the one function's name."""
    choice = body.get("tool_choice")
    if choice is None:
        return "auto" if tools else "none"
    if choice in ("auto", "none", "required"):
        return choice
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(name, str):
        raise BadRequest(
            "'tool_choice' must be 'auto', 'none', 'required' or "
            '{"type": "function", "function": {"name": ...}}'
        )
    if not tools or name not in {t["function"]["name"] for t in tools}:
        raise BadRequest(f"'tool_choice' names function {name!r}, which is not in 'tools'")
    return name


# ---------------------------------------------------------------------------------------------------
# Sessions
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Turn:
    """What an earlier call saw and returned, for recognising an extension of it."""

    normal: tuple[str, ...]  # its messages, normalised
    returned: str  # the assistant message it returned, normalised
    tools: tuple[dict, ...] | None
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    index: int


@dataclass(frozen=True)
class _Prepared:
    call: PendingCall
    tools: tuple[dict, ...] | None
    normal: tuple[str, ...]
    tool_choice: str | None
    params: SamplingParams


class GatewaySession:
    """One rollout's conversation(s) with the model: its URL, its key and its recorded calls.

    Made by ``Gateway.open_session``; ``records`` are the calls in completion order, ``steps()``
    them as Steps. After ``close()`` every call is answered 410.
    """

    def __init__(self, gateway: Gateway, session_id: str, sampler: Sampler, max_calls: int | None) -> None:
        self.gateway = gateway
        self.id = session_id
        self.api_key = secrets.token_urlsafe(24)
        self.sampler = sampler
        self.max_calls = max_calls
        self.records: list[CallRecord] = []
        self.closed = False
        self._key_digest = key_digest(self.api_key)
        self._turns: list[_Turn] = []
        self._raw: dict[str, str] = {}  # normalised assistant message returned -> the model's raw text
        self._started = 0

    @property
    def base_url(self) -> str:
        """The OpenAI base URL of this session (``openai.AsyncOpenAI(base_url=..., api_key=...)``)."""
        return f"{self.gateway.url}/sessions/{self.id}/v1"

    def steps(self) -> tuple[Step, ...]:
        return tuple(r.step() for r in self.records)

    def close(self) -> None:
        self.closed = True
        self.gateway.sessions.pop(self.id, None)

    def authorized(self, header: str) -> bool:
        return bearer_matches(header, self._key_digest)

    # ------------------------------------------------------------------ one call

    async def _prompt(
        self, messages: list[dict], normal: tuple[str, ...], tools: tuple[dict, ...] | None
    ) -> tuple[tuple[int, ...], dict[str, Any]]:
        tokenizer = self.gateway.tokenizer
        rendered = tuple(
            {"role": "assistant", "content": self._raw[n]}
            if n in self._raw
            else _template_message(m, f"messages[{i}]")
            for i, (m, n) in enumerate(zip(messages, normal, strict=True))
        )
        rendered, template_tools = self.gateway.tool_block(rendered, tools)
        policy = AppendContext()
        reason = "the first call of the session"
        for turn in reversed(self._turns):
            k = len(turn.normal)
            if turn.tools == tools and normal[:k] == turn.normal and normal[k : k + 1] == (turn.returned,):
                previous = PreviousTurn(turn.prompt_ids, turn.response_ids, num_messages=k)
                try:
                    prompt = await policy.build(tokenizer, ContextRequest(rendered, template_tools, previous))
                except ContextError as e:
                    reason = str(e)
                    break
                return prompt.token_ids, {"prompt": "extends", "extends_call": turn.index}
        else:
            if self._turns:
                reason = self._divergence(normal, tools, self._turns[-1])
        prompt = await policy.build(tokenizer, ContextRequest(rendered, template_tools))
        return prompt.token_ids, {"prompt": "fresh", "fresh_reason": reason}

    @staticmethod
    def _divergence(normal: tuple[str, ...], tools: tuple[dict, ...] | None, turn: _Turn) -> str:
        if tools != turn.tools:
            return f"the tools differ from those of call {turn.index}"
        expected = (*turn.normal, turn.returned)
        for i, (a, b) in enumerate(zip(normal, expected, strict=False)):
            if a != b:
                what = "the answer it returned" if i == len(turn.normal) else f"its message {i}"
                return f"message {i} differs from {what} (call {turn.index}): the history was rewritten"
        return f"the call has {len(normal)} messages, fewer than call {turn.index} saw and returned"

    async def prepare(self, body: dict) -> _Prepared:
        messages = _check_messages(body)
        tools = _check_tools(body)
        tool_choice = _check_tool_choice(body, tools)
        if body_field(body, "n", int, 1) != 1:
            raise BadRequest("'n' must be 1: each call through the gateway is one step")
        response_format = body_field(body, "response_format", dict)
        if response_format is not None and response_format.get("type") != "text":
            raise BadRequest("'response_format' other than text is not supported by the gateway")
        normal = tuple(_normal(m, f"messages[{i}]") for i, m in enumerate(messages))
        try:
            prompt_ids, info = await self._prompt(messages, normal, tools)
        except (TypeError, ValueError, KeyError) as e:  # jinja errors are ValueError / TypeError
            raise BadRequest(f"the chat template could not render these messages: {e}") from e
        gateway = self.gateway
        if gateway.max_context is not None and len(prompt_ids) >= gateway.max_context:
            raise BadRequest(
                f"This model's maximum context length is {gateway.max_context} tokens. However, your "
                f"request has {len(prompt_ids)} input tokens."
            )
        cap = gateway.max_tokens
        if gateway.max_context is not None:
            cap = min(cap, gateway.max_context - len(prompt_ids))
        params = sampling_params(body, max_tokens_default=cap, unsupported=("echo",))
        if params.max_tokens > cap:
            params = replace(params, max_tokens=cap)
        if self.max_calls is not None and self._started >= self.max_calls:
            raise ApiError(
                f"session {self.id} reached its limit of {self.max_calls} model calls",
                status=429,
                kind="rate_limit_error",
            )
        index = self._started
        self._started += 1
        call = PendingCall(
            index, prompt_ids, {"call": index, **info}, asyncio.get_running_loop().create_future()
        )
        return _Prepared(call, tools, normal, tool_choice, params)

    def complete(self, prepared: _Prepared, sampled: Completion | Action, generate_s: float) -> CallRecord:
        """Parse the sample into the assistant message, remember the turn, and record the call."""
        call = prepared.call
        tokenizer = self.gateway.tokenizer
        text = tokenizer.decode(list(sampled.token_ids), skip_special_tokens=False)
        eos = tokenizer.eos_token
        content = text[: -len(eos)] if eos and text.endswith(eos) else text
        info = dict(call.info)
        message: Message = {"role": "assistant", "content": content}
        if prepared.tools and prepared.tool_choice != "none":
            message, parse_info = self._tool_message(content, prepared.tool_choice, call.index)
            info.update(parse_info)
        finish = StopReason(sampled.finish_reason)
        self._raw[_normal(message, "the answer")] = content
        self._turns.append(
            _Turn(
                prepared.normal,
                _normal(message, "the answer"),
                prepared.tools,
                call.prompt_ids,
                sampled.token_ids,
                call.index,
            )
        )
        record = CallRecord(
            index=call.index,
            prompt_ids=call.prompt_ids,
            response_ids=sampled.token_ids,
            logprobs=sampled.logprobs if isinstance(sampled, Completion) else None,
            finish_reason=finish,
            text=text,
            message=message,
            info=info,
            generate_s=generate_s,
            policy_version=getattr(sampled, "policy_version", None) or 0,
        )
        self.records.append(record)
        if not call.recorded.done():
            call.recorded.set_result(record)
        return record

    def _tool_message(self, content: str, tool_choice: str | None, index: int) -> tuple[Message, dict]:
        fmt: ToolCallFormat = self.gateway.format
        parsed = fmt.parse(content)
        info: dict[str, Any] = {"tool_calls": len(parsed.calls), "tool_parse_errors": list(parsed.errors)}
        if parsed.is_final:
            near_miss = fmt.near_miss(content)
            if near_miss is not None:
                info["near_miss"] = near_miss
        if parsed.errors or not parsed.calls:
            # a malformed call is the model's text, returned as such: the agent sees what it wrote
            message: Message = {"role": "assistant", "content": content}
        else:
            message = {
                "role": "assistant",
                "content": parsed.content or None,
                "tool_calls": [
                    {
                        "id": f"call_{index}_{i}",
                        "type": "function",
                        "function": {
                            "name": c.name,
                            "arguments": json.dumps(c.arguments, ensure_ascii=False),
                        },
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
# The HTTP server
# ---------------------------------------------------------------------------------------------------


class Gateway:
    """An OpenAI-compatible HTTP server hosting sessions; ``async with Gateway(...)`` starts and stops it.

    Args:
        tokenizer: the policy's tokenizer (with a chat template).
        sampler: the default sampler of new sessions (``engine_sampler(engine)``); a session may
            bring its own (``open_session(sampler=...)``).
        format: the tool-call format that parses responses into ``tool_calls``; it must be one whose
            chat template renders the tools and role "tool" results (``hermes``, ``llama3_json``).
        model_name: what ``/v1/models`` lists; requests may name any model (an agent's configured
            name is not the gateway's business).
        max_tokens: the most tokens one call may generate (a request asking more is capped).
        max_context: prompts this long or longer are answered 400.
        max_calls: model calls per session before it is answered 429 (None: no limit).
        tool_prompt: how a request's ``tools`` reach the prompt: ``"template"`` (the chat template's
            own tool block, the JSON schemas in full), ``"compact"`` (one line per tool appended to the
            system message, ``agent_r1.tools.formats.compact_tools_text``, and no template block), or
            ``"none"`` (nothing: the agent's own system prompt describes its tools). Responses are
            parsed into ``tool_calls`` the same way under all three.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        sampler: Sampler | None = None,
        *,
        format: str | ToolCallFormat = "hermes",
        model_name: str = "agent-r1",
        max_tokens: int = 1024,
        max_context: int | None = None,
        max_calls: int | None = None,
        host: str = "127.0.0.1",
        tool_prompt: str = "template",
    ) -> None:
        require_chat_template(tokenizer)
        self.tokenizer = tokenizer
        self.sampler = sampler
        self.format = get_format(format) if isinstance(format, str) else format
        if self.format.system_prompt([{"type": "function", "function": {"name": "f"}}]) is not None:
            raise ValueError(
                f"Gateway: tool-call format {self.format.name!r} writes its own system prompt and results "
                "as user text; the gateway needs a format whose chat template renders the tools and "
                "role 'tool' results (hermes, llama3_json)"
            )
        if max_tokens < 1:
            raise ValueError(f"Gateway: max_tokens must be >= 1, got {max_tokens}")
        if max_calls is not None and max_calls < 1:
            raise ValueError(f"Gateway: max_calls must be >= 1 or None, got {max_calls}")
        if tool_prompt not in TOOL_PROMPTS:
            raise ValueError(f"Gateway: tool_prompt must be one of {TOOL_PROMPTS}, got {tool_prompt!r}")
        if tool_prompt == "compact":
            compact_tools_text([], self.format)  # a format that cannot say how a call is written fails here
        self.tool_prompt = tool_prompt
        self.model_name = model_name
        self.max_tokens = max_tokens
        self.max_context = max_context
        self.max_calls = max_calls
        self.host = host
        self.sessions: dict[str, GatewaySession] = {}
        self._ended: set[str] = set()
        self._runner: web.AppRunner | None = None
        self.url = ""

    def tool_block(
        self, messages: tuple[Message, ...], tools: tuple[dict, ...] | None
    ) -> tuple[tuple[Message, ...], tuple[dict, ...] | None]:
        """The messages and tools to render, as ``tool_prompt`` says (the same for every call of a
        conversation, so extensions stay exact)."""
        if tools is None or self.tool_prompt == "template":
            return messages, tools
        if self.tool_prompt == "none":
            return messages, None
        text = compact_tools_text(tools, self.format)
        if messages and messages[0]["role"] == "system":
            system = {**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}
            return (system, *messages[1:]), None
        return ({"role": "system", "content": text}, *messages), None

    def open_session(self, sampler: Sampler | None = None) -> GatewaySession:
        sampler = sampler or self.sampler
        if sampler is None:
            raise ValueError("Gateway.open_session: no sampler (give one here or to the Gateway)")
        session = GatewaySession(self, uuid.uuid4().hex, sampler, self.max_calls)
        self.sessions[session.id] = session
        return session

    def close_session(self, session: GatewaySession) -> None:
        session.close()
        self._ended.add(session.id)

    # ------------------------------------------------------------------ lifecycle

    async def start(self, port: int = 0) -> str:
        from agent_r1.rollout.server import start_server

        self._runner, bound = await start_server(self.app(), self.host, port)
        self.url = f"http://{self.host}:{bound}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    async def __aenter__(self) -> Gateway:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_get("/health", self._health)
        app.router.add_get("/sessions/{session}/v1/models", self._models)
        app.router.add_post("/sessions/{session}/v1/chat/completions", json_endpoint(self._chat))
        return app

    # ------------------------------------------------------------------ endpoints

    def _session(self, request: web.Request) -> GatewaySession:
        session_id = request.match_info["session"]
        session = self.sessions.get(session_id)
        if session is None:
            if session_id in self._ended:
                raise ApiError(f"session {session_id} has ended", status=410, kind="invalid_request_error")
            raise NotFound(f"no session {session_id} on this gateway")
        if not session.authorized(request.headers.get("Authorization", "")):
            raise ApiError(
                "invalid or missing API key for this session (Authorization: Bearer ...)",
                status=401,
                kind="authentication_error",
            )
        return session

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _models(self, request: web.Request) -> web.Response:
        try:
            self._session(request)
        except ApiError as e:
            return error_response(e.status, str(e), e.kind)
        card = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "agent-r1"}
        return web.json_response({"object": "list", "data": [card]})

    async def _chat(self, request: web.Request, body: dict) -> dict | web.StreamResponse:
        session = self._session(request)
        stream = body_field(body, "stream", bool, False)
        stream_options = body_field(body, "stream_options", dict, {})
        prepared = await session.prepare(body)
        call = prepared.call
        start = time.perf_counter()
        try:
            sampled = await session.sampler(call, prepared.params)
            record = session.complete(prepared, sampled, time.perf_counter() - start)
        finally:
            if not call.recorded.done():  # cancelled (the client went away) or failed: no record
                call.recorded.set_result(None)
        finish = "tool_calls" if record.message.get("tool_calls") else record.finish_reason.value
        usage = {
            "prompt_tokens": len(record.prompt_ids),
            "completion_tokens": len(record.response_ids),
            "total_tokens": len(record.prompt_ids) + len(record.response_ids),
        }
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": self.model_name}
        if stream:
            return await _stream(
                request, head, record.message, finish, usage if stream_options.get("include_usage") else None
            )
        return {
            **head,
            "object": "chat.completion",
            "choices": [{"index": 0, "message": record.message, "logprobs": None, "finish_reason": finish}],
            "usage": usage,
        }


async def _stream(
    request: web.Request, head: dict, message: Message, finish: str, usage: dict | None
) -> web.StreamResponse:
    """The answer as the OpenAI API streams it: server-sent events of ``chat.completion.chunk``
    deltas (the role, the content, each tool call's id and name then its arguments), a chunk with the
    finish reason, optionally one with the usage, then ``[DONE]``."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)

    async def send(delta: dict, finish_reason: str | None = None, **extra: Any) -> None:
        choices = (
            []
            if extra.get("usage")
            else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
        )
        chunk = {**head, "object": "chat.completion.chunk", "choices": choices, **extra}
        await response.write(f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n".encode())

    await send({"role": "assistant", "content": ""})
    if message.get("content"):
        await send({"content": message["content"]})
    for i, call in enumerate(message.get("tool_calls", [])):
        fn = call["function"]
        await send(
            {
                "tool_calls": [
                    {
                        "index": i,
                        "id": call["id"],
                        "type": "function",
                        "function": {"name": fn["name"], "arguments": ""},
                    }
                ]
            }
        )
        await send({"tool_calls": [{"index": i, "function": {"arguments": fn["arguments"]}}]})
    await send({}, finish)
    if usage is not None:
        await send({}, usage=usage)
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response
