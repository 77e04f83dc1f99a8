"""Training: config tree, step-level batching, learner, trainer, checkpoints (docs/training.md).

``from agent_r1.train import Trainer, load_config`` — the heavy modules load on first use, so that
importing the config alone stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "TrainConfig": "config",
    "ConfigError": "config",
    "load_config": "config",
    "config_from_dict": "config",
    "Trainer": "trainer",
    "train": "trainer",
    "evaluate": "evaluation",
    "Learner": "learner",
    "load_policy": "learner",
    "load_tasks": "data",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'agent_r1.train' has no attribute {name!r}")
    return getattr(importlib.import_module(f"agent_r1.train.{_EXPORTS[name]}"), name)
