"""Tiny stand-ins for real models: the same architecture family and chat-template family, random
weights, a byte-level tokenizer, built locally (nothing downloaded).

A recipe's smoke run (``agent-r1 train RECIPE --smoke``, ``agent_r1.train.smoke``) trains one in place
of ``Qwen/Qwen2.5-3B-Instruct`` or ``Qwen/Qwen3-4B-Instruct-2507``: the config, the data, the env, the
tool-call format and the reward path are the recipe's own; only the weights and the tokenizer's
vocabulary are small.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from agent_r1.models.chat_templates import QWEN3_CHATML_TOOLS, QWEN25_CHATML_TOOLS
from agent_r1.models.tiny import build_tiny_tokenizer, save_tiny_checkpoint

__all__ = ["FAMILIES", "Family", "family_of", "save_stand_in"]


@dataclass(frozen=True)
class Family:
    """An architecture (``agent_r1.models.tiny.ARCHITECTURES``) and the chat template of its models."""

    architecture: str
    chat_template: str
    extra_special_tokens: tuple[str, ...] = ()


FAMILIES = {
    # Qwen2 and Qwen2.5 share the architecture (model_type "qwen2") and the ChatML-with-tools template.
    "qwen2": Family("qwen2", QWEN25_CHATML_TOOLS),
    "qwen3": Family("qwen3", QWEN3_CHATML_TOOLS, ("<think>", "</think>")),
}


def family_of(model_path: str, key: str = "model.path") -> str:
    """The family of a model: a local folder's ``config.json`` ``model_type``, else read from a hub
    name (``Qwen/Qwen3-4B-Instruct-2507`` -> ``qwen3``, ``Qwen/Qwen2.5-3B-Instruct`` -> ``qwen2``)."""
    config_file = Path(model_path) / "config.json"
    if config_file.is_file():
        family = json.loads(config_file.read_text()).get("model_type")
    else:
        name = model_path.rstrip("/").rsplit("/", 1)[-1].lower()
        family = next((f for f in sorted(FAMILIES, reverse=True) if name.startswith(f)), None)
    if family not in FAMILIES:
        raise ValueError(
            f"{key} = {model_path!r}: no tiny stand-in for this model (known families: "
            f"{', '.join(FAMILIES)}; a local folder's config.json model_type, or a hub name starting "
            "with the family, e.g. Qwen2.5-3B-Instruct)"
        )
    return family


def save_stand_in(
    family: str, path: str | Path, *, max_position_embeddings: int = 8192, seed: int = 0
) -> Path:
    """The tiny stand-in of ``family`` saved to ``path`` (a Hugging Face folder)."""
    spec = FAMILIES[family]
    tokenizer = build_tiny_tokenizer(spec.chat_template, spec.extra_special_tokens)
    return save_tiny_checkpoint(
        path,
        seed=seed,
        tokenizer=tokenizer,
        architecture=spec.architecture,
        max_position_embeddings=max_position_embeddings,
    )
