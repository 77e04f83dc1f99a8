"""``build_batch``, the one builder of training data, on a hand-written batch: every view (step rows,
flat token fields, padded table, training sequences, mini-batches, micro-batches) checked against
values worked out by hand."""

from __future__ import annotations

import pytest
import torch

from agent_r1.train.batch import batch_of, build_batch
from agent_r1.types import Step, Trajectory, TrajectoryGroup, TrajectoryStatus


def _step(prompt, response, logprobs, *, reward=0.0, mask=()):
    return Step(
        prompt_ids=prompt, response_ids=response, logprobs=logprobs, response_mask=mask, reward=reward
    )


# Group 0: A's second prompt extends its first prompt + response (one sequence); B shares A's prompt.
A = Trajectory(
    "a",
    (
        _step((1, 2, 3), (4, 5), (-0.5, -1.0)),
        _step((1, 2, 3, 4, 5, 6), (7,), (-1.5,), reward=0.5),
    ),
    outcome_reward=1.0,
)
B = Trajectory("a", (_step((1, 2, 3), (8, 9, 10), (-2.0, -2.5, -3.0)),))
# Group 1: C's last response token is not trained (mask 0); a trajectory without steps; D's first two
# steps merge, its third rewrites the context (prompt (30, 35) does not extend (30, 31, 32, 33, 34)).
C = Trajectory("b", (_step((20, 21), (22, 23), (-0.25, -0.75), mask=(1, 0)),), outcome_reward=2.0)
EMPTY = Trajectory("b", ())
D = Trajectory(
    "b",
    (
        _step((30,), (31,), (-3.5,)),
        _step((30, 31, 32), (33, 34), (-4.0, -4.5), reward=-1.0),
        _step((30, 35), (36,), (-5.0,)),
    ),
)
GROUPS = [TrajectoryGroup("g0", "a", (A, B)), TrajectoryGroup("g1", "b", (C, EMPTY, D))]

#          A0        A1   B0          C0        D0   D1        D2
OFFSETS = (0, 2, 3, 6, 8, 9, 11)
STEP_IDS = [0, 0, 1, 2, 2, 2, 3, 3, 4, 5, 5, 6]
TRAJ_IDS = [0, 0, 0, 1, 1, 1, 2, 2, 3, 3, 3, 3]
MASK = [1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1]
SAMPLER = [-0.5, -1.0, -1.5, -2.0, -2.5, -3.0, -0.25, -0.75, -3.5, -4.0, -4.5, -5.0]


def test_rows_tokens_table_and_sequences_are_the_hand_computed_layout():
    batch = build_batch(GROUPS, micro_batch_tokens=64)
    assert batch.trajectories == (A, B, C, D)  # the step-less trajectory takes no index
    assert batch.rows.steps == A.steps + B.steps + C.steps + D.steps
    assert batch.rows.offsets == OFFSETS
    assert batch.rows.trajectory_index == (0, 0, 1, 2, 3, 3, 3)
    assert batch.num_tokens == batch.rows.num_tokens == 12
    assert batch.tokens.step_ids.tolist() == STEP_IDS
    assert batch.tokens.traj_ids.tolist() == TRAJ_IDS
    assert batch.tokens.mask.tolist() == MASK
    assert batch.tokens.sampler_logprobs.tolist() == SAMPLER
    lengths = [2, 1, 3, 2, 1, 2, 1]
    assert batch.valid_NL.tolist() == [[i < n for i in range(3)] for n in lengths]

    sequences = [(s.token_ids, [(p.row, p.start, p.length) for p in s.spans]) for s in batch.sequences]
    assert sequences == [
        ((1, 2, 3, 4, 5, 6, 7), [(0, 3, 2), (1, 6, 1)]),
        ((1, 2, 3, 8, 9, 10), [(2, 3, 3)]),
        ((20, 21, 22, 23), [(3, 2, 2)]),
        ((30, 31, 32, 33, 34), [(4, 1, 1), (5, 3, 2)]),
        ((30, 35, 36), [(6, 2, 1)]),
    ]
    # each sequence once (7 + 6 + 4 + 5 + 3); one row per step re-reads every prompt
    assert batch.train_tokens == 25
    assert batch.step_layout_tokens == (3 + 2) + (6 + 1) + (3 + 3) + (2 + 2) + (1 + 1) + (3 + 2) + (2 + 1)
    assert batch.first_token_mask().tolist() == [1.0 if t in OFFSETS else 0.0 for t in range(12)]

    (mini,) = batch.micro_batches
    assert sorted(torch.cat([mb.flat_index_K for mb in mini]).tolist()) == list(range(12))
    assert batch.mini_batch_masks[0].tolist() == [1.0] * 12


