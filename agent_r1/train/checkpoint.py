"""Atomic checkpoints: everything a killed run needs to continue exactly where it stopped.

``RUN_DIR/checkpoints/step_000010/`` holds

- ``model/``: the policy in Hugging Face format (``save_pretrained``; with LoRA, the adapter only),
  loadable on its own with ``from_pretrained`` / ``PeftModel.from_pretrained``;
- ``learner.pt``: optimizer and learning-rate schedule state;
- ``trainer_state.pt``: the step counter and the Python / NumPy / torch RNG states.

A checkpoint is written under ``.tmp-step_000010`` and renamed into place once complete, so a process
killed mid-write leaves either the previous checkpoint set or the new one, never a half-written
checkpoint that resume would load. Only the last ``keep`` checkpoints are kept.

``AGENT_R1_CHECKPOINT_WRITE_DELAY="STEP:SECONDS"`` (for tests only) sleeps halfway through the write of
checkpoint STEP so that a test can kill the process while that checkpoint is being written.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["latest_checkpoint", "load_checkpoint", "rng_state", "save_checkpoint", "set_rng_state"]

PREFIX = "step_"
TMP_PREFIX = ".tmp-"
WRITE_DELAY_ENV = "AGENT_R1_CHECKPOINT_WRITE_DELAY"


def rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def _is_peft(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def save_checkpoint(
    directory: str | Path,
    step: int,
    model,
    learner_state: dict,
    trainer_state: dict,
    *,
    keep: int,
    tokenizer=None,
) -> Path:
    """Write checkpoint ``step`` atomically under ``directory``; prune to the last ``keep``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"{PREFIX}{step:06d}"
    tmp = directory / f"{TMP_PREFIX}{final.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    model.save_pretrained(tmp / "model")
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp / "model")
    delay_step, _, delay_s = os.environ.get(WRITE_DELAY_ENV, "").partition(":")
    if delay_step and int(delay_step) == step:
        time.sleep(float(delay_s))
    torch.save(learner_state, tmp / "learner.pt")
    torch.save({**trainer_state, "step": step}, tmp / "trainer_state.pt")
    (tmp / "info.json").write_text(json.dumps({"step": step, "lora": _is_peft(model)}))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in sorted(p for p in directory.glob(f"{PREFIX}*") if p.is_dir())[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The newest complete checkpoint under ``directory`` (temporary leftovers are removed)."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    for leftover in directory.glob(f"{TMP_PREFIX}*"):
        shutil.rmtree(leftover, ignore_errors=True)
    complete = sorted(p for p in directory.glob(f"{PREFIX}*") if (p / "trainer_state.pt").is_file())
    return complete[-1] if complete else None


def _read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {folder}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    return state


def load_checkpoint(path: str | Path, model) -> tuple[dict, dict]:
    """Load the weights of checkpoint ``path`` into ``model``; return (learner_state, trainer_state)."""
    path = Path(path)
    weights = _read_safetensors(path / "model")
    if _is_peft(model):
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(model, weights)
        unexpected = getattr(result, "unexpected_keys", [])
        if unexpected:
            raise ValueError(f"{path}: adapter weights do not match the model: unexpected {unexpected[:5]}")
    else:
        missing, unexpected = model.load_state_dict(weights, strict=False)
        tied = set(getattr(model, "_tied_weights_keys", None) or ())
        if getattr(model.config, "tie_word_embeddings", False):
            tied |= {"lm_head.weight"}
        missing = [k for k in missing if k not in tied]
        if missing or unexpected:
            raise ValueError(
                f"{path}: weights do not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
            )
    learner_state = torch.load(path / "learner.pt", weights_only=False)
    trainer_state = torch.load(path / "trainer_state.pt", weights_only=False)
    return learner_state, trainer_state
