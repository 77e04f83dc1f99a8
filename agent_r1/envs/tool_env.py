"""ToolEnv: a chat environment in which the model calls tools until it gives a final answer.

One step = one model response (Agent-R1, arXiv 2511.14460: the action is the whole response):

1. The response is parsed in the named tool-call format (``hermes`` by default).
2. Calls or malformed calls (parse errors): the calls run concurrently (``ToolSet.execute``, outputs cut
   to ``max_tool_output_chars``); results and errors go back to the model as chat messages; the
   context policy builds the next prompt (a policy that asks the model for a summary returns that
   call, which becomes a step of its own: ``StepResult.policy_steps``). By default a malformed
   call is never taken as the final answer (``malformed_calls`` below changes that).
   A response cut by ``max_tokens`` inside a call gets an extra error saying so. The model reads at
   most ``max_errors_shown`` parse errors per response, then one line saying how many more there were:
   a policy that falls into repeating ``<tool_call>`` thirty times would otherwise get thirty error
   messages back, and every later prompt of the episode would carry them (``info`` keeps them all).
   A near miss — no call in the format's syntax, but plainly one in a spelling it does not accept
   (``<TOOL_CALL>``, the call JSON in a code fence, ``action:`` in lower case; see the format's
   ``near_miss``) — is, with ``near_miss="hint"`` (the default), one error that shows the correct form.
   With ``near_miss="strict"`` it is the final answer, as the format's rules alone say. With
   ``malformed_calls="answer"`` a response with any malformed call is the final answer too (none of
   its calls run), as in TRL's tool loop, whose parser falls back to plain text: the episode ends,
   scored like any answer, instead of the model being told and going on.
3. No tool activity: the response is the final answer. ``extract_answer(text)`` pulls the answer
   out (default: the whole text, stripped), ``outcome_reward(answer, task)`` scores it, and the
   episode terminates with ``StepResult.outcome_reward`` set. An answer of None scores 0.
4. After ``max_turns`` responses without a final answer the episode is truncated.

The conversation keeps each response's raw text as the assistant message's ``content`` (no
``tool_calls`` field), so re-rendering reproduces exactly what the model wrote. Observations are
token ids built by the context policy (``append`` by default, see ``agent_r1.envs.context``).

``Step.info`` keys: ``turn``; ``tool_counts`` on every step (``{"calls", "parse_errors", "tool_errors",
"near_misses"}``: well-formed calls, malformed calls, calls whose result is an error, and 1 when the
response is a near miss — in either mode — else 0; each is also the step's metric
``tools/<count>_per_step``, ``StepResult.metrics``, which the trainer averages over the steps);
``near_miss`` (the message) when there is one; ``tool_calls`` ([{"name", "arguments"}]),
``tool_results`` ([str], what the model reads, per call), ``tool_errors`` ([str]: malformed calls or the
near-miss message, then the contents of calls that failed); ``context`` (the policy's report); on the
final answer ``answer`` and ``success`` (``outcome_reward >= success_threshold``); ``truncated`` (and
``success`` False) when ``max_turns`` ends the episode. A summary step (``summarize`` with a sampled
summary) carries ``summary`` only (``agent_r1.envs.context.SUMMARY_STEP_KEY``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

from transformers import PreTrainedTokenizerBase

from agent_r1.envs.base import AgentEnv
from agent_r1.envs.context import (
    ContextPolicy,
    ContextRequest,
    PreviousTurn,
    resolve_context_policy,
    task_messages,
)
from agent_r1.models.loading import require_chat_template
from agent_r1.tools import ParsedResponse, Tool, ToolCallFormat, ToolResult, ToolSet, get_format
from agent_r1.types import Action, Message, Observation, StepResult, StopReason, Task

__all__ = ["NEAR_MISS_MODES", "TOOL_COUNTS", "ToolEnv", "exact_match"]

OutcomeReward = Callable[[str, Task], float]
StepReward = Callable[[ParsedResponse, Sequence[ToolResult], Task], float]

CUT_OFF_ERROR = "the response was cut off at the token limit before the tool call was complete"
NEAR_MISS_MODES = ("hint", "strict")
MALFORMED_CALL_MODES = ("error", "answer")
TOOL_COUNTS = ("calls", "parse_errors", "tool_errors", "near_misses")
"""The keys of ``Step.info["tool_counts"]``."""


def exact_match(answer: str, task: Task) -> float:
    """1.0 when the answer equals ``str(task["answer"])`` (both stripped), else 0.0."""
    if "answer" not in task:
        raise ValueError(f"exact_match needs task['answer']; the task has fields {sorted(task)}")
    return float(answer.strip() == str(task["answer"]).strip())


class ToolEnv(AgentEnv):
    """A tool-using chat episode; see the module docstring for the step semantics.

    Args:
        tokenizer: the policy's tokenizer; it must have a chat template.
        tools: ``Tool`` objects (from ``@tool``) or a ``ToolSet``.
        format: the tool-call format's name (``agent_r1.tools.FORMATS``) or an instance.
        context: the context policy's name (``agent_r1.envs.context.CONTEXT_POLICIES``) or an instance;
            ``context_kwargs`` are passed to a named policy (e.g. ``{"k": 4}`` for ``sliding_window``).
        outcome_reward: ``(answer, task) -> float``, the final reward (default ``exact_match``).
        extract_answer: ``(response_text) -> str | None`` (default: the text, stripped).
        step_reward: optional ``(parsed_response, tool_results, task) -> float``, the immediate reward
            of every step (the final one included, with no results).
        max_turns: responses per episode before it is truncated.
        max_tool_output_chars: each tool output is cut to this many characters (None: no limit).
        system_prompt: a system message to open the conversation with, unless the task brings one.
        prompt_key: the task field holding the prompt (a string or a list of chat messages).
        success_threshold: ``info["success"]`` is ``outcome_reward >= success_threshold``.
        near_miss: ``"hint"`` (default): a response that is plainly a call in a spelling the format does
            not accept gets an error observation showing the correct form, so a model learning the
            format is told; ``"strict"``: it is the final answer (the format's rules alone). Counted
            in ``info["tool_counts"]`` in both modes.
        max_errors_shown: parse errors the model reads per response (>= 1); the rest are one message
            that says how many were not shown. ``None``: every error.
        malformed_calls: ``"error"`` (default): each malformed call is an error observation and the
            episode goes on; ``"answer"``: a response with one is the final answer, its well-formed
            calls not run (TRL's tool loop; ``info["tool_counts"]["calls"]`` then counts 0 for it).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        tools: Iterable[Tool] | ToolSet = (),
        *,
        format: str | ToolCallFormat = "hermes",
        context: str | ContextPolicy = "append",
        context_kwargs: dict[str, Any] | None = None,
        outcome_reward: OutcomeReward = exact_match,
        extract_answer: Callable[[str], str | None] | None = None,
        step_reward: StepReward | None = None,
        max_turns: int = 8,
        max_tool_output_chars: int | None = 4096,
        system_prompt: str | None = None,
        prompt_key: str = "prompt",
        success_threshold: float = 1.0,
        near_miss: Literal["hint", "strict"] = "hint",
        max_errors_shown: int | None = 1,
        malformed_calls: Literal["error", "answer"] = "error",
    ) -> None:
        require_chat_template(tokenizer)
        if max_turns < 1:
            raise ValueError(f"ToolEnv: max_turns must be >= 1, got {max_turns}")
        if near_miss not in NEAR_MISS_MODES:
            raise ValueError(f"ToolEnv: near_miss must be one of {NEAR_MISS_MODES}, got {near_miss!r}")
        if max_errors_shown is not None and (isinstance(max_errors_shown, bool) or max_errors_shown < 1):
            raise ValueError(f"ToolEnv: max_errors_shown must be >= 1 or None, got {max_errors_shown!r}")
        if malformed_calls not in MALFORMED_CALL_MODES:
            raise ValueError(
                f"ToolEnv: malformed_calls must be one of {MALFORMED_CALL_MODES}, got {malformed_calls!r}"
            )
        self.tokenizer = tokenizer
        self.tools = tools if isinstance(tools, ToolSet) else ToolSet(tools)
        self.format = get_format(format) if isinstance(format, str) else format
        self.context = resolve_context_policy(context, context_kwargs, "ToolEnv")
        self.outcome_reward = outcome_reward
        self.extract_answer = extract_answer or str.strip
        self.step_reward = step_reward
        self.max_turns = max_turns
        self.max_tool_output_chars = max_tool_output_chars
        self.system_prompt = system_prompt
        self.prompt_key = prompt_key
        self.success_threshold = success_threshold
        self.near_miss = near_miss
        self.max_errors_shown = max_errors_shown
        self.malformed_calls = malformed_calls
        self._task: Task | None = None
        self._messages: tuple[Message, ...] = ()
        self._prompt_ids: tuple[int, ...] = ()
        self._turn = 0

    @property
    def messages(self) -> tuple[Message, ...]:
        """The conversation as the context policy carries it (older turns may be dropped/summarised)."""
        return self._messages

    def _tool_schemas(self) -> tuple[dict, ...] | None:
        """Schemas for the chat template, unless the format writes its own system-prompt text."""
        schemas = self.tools.schemas()
        if not schemas or self.format.system_prompt(schemas) is not None:
            return None
        return tuple(schemas)

    def _opening_messages(self, task: Task) -> list[Message]:
        messages = task_messages(task, self.prompt_key)
        if self.system_prompt is not None and messages[0].get("role") != "system":
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        format_text = self.format.system_prompt(self.tools.schemas()) if len(self.tools) else None
        if format_text:
            if messages[0].get("role") == "system":
                messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{format_text}"}
            else:
                messages.insert(0, {"role": "system", "content": format_text})
        return messages

    async def reset(self, task: Task) -> Observation:
        self._task = task
        self._turn = 0
        request = ContextRequest(
            tuple(self._opening_messages(task)), self._tool_schemas(), policy=self.policy
        )
        # A summary made here (a task that opens with more than max_turns turns) precedes every action:
        # it is part of the initial state, so its call (prompt.steps) is not a step of the trajectory.
        prompt = await self.context.build(self.tokenizer, request)
        self._messages, self._prompt_ids = prompt.messages, prompt.token_ids
        return Observation(token_ids=prompt.token_ids)

    def _content(self, action: Action) -> str:
        """The response text without the end-of-turn token the model generated (the template adds it)."""
        eos = self.tokenizer.eos_token
        if eos and action.text.endswith(eos):
            return action.text[: -len(eos)]
        return action.text

    async def step(self, action: Action) -> StepResult:
        if self._task is None:
            raise RuntimeError("ToolEnv.step called before reset(task)")
        task = self._task
        self._turn += 1
        content = self._content(action)
        parsed = self.format.parse(content)
        malformed = len(parsed.errors)
        near_miss = self.format.near_miss(content) if parsed.is_final else None
        if near_miss is not None and self.near_miss == "hint":
            parsed = ParsedResponse(parsed.content, (), (near_miss,))
        if parsed.errors and self.malformed_calls == "answer":
            parsed = ParsedResponse(parsed.content)
        info: dict[str, Any] = {
            "turn": self._turn,
            "tool_counts": {
                "calls": len(parsed.calls),
                "parse_errors": malformed,
                "tool_errors": 0,
                "near_misses": int(near_miss is not None),
            },
        }
        if near_miss is not None:
            info["near_miss"] = near_miss
        assistant = {"role": "assistant", "content": content}

        if parsed.is_final:
            answer = self.extract_answer(content)
            outcome = 0.0 if answer is None else float(self.outcome_reward(answer, task))
            info.update(answer=answer, success=outcome >= self.success_threshold, **_expected(task))
            self._messages = (*self._messages, assistant)
            return StepResult(
                observation=None,
                reward=self._step_reward(parsed, [], task),
                terminated=True,
                info=info,
                outcome_reward=outcome,
                metrics=_count_metrics(info),
            )

        errors = list(parsed.errors)
        cut_off = [CUT_OFF_ERROR] if action.finish_reason is StopReason.LENGTH and parsed.errors else []
        results = await self.tools.execute(parsed.calls, self.max_tool_output_chars)
        info["tool_counts"]["tool_errors"] = sum(r.is_error for r in results)
        info.update(
            tool_calls=[{"name": c.name, "arguments": c.arguments} for c in parsed.calls],
            tool_results=[r.content for r in results],
            tool_errors=errors + cut_off + [r.content for r in results if r.is_error],
        )
        reward = self._step_reward(parsed, results, task)
        if self._turn >= self.max_turns:
            info.update(truncated=f"max_turns={self.max_turns} reached", success=False, **_expected(task))
            return StepResult(
                observation=None, reward=reward, truncated=True, info=info, metrics=_count_metrics(info)
            )

        previous = PreviousTurn(self._prompt_ids, action.token_ids, num_messages=len(self._messages))
        observation_messages = self.format.observation_messages(results, self._shown(errors) + cut_off)
        request = ContextRequest(
            (*self._messages, assistant, *observation_messages), self._tool_schemas(), previous, self.policy
        )
        prompt = await self.context.build(self.tokenizer, request)
        self._messages, self._prompt_ids = prompt.messages, prompt.token_ids
        info["context"] = prompt.info
        return StepResult(
            observation=Observation(token_ids=prompt.token_ids),
            reward=reward,
            info=info,
            policy_steps=prompt.steps,
            metrics=_count_metrics(info),
        )

    def _shown(self, errors: list[str]) -> list[str]:
        """The parse errors the model reads: the first ``max_errors_shown``, then how many were left out."""
        limit = self.max_errors_shown
        if limit is None or len(errors) <= limit:
            return errors
        hidden = len(errors) - limit
        return [*errors[:limit], f"{hidden} more error{'s' if hidden > 1 else ''} in this response not shown"]

    def _step_reward(self, parsed: ParsedResponse, results: Sequence[ToolResult], task: Task) -> float:
        return 0.0 if self.step_reward is None else float(self.step_reward(parsed, results, task))


def _expected(task: Task) -> dict[str, str]:
    """``{"expected": the task's answer}`` for the report's outcome line, when the task has one."""
    return {"expected": str(task["answer"])} if isinstance(task, dict) and "answer" in task else {}


def _count_metrics(info: dict[str, Any]) -> dict[str, float]:
    """``info["tool_counts"]`` as the step's metrics, ``tools/<count>_per_step``."""
    return {f"tools/{key}_per_step": float(value) for key, value in info["tool_counts"].items()}
