"""Batch-invariant decoding (the deterministic mode's HF engine): a row's tokens and log-probs do not
depend on which rows share its batch, so requests decode together and the result is still a function
of each request alone.

What breaks invariance in a plain batched decode, measured on this machine with MKL in its
reproducible mode at one thread, as ``trainer.deterministic`` runs:

- **the matmuls**: with ``MKL_CBWR=AUTO`` (the mode's default) a row of ``x @ W.T`` is bitwise the
  same for every row count M of at least 16, wherever the row sits, for each of SmolLM2's projections
  and its LM head (at least 6 for the tiny model's 128-wide ones); fewer rows take other kernels and
  round otherwise. With ``COMPATIBLE``: every M that is a multiple of 4 and at least 8. At two threads
  the result depended on M up to 57 rows for some shapes on the hosts measured first (not on every
  host since): invariance is for one thread only, and ``HFEngine`` refuses more.
- **the attention**: a left-padded batch puts a row's keys at an offset set by the longest row, and
  the kernel's blocking over keys then sums them in another order.
- **shared work**: a prompt prefilled together with others is padded; whether a prompt shared by
  several rows is attended as one block (``agent_r1.rollout.cascade``), or a stored turn's KV is
  still there to be reused (an LRU store evicts by arrival), depends on what else arrived.

So, in this mode (``Scheduler(batch_invariant=True)``):

- each distinct prompt is prefilled in a forward of its own (no padding: a function of its tokens);
- the decode batch is padded with idle rows to at least ``MIN_ROWS`` and a multiple of
  ``ROW_MULTIPLE`` (``DecodeBatch``), a row count whose rows are invariant under both modes; the
  engine checks this for its model's matmul shapes when it starts (``matmuls_invariant``), since
  another CPU or MKL may pick its kernels otherwise;
- each row attends to its own keys alone (``rowwise_attention``: one kernel call per row and layer);
- there are no blocks; a finished turn's KV is kept, with no limit, until the weights change
  (``PrefixStore(None)``), so a trajectory's next turn always finds its own last turn and prefills
  only its new tokens, alone. The stored KV is itself a function of the trajectory (its prefills and
  decode steps were), and so is the next turn's. Two samples that fed the same tokens are kept as two
  entries (bitwise equal), so neither finds the other's taken. The cost: every trajectory of a
  weight version keeps its last turn's KV (what its row held while it decoded) until the weights
  change.

Element-wise operations and the per-row reductions (RMS norm, the softmax over the vocabulary, the
sampler's cumulative sum) compute each row alone at one thread. ``tests/test_rollout_batch_invariant.py``
checks the whole: a seeded request's tokens and log-probs, bitwise, alone and among others that join
and leave at other times.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from agent_r1.models.attention import refuse_unplain, route_sdpa

__all__ = [
    "MIN_ROWS",
    "ROW_MULTIPLE",
    "RowSpans",
    "install",
    "matmuls_invariant",
    "padded_rows",
    "possible",
    "refuse_settings",
    "rowwise_attention",
]

MIN_ROWS = 16
ROW_MULTIPLE = 8
"""The decode batch's row count is at least ``MIN_ROWS`` and a multiple of ``ROW_MULTIPLE`` (idle rows
fill it): see the module docstring."""


def padded_rows(rows: int) -> int:
    """The row count a batch of ``rows`` rows decodes at."""
    return max(MIN_ROWS, -(-rows // ROW_MULTIPLE) * ROW_MULTIPLE)


def matmuls_invariant(
    model: torch.nn.Module, capacity: int, linear: Callable[[Tensor, Tensor], Tensor] = F.linear
) -> bool:
    """Whether every distinct weight shape of ``model``'s linear layers (the LM head included) gives
    each row the same bits at every padded row count up to ``capacity``'s, wherever the row sits:
    random rows, compared with one product over all of them, by ``linear`` (the engine's: ``F.linear``
    or ``agent_r1.rollout.packed_linear``'s)."""
    shapes = {m.weight.shape for m in model.modules() if isinstance(m, torch.nn.Linear)}
    most = padded_rows(capacity)
    dtype = next(model.parameters()).dtype
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for shape in shapes:
            weight = torch.randn(shape, generator=generator, dtype=dtype)
            x = torch.randn(most, shape[1], generator=generator, dtype=dtype)
            whole = linear(x, weight)
            for rows in range(MIN_ROWS, most + 1, ROW_MULTIPLE):
                for start in {0, most - rows}:
                    if not torch.equal(linear(x[start : start + rows], weight), whole[start : start + rows]):
                        return False
    return True


@dataclass(frozen=True)
class RowSpans:
    """A decode step's rows' own key counts: row ``i`` attends to the last ``spans[i]`` columns of the
    cache (its own tokens, contiguous at the right: each prompt, a reused turn's included, is prefilled
    alone, without padding); 0 for an idle row."""

    spans: Sequence[int]


def rowwise_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    *,
    rowwise: RowSpans,
    **kwargs,
) -> tuple[Tensor, None]:
    """Hugging Face's attention-function contract for a decode step (``query`` (B, H, 1, D); ``key``
    / ``value`` (B, KV, T, D)): each row's query against its own keys alone, so that its output is the
    same whatever the batch's width -> (B, 1, H, D); an idle row's output is zeros."""
    refuse_unplain("batch-invariant decoding", kwargs, "trainer.deterministic: false")
    if dropout:
        raise ValueError("batch-invariant decoding runs without dropout (the engine's model is in eval mode)")
    batch, heads, queries, dim = query.shape
    if queries != 1:
        raise ValueError(f"batch-invariant attention is for decode steps (one query per row), got {queries}")
    width = key.shape[2]
    out = query.new_zeros(batch, 1, heads, dim)
    for row, span in enumerate(rowwise.spans):
        if span:
            own = slice(width - span, width)
            out[row] = torch.nn.functional.scaled_dot_product_attention(
                query[row : row + 1],
                key[row : row + 1, :, own],
                value[row : row + 1, :, own],
                scale=scaling,
                enable_gqa=True,
            )[0].transpose(0, 1)
    return out, None


