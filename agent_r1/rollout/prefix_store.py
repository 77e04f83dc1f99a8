"""Finished sequences' KV, kept for the next turn that extends them (multi-turn reuse).

When a request finishes, its KV (prompt + response) goes into a small LRU store under the token ids it
covers; a later prompt that extends it (the next turn of the same trajectory under an append context)
claims it and runs only its new tokens. KV is valid only for the weights that computed it: any write
to the weights (``update_weights``, or an optimizer stepping a model the engine shares with the
learner) empties the store; and only for the adapter that computed it: an engine serving several
roles (each a LoRA adapter of one model) keys every entry by ``(adapter, token ids)``
(``PromptKey``), so a prompt's KV from one adapter never serves another's request.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple

import torch

from agent_r1.rollout import cascade

__all__ = ["BASE_ADAPTER", "PrefixStore", "PromptKey", "StoredPrefix"]

log = logging.getLogger(__name__)

UNBOUNDED_WARNING_BYTES = 4 * 2**30
"""An unbounded store warns when its KV first passes this, and again at every doubling."""

BASE_ADAPTER = "__base__"
"""peft's name for "the base model, adapters off" in a mixed-adapter batch (``adapter_names``)."""


class PromptKey(NamedTuple):
    """Token ids and the adapter that runs them: what a KV cache entry is valid for. ``adapter`` is a
    peft adapter name, ``BASE_ADAPTER``, or None (the engine runs the model as it is: one policy)."""

    adapter: str | None
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class StoredPrefix:
    """A finished sequence's KV kept for a next turn: the block it extends (or None) and its own
    tokens' keys and values per layer, each (H, T, D)."""

    block: cascade.Block | None
    kv: list[tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.kv)


class PrefixStore:
    """Up to ``capacity`` stored sequences (0: none are kept; None: no limit), least recently stored
    dropped first, keyed by the adapter and the token ids fed to the model (prompt + response[:-1]),
    for ``model``'s weights. Several sequences with the same key (samples of a group that sampled the
    same tokens) are kept as several entries, each claimed once. Without a limit (the batch-invariant
    engine's store) it logs a warning when its KV first passes ``UNBOUNDED_WARNING_BYTES``, and at
    every doubling after."""

    def __init__(self, capacity: int | None, model: torch.nn.Module) -> None:
        self.capacity = capacity
        self._model = model
        self._entries: OrderedDict[PromptKey, list[StoredPrefix]] = OrderedDict()
        self._fingerprint = self._weights_fingerprint()
        self.nbytes = 0  # the stored KV
        self._warn_at = UNBOUNDED_WARNING_BYTES

    def __len__(self) -> int:
        return sum(len(entries) for entries in self._entries.values())

    @property
    def keeps(self) -> bool:
        """Whether finished sequences are stored at all."""
        return self.capacity is None or self.capacity > 0

    def _weights_fingerprint(self) -> int:
        """Sum of the parameters' in-place version counters: it changes whenever any weight is
        written (``update_weights``, or an optimizer stepping a model this engine shares)."""
        return sum(p._version for p in self._model.parameters())

    def drop_stale(self) -> None:
        """Empty the store if any weight was written since it was last checked."""
        fingerprint = self._weights_fingerprint()
        if fingerprint != self._fingerprint:
            self._entries.clear()
            self._fingerprint = fingerprint
            self.nbytes = 0

    def keep(self, fed: PromptKey, entry: StoredPrefix) -> None:
        """Store ``entry`` under the adapter and tokens ``fed`` it covers, dropping the oldest beyond
        capacity."""
        self._entries.setdefault(fed, []).append(entry)
        self._entries.move_to_end(fed)
        self.nbytes += entry.nbytes
        while self.capacity is not None and len(self) > self.capacity:
            self.pop(next(iter(self._entries)))
        if self.capacity is None and self.nbytes >= self._warn_at:
            log.warning(
                "HFEngine (batch-invariant, trainer.deterministic): the finished turns kept for reuse hold "
                "%.1f GiB of KV until the weights change (a bounded store would evict by arrival and break "
                "the bits); rollout.engine_kwargs.prefix_cache_entries: 0 turns reuse off",
                self.nbytes / 2**30,
            )
            self._warn_at *= 2

    def claim(self, prompts: list[PromptKey]) -> list[PromptKey | None]:
        """For each prompt, the longest stored sequence of the same adapter that it strictly extends
        and no earlier prompt claimed, or None. (The prefill ``pop`` s the claimed entries: each new
        request stores its own longer one.)"""
        claimed: list[PromptKey | None] = []
        for prompt in prompts:
            best = None
            for fed, entries in self._entries.items():
                n = len(fed.token_ids)
                if (
                    fed.adapter == prompt.adapter
                    and n < len(prompt.token_ids)
                    and (best is None or n > len(best.token_ids))
                    and claimed.count(fed) < len(entries)
                    and prompt.token_ids[:n] == fed.token_ids
                ):
                    best = fed
            claimed.append(best)
        return claimed

    def pop(self, fed: PromptKey) -> StoredPrefix:
        """Take an entry stored under ``fed`` out of the store."""
        entries = self._entries[fed]
        entry = entries.pop(0)
        if not entries:
            del self._entries[fed]
        self.nbytes -= entry.nbytes
        return entry
