"""Attention by segments: a packed micro-batch's attention at the cost of its sequences, not its rows.

A packed row (``agent_r1.train.batching``) holds several sequences side by side, or a prefix tree whose
members each add a segment after the tokens they share. Run with one mask over the row, attention
costs (row width)^2 query-key pairs whatever the mask allows: a kernel given an arbitrary mask computes
every pair and discards the masked ones. On the quickstart's multi-turn batches a tree spans a whole
GRPO group (a 183-token prompt and eight ~200-token branches: rows of ~1,900 tokens), so ~85% of the
pairs computed were masked.

Here every segment is its own attention problem instead. A segment that shares nothing (a plain
sequence, a tree's root) is a *run*: causal attention over a view of its own tokens, which the kernel
computes block-causally (no gathered copies, no mask). A segment with ancestors attends to the tokens
it shares with them (gathered from wherever the row holds them) and causally to its own; such
segments of similar size are stacked into one ``scaled_dot_product_attention`` call each
(``SegmentBucket``), padded to the bucket's longest, and the outputs are gathered back into the row
layout (without trees, the runs' outputs are the row layout already, in order). The pairs computed are
then each segment's (ancestors + own length) x own length, plus the bucket padding, and the result is
the masked attention's: the same softmax over the same keys for every query (tested against the dense
mask, forward and backward). A padding token of a row attends to nothing and gets a zero output (its
logits are never scored).

Installed as a wrapper around Hugging Face's ``sdpa`` attention function (``install``): a forward
that passes ``segment_attention=`` (the micro-batch's plan) takes this path, every other forward, the
engine's included, runs plain ``sdpa`` unchanged. Models whose attention is not plain softmax over
the mask (a sliding window, logit soft-capping, attention sinks) are refused rather than computed
wrongly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from agent_r1.models.attention import refuse_unplain, route_sdpa

__all__ = [
    "BUCKET_OVERHEAD_PAIRS",
    "CHUNK_QUERIES",
    "SegmentAttention",
    "SegmentBucket",
    "Segment",
    "applies",
    "install",
    "plan_segments",
    "segment_attention_forward",
]

BUCKET_OVERHEAD_PAIRS = 2**16
"""The cost of one more attention call, in query-key pairs (gathers, a kernel launch): the bucketing
(``plan_segments``) splits segments into another call when that saves more padded pairs than this."""


CHUNK_QUERIES = 64
"""Queries per chunk of a long segment (``plan_segments``): a segment's own tokens attend causally,
so of its own query-key pairs a kernel given a mask computes twice what is used; in chunks that
waste is one chunk's. Smaller chunks gather more keys (each chunk its own copy of what it sees).
64 was the fastest of 32, 64, 128, 256 and unchunked on the quickstart's multi-turn batches
(2-core CPU)."""


def applies(kernel: str, device: torch.device | str) -> bool:
    """Whether the learner runs attention by segments: SDPA models on the CPU. Elsewhere it is not
    measured yet (on CUDA the gathered keys of every chunk would also be saved for the backward),
    and the dense tree mask runs as before."""
    return kernel == "sdpa" and torch.device(device).type == "cpu"


@dataclass(frozen=True)
class Segment:
    """A run of ``length`` query tokens at ``start`` in the flattened (B*T) micro-batch, attending to
    the tokens at ``ancestors`` (flat indices, earlier in the same row) and causally to its own."""

    start: int
    length: int
    ancestors: Tensor  # (A,) long


@dataclass(frozen=True)
class SegmentBucket:
    """Segments stacked for one attention call: N segments padded to S queries and K = A + S keys
    (their ancestors padded to A, then their own tokens).

    ``query_index_NS`` / ``key_index_NK``: flat (B*T) indices of every query and key slot (padding
    slots point at a real token and are masked). ``mask_N1SK``: which key each query attends to.
    ``query_valid_NS``: the slots that are real queries.
    """

    query_index_NS: Tensor
    key_index_NK: Tensor
    mask_N1SK: Tensor
    query_valid_NS: Tensor


@dataclass(frozen=True)
class SegmentAttention:
    """A micro-batch's attention plan: its runs (segments without ancestors, as flat ``(start,
    length)`` in position order), its buckets, and, for each of the B*T positions, where its output is
    among the buckets' real queries and then the runs' queries concatenated (``len`` of them: a
    padding position gets the zero row after them). Without buckets that index is not needed: the
    runs and the zero rows of the padding between them are the row layout in order."""

    buckets: tuple[SegmentBucket, ...]
    output_index_BT: Tensor  # (B*T,) long
    runs: tuple[tuple[int, int], ...] = ()

    def to(self, device: torch.device | str) -> SegmentAttention:
        buckets = tuple(
            SegmentBucket(
                b.query_index_NS.to(device),
                b.key_index_NK.to(device),
                b.mask_N1SK.to(device),
                b.query_valid_NS.to(device),
            )
            for b in self.buckets
        )
        return SegmentAttention(buckets, self.output_index_BT.to(device), self.runs)


def _bucket_splits(sizes: Sequence[tuple[int, int]], overhead: int) -> list[tuple[int, int]]:
    """Contiguous ranges [i, j) of ``sizes`` (ancestors, length; sorted by their sum) minimising the
    padded pairs ``count x S x (A + S)`` of every range plus ``overhead`` per range.

    A dynamic programme over classes of segments whose sums are within 5% of each other (a range
    never splits a class), so it is quadratic in the classes (at most ~170 up to 4096 tokens), not in
    the segments.
    """
    classes: list[list[int]] = []  # [first, count, most ancestors, most length]
    last_key = None
    for i, (a, s) in enumerate(sizes):
        key = int(math.log(max(a + s, 1)) / math.log(1.05))
        if key != last_key:
            classes.append([i, 0, 0, 0])
            last_key = key
        c = classes[-1]
        c[1], c[2], c[3] = c[1] + 1, max(c[2], a), max(c[3], s)
    n = len(classes)
    best = [0.0] + [math.inf] * n
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        count = most_a = most_s = 0
        for i in range(j - 1, -1, -1):
            _, c_count, c_a, c_s = classes[i]
            count, most_a, most_s = count + c_count, max(most_a, c_a), max(most_s, c_s)
            cost = best[i] + count * most_s * (most_a + most_s) + overhead
            if cost < best[j]:
                best[j], cut[j] = cost, i
    ranges, j = [], n
    while j > 0:
        i = cut[j]
        ranges.append((classes[i][0], classes[j][0] if j < n else len(sizes)))
        j = i
    return ranges[::-1]


def _chunks(segment: Segment, queries: int) -> list[Segment]:
    """``segment`` as runs of at most ``queries`` queries, each attending to the segment's ancestors
    and its own tokens before it as ancestors: the same attention, with the causal half of a long
    segment's own pairs (masked, yet computed) cut down to that of each chunk."""
    if segment.length <= queries:
        return [segment]
    own = torch.arange(segment.start, segment.start + segment.length)
    return [
        Segment(segment.start + k, min(queries, segment.length - k), torch.cat([segment.ancestors, own[:k]]))
        for k in range(0, segment.length, queries)
    ]


