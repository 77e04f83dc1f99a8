"""Advantage estimators: hand-computed values on small tables, then properties with hypothesis."""

import math
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agent_r1.algos import ADVANTAGE_ESTIMATORS, AdvantageConfig, StepTable, compute_advantages, step_rewards
from agent_r1.algos.kl import kl_reward_penalty
from agent_r1.types import Step, Trajectory, TrajectoryGroup


def make_step(prompt, n_resp=1, reward=0.0, mask=(), state_key=None) -> Step:
    return Step(
        prompt_ids=prompt,
        response_ids=list(range(100, 100 + n_resp)),
        logprobs=[-0.5] * n_resp,
        response_mask=mask,
        reward=reward,
        state_key=state_key,
    )


def group(*trajectories: Trajectory, gid: str = "g") -> TrajectoryGroup:
    return TrajectoryGroup(gid, "task", trajectories)


def outcome_only(*rewards: float, gid: str = "g") -> TrajectoryGroup:
    """One single-step trajectory per reward, all from the same prompt."""
    return group(*(Trajectory("task", (make_step([1], 2),), outcome_reward=r) for r in rewards), gid=gid)


def assert_values(tensor: torch.Tensor, expected, atol: float = 1e-5) -> None:
    expected = torch.tensor(expected, dtype=tensor.dtype)
    assert torch.allclose(tensor, expected, atol=atol, rtol=0), f"{tensor} != {expected}"


def per_step(out, table: StepTable) -> list[float]:
    """Each row's advantage at its first token (every row in these examples trains its first token)."""
    assert bool((table.response_mask[:, 0] > 0).all())
    return out.advantages[:, 0].tolist()


# ---------------------------------------------------------------------------------------------------
# Hand-computed values


def test_grpo_normalises_by_group_mean_and_unbiased_std():
    # returns 3, 0, 0: mean 1, deviations 2, -1, -1, unbiased var (4 + 1 + 1) / 2 = 3
    table = StepTable.from_groups([outcome_only(3.0, 0.0, 0.0), outcome_only(5.0, gid="h")])
    out = compute_advantages(table, "grpo")
    s3 = math.sqrt(3.0)
    assert per_step(out, table) == pytest.approx([2 / s3, -1 / s3, -1 / s3, 0.0], abs=1e-5)
    assert out.advantages[0].tolist() == pytest.approx([2 / s3] * 2, abs=1e-5)  # broadcast to tokens
    dr = compute_advantages(table, AdvantageConfig("grpo", norm_by_std=False))  # Dr. GRPO
    assert per_step(dr, table) == pytest.approx([2.0, -1.0, -1.0, 0.0])


def test_grpo_uses_discounted_trajectory_return_over_steps():
    # A: R_0 = 0, R_1 = 0.5 + outcome 1 = 1.5; B: R_0 = 0. gamma = 0.5 -> G_0(A) = 0.75, G_0(B) = 0
    a = Trajectory("task", (make_step([1]), make_step([1, 100, 5], reward=0.5)), outcome_reward=1.0)
    b = Trajectory("task", (make_step([1]),), outcome_reward=0.0)
    table = StepTable.from_groups([group(a, b)])
    out = compute_advantages(table, AdvantageConfig("grpo", gamma=0.5, norm_by_std=False))
    assert per_step(out, table) == pytest.approx([0.375, 0.375, -0.375])
    assert out.returns[:, 0].tolist() == pytest.approx([0.75, 1.5, 0.0])  # return-to-go per step


def test_rloo_subtracts_the_mean_of_the_others():
    table = StepTable.from_groups([outcome_only(3.0, 0.0, 0.0), outcome_only(5.0, gid="h")])
    out = compute_advantages(table, "rloo")
    assert per_step(out, table) == pytest.approx([3.0, -1.5, -1.5, 0.0])  # a group of one has no baseline


