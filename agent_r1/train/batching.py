"""Trajectories -> training sequences -> token-budget micro-batches (DESIGN.md, consequence 4).

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

Sequences that share a prefix — the samples of a GRPO group share their prompt, and every step of
every trajectory in a group shares the task's first prompt — can also share its computation
(``share_prefixes``): a prefix tree lays the shared tokens out once as a trunk, then each member's
remaining tokens as a branch with positions continuing from the trunk, and an explicit attention mask
lets each branch see the trunk and itself only. A causal LM's log-probs of a token depend only on the
tokens before it, so every member's log-probs are exactly its own, and the gradients reaching the
trunk are the sum of its members'. Whether sequences are worth joining is decided by a cost model: a
tree saves (members - 1) x trunk tokens, but its row is wider, and attention over a row costs
(row width)^2 (``attention_pair_cost`` weighs one attention pair against one token's dense layers from
the model's dimensions).

Every per-token quantity of a batch (old log-probs, advantages, masks) lives in one flat "token order":
step rows in order, each row's response tokens in order. ``StepRows`` gives each row's offset into it;
a micro-batch carries the flat indices of the tokens it scores, so losses computed per micro-batch are
gathered from and scattered to the same flat arrays regardless of the layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from agent_r1.types import Step, Trajectory

__all__ = [
    "SOFTMAX_MACS",
    "MicroBatch",
    "PrefixTree",
    "StepRows",
    "StepSpan",
    "TrainSequence",
    "attention_pair_cost",
    "build_sequences",
    "count_tokens",
    "make_micro_batches",
    "pack_sequences",
    "share_prefixes",
    "step_rows",
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


def step_rows(trajectories: Sequence[Trajectory]) -> StepRows:
    steps, owner, offsets = [], [], []
    offset = 0
    for i, trajectory in enumerate(trajectories):
        for step in trajectory.steps:
            steps.append(step)
            owner.append(i)
            offsets.append(offset)
            offset += len(step.response_ids)
    return StepRows(tuple(steps), tuple(owner), tuple(offsets))


def build_sequences(trajectories: Sequence[Trajectory], *, merge: bool = True) -> list[TrainSequence]:
    """Turn trajectories into training sequences; with ``merge``, prefix-extending steps share one.

    Step rows are numbered as in ``step_rows(trajectories)``. Steps without response tokens get no
    span (nothing to score) but still extend a merged sequence.
    """
    sequences: list[TrainSequence] = []
    row = 0
    for trajectory in trajectories:
        tokens: list[int] = []
        spans: list[StepSpan] = []
        for step in trajectory.steps:
            prompt = step.prompt_ids
            extends = (
                merge and tokens and len(prompt) >= len(tokens) and tuple(tokens) == prompt[: len(tokens)]
            )
            if not extends and tokens:
                sequences.append(TrainSequence(tuple(tokens), tuple(spans)))
                tokens, spans = [], []
            tokens.extend(prompt[len(tokens) :])
            if not tokens:
                raise ValueError(f"step row {row} has an empty prompt: nothing to condition on")
            if step.response_ids:
                spans.append(StepSpan(row, len(tokens), len(step.response_ids)))
            tokens.extend(step.response_ids)
            row += 1
        if tokens:
            sequences.append(TrainSequence(tuple(tokens), tuple(spans)))
    return [s for s in sequences if s.spans]


def count_tokens(units: Sequence[TrainSequence | PrefixTree]) -> int:
    """Tokens a forward pass processes for these sequences or trees (a tree's trunk counts once)."""
    return sum(len(u) for u in units)


@dataclass(frozen=True)
class PrefixTree:
    """Sequences whose first ``shared`` tokens are equal, laid out as that trunk once followed by each
    member's remaining tokens (its branch). A tree of one sequence is that sequence, unchanged."""

    members: tuple[TrainSequence, ...]
    shared: int

    def __len__(self) -> int:
        return self.shared + sum(len(m) - self.shared for m in self.members)


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
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def share_prefixes(
    sequences: Sequence[TrainSequence], *, pair_cost: float | None, max_width: int
) -> list[PrefixTree]:
    """Group ``sequences`` into prefix trees no wider than ``max_width`` tokens.

    Sequences are visited in token order, so those sharing a prefix are adjacent; each joins the
    current tree when that lowers the estimated cost ``tokens + pair_cost * width^2`` of the tree plus
    the sequence alone. ``pair_cost=None`` shares nothing (every sequence is its own tree).
    """
    if pair_cost is None:
        return [PrefixTree((s,), len(s)) for s in sequences]

    def cost(width: int) -> float:
        return width + pair_cost * width * width

    trees: list[PrefixTree] = []
    for sequence in sorted(sequences, key=lambda s: s.token_ids):
        if trees:
            tree = trees[-1]
            shared = min(tree.shared, _common_prefix(tree.members[-1].token_ids, sequence.token_ids))
            joined = PrefixTree((*tree.members, sequence), shared)
            if (
                shared
                and len(joined) <= max_width
                and cost(len(joined)) < cost(len(tree)) + cost(len(sequence))
            ):
                trees[-1] = joined
                continue
        trees.append(PrefixTree((sequence,), len(sequence)))
    return trees


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
    trees) side by side with positions restarting at 0 for each; a row's padding is one more such
    segment, never scored. ``attention_BTT``: None when every tree is a plain sequence (Hugging Face then
    masks attention block-diagonally from the position ids); otherwise which token attends to which
    (True = attends), the block-diagonal causal mask extended to trees. ``logit_index_K``: for each
    scored token, the index into the flattened (B*T) positions whose logits predict it (the token before
    it in its own sequence). ``target_ids_K``: the scored tokens. ``flat_index_K``: their indices in the
    batch's flat token order.
    """

    input_ids_BT: torch.Tensor  # (B, T)
    position_ids_BT: torch.Tensor  # (B, T)
    logit_index_K: torch.Tensor  # (K,) into the flattened (B*T)
    target_ids_K: torch.Tensor  # (K,)
    flat_index_K: torch.Tensor  # (K,)
    attention_BTT: torch.Tensor | None = None  # (B, T, T) bool, only when a row holds a shared prefix

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids_BT.numel())


def make_micro_batches(
    sequences: Sequence[TrainSequence],
    rows: StepRows,
    token_budget: int,
    *,
    row_width: int | None = None,
    pad_token_id: int = 0,
    pair_cost: float | None = None,
) -> list[MicroBatch]:
    """Pack ``sequences`` into rows, the rows into micro-batches of at most ``token_budget`` tokens.

    With ``pair_cost`` (``attention_pair_cost`` of the model), sequences sharing a prefix are first
    joined into prefix trees (``share_prefixes``); None keeps every sequence whole.

    A row is at most ``row_width`` tokens wide (default: the widest sequence or tree), never one long
    row per budget: without a variable-length attention kernel (CPU, plain SDPA) a packed row's
    attention costs (row width)^2 whatever the sequences inside it, so wide rows would make packing
    slower than padding. Rows of a micro-batch are right-padded to the widest of them.
    """
    units = share_prefixes(sequences, pair_cost=pair_cost, max_width=token_budget)
    width = max(row_width or 0, max((len(u) for u in units), default=1))
    packed_rows = pack_sequences(units, width)
    packed_rows.sort(key=count_tokens, reverse=True)
    micro_batches: list[MicroBatch] = []
    i = 0
    while i < len(packed_rows):
        # Rows are sorted widest first, so the first row of a group sets its width.
        group_width = count_tokens(packed_rows[i])
        n_rows = max(1, token_budget // max(group_width, 1))
        micro_batches.append(_micro_batch(packed_rows[i : i + n_rows], group_width, rows, pad_token_id))
        i += n_rows
    return micro_batches


def _micro_batch(
    packed_rows: Sequence[Sequence[PrefixTree]], width: int, rows: StepRows, pad_token_id: int
) -> MicroBatch:
    input_ids, positions, segments, parents = [], [], [], []
    logit_index, targets, flat = [], [], []
    for r, packed in enumerate(packed_rows):
        row_ids: list[int] = []
        row_positions: list[int] = []
        # Each trunk, each branch and the padding is a segment; a token attends to the earlier tokens
        # of its own segment and of its parent segment (a branch's trunk; otherwise itself).
        row_segments: list[int] = []
        row_parents: list[int] = []
        segment = 0
        for tree in packed:
            trunk, trunk_start = segment, len(row_ids)
            row_ids.extend(tree.members[0].token_ids[: tree.shared])
            row_positions.extend(range(tree.shared))
            row_segments.extend([trunk] * tree.shared)
            row_parents.extend([trunk] * tree.shared)
            for member in tree.members:
                segment += 1
                branch_start, branch_length = len(row_ids), len(member) - tree.shared
                row_ids.extend(member.token_ids[tree.shared :])
                row_positions.extend(range(tree.shared, len(member)))
                row_segments.extend([segment] * branch_length)
                row_parents.extend([trunk] * branch_length)
                for span in member.spans:
                    for q in range(span.start - 1, span.start + span.length - 1):
                        # the logits at the member's token q (in the trunk or in its branch)
                        at = trunk_start + q if q < tree.shared else branch_start + q - tree.shared
                        logit_index.append(r * width + at)
                    targets.extend(member.token_ids[span.start : span.start + span.length])
                    flat.extend(rows.token_index(span.row))
            segment += 1
        padding = width - len(row_ids)
        input_ids.append(row_ids + [pad_token_id] * padding)
        positions.append(row_positions + list(range(padding)))
        segments.append(row_segments + [segment] * padding)
        parents.append(row_parents + [segment] * padding)
    attention_BTT = None
    if any(len(tree.members) > 1 for packed in packed_rows for tree in packed):
        segment_BT, parent_BT = torch.tensor(segments), torch.tensor(parents)
        own_BTT = segment_BT[:, None, :] == segment_BT[:, :, None]
        trunk_BTT = segment_BT[:, None, :] == parent_BT[:, :, None]
        attention_BTT = (own_BTT | trunk_BTT) & torch.ones(width, width, dtype=torch.bool).tril()
    return MicroBatch(
        input_ids_BT=torch.tensor(input_ids, dtype=torch.long),
        position_ids_BT=torch.tensor(positions, dtype=torch.long),
        logit_index_K=torch.tensor(logit_index, dtype=torch.long),
        target_ids_K=torch.tensor(targets, dtype=torch.long),
        flat_index_K=torch.tensor(flat, dtype=torch.long),
        attention_BTT=attention_BTT,
    )
