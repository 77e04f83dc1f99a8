"""The rollout engine contract: token ids in, token ids and their log-probs out.

Every engine (HF in-process, vLLM in-process, any OpenAI-compatible server) implements ``Engine``.
Flows only ever call ``generate``; the trainer also calls ``update_weights`` (and ``sleep`` /
``wake`` where an engine can free its memory while the learner trains).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

import torch

from agent_r1.types import Completion, SamplingParams

__all__ = ["Engine", "NamedTensors"]

NamedTensors = Iterable[tuple[str, torch.Tensor]]
"""Weights as ``(hugging_face_parameter_name, tensor)`` pairs, e.g. ``model.named_parameters()``."""


@runtime_checkable
class Engine(Protocol):
    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Completion:
        """Sample one response to ``prompt_ids``.

        Returns the generated ids, the log-prob of each under ``softmax(logits / temperature)``
        (see ``agent_r1.types``) and why it stopped. A request that cannot be served (e.g. a prompt
        longer than the context) returns ``finish_reason=LENGTH`` or ``ABORT`` with ``error`` set;
        it never takes the engine down with it.
        """
        ...

    def update_weights(self, named_tensors: NamedTensors, version: int | None = None) -> None:
        """Load new policy weights (Hugging Face parameter names) without restarting the engine."""
        ...
