"""LLM judges: a reward function that asks any OpenAI-compatible endpoint to score an answer.

The endpoint may be ``agent-r1 serve``, ``vllm serve``, a hosted API, or a gateway session. A judge
never fails a rollout: a request that still fails after ``retries`` (the ``openai`` client's
retries with backoff, on connection errors, timeouts, 408/409/429 and 5xx), or a reply ``parse``
cannot read, scores ``failure_value`` and is logged.

    judge = LLMJudge(base_url="http://127.0.0.1:8000/v1", model="judge",
                     prompt="Question: {prompt}\\nReference: {answer}\\nReply: {response}\\n"
                            "Score the reply from 0 to 1. Answer with the number only.")
    reward = await judge("the reply", task)     # a reward_fn of AgentProgramEnv, or any async code
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["LLMJudge", "first_number"]

logger = logging.getLogger(__name__)

_NUMBER_RE = re.compile(r"-?\d+(?:\.\d+)?")


def first_number(reply: str) -> float | None:
    """The first number in the reply, or None."""
    match = _NUMBER_RE.search(reply)
    return None if match is None else float(match.group())


@dataclass(frozen=True)
class LLMJudge:
    """An async ``(response, task) -> float`` reward that asks a chat model.

    ``prompt`` is formatted with the task's fields and ``response`` (the text judged; an
    ``AgentResult``'s ``answer`` when given one); a field it names that the task lacks is an error
    at the call, naming it. ``parse(reply) -> float | None`` reads the score (default: the first
    number); None scores ``failure_value``.
    """

    base_url: str
    model: str
    prompt: str
    api_key: str = "EMPTY"
    system: str | None = None
    parse: Callable[[str], float | None] = first_number
    retries: int = 2
    timeout_s: float = 60.0
    failure_value: float = 0.0
    max_tokens: int = 32
    temperature: float = 0.0

    def __post_init__(self) -> None:
        if self.retries < 0:
            raise ValueError(f"LLMJudge: retries must be >= 0, got {self.retries}")
        if self.timeout_s <= 0:
            raise ValueError(f"LLMJudge: timeout_s must be > 0, got {self.timeout_s}")

    def messages(self, response: str, task: Mapping[str, Any]) -> list[dict]:
        try:
            content = self.prompt.format(**{**task, "response": response})
        except KeyError as e:
            raise ValueError(
                f"LLMJudge: the prompt names {{{e.args[0]}}}, which the task does not have "
                f"(its fields: {sorted(task)}, and 'response')"
            ) from None
        system = [{"role": "system", "content": self.system}] if self.system else []
        return [*system, {"role": "user", "content": content}]

    async def __call__(self, response: Any, task: Mapping[str, Any]) -> float:
        import openai

        text = getattr(response, "answer", response)
        messages = self.messages("" if text is None else str(text), task)
        client = openai.AsyncOpenAI(
            base_url=self.base_url, api_key=self.api_key, max_retries=self.retries, timeout=self.timeout_s
        )
        try:
            completion = await client.chat.completions.create(
                model=self.model, messages=messages, max_tokens=self.max_tokens, temperature=self.temperature
            )
        except openai.OpenAIError as error:
            logger.warning(
                "LLM judge at %s failed (%s: %s): scored %s",
                self.base_url,
                type(error).__name__,
                error,
                self.failure_value,
            )
            return self.failure_value
        finally:
            await client.close()
        reply = completion.choices[0].message.content or ""
        score = self.parse(reply)
        if score is None:
            logger.warning("LLM judge reply %r has no score: scored %s", reply[:80], self.failure_value)
            return self.failure_value
        return float(score)