def install() -> None:
    """Route Hugging Face ``sdpa`` forwards that carry ``rowwise=`` through ``rowwise_attention``."""
    route_sdpa("rowwise", rowwise_attention)


def possible(device: torch.device) -> bool:
    """Whether this process can decode batch-invariantly on ``device``: the CPU at one torch thread
    (what was measured; a GPU's matmul kernels change with the row count, and so do MKL's at two
    threads)."""
    return device.type == "cpu" and torch.get_num_threads() == 1


def refuse_settings(
    device: torch.device,
    plain_sdpa: bool,
    cascade_attention: bool | None,
    prefix_cache_entries: int | None,
    roles: Mapping | None,
) -> None:
    """Raise unless ``HFEngine(batch_invariant=True)`` can hold its promise with these settings."""
    if not possible(device):
        raise ValueError(
            f"HFEngine(batch_invariant=True) decodes bitwise the same in any batch on the CPU at one torch "
            f"thread; this engine runs on {device.type} at {torch.get_num_threads()} thread(s) "
            "(trainer.deterministic then decodes one request at a time)"
        )
    if roles is not None:
        raise ValueError(
            "HFEngine(batch_invariant=True) serves one policy: with several roles peft runs each adapter's "
            "rows as a product of their own, whose row count (and so each row's rounding) depends on the batch"
        )
    if not plain_sdpa:
        raise ValueError(
            "HFEngine(batch_invariant=True) attends row by row through the sdpa route: the model needs "
            "attn_implementation='sdpa' and plain softmax attention in every layer"
        )
    if cascade_attention or prefix_cache_entries:
        raise ValueError(
            "HFEngine(batch_invariant=True) shares no prompt (that depends on what else arrived) and keeps "
            "every finished turn until the weights change (an eviction would depend on arrival): leave "
            "cascade_attention unset and prefix_cache_entries unset (or 0: no reuse)"
        )
