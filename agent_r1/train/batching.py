"""Trajectories -> training sequences -> token-budget micro-batches (docs/training.md, "Step-level
batching").

Step-level semantics at concatenation cost: when step t+1's prompt starts with step t's prompt +
response (the usual "append" context), both steps become ONE training sequence and each step keeps its
own span of response tokens (its loss mask and step index). A causal LM computes the same log-probs for
a token whatever follows it, so the merged sequence gives exactly the per-step log-probs while the shared
history is processed once instead of once per step (O(T) instead of O(T^2) tokens over T turns). When
the environment rewrites the context (a window, a summary), the prefix test fails and a new sequence
starts, so every layout the MDP allows stays exact.

Sequences are then packed first-fit-decreasing into rows no wider than the longest sequence, and the
rows into micro-batches under a token budget: in a row the sequences sit side by side with position ids
restarting at 0 for each, which Hugging Face models turn into a block-diagonal causal mask; a row's
padding is one more segment, never scored. Rows are capped because without a variable-length attention
kernel a packed row's attention costs (row width)^2 (``tests/test_batching.py`` checks the log-probs
and gradients against one unpadded forward per step).

Sequences that share a prefix — the samples of a GRPO group share their prompt, every group of a
micro-batch may share a system prompt and tool schema, and the steps of a rewritten context (a sliding
window, a summary, a re-rendered history) share their head and part of their history without
extending each other — can also share its computation (``share_prefixes``): a prefix trie over the
micro-batch's sequences lays every shared run of tokens out once, each member adding only the tokens
after its common prefix with the previous member, with positions continuing from there, and an
explicit attention mask lets each token see the earlier tokens of its own run and of all its
ancestors' runs only. A causal LM's log-probs of a token depend only on the tokens before it, so every
member's log-probs are exactly its own, and the gradients reaching a shared run are the sum of its
members'. Whether sequences are worth joining is decided by a cost model: a trie saves the shared
tokens, but its row is wider, and attention over a row costs (row width)^2
(``attention_pair_cost`` weighs one attention pair against one token's dense layers from the model's
dimensions).

Every per-token quantity of a batch (old log-probs, advantages, masks) lives in one flat "token order":
step rows in order, each row's response tokens in order. ``StepRows`` gives each row's offset into it;
a micro-batch carries the flat indices of the tokens it scores, so losses computed per micro-batch are
gathered from and scattered to the same flat arrays regardless of the layout.

These are the building blocks; ``agent_r1.train.batch.build_batch`` (``batch_of`` for trajectories
outside groups) composes them into a step's batch and is the one way trajectories become training
data.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from agent_r1.train import segment_attention
from agent_r1.train.segment_attention import Segment, SegmentAttention, plan_segments
from agent_r1.types import Step, Trajectory

__all__ = [
    "SOFTMAX_MACS",
    "MicroBatch",
    "PrefixTree",
    "StepRows",
    "StepSpan",
    "TrainSequence",
    "TreeLayout",
    "attention_pair_cost",
    "count_tokens",
    "pack_sequences",
    "pack_trees",
    "share_prefixes",
    "trajectory_sequences",
]


@dataclass(frozen=True)
class StepSpan:
    """Where the response of step row ``row`` lies inside a training sequence."""

    row: int  # index of the step in the batch's flat step order
    start: int  # position of the first response token in the sequence
    length: int


@dataclass(frozen=True)
class TrainSequence:
    """One forward sequence: a prompt, then one or more steps' responses (with the tokens between)."""

    token_ids: tuple[int, ...]
    spans: tuple[StepSpan, ...]

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class StepRows:
    """The flat step order of a batch: which trajectory each step row belongs to, and token offsets."""

    steps: tuple[Step, ...]
    trajectory_index: tuple[int, ...]  # row -> index of its trajectory in the batch
    offsets: tuple[int, ...]  # row -> offset of its first response token in the flat token order

    @property
    def num_tokens(self) -> int:
        return self.offsets[-1] + len(self.steps[-1].response_ids) if self.steps else 0

    def token_index(self, row: int) -> range:
        return range(self.offsets[row], self.offsets[row] + len(self.steps[row].response_ids))


def trajectory_sequences(
    trajectory: Trajectory, first_row: int, *, merge: bool = True
) -> list[TrainSequence]:
    """The training sequences of one trajectory whose first step is step row ``first_row``; with
    ``merge``, prefix-extending steps share one (``agent_r1.train.batch.build_batch`` numbers the rows
    of a whole batch). Steps without response tokens get no span (nothing to score) but still extend
    a merged sequence."""
    sequences: list[TrainSequence] = []
    tokens: list[int] = []
    spans: list[StepSpan] = []
    for row, step in enumerate(trajectory.steps, first_row):
        prompt = step.prompt_ids
        extends = merge and tokens and len(prompt) >= len(tokens) and tuple(tokens) == prompt[: len(tokens)]
        if not extends and tokens:
            sequences.append(TrainSequence(tuple(tokens), tuple(spans)))
            tokens, spans = [], []
        tokens.extend(prompt[len(tokens) :])
        if not tokens:
            raise ValueError(f"step row {row} has an empty prompt: nothing to condition on")
        if step.response_ids:
            spans.append(StepSpan(row, len(tokens), len(step.response_ids)))
        tokens.extend(step.response_ids)
    if tokens:
        sequences.append(TrainSequence(tuple(tokens), tuple(spans)))
    return [s for s in sequences if s.spans]


