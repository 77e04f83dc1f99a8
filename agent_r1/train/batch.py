"""The training batch of one RL step, built once from the kept groups (docs/training.md, "a step").

``build_batch`` walks the kept trajectories once. Each trajectory with steps gets one trajectory
index (the step table's ``traj_index``) and its steps get consecutive step rows; in the same pass the
walk fills the step table's columns (``agent_r1.algos.StepColumns``), the flat token order's row
offsets (``agent_r1.train.batching.StepRows``) and the trajectory's training sequences
(``trajectory_sequences``: steps that extend each other share one). Everything else is derived from
those: the per-token fields (``agent_r1.algos.TokenFields``), the step's mini-batch partition, each
mini-batch's token mask and packed micro-batches (prefix trees, token budget), so every view of the
batch agrees by construction and every epoch reads the same views. It is the one builder of
training data: the trainer, SFT, the benchmarks and the tests all lay trajectories out through it
(``batch_of`` for trajectories outside groups).

The batch is frozen. A phase that computes per-token data (old or reference log-probs, values, the
off-policy weights, a teacher's log-probs, the advantages) returns it, and the trainer enriches the
batch with ``with_tokens`` (a ``dataclasses.replace``), never by mutation.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from agent_r1.algos import StepTable, TokenFields
from agent_r1.algos.step_table import StepColumns
from agent_r1.train import segment_attention
from agent_r1.train.batching import (
    MicroBatch,
    StepRows,
    TrainSequence,
    attention_pair_cost,
    count_tokens,
    pack_trees,
    share_prefixes,
    trajectory_sequences,
)
from agent_r1.train.learner import MASKABLE_KERNELS
from agent_r1.types import Trajectory, TrajectoryGroup, TrajectoryStatus

__all__ = [
    "TrainBatch",
    "batch_of",
    "build_batch",
    "hash_seed",
    "keep_groups",
    "kernel_pair_cost",
    "prefix_pair_cost",
    "step_advantages",
]

logger = logging.getLogger(__name__)


def prefix_pair_cost(config, model_config, device: torch.device | str = "cpu") -> float | None:
    """The attention weight of the prefix-tree cost model for this policy (``batching``), or None
    where prefix trees are off (``trainer.share_prefixes``) or the attention kernel takes no mask.

    Where the learner (on ``device``) runs attention segment by segment (``segment_attention``: SDPA
    on the CPU), a tree member attends to what it shares at the cost it would pay alone: joining a
    tree then only saves tokens, so the weight is 0 (every shared prefix is shared). Elsewhere the
    dense tree mask runs, whose attention costs (row width)^2."""
    if not config.trainer.share_prefixes:
        return None
    kernel = config.model.attn_implementation or getattr(model_config, "_attn_implementation", None) or "sdpa"
    return kernel_pair_cost(kernel, model_config, device)


def kernel_pair_cost(kernel: str, model_config, device: torch.device | str = "cpu") -> float | None:
    """``prefix_pair_cost`` for a learner that runs attention ``kernel`` on ``device``, prefix trees on."""
    if kernel not in MASKABLE_KERNELS:
        logger.info("prefix trees off: attention kernel %r takes no custom mask", kernel)
        return None
    return 0.0 if segment_attention.applies(kernel, device) else attention_pair_cost(model_config)


def hash_seed(*parts: Any) -> int:
    """A 56-bit seed that is a pure function of ``parts`` (a step's mini-batch draw, an epoch's order)."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:7], "little")


