"""Preemption: SIGTERM or SIGINT (SLURM, Kubernetes, a spot instance's notice, Ctrl-C) checkpoints
the run at a consistent point and ends it with ``PREEMPTED_EXIT`` (4).

``PreemptionGuard`` is installed by ``Trainer.fit`` in the main thread. On the first signal:

- a **sync rollout** being sampled stops at once (``StopSampling`` is raised where the trainer waits
  for it; its unfinished trajectories are dropped): the step it belonged to has not changed the
  weights, so the checkpoint is the previous step's state, with the RNG state recorded when that step
  ended. The resumed run samples that step again, from the same seeds. A rollout whose event loop
  runs in this thread (the local backend) is not interrupted wherever the handler lands (raised
  inside a flow's task, ``StopSampling`` would end that trajectory and leave its group waiting for
  the others; raised inside a loop callback, asyncio would log and drop it): the handler stops the
  loop, and ``StopSampling`` is raised once it has stopped, its trajectories cancelled.
- anything else (the update, the weight sync, an evaluation, a checkpoint being written, an async
  rollout) runs on to the end of its step: the update is not split, since half an optimizer pass is
  no state to resume from. The step's checkpoint then waits for an async rollout in flight and saves
  its finished groups with it, as every async checkpoint does.

A timer is started with the signal: if the checkpoint is not written ``trainer.preemption_grace_s``
seconds later (an update or an async rollout that outlasts the grace), the process ends at once with
``UNSAVED_EXIT`` (5), saying so; the previous checkpoint stands, and a checkpoint half written then
is only a ``.tmp-`` folder that resume removes (``agent_r1.train.checkpoint``). A second SIGTERM
while the checkpoint is being prepared is ignored (logged); a second SIGINT (Ctrl-C twice) raises
``KeyboardInterrupt`` at once, leaving the previous checkpoint.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["PREEMPTED_EXIT", "UNSAVED_EXIT", "Preempted", "PreemptionGuard", "StopSampling"]

logger = logging.getLogger(__name__)

PREEMPTED_EXIT = 4
"""Exit code of ``agent-r1 train`` after a preemption signal once its checkpoint is written."""
UNSAVED_EXIT = 5
"""Exit code when the checkpoint could not be written within ``trainer.preemption_grace_s``."""

_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(Exception):
    """The run stopped on a preemption signal after writing ``checkpoint`` (None: before its first
    step ended there was nothing to save)."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None) -> None:
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        name = signal.Signals(signum).name
        saved = (
            f"checkpoint {checkpoint} holds step {step}; --resume continues from it"
            if checkpoint is not None
            else "no step had finished, so there is nothing to resume: --resume-or-start starts over"
        )
        super().__init__(f"preempted by {name}: {saved}")


class StopSampling(BaseException):
    """Raised by the signal handler where the trainer waits for a sync rollout: stop sampling. A
    ``BaseException`` (like ``KeyboardInterrupt``), so that a flow or env that catches ``Exception``
    (``rollout_group`` turns those into ERROR trajectories) does not swallow it when the signal lands
    inside its code."""


class PreemptionGuard:
    """The preemption signals' handler and its grace timer (see the module docstring)."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.signum: int | None = None
        self._stoppable = False
        self._loop_stopped = False  # the handler stopped a stoppable rollout's event loop
        self._installed: dict[int, object] = {}
        self._timer: threading.Timer | None = None
        self._signalled_at = 0.0

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def __enter__(self) -> PreemptionGuard:
        if threading.current_thread() is threading.main_thread():
            for signum in _SIGNALS:
                self._installed[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, previous in self._installed.items():
            signal.signal(signum, previous)
        self._installed = {}
        self.done()

    @contextmanager
    def stoppable(self) -> Iterator[None]:
        """A sync rollout: a preemption signal (or one already received) stops it with ``StopSampling``."""
        if self.requested:
            raise StopSampling()
        self._stoppable, self._loop_stopped = True, False
        try:
            yield
        except RuntimeError:  # "Event loop stopped before Future completed.": ours, or not
            if self._loop_stopped:
                raise StopSampling() from None
            raise
        finally:
            self._stoppable = False
        if self._loop_stopped:  # the rollout ended in the loop's last iteration: dropped all the same
            raise StopSampling()

    def done(self) -> None:
        """The checkpoint is written (or the run ends otherwise): the grace timer stops."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def elapsed(self) -> float:
        return time.monotonic() - self._signalled_at

    def _handle(self, signum: int, frame) -> None:
        if self.requested:
            if signum == signal.SIGINT:  # Ctrl-C twice: stop now, the previous checkpoint stands
                raise KeyboardInterrupt
            logger.warning("%s again: still writing the preemption checkpoint", signal.Signals(signum).name)
            return
        self.signum, self._signalled_at = signum, time.monotonic()
        logger.warning(
            "%s: stopping at the next consistent point to checkpoint (within trainer.preemption_grace_s=%s s)",
            signal.Signals(signum).name,
            self.grace_s,
        )
        self._timer = threading.Timer(self.grace_s, self._expired)
        self._timer.daemon = True
        self._timer.start()
        if self._stoppable:
            self._stoppable = False
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # waiting on another process (Ray): interrupt the wait
                raise StopSampling() from None
            self._loop_stopped = True
            loop.call_soon_threadsafe(loop.stop)  # (wakes the loop, as asyncio's own signal handling)

    def _expired(self) -> None:
        print(
            f"agent-r1 train: preempted by {signal.Signals(self.signum).name}: the checkpoint was not written "
            f"within trainer.preemption_grace_s={self.grace_s} s; the previous checkpoint stands "
            f"(--resume continues from it). Exit {UNSAVED_EXIT}.",
            file=sys.stderr,
            flush=True,
        )
        os._exit(UNSAVED_EXIT)