def count_tokens(units: Sequence[TrainSequence | PrefixTree]) -> int:
    """Tokens a forward pass processes for these sequences or trees (a tree's trunk counts once)."""
    return sum(len(u) for u in units)


@dataclass(frozen=True)
class TreeLayout:
    """A prefix tree laid out as one run of tokens (its ``len``), in the tree's member order.

    ``member_index[i]``: for each token of member i, its index in the run (two members share a token
    exactly where their indices are equal). ``visible_until_L``: a token at index k is attended to by
    the queries at indices k..visible_until_L[k]-1 and by no others: the rest of its own segment and
    the segments of every later member that shares it (they follow it contiguously).
    """

    token_ids_L: torch.Tensor  # (L,)
    position_ids_L: torch.Tensor  # (L,) the token's position in every member holding it
    visible_until_L: torch.Tensor  # (L,)
    member_index: tuple[torch.Tensor, ...]  # member i -> (len(member),) indices into the run


@dataclass(frozen=True)
class PrefixTree:
    """Sequences laid out as a trie: member i's first ``branch_at[i]`` tokens are the previous
    member's (computed once, where that member has them), and only its remaining tokens are laid out,
    as its segment, with positions continuing from ``branch_at[i]``.

    A trie node is then a run of tokens held by a contiguous range of members: with members in token
    order (``share_prefixes``), what a member shares with any earlier one it shares with the previous
    one, so the segments form a pre-order walk of the trie. ``branch_at[0]`` is 0; any
    ``branch_at[i]`` up to the common prefix of members i-1 and i is exact (less shares less). A tree of
    one sequence is that sequence, unchanged.
    """

    members: tuple[TrainSequence, ...]
    branch_at: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.members or len(self.branch_at) != len(self.members) or self.branch_at[0] != 0:
            raise ValueError(
                f"PrefixTree: need one branch_at per member starting at 0, got {len(self.members)} "
                f"members and branch_at {self.branch_at[:4]}"
            )
        for i in range(1, len(self.members)):
            common = _common_prefix(self.members[i - 1].token_ids, self.members[i].token_ids)
            if not 0 <= self.branch_at[i] <= common:
                raise ValueError(
                    f"PrefixTree: member {i} shares {common} leading tokens with member {i - 1}, "
                    f"so branch_at[{i}] must be in [0, {common}], got {self.branch_at[i]}"
                )

    def __len__(self) -> int:
        return sum(len(m) - b for m, b in zip(self.members, self.branch_at, strict=True))

    @property
    def trunk(self) -> int:
        """Leading tokens shared by every member (the trie's root run)."""
        return min(self.branch_at[1:], default=len(self.members[0]))

    def layout(self) -> TreeLayout:
        """The tree as one run of tokens, with where each member's tokens are and who sees whom."""
        starts, ends, index = [], [], []
        offset = 0
        for member, branch in zip(self.members, self.branch_at, strict=True):
            own = torch.arange(offset, offset + len(member) - branch)
            index.append(torch.cat([index[-1][:branch], own]) if index else own)
            starts.append(offset)
            offset += len(own)
            ends.append(offset)
        visible_until_L = torch.cat(
            [torch.full((e - s,), e, dtype=torch.long) for s, e in zip(starts, ends, strict=True)]
        )
        # Member j's token at position d is shared by members j+1..i while every branch point
        # between is beyond d; those members' segments follow j's, so its visibility reaches the end
        # of the last one. Depths shared further are a prefix of j's segment, narrowing as i grows.
        for j, (member, branch) in enumerate(zip(self.members, self.branch_at, strict=True)):
            reach = len(member)
            for i in range(j + 1, len(self.members)):
                reach = min(reach, self.branch_at[i])
                if reach <= branch:
                    break
                visible_until_L[starts[j] : starts[j] + reach - branch] = ends[i]
        return TreeLayout(
            token_ids_L=torch.tensor(
                [t for m, b in zip(self.members, self.branch_at, strict=True) for t in m.token_ids[b:]],
                dtype=torch.long,
            ),
            position_ids_L=torch.cat(
                [torch.arange(b, len(m)) for m, b in zip(self.members, self.branch_at, strict=True)]
            ),
            visible_until_L=visible_until_L,
            member_index=tuple(index),
        )