def test_reinforce_pp_whitens_returns_over_all_trained_tokens():
    # tokens carry returns 1, 1 (two-token step) and 0: mean 2/3, biased std sqrt(2)/3
    a = Trajectory("task", (make_step([1], 2),), outcome_reward=1.0)
    b = Trajectory("task", (make_step([2], 1),), outcome_reward=0.0)
    table = StepTable.from_groups([group(a, gid="g"), group(b, gid="h")])
    out = compute_advantages(table, "reinforce_pp")
    assert_values(out.advantages, [[1 / math.sqrt(2)] * 2, [-math.sqrt(2), 0.0]], atol=1e-5)


def test_reinforce_pp_discounts_over_steps():
    a = Trajectory("task", (make_step([1]), make_step([1, 100, 3])), outcome_reward=1.0)
    b = Trajectory("task", (make_step([2]),), outcome_reward=0.25)
    table = StepTable.from_groups([group(a, b)])
    out = compute_advantages(table, AdvantageConfig("reinforce_pp", gamma=0.5, norm_by_std=False))
    assert out.returns[:, 0].tolist() == pytest.approx([0.5, 1.0, 0.25])
    assert per_step(out, table) == pytest.approx([0.5 - 7 / 12, 1.0 - 7 / 12, 0.25 - 7 / 12])


def test_reinforce_pp_baseline_subtracts_group_mean_first():
    # totals 1 and 0 -> mean 0.5 -> shifted returns +0.5, -0.5 -> whitened +1, -1
    table = StepTable.from_groups([outcome_only(1.0, 0.0)])
    out = compute_advantages(table, "reinforce_pp_baseline")
    assert out.returns[:, 0].tolist() == pytest.approx([0.5, -0.5])
    assert per_step(out, table) == pytest.approx([1.0, -1.0], abs=1e-5)


def test_step_grpo_adds_anchor_state_advantages():
    # A and B visit the same two states; C only the first. Outcomes 1, 0, 0; gamma = 1, no std.
    second = [1, 100, 5]
    a = Trajectory("task", (make_step([1]), make_step(second)), outcome_reward=1.0)
    b = Trajectory("task", (make_step([1]), make_step(second)), outcome_reward=0.0)
    c = Trajectory("task", (make_step([1]),), outcome_reward=0.0)
    table = StepTable.from_groups([group(a, b, c)])
    out = compute_advantages(table, AdvantageConfig("step_grpo", norm_by_std=False))
    # episode: 2/3, -1/3, -1/3; state [1]: returns 1, 0, 0 -> 2/3, -1/3, -1/3; state `second`: +1/2, -1/2
    assert per_step(out, table) == pytest.approx([4 / 3, 2 / 3 + 0.5, -2 / 3, -1 / 3 - 0.5, -2 / 3])
    half = compute_advantages(table, AdvantageConfig("step_grpo", norm_by_std=False, step_weight=0.5))
    assert per_step(half, table) == pytest.approx([1.0, 2 / 3 + 0.25, -0.5, -1 / 3 - 0.25, -0.5])


def test_step_grpo_groups_by_state_key():
    a = Trajectory("task", (make_step([1], state_key="s"),), outcome_reward=1.0)
    b = Trajectory("task", (make_step([2], state_key="s"),), outcome_reward=0.0)
    table = StepTable.from_groups([group(a, b)])
    out = compute_advantages(table, AdvantageConfig("step_grpo", norm_by_std=False))
    assert per_step(out, table) == pytest.approx([1.0, -1.0])  # 0.5 episode + 0.5 step each


def test_gae_token_advances_only_over_action_tokens():
    # step 0: tokens [a, forced, a] (middle masked), reward 1; step 1: one token, outcome 2.
    s0 = make_step([1], 3, reward=1.0, mask=(1, 0, 1))
    s1 = make_step([1, 100, 101, 102, 9], 1)
    table = StepTable.from_groups(
        [group(Trajectory("task", (s0, s1), outcome_reward=2.0))],
        token_values=[[0.5, 9.9, 0.2], [0.4]],
    )
    out = compute_advantages(table, AdvantageConfig("gae_token", gamma=0.9, lam=0.5))
    # action values 0.5, 0.2, 0.4; rewards 0, 1, 2
    # d2 = 2 - 0.4 = 1.6;            A2 = 1.6
    # d1 = 1 + 0.9*0.4 - 0.2 = 1.16; A1 = 1.16 + 0.45*1.6 = 1.88
    # d0 = 0.9*0.2 - 0.5 = -0.32;    A0 = -0.32 + 0.45*1.88 = 0.526
    assert_values(out.advantages, [[0.526, 0.0, 1.88], [1.6, 0.0, 0.0]], atol=1e-6)
    assert_values(out.returns, [[1.026, 0.0, 2.08], [2.0, 0.0, 0.0]], atol=1e-6)


