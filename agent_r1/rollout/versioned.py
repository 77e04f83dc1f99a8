"""Policy versions at request granularity: an engine wrapper that swaps weights only between requests.

Asynchronous training overlaps sampling with the update, so new weights arrive while trajectories are
in flight. ``VersionedEngine`` makes that exact at the step level, the unit of the MDP: a weight swap
waits until every request that has started has finished (its tokens all come from the old weights),
holds back requests that arrive meanwhile, applies the new weights, and lets them go. Each
``Completion`` is stamped with the version that sampled it, so every ``Step`` records exactly which
policy produced its tokens and the off-policy correction (``agent_r1.algos.off_policy``) sees it.

An in-flight trajectory therefore continues with the new weights from its next step ("partial
rollouts", as in AReaL, arXiv 2505.24298, and Kimi k1.5): a weight update waits for the longest
in-flight *turn*, never for the longest trajectory.

Both rollout backends stamp the same way (``VersionedEngine.watch``): a rollout during which no swap
happened was sampled by one version, which every one of its steps then records, whatever the flow
stamped (a flow may build steps without the completion's version).

One event loop at a time drives it (the rollout thread's, a Ray actor's, or ``asyncio.run`` in the
trainer's thread between rollouts), so its counters need no lock.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from agent_r1.types import Completion, SamplingParams, TrajectoryGroup

__all__ = ["VersionWatch", "VersionedEngine", "stamp_version"]


class VersionedEngine:
    """``engine`` with ``version`` stamped on each completion and ``swap`` between requests."""

    def __init__(self, engine, version: int = 0) -> None:
        self.engine = engine
        self.version = version
        self.swaps = 0  # weight swaps applied
        self.held_requests = 0  # requests that waited for a swap to finish
        self._active = 0
        self._swapping = False
        self._idle: asyncio.Future | None = None
        self._held: list[asyncio.Future] = []

    @property
    def active(self) -> int:
        """Requests being sampled now."""
        return self._active

    def watch(self) -> VersionWatch:
        """Taken before a rollout starts: its ``stamp`` says which version sampled the rollout's steps."""
        return VersionWatch(self, self.swaps, self.version)

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Completion:
        while self._swapping:
            self.held_requests += 1
            held = asyncio.get_running_loop().create_future()
            self._held.append(held)
            await held
        self._active += 1
        version = self.version
        try:
            completion = await self.engine.generate(prompt_ids, params)
        finally:
            self._active -= 1
            if not self._active and self._idle is not None and not self._idle.done():
                self._idle.set_result(None)
        return replace(completion, policy_version=version)

    async def swap(self, apply: Callable[[], None], version: int) -> None:
        """Wait until no request is being sampled, ``apply()`` the new weights, then sample as
        ``version``. Requests that arrive while it waits are held until it is done."""
        if self._swapping:
            raise RuntimeError("VersionedEngine.swap: a swap is already in progress")
        self._swapping = True
        try:
            while self._active:
                self._idle = asyncio.get_running_loop().create_future()
                await self._idle
            apply()
            self.version = version
            self.swaps += 1
        finally:
            self._swapping, self._idle = False, None
            held, self._held = self._held, []
            for future in held:
                if not future.done():
                    future.set_result(None)


@dataclass(frozen=True)
class VersionWatch:
    """The engine's swap count and version when a rollout started (``VersionedEngine.watch``)."""

    engine: VersionedEngine
    swaps: int
    version: int

    def stamp(self, group: TrajectoryGroup) -> TrajectoryGroup:
        """``group`` with every step stamped with the watched version when no swap happened since the
        watch began (every step was sampled by that version); unchanged otherwise (each step keeps
        the version its completion carried)."""
        return stamp_version(group, self.version) if self.engine.swaps == self.swaps else group


def stamp_version(group: TrajectoryGroup, version: int) -> TrajectoryGroup:
    """``group`` with every step's ``policy_version`` set to ``version``."""
    return replace(
        group,
        trajectories=tuple(
            replace(t, steps=tuple(replace(s, policy_version=version) for s in t.steps))
            for t in group.trajectories
        ),
    )
