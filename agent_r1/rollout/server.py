"""An OpenAI-compatible HTTP server over any engine (``agent-r1 serve``).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST /v1/responses`` (the
OpenAI Responses API), ``POST /v1/messages`` (Anthropic's Messages API), ``GET /v1/models``,
``GET /health``, and vLLM's ``POST /tokenize`` (``{"prompt", "add_special_tokens"}`` ->
``{"tokens", "count", "max_model_len"}``: a client checks that it shares the server's tokenizer). The completions API takes token-id prompts and returns the generated token ids
and their log-probs with vLLM's conventions, so one client (``OpenAIEngine``) talks to this server
and to ``vllm serve`` alike:

- ``prompt``: a string, a list of token ids, or a list of either (a batch);
- ``return_token_ids: true`` adds ``token_ids`` (and ``prompt_token_ids``) to each choice;
- ``logprobs: k`` adds ``{tokens, token_logprobs, top_logprobs, text_offset}``; with
  ``return_tokens_as_token_ids: true`` the tokens read ``"token_id:N"``;
- vLLM's sampling extensions ``top_k``, ``stop_token_ids``, ``seed`` are honoured;
- vLLM's ``prompt_logprobs: k`` adds ``prompt_logprobs`` to each choice: None for the first prompt
  token, then ``{"<id>": {"logprob", "rank", "decoded_token"}}`` holding the prompt token and the k
  most likely, under the engine's ``log softmax(logits)`` (temperature 1, as vLLM; engines with a
  ``prompt_logprobs`` hook: ``HFEngine``).

Log-probs are the engine's (``log softmax(logits / temperature)``, ``agent_r1.types``). Deviation:
``top_logprobs`` holds only the sampled token (engines return no alternatives). Streaming, ``echo``
and ``best_of`` are not supported and answered with HTTP 400, like any invalid request; a ``model``
other than the served one gets 404, as from vLLM.

A chat completion with ``tools`` (and ``tool_choice`` not "none") has its tool calls parsed with
``tool_format`` into ``tool_calls`` (finish reason ``tool_calls``), as ``vllm serve
--enable-auto-tool-choice`` answers; without tools the message is the text as sampled.
The Responses and Messages endpoints are translated by ``agent_r1.rollout.dialects`` into one chat
call (the chat template renders messages and tools), and the answer's tool calls are parsed with
``tool_format`` (``hermes`` by default) into ``function_call`` items / ``tool_use`` blocks; streaming is
the API's events for the whole answer, generated first. ``tool_prompt`` (``template`` by default,
``compact``, ``none``) decides how a request's tools reach the prompt in all three, as the agent
gateway's option of that name does. ``previous_response_id`` continues one of the
last ``MAX_STORED_RESPONSES`` responses, kept in memory. Errors are in each API's own shape.

With ``api_key``, every path but ``/health`` needs ``Authorization: Bearer KEY`` or ``x-api-key: KEY``
(Anthropic's clients) (401 otherwise), like ``vllm serve --api-key``. ``check_exposure`` is the rule ``agent-r1 serve`` applies before it
binds: an address other than loopback needs a key, or an explicit opt-out.

A client that disconnects cancels its request: the engine stops generating for it.
"""

from __future__ import annotations

import asyncio
import ipaddress
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from aiohttp import web

from agent_r1.rollout.base import Engine
from agent_r1.rollout.dialects import (
    MESSAGES,
    RESPONSES,
    ChatRequest,
    ChatResult,
    Dialect,
    assistant_message,
    send_events,
    template_message,
)
from agent_r1.rollout.openai_api import (
    BadRequest,
    NotFound,
    engine_error,
    error_response,
    field,
    json_endpoint,
    key_digest,
    key_matches,
    sampling_params,
)
from agent_r1.tools.formats import TOOL_PROMPTS, compact_tools_text, get_format, with_tool_prompt
from agent_r1.types import Completion, Message, SamplingParams, StopReason

__all__ = ["build_app", "check_exposure", "is_loopback", "start_server"]

# The OpenAI API's limit on ``n``; without one, a single request could queue any number of samples.
MAX_N = 128

# Responses kept for ``previous_response_id`` (the oldest is forgotten first).
MAX_STORED_RESPONSES = 1024


def _finish_reason(completion: Completion) -> str:
    return completion.finish_reason.value


