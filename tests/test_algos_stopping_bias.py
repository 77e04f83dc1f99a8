"""Stopping bias, measured exactly: when the policy chooses how many turns it takes, which
(estimator, aggregation) pairs give a policy gradient whose expectation points along the true one?

The toy MDP: at turn k = 0, 1, 2 the policy emits one token, "stop" (the episode ends with reward
STOP_REWARD[k]) or "go" (after turn 2 the episode ends with END_REWARD). pi(go | k) = sigmoid(theta_k).
Trajectories: stop at 0 (1 step), go-stop (2), go-go-stop (3), go-go-go (3). The true gradient of
J(theta) = E[R] is exact by enumeration; the expected estimate of a group of G samples is exact by
enumerating all 4^G ordered groups. An estimator is unbiased when E[estimate] = c * grad J with c > 0
(a constant scale is the learning rate's business). The estimate is the gradient of
-sum_t w_t * loss_t with the REINFORCE loss (on-policy, the PPO-clip surrogate's gradient at ratio 1)
and the aggregation's weights w, with steps as sequences, as the trainer does.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from agent_r1.algos import (
    AdvantageConfig,
    PolicyLossConfig,
    StepTable,
    aggregation_weights,
    compute_advantages,
    get_policy_loss,
)

TURNS = 3
STOP_REWARD = (0.0, 1.0, 0.3)
END_REWARD = 0.6
THETA = (0.3, -0.2, 0.5)
GROUP = 3
GO, STOP = 1, 0
# (actions, reward) of the four trajectories
TRAJECTORIES = [
    ((STOP,), STOP_REWARD[0]),
    ((GO, STOP), STOP_REWARD[1]),
    ((GO, GO, STOP), STOP_REWARD[2]),
    ((GO, GO, GO), END_REWARD),
]
# Aggregation weights are float32 (2^-24 relative rounding each); an estimate sums < 100 weighted
# terms per group and 4^3 groups, so its relative rounding stays far below 1e-5. A biased pair on
# this MDP deviates by more than 1e-2.
TOLERANCE = 1e-5


def log_policy(theta: torch.Tensor, turn: int, action: int) -> torch.Tensor:
    go = torch.nn.functional.logsigmoid(theta[turn])
    stop = torch.nn.functional.logsigmoid(-theta[turn])
    return go if action == GO else stop


def trajectory_logprob(theta: torch.Tensor, actions: tuple[int, ...]) -> torch.Tensor:
    return sum(log_policy(theta, k, a) for k, a in enumerate(actions))


def true_gradient() -> torch.Tensor:
    theta = torch.tensor(THETA, dtype=torch.float64, requires_grad=True)
    expected_reward = sum(trajectory_logprob(theta, a).exp() * r for a, r in TRAJECTORIES)
    expected_reward.backward()
    return theta.grad


def state_values() -> list[float]:
    """V(turn k) = E[R | the episode reaches turn k], exactly."""
    theta = torch.tensor(THETA, dtype=torch.float64)
    values = []
    for k in range(TURNS):
        reaching = [(a, r) for a, r in TRAJECTORIES if len(a) > k]
        probs = [  # of the rest of the trajectory, from turn k on
            sum(log_policy(theta, k + i, action) for i, action in enumerate(a[k:])).exp() for a, _ in reaching
        ]
        values.append(float(sum(p * r for p, (_, r) in zip(probs, reaching, strict=True))))
    return values


def group_estimate(
    group: tuple[int, ...], advantage: AdvantageConfig, aggregation: str, **agg
) -> torch.Tensor:
    """The trainer's gradient estimate of E[R] from one group (indices into TRAJECTORIES)."""
    theta = torch.tensor(THETA, dtype=torch.float64, requires_grad=True)
    traj, step, outcome, done, logprobs = [], [], [], [], []
    for i, index in enumerate(group):
        actions, reward = TRAJECTORIES[index]
        for k, action in enumerate(actions):
            traj.append(i)
            step.append(k)
            outcome.append(reward)
            done.append(k == len(actions) - 1)
            logprobs.append(log_policy(theta, k, action))
    n = len(traj)
    logprobs_N1 = torch.stack(logprobs)[:, None]
    values = state_values()
    table = StepTable(
        traj_index=torch.tensor(traj),
        group_index=torch.zeros(n, dtype=torch.long),
        step_index=torch.tensor(step),
        reward=torch.zeros(n, dtype=torch.float64),
        outcome_reward=torch.tensor(outcome, dtype=torch.float64),
        done=torch.tensor(done),
        state_index=torch.tensor(step),  # the state at turn k is the same in every trajectory reaching it
        response_mask=torch.ones(n, 1, dtype=torch.float64),
        sampler_logprobs=logprobs_N1.detach(),
        step_values=torch.tensor([values[k] for k in step], dtype=torch.float64),
    )
    advantages_N1 = compute_advantages(table, advantage).advantages
    loss_N1, _ = get_policy_loss("reinforce")(
        logprobs_N1, logprobs_N1.detach(), advantages_N1, table.response_mask, PolicyLossConfig()
    )
    weights_N1 = aggregation_weights(
        table.response_mask,
        aggregation,
        seq_ids=torch.arange(n)[:, None],
        traj_ids=table.traj_index[:, None],
        norm_len=float(TURNS),
        **agg,
    ).to(torch.float64)
    (-(weights_N1 * loss_N1).sum()).backward()
    return theta.grad


