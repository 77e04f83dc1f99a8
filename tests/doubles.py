"""Test doubles. Each is named as such and isolates one unit; none stands in for a real part elsewhere."""

from __future__ import annotations

import inspect
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


class ForwardPassEngine:
    """TEST DOUBLE for ``agent_r1.rollout.base.Engine`` over a real Hugging Face causal LM: one request
    at a time, one token per forward pass (with the model's KV cache), no batching — slow, but plainly
    correct. Log-probs are ``log_softmax(logits / temperature)`` of the sampled tokens, as the contract
    says. Stops on ``eos_token_id``, ``params.stop_token_ids`` or ``max_tokens``.
    """

    def __init__(self, model, eos_token_id: int) -> None:
        self.model = model.eval()
        self.eos_token_id = eos_token_id
        forward_parameters = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in forward_parameters else "past_key_values"

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Completion:
        import torch
        from transformers import DynamicCache

        if params.greedy:
            raise ValueError("ForwardPassEngine only samples: use temperature > 0")
        generator = torch.Generator().manual_seed(params.seed if params.seed is not None else len(prompt_ids))
        stops = {self.eos_token_id, *params.stop_token_ids}
        tokens, logprobs, reason = [], [], StopReason.LENGTH
        cache = {self._cache_kwarg: DynamicCache()}  # filled in place by each forward pass
        with torch.no_grad():
            logits_1TV = self.model(torch.tensor([list(prompt_ids)]), use_cache=True, **cache).logits
            for _ in range(params.max_tokens):
                logprobs_V = torch.log_softmax(logits_1TV[0, -1].float() / params.temperature, dim=-1)  # (V,)
                token = int(torch.multinomial(logprobs_V.exp(), 1, generator=generator))
                tokens.append(token)
                logprobs.append(float(logprobs_V[token]))
                if token in stops:
                    reason = StopReason.STOP
                    break
                logits_1TV = self.model(torch.tensor([[token]]), use_cache=True, **cache).logits
        return Completion(tokens, logprobs, reason)

    def update_weights(self, named_tensors, version=None) -> None:
        raise NotImplementedError("ForwardPassEngine serves a fixed model")
