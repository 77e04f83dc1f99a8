"""The OpenAI HTTP API's request checks and error answers, shared by ``agent-r1 serve``
(``agent_r1.rollout.server``) and the agent gateway (``agent_r1.envs.gateway``).

Every error is answered in the API's format, ``{"error": {"message", "type", "param", "code"}}`` (or,
on an Anthropic Messages route, that API's ``{"type": "error", "error": {"type", "message"}}``: the
``error`` argument of ``json_endpoint``), with the
HTTP status the OpenAI API (and vLLM) use: 400 for a bad request, 404 for a model or path this
server does not have, 500 for a bug, which is logged.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from agent_r1.types import Completion, SamplingParams, StopReason

__all__ = [
    "ApiError",
    "BadRequest",
    "NotFound",
    "bearer_matches",
    "engine_error",
    "error_response",
    "field",
    "json_endpoint",
    "key_digest",
    "key_matches",
    "openai_error",
    "sampling_params",
]

logger = logging.getLogger(__name__)


def key_digest(api_key: str) -> bytes:
    """The digest an API key is checked against (``bearer_matches``)."""
    return hashlib.sha256(api_key.encode("utf-8", "surrogatepass")).digest()


def key_matches(headers: Any, expected: bytes) -> bool:
    """Whether a request carries the key of ``expected``: ``Authorization: Bearer KEY`` (OpenAI's
    clients) or ``x-api-key: KEY`` (Anthropic's)."""
    if "x-api-key" in headers:
        return hmac.compare_digest(key_digest(headers["x-api-key"].strip()), expected)
    return bearer_matches(headers.get("Authorization", ""), expected)


def bearer_matches(authorization: str, expected: bytes) -> bool:
    """Whether an ``Authorization`` header is ``Bearer <the key of expected>``. Digests of equal length
    are compared with ``hmac.compare_digest``, so the time taken does not reveal how much of a guess
    was right."""
    scheme, _, token = authorization.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(key_digest(token.strip()), expected)


# Integers go to torch as int64 (seeds, top_k): a larger one would fail inside the engine.
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


class ApiError(Exception):
    """A request answered with HTTP ``status`` and this message, in the API's error format."""

    status = 500
    kind = "internal_error"

    def __init__(
        self, message: str, *, status: int | None = None, kind: str | None = None, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status or type(self).status
        self.kind = kind or type(self).kind
        self.param = param


class BadRequest(ApiError):
    """An invalid request: answered with HTTP 400 and this message."""

    status = 400
    kind = "invalid_request_error"


class NotFound(ApiError):
    """A request for something this server does not have: answered with HTTP 404."""

    status = 404
    kind = "not_found_error"


def engine_error(completion: Completion) -> ApiError:
    """What a request the engine failed is answered with: 400 when the prompt cannot fit the
    engine's context (finish reason LENGTH), else 500."""
    if completion.finish_reason is StopReason.LENGTH:
        return BadRequest(completion.error or "the prompt does not fit the engine's context")
    return ApiError(completion.error or "the engine failed the request", status=500, kind="engine_error")


ErrorBody = Callable[[int, str, str, "str | None"], dict]
"""(status, message, kind, param) -> the error's JSON body in one API's shape."""


def openai_error(status: int, message: str, kind: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(
    status: int, message: str, kind: str, param: str | None = None, *, error: ErrorBody = openai_error
) -> web.Response:
    return web.json_response(error(status, message, kind, param), status=status)


def field(body: dict, name: str, kinds: type | tuple[type, ...], default: Any = None) -> Any:
    """``body[name]`` if present and of one of ``kinds`` (a JSON boolean is not a number)."""
    value = body.get(name)
    if value is None:
        return default
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        expected = " or ".join(k.__name__ for k in kinds)
        raise BadRequest(f"'{name}' must be of type {expected}, got {json.dumps(value)[:50]}")
    if isinstance(value, int) and not isinstance(value, bool) and not _INT64_MIN <= value <= _INT64_MAX:
        raise BadRequest(f"'{name}' is out of range (a 64-bit signed integer), got {value}")
    return value


def _reject_constant(name: str) -> None:
    """``json.loads`` hook: Python's parser accepts ``NaN`` and ``Infinity``; JSON does not."""
    raise ValueError(f"{name} is not valid JSON")


def sampling_params(
    body: dict, max_tokens_default: int, *, unsupported: tuple[str, ...] = ("stream", "echo")
) -> SamplingParams:
    """The request's sampling fields as ``SamplingParams``; a field in ``unsupported`` that is set,
    or any invalid value, is a ``BadRequest``."""
    for name in unsupported:
        if body.get(name):
            raise BadRequest(f"'{name}' is not supported by this server")
    if body.get("best_of") not in (None, 1):
        raise BadRequest("'best_of' is not supported by this server (use n)")
    stop = field(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) for s in stop):
        raise BadRequest("'stop' must be a string or a list of strings")
    stop_token_ids = field(body, "stop_token_ids", list, [])
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_token_ids):
        raise BadRequest("'stop_token_ids' must be a list of integers")
    max_tokens_key = (
        "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    )
    try:
        return SamplingParams(
            temperature=float(field(body, "temperature", (int, float), 1.0)),
            top_p=float(field(body, "top_p", (int, float), 1.0)),
            top_k=field(body, "top_k", int, -1) or -1,  # vLLM and OpenAI clients send 0 for "off"
            max_tokens=field(body, max_tokens_key, int, max_tokens_default),
            stop_token_ids=tuple(stop_token_ids),
            stop=tuple(stop),
            seed=field(body, "seed", int),
        )
    except ValueError as e:
        raise BadRequest(str(e)) from e


Handler = Callable[[web.Request, dict], Awaitable["dict | web.StreamResponse"]]


def json_endpoint(
    handler: Handler, error: ErrorBody = openai_error
) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """An aiohttp handler that parses the body as a JSON object, calls ``handler(request, body)`` and
    answers its dict as JSON (or returns its stream response); ``ApiError`` becomes its status, any
    other exception a logged 500, both in the API's error format (``error``)."""

    async def endpoint(request: web.Request) -> web.StreamResponse:
        try:
            body = json.loads(await request.text(), parse_constant=_reject_constant)
        except web.HTTPRequestEntityTooLarge as e:
            return error_response(413, e.text, "invalid_request_error", error=error)
        except (ValueError, LookupError) as e:  # bad JSON, NaN / Infinity, undecodable bytes or charset
            return error_response(
                400, f"the request body must be a JSON object ({e})", "invalid_request_error", error=error
            )
        if not isinstance(body, dict):
            return error_response(
                400, "the request body must be a JSON object", "invalid_request_error", error=error
            )
        try:
            result = await handler(request, body)
        except ApiError as e:
            return error_response(e.status, str(e), e.kind, e.param, error=error)
        except Exception as e:  # a bug here must still answer in the API's error format, and be logged
            logger.exception("agent-r1 server: %s %s failed", request.method, request.path)
            return error_response(
                500, f"internal server error: {type(e).__name__}: {e}", "internal_error", error=error
            )
        return result if isinstance(result, web.StreamResponse) else web.json_response(result)

    return endpoint