class _Handlers:
    def __init__(
        self,
        engine: Engine,
        model_name: str,
        tokenizer,
        max_context: int | None,
        tool_format: str = "hermes",
        tool_prompt: str = "template",
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.max_context = max_context or getattr(engine, "max_context", None)
        self.vocab_size = getattr(engine, "vocab_size", None)
        self.tool_format = get_format(tool_format)
        if tool_prompt not in TOOL_PROMPTS:
            raise ValueError(f"tool_prompt must be one of {TOOL_PROMPTS}, got {tool_prompt!r}")
        if tool_prompt == "compact":
            compact_tools_text(
                [], self.tool_format
            )  # a format that cannot say how a call is written fails here
        self.tool_prompt = tool_prompt
        self.stored: OrderedDict[str, tuple[Message, ...]] = OrderedDict()

    # ------------------------------------------------------------------ helpers

    def _need_tokenizer(self, what: str) -> None:
        if self.tokenizer is None:
            raise BadRequest(f"{what} needs a tokenizer, and this server was started without one")

    def _prompt_ids(self, prompt: Any) -> list[int]:
        if isinstance(prompt, str):
            self._need_tokenizer("a text prompt")
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return prompt
        raise BadRequest("'prompt' must be a string, a list of token ids, or a list of those")

    def _render(self, messages: list, tools: list | None) -> list[int]:
        """The prompt ids of a chat: the tokenizer's chat template with the generation prompt, the
        tools shown as ``tool_prompt`` says (``agent_r1.tools.formats.with_tool_prompt``)."""
        shown, shown_tools = with_tool_prompt(messages, tools, self.tool_prompt, self.tool_format)
        try:
            rendered = self.tokenizer.apply_chat_template(
                list(shown),
                tools=None if shown_tools is None else list(shown_tools),
                add_generation_prompt=True,
                tokenize=False,
            )
        except Exception as e:  # a template that rejects the conversation is the caller's problem
            raise BadRequest(f"the chat template could not render these messages: {e}") from e
        ids = self.tokenizer.encode(rendered, add_special_tokens=False)
        self._check_prompt(ids)
        return ids

    def _check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise BadRequest("the prompt is empty")
        bad = [t for t in ids if t < 0 or (self.vocab_size is not None and t >= self.vocab_size)]
        if bad:
            raise BadRequest(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        if self.max_context is not None and len(ids) >= self.max_context:
            raise BadRequest(
                f"This model's maximum context length is {self.max_context} tokens. However, your "
                f"request has {len(ids)} input tokens."
            )

    def _token_strings(self, ids: Sequence[int], as_ids: bool) -> list[str]:
        if as_ids or self.tokenizer is None:
            return [f"token_id:{t}" for t in ids]
        return [self.tokenizer.decode([t], skip_special_tokens=False) for t in ids]

    def _text(self, completion: Completion) -> str:
        if completion.text is not None:
            return completion.text
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(completion.token_ids, skip_special_tokens=False)

    async def _generate(self, prompts: list[list[int]], n: int, params: SamplingParams) -> list[Completion]:
        jobs = []
        for ids in prompts:
            for i in range(n):
                # the i-th of n samples uses seed + i, so that n seeded samples differ
                sample_params = params if params.seed is None else replace(params, seed=params.seed + i)
                jobs.append(self.engine.generate(ids, sample_params))
        completions = await asyncio.gather(*jobs)
        for c in completions:
            if c.error is not None:
                raise engine_error(c)
        return completions

    @staticmethod
    def _body_n(body: dict) -> int:
        n = field(body, "n", int, 1)
        if not 1 <= n <= MAX_N:
            raise BadRequest(f"'n' must be between 1 and {MAX_N}, got {n}")
        return n

    def check_model(self, body: dict) -> None:
        """The model a request names, if any, must be the one served (vLLM answers 404 too)."""
        model = field(body, "model", str)
        if model is not None and model != self.model_name:
            raise NotFound(f"The model `{model}` does not exist; this server serves `{self.model_name}`.")

    # ------------------------------------------------------------------ endpoints

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def models(self, request: web.Request) -> web.Response:
        card = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "agent-r1"}
        if self.max_context is not None:
            card["max_model_len"] = self.max_context
        return web.json_response({"object": "list", "data": [card]})

    async def tokenize(self, body: dict) -> dict:
        """vLLM's ``/tokenize`` for a text prompt: its token ids under this server's tokenizer."""
        self.check_model(body)
        self._need_tokenizer("/tokenize")
        prompt = field(body, "prompt", str)
        if prompt is None:
            raise BadRequest("'prompt' (a string) is required")
        add_special_tokens = field(body, "add_special_tokens", bool, True)
        tokens = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        return {"count": len(tokens), "max_model_len": self.max_context, "tokens": tokens}

    async def completions(self, body: dict) -> dict:
        prompt = body.get("prompt")
        if prompt is None:
            raise BadRequest("'prompt' is required")
        batch = (
            prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]
        )
        prompts = [self._prompt_ids(p) for p in batch]
        for ids in prompts:
            self._check_prompt(ids)
        params = sampling_params(body, max_tokens_default=16)
        n = self._body_n(body)
        logprobs_k = field(body, "logprobs", int)
        if logprobs_k is not None and logprobs_k < 0:
            raise BadRequest(f"'logprobs' must be >= 0, got {logprobs_k}")
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        with_ids = bool(body.get("return_token_ids"))
        prompt_k = field(body, "prompt_logprobs", int)
        scored = None
        if prompt_k is not None:  # vLLM's extension: the prompt's own log-probs (a teacher's signal)
            scored = await self._prompt_logprobs(prompts, prompt_k, as_ids)
        completions = await self._generate(prompts, n, params)
        choices = []
        for index, c in enumerate(completions):
            choice: dict[str, Any] = {
                "index": index,
                "text": self._text(c),
                "logprobs": None,
                "finish_reason": _finish_reason(c),
                "stop_reason": None,
            }
            if logprobs_k is not None:
                tokens = self._token_strings(c.token_ids, as_ids)
                offsets, position = [], 0
                for t in tokens:
                    offsets.append(position)
                    position += len(t)
                choice["logprobs"] = {
                    "text_offset": offsets,
                    "token_logprobs": list(c.logprobs),
                    "tokens": tokens,
                    "top_logprobs": [{t: lp} for t, lp in zip(tokens, c.logprobs, strict=True)],
                }
            if with_ids:
                choice["token_ids"] = list(c.token_ids)
                choice["prompt_token_ids"] = prompts[index // n]
            if scored is not None:
                choice["prompt_logprobs"] = scored[index // n]
            choices.append(choice)
        prompt_tokens = sum(len(p) for p in prompts)
        completion_tokens = sum(len(c.token_ids) for c in completions)
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }

    async def _prompt_logprobs(self, prompts: list[list[int]], k: int, as_ids: bool) -> list[list]:
        """vLLM's ``prompt_logprobs`` of each prompt: None, then ``{"<id>": {logprob, rank,
        decoded_token}}`` per token (the token itself and the ``k`` most likely)."""
        if k < 0:
            raise BadRequest(f"'prompt_logprobs' must be >= 0, got {k}")
        score = getattr(self.engine, "prompt_logprobs", None)
        if score is None:
            raise BadRequest(
                f"'prompt_logprobs': this server's engine ({type(self.engine).__name__}) cannot score prompts"
            )
        out = []
        for ids in prompts:
            try:
                entries = await score(ids, k)
            except ValueError as error:
                raise BadRequest(f"'prompt_logprobs': {error}") from None
            out.append(
                [
                    None
                    if entry is None
                    else {
                        str(t): {
                            "logprob": lp,
                            "rank": rank,
                            "decoded_token": self._token_strings([t], as_ids)[0],
                        }
                        for t, (lp, rank) in entry.items()
                    }
                    for entry in entries
                ]
            )
        return out

    async def chat_completions(self, body: dict) -> dict:
        self._need_tokenizer("chat completions")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise BadRequest("'messages' must be a non-empty list of message objects")
        for i, m in enumerate(messages):
            if "role" not in m:
                raise BadRequest(f"messages[{i}] has no 'role'")
        tools = field(body, "tools", list)
        ids = self._render(messages, tools)
        params = sampling_params(body, max_tokens_default=max(1, (self.max_context or 4096) - len(ids)))
        n = self._body_n(body)
        want_logprobs = bool(body.get("logprobs"))
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        completions = await self._generate([ids], n, params)
        choices = []
        for index, c in enumerate(completions):
            message, finish = self._chat_message(c, tools, body.get("tool_choice"))
            choice: dict[str, Any] = {
                "index": index,
                "message": message,
                "logprobs": None,
                "finish_reason": finish,
            }
            if want_logprobs:
                tokens = self._token_strings(c.token_ids, as_ids)
                choice["logprobs"] = {
                    "content": [
                        {"token": t, "logprob": lp, "bytes": None, "top_logprobs": []}
                        for t, lp in zip(tokens, c.logprobs, strict=True)
                    ]
                }
            if body.get("return_token_ids"):
                choice["token_ids"] = list(c.token_ids)
            choices.append(choice)
        completion_tokens = sum(len(c.token_ids) for c in completions)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "prompt_token_ids": ids if body.get("return_token_ids") else None,
            "usage": {
                "prompt_tokens": len(ids),
                "completion_tokens": completion_tokens,
                "total_tokens": len(ids) + completion_tokens,
            },
        }

    def _chat_message(
        self, completion: Completion, tools: list | None, tool_choice: Any
    ) -> tuple[Message, str]:
        """A chat answer: the text as sampled, or with ``tools`` (and ``tool_choice`` not "none") its
        calls parsed with the tool format into ``tool_calls`` (finish reason ``tool_calls``), as
        ``vllm serve --enable-auto-tool-choice`` does."""
        text = self._text(completion)
        if not tools or tool_choice == "none":
            return {"role": "assistant", "content": text}, _finish_reason(completion)
        eos = self.tokenizer.eos_token
        content = text[: -len(eos)] if eos and text.endswith(eos) else text
        message, _ = assistant_message(content, self.tool_format, "auto", f"call_{uuid.uuid4().hex[:12]}")
        return message, "tool_calls" if message.get("tool_calls") else _finish_reason(completion)

    async def dialect_call(
        self, dialect: Dialect, request: web.Request, body: dict
    ) -> dict | web.StreamResponse:
        """A Responses or Messages request: translated into one chat call, rendered with the chat
        template, sampled once, its tool calls parsed, answered in the dialect's shape."""
        self._need_tokenizer(f"the {dialect.name} API")
        translated: ChatRequest = dialect.parse(body, self.stored.get)
        messages = [template_message(m, f"messages[{i}]") for i, m in enumerate(translated.messages)]
        tools = list(translated.tools) if translated.tools else None
        ids = self._render(messages, tools)
        cap = max(1, (self.max_context or 4096) - len(ids))
        params = sampling_params(translated.sampling, max_tokens_default=cap, unsupported=())
        (completion,) = await self._generate([ids], 1, params)
        text = self._text(completion)
        eos = self.tokenizer.eos_token
        content = text[: -len(eos)] if eos and text.endswith(eos) else text
        message: Message = {"role": "assistant", "content": content}
        if tools and translated.tool_choice != "none":
            message, _ = assistant_message(
                content, self.tool_format, translated.tool_choice, f"call_{uuid.uuid4().hex[:12]}"
            )
        result = ChatResult(
            message,
            StopReason(completion.finish_reason),
            len(ids),
            len(completion.token_ids),
            self.model_name,
        )
        response_id = dialect.new_id()
        if dialect.stores:
            self.stored[response_id] = dialect.conversation(translated, result)
            while len(self.stored) > MAX_STORED_RESPONSES:
                self.stored.popitem(last=False)
        if translated.stream:
            return await send_events(request, dialect.events(translated, result, response_id), dialect.done)
        return dialect.response(translated, result, response_id)


