"""What ``--resume`` continues from, and the checks that keep it from silently doing something else.

``Trainer(config, resume=...)`` (and ``agent-r1 train --resume`` / ``--resume-or-start``) calls
``resume_checkpoint`` before it loads anything:

- ``resume=True`` (``--resume``) needs a checkpoint: with none under ``RUN_DIR/checkpoints`` it is a
  ``ResumeError`` saying where it looked, not a silent fresh start. ``resume="auto"``
  (``--resume-or-start``) starts fresh when there is none.
- The resolved config is compared with ``RUN_DIR/config.yaml`` (the config the run was last started
  with). A difference in a key that can change what is trained (the advantage estimator, the learning
  rate, tasks per step, ...) is a ``ResumeError`` listing each key, old → new, unless
  ``allow_config_change`` (``--allow-config-change``); then the old file is kept as
  ``config.prev-N.yaml`` before the run directory writes the new one. Keys in ``NEUTRAL_KEYS`` cannot
  change the trained result and may differ freely; ``trainer.steps`` may too while the learning-rate
  schedule is constant (a cosine schedule decays over ``trainer.steps``).
- The checkpoint is the newest one that verifies against its manifest (``latest_checkpoint``), or
  the one named (``resume=PATH``, ``--resume-from PATH``: e.g. ``RUN_DIR/checkpoints/best``, the best
  evaluation's), verified the same way. The run then goes on from that step: the newer ``step_N``
  checkpoints of the run directory are set aside as ``superseded-step_N`` (logged), so that a later
  ``--resume`` continues this run and not the one it replaced.
- ``resume=False`` (no flag) into a run directory that already holds checkpoints is a ``ResumeError``:
  a fresh run there would train beside them and replace them one by one. ``overwrite=True``
  (``--overwrite``) starts over instead, deleting the old run's checkpoints (``step_*``), metrics,
  trajectory dumps and TensorBoard events first (``corrupt-*`` checkpoints and ``config.prev-*.yaml``
  stay) and logging what it deleted.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Literal

import yaml

from agent_r1.train.checkpoint import PREFIX, checkpoint_problem, latest_checkpoint
from agent_r1.train.config import TrainConfig, config_to_dict

__all__ = ["NEUTRAL_KEYS", "ResumeError", "config_changes", "resume_checkpoint"]

logger = logging.getLogger(__name__)

ResumeMode = bool | Literal["auto"] | str | Path
"""False (a fresh run), True (the newest checkpoint), "auto" (the newest, else fresh), or a checkpoint
folder to continue from."""

NEUTRAL_KEYS = (
    "logging.",
    "trainer.run_dir",
    "trainer.checkpoint_every",
    "trainer.keep_checkpoints",
    "trainer.retain_freed_memory",
    "trainer.preemption_grace_s",
)
"""Dotted keys (or prefixes ending in '.') that change how a run is logged or saved, or where its
memory comes from, not what it trains."""

_ABSENT = "(absent)"


class ResumeError(ValueError):
    """Resuming would silently do something other than continue the run; says what and how to proceed."""


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(data, dict) or (prefix and not data):
        return {prefix[:-1]: data}
    out: dict[str, Any] = {}
    for key, value in data.items():
        out.update(_flatten(value, f"{prefix}{key}."))
    return out


def config_changes(old: dict[str, Any], new: TrainConfig) -> list[tuple[str, Any, Any]]:
    """(dotted key, old value, new value) for every key where ``new`` differs from the mapping ``old``
    (a ``config.yaml`` as loaded); a key only one side has shows ``(absent)`` on the other."""
    # Round-trip through YAML so both sides have the types config.yaml holds (lists, not tuples).
    old_flat = _flatten(old)
    new_flat = _flatten(yaml.safe_load(yaml.safe_dump(config_to_dict(new))))
    keys = sorted(old_flat.keys() | new_flat.keys())
    return [
        (k, old_flat.get(k, _ABSENT), new_flat.get(k, _ABSENT))
        for k in keys
        if old_flat.get(k, _ABSENT) != new_flat.get(k, _ABSENT)
    ]


def _neutral(key: str, config: TrainConfig) -> bool:
    if key == "trainer.steps":
        return config.trainer.lr_schedule == "constant"
    return any(key == k or (k.endswith(".") and key.startswith(k)) for k in NEUTRAL_KEYS)


def _keep_previous(config_file: Path) -> Path:
    n = 1
    while (kept := config_file.with_name(f"config.prev-{n}.yaml")).exists():
        n += 1
    shutil.copyfile(config_file, kept)
    return kept


def _fresh_start(run_dir: Path, overwrite: bool) -> None:
    """Refuse a fresh start beside an earlier run's checkpoints, or delete that run (``overwrite``)."""
    checkpoints = run_dir / "checkpoints"
    held = sorted(p for p in checkpoints.glob("step_*") if p.is_dir()) if checkpoints.is_dir() else []
    if not held:
        return
    names = ", ".join(p.name for p in held)
    if not overwrite:
        raise ResumeError(
            f"trainer.run_dir {run_dir} already holds checkpoints ({names}): a new run there would train "
            "beside them and replace them. Continue that run with --resume (or --resume-or-start; Python: "
            "Trainer(config, resume=True)), start over with --overwrite (overwrite=True: deletes its "
            "checkpoints, metrics.jsonl, trajectories/ and tb/), or set another trainer.run_dir."
        )
    removed = [f"checkpoints/{{{names}}}"]
    for path in held + sorted(checkpoints.glob(".tmp-*")) + sorted(checkpoints.glob("best")):
        shutil.rmtree(path)
    for name in ("metrics.jsonl", "trajectories", "tb"):
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
        else:
            continue
        removed.append(name)
    logger.warning("--overwrite: deleted the earlier run in %s: %s", run_dir, ", ".join(removed))


