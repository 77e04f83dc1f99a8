"""The agent gateway: OpenAI- and Anthropic-compatible endpoints that turn every model call into one exact step.

A user's agent program (a tool loop written with the ``openai`` or ``anthropic`` client, the OpenAI
Agents SDK, ...) talks to a ``GatewaySession`` as it would to the OpenAI or Anthropic API; each
rollout gets its own session, with its own key, so concurrent agents never mix::

    POST {base_url}/chat/completions     base_url = http://HOST:PORT/sessions/<id>/v1  (session.base_url)
    POST {base_url}/responses            Authorization: Bearer <the session's api_key>
    POST {base_url}/messages             (or x-api-key: <key>, as Anthropic's clients send it;
    GET  {base_url}/models                anthropic's base URL is session.anthropic_base_url)

or, for a harness that cannot change its base URL per rollout, the same paths under
``http://HOST:PORT/v1`` with the header ``X-Agent-R1-Session: <id>`` (``SESSION_HEADER``).

The three APIs are translators (``agent_r1.rollout.dialects``) over one call: each request becomes
chat messages + ``tools`` + a tool choice + sampling fields, and the one core here renders them with
the tokenizer's chat template (``GatewaySession._prompt``), samples token-in / token-out through the
session's sampler (an ``Engine``, or the trainer's loop: see ``agent_r1.envs.agent_program``), parses
tool calls in the configured format (``hermes`` by default) into the assistant message's
``tool_calls``, and records a ``CallRecord``: prompt ids, response ids, sampler log-probs, finish
reason, timing and ``info``. The dialect then answers in its API's shape (``tool_calls``,
``function_call`` items, ``tool_use`` blocks), or as that API's stream events. A Responses answer's
conversation is kept in the session for ``previous_response_id``.

Roles (``Gateway(roles=[...])``): an agent of several roles (a planner and an executor) names the role
of each call as the request's ``model``; the call is sampled with ``SamplingParams.role`` set to it
(the role's policy) and its ``PendingCall`` / ``CallRecord`` carry it. A model that is not a role is
answered 404 in the API's error shape, listing the roles; ``/models`` lists them. Without roles any
model name is accepted.

Exact by construction: when a call's messages are an earlier call's messages + the assistant message
that call returned + new messages (tool results, user turns), with the same tools, its prompt ids are
that call's prompt ids + its sampled response ids + the ids of the template's delta — the ``append``
context policy (``agent_r1.envs.context.AppendContext``), so the model's output is never decoded and
re-encoded. This holds whichever API the agent speaks (a Responses agent resending its input or
chaining ``previous_response_id``, an Anthropic loop resending ``tool_use`` / ``tool_result``
blocks): they translate to the same messages. Assistant messages the gateway returned are rendered
from the model's raw text (as ``ToolEnv`` keeps them), whatever the client sends back for them.
Otherwise (the first call, or an agent that rewrote, dropped or reordered its history) the whole
conversation is rendered afresh. ``info["prompt"]`` says which (``"extends"`` with
``"extends_call"``, or ``"fresh"`` with ``"fresh_reason"``).

Deviations from the APIs: ``n`` must be 1 (one call is one step); ``tool_choice`` ``"required"``
(Anthropic's ``any``) or a named function cannot be enforced on sampling (no constrained decoding): a
response without the call is returned as is and flagged in ``info["tool_choice_unmet"]``; a streamed
answer is generated whole, then sent as the API's events; built-in tools, non-text content and
structured output are refused (400, in the API's error shape). A response with a malformed call comes
back as text content (no tool calls) with the format's errors in ``info["tool_parse_errors"]``, never
as an error.
"""

from __future__ import annotations

import asyncio
import secrets
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from aiohttp import web
from transformers import PreTrainedTokenizerBase

from agent_r1.envs.context import AppendContext, ContextError, ContextRequest, PreviousTurn
from agent_r1.models.loading import require_chat_template
from agent_r1.rollout.dialects import (
    CHAT,
    MESSAGES,
    RESPONSES,
    ChatRequest,
    ChatResult,
    Dialect,
    assistant_message,
    normal_message,
    send_events,
    template_message,
)
from agent_r1.rollout.openai_api import (
    ApiError,
    BadRequest,
    NotFound,
    engine_error,
    error_response,
    json_endpoint,
    key_digest,
    key_matches,
    sampling_params,
)
from agent_r1.tools.formats import (
    TOOL_PROMPTS,
    ToolCallFormat,
    compact_tools_text,
    get_format,
    with_tool_prompt,
)
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
    "role_names",
]

SESSION_HEADER = "X-Agent-R1-Session"
"""Routes a request on ``http://HOST:PORT/v1/...`` to its session (instead of ``/sessions/<id>/v1``)."""

DIALECTS: tuple[Dialect, ...] = (CHAT, RESPONSES, MESSAGES)


