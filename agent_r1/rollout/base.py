"""The rollout engine contract: token ids in, token ids and their log-probs out.

Every engine (HF in-process, vLLM in-process, any OpenAI-compatible server) implements ``Engine``.
Flows only ever call ``generate``; the trainer also calls ``update_weights``.

Optional hooks (not part of the protocol; callers check ``hasattr``): ``sleep()`` frees the engine's
accelerator memory while the learner trains and ``wake()`` restores it before the next rollout.
``VLLMEngine`` has them (vLLM sleep mode, GPU only); ``HFEngine`` and ``OpenAIEngine`` do not.

Log-probs, in every engine: ``log softmax(logits / temperature)`` of each sampled token over the full
vocabulary, temperature applied, top-k / top-p truncation not renormalised (greedy: the raw
log-softmax); see ``agent_r1.types`` and, for vLLM's deviation under truncation, ``vllm_engine``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from agent_r1.types import Completion, SamplingParams

__all__ = ["Engine", "LoraWeights", "NamedTensors"]

NamedTensors = Iterable[tuple[str, torch.Tensor]]
"""Weights as ``(hugging_face_parameter_name, tensor)`` pairs, e.g. ``model.named_parameters()``."""


@dataclass(frozen=True)
class LoraWeights:
    """One LoRA adapter in memory, as peft saves it to a folder (``save_pretrained``): ``config`` is
    its ``adapter_config.json`` (``LoraConfig.to_dict()``, sets as lists), ``tensors`` its
    ``adapter_model.safetensors`` (``get_peft_model_state_dict``: ``...q_proj.lora_A.weight``, no
    adapter name). Picklable, so it can travel to an engine in another process."""

    config: Mapping[str, Any]
    tensors: Mapping[str, torch.Tensor]


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
