"""Batch-invariant decoding (the deterministic mode's HF engine): a row's tokens and log-probs do not
depend on which rows share its batch, so requests decode together and the result is still a function
of each request alone.

What breaks invariance in a plain batched decode, measured on this machine with MKL in its
reproducible mode at one thread, as ``trainer.deterministic`` runs:

- **the matmuls**: with ``MKL_CBWR=AUTO`` (the mode's default) a row of ``x @ W.T`` is bitwise the
  same for every row count M of at least 16, wherever the row sits, for each of SmolLM2's projections
  and its LM head (at least 6 for the tiny model's 128-wide ones); fewer rows take other kernels and
  round otherwise. With ``COMPATIBLE``: every M that is a multiple of 4 and at least 8. At two threads
  the result depends on M up to 57 rows for some shapes: invariance is for one thread only, and
  ``HFEngine`` refuses more.
- **the attention**: a left-padded batch puts a row's keys at an offset set by the longest row, and
  the kernel's blocking over keys then sums them in another order.
- **shared work**: a prompt prefilled together with others is padded; a prompt shared by several rows
  attended as one block (``agent_r1.rollout.cascade``), or a stored turn's KV reused, depends on what
  else arrived.

So, in this mode (``Scheduler(batch_invariant=True)``):

- the distinct prompts are prefilled packed, one after another in one row (no padding), each
  attending causally to its own tokens alone (``Segments``), the row padded to at least ``MIN_ROWS``
  tokens and the LM head run on at least ``MIN_ROWS`` positions: every token's result is a function
  of its own prompt. (Prefilling each prompt in a forward of its own cost ~4 ms a forward on the
  tiny model: 2-3 s of a quickstart step's 512 prompts);
- the decode batch is padded with idle rows to at least ``MIN_ROWS`` and a multiple of
  ``ROW_MULTIPLE`` (``DecodeBatch``), a row count whose rows are invariant under both modes; the
  engine checks this for its model's matmul shapes when it starts (``matmuls_invariant``), since
  another CPU or MKL may pick its kernels otherwise;
- each row attends to its own keys alone (``rowwise_attention``: one kernel call per row and layer);
- there are no blocks and no prefix reuse (the engine builder turns the store off).

Element-wise operations and the per-row reductions (RMS norm, the softmax over the vocabulary, the
sampler's cumulative sum) compute each row alone at one thread. ``tests/test_rollout_batch_invariant.py``
checks the whole: a seeded request's tokens and log-probs, bitwise, alone and among others that join
and leave at other times.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from agent_r1.models.attention import refuse_unplain, route_sdpa

__all__ = [
    "MIN_ROWS",
    "ROW_MULTIPLE",
    "RowSpans",
    "Segments",
    "install",
    "matmuls_invariant",
    "padded_rows",
    "refuse_unless_invariant",
    "rowwise_attention",
]

MIN_ROWS = 16
ROW_MULTIPLE = 8
"""The decode batch's row count is at least ``MIN_ROWS`` and a multiple of ``ROW_MULTIPLE`` (idle rows
fill it): see the module docstring."""


def padded_rows(rows: int) -> int:
    """The row count a batch of ``rows`` rows decodes at."""
    return max(MIN_ROWS, -(-rows // ROW_MULTIPLE) * ROW_MULTIPLE)


def matmuls_invariant(model: torch.nn.Module, capacity: int) -> bool:
    """Whether every distinct weight shape of ``model``'s linear layers (the LM head included) gives
    each row the same bits at every padded row count up to ``capacity``'s, wherever the row sits:
    random rows, compared with one product over all of them."""
    shapes = {m.weight.shape for m in model.modules() if isinstance(m, torch.nn.Linear)}
    most = padded_rows(capacity)
    dtype = next(model.parameters()).dtype
    generator = torch.Generator().manual_seed(0)
    for shape in shapes:
        weight = torch.randn(shape, generator=generator, dtype=dtype)
        x = torch.randn(most, shape[1], generator=generator, dtype=dtype)
        whole = torch.nn.functional.linear(x, weight)
        for rows in range(MIN_ROWS, most + 1, ROW_MULTIPLE):
            for start in {0, most - rows}:
                part = torch.nn.functional.linear(x[start : start + rows], weight)
                if not torch.equal(part, whole[start : start + rows]):
                    return False
    return True


@dataclass(frozen=True)
class RowSpans:
    """A decode step's rows' own key counts: row ``i`` attends to the last ``spans[i]`` columns of the
    cache (its own tokens, contiguous at the right since nothing is reused); 0 for an idle row."""

    spans: Sequence[int]


@dataclass(frozen=True)
class Segments:
    """A packed prefill's single row: ``lengths[i]`` tokens of prompt ``i``, one prompt after another,
    each attending causally to its own tokens alone."""

    lengths: Sequence[int]


def rowwise_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    *,
    rowwise: RowSpans | Segments,
    **kwargs,
) -> tuple[Tensor, None]:
    """Hugging Face's attention-function contract, ``query`` (B, H, S, D), ``key`` / ``value`` (B, KV,
    T, D) -> (B, S, H, D), each problem over its own keys alone so that its output is the same
    whatever else is in the forward: a decode step (``RowSpans``, S = 1) attends each row's query to
    its own keys (an idle row's output is zeros); a packed prefill (``Segments``, B = 1) each prompt's
    queries causally to its own keys."""
    refuse_unplain("batch-invariant decoding", kwargs, "trainer.deterministic: false")
    if dropout:
        raise ValueError("batch-invariant decoding runs without dropout (the engine's model is in eval mode)")
    if isinstance(rowwise, Segments):
        return _segment_attention(query, key, value, rowwise.lengths, scaling), None
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


def _segment_attention(query: Tensor, key: Tensor, value: Tensor, lengths, scaling) -> Tensor:
    _, heads, tokens, dim = query.shape
    out = query.new_empty(1, tokens, heads, dim)
    start = 0
    for length in lengths:
        own = slice(start, start + length)
        out[0, own] = torch.nn.functional.scaled_dot_product_attention(
            query[:, :, own], key[:, :, own], value[:, :, own], is_causal=True, scale=scaling, enable_gqa=True
        )[0].transpose(0, 1)
        start += length
    return out


def packed_prefill(model, prompts: Sequence[Sequence[int]], cache_kwarg: str, new_cache, adapter_kwargs):
    """Prefill ``prompts`` packed in one row (``Segments``), padded to ``padded_rows`` tokens; return
    the next-token logits of each prompt's last position (P, V) and each prompt's own keys and values
    per layer, each (KV, L, D)."""
    lengths = [len(p) for p in prompts]
    total = sum(lengths)
    width = padded_rows(total)
    spans = lengths + ([width - total] if width > total else [])  # the padding: a prompt of its own
    ids = [t for p in prompts for t in p] + [0] * (width - total)
    positions = [i for n in spans for i in range(n)]
    ends = torch.tensor(lengths).cumsum(0) - 1
    keep = torch.cat([ends, ends[:1].expand(padded_rows(len(prompts)) - len(prompts))])  # >= MIN_ROWS rows
    device = next(model.parameters()).device
    cache = new_cache
    out = model(
        input_ids=torch.tensor([ids], device=device),
        attention_mask=torch.ones(1, width, dtype=torch.long, device=device),  # no packed-mask detection
        position_ids=torch.tensor([positions], device=device),
        use_cache=True,
        logits_to_keep=keep.to(device),
        rowwise=Segments(spans),
        **{cache_kwarg: cache},
        **adapter_kwargs,
    )
    starts = (ends + 1 - torch.tensor(lengths)).tolist()
    kv = [
        [(layer.keys[0, :, s : s + n], layer.values[0, :, s : s + n]) for layer in cache.layers]
        for s, n in zip(starts, lengths, strict=True)
    ]
    return out.logits[0, : len(prompts)], kv


def install() -> None:
    """Route Hugging Face ``sdpa`` forwards that carry ``rowwise=`` through ``rowwise_attention``."""
    route_sdpa("rowwise", rowwise_attention)


def refuse_unless_invariant(device: torch.device) -> None:
    """Raise unless this process decodes batch-invariantly: on the CPU at one torch thread (what was
    measured; a GPU's matmul kernels change with the row count, and so do MKL's at two threads)."""
    if device.type != "cpu" or torch.get_num_threads() != 1:
        raise ValueError(
            f"HFEngine(batch_invariant=True) decodes bitwise the same in any batch on the CPU at one torch "
            f"thread; this engine runs on {device.type} at {torch.get_num_threads()} thread(s) "
            "(trainer.deterministic then decodes one request at a time)"
        )
