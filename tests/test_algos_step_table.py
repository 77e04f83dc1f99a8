"""StepTable: layout, reward accounting, state ids and the errors it raises."""

from dataclasses import replace

import pytest
import torch

from agent_r1.algos.step_table import StepTable, step_rewards
from agent_r1.types import Step, Trajectory, TrajectoryGroup, TrajectoryStatus


def make_step(prompt, n_resp, reward=0.0, mask=(), state_key=None) -> Step:
    return Step(
        prompt_ids=prompt,
        response_ids=list(range(100, 100 + n_resp)),
        logprobs=[-0.1 * (i + 1) for i in range(n_resp)],
        response_mask=mask,
        reward=reward,
        state_key=state_key,
    )


def two_groups() -> list[TrajectoryGroup]:
    a = Trajectory("t0", (make_step([1], 2), make_step([1, 100, 101, 7], 1, reward=0.5)), outcome_reward=1.0)
    b = Trajectory("t0", (make_step([1], 3, mask=(1, 0, 1)),), outcome_reward=0.0)
    c = Trajectory("t1", (make_step([1], 1, reward=0.25),), outcome_reward=2.0)
    return [TrajectoryGroup("g0", "t0", (a, b)), TrajectoryGroup("g1", "t1", (c,))]


def test_layout_rows_are_groups_then_trajectories_then_steps():
    table = StepTable.from_groups(two_groups())
    assert table.num_steps == 4 and table.max_response_len == 3
    assert table.traj_index.tolist() == [0, 0, 1, 2]
    assert table.group_index.tolist() == [0, 0, 0, 1]
    assert table.step_index.tolist() == [0, 1, 0, 0]
    assert table.done.tolist() == [False, True, True, True]
    assert table.reward.tolist() == [0.0, 0.5, 0.0, 0.25]
    assert table.outcome_reward.tolist() == [1.0, 1.0, 0.0, 2.0]
    assert table.response_mask.tolist() == [[1, 1, 0], [1, 0, 0], [1, 0, 1], [1, 0, 0]]
    assert table.sampler_logprobs[2].tolist() == pytest.approx([-0.1, -0.2, -0.3])
    assert table.sampler_logprobs[1].tolist() == pytest.approx([-0.1, 0.0, 0.0])  # right-padded


def test_state_index_same_prompt_same_group_only():
    table = StepTable.from_groups(two_groups())
    s = table.state_index.tolist()
    assert s[0] == s[2]  # prompt [1] in group 0, two trajectories
    assert s[1] != s[0]
    assert s[3] not in (s[0], s[1])  # prompt [1] again, but in group 1


def test_state_key_overrides_prompt_ids():
    traj_a = Trajectory("t", (make_step([1, 2], 1, state_key="room-3"),))
    traj_b = Trajectory("t", (make_step([9, 9, 9], 1, state_key="room-3"),))
    traj_c = Trajectory("t", (make_step([1, 2], 1),))
    table = StepTable.from_groups([TrajectoryGroup("g", "t", (traj_a, traj_b, traj_c))])
    assert table.state_index[0] == table.state_index[1] != table.state_index[2]


def test_step_rewards_count_outcome_once_and_sum_to_total_reward():
    groups = two_groups()
    table = StepTable.from_groups(groups)
    rewards = step_rewards(table)
    assert rewards.tolist() == pytest.approx([0.0, 1.5, 0.0, 2.25])
    totals = [t.total_reward for g in groups for t in g.trajectories]
    per_traj = torch.zeros(3).index_add_(0, table.traj_index, rewards)
    assert per_traj.tolist() == pytest.approx(totals)


def test_step_rewards_add_token_rewards_on_trained_tokens_only():
    table = StepTable.from_groups(two_groups())
    table = replace(table, token_rewards=torch.full((4, 3), -0.1))
    # trained tokens per row: 2, 1, 2, 1
    assert step_rewards(table).tolist() == pytest.approx([-0.2, 1.4, -0.2, 2.15])


def test_optional_values_are_padded_and_checked():
    table = StepTable.from_groups(
        two_groups(),
        token_values=[[1, 2], [3], [4, 5, 6], [7]],
        step_values=[0.1, 0.2, 0.3, 0.4],
        ref_logprobs=torch.zeros(4, 3),
    )
    assert table.token_values.tolist() == [[1, 2, 0], [3, 0, 0], [4, 5, 6], [7, 0, 0]]
    assert table.step_values.tolist() == pytest.approx([0.1, 0.2, 0.3, 0.4])
    with pytest.raises(ValueError, match=r"step_values must hold one value per step, shape \(4,\)"):
        StepTable.from_groups(two_groups(), step_values=[0.0])
    with pytest.raises(ValueError, match="token_values must hold one sequence per step"):
        StepTable.from_groups(two_groups(), token_values=[[1.0]])
    with pytest.raises(
        ValueError, match=r"ref_logprobs: row 1 has 4 entries, more than the longest response \(3\)"
    ):
        StepTable.from_groups(two_groups(), ref_logprobs=[[], [0, 0, 0, 0], [], []])


def test_error_trajectories_are_rejected_and_empty_ones_skipped():
    bad = Trajectory("t", (make_step([1], 1),), status=TrajectoryStatus.ERROR, error="boom")
    with pytest.raises(ValueError, match=r"group 0 \('g'\) trajectory 1 has status ERROR \('boom'\)"):
        StepTable.from_groups([TrajectoryGroup("g", "t", (Trajectory("t", (make_step([1], 1),)), bad))])
    empty = Trajectory("t", ())
    table = StepTable.from_groups([TrajectoryGroup("g", "t", (empty, Trajectory("t", (make_step([1], 1),))))])
    assert table.traj_index.tolist() == [0]


def test_validation_names_the_problem():
    table = StepTable.from_groups(two_groups())
    with pytest.raises(ValueError, match="done must be set exactly on the last step"):
        replace(table, done=torch.tensor([True, True, True, True]))
    with pytest.raises(ValueError, match="trajectory 0 has step_index 0 twice"):
        replace(table, step_index=torch.tensor([0, 0, 0, 0]))
    with pytest.raises(ValueError, match="sampler_logprobs must have the shape of response_mask"):
        replace(table, sampler_logprobs=torch.zeros(4, 2))
    with pytest.raises(ValueError, match=r"reward must have shape \(N,\)"):
        replace(table, reward=torch.zeros(3))
    with pytest.raises(ValueError, match="spans several group_index"):
        replace(table, group_index=torch.tensor([0, 1, 0, 1]))


def test_bool_mask_becomes_float_and_select_reorders_whole_table():
    table = StepTable.from_groups(two_groups())
    table = replace(table, response_mask=table.response_mask > 0)
    assert table.response_mask.dtype == torch.float32
    flipped = table.select(torch.tensor([3, 2, 1, 0]))
    assert flipped.traj_index.tolist() == [2, 1, 0, 0]
    assert torch.equal(flipped.sampler_logprobs[0], table.sampler_logprobs[3])
    assert flipped.sorted_rows().tolist() == [3, 2, 1, 0]
