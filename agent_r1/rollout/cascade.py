"""Cascade attention for the HF engine's batch: each row's attention in parts, merged exactly.

A decode batch is left-padded: every row's keys sit right-aligned in one (B, KV, T, D) cache as wide
as the longest row, and a GRPO group's ``rollout.n`` rows each hold a copy of their shared prompt. On
the quickstart's race (128 rows, 183-token prompts, episodes of up to ~450 own tokens) attention over
that cache was 40% of the rollout, and under a quarter of what it read were real, distinct keys.

Here a row's attention runs in parts, each over keys read once, merged by their log-sum-exps (the
softmax over the keys of all parts, equal up to float rounding), as in cascade / shared-prefix
attention (FlashInfer's cascade inference, Hydragen):

- **blocks**: a prompt that several rows share is held once ("block") and left out of their cache.
  The queries of all rows of a block are stacked into one problem against the block's keys (no mask
  between them is needed: every block token precedes every row's own tokens).
- **window** (decode steps): every row attends densely to the last ``recent`` columns of the cache;
  only the rows that reach further back (the few long episodes) attend to the older columns, gathered
  for them alone (``choose_window``).
- each part's output ``o`` and log-sum-exp ``l`` combine as
  ``o = (o_1 * exp(l_1) + o_2 * exp(l_2)) / (exp(l_1) + exp(l_2))``.

Installed as a route of Hugging Face's ``sdpa`` attention function (``install``): a forward that
passes ``cascade=`` (a ``CascadePlan``) takes this path, every other forward runs what was registered
before. Models whose attention is not plain softmax over the mask (a sliding window, logit
soft-capping, attention sinks) never get a plan (``plain_attention``).

A narrow KV cache (the HF engine's bf16 sampler on the CPU keeps its keys and values in bf16,
``agent_r1.rollout.kv_cache``) is attended here in every forward, with an empty plan where there is
nothing to split: the queries are rounded to the cache's type, a decode step's products compute in
it (``_attend``), the log-sum-exps and merges stay fp32, and the output comes back in the queries'
type.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from agent_r1.models.attention import refuse_unplain, route_sdpa

__all__ = [
    "Block",
    "BlockPlan",
    "BlockStacks",
    "CascadePlan",
    "Window",
    "block_plan",
    "cascade_attention",
    "choose_window",
    "install",
    "left_pad",
    "plain_attention",
]

GATHER_COST = 3
"""What a key read through a gather costs against one read in place (``choose_window``): it is copied
(read, written) and then read by the attention."""


NARROW_PRODUCT_QUERIES = 16
"""Up to this many queries per KV head and row, a narrow (bf16 / fp16) KV cache is attended through
batched products rather than the CPU flash kernel (``_attend``)."""


class Block:
    """A prompt prefix's keys and values, per layer (KV heads, L, D), shared by the rows that extend
    it. Identity matters (plans group rows by the block object); the tensors are never written."""

    __slots__ = ("keys", "length", "values")

    def __init__(self, keys: list[Tensor], values: list[Tensor]) -> None:
        self.keys, self.values = keys, values
        self.length = keys[0].shape[1]


@dataclass(frozen=True)
class BlockPlan:
    """The blocks of one forward's rows: the distinct blocks stacked left-padded per layer
    (``keys[layer]``: (NB, KV, L, D)) with ``mask_NB11L`` (additive: 0 or the dtype's min), and which
    rows read each: ``index_NR`` (NB, R) row ids (padding slots repeat a real row), ``valid_NR``, and
    ``rows_N``, the valid row ids in ``index_NR[valid_NR]`` order."""

    keys: tuple[Tensor, ...]
    values: tuple[Tensor, ...]
    mask_NB11L: Tensor
    index_NR: Tensor
    valid_NR: Tensor
    rows_N: Tensor


def plain_attention(config) -> bool:
    """Whether a model's attention is plain softmax over its mask in every layer (no sliding window,
    soft-capping or sinks), so that a block can be attended apart from a row's own tokens."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    sliding = getattr(config, "sliding_window", None) is not None and getattr(
        config, "use_sliding_window", True
    )
    return (
        all(t == "full_attention" for t in layer_types)
        and not sliding
        and getattr(config, "attn_logit_softcapping", None) is None
        and getattr(config, "model_type", "") not in ("gpt_oss",)  # attention sinks
    )


