"""Rollout engines: prompt token ids in, generated token ids and their log-probs out.

- ``HFEngine`` (``rollout/hf.py``): any Hugging Face causal LM in this process, continuous batching.
- ``VLLMEngine`` (``rollout/vllm_engine.py``): vLLM in this process (needs the ``vllm`` package).
- ``OpenAIEngine`` (``rollout/openai_client.py``): any OpenAI-compatible server (``agent-r1 serve``,
  ``vllm serve``, SGLang).
- ``RoleRouter`` (``rollout/router.py``): each request to the engine of its role (a frozen policy on a
  server beside the local engine).

The engines are imported lazily, so that importing this package loads neither transformers nor vLLM.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from agent_r1.rollout.base import Engine, LoraWeights, NamedTensors

if TYPE_CHECKING:
    from agent_r1.rollout.hf import HFEngine
    from agent_r1.rollout.openai_client import OpenAIEngine
    from agent_r1.rollout.router import RoleRouter
    from agent_r1.rollout.vllm_engine import VLLMEngine

__all__ = ["Engine", "HFEngine", "LoraWeights", "NamedTensors", "OpenAIEngine", "RoleRouter", "VLLMEngine"]

_LAZY = {
    "HFEngine": "agent_r1.rollout.hf",
    "OpenAIEngine": "agent_r1.rollout.openai_client",
    "RoleRouter": "agent_r1.rollout.router",
    "VLLMEngine": "agent_r1.rollout.vllm_engine",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'agent_r1.rollout' has no attribute {name!r}")