def test_step_table_holds_the_step_columns_and_the_phases_tokens():
    batch = build_batch(GROUPS, micro_batch_tokens=64)
    assert batch.step_table().old_logprobs is None
    old_T = torch.tensor([-0.125 * (t + 1) for t in range(12)])
    table = batch.with_tokens(old_logprobs=old_T).step_table()
    assert table.traj_index.tolist() == [0, 0, 1, 2, 3, 3, 3]
    assert table.group_index.tolist() == [0, 0, 0, 1, 1, 1, 1]
    assert table.step_index.tolist() == [0, 1, 0, 0, 0, 1, 2]
    assert table.done.tolist() == [False, True, True, True, False, False, True]
    assert table.reward.tolist() == [0.0, 0.5, 0.0, 0.0, 0.0, -1.0, 0.0]
    assert table.outcome_reward.tolist() == [1.0, 1.0, 0.0, 2.0, 0.0, 0.0, 0.0]
    assert table.response_mask.tolist() == [
        [1, 1, 0],
        [1, 0, 0],
        [1, 1, 1],
        [1, 0, 0],
        [1, 0, 0],
        [1, 1, 0],
        [1, 0, 0],
    ]
    assert table.sampler_logprobs.tolist() == [
        [-0.5, -1.0, 0.0],
        [-1.5, 0.0, 0.0],
        [-2.0, -2.5, -3.0],
        [-0.25, -0.75, 0.0],
        [-3.5, 0.0, 0.0],
        [-4.0, -4.5, 0.0],
        [-5.0, 0.0, 0.0],
    ]
    assert table.old_logprobs.tolist() == [
        [-0.125, -0.25, 0.0],
        [-0.375, 0.0, 0.0],
        [-0.5, -0.625, -0.75],
        [-0.875, -1.0, 0.0],
        [-1.125, 0.0, 0.0],
        [-1.25, -1.375, 0.0],
        [-1.5, 0.0, 0.0],
    ]


def test_two_mini_batches_hold_whole_groups_and_every_token_once():
    batch = build_batch(GROUPS, micro_batch_tokens=64, mini_batches=2, seed=3, step=1)
    parts = [p.tolist() for p in batch.mini_batch_trajectories]
    assert parts == [[2, 3], [0, 1]]  # the draw of (seed 3, step 1): group 1, then group 0
    group_1 = [0.0] * 6 + [1.0] * 6
    assert [m.tolist() for m in batch.mini_batch_masks] == [group_1, [1.0 - x for x in group_1]]
    for part, micro_batches in zip(batch.mini_batch_trajectories, batch.micro_batches, strict=True):
        scored = torch.cat([mb.flat_index_K for mb in micro_batches])
        assert sorted(scored.tolist()) == [t for t in range(12) if TRAJ_IDS[t] in part.tolist()]
    scored = torch.cat([mb.flat_index_K for mb in batch.all_micro_batches])
    assert sorted(scored.tolist()) == list(range(12))
    assert batch.train_tokens == 25  # no sequence in two mini-batches
    # the same draw on a rebuild
    again = build_batch(GROUPS, micro_batch_tokens=64, mini_batches=2, seed=3, step=1)
    assert [p.tolist() for p in again.mini_batch_trajectories] == parts


def test_prefix_sharing_and_per_step_layouts_count_their_tokens():
    # one mini-batch: A and B share (1, 2, 3); D's sequences share (30,)
    assert build_batch(GROUPS, micro_batch_tokens=64, pair_cost=0.0).train_tokens == 25 - 3 - 1
    per_step = batch_of([A, B, C, EMPTY, D], micro_batch_tokens=64, merge=False)
    assert [len(s.spans) for s in per_step.sequences] == [1] * 7
    assert per_step.train_tokens == per_step.step_layout_tokens == 32
    assert per_step.tokens.traj_ids.tolist() == TRAJ_IDS


def test_an_error_trajectory_is_refused():
    broken = Trajectory("b", D.steps, status=TrajectoryStatus.ERROR, error="the env raised")
    with pytest.raises(ValueError, match="group 'g1' holds an ERROR trajectory"):
        build_batch([GROUPS[0], TrajectoryGroup("g1", "b", (C, broken))], micro_batch_tokens=64)
