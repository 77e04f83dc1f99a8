"""An engine wrapper that seeds every sampled request from its content, not its arrival order."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import replace

from agent_r1.types import Completion, SamplingParams

__all__ = ["SeededEngine", "sample_engine", "sample_seed_base"]


def sample_seed_base(base: str, task_index: int, sample_index: int, attempt: int = 0) -> str:
    """The seed base of sample ``sample_index`` of the rollout's task ``task_index``: each sample seeds
    its requests from its own identity, so that which sample gets which seed does not depend on the
    order in which the samples' (identical) first prompts reach the engine. ``attempt`` k > 0 (a
    sample re-queued after its rollout actor died) adds ``:retry<k>``: fresh seeds, never a sibling's."""
    retry = f":retry{attempt}" if attempt else ""
    return f"{base}:{task_index}:{sample_index}{retry}"


def sample_engine(engine, base: str, task_index: int, sample_index: int, attempt: int = 0) -> SeededEngine:
    """The engine one sample of a rollout samples through: ``engine`` seeded by the sample's identity
    (``sample_seed_base``); the same seeds in one process and on Ray."""
    seeded = SeededEngine(engine)
    seeded.reseed(sample_seed_base(base, task_index, sample_index, attempt))
    return seeded


class SeededEngine:
    """Gives every sampled request a seed derived from (base, prompt, occurrence of that prompt).

    Rollouts are concurrent and their requests arrive in a scheduling-dependent order; seeding by
    content instead of arrival makes each step's samples a function of the step's seed. The trainer
    gives every sample its own engine (``sample_seed_base``), so the n samples of one task differ and
    sample i is the same trajectory in every run; within one engine, identical prompts get distinct
    seeds by occurrence.
    """

    def __init__(self, engine) -> None:
        self.engine = engine
        self.base = ""
        self._seen: dict[bytes, int] = {}

    def reseed(self, base: str) -> None:
        self.base = base
        self._seen = {}

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Completion:
        if not params.greedy:
            digest = hashlib.sha256(repr(tuple(prompt_ids)).encode()).digest()
            k = self._seen.get(digest, 0)
            self._seen[digest] = k + 1
            seed_bytes = hashlib.sha256(f"{self.base}:{k}:".encode() + digest).digest()
            params = replace(params, seed=int.from_bytes(seed_bytes[:7], "little"))
        return await self.engine.generate(prompt_ids, params)

    def update_weights(self, named_tensors, version: int | None = None) -> None:
        self.engine.update_weights(named_tensors, version)