def test_gae_token_credits_token_rewards_in_place_and_untrained_step_rewards_backwards():
    s0 = make_step([1], 2)
    s1 = make_step([1, 100, 101], 1, reward=3.0, mask=(0,))  # no trained token: reward goes to s0's last
    table = StepTable.from_groups([group(Trajectory("task", (s0, s1)))], token_values=[[0, 0], [0]])
    table = replace(table, token_rewards=torch.tensor([[-0.25, 0.0], [0.0, 0.0]]))
    out = compute_advantages(table, AdvantageConfig("gae_token", gamma=0.5, lam=1.0))
    # rewards on action tokens: -0.25, 3 -> A1 = 3, A0 = -0.25 + 0.5 * 3
    assert_values(out.advantages, [[1.25, 3.0], [0.0, 0.0]])


def test_gae_step_uses_one_value_per_step():
    s0 = make_step([1], 2, reward=1.0)
    s1 = make_step([1, 100, 101, 9], 1)
    table = StepTable.from_groups(
        [group(Trajectory("task", (s0, s1), outcome_reward=2.0))], step_values=[0.5, 0.2]
    )
    out = compute_advantages(table, AdvantageConfig("gae_step", gamma=0.9, lam=0.5))
    # d1 = 2 - 0.2 = 1.8; d0 = 1 + 0.9*0.2 - 0.5 = 0.68; A0 = 0.68 + 0.45*1.8 = 1.49
    assert_values(out.advantages, [[1.49, 1.49], [1.8, 0.0]])
    assert_values(out.returns, [[1.99, 1.99], [2.0, 0.0]])


def test_kl_reward_penalty_reaches_every_estimator_through_the_step_reward():
    table = StepTable.from_groups([outcome_only(1.0, 1.0)], ref_logprobs=[[-1.0, -1.0], [-0.5, -0.5]])
    penalised = kl_reward_penalty(table, beta=0.1, kind="k1")  # sampler_logprobs are -0.5 everywhere
    assert_values(penalised.token_rewards, [[-0.05, -0.05], [0.0, 0.0]])
    assert step_rewards(penalised).tolist() == pytest.approx([0.9, 1.0])
    out = compute_advantages(penalised, AdvantageConfig("grpo", norm_by_std=False))
    assert per_step(out, penalised) == pytest.approx([-0.05, 0.05])


def test_missing_critic_values_and_unknown_names_are_clear_errors():
    table = StepTable.from_groups([outcome_only(1.0)])
    with pytest.raises(ValueError, match="gae_token needs StepTable.token_values"):
        compute_advantages(table, "gae_token")
    with pytest.raises(ValueError, match="gae_step needs StepTable.step_values"):
        compute_advantages(table, "gae_step")
    with pytest.raises(
        ValueError, match="unknown advantage estimator 'ppo'; available: gae_step, gae_token, grpo"
    ):
        compute_advantages(table, "ppo")
    with pytest.raises(ValueError, match=r"AdvantageConfig.gamma must be in \[0, 1\]"):
        AdvantageConfig(gamma=1.5)


# ---------------------------------------------------------------------------------------------------
# Properties

PROPERTY_SETTINGS = settings(max_examples=30)  # each example builds a table; keeps the module under ~10 s
REWARDS = st.sampled_from([0.0, 0.0, 1.0, 0.5, -1.0, 0.3])


