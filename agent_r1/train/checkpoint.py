"""Atomic checkpoints: everything a killed run needs to continue exactly where it stopped.

``RUN_DIR/checkpoints/step_000010/`` holds

- ``model/``: the policy in Hugging Face format (``save_pretrained``; with LoRA, the adapter only),
  loadable on its own with ``from_pretrained`` / ``PeftModel.from_pretrained``;
- ``learner.pt``: optimizer and learning-rate schedule state;
- ``trainer_state.pt``: the step counter and the Python / NumPy / torch RNG states (and, with a
  critic, its weights and learner state: ``with_critic`` / ``split_critic``, the one format of the
  local and the Ray learner);
- ``manifest.json``: ``{"files": {relative path: {"size": bytes, "sha256": hex}}}`` of every other file.

A checkpoint is written under ``.tmp-step_000010`` and renamed into place once complete, so a process
killed mid-write leaves either the previous checkpoint set or the new one, never a half-written
checkpoint that resume would load. The manifest is the last file written before the rename, so a
file truncated or changed later (a full disk, a bad copy, bit rot) is detected: ``load_checkpoint``
refuses such a checkpoint, and ``latest_checkpoint`` skips it (with a warning naming the file and what
is wrong) for the newest one that verifies, setting the bad one aside as ``corrupt-step_000010``.
A checkpoint written before manifests existed is accepted with a warning that it cannot be verified.
Only the last ``keep`` checkpoints are kept. A write that fails (a full disk, an unwritable run
directory) removes its temporary folder and raises one ``CheckpointWriteError`` saying where and why;
the checkpoints already there are untouched, so ``--resume`` continues from the previous one.

A test kills a process mid-write through ``agent_r1.train.fault_injection.mid_checkpoint_write``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from agent_r1.models.loading import save_model
from agent_r1.train import fault_injection

__all__ = [
    "CheckpointError",
    "CheckpointWriteError",
    "checkpoint_problem",
    "keep_best",
    "latest_checkpoint",
    "load_checkpoint",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
    "split_critic",
    "with_critic",
]

logger = logging.getLogger(__name__)

PREFIX = "step_"
TMP_PREFIX = ".tmp-"
CORRUPT_PREFIX = "corrupt-"
MANIFEST = "manifest.json"
BEST = "best"
"""``checkpoints/best``: the checkpoint of the best evaluation (``keep_best``)."""


class CheckpointError(ValueError):
    """A checkpoint that fails verification, naming the folder, the file and what is wrong."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint that could not be written (a full disk, an unwritable run directory): the partial
    write is removed, the previous checkpoints are left as they were."""


def rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def with_critic(trainer_state: dict, weights: dict, learner_state: dict) -> dict:
    """``trainer_state`` with the critic's ``weights`` (a state dict) and ``learner_state`` (optimizer,
    schedule) riding in it: the policy fills ``model/`` and ``learner.pt``, the critic rides here."""
    return {**trainer_state, "critic": {"model": weights, "learner": learner_state}}


def split_critic(trainer_state: dict) -> tuple[dict, tuple[dict, dict] | None]:
    """(``trainer_state`` without the critic's, the critic's (weights, learner state) as
    ``with_critic`` stored them, or None when the run had no critic)."""
    rest = dict(trainer_state)
    critic = rest.pop("critic", None)
    return rest, None if critic is None else (critic["model"], critic["learner"])


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
    own_models: Mapping[str, Any] | None = None,
) -> Path:
    """Write checkpoint ``step`` atomically under ``directory``; prune to the last ``keep``.
    ``own_models``: the trained policies with a model of their own (``PolicyLearners.own_models``),
    each one's adapter saved beside the shared base's, in ``model/<name>/``."""
    directory = Path(directory)
    final = directory / f"{PREFIX}{step:06d}"
    tmp = directory / f"{TMP_PREFIX}{final.name}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        save_model(model, tokenizer, tmp / "model")
        for name, own in (own_models or {}).items():
            save_model(own, None, tmp / "own")  # peft writes adapter <name> to own/<name>/
            os.replace(tmp / "own" / name, tmp / "model" / name)
            shutil.rmtree(tmp / "own")
        fault_injection.mid_checkpoint_write(step)  # a test may kill the process here
        torch.save(learner_state, tmp / "learner.pt")
        torch.save({**trainer_state, "step": step}, tmp / "trainer_state.pt")
        (tmp / "info.json").write_text(json.dumps({"step": step, "lora": _is_peft(model)}))
        _write_manifest(tmp)
    except Exception as error:  # OSError, or torch's / safetensors' own wrappers of one
        shutil.rmtree(tmp, ignore_errors=True)  # frees what the partial write took
        raise _write_error(directory, step, error) from error
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in sorted(p for p in directory.glob(f"{PREFIX}*") if p.is_dir())[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def keep_best(checkpoint: str | Path) -> Path:
    """Checkpoint folder ``checkpoint`` (a ``step_N`` just written) kept as ``best`` beside it: its
    files hard-linked (copied where the file system cannot link; checkpoint files are never written
    twice, so the two names cannot diverge), assembled under a temporary name and renamed into place,
    so that a kill leaves the previous best or the new one. Pruning ``step_N`` later leaves ``best``
    whole."""
    checkpoint = Path(checkpoint)
    best = checkpoint.parent / BEST
    tmp, old = (checkpoint.parent / f"{TMP_PREFIX}{name}" for name in (BEST, f"old-{BEST}"))
    for leftover in (tmp, old):
        shutil.rmtree(leftover, ignore_errors=True)
    shutil.copytree(checkpoint, tmp, copy_function=_link_or_copy)
    if best.exists():
        os.replace(best, old)
    os.replace(tmp, best)
    shutil.rmtree(old, ignore_errors=True)
    return best


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def _write_error(directory: Path, step: int, error: BaseException) -> CheckpointWriteError:
    """One message for a checkpoint that could not be written: where, why, and what is still there."""
    cause = str(error) or type(error).__name__
    try:
        free = (
            f"; {shutil.disk_usage(directory if directory.exists() else directory.parent).free:,} bytes free"
        )
    except OSError:
        free = ""
    kept = sorted(p.name for p in directory.glob(f"{PREFIX}*") if p.is_dir()) if directory.is_dir() else []
    previous = f"the previous checkpoint {kept[-1]} is intact" if kept else "no earlier checkpoint exists"
    return CheckpointWriteError(
        f"cannot write checkpoint {PREFIX}{step:06d} under {directory} ({type(error).__name__}: {cause}"
        f"{free}); the partial write was removed and {previous}. Free space or fix the directory's "
        "permissions, then continue with --resume."
    )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_manifest(folder: Path) -> None:
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    entries = {
        p.relative_to(folder).as_posix(): {"size": p.stat().st_size, "sha256": _sha256(p)} for p in files
    }
    (folder / MANIFEST).write_text(json.dumps({"files": entries}, indent=1))


def checkpoint_problem(path: str | Path) -> str | None:
    """What is wrong with checkpoint folder ``path`` (a missing, truncated or changed file, an
    unreadable manifest), or None when every file matches its manifest entry. A folder without a
    manifest (written by an older agent-r1) is accepted with a warning when its files are present."""
    path = Path(path)
    manifest = path / MANIFEST
    if not manifest.is_file():
        if not (path / "trainer_state.pt").is_file():
            return f"no {MANIFEST} and no trainer_state.pt: not a complete checkpoint"
        logger.warning("%s has no %s (written by an older agent-r1): loading it unverified", path, MANIFEST)
        return None
    try:
        entries = json.loads(manifest.read_text(encoding="utf-8"))["files"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as error:
        return f"{MANIFEST} is unreadable ({type(error).__name__}: {error})"
    for name, entry in entries.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        size = file.stat().st_size
        if size != entry["size"]:
            return f"{name} has {size} bytes, the manifest says {entry['size']} (truncated or overwritten)"
        if _sha256(file) != entry["sha256"]:
            return f"{name} does not match its sha256 in the manifest (its bytes changed)"
    return None


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The newest checkpoint under ``directory`` that verifies (``checkpoint_problem``).

    Temporary leftovers of a killed write are removed. A newer checkpoint that fails verification is
    logged as a warning (which file, what is wrong) and renamed to ``corrupt-step_N``, so that pruning
    and later resumes skip it and it stays on disk for inspection.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return None
    for leftover in directory.glob(f"{TMP_PREFIX}*"):
        shutil.rmtree(leftover, ignore_errors=True)
    for candidate in sorted((p for p in directory.glob(f"{PREFIX}*") if p.is_dir()), reverse=True):
        problem = checkpoint_problem(candidate)
        if problem is None:
            return candidate
        aside = candidate.with_name(CORRUPT_PREFIX + candidate.name)
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(candidate, aside)
        logger.warning(
            "checkpoint %s is corrupt: %s; moved it to %s and falling back to the previous checkpoint",
            candidate,
            problem,
            aside.name,
        )
    return None


def _load_adapter(path: Path, model, adapter: str) -> None:
    """Adapter ``adapter`` of peft ``model`` from checkpoint ``path`` (``model/`` for "default",
    else ``model/<adapter>/``)."""
    from peft import set_peft_model_state_dict

    folder = path / "model" if adapter == "default" else path / "model" / adapter
    result = set_peft_model_state_dict(model, _read_safetensors(folder), adapter_name=adapter)
    unexpected = getattr(result, "unexpected_keys", [])
    if unexpected:
        raise ValueError(
            f"{path}: weights of adapter {adapter!r} do not match the model: unexpected {unexpected[:5]}"
        )


def _read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {folder}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    return state


def load_checkpoint(
    path: str | Path, model, *, verify: bool = True, own_models: Mapping[str, Any] | None = None
) -> tuple[dict, dict]:
    """Load the weights of checkpoint ``path`` into ``model`` (and each of ``own_models``, the
    policies with a model of their own: its adapter from ``model/<name>/``); return (learner_state,
    trainer_state).

    ``verify`` checks every file against the manifest first (``CheckpointError`` if one does not
    match); ``verify=False`` is for a checkpoint that ``latest_checkpoint`` has just verified.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such checkpoint folder")
    problem = checkpoint_problem(path) if verify else None
    if problem is not None:
        raise CheckpointError(f"checkpoint {path} is corrupt: {problem}")
    if _is_peft(model):
        # peft saves adapter "default" in the folder, any other beside it in a subfolder of its name
        # (several policies: agent_r1.train.policies)
        for adapter in model.peft_config:
            _load_adapter(path, model, adapter)
        for name, own in (own_models or {}).items():
            _load_adapter(path, own, name)
    else:
        weights = _read_safetensors(path / "model")
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
