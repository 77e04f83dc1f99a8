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
    "MicroBatch",
    "StepRows",
    "StepSpan",
    "TrainSequence",
    "build_sequences",
    "count_tokens",
    "make_micro_batches",
    "pack_sequences",
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


def count_tokens(sequences: Sequence[TrainSequence]) -> int:
    return sum(len(s) for s in sequences)


def pack_sequences(sequences: Sequence[TrainSequence], token_budget: int) -> list[list[TrainSequence]]:
    """First-fit decreasing bin packing by length; a sequence longer than the budget gets its own bin."""
    bins: list[list[TrainSequence]] = []
    loads: list[int] = []
    for sequence in sorted(sequences, key=len, reverse=True):
        for i, load in enumerate(loads):
            if load + len(sequence) <= token_budget:
                bins[i].append(sequence)
                loads[i] += len(sequence)
                break
        else:
            bins.append([sequence])
            loads.append(len(sequence))
    return bins


@dataclass(frozen=True)
class MicroBatch:
    """One forward batch of packed rows and where its scored tokens go in the flat token order.

    ``input_ids_BT`` / ``position_ids_BT``: B rows of T tokens, each row several sequences side by side
    with positions restarting at 0 for each (Hugging Face then masks attention block-diagonally); a
    row's padding is one more such segment, never scored. ``logit_index_K``: for each scored token, the
    index into the flattened (B*T) positions whose logits predict it (its position - 1).
    ``target_ids_K``: the scored tokens. ``flat_index_K``: their indices in the batch's flat token order.
    """

    input_ids_BT: torch.Tensor  # (B, T)
    position_ids_BT: torch.Tensor  # (B, T)
    logit_index_K: torch.Tensor  # (K,) into the flattened (B*T)
    target_ids_K: torch.Tensor  # (K,)
    flat_index_K: torch.Tensor  # (K,)

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
) -> list[MicroBatch]:
    """Pack ``sequences`` into rows, the rows into micro-batches of at most ``token_budget`` tokens.

    A row is at most ``row_width`` tokens wide (default: the longest sequence), never one long row per
    budget: without a variable-length attention kernel (CPU, plain SDPA) a packed row's attention
    costs (row width)^2 whatever the sequences inside it, so wide rows would make packing slower than
    padding. Rows of a micro-batch are right-padded to the widest of them.
    """
    width = max(row_width or 0, max((len(s) for s in sequences), default=1))
    packed_rows = pack_sequences(sequences, width)
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
    packed_rows: Sequence[Sequence[TrainSequence]], width: int, rows: StepRows, pad_token_id: int
) -> MicroBatch:
    input_ids, positions, logit_index, targets, flat = [], [], [], [], []
    for r, packed in enumerate(packed_rows):
        row_ids: list[int] = []
        row_positions: list[int] = []
        for sequence in packed:
            base = r * width + len(row_ids)
            row_ids.extend(sequence.token_ids)
            row_positions.extend(range(len(sequence)))
            for span in sequence.spans:
                logit_index.extend(range(base + span.start - 1, base + span.start + span.length - 1))
                targets.extend(sequence.token_ids[span.start : span.start + span.length])
                flat.extend(rows.token_index(span.row))
        padding = width - len(row_ids)
        input_ids.append(row_ids + [pad_token_id] * padding)
        positions.append(row_positions + list(range(padding)))
    return MicroBatch(
        input_ids_BT=torch.tensor(input_ids, dtype=torch.long),
        position_ids_BT=torch.tensor(positions, dtype=torch.long),
        logit_index_K=torch.tensor(logit_index, dtype=torch.long),
        target_ids_K=torch.tensor(targets, dtype=torch.long),
        flat_index_K=torch.tensor(flat, dtype=torch.long),
    )