@st.composite
def step_tables(draw, *, immediate_rewards: bool = True, constant_per_group: bool = False) -> StepTable:
    """Random groups (sizes 1-4) of trajectories (1-3 steps) whose steps all train their first token."""
    groups = []
    for g in range(draw(st.integers(1, 3))):
        group_outcome = draw(REWARDS)
        trajectories = []
        for _ in range(draw(st.integers(1, 4))):
            steps = []
            for k in range(draw(st.integers(1, 3))):
                n = draw(st.integers(1, 4))
                mask = (1, *draw(st.lists(st.integers(0, 1), min_size=n - 1, max_size=n - 1)))
                reward = draw(REWARDS) if immediate_rewards else 0.0
                prompt = [g, k, draw(st.integers(0, 1))]  # few distinct states: anchors repeat
                steps.append(make_step(prompt, n, reward=reward, mask=mask))
            outcome = group_outcome if constant_per_group else draw(REWARDS)
            trajectories.append(Trajectory("task", tuple(steps), outcome_reward=outcome))
        groups.append(group(*trajectories, gid=f"g{g}"))
    table = StepTable.from_groups(groups)
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    token_values = 4 * torch.rand(table.response_mask.shape, generator=generator) - 2
    step_values = 4 * torch.rand(table.num_steps, generator=generator) - 2
    baseline = (4 * torch.rand(int(table.traj_index.max()) + 1, generator=generator) - 2)[table.traj_index]
    return replace(table, token_values=token_values, step_values=step_values, baseline=baseline)


def trajectory_advantages(out, table: StepTable) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantage, group) of each trajectory, read at its first step's first token."""
    first = table.step_index == 0
    return out.advantages[first, 0], table.group_index[first]


@PROPERTY_SETTINGS
@given(step_tables(), st.booleans())
def test_grpo_advantages_sum_to_zero_within_each_group(table, norm_by_std):
    out = compute_advantages(table, AdvantageConfig("grpo", norm_by_std=norm_by_std))
    adv, groups = trajectory_advantages(out, table)
    sums = torch.zeros(int(groups.max()) + 1).index_add_(0, groups, adv)
    assert sums.abs().max() < 1e-4


@PROPERTY_SETTINGS
@given(step_tables())
def test_rloo_advantages_sum_to_zero_within_each_group(table):
    adv, groups = trajectory_advantages(compute_advantages(table, "rloo"), table)
    assert torch.zeros(int(groups.max()) + 1).index_add_(0, groups, adv).abs().max() < 1e-4


def return_to_go(table: StepTable) -> torch.Tensor:
    """Undiscounted return from each step: sum of step_rewards of the same and later steps. (N,)"""
    rewards = step_rewards(table)
    later = (table.traj_index[:, None] == table.traj_index[None, :]) & (
        table.step_index[None, :] >= table.step_index[:, None]
    )
    return (later.float() * rewards[None, :]).sum(-1)


@PROPERTY_SETTINGS
@given(step_tables())
def test_gae_with_gamma_lambda_one_is_return_minus_value(table):
    cfg = AdvantageConfig(gamma=1.0, lam=1.0)
    mask = table.response_mask
    expected_token = (return_to_go(table)[:, None] - table.token_values) * mask
    token = compute_advantages(table, replace(cfg, name="gae_token"))
    assert torch.allclose(token.advantages, expected_token, atol=1e-5)
    assert torch.allclose(token.returns, return_to_go(table)[:, None] * mask, atol=1e-5)
    step = compute_advantages(table, replace(cfg, name="gae_step"))
    expected_step = (return_to_go(table) - table.step_values)[:, None] * mask
    assert torch.allclose(step.advantages, expected_step, atol=1e-5)


def naive_gae(rewards: list[float], values: list[float], gamma: float, lam: float) -> list[float]:
    """GAE written out with Python floats, for one sequence that ends in a terminal state."""
    advantages, running = [0.0] * len(rewards), 0.0
    for t in reversed(range(len(rewards))):
        next_value = values[t + 1] if t + 1 < len(rewards) else 0.0
        running = rewards[t] + gamma * next_value - values[t] + gamma * lam * running
        advantages[t] = running
    return advantages


UNIT = st.floats(0.0, 1.0)


