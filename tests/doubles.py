"""Test doubles. Each is named as such and isolates one unit; none stands in for a real part elsewhere."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from agent_r1.types import Completion, SamplingParams, StopReason

Script = Sequence["str | Completion | Exception"] | Callable[[str], "str | Completion | Exception"]


class ScriptedEngine:
    """TEST DOUBLE for ``agent_r1.rollout.base.Engine``: no model; returns scripted responses.

    ``script`` is a list (one entry per ``generate`` call, in call order) or a function of the decoded
    prompt text. An entry is the response text (encoded with the tokenizer, then ``<|im_end|>`` appended
    unless ``append_eos=False``; cut to ``max_tokens`` with finish reason LENGTH), a ``Completion``
    returned as is, or an exception to raise. Log-probs are made up: ``-0.1 * (1 + i % 3)``.
    Every prompt and its params are recorded in ``calls``.
    """

    def __init__(self, tokenizer, script: Script, *, append_eos: bool = True) -> None:
        self.tokenizer = tokenizer
        self.script = script
        self.append_eos = append_eos
        self.calls: list[tuple[list[int], SamplingParams]] = []

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Completion:
        self.calls.append((list(prompt_ids), params))
        if callable(self.script):
            entry = self.script(self.tokenizer.decode(list(prompt_ids), skip_special_tokens=False))
        else:
            entry = self.script[len(self.calls) - 1]
        if isinstance(entry, Exception):
            raise entry
        if isinstance(entry, Completion):
            return entry
        ids = self.tokenizer.encode(entry, add_special_tokens=False)
        if self.append_eos:
            ids.append(self.tokenizer.eos_token_id)
        reason = StopReason.STOP
        if len(ids) > params.max_tokens:
            ids, reason = ids[: params.max_tokens], StopReason.LENGTH
        logprobs = [-0.1 * (1 + i % 3) for i in range(len(ids))]
        return Completion(ids, logprobs, reason)

    def update_weights(self, named_tensors, version=None) -> None:
        raise NotImplementedError("ScriptedEngine has no weights")
