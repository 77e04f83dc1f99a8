"""Context policies: how an environment builds the next prompt from the conversation.

In the step-level MDP the environment decides the state s_{t+1} (Agent-R1, arXiv 2511.14460, §3):
appending everything is one transition function among many. Each policy here turns the conversation
(chat messages, tool results included) into the next prompt's token ids, and may rewrite the
conversation it carries forward.

| name | next prompt | extension of the previous prompt+response? |
|---|---|---|
| ``append`` | previous prompt ids + response ids + token ids of the template text of the new messages | yes, by construction |
| ``rerender`` | the chat template applied to all messages | only when the template and tokenizer round-trip |
| ``sliding_window`` | system + first user message + the last ``k`` turns | no, once turns are dropped |
| ``token_budget`` | drops the oldest turns until the prompt fits ``max_tokens`` | no, once turns are dropped |
| ``summarize`` | older turns replaced by one summary message, by default written (and trained) by the policy | no, once summarised |

A *turn* is one assistant message and the messages that follow it up to the next assistant message
(tool results, user replies). The *head* is every message before the first assistant message (the
system prompt and the task), which windowing policies always keep.

Every policy reports ``{"policy": name, "dropped_turns": int, "summarised": bool}`` in
``ContextPrompt.info``; ``ToolEnv`` stores it in ``Step.info["context"]``. A policy that asks the
policy model for part of the prompt (``summarize``) returns that call as a Step in
``ContextPrompt.steps``: in the step-level MDP the summary is an action like any other.
"""

from __future__ import annotations

import inspect
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from transformers import PreTrainedTokenizerBase

from agent_r1.envs.base import LentPolicy
from agent_r1.models.tokens import encode_text, render_messages
from agent_r1.types import Completion, Message, Step, StopReason, Task

__all__ = [
    "CONTEXT_POLICIES",
    "SUMMARY_KEY",
    "SUMMARY_STEP_KEY",
    "AppendContext",
    "ContextError",
    "ContextPolicy",
    "ContextPrompt",
    "ContextRequest",
    "PreviousTurn",
    "RerenderContext",
    "SampledSummary",
    "SlidingWindowContext",
    "SummarizeContext",
    "TokenBudgetContext",
    "engine_summarizer",
    "get_context_policy",
    "register_context_policy",
    "resolve_context_policy",
    "split_turns",
    "task_id",
    "task_messages",
]

SUMMARY_KEY = "summary_of_turns"
"""Key marking the message that ``summarize`` inserted (its value: how many turns it replaces).
Chat templates ignore unknown message keys, so the marker never reaches the model."""


class ContextError(ValueError):
    """The conversation cannot be turned into a prompt the way the policy promises."""


def task_id(task: Task) -> str:
    return str(task.get("id", ""))


def task_messages(task: Task, key: str = "prompt") -> list[Message]:
    """The opening chat messages of a task: ``task[key]`` is a string (one user message) or a list of
    ``{"role", "content"}`` messages."""
    if key not in task:
        raise ValueError(
            f"task {task_id(task) or '(no id)'} has no {key!r} field; its fields: {sorted(task)}"
        )
    prompt = task[key]
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, Sequence) and all(isinstance(m, Mapping) and "role" in m for m in prompt):
        return [dict(m) for m in prompt]
    raise TypeError(
        f"task {task_id(task) or '(no id)'}: {key!r} must be a string or a list of chat messages "
        f"with 'role' and 'content', got {type(prompt).__name__}"
    )


def split_turns(messages: Sequence[Message]) -> tuple[list[Message], Message | None, list[list[Message]]]:
    """Split a conversation into (head, summary message or None, turns).

    head: the messages before the first assistant message (system prompt, task), less any summary.
    turns: from each assistant message up to the next one.
    """
    head: list[Message] = []
    summary: Message | None = None
    turns: list[list[Message]] = []
    for message in messages:
        if message.get(SUMMARY_KEY) is not None:
            summary = message
        elif message.get("role") == "assistant":
            turns.append([message])
        elif turns:
            turns[-1].append(message)
        else:
            head.append(message)
    return head, summary, turns


def _join(head: list[Message], summary: Message | None, turns: Sequence[list[Message]]) -> list[Message]:
    return [*head, *([summary] if summary else []), *(m for turn in turns for m in turn)]


@dataclass(frozen=True)
class PreviousTurn:
    """The last prompt the model saw and its response; ``messages[num_messages]`` is that response."""

    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    num_messages: int