def _json_endpoint(handlers: _Handlers, handler):
    async def checked(request: web.Request, body: dict) -> dict:
        handlers.check_model(body)
        return await handler(body)

    return json_endpoint(checked)


def _dialect_endpoint(handlers: _Handlers, dialect: Dialect):
    async def checked(request: web.Request, body: dict) -> dict | web.StreamResponse:
        handlers.check_model(body)
        return await handlers.dialect_call(dialect, request, body)

    return json_endpoint(checked, dialect.error)


def _require_api_key(api_key: str):
    """Middleware: every path but ``/health`` needs ``Authorization: Bearer <api_key>`` (or
    ``x-api-key: <api_key>``, as Anthropic's clients send it).

    Guarding everything except the one public path (rather than matching ``/v1/...``) leaves no
    route open by a spelling the check did not foresee (``bearer_matches``: constant-time).
    """
    expected = key_digest(api_key)

    @web.middleware
    async def require_api_key(request: web.Request, handler) -> web.StreamResponse:
        if request.path != "/health" and not key_matches(request.headers, expected):
            response = error_response(
                401,
                "invalid or missing API key (Authorization: Bearer ..., or x-api-key)",
                "authentication_error",
                error=MESSAGES.error if request.path.endswith(MESSAGES.path) else RESPONSES.error,
            )
            response.headers["WWW-Authenticate"] = "Bearer"
            return response
        return await handler(request)

    return require_api_key


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address to bind) is reachable from this machine only.

    ``localhost``, 127.0.0.0/8 and ``::1`` (also IPv4-mapped) are; any other name is not, since
    it may resolve to a public interface, and nor is ``""`` or ``0.0.0.0`` (every interface).
    """
    host = host.strip().strip("[]")
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def check_exposure(
    host: str, *, api_key: str | None, allow_unauthenticated: bool = False, exposes: str = "use the model"
) -> None:
    """Raise ``ValueError`` when serving on ``host`` would let anyone who can reach it use the model
    (or whatever ``exposes`` says): a non-loopback address without ``api_key``, unless
    ``allow_unauthenticated`` says it is meant. ``agent-r1 serve`` and ``agent-r1 view`` apply it."""
    if api_key is not None and not api_key:
        raise ValueError("the API key is empty; give a non-empty key, or none")
    if api_key or allow_unauthenticated or is_loopback(host):
        return
    raise ValueError(
        f"refusing to serve on {host!r} without an API key: anyone who can reach that address could "
        f"{exposes}. Set --api-key KEY (or the AGENT_R1_API_KEY environment variable), bind "
        "127.0.0.1, or pass --allow-unauthenticated if the network is trusted."
    )


def build_app(
    engine: Engine,
    *,
    model_name: str,
    tokenizer=None,
    max_context: int | None = None,
    api_key: str | None = None,
    tool_format: str = "hermes",
    tool_prompt: str = "template",
) -> web.Application:
    """An aiohttp application serving ``engine`` under ``model_name``.

    ``tokenizer`` enables text prompts, text in responses and chat completions; ``max_context``
    (default: the engine's ``max_context``) rejects prompts that cannot fit with HTTP 400;
    ``api_key`` makes every path but ``/health`` require ``Authorization: Bearer <api_key>`` (or
    ``x-api-key``); ``tool_format`` parses tool calls in chat completions with ``tools`` and in
    Responses and Messages answers; ``tool_prompt`` says how a request's tools reach the prompt
    (``template``, ``compact``, ``none``: ``agent_r1.tools.formats.with_tool_prompt``, as the agent
    gateway's option of that name, so a model warm-started under ``compact`` sees the same prompts).
    Serve it with ``start_server`` or ``web.run_app(..., handler_cancellation=True)``, so that a
    client's disconnect cancels its generation.
    """
    if api_key is not None and not api_key:
        raise ValueError("build_app: api_key is empty; give a non-empty key, or None")
    handlers = _Handlers(engine, model_name, tokenizer, max_context, tool_format, tool_prompt)
    middlewares = [_require_api_key(api_key)] if api_key else []
    app = web.Application(client_max_size=64 * 2**20, middlewares=middlewares)
    app.router.add_get("/health", handlers.health)
    app.router.add_get("/v1/models", handlers.models)
    app.router.add_post("/tokenize", _json_endpoint(handlers, handlers.tokenize))
    app.router.add_post("/v1/completions", _json_endpoint(handlers, handlers.completions))
    app.router.add_post("/v1/chat/completions", _json_endpoint(handlers, handlers.chat_completions))
    for dialect in (RESPONSES, MESSAGES):
        app.router.add_post(f"/v1{dialect.path}", _dialect_endpoint(handlers, dialect))
    return app


async def start_server(
    app: web.Application, host: str = "127.0.0.1", port: int = 0
) -> tuple[web.AppRunner, int]:
    """Start ``app`` on the running event loop; return the runner (``await runner.cleanup()`` to
    stop) and the bound port (``port=0`` picks a free one)."""
    # aiohttp >= 3.9 lets a handler run on after its client has gone; cancelling it instead
    # cancels the engine request, so a disconnected client stops costing decode steps.
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner, runner.addresses[0][1]