def _named_checkpoint(path: Path, run_dir: Path) -> Path:
    """Checkpoint folder ``path``, verified; the run directory's newer ``step_N`` set aside."""
    if not path.is_dir():
        raise ResumeError(
            f"--resume-from: {path} is not a folder (a checkpoint such as {run_dir}/checkpoints/best)"
        )
    problem = checkpoint_problem(path)
    if problem is not None:
        raise ResumeError(f"--resume-from: {path} is not a checkpoint to continue from: {problem}")
    step = _checkpoint_step(path)
    checkpoints = run_dir / "checkpoints"
    newer = sorted(
        p for p in checkpoints.glob(f"{PREFIX}*") if p.is_dir() and int(p.name[len(PREFIX) :]) > step
    )
    for later in newer:
        os.replace(later, later.with_name(f"superseded-{later.name}"))
    if newer:
        logger.warning(
            "--resume-from %s (step %d): the run goes on from there; its newer checkpoints are set aside "
            "as %s",
            path,
            step,
            ", ".join(f"superseded-{p.name}" for p in newer),
        )
    return path


def _checkpoint_step(path: Path) -> int:
    """The step checkpoint ``path`` was written at (its ``info.json``, else its ``trainer_state.pt``)."""
    info = path / "info.json"
    if info.is_file():
        return int(json.loads(info.read_text(encoding="utf-8"))["step"])
    import torch

    return int(torch.load(path / "trainer_state.pt", weights_only=False)["step"])


def resume_checkpoint(
    config: TrainConfig, resume: ResumeMode, *, allow_config_change: bool = False, overwrite: bool = False
) -> Path | None:
    """The checkpoint to continue from, or None to start fresh (``resume`` False, or "auto" with no
    checkpoint); raises ``ResumeError`` as the module docstring says (``overwrite``: see there)."""
    if overwrite and resume is not False:
        raise ValueError("overwrite=True starts over: it cannot be combined with resume")
    if resume is False:
        _fresh_start(Path(config.trainer.run_dir), overwrite)
        return None
    run_dir = Path(config.trainer.run_dir)
    if resume in (True, "auto"):
        checkpoint = latest_checkpoint(run_dir / "checkpoints")
    else:
        checkpoint = _named_checkpoint(Path(resume), run_dir)
    if checkpoint is None:
        if resume == "auto":
            logger.info("no checkpoint in %s: starting a fresh run", run_dir / "checkpoints")
            return None
        raise ResumeError(
            f"--resume: no checkpoint to resume from in {run_dir / 'checkpoints'} (none there, or none "
            "that verifies; see the warnings above). To start a fresh run in this run directory, use "
            "--resume-or-start (Python: Trainer(config, resume='auto')) or leave out --resume."
        )
    config_file = run_dir / "config.yaml"
    if not config_file.is_file():
        logger.warning(
            "%s is missing: cannot check that the config is unchanged since %s", config_file, checkpoint
        )
        return checkpoint
    changes = config_changes(yaml.safe_load(config_file.read_text(encoding="utf-8")) or {}, config)
    if not changes:
        return checkpoint
    listing = "\n".join(f"  {key}: {old!r} → {new!r}" for key, old, new in changes)
    significant = [key for key, _, _ in changes if not _neutral(key, config)]
    if significant and not allow_config_change:
        raise ResumeError(
            f"--resume: the config differs from the one this run was started with ({config_file}):\n"
            f"{listing}\nResuming would continue checkpoint {checkpoint.name} under other settings than "
            "it was trained with. To resume with these changes, add --allow-config-change (Python: "
            "Trainer(..., allow_config_change=True)); the old config is then kept as config.prev-N.yaml. "
            "Otherwise resume with the old settings, or train in a new trainer.run_dir."
        )
    kept = _keep_previous(config_file)
    log = logger.warning if significant else logger.info
    log("resuming %s with a changed config (the old one is kept as %s):\n%s", checkpoint, kept.name, listing)
    return checkpoint
