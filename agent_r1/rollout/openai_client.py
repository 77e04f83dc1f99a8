"""An engine that drives any OpenAI-compatible server token-in / token-out.

``OpenAIEngine`` sends prompt token ids to ``POST {base_url}/completions`` and reads back the
generated token ids and their log-probs, never text: it asks for ``return_token_ids`` (choices carry
``token_ids``) and ``return_tokens_as_token_ids`` (log-prob tokens read ``"token_id:N"``), which
``agent-r1 serve`` and ``vllm serve`` both understand. SGLang's OpenAI server speaks the same
completions API. Log-probs are the server's: on vLLM start it with
``--logprobs-mode processed_logprobs`` to get ``log softmax(logits / temperature)``
(``agent_r1.types``); its default (``raw_logprobs``) ignores the temperature.

Failures: connection errors, timeouts, HTTP 429 and 5xx are retried with exponential backoff
(``max_retries`` times); what still fails, and any other HTTP error, returns
``Completion(finish_reason=ABORT, error=...)`` (``LENGTH`` when the server says the prompt exceeds
the context) — one failing request fails only its trajectory. ``max_concurrency`` bounds the
requests in flight from this engine.

Several roles (``roles=``): each role is a model name on the server, e.g. a LoRA module of
``vllm serve --enable-lora --lora-modules planner=/path/to/adapter``; a request is sent under the
model name of its ``SamplingParams.role``.
"""

from __future__ import annotations

import asyncio
import json
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp

from agent_r1.rollout.base import NamedTensors
from agent_r1.rollout.prompt_checks import refuse_role
from agent_r1.types import Completion, SamplingParams, StopReason

__all__ = ["OpenAIEngine"]

_RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


class _Retryable(Exception):
    pass


class OpenAIEngine:
    """``generate`` against ``{base_url}/completions`` (``base_url`` ends in ``/v1``).

    ``roles``: serve several roles, each a model name on the server (``{role: model name}``); a
    request is sent as the model of its ``SamplingParams.role``, and one whose role is None or not in
    ``roles`` is answered at once with ``ABORT`` and an ``error`` naming the roles served. Default
    None: every request is sent as ``model`` and ``SamplingParams.role`` is ignored (one policy)."""

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        timeout: float = 600.0,
        max_retries: int = 3,
        max_concurrency: int = 64,
        backoff_s: float = 0.5,
        api_key: str | None = None,
        roles: Mapping[str, str] | None = None,
    ) -> None:
        if max_concurrency < 1:
            raise ValueError(f"OpenAIEngine: max_concurrency must be >= 1, got {max_concurrency}")
        if max_retries < 0:
            raise ValueError(f"OpenAIEngine: max_retries must be >= 0, got {max_retries}")
        self.url = base_url.rstrip("/") + "/completions"
        self.model = model
        self.roles = None if roles is None else _checked_roles(roles)
        self.timeout = timeout
        self.max_retries = max_retries
        self.max_concurrency = max_concurrency
        self.backoff_s = backoff_s
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # aiohttp sessions and semaphores belong to one event loop: one of each per loop.
        self._per_loop: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def _session(self) -> tuple[aiohttp.ClientSession, asyncio.Semaphore]:
        loop = asyncio.get_running_loop()
        entry = self._per_loop.get(loop)
        if entry is None or entry[0].closed:
            session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout), headers=self.headers
            )
            entry = (session, asyncio.Semaphore(self.max_concurrency))
            self._per_loop[loop] = entry
        return entry

    async def aclose(self) -> None:
        """Close this event loop's HTTP session."""
        entry = self._per_loop.pop(asyncio.get_running_loop(), None)
        if entry is not None:
            await entry[0].close()

    def request_body(self, prompt_ids: Sequence[int], params: SamplingParams) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model if self.roles is None else self.roles[params.role],
            "prompt": [int(t) for t in prompt_ids],
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "logprobs": 1,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": False,
            "include_stop_str_in_output": True,
        }
        if params.top_k != -1:
            body["top_k"] = params.top_k
        if params.stop:
            body["stop"] = list(params.stop)
        if params.stop_token_ids:
            body["stop_token_ids"] = list(params.stop_token_ids)
        if params.seed is not None:
            body["seed"] = params.seed
        return body

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Completion:
        """Sample one response; see ``agent_r1.rollout.base.Engine.generate``."""
        refused = refuse_role("OpenAIEngine", params.role, self.roles)
        if refused is not None:
            return refused
        session, semaphore = self._session()
        body = self.request_body(prompt_ids, params)
        last_error = ""
        async with semaphore:
            for attempt in range(self.max_retries + 1):
                if attempt:
                    await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
                try:
                    return await self._post(session, body)
                except _Retryable as e:
                    last_error = str(e)
                except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                    last_error = f"{type(e).__name__}: {e}"
        return Completion(
            (),
            (),
            StopReason.ABORT,
            error=f"{self.url}: failed after {self.max_retries + 1} attempts: {last_error}",
        )

    async def _post(self, session: aiohttp.ClientSession, body: dict[str, Any]) -> Completion:
        async with session.post(self.url, json=body) as response:
            text = await response.text()
            if response.status in _RETRY_STATUSES:
                raise _Retryable(f"HTTP {response.status}: {text[:500]}")
            if response.status != 200:
                message = _error_message(text)
                reason = StopReason.LENGTH if "context length" in message else StopReason.ABORT
                return Completion((), (), reason, error=f"HTTP {response.status} from {self.url}: {message}")
        try:
            return parse_completion_choice(json.loads(text)["choices"][0])
        except (KeyError, IndexError, TypeError, ValueError) as e:
            return Completion(
                (),
                (),
                StopReason.ABORT,
                error=f"{self.url} answered with an unreadable completion ({e}): {text[:300]}",
            )

    def update_weights(self, named_tensors: NamedTensors, version: int | None = None) -> None:
        raise NotImplementedError(
            "OpenAIEngine cannot push weights to a remote server; reload the server's model "
            "(e.g. restart it from the new checkpoint) or use HFEngine / VLLMEngine in process"
        )