def expected_estimate(advantage: AdvantageConfig, aggregation: str, **agg) -> torch.Tensor:
    theta = torch.tensor(THETA, dtype=torch.float64)
    probs = [float(trajectory_logprob(theta, a).exp()) for a, _ in TRAJECTORIES]
    total = torch.zeros(TURNS, dtype=torch.float64)
    for group in itertools.product(range(len(TRAJECTORIES)), repeat=GROUP):
        weight = 1.0
        for index in group:
            weight *= probs[index]
        total += weight * group_estimate(group, advantage, aggregation, **agg)
    return total


def deviation(estimate: torch.Tensor, truth: torch.Tensor) -> tuple[float, float]:
    """(scale c, relative distance of the estimate from c * truth): 0 for an unbiased estimator."""
    c = float(estimate @ truth / (truth @ truth))
    return c, float((estimate - c * truth).norm() / estimate.norm())


UNBIASED = [
    ("rloo", {}, "traj-mean-token-sum-norm", {}),
    ("grpo", {"norm_by_std": False}, "traj-mean-token-sum-norm", {}),  # Dr. GRPO's advantage
    ("gae_step", {}, "traj-mean-token-sum-norm", {}),  # with the exact V: per-step credit G_k - V(s_k)
    ("rloo", {}, "traj-mean-token-sum-norm", {"equal_trajectory_weight": True}),
]
BIASED = [
    ("grpo", {}, "token-mean", {}),  # the defaults: the step count of the batch is random
    ("rloo", {}, "token-mean", {}),
    ("rloo", {}, "seq-mean-token-sum-norm", {}),  # Dr. GRPO's normaliser counts steps here
    ("rloo", {}, "seq-mean-token-mean", {"equal_trajectory_weight": True}),  # 1 / K_i per trajectory
    ("grpo", {}, "traj-mean-token-sum-norm", {}),  # the group std is sample-dependent
    ("step_grpo", {"norm_by_std": False}, "traj-mean-token-sum-norm", {}),  # own return in its state baseline
]


@pytest.mark.parametrize(("estimator", "options", "aggregation", "agg"), UNBIASED)
def test_unbiased_combinations_follow_the_true_gradient(estimator, options, aggregation, agg):
    c, distance = deviation(
        expected_estimate(AdvantageConfig(estimator, **options), aggregation, **agg), true_gradient()
    )
    assert c > 0 and distance < TOLERANCE, (c, distance)


@pytest.mark.parametrize(("estimator", "options", "aggregation", "agg"), BIASED)
def test_biased_combinations_are_measurably_off(estimator, options, aggregation, agg):
    _, distance = deviation(
        expected_estimate(AdvantageConfig(estimator, **options), aggregation, **agg), true_gradient()
    )
    assert distance > 1e-2, distance