@dataclass(frozen=True)
class ContextRequest:
    """What a policy gets: the whole carried conversation (new messages included) and tool schemas.

    ``previous`` is None for the first prompt of an episode. ``policy`` is the acting policy the flow
    lent to the environment, for policies that ask it (``summarize``); None outside a flow.
    """

    messages: tuple[Message, ...]
    tools: tuple[dict, ...] | None = None
    previous: PreviousTurn | None = None
    policy: LentPolicy | None = None


@dataclass(frozen=True)
class ContextPrompt:
    """The next prompt: its token ids, the conversation to carry forward, and what was changed.

    ``steps``: policy calls made to build it that are trained (a summary); the env hands them to the
    flow in ``StepResult.policy_steps``.
    """

    token_ids: tuple[int, ...]
    messages: tuple[Message, ...]
    info: dict[str, Any] = field(default_factory=dict)
    steps: tuple[Step, ...] = ()


class ContextPolicy(ABC):
    """Builds the next prompt. Subclass, set ``name`` and register with ``@register_context_policy``."""

    name: ClassVar[str]

    @abstractmethod
    async def build(self, tokenizer: PreTrainedTokenizerBase, request: ContextRequest) -> ContextPrompt: ...

    def _info(self, dropped_turns: int = 0, summarised: bool = False) -> dict[str, Any]:
        return {"policy": self.name, "dropped_turns": dropped_turns, "summarised": summarised}


CONTEXT_POLICIES: dict[str, type[ContextPolicy]] = {}


def register_context_policy(cls: type[ContextPolicy]) -> type[ContextPolicy]:
    CONTEXT_POLICIES[cls.name] = cls
    return cls


def get_context_policy(name: str, **kwargs: Any) -> ContextPolicy:
    """The policy registered as ``name``, built with ``kwargs``; unknown names list the choices."""
    if name not in CONTEXT_POLICIES:
        raise ValueError(f"unknown context policy {name!r}; available: {sorted(CONTEXT_POLICIES)}")
    return CONTEXT_POLICIES[name](**kwargs)


def resolve_context_policy(
    context: str | ContextPolicy, context_kwargs: Mapping[str, Any] | None, owner: str
) -> ContextPolicy:
    """An env's ``context`` argument as a policy: a name is built with ``context_kwargs``; an
    instance is used as is, and ``context_kwargs`` beside it is an error naming ``owner``."""
    if isinstance(context, str):
        return get_context_policy(context, **(context_kwargs or {}))
    if context_kwargs:
        raise ValueError(f"{owner}: context_kwargs apply to a context policy given by name only")
    return context


def _rendered_prompt(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message], tools: Sequence[dict] | None
) -> tuple[int, ...]:
    return tuple(encode_text(tokenizer, render_messages(tokenizer, messages, tools=tools)))


@register_context_policy
class RerenderContext(ContextPolicy):
    """Apply the chat template to every message at every step (what most frameworks do).

    The model's response is re-tokenised from its text, so the prompt is an exact extension of the
    previous prompt+response only when decode→encode round-trips; prefer ``append`` for training.
    """

    name = "rerender"

    async def build(self, tokenizer: PreTrainedTokenizerBase, request: ContextRequest) -> ContextPrompt:
        ids = _rendered_prompt(tokenizer, request.messages, request.tools)
        return ContextPrompt(ids, request.messages, self._info())


