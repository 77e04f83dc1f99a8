"""Fault injection: the points where a test may stop a run mid-phase. They exist for tests only.

A test that signals or kills a training process at an exact point of a phase (a preemption between
two mini-batches, a kill while a checkpoint is half written) sets one of these environment variables
in that process's environment; the phase calls the matching hook in one line at that point. Unset,
the normal case, a hook does nothing.

| hook | variable | format | where it fires |
|---|---|---|---|
| ``after_optimizer_step`` | ``AGENT_R1_UPDATE_DELAY`` | ``STEP:SECONDS:MARKER`` | in ``agent_r1.train.update.ppo_update`` (the driver, also on Ray), after the first optimizer step of training step STEP: creates the file MARKER, then sleeps SECONDS (some mini-batches applied, others not) |
| ``mid_checkpoint_write`` | ``AGENT_R1_CHECKPOINT_WRITE_DELAY`` | ``STEP:SECONDS`` | in ``agent_r1.train.checkpoint.save_checkpoint`` (where the checkpoint is written: on Ray, learner rank 0), between the ``model/`` folder of checkpoint STEP and its other files: sleeps SECONDS |
"""

from __future__ import annotations

import os
import time
from pathlib import Path

__all__ = ["CHECKPOINT_WRITE_DELAY", "UPDATE_DELAY", "after_optimizer_step", "mid_checkpoint_write"]

UPDATE_DELAY = "AGENT_R1_UPDATE_DELAY"
CHECKPOINT_WRITE_DELAY = "AGENT_R1_CHECKPOINT_WRITE_DELAY"


def after_optimizer_step(step: int, updates: int) -> None:
    """``AGENT_R1_UPDATE_DELAY="STEP:SECONDS:MARKER"``: when training step ``step`` is STEP and
    ``updates`` (the updates it has taken so far) is 1, touch MARKER and sleep SECONDS."""
    value = os.environ.get(UPDATE_DELAY)
    if not value or updates != 1:
        return
    delay_step, seconds, marker = value.split(":", 2)
    if int(delay_step) == step:
        Path(marker).touch()
        time.sleep(float(seconds))


def mid_checkpoint_write(step: int) -> None:
    """``AGENT_R1_CHECKPOINT_WRITE_DELAY="STEP:SECONDS"``: when checkpoint ``step`` is STEP, sleep
    SECONDS."""
    delay_step, _, seconds = os.environ.get(CHECKPOINT_WRITE_DELAY, "").partition(":")
    if delay_step and int(delay_step) == step:
        time.sleep(float(seconds))
