"""Finished sequences' KV, kept for the next turn that extends them (multi-turn reuse).

When a request finishes, its KV (prompt + response) goes into a small LRU store under the token ids it
covers; a later prompt that extends it (the next turn of the same trajectory under an append context)
claims it and runs only its new tokens. KV is valid only for the weights that computed it: any write
to the weights (``update_weights``, or an optimizer stepping a model the engine shares with the
learner) empties the store.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from agent_r1.rollout import cascade

__all__ = ["PrefixStore", "StoredPrefix"]


@dataclass(frozen=True)
class StoredPrefix:
    """A finished sequence's KV kept for a next turn: the block it extends (or None) and its own
    tokens' keys and values per layer, each (H, T, D)."""

    block: cascade.Block | None
    kv: list[tuple[torch.Tensor, torch.Tensor]]


class PrefixStore:
    """Up to ``capacity`` stored sequences (0: none are kept), least recently stored dropped first,
    keyed by the token ids fed to the model (prompt + response[:-1]), for ``model``'s weights."""

    def __init__(self, capacity: int, model: torch.nn.Module) -> None:
        self.capacity = capacity
        self._model = model
        self._entries: OrderedDict[tuple[int, ...], StoredPrefix] = OrderedDict()
        self._fingerprint = self._weights_fingerprint()

    def __len__(self) -> int:
        return len(self._entries)

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

    def keep(self, fed: tuple[int, ...], entry: StoredPrefix) -> None:
        """Store ``entry`` under the tokens ``fed`` it covers, dropping the oldest beyond capacity."""
        self._entries[fed] = entry
        self._entries.move_to_end(fed)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def claim(self, prompts: list[tuple[int, ...]]) -> list[tuple[int, ...] | None]:
        """For each prompt, the longest stored sequence it strictly extends and no earlier prompt
        claimed, or None. (The prefill ``pop`` s the claimed entries: each new request stores its own
        longer one.)"""
        claimed: list[tuple[int, ...] | None] = []
        for prompt_ids in prompts:
            best = None
            for fed in self._entries:
                if (
                    len(fed) < len(prompt_ids)
                    and (best is None or len(fed) > len(best))
                    and fed not in claimed
                    and prompt_ids[: len(fed)] == fed
                ):
                    best = fed
            claimed.append(best)
        return claimed

    def pop(self, fed: tuple[int, ...]) -> StoredPrefix:
        """Take the entry stored under ``fed`` out of the store."""
        return self._entries.pop(fed)