@PROPERTY_SETTINGS
@given(step_tables(), UNIT, UNIT)
def test_gae_estimators_match_a_naive_loop_over_each_trajectory(table, gamma, lam):
    cfg = AdvantageConfig(gamma=gamma, lam=lam)
    token = compute_advantages(table, replace(cfg, name="gae_token")).advantages
    step = compute_advantages(table, replace(cfg, name="gae_step")).advantages
    rewards = step_rewards(table)
    for traj in table.traj_index.unique():
        rows = [int(r) for r in table.sorted_rows() if table.traj_index[r] == traj]
        cells = [(r, c) for r in rows for c in range(table.max_response_len) if table.response_mask[r, c] > 0]
        last_cell = {r: max(c for rr, c in cells if rr == r) for r in rows}
        token_rewards = [float(rewards[r]) if c == last_cell[r] else 0.0 for r, c in cells]
        expected = naive_gae(token_rewards, [float(table.token_values[r, c]) for r, c in cells], gamma, lam)
        assert [float(token[r, c]) for r, c in cells] == pytest.approx(expected, abs=1e-4)
        expected = naive_gae(
            [float(rewards[r]) for r in rows], [float(table.step_values[r]) for r in rows], gamma, lam
        )
        assert [float(step[r, 0]) for r in rows] == pytest.approx(expected, abs=1e-4)


@PROPERTY_SETTINGS
@given(step_tables(), st.randoms(use_true_random=False))
def test_no_estimator_depends_on_row_order(table, rnd):
    perm = list(range(table.num_steps))
    rnd.shuffle(perm)
    perm = torch.tensor(perm)
    shuffled = table.select(perm)
    cfg = AdvantageConfig(gamma=0.9, lam=0.8)
    for name in ADVANTAGE_ESTIMATORS:
        out = compute_advantages(table, replace(cfg, name=name))
        out_shuffled = compute_advantages(shuffled, replace(cfg, name=name))
        assert torch.allclose(out.advantages[perm], out_shuffled.advantages, atol=1e-5), name
        assert torch.allclose(out.returns[perm], out_shuffled.returns, atol=1e-5), name


@PROPERTY_SETTINGS
@given(step_tables(immediate_rewards=False, constant_per_group=True), st.booleans())
def test_zero_variance_groups_give_exactly_zero_advantages(table, norm_by_std):
    cfg = AdvantageConfig(norm_by_std=norm_by_std)
    for name in ("grpo", "rloo", "step_grpo", "reinforce_pp_baseline"):
        out = compute_advantages(table, replace(cfg, name=name))
        assert not out.advantages.isnan().any(), name
        assert (out.advantages == 0).all(), name


@PROPERTY_SETTINGS
@given(step_tables())
def test_advantages_are_finite_and_zero_on_masked_tokens(table):
    for name in ADVANTAGE_ESTIMATORS:
        out = compute_advantages(table, name)
        assert torch.isfinite(out.advantages).all() and torch.isfinite(out.returns).all(), name
        assert (out.advantages[table.response_mask == 0] == 0).all(), name
        assert (out.returns[table.response_mask == 0] == 0).all(), name


def test_a_batch_with_one_reward_gives_zero_reinforce_pp_advantages():
    table = StepTable.from_groups([outcome_only(0.7, 0.7), outcome_only(0.7, gid="h")])
    assert (compute_advantages(table, "reinforce_pp").advantages == 0).all()


@PROPERTY_SETTINGS
@given(step_tables(), st.sampled_from([1.0, 0.9]))
def test_rae_is_the_return_to_go_minus_the_given_baseline(table, gamma):
    """rae (SPIRAL) subtracts the running baseline the trainer keeps (``StepTable.baseline``) from each
    step's return-to-go: groups play no part, so a trajectory alone in its group still learns."""
    out = compute_advantages(table, AdvantageConfig("rae", gamma=gamma))
    reference = compute_advantages(table, AdvantageConfig("reinforce_pp", gamma=gamma, norm_by_std=False))
    expected_NL = (reference.returns - table.baseline[:, None]) * table.response_mask
    assert torch.allclose(out.advantages, expected_NL, atol=1e-6)
    assert torch.allclose(out.returns, reference.returns, atol=1e-6)


def test_rae_without_a_baseline_is_refused_by_name():
    table = StepTable.from_groups([outcome_only(1.0)])
    with pytest.raises(ValueError, match="StepTable.baseline"):
        compute_advantages(table, "rae")