def _checked_roles(roles: Mapping[str, str]) -> dict[str, str]:
    if not roles:
        raise ValueError("OpenAIEngine: roles must name at least one role (or be None: one policy)")
    for role, model in roles.items():
        if not isinstance(role, str) or not role:
            raise TypeError(f"OpenAIEngine: roles keys must be non-empty str role names, got {role!r}")
        if not isinstance(model, str) or not model:
            raise TypeError(f"OpenAIEngine: roles[{role!r}] must be the server's model name, got {model!r}")
    return dict(roles)


def _error_message(text: str) -> str:
    try:
        error = json.loads(text)["error"]
        return str(error["message"] if isinstance(error, dict) else error)
    except (ValueError, KeyError, TypeError):
        return text[:500]


def parse_completion_choice(choice: dict[str, Any]) -> Completion:
    """Token ids and log-probs of one ``/v1/completions`` choice, in vLLM's conventions."""
    logprobs = choice.get("logprobs") or {}
    token_logprobs = logprobs.get("token_logprobs")
    token_ids = choice.get("token_ids")
    if token_ids is None:
        tokens = logprobs.get("tokens")
        if tokens is None or not all(str(t).startswith("token_id:") for t in tokens):
            raise ValueError("the choice has neither 'token_ids' nor 'token_id:N' log-prob tokens")
        token_ids = [int(str(t).removeprefix("token_id:")) for t in tokens]
    if token_logprobs is None or len(token_logprobs) != len(token_ids):
        raise ValueError("the choice's 'logprobs.token_logprobs' do not match its tokens")
    reason = {"stop": StopReason.STOP, "length": StopReason.LENGTH}.get(
        choice.get("finish_reason"), StopReason.ABORT
    )
    error = None if reason is not StopReason.ABORT else f"finish reason {choice.get('finish_reason')!r}"
    return Completion(token_ids, token_logprobs, reason, text=choice.get("text"), error=error)