def plan_segments(
    segments: Sequence[Segment],
    num_positions: int,
    *,
    overhead: int = BUCKET_OVERHEAD_PAIRS,
    chunk_queries: int | None = None,
) -> SegmentAttention:
    """Plan ``segments`` (covering some of ``num_positions`` flat positions, each at most once): those
    without ancestors become runs, the others are cut into chunks of at most ``chunk_queries`` queries
    (None: whole) and bucketed."""
    runs = tuple(sorted((s.start, s.length) for s in segments if len(s.ancestors) == 0))
    segments = [s for s in segments if len(s.ancestors) > 0]
    if chunk_queries is not None:
        segments = [c for s in segments for c in _chunks(s, chunk_queries)]
    order = sorted(range(len(segments)), key=lambda i: (len(segments[i].ancestors) + segments[i].length, i))
    sizes = [(len(segments[i].ancestors), segments[i].length) for i in order]
    buckets, sources = [], []
    for lo, hi in _bucket_splits(sizes, overhead):
        members = [segments[i] for i in order[lo:hi]]
        A = max(len(s.ancestors) for s in members)
        S = max(s.length for s in members)
        n = len(members)
        ancestors_NA = torch.zeros(n, A, dtype=torch.long)
        own_N = torch.tensor([s.length for s in members])
        n_ancestors_N = torch.tensor([len(s.ancestors) for s in members])
        for k, s in enumerate(members):
            ancestors_NA[k, : len(s.ancestors)] = s.ancestors
        starts_N = torch.tensor([s.start for s in members])
        slot_S = torch.arange(S)
        query_valid_NS = slot_S[None, :] < own_N[:, None]
        # A padding slot points at the segment's first token: real, and masked wherever it is unused.
        query_index_NS = starts_N[:, None] + torch.where(query_valid_NS, slot_S[None, :], 0)
        ancestor_valid_NA = torch.arange(A)[None, :] < n_ancestors_N[:, None]
        ancestors_NA = torch.where(ancestor_valid_NA, ancestors_NA, starts_N[:, None])
        key_index_NK = torch.cat([ancestors_NA, query_index_NS], dim=1)
        causal_SS = slot_S[:, None] >= slot_S[None, :]
        own_NSS = causal_SS[None] & query_valid_NS[:, None, :]
        mask_NSK = torch.cat([ancestor_valid_NA[:, None, :].expand(n, S, A), own_NSS], dim=2)
        # A padding query attends to its segment's first token, so that no softmax row is empty (an
        # empty one is NaN, and NaN reaches the gradients even through a zero output gradient).
        mask_NSK[:, :, A] |= ~query_valid_NS
        buckets.append(SegmentBucket(query_index_NS, key_index_NK, mask_NSK[:, None], query_valid_NS))
        sources.append(query_index_NS[query_valid_NS])
    sources += [torch.arange(start, start + length) for start, length in runs]
    flat_sources = torch.cat(sources) if sources else torch.zeros(0, dtype=torch.long)
    output_index_BT = torch.full((num_positions,), len(flat_sources), dtype=torch.long)
    if len(torch.unique(flat_sources)) != len(flat_sources):
        raise ValueError("plan_segments: segments overlap (a position is in two segments)")
    output_index_BT[flat_sources] = torch.arange(len(flat_sources))
    return SegmentAttention(tuple(buckets), output_index_BT, runs)