def left_pad(tensor: Tensor, length: int, dim: int) -> Tensor:
    """``tensor`` left-padded with zeros along ``dim`` to ``length``."""
    missing = length - tensor.shape[dim]
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)


class BlockStacks:
    """The last stacking of a set of blocks, reused while a batch's set of blocks is unchanged (it
    changes only when rows join or the batch is compacted, not at every decode step)."""

    def __init__(self) -> None:
        self.blocks: tuple[Block, ...] = ()
        self.stacked: tuple[tuple[Tensor, ...], tuple[Tensor, ...], Tensor] | None = None

    def get(self, blocks: tuple[Block, ...], dtype: torch.dtype):
        if (
            self.stacked is None
            or len(blocks) != len(self.blocks)
            or any(a is not b for a, b in zip(blocks, self.blocks, strict=True))
        ):
            length = max(b.length for b in blocks)
            keys, values = (
                tuple(
                    torch.stack([left_pad(per_layer[layer], length, 1) for per_layer in tensors])
                    for layer in range(len(tensors[0]))
                )
                for tensors in ([b.keys for b in blocks], [b.values for b in blocks])
            )
            lengths = torch.tensor([b.length for b in blocks], device=keys[0].device)
            padding = torch.arange(length, device=keys[0].device)[None, :] < (length - lengths)[:, None]
            mask = torch.zeros(len(blocks), 1, 1, length, dtype=dtype, device=keys[0].device)
            mask.masked_fill_(padding[:, None, None, :], torch.finfo(dtype).min)
            self.blocks, self.stacked = blocks, (keys, values, mask)
        return self.stacked


def block_plan(
    row_blocks: Sequence[Block | None], stacks: BlockStacks, dtype: torch.dtype
) -> BlockPlan | None:
    """The plan for a forward whose row ``i`` extends ``row_blocks[i]`` (None: no block); None when no
    row has one."""
    members: dict[int, tuple[Block, list[int]]] = {}
    for row, block in enumerate(row_blocks):
        if block is not None:
            members.setdefault(id(block), (block, []))[1].append(row)
    if not members:
        return None
    blocks = tuple(block for block, _ in members.values())
    keys, values, mask = stacks.get(blocks, dtype)
    width = max(len(rows) for _, rows in members.values())
    index = torch.tensor([rows + [rows[0]] * (width - len(rows)) for _, rows in members.values()])
    valid = torch.tensor([[True] * len(rows) + [False] * (width - len(rows)) for _, rows in members.values()])
    device = keys[0].device
    return BlockPlan(keys, values, mask, index.to(device), valid.to(device), index[valid].to(device))


@dataclass(frozen=True)
class Window:
    """A decode step's split of the rows' own keys: every row attends to the last ``recent`` columns;
    the rows ``rows_M`` also to the ``width - recent`` columns before them."""

    recent: int
    width: int
    rows_M: Tensor


@dataclass(frozen=True)
class CascadePlan:
    """What ``cascade_attention`` needs besides a layer's own keys: the rows' blocks and / or the
    decode step's window (either may be None)."""

    blocks: BlockPlan | None = None
    window: Window | None = None