@dataclass(frozen=True)
class PendingCall:
    """A call whose prompt is built, waiting for its sample. ``recorded`` resolves to its
    ``CallRecord``, or to None when the request ended first (the client went away). ``role``: the
    role the request's model named (``Gateway(roles=...)``); None on a gateway without roles."""

    index: int
    prompt_ids: tuple[int, ...]
    info: dict[str, Any]
    recorded: asyncio.Future
    role: str | None = None


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
    role: str | None = None

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
    """The share of calls after the first whose prompt extended an earlier call exactly: 1.0 means
    every step's prompt is the previous prompt + sampled ids + template delta, so the trajectory
    packs into merged training sequences. One call is exact (1.0: nothing it could fail to extend,
    one sequence); None only for no call at all. Calls of several roles (``CallRecord.role``) are
    judged after each role's first call: every role's trajectory starts afresh."""
    if not calls:
        return None
    started: set[str | None] = set()
    judged = []
    for call in calls:
        role = getattr(call, "role", None)
        if role in started:
            judged.append(call.info.get("gateway", call.info))
        started.add(role)
    if not judged:
        return 1.0
    return sum(i.get("prompt") == "extends" for i in judged) / len(judged)


def role_names(roles: Sequence[str] | None) -> tuple[str, ...] | None:
    """``roles`` as a tuple, checked: a list of distinct non-empty strings (None: one role)."""
    if roles is None:
        return None
    if isinstance(roles, str) or not isinstance(roles, Sequence) or not roles:
        raise ValueError(f"roles must be a list of role names, e.g. [planner, executor]; got {roles!r}")
    for role in roles:
        if not isinstance(role, str) or not role:
            raise ValueError(f"roles must be non-empty strings; got {role!r} in {list(roles)}")
    twice = sorted(role for role, n in Counter(roles).items() if n > 1)
    if twice:
        raise ValueError(f"roles must be distinct; {twice} named more than once in {list(roles)}")
    return tuple(roles)


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
        self._responses: dict[str, tuple[Message, ...]] = {}  # Responses API id -> its conversation
        self._started = 0

    @property
    def base_url(self) -> str:
        """The OpenAI base URL of this session (``openai.AsyncOpenAI(base_url=..., api_key=...)``)."""
        return f"{self.gateway.url}/sessions/{self.id}/v1"

    @property
    def anthropic_base_url(self) -> str:
        """The Anthropic base URL of this session (``anthropic.AsyncAnthropic(base_url=..., api_key=...)``:
        that SDK appends ``/v1/messages`` itself)."""
        return f"{self.gateway.url}/sessions/{self.id}"

    def steps(self) -> tuple[Step, ...]:
        return tuple(r.step() for r in self.records)

    def close(self) -> None:
        self.closed = True
        self.gateway.sessions.pop(self.id, None)

    def authorized(self, headers: Any) -> bool:
        """Whether the request's headers carry this session's key (``Authorization: Bearer`` or
        ``x-api-key``)."""
        return key_matches(headers, self._key_digest)

    def remember(self, response_id: str, conversation: tuple[Message, ...]) -> None:
        """Keep a Responses answer's conversation for a later ``previous_response_id``."""
        self._responses[response_id] = conversation

    def previous(self, response_id: str) -> tuple[Message, ...] | None:
        return self._responses.get(response_id)

    # ------------------------------------------------------------------ one call

    async def _prompt(
        self, messages: list[dict], normal: tuple[str, ...], tools: tuple[dict, ...] | None
    ) -> tuple[tuple[int, ...], dict[str, Any]]:
        tokenizer = self.gateway.tokenizer
        rendered = tuple(
            {"role": "assistant", "content": self._raw[n]}
            if n in self._raw
            else template_message(m, f"messages[{i}]")
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

    async def prepare(self, request: ChatRequest, role: str | None = None) -> _Prepared:
        """Build one call's prompt ids (exactly, when it extends an earlier call) and its sampling
        parameters (``role``: the policy's role, ``SamplingParams.role``), from the dialect's
        translation of the request."""
        messages, tools, tool_choice = list(request.messages), request.tools, request.tool_choice
        normal = tuple(normal_message(m, f"messages[{i}]") for i, m in enumerate(messages))
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
        params = sampling_params(request.sampling, max_tokens_default=cap, unsupported=("echo",))
        if params.max_tokens > cap:
            params = replace(params, max_tokens=cap)
        params = replace(params, role=role)
        if self.max_calls is not None and self._started >= self.max_calls:
            raise ApiError(
                f"session {self.id} reached its limit of {self.max_calls} model calls",
                status=429,
                kind="rate_limit_error",
            )
        index = self._started
        self._started += 1
        call = PendingCall(
            index, prompt_ids, {"call": index, **info}, asyncio.get_running_loop().create_future(), role
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
            message, parse_info = assistant_message(
                content, self.gateway.format, prepared.tool_choice, f"call_{call.index}"
            )
            info.update(parse_info)
        finish = StopReason(sampled.finish_reason)
        self._raw[normal_message(message, "the answer")] = content
        self._turns.append(
            _Turn(
                prepared.normal,
                normal_message(message, "the answer"),
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
            role=call.role,
        )
        self.records.append(record)
        if not call.recorded.done():
            call.recorded.set_result(record)
        return record


# ---------------------------------------------------------------------------------------------------
# The HTTP server
# ---------------------------------------------------------------------------------------------------


class Gateway:
    """An HTTP server hosting sessions (chat completions, Responses, Anthropic Messages);
    ``async with Gateway(...)`` starts and stops it.

    Args:
        tokenizer: the policy's tokenizer (with a chat template).
        sampler: the default sampler of new sessions (``engine_sampler(engine)``); a session may
            bring its own (``open_session(sampler=...)``).
        format: the tool-call format that parses responses into ``tool_calls``; it must be one whose
            chat template renders the tools and role "tool" results (``hermes``, ``llama3_json``).
        model_name: what ``/v1/models`` lists without roles; requests may then name any model (an
            agent's configured name is not the gateway's business).
        roles: the role names an agent of several roles calls as its ``model`` (each call is sampled
            with ``SamplingParams.role`` set to it); a request naming another model is answered 404,
            and ``/v1/models`` lists the roles. None: one role, any model name.
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
        roles: Sequence[str] | None = None,
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
        self.roles = role_names(roles)
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
        conversation, so extensions stay exact; ``agent_r1.tools.formats.with_tool_prompt``)."""
        return with_tool_prompt(messages, tools, self.tool_prompt, self.format)

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
        for prefix in ("/sessions/{session}/v1", "/v1"):  # by path, or by the X-Agent-R1-Session header
            app.router.add_get(f"{prefix}/models", self._models)
            for dialect in DIALECTS:
                app.router.add_post(
                    f"{prefix}{dialect.path}", json_endpoint(self._endpoint(dialect), dialect.error)
                )
        return app

    # ------------------------------------------------------------------ endpoints

    def _session(self, request: web.Request) -> GatewaySession:
        session_id = request.match_info.get("session")
        header = request.headers.get(SESSION_HEADER)
        if session_id is None:
            if not header:
                raise NotFound(
                    f"no session named: use the path /sessions/<id>/v1/... or the {SESSION_HEADER} header"
                )
            session_id = header.strip()
        elif header and header.strip() != session_id:
            raise BadRequest(f"the path names session {session_id} and the {SESSION_HEADER} header another")
        session = self.sessions.get(session_id)
        if session is None:
            if session_id in self._ended:
                raise ApiError(f"session {session_id} has ended", status=410, kind="invalid_request_error")
            raise NotFound(f"no session {session_id} on this gateway")
        if not session.authorized(request.headers):
            raise ApiError(
                "invalid or missing API key for this session (Authorization: Bearer ..., or x-api-key)",
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
        cards = [
            {"id": name, "object": "model", "created": 0, "owned_by": "agent-r1"}
            for name in self.roles or (self.model_name,)
        ]
        return web.json_response({"object": "list", "data": cards})

    def _role(self, body: dict) -> str | None:
        """The role the request's ``model`` names (None without roles); another model is a 404."""
        if self.roles is None:
            return None
        model = body.get("model")
        if model not in self.roles:
            raise NotFound(
                f"The model {model!r} does not exist on this gateway: its models are the agent's roles "
                f"{list(self.roles)}; name one as the request's model",
                param="model",
            )
        return model

    def _endpoint(self, dialect: Dialect):
        async def endpoint(request: web.Request, body: dict) -> dict | web.StreamResponse:
            session = self._session(request)
            role = self._role(body)
            translated = dialect.parse(body, session.previous)
            record = await self._call(session, translated, role)
            result = ChatResult(
                record.message,
                record.finish_reason,
                len(record.prompt_ids),
                len(record.response_ids),
                role or self.model_name,
            )
            response_id = dialect.new_id()
            if dialect.stores:
                session.remember(response_id, dialect.conversation(translated, result))
            if translated.stream:
                return await send_events(
                    request, dialect.events(translated, result, response_id), dialect.done
                )
            return dialect.response(translated, result, response_id)

        return endpoint

    async def _call(self, session: GatewaySession, request: ChatRequest, role: str | None) -> CallRecord:
        """One call, whatever its dialect: build the prompt, sample, record."""
        prepared = await session.prepare(request, role)
        call = prepared.call
        start = time.perf_counter()
        try:
            sampled = await session.sampler(call, prepared.params)
            return session.complete(prepared, sampled, time.perf_counter() - start)
        finally:
            if not call.recorded.done():  # cancelled (the client went away) or failed: no record
                call.recorded.set_result(None)