def segment_attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    *,
    segment_attention: SegmentAttention,
    **kwargs,
) -> tuple[Tensor, None]:
    """Hugging Face's attention-function contract: ``query`` (B, H, T, D), ``key`` / ``value``
    (B, KV, T, D) -> output (B, T, H, D). ``attention_mask`` is ignored: the plan is the mask."""
    refuse_unplain(
        "segment attention", kwargs, "set trainer.share_prefixes: false or another attn_implementation"
    )
    B, H, T, D = query.shape
    kv_heads = key.shape[1]
    query_PHD = query.transpose(1, 2).reshape(B * T, H, D)
    key_PKD = key.transpose(1, 2).reshape(B * T, kv_heads, D)
    value_PKD = value.transpose(1, 2).reshape(B * T, kv_heads, value.shape[-1])
    outputs = []
    for bucket in segment_attention.buckets:
        q = query_PHD[bucket.query_index_NS].transpose(1, 2)  # (N, H, S, D)
        k = key_PKD[bucket.key_index_NK].transpose(1, 2)  # (N, KV, K, D)
        v = value_PKD[bucket.key_index_NK].transpose(1, 2)
        out = torch.nn.functional.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=bucket.mask_N1SK,
            dropout_p=dropout,
            scale=scaling,
            enable_gqa=kv_heads != H,
        )
        outputs.append(out.transpose(1, 2)[bucket.query_valid_NS])  # (real queries, H, Dv)
    ordered = not segment_attention.buckets  # the runs' outputs, with zeros between, are the layout
    end = 0  # flat position where the last run ended
    for start, length in segment_attention.runs:
        row, at = divmod(start, T)
        if ordered and start > end:
            outputs.append(query_PHD.new_zeros(start - end, H, value.shape[-1]))  # padding
        out = torch.nn.functional.scaled_dot_product_attention(
            query[row : row + 1, :, at : at + length],
            key[row : row + 1, :, at : at + length],
            value[row : row + 1, :, at : at + length],
            dropout_p=dropout,
            is_causal=True,
            scale=scaling,
            enable_gqa=kv_heads != H,
        )
        outputs.append(out[0].transpose(0, 1))  # (length, H, Dv)
        end = start + length
    if ordered:
        if end < B * T:
            outputs.append(query_PHD.new_zeros(B * T - end, H, value.shape[-1]))
        return torch.cat(outputs).reshape(B, T, H, -1), None
    outputs.append(query_PHD.new_zeros(1, H, value.shape[-1]))  # the padding positions' output
    out_PHD = torch.cat(outputs)[segment_attention.output_index_BT]
    return out_PHD.reshape(B, T, H, -1), None


def install() -> None:
    """Route Hugging Face ``sdpa`` forwards that carry ``segment_attention=`` through
    ``segment_attention_forward``; all others run the ``sdpa`` function as registered before.
    Idempotent."""
    # looked up at each call, not bound now, so that the module's function can be wrapped (tests count calls)
    route_sdpa("segment_attention", lambda *args, **kwargs: segment_attention_forward(*args, **kwargs))