SOFTMAX_MACS = 192
"""Multiply-add equivalents per attention pair and head for the work around the two matmuls: scaling,
masking and softmax of every score, forward and backward. These are elementwise passes over the
(query, key) pairs that run far below matmul speed. Calibrated on the quickstart's RL batch on the
2-core CPU: 192 (4x the matmul-only cost of the tiny model's 32-wide heads) was the best of 1x to 32x,
with a forward + backward of 3.8 s against 4.9 s at 1x and 6.4 s without trees."""


def attention_pair_cost(config) -> float:
    """The cost of one attention (query, key) pair relative to one token's dense layers, from a
    Hugging Face config's dimensions (multiply-adds, summed over layers).

    Per layer a pair costs, per head, 2 x head_dim (its score and its share of the weighted values)
    plus ``SOFTMAX_MACS``. A token costs its projections (q, k, v, o), its gated MLP (3 matrices) and,
    once, the LM head.
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = text.hidden_size
    layers = text.num_hidden_layers
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    ffn = getattr(text, "intermediate_size", None) or 4 * hidden
    per_layer = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + 3 * hidden * ffn
    token = layers * per_layer + hidden * text.vocab_size
    return layers * heads * (2 * head_dim + SOFTMAX_MACS) / token


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def share_prefixes(
    sequences: Sequence[TrainSequence], *, pair_cost: float | None, max_width: int
) -> list[PrefixTree]:
    """Group ``sequences`` into prefix tries no wider than ``max_width`` tokens.

    Greedy over the sequences in token order (so that each shares with the previous one the most it
    shares with any earlier one): a sequence joins the current trie, adding only the tokens after its
    common prefix with the previous member, when that lowers the estimated cost
    ``tokens + pair_cost * width^2`` of the trie plus the sequence alone; otherwise it starts the next
    trie. A trie therefore spans every group of a micro-batch that shares a system prompt when the
    cost model allows, and steps of a rewritten context share their common head and history at every
    depth. Greedy, not optimal: a trie that stopped growing is not reopened, and sequences are not
    reordered to fill tries. ``pair_cost=None`` shares nothing (every sequence is its own tree).
    """
    if pair_cost is None:
        return [PrefixTree((s,), (0,)) for s in sequences]

    def cost(width: int) -> float:
        return width + pair_cost * width * width

    groups: list[tuple[list[TrainSequence], list[int], int]] = []  # (members, branch_at, width)
    for sequence in sorted(sequences, key=lambda s: s.token_ids):
        if groups:
            members, branch_at, width = groups[-1]
            shared = _common_prefix(members[-1].token_ids, sequence.token_ids)
            joined = width + len(sequence) - shared
            if shared and joined <= max_width and cost(joined) < cost(width) + cost(len(sequence)):
                members.append(sequence)
                branch_at.append(shared)
                groups[-1] = (members, branch_at, joined)
                continue
        groups.append(([sequence], [0], len(sequence)))
    return [PrefixTree(tuple(members), tuple(branch_at)) for members, branch_at, _ in groups]


def pack_sequences(units: Sequence, token_budget: int) -> list[list]:
    """First-fit decreasing bin packing by length; a unit longer than the budget gets its own bin.

    Units are anything with a length: training sequences or prefix trees.
    """
    bins: list[list] = []
    loads: list[int] = []
    for unit in sorted(units, key=len, reverse=True):
        for i, load in enumerate(loads):
            if load + len(unit) <= token_budget:
                bins[i].append(unit)
                loads[i] += len(unit)
                break
        else:
            bins.append([unit])
            loads.append(len(unit))
    return bins


@dataclass(frozen=True)
class MicroBatch:
    """One forward batch of packed rows and where its scored tokens go in the flat token order.

    ``input_ids_BT`` / ``position_ids_BT``: B rows of T tokens, each row several sequences (or prefix
    tries) side by side with positions restarting at 0 for each; a row's padding is one more such
    segment, never scored. ``visible_until_BT``: None when every tree is a plain sequence (Hugging Face
    then masks attention block-diagonally from the position ids); otherwise each token's visibility
    range (``TreeLayout``), from which ``attention_BTT`` is the block-diagonal causal mask extended
    to tries.
    ``logit_index_K``: for each scored token, the index into the flattened (B*T) positions whose
    logits predict it (the token before it in its own sequence, wherever its trie holds it).
    ``target_ids_K``: the scored tokens. ``flat_index_K``: their indices in the batch's flat token
    order. ``segments``: the same attention as a plan over the rows' segments (each sequence, or each
    tree member's own tokens after what it shares), which SDPA models run at the cost of the
    segments instead of (row width)^2 (``agent_r1.train.segment_attention``).
    """

    input_ids_BT: torch.Tensor  # (B, T)
    position_ids_BT: torch.Tensor  # (B, T)
    logit_index_K: torch.Tensor  # (K,) into the flattened (B*T)
    target_ids_K: torch.Tensor  # (K,)
    flat_index_K: torch.Tensor  # (K,)
    visible_until_BT: torch.Tensor | None = None  # (B, T), only when a row holds a shared prefix
    segments: SegmentAttention | None = None  # the same attention, segment by segment

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids_BT.numel())

    @property
    def attention_BTT(self) -> torch.Tensor | None:
        """(B, T, T) bool, None when every tree is a plain sequence: query q attends to key k when k
        is at or before q and q lies in k's visibility range (the rest of k's segment and the segments
        of the members that share it), the causal mask of each member over the ancestors' tokens it
        shares and its own. Built on demand: (B, T, T) is large, and SDPA runs ``segments`` instead."""
        if self.visible_until_BT is None:
            return None
        index_T = torch.arange(self.visible_until_BT.shape[1])
        causal_TT = index_T[:, None] >= index_T[None, :]
        return causal_TT & (index_T[None, :, None] < self.visible_until_BT[:, None, :])


def pack_trees(trees: Sequence[PrefixTree], rows: StepRows, token_budget: int) -> list[MicroBatch]:
    """Pack prefix trees into rows, the rows into micro-batches of at most ``token_budget`` tokens.

    A row is at most as wide as the widest tree, never one long row per budget: without a variable-length attention kernel (CPU, plain SDPA) a packed row's attention
    costs (row width)^2 whatever the sequences inside it, so wide rows would make packing slower than
    padding. Rows of a micro-batch are right-padded to the widest of them (with token id 0: padding is
    one more segment, never attended to by a real token and never scored).
    """
    width = max((len(t) for t in trees), default=1)
    packed_rows = pack_sequences(trees, width)
    packed_rows.sort(key=count_tokens, reverse=True)
    micro_batches: list[MicroBatch] = []
    i = 0
    while i < len(packed_rows):
        # Rows are sorted widest first, so the first row of a group sets its width.
        group_width = count_tokens(packed_rows[i])
        n_rows = max(1, token_budget // max(group_width, 1))
        micro_batches.append(_micro_batch(packed_rows[i : i + n_rows], group_width, rows))
        i += n_rows
    return micro_batches


def _micro_batch(packed_rows: Sequence[Sequence[PrefixTree]], width: int, rows: StepRows) -> MicroBatch:
    input_ids, positions, visible_until = [], [], []
    logit_index, targets, flat = [], [], []
    segments: list[Segment] = []
    for r, packed in enumerate(packed_rows):
        row_ids, row_positions, row_until = [], [], []
        start = 0  # where the tree starts in the row
        for tree in packed:
            layout = tree.layout()
            row_ids.append(layout.token_ids_L)
            row_positions.append(layout.position_ids_L)
            row_until.append(layout.visible_until_L + start)
            for member, branch, index in zip(tree.members, tree.branch_at, layout.member_index, strict=True):
                if len(member) > branch:  # a member equal to a prefix of the previous adds no tokens
                    flat_index = r * width + start + index
                    segments.append(
                        Segment(int(flat_index[branch]), len(member) - branch, flat_index[:branch])
                    )
                for span in member.spans:
                    # the logits at the member's tokens before each response token, wherever the
                    # trie holds them
                    logit_index.append(
                        r * width + start + index[span.start - 1 : span.start + span.length - 1]
                    )
                    targets.append(torch.tensor(member.token_ids[span.start : span.start + span.length]))
                    offset = rows.offsets[span.row]
                    flat.append(torch.arange(offset, offset + span.length))
            start += len(tree)
        # The padding is one more segment: it sees only itself and is never scored.
        padding = width - start
        row_ids.append(torch.full((padding,), 0, dtype=torch.long))
        row_positions.append(torch.arange(padding))
        row_until.append(torch.full((padding,), width, dtype=torch.long))
        input_ids.append(torch.cat(row_ids))
        positions.append(torch.cat(row_positions))
        visible_until.append(torch.cat(row_until))
    shared = any(len(tree.members) > 1 for packed in packed_rows for tree in packed)
    empty = torch.zeros(0, dtype=torch.long)
    return MicroBatch(
        input_ids_BT=torch.stack(input_ids),
        position_ids_BT=torch.stack(positions),
        logit_index_K=torch.cat(logit_index) if logit_index else empty,
        target_ids_K=torch.cat(targets) if targets else empty,
        flat_index_K=torch.cat(flat) if flat else empty,
        visible_until_BT=torch.stack(visible_until) if shared else None,
        segments=plan_segments(
            segments, len(packed_rows) * width, chunk_queries=segment_attention.CHUNK_QUERIES
        ),
    )