@register_context_policy
class AppendContext(ContextPolicy):
    """Token-level append: next ids = previous prompt ids + response ids + ids of the template delta.

    The delta is derived from the chat template itself: render the conversation up to and including
    the response (no generation prompt) and with the new messages (with the generation prompt); the
    delta is the text between the end of the model's response and the end of the second rendering —
    for ChatML: the turn's closing ``<|im_end|>\\n`` (less the ``<|im_end|>`` the model generated), the
    new messages, and the next ``<|im_start|>assistant\\n``.

    The model's own ids are never re-tokenised, so each prompt is an exact extension of the previous
    prompt+response. It equals tokenising the whole rendering when the tokenizer encodes the
    response text to the same ids the model sampled (always true for canonical samples at special-token
    boundaries). Templates that rewrite earlier turns (e.g. ones that strip ``<think>`` reasoning from
    past assistant messages) cannot be extended: ``build`` raises ``ContextError`` naming where the
    renderings diverge; use ``rerender`` (or a context policy that rewrites history) for them.
    """

    name = "append"

    async def build(self, tokenizer: PreTrainedTokenizerBase, request: ContextRequest) -> ContextPrompt:
        previous = request.previous
        if previous is None:
            return ContextPrompt(
                _rendered_prompt(tokenizer, request.messages, request.tools), request.messages, self._info()
            )
        messages = list(request.messages)
        history = messages[: previous.num_messages]
        response = messages[previous.num_messages]
        if response.get("role") != "assistant":
            raise ContextError(
                f"append: message {previous.num_messages} should be the model's response (role "
                f"'assistant'), got role {response.get('role')!r}"
            )
        content = str(response.get("content") or "")
        prompt_text = render_messages(tokenizer, history, tools=request.tools)
        with_response = render_messages(
            tokenizer, messages[: previous.num_messages + 1], tools=request.tools, add_generation_prompt=False
        )
        full = render_messages(tokenizer, messages, tools=request.tools)
        if not with_response.startswith(prompt_text + content):
            raise ContextError(
                "append: the chat template does not render the response as an extension of the previous "
                f"prompt (it rewrites earlier text; divergence at character "
                f"{_divergence(with_response, prompt_text + content)}). Use context='rerender' for "
                "this template."
            )
        if not full.startswith(with_response):
            raise ContextError(
                "append: the chat template renders earlier messages differently once new messages are "
                f"added (divergence at character {_divergence(full, with_response)}), e.g. it strips "
                "reasoning from past turns. Use context='rerender' for this template."
            )
        closing = with_response[len(prompt_text) + len(content) :]
        generated_tail = tokenizer.decode(list(previous.response_ids), skip_special_tokens=False)
        generated_tail = generated_tail[len(content) :] if generated_tail.startswith(content) else ""
        if generated_tail and closing.startswith(generated_tail):
            closing = closing[len(generated_tail) :]
        delta_ids = encode_text(tokenizer, closing + full[len(with_response) :])
        ids = (*previous.prompt_ids, *previous.response_ids, *delta_ids)
        return ContextPrompt(ids, request.messages, self._info())