def choose_window(spans: Sequence[int]) -> tuple[int, list[int]] | None:
    """The split of a decode step's own keys that reads the fewest: ``spans[i]``, how many of the last
    columns row ``i``'s own tokens span (0: a finished row). Returns ``(recent,
    long_rows)``: every row reads the last ``recent`` columns, the ``long_rows`` also the columns back
    to the longest span, at ``GATHER_COST`` each; or None when one dense read of the longest span is
    cheapest."""
    order = sorted(range(len(spans)), key=lambda i: spans[i], reverse=True)
    longest = spans[order[0]]
    best_cost, best = len(spans) * longest, None
    for k in range(1, len(order)):
        recent = max(spans[order[k]], 1)
        cost = len(spans) * recent + GATHER_COST * k * (longest - recent)
        if cost < best_cost:
            best_cost, best = cost, (recent, order[:k])
    return best


def _attend(
    query: Tensor, key: Tensor, value: Tensor, mask: Tensor, scaling: float, narrow: bool = False
) -> tuple[Tensor, Tensor]:
    """Softmax attention with its log-sum-exp: query (N, KV, Q, D) against key / value (N, KV, K, D)
    under an additive ``mask`` broadcast to (N, KV, Q, K); -> output (N, KV, Q, D), lse (N, KV, Q).

    On the CPU, PyTorch's flash kernel in the tensors' type (a model whose parameters are bf16
    attends in bf16 there, as before). A narrow KV cache under fp32 queries (``narrow``: the engine's
    bf16 sampler over fp32 parameters) is attended there too when a row has many queries per KV head
    (a prefill's), over its keys and values widened to fp32: the flash kernel ran ~1.3x slower in
    bf16 than in fp32 at SmolLM2's prefill shapes. A decode step's
    few queries (at most ``NARROW_PRODUCT_QUERIES``) take the two batched products below in the
    narrow type instead: on contiguous keys the flash kernel ran 4-5x slower than oneDNN's bf16
    products (32 rows x 3 KV heads x 3 queries x 300 keys: ~2.7 ms against ~0.6 ms at one thread).
    The products write their scores in the narrow type (bf16 keeps 8 significant bits), then the
    softmax runs in fp32. The cache's keys are a view with spare columns, which the products would
    copy through a transposing copy per call: one plain copy first is several times cheaper, but it
    is still a copy of the layer's cache (why ``HFEngine(narrow_attention=...)`` is off by
    default)."""
    if query.device.type == "cpu":
        if narrow and query.shape[2] > NARROW_PRODUCT_QUERIES:
            query, key, value = query.float(), key.float(), value.float()
        if not narrow or query.dtype == torch.float32:
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                query, key, value, 0.0, False, attn_mask=mask.to(query.dtype), scale=scaling
            )
            return out, lse.float()
        key, value = key.contiguous(), value.contiguous()
    scores = torch.matmul(query, key.transpose(-1, -2)).float().mul_(scaling).add_(mask)
    peak = scores.amax(dim=-1, keepdim=True)
    weights = (scores - peak).exp_()
    total = weights.sum(dim=-1, keepdim=True)
    out = torch.matmul((weights / total).to(value.dtype), value)
    return out, (peak + total.log()).squeeze(-1)


def _additive_mask(attention_mask: Tensor | None, queries: int, keys: int, like: Tensor) -> Tensor:
    """The own part's mask as an additive (B or 1, 1, queries, keys) float mask. ``None`` (Hugging
    Face's "no padding, plain causal") is causal over the last ``queries`` keys."""
    blocked = torch.finfo(like.dtype).min
    if attention_mask is None:
        allowed = torch.ones(queries, keys, dtype=torch.bool, device=like.device).tril(keys - queries)
        attention_mask = allowed[None, None]
    if attention_mask.dtype == torch.bool:
        return torch.zeros(attention_mask.shape, dtype=like.dtype, device=like.device).masked_fill_(
            ~attention_mask, blocked
        )
    return attention_mask.to(like.dtype)