@dataclass(frozen=True)
class TrainBatch:
    """A step's kept trajectories as training data (see the module docstring).

    ``trajectories[i]`` is trajectory index i of ``table.traj_index`` and ``rows.trajectory_index``
    (the kept trajectories that have steps, in group order). ``rows`` is the flat token order;
    ``table`` its padded one-row-per-step view (row n's tokens are ``valid_NL[n]``).
    ``mini_batch_trajectories[j]``: the trajectory indices of mini-batch j, ``mini_batch_masks[j]``
    its tokens (1.0 on the flat tokens of its trajectories), ``micro_batches[j]`` its packed
    micro-batches; together they score every token exactly once. ``sequences``: the training
    sequences the micro-batches were packed from (``trajectory_sequences``), in trajectory order.
    """

    groups: tuple[TrajectoryGroup, ...]
    trajectories: tuple[Trajectory, ...]
    rows: StepRows
    table: StepTable
    valid_NL: Tensor  # (N, L) bool: which padded entries of the table are real tokens
    tokens: TokenFields
    mini_batch_trajectories: tuple[Tensor, ...]
    mini_batch_masks: tuple[Tensor, ...]  # (num_tokens,) float each
    micro_batches: tuple[tuple[MicroBatch, ...], ...]
    sequences: tuple[TrainSequence, ...]
    train_tokens: int  # tokens the layout's forward passes process (a shared prefix counts once)
    step_layout_tokens: int  # tokens one row per step (prompt + response) would process

    @property
    def num_tokens(self) -> int:
        return self.tokens.num_tokens

    @property
    def all_micro_batches(self) -> list[MicroBatch]:
        return [mb for mini in self.micro_batches for mb in mini]

    def to_padded(self, flat: Tensor) -> Tensor:
        """A (num_tokens,) field as the table's (N, L), zero-padded."""
        out_NL = torch.zeros(self.valid_NL.shape, dtype=flat.dtype)
        out_NL[self.valid_NL] = flat
        return out_NL

    def step_table(self) -> StepTable:
        """The step table with the per-token phases' results so far (the learner's old log-probs, the
        critic's values, the reference log-probs) as its padded (N, L) columns: what the advantage
        estimators read."""
        tokens, columns = self.tokens, {}
        if tokens.old_logprobs is not None:
            columns["old_logprobs"] = self.to_padded(tokens.old_logprobs)
        if tokens.old_values is not None:
            values_NL = self.to_padded(tokens.old_values)
            columns.update(token_values=values_NL, step_values=values_NL[:, 0])
        if tokens.ref_logprobs is not None:
            columns["ref_logprobs"] = self.to_padded(tokens.ref_logprobs)
        return replace(self.table, **columns)

    def first_token_mask(self) -> Tensor:
        """(num_tokens,) 1.0 on each step's first response token: where a step-level value is read."""
        mask_T = torch.zeros(self.num_tokens)
        starts = [o for o, s in zip(self.rows.offsets, self.rows.steps, strict=True) if s.response_ids]
        mask_T[starts] = 1.0
        return mask_T

    def with_tokens(self, **fields: Tensor | None) -> TrainBatch:
        """This batch with per-token ``fields`` set (a phase's result)."""
        return replace(self, tokens=replace(self.tokens, **fields))

    def step_means(self, flat: Tensor) -> list[float]:
        """The mean of a (num_tokens,) field over each step row's trained tokens (0 for none)."""
        mask_T, step_T = self.tokens.mask, self.tokens.step_ids
        num_steps = len(self.rows.steps)
        summed_N = torch.zeros(num_steps).index_add_(0, step_T, flat * mask_T)
        return (summed_N / torch.zeros(num_steps).index_add_(0, step_T, mask_T).clamp(min=1)).tolist()


def step_advantages(batches: Sequence[TrainBatch]) -> dict[int, float] | None:
    """Each trained step's mean advantage, by ``id`` of the step, over ``batches`` (one per policy);
    None when none of them has advantages."""
    advantage_of = {}
    for batch in batches:
        if batch.tokens.advantages is not None:
            means = batch.step_means(batch.tokens.advantages)
            advantage_of.update({id(s): v for s, v in zip(batch.rows.steps, means, strict=True)})
    return advantage_of or None


def keep_groups(
    groups: Sequence[TrajectoryGroup], *, dynamic_filter: bool
) -> tuple[list[TrajectoryGroup], dict[str, float]]:
    """The groups a batch is built from: each without its ERROR and step-less trajectories (none
    left: the group is dropped) and, with ``dynamic_filter`` (DAPO, arXiv 2503.14476), without the
    groups whose rewards all agree (zero advantage under a group baseline); and the filter's counts
    (``filter/groups``: the groups given, one per (task, role) with several roles)."""
    kept = []
    zero_variance = 0
    for group in groups:
        usable = tuple(t for t in group.trajectories if t.status is not TrajectoryStatus.ERROR and t.steps)
        if not usable:
            continue
        rewards = [t.total_reward for t in usable]
        if max(rewards) - min(rewards) < 1e-9:
            zero_variance += 1
            if dynamic_filter:
                continue
        kept.append(replace(group, trajectories=usable))
    return kept, {
        "filter/groups": float(len(groups)),
        "filter/kept_groups": float(len(kept)),
        "filter/zero_variance_groups": float(zero_variance),
    }


def batch_of(trajectories: Sequence[Trajectory], **layout: Any) -> TrainBatch:
    """``build_batch`` of trajectories that belong to no group (one group holds them all): SFT's
    demonstrations, a benchmark's or a test's hand-built trajectories."""
    return build_batch([TrajectoryGroup("batch", "batch", tuple(trajectories))], **layout)