def _divergence(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


@register_context_policy
class SlidingWindowContext(ContextPolicy):
    """Keep the head (system + task) and the last ``k`` turns; older turns are dropped."""

    name = "sliding_window"

    def __init__(self, k: int = 4) -> None:
        if k < 1:
            raise ValueError(f"sliding_window: k must be >= 1, got {k}")
        self.k = k

    async def build(self, tokenizer: PreTrainedTokenizerBase, request: ContextRequest) -> ContextPrompt:
        head, summary, turns = split_turns(request.messages)
        kept = turns[-self.k :]
        messages = tuple(_join(head, summary, kept))
        ids = _rendered_prompt(tokenizer, messages, request.tools)
        return ContextPrompt(ids, messages, self._info(dropped_turns=len(turns) - len(kept)))


@register_context_policy
class TokenBudgetContext(ContextPolicy):
    """Drop the oldest turns until the rendered prompt has at most ``max_tokens`` tokens.

    The head and the newest turn are always kept; if they alone exceed the budget the prompt is
    returned over budget (the flow then truncates the episode or raises, by its config).
    """

    name = "token_budget"

    def __init__(self, max_tokens: int) -> None:
        if max_tokens < 1:
            raise ValueError(f"token_budget: max_tokens must be >= 1, got {max_tokens}")
        self.max_tokens = max_tokens

    async def build(self, tokenizer: PreTrainedTokenizerBase, request: ContextRequest) -> ContextPrompt:
        head, summary, turns = split_turns(request.messages)
        dropped = 0
        while True:
            messages = tuple(_join(head, summary, turns[dropped:]))
            ids = _rendered_prompt(tokenizer, messages, request.tools)
            if len(ids) <= self.max_tokens or dropped >= len(turns) - 1:
                return ContextPrompt(ids, messages, self._info(dropped_turns=dropped))
            dropped += 1


SUMMARY_INSTRUCTION = (
    "Summarise the conversation below for your own later use: keep every fact, number, tool result "
    "and open question that may matter for the task; drop pleasantries. Reply with the summary only."
)


@dataclass(frozen=True)
class SampledSummary:
    """A summary the policy sampled: the request it was shown and the completion it returned."""

    prompt_ids: tuple[int, ...]
    completion: Completion


Summarizer = Callable[[list[Message]], "str | SampledSummary | Awaitable[str | SampledSummary]"]

SUMMARY_STEP_KEY = "summary"
"""``Step.info`` key marking a summary step: ``{"turns": the turns the summary covers}``."""

_SUMMARY_SLOT = "\x00agent-r1 summary\x00"  # stands in for the sampled ids while the template renders


@register_context_policy
class SummarizeContext(ContextPolicy):
    """Once more than ``max_turns`` turns pile up, replace all but the last ``keep_last`` with a summary.

    The summary is one user message after the head (``prefix`` + the summary), marked with
    ``SUMMARY_KEY``. ``summarizer(messages)`` (sync or async) receives the messages to replace (a
    previous summary first, when there is one), so summaries roll forward. It is one of:

    - ``"policy"`` (the default): the acting policy writes the summary (``engine_summarizer`` over the
      engine the flow lends to the env, ``request.policy``; ``instruction`` is its request).
    - a callable returning a ``SampledSummary`` (``engine_summarizer``: a model's sampled ids).
    - a callable returning ``str`` (any other summariser): its text is rendered into the prompt and
      nothing is trained.

    With ``train_summaries`` (the default) a sampled summary is an action of the MDP: the call becomes
    a Step (prompt = the summarisation request, response = the sampled ids and their log-probs,
    reward 0, ``info[SUMMARY_STEP_KEY]``), returned in ``ContextPrompt.steps``, and the next prompt is
    spliced from token ids — the template's tokens before the summary, the sampled ids less the
    end-of-turn token they stopped on, the template's tokens after — so the model is trained on
    exactly the summary it later reads. With ``train_summaries=False`` the summary text (special
    tokens dropped, stripped) is rendered and re-tokenised, and the call is not trained.

    Between summaries the prompt is built by ``between``: ``"append"`` (default; token-level, so the
    sampled summary and responses stay exact and successive steps share one training sequence) or
    ``"rerender"`` (for templates that rewrite earlier turns, which ``append`` refuses).
    """

    name = "summarize"

    def __init__(
        self,
        summarizer: Summarizer | Literal["policy"] = "policy",
        *,
        keep_last: int = 2,
        max_turns: int = 4,
        prefix: str = "Summary of the earlier conversation:\n",
        train_summaries: bool = True,
        instruction: str | None = None,
        between: Literal["append", "rerender"] = "append",
    ) -> None:
        if summarizer != "policy" and not callable(summarizer):
            raise TypeError(
                f"summarize: summarizer must be callable or 'policy', got {type(summarizer).__name__}"
            )
        if instruction is not None and summarizer != "policy":
            raise ValueError("summarize: instruction applies to summarizer='policy' only")
        if not 1 <= keep_last <= max_turns:
            raise ValueError(f"summarize: need 1 <= keep_last <= max_turns, got {keep_last}, {max_turns}")
        if between not in ("append", "rerender"):
            raise ValueError(f"summarize: between must be 'append' or 'rerender', got {between!r}")
        self.summarizer = summarizer
        self.keep_last = keep_last
        self.max_turns = max_turns
        self.prefix = prefix
        self.train_summaries = train_summaries
        self.instruction = SUMMARY_INSTRUCTION if instruction is None else instruction
        self.between = get_context_policy(between)

    async def build(self, tokenizer: PreTrainedTokenizerBase, request: ContextRequest) -> ContextPrompt:
        head, summary, turns = split_turns(request.messages)
        if len(turns) <= self.max_turns:
            prompt = await self.between.build(tokenizer, request)
            return ContextPrompt(prompt.token_ids, prompt.messages, self._info())
        older, kept = turns[: -self.keep_last], turns[-self.keep_last :]
        to_summarise = [*([summary] if summary else []), *(m for turn in older for m in turn)]
        start = time.perf_counter()
        result = self._summarizer(tokenizer, request)([dict(m) for m in to_summarise])
        if inspect.isawaitable(result):
            result = await result
        generate_s = time.perf_counter() - start
        covered = len(older) + (summary[SUMMARY_KEY] if summary else 0)
        info = self._info(dropped_turns=len(older), summarised=True)
        if isinstance(result, SampledSummary) and self.train_summaries:
            ids, messages = self._splice(tokenizer, request, head, kept, covered, result.completion)
            step = _summary_step(tokenizer, result, covered, generate_s)
            return ContextPrompt(ids, messages, info, steps=(step,) if step.response_ids else ())
        if isinstance(result, SampledSummary):
            result = tokenizer.decode(list(result.completion.token_ids), skip_special_tokens=True).strip()
        if not isinstance(result, str):
            raise TypeError(
                f"summarize: the summarizer returned {type(result).__name__}, expected str or SampledSummary"
            )
        new_summary = {"role": "user", "content": self.prefix + result, SUMMARY_KEY: covered}
        messages = tuple(_join(head, new_summary, kept))
        return ContextPrompt(_rendered_prompt(tokenizer, messages, request.tools), messages, info)

    def _summarizer(self, tokenizer: PreTrainedTokenizerBase, request: ContextRequest) -> Summarizer:
        if self.summarizer != "policy":
            return self.summarizer
        if request.policy is None:
            raise ContextError(
                "summarize: summarizer='policy' asks the acting policy for the summary, but no policy "
                "was lent to the environment (AgentEnvLoop lends it through AgentEnv.lend_policy); "
                "outside a flow pass summarizer=engine_summarizer(engine, tokenizer, sampling_params)"
            )
        return _sampling_summarizer(request.policy.generate, tokenizer, self.instruction)

    def _splice(
        self,
        tokenizer: PreTrainedTokenizerBase,
        request: ContextRequest,
        head: list[Message],
        kept: list[list[Message]],
        covered: int,
        completion: Completion,
    ) -> tuple[tuple[int, ...], tuple[Message, ...]]:
        """The next prompt with the sampled summary ids spliced in, and the conversation carried on
        (whose summary text is those ids decoded, so later renderings read the same text)."""
        summary_ids = list(completion.token_ids)
        special = set(tokenizer.all_special_ids)
        while summary_ids and summary_ids[-1] in special:  # the stop token: the template closes the turn
            summary_ids.pop()
        slot = {"role": "user", "content": self.prefix + _SUMMARY_SLOT, SUMMARY_KEY: covered}
        rendered = render_messages(tokenizer, _join(head, slot, kept), tools=request.tools)
        if rendered.count(_SUMMARY_SLOT) != 1:
            raise ContextError(
                "summarize: the chat template does not render a message's content verbatim, so the "
                "sampled summary ids cannot be spliced into the prompt; use train_summaries=False"
            )
        before, after = rendered.split(_SUMMARY_SLOT)
        ids = (*encode_text(tokenizer, before), *summary_ids, *encode_text(tokenizer, after))
        text = tokenizer.decode(summary_ids, skip_special_tokens=False)
        new_summary = {"role": "user", "content": self.prefix + text, SUMMARY_KEY: covered}
        return ids, tuple(_join(head, new_summary, kept))


def _summary_step(
    tokenizer: PreTrainedTokenizerBase, summary: SampledSummary, covered: int, generate_s: float
) -> Step:
    completion = summary.completion
    return Step(
        prompt_ids=summary.prompt_ids,
        response_ids=completion.token_ids,
        logprobs=completion.logprobs,
        reward=0.0,
        stop_reason=completion.finish_reason,
        response_text=tokenizer.decode(list(completion.token_ids), skip_special_tokens=False),
        policy_version=completion.policy_version or 0,
        info={SUMMARY_STEP_KEY: {"turns": covered}},
        timings={"generate": generate_s},
        # trained summary steps, counted in steps_per_trajectory too (agent_r1.train.summary)
        metrics={"context/summary_steps_per_trajectory": 1.0},
    )


def engine_summarizer(
    engine: Any,
    tokenizer: PreTrainedTokenizerBase,
    sampling_params: Any,
    *,
    instruction: str = SUMMARY_INSTRUCTION,
) -> Summarizer:
    """A ``summarize`` summarizer that asks a model (e.g. the policy's own engine) for the summary.

    The messages to replace are written out as a ``role: content`` transcript after ``instruction``
    in one user message, rendered with the chat template; the summarizer returns that request's ids
    and the engine's completion (``SampledSummary``), which ``summarize`` trains on by default.
    """
    return _sampling_summarizer(
        lambda prompt_ids: engine.generate(list(prompt_ids), sampling_params), tokenizer, instruction
    )


def _sampling_summarizer(
    generate: Callable[[Sequence[int]], Awaitable[Completion]],
    tokenizer: PreTrainedTokenizerBase,
    instruction: str,
) -> Summarizer:
    async def summarize(messages: list[Message]) -> SampledSummary:
        transcript = "\n\n".join(f"{m['role']}: {m.get('content') or ''}" for m in messages)
        request = [{"role": "user", "content": f"{instruction}\n\n{transcript}"}]
        prompt_ids = tuple(encode_text(tokenizer, render_messages(tokenizer, request)))
        completion = await generate(prompt_ids)
        if completion.finish_reason is StopReason.ABORT:
            raise RuntimeError(f"summarize: the engine aborted the summary request: {completion.error}")
        return SampledSummary(prompt_ids, completion)

    return summarize