def _merge(
    out: Tensor, lse: Tensor, rows: Tensor, part_out: Tensor, part_lse: Tensor
) -> tuple[Tensor, Tensor]:
    """Fold a part computed for ``rows`` (output (N, KV, Q, D), lse (N, KV, Q)) into ``out`` / ``lse``."""
    mine_out, mine_lse = out[rows].float(), lse[rows]
    peak = torch.maximum(mine_lse, part_lse)
    mine_weight, part_weight = (mine_lse - peak).exp(), (part_lse - peak).exp()
    total = mine_weight + part_weight
    merged = (mine_out * mine_weight[..., None] + part_out.float() * part_weight[..., None]) / total[
        ..., None
    ]
    return out.index_put((rows,), merged.to(out.dtype)), lse.index_put((rows,), peak + total.log())


def _attend_blocks(
    query_BKQD: Tensor, plan: BlockPlan, layer: int, scaling: float, narrow: bool
) -> tuple[Tensor, Tensor]:
    """Every block's rows' queries against the block: -> output (N, KV, Q, D), lse (N, KV, Q) for the
    rows ``plan.rows_N``."""
    _, kv_heads, Q, D = query_BKQD.shape
    NB, R = plan.index_NR.shape
    query_NKQD = query_BKQD[plan.index_NR].permute(0, 2, 1, 3, 4).reshape(NB, kv_heads, R * Q, D)
    out, lse = _attend(query_NKQD, plan.keys[layer], plan.values[layer], plan.mask_NB11L, scaling, narrow)
    out = out.reshape(NB, kv_heads, R, Q, D).permute(0, 2, 1, 3, 4)[plan.valid_NR]
    return out, lse.reshape(NB, kv_heads, R, Q).permute(0, 2, 1, 3)[plan.valid_NR]


def cascade_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    *,
    cascade: CascadePlan,
    **kwargs,
) -> tuple[Tensor, None]:
    """Hugging Face's attention-function contract: ``query`` (B, H, S, D), ``key`` / ``value`` (B, KV,
    T, D): the rows' own keys (the cache without the blocks), ``attention_mask`` over them -> output
    (B, S, H, D), the attention over each row's block followed by its own keys."""
    refuse_unplain("cascade attention", kwargs, "HFEngine(cascade_attention=False)")
    if dropout:
        raise ValueError("cascade attention runs without dropout (the engine's model is in eval mode)")
    B, H, S, D = query.shape
    kv_heads, T = key.shape[1], key.shape[2]
    groups = H // kv_heads
    scaling = D**-0.5 if scaling is None else scaling
    # The query heads of one KV head stacked as that head's queries (grouped-query attention reads
    # each key once): (B, KV, G*S, D), slot g*S + s. A narrow KV cache (the engine's bf16 sampler on
    # the CPU) is attended in its type: the queries are rounded to it.
    narrow = key.dtype != query.dtype
    query_BKQD = query.reshape(B, kv_heads, groups * S, D).to(key.dtype)
    mask = _additive_mask(attention_mask, S, T, query)
    if S > 1 and groups > 1:
        mask = mask.repeat(1, 1, groups, 1)
    window = cascade.window
    if window is None:
        out, lse = _attend(query_BKQD, key, value, mask, scaling, narrow)
    else:
        recent = slice(T - window.recent, T)
        out, lse = _attend(
            query_BKQD, key[:, :, recent], value[:, :, recent], mask[..., recent], scaling, narrow
        )
        rows, older = window.rows_M, slice(T - window.width, T - window.recent)
        part = _attend(
            query_BKQD[rows],
            key[rows, :, older],
            value[rows, :, older],
            mask[rows][..., older],
            scaling,
            narrow,
        )
        out, lse = _merge(out, lse, rows, *part)
    if cascade.blocks is not None:
        out, lse = _merge(
            out,
            lse,
            cascade.blocks.rows_N,
            *_attend_blocks(query_BKQD, cascade.blocks, module.layer_idx, scaling, narrow),
        )
    return out.reshape(B, H, S, D).transpose(1, 2).to(query.dtype).contiguous(), None


def install() -> None:
    """Route Hugging Face ``sdpa`` forwards that carry ``cascade=`` through ``cascade_attention``; all
    others run the function registered before. Idempotent."""
    route_sdpa("cascade", cascade_attention)
