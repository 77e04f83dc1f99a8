"""The decode batch's KV cache: rows joining and leaving a left-padded ``DynamicCache``.

``GrowingLayer`` is one layer's keys and values in buffers with spare rows and columns, so a decode
step writes one column in place and a joining row is written into a free row; ``DecodeBatch`` is the
scheduler's batch: which request sits in which cache row, the mask over the cache's columns, and the
shared prompt block (``agent_r1.rollout.cascade``) each row extends. Rows sit left-padded; padding is
masked out and positions are explicit, so a row's log-probs equal an unpadded forward over its own
tokens. A cache made with a ``dtype`` (``new_cache``: the engine's bf16 sampler on the CPU) holds
its keys and values in it, whatever the model writes.

Deviation from vLLM: no paged attention; the batch cache is re-laid when a joining row does not
fit its buffers (a copy of the live KV, cheap next to a decode step for models that fit a CPU or one
GPU), and finished rows are dropped by moving the live ones within the buffers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Generic, TypeVar

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from agent_r1.rollout import cascade

__all__ = ["DecodeBatch", "GrowingLayer", "new_cache"]

# What sits in a cache row: the scheduler's request (``agent_r1.rollout.hf_scheduler.Request``). The
# batch never reads one, it only tells a live row from a finished one (None), so it takes any type and
# the scheduler, which imports this module, is not imported back.
RequestT = TypeVar("RequestT")


class GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` over a buffer with spare rows and spare columns both sides.

    ``DynamicLayer`` appends with ``torch.cat``, copying the whole cache at every decode step; here a
    step writes one column in place and ``keys`` / ``values`` are views of the filled block
    ``[:rows, :, start:end]``. Spare columns on the right take decode steps (the buffer doubles when
    full); spare rows and spare columns on the left let joining rows, even ones longer than the batch,
    be written in place (``put_rows``) instead of re-laying the whole cache. Buffers are allocated
    uninitialised (zeroing them cost a fifth of a multi-turn rollout's time); every slot is written
    before the view covers it (padding with zeros), so a masked slot never holds a non-finite value.
    """

    def __init__(self, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.kv_dtype = dtype  # what the buffers hold (None: what the model writes)
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None
        self._rows = self._start = self._end = 0

    def set(self, keys: torch.Tensor, values: torch.Tensor, *, rows: int = 0, left: int = 0, right: int = 0):
        """Hold exactly ``keys`` / ``values`` (B, H, T, D), with room for ``rows`` rows in all and
        ``left`` / ``right`` more positions."""
        if self.kv_dtype is not None:
            keys, values = keys.to(self.kv_dtype), values.to(self.kv_dtype)
        batch, heads, length, _ = keys.shape
        rows, columns = max(rows, batch), left + length + right
        self._key_buffer = _uninitialised(keys, rows, heads, columns, keys.shape[-1])
        self._value_buffer = _uninitialised(values, rows, heads, columns, values.shape[-1])
        self._key_buffer[:batch, :, left : left + length] = keys
        self._value_buffer[:batch, :, left : left + length] = values
        self._rows, self._start, self._end = batch, left, left + length
        self._view()
        self.device = keys.device
        self.is_initialized = True

    def _view(self) -> None:
        self.keys = self._key_buffer[: self._rows, :, self._start : self._end]
        self.values = self._value_buffer[: self._rows, :, self._start : self._end]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.set(key_states, value_states, right=key_states.shape[-2])
            return self.keys, self.values
        end = self._end + key_states.shape[-2]
        if end > self._key_buffer.shape[-2]:
            width = end - self._start
            self.set(self.keys, self.values, rows=self._key_buffer.shape[0], left=self._start, right=width)
            end = self._end + key_states.shape[-2]
        self._key_buffer[: self._rows, :, self._end : end] = key_states
        self._value_buffer[: self._rows, :, self._end : end] = value_states
        self._end = end
        self._view()
        return self.keys, self.values

    def reserve(self, rows: int, left: int) -> None:
        """Make room for ``rows`` rows in all and ``left`` more positions on the left (and as many on
        the right), re-laying the buffer only when it lacks either."""
        if self._key_buffer.shape[0] < rows or self._start < left:
            width = self._end - self._start
            self.set(self.keys, self.values, rows=rows, left=left, right=max(width, left))

    def fits(self, rows: int, length: int) -> bool:
        """Whether ``put_rows`` can add ``rows`` rows of ``length`` positions in place."""
        return self._rows + rows <= self._key_buffer.shape[0] and length <= self._end

    def pad_rows(self, rows: int) -> None:
        """Widen the view to ``rows`` rows (within the buffer), the new ones all zeros (idle rows)."""
        self._key_buffer[self._rows : rows, :, self._start : self._end] = 0
        self._value_buffer[self._rows : rows, :, self._start : self._end] = 0
        self._rows = max(self._rows, rows)
        self._view()

    def keep_rows(self, index: torch.Tensor, first: int) -> None:
        """Keep only rows ``index`` (ascending), moved to the front in place, and drop the view's first
        ``first`` columns (padding in every kept row): no new buffer, only the live KV is copied."""
        start = self._start + first
        for buffer in (self._key_buffer, self._value_buffer):
            # (the gather copies before it writes: row i moves from index[i] >= i)
            buffer[: len(index), :, start : self._end] = buffer[index, :, start : self._end]
        self._rows, self._start = len(index), start
        self._view()

    def put_rows(self, slots: list[int], keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write rows (n, H, L, D) into row ``slots`` (finished rows', or the next new ones), right-aligned
        to the current end, widening the view to the left when ``L`` exceeds its width (the other rows'
        new columns are zero: padding). New rows need ``fits``."""
        length = keys.shape[-2]
        start = min(self._start, self._end - length)
        index = torch.tensor(slots, device=self._key_buffer.device)
        for buffer, new in ((self._key_buffer, keys), (self._value_buffer, values)):
            buffer[: self._rows, :, start : self._start] = 0  # the existing rows' new columns: padding
            buffer[index, :, start : self._end - length] = 0
            buffer[index, :, self._end - length : self._end] = new
        self._rows, self._start = max(self._rows, max(slots) + 1), start
        self._view()


def _uninitialised(like: torch.Tensor, *shape: int) -> torch.Tensor:
    """A contiguous tensor of ``shape`` with ``like``'s dtype and device, its memory left as it is.

    ``new_empty`` fills every new tensor with NaN under ``torch.use_deterministic_algorithms`` (the
    deterministic mode's guard against reading memory never written): a ``max_batch_size``-row buffer
    at each cache re-lay took 39% of a deterministic quickstart's sampling time at 400 rows. Here
    every slot is written before a view covers it (``GrowingLayer``), so nothing unwritten is read
    and the fill is pure cost."""
    storage = torch.UntypedStorage(math.prod(shape) * like.element_size(), device=like.device)
    return like.new_empty(0).set_(storage, 0, shape)


def new_cache(num_layers: int, dtype: torch.dtype | None = None) -> DynamicCache:
    """An empty cache of ``num_layers`` ``GrowingLayer`` s, holding keys and values in ``dtype``
    (None: the type the model computes them in)."""
    cache = DynamicCache()
    cache.layers = [GrowingLayer(dtype) for _ in range(num_layers)]
    return cache


class DecodeBatch(Generic[RequestT]):
    """The decode batch: a left-padded KV cache of B rows, its mask (B, T), ``rows[i]``, the
    request in cache row ``i``, or None once that request finished, and ``blocks[i]``, the shared
    prompt block row ``i`` extends (its cache then holds only the tokens after it), or None.

    A finished row stays in the cache (its decode output is ignored) until a joining request takes its
    slot, or until finished rows make up half the batch: then the live rows are moved to the front of
    the same buffers (``GrowingLayer.keep_rows``), so a copy happens O(log B) times per wave of
    finishing rows instead of at every retirement. (Multi-turn trajectories rejoin once per turn:
    filling finished rows' slots, their turns no longer run the buffers out of rows, which re-laid
    the whole cache.)

    ``padded_rows`` (batch-invariant decoding, ``agent_r1.rollout.batch_invariant``): the row count
    the batch is padded to with idle rows (None, all-zero KV and mask) after every change, given its
    rows; the capacity is padded the same way.

    The buffers always hold ``capacity`` rows (the engine's ``max_batch_size``): joining rows fill
    finished rows' slots before new ones, so the batch never has more rows than that, and a row that
    joins never re-lays the cache for want of one. (Sized to twice the live rows, the buffers ran out
    of rows in 7 of 80 joins over two iterations of ``benchmarks/vs_trl_multiturn.py``; a re-lay
    copies every live row's KV.)
    """

    def __init__(self, capacity: int, padded_rows: Callable[[int], int] | None = None) -> None:
        self.padded_rows = padded_rows
        self.capacity = capacity if padded_rows is None else padded_rows(capacity)
        self.clear()

    def clear(self) -> None:
        self.rows: list[RequestT | None] = []
        self.blocks: list[cascade.Block | None] = []
        self.cache: DynamicCache | None = None
        self.mask_BT: torch.Tensor | None = None
        self._block_plan: cascade.BlockPlan | None = None
        self._planned = False

    def block_plan(self, stacks, dtype: torch.dtype) -> cascade.BlockPlan | None:
        """The decode steps' blocks, rebuilt only after the rows changed."""
        if not self._planned:
            self._block_plan, self._planned = cascade.block_plan(self.blocks, stacks, dtype), True
        return self._block_plan

    def window(self) -> cascade.Window | None:
        """This decode step's split of the rows' own keys (``cascade.choose_window``)."""
        width = self.mask_BT.shape[1]
        first = self.mask_BT.argmax(dim=1).tolist()  # each row's first real column
        spans = [0 if r is None else width - f for r, f in zip(self.rows, first, strict=True)]
        chosen = cascade.choose_window(spans)
        if chosen is None:
            return None
        recent, rows = chosen
        return cascade.Window(recent, max(spans), torch.tensor(rows, device=self.mask_BT.device))

    @property
    def requests(self) -> list[RequestT]:
        """The live requests, in row order."""
        return [r for r in self.rows if r is not None]

    @property
    def live_rows(self) -> list[int]:
        return [i for i, r in enumerate(self.rows) if r is not None]

    def merge(self, requests: list[RequestT], cache: DynamicCache, mask_BT: torch.Tensor, blocks) -> None:
        """Append newly prefilled rows (their own cache and mask, and the blocks they extend): in place
        when the buffers have room, else by re-laying the live rows and the new ones into a fresh cache
        (finished rows dropped)."""
        self._planned = False
        if self.cache is None:
            for layer in cache.layers:  # room for joining rows, longer ones included, written in place
                layer.reserve(self.capacity, left=mask_BT.shape[1])
            self.rows, self.cache, self.mask_BT, self.blocks = list(requests), cache, mask_BT, list(blocks)
            self._pad_rows()
            return
        rows, length = mask_BT.shape
        free = [i for i, r in enumerate(self.rows) if r is None][:rows]
        slots = free + list(range(len(self.rows), len(self.rows) + rows - len(free)))
        if self.cache.layers[0].fits(rows - len(free), length):
            for mine, theirs in zip(self.cache.layers, cache.layers, strict=True):
                mine.put_rows(slots, theirs.keys, theirs.values)
            width = max(self.mask_BT.shape[1], length)
            grown = cascade.left_pad(self.mask_BT, width, 1)
            self.mask_BT = torch.cat([grown, grown.new_zeros(rows - len(free), width)])
            self.mask_BT[torch.tensor(slots, device=grown.device)] = cascade.left_pad(mask_BT, width, 1)
            self.rows += [None] * (rows - len(free))
            self.blocks += [None] * (rows - len(free))
            for slot, request, block in zip(slots, requests, blocks, strict=True):
                self.rows[slot], self.blocks[slot] = request, block
            self._pad_rows()
            return
        live = self.live_rows
        index = torch.tensor(live, device=self.mask_BT.device)
        mine_mask_BT, first = self._trimmed_mask(index)
        width = max(mine_mask_BT.shape[1], length)
        for mine, theirs in zip(self.cache.layers, cache.layers, strict=True):
            mine.set(
                *(
                    torch.cat(
                        [cascade.left_pad(a[index, :, first:], width, 2), cascade.left_pad(b, width, 2)]
                    )
                    for a, b in ((mine.keys, theirs.keys), (mine.values, theirs.values))
                ),
                rows=self.capacity,
                left=width,
                right=width,
            )
        self.mask_BT = torch.cat(
            [cascade.left_pad(mine_mask_BT, width, 1), cascade.left_pad(mask_BT, width, 1)]
        )
        self.rows = [self.rows[i] for i in live] + list(requests)
        self.blocks = [self.blocks[i] for i in live] + list(blocks)
        self._pad_rows()

    def retire(self, rows: list[int]) -> None:
        """Mark ``rows`` finished; compact the cache once finished rows are half of it or more."""
        for i in rows:
            self.rows[i] = self.blocks[i] = None
        self._planned = self._planned and not rows
        live = self.live_rows
        if not live:
            self.clear()
        elif rows and 2 * len(live) <= len(self.rows):
            index = torch.tensor(live, device=self.mask_BT.device)
            self.mask_BT, first = self._trimmed_mask(index)
            for layer in self.cache.layers:
                layer.keep_rows(index, first)
            self.rows = [self.rows[i] for i in live]
            self.blocks = [self.blocks[i] for i in live]
            self._pad_rows()

    def _pad_rows(self) -> None:
        """Idle rows up to ``padded_rows``."""
        missing = 0 if self.padded_rows is None else self.padded_rows(len(self.rows)) - len(self.rows)
        if missing:
            for layer in self.cache.layers:
                layer.pad_rows(len(self.rows) + missing)
            self.mask_BT = torch.cat([self.mask_BT, self.mask_BT.new_zeros(missing, self.mask_BT.shape[1])])
            self.rows += [None] * missing
            self.blocks += [None] * missing

    def own_kv(self, row: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Row ``row``'s own keys and values per layer, each (H, T, D) without the padding (copies)."""
        columns = self.mask_BT[row].nonzero().squeeze(1)  # found once for every layer
        return [
            (layer.keys[row].index_select(1, columns), layer.values[row].index_select(1, columns))
            for layer in self.cache.layers
        ]

    def _trimmed_mask(self, index: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The mask of rows ``index`` without the columns that are padding in all of them, and the
        first column kept."""
        mask_BT = self.mask_BT[index]
        first = int(mask_BT.any(dim=0).long().argmax())
        return mask_BT[:, first:], first