def build_batch(
    groups: Sequence[TrajectoryGroup],
    *,
    micro_batch_tokens: int,
    mini_batches: int = 1,
    pair_cost: float | None = None,
    merge: bool = True,
    seed: int = 0,
    step: int = 0,
) -> TrainBatch:
    """The step's batch from its kept groups (no ERROR trajectories: ``keep_groups`` drops them).

    ``mini_batches``: how many parts the trajectories are split into (drawn by ``(seed, step)``);
    ``micro_batch_tokens``: the token budget of one packed micro-batch; ``pair_cost``: the prefix-tree
    cost model's attention weight (None: no prefix sharing, ``agent_r1.train.batching``); ``merge``:
    steps that extend each other share a training sequence (False: one sequence per step, the layout
    a benchmark compares against)."""
    columns = StepColumns()
    trajectories: list[Trajectory] = []
    steps, owner, offsets, lengths = [], [], [], []
    sequences, sequence_traj = [], []
    offset = layout_tokens = 0
    for g, group in enumerate(groups):
        for trajectory in group.trajectories:
            if trajectory.status is TrajectoryStatus.ERROR:
                raise ValueError(f"build_batch: group {group.group_id!r} holds an ERROR trajectory")
            if not trajectory.steps:
                continue
            index = len(trajectories)
            trajectories.append(trajectory)
            columns.add(g, trajectory)
            for trajectory_sequence in trajectory_sequences(trajectory, len(steps), merge=merge):
                sequences.append(trajectory_sequence)
                sequence_traj.append(index)
            for s in trajectory.steps:
                steps.append(s)
                owner.append(index)
                offsets.append(offset)
                lengths.append(len(s.response_ids))
                offset += len(s.response_ids)
                layout_tokens += len(s.prompt_ids) + len(s.response_ids)
    rows = StepRows(tuple(steps), tuple(owner), tuple(offsets))
    table = columns.table()
    lengths_N = torch.tensor(lengths, dtype=torch.long)
    valid_NL = torch.arange(table.max_response_len)[None, :] < lengths_N[:, None]
    tokens = TokenFields(
        mask=table.response_mask[valid_NL],
        step_ids=torch.arange(len(steps)).repeat_interleave(lengths_N),
        traj_ids=table.traj_index.repeat_interleave(lengths_N),
        sampler_logprobs=table.sampler_logprobs[valid_NL],
    )
    parts = _partition(table, mini_batches, hash_seed(seed, step))
    sequence_traj_S = torch.tensor(sequence_traj, dtype=torch.long)
    packed, train_tokens = [], 0
    for part in parts:
        keep = torch.isin(sequence_traj_S, part).tolist()
        chosen = [s for s, kept in zip(sequences, keep, strict=True) if kept]
        trees = share_prefixes(chosen, pair_cost=pair_cost, max_width=micro_batch_tokens)
        packed.append(tuple(pack_trees(trees, rows, micro_batch_tokens)))
        train_tokens += count_tokens(trees)
    masks = tuple(torch.isin(tokens.traj_ids, part).float() for part in parts)
    return TrainBatch(
        tuple(groups),
        tuple(trajectories),
        rows,
        table,
        valid_NL,
        tokens,
        tuple(parts),
        masks,
        tuple(packed),
        tuple(sequences),
        train_tokens,
        layout_tokens,
    )


def _partition(table: StepTable, mini_batches: int, seed: int) -> list[Tensor]:
    """``mini_batches`` parts as trajectory indices, drawn by ``seed``. Whole groups stay in one part
    whenever there are at least as many groups as parts, so a group's shared prompt is laid out once;
    else trajectories are split."""
    traj_T = torch.unique(table.traj_index)
    splits = min(mini_batches, len(traj_T))
    if splits <= 1:
        return [traj_T]
    generator = torch.Generator().manual_seed(seed)
    group_of_T = torch.zeros(int(traj_T.max()) + 1, dtype=torch.long)
    group_of_T[table.traj_index] = table.group_index
    group_ids = torch.unique(table.group_index)
    if len(group_ids) >= splits:
        shuffled = group_ids[torch.randperm(len(group_ids), generator=generator)]
        return [traj_T[torch.isin(group_of_T[traj_T], part)] for part in shuffled.chunk(splits)]
    return list(traj_T[torch.randperm(len(traj_T), generator=generator)].chunk(splits))
