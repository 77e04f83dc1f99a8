"""Prompt log-probs from an OpenAI-compatible server: how a remote teacher scores token sequences.

``POST {base_url}/completions`` with a token-id ``prompt``, ``max_tokens: 1`` and vLLM's
``prompt_logprobs: 0`` returns, in each choice, ``prompt_logprobs``: one entry per prompt token, the
first ``null`` (nothing predicts it) and each other a mapping ``{"<token id>": {"logprob": ...,
"rank": ..., "decoded_token": ...}}`` that holds the prompt token itself (and the top-k with k > 0).
``vllm serve`` and ``agent-r1 serve`` both answer so. vLLM computes them from the raw logits
(temperature 1), whatever the request's temperature; so does ``agent-r1 serve``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence

import aiohttp

__all__ = ["PromptLogprobsError", "prompt_logprobs", "served_model", "served_models", "served_tokens"]


class PromptLogprobsError(RuntimeError):
    """The server could not be reached, or answered without usable prompt log-probs."""


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def served_models(base_url: str, *, api_key: str | None = None, timeout: float = 30.0) -> list[str]:
    """The ids of the models ``GET {base_url}/models`` lists (at least one)."""
    url = base_url.rstrip("/") + "/models"
    try:
        async with (
            aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=timeout), headers=_headers(api_key)
            ) as session,
            session.get(url) as response,
        ):
            text = await response.text()
            if response.status != 200:
                raise PromptLogprobsError(f"GET {url}: HTTP {response.status}: {text[:300]}")
            models = [entry["id"] for entry in json.loads(text)["data"]]
    except (aiohttp.ClientError, asyncio.TimeoutError) as error:
        raise PromptLogprobsError(f"GET {url}: {type(error).__name__}: {error}") from None
    except (KeyError, TypeError, ValueError) as error:
        raise PromptLogprobsError(f"GET {url} listed no model ({error})") from None
    if not models:
        raise PromptLogprobsError(f"GET {url} listed no model")
    return models


async def served_tokens(
    base_url: str, text: str, *, model: str, api_key: str | None = None, timeout: float = 30.0
) -> list[int] | None:
    """The token ids of ``text`` (no special tokens added) under the tokenizer of ``model`` on the
    server: vLLM's ``POST /tokenize`` beside ``base_url``'s ``/v1`` (``agent-r1 serve`` answers it
    too); None when the server has no such endpoint (HTTP 404 or 405)."""
    root = base_url.rstrip("/").removesuffix("/v1")
    url = root + "/tokenize"
    body = {"model": model, "prompt": text, "add_special_tokens": False}
    try:
        async with (
            aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=timeout), headers=_headers(api_key)
            ) as session,
            session.post(url, json=body) as response,
        ):
            answer = await response.text()
            if response.status in (404, 405):
                return None
            if response.status != 200:
                raise PromptLogprobsError(f"POST {url}: HTTP {response.status}: {answer[:300]}")
            return [int(t) for t in json.loads(answer)["tokens"]]
    except (aiohttp.ClientError, asyncio.TimeoutError) as error:
        raise PromptLogprobsError(f"POST {url}: {type(error).__name__}: {error}") from None
    except (KeyError, TypeError, ValueError) as error:
        raise PromptLogprobsError(f"POST {url} answered without token ids ({error})") from None


async def served_model(base_url: str, *, api_key: str | None = None, timeout: float = 30.0) -> str:
    """The first model ``GET {base_url}/models`` lists."""
    return (await served_models(base_url, api_key=api_key, timeout=timeout))[0]


def _token_logprobs(ids: Sequence[int], entries, url: str) -> list[float]:
    """The log-prob of each of ``ids[1:]`` from a choice's ``prompt_logprobs``."""
    if not isinstance(entries, list) or len(entries) != len(ids):
        got = "none" if entries is None else f"{type(entries).__name__} of {len(entries)} entries"
        raise PromptLogprobsError(
            f"{url} returned no prompt log-probs for a {len(ids)}-token prompt (got {got}): the server "
            "must support vLLM's 'prompt_logprobs' request field (vllm serve, agent-r1 serve)"
        )
    out = []
    for position in range(1, len(ids)):
        entry = entries[position]
        found = entry.get(str(ids[position])) if isinstance(entry, dict) else None
        if not isinstance(found, dict) or "logprob" not in found:
            raise PromptLogprobsError(
                f"{url}: prompt_logprobs[{position}] does not hold prompt token {ids[position]}: {entry!r:.200}"
            )
        out.append(float(found["logprob"]))
    return out


async def prompt_logprobs(
    base_url: str,
    model: str,
    prompts: Sequence[Sequence[int]],
    *,
    api_key: str | None = None,
    max_concurrency: int = 16,
    timeout: float = 600.0,
) -> list[list[float]]:
    """For each token-id prompt, the log-prob of each of its tokens after the first, given those
    before it (``len(prompt) - 1`` floats), as the server's model scores them."""
    url = base_url.rstrip("/") + "/completions"
    semaphore = asyncio.Semaphore(max_concurrency)

    async def one(session: aiohttp.ClientSession, ids: Sequence[int]) -> list[float]:
        body = {"model": model, "prompt": [int(t) for t in ids], "max_tokens": 1, "prompt_logprobs": 0}
        async with semaphore:
            try:
                async with session.post(url, json=body) as response:
                    text = await response.text()
            except (aiohttp.ClientError, asyncio.TimeoutError) as error:
                raise PromptLogprobsError(f"POST {url}: {type(error).__name__}: {error}") from None
        if response.status != 200:
            raise PromptLogprobsError(f"POST {url}: HTTP {response.status}: {text[:300]}")
        try:
            choice = json.loads(text)["choices"][0]
        except (KeyError, IndexError, TypeError, ValueError):
            raise PromptLogprobsError(f"POST {url} answered without a choice: {text[:300]}") from None
        return _token_logprobs(ids, choice.get("prompt_logprobs"), url)

    async with aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=timeout), headers=_headers(api_key)
    ) as session:
        return list(await asyncio.gather(*(one(session, ids) for ids in prompts)))
