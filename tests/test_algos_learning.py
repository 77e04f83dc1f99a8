"""The algos layer end to end on a two-step bandit: a tabular softmax policy learns from each
critic-free estimator and each policy loss (StepTable -> advantages -> loss -> aggregation -> SGD)."""

import pytest
import torch

from agent_r1.algos import (
    AdvantageConfig,
    PolicyLossConfig,
    StepTable,
    aggregate,
    compute_advantages,
    get_policy_loss,
)
from agent_r1.types import Step, Trajectory, TrajectoryGroup

ACTIONS = 3
GOOD = 2  # the rewarded action, at both steps


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    # torch.log_softmax dispatches tiny tensors to the thread pool: ~50 ms a call on a busy 2-core box
    return logits - logits.logsumexp(-1, keepdim=True)


def rollout_groups(logits_SA: torch.Tensor, generator: torch.Generator, groups: int = 4, n: int = 8):
    """Trajectories of two steps: immediate reward 0.5 for GOOD at step 0, outcome 1 for GOOD at step 1."""
    logprobs_SA = log_softmax(logits_SA.detach())
    actions_S_GN = torch.multinomial(logprobs_SA.exp(), groups * n, replacement=True, generator=generator)
    result = []
    for g in range(groups):
        trajectories = []
        for i in range(g * n, (g + 1) * n):
            a0, a1 = int(actions_S_GN[0, i]), int(actions_S_GN[1, i])
            steps = (
                Step(
                    prompt_ids=[0],
                    response_ids=[a0],
                    logprobs=[float(logprobs_SA[0, a0])],
                    reward=0.5 * (a0 == GOOD),
                ),
                Step(prompt_ids=[1], response_ids=[a1], logprobs=[float(logprobs_SA[1, a1])]),
            )
            trajectories.append(Trajectory("bandit", steps, outcome_reward=float(a1 == GOOD)))
        result.append(TrajectoryGroup(f"g{g}", "bandit", tuple(trajectories)))
    return result


def train(estimator: str, loss_name: str, iterations: int = 15) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    logits_SA = torch.zeros(2, ACTIONS, requires_grad=True)
    loss_fn = get_policy_loss(loss_name)
    for _ in range(iterations):
        groups = rollout_groups(logits_SA, generator)
        table = StepTable.from_groups(groups)
        out = compute_advantages(table, AdvantageConfig(estimator))
        actions_N1 = torch.tensor(
            [[s.response_ids[0]] for g in groups for t in g.trajectories for s in t.steps]
        )
        for _ in range(2):  # two updates per batch: the ratio moves away from 1
            logprobs_N1 = log_softmax(logits_SA)[table.step_index].gather(-1, actions_N1)
            loss, _ = loss_fn(
                logprobs_N1, table.sampler_logprobs, out.advantages, table.response_mask, PolicyLossConfig()
            )
            (grad_SA,) = torch.autograd.grad(aggregate(loss, table.response_mask, "token-mean"), logits_SA)
            with torch.no_grad():  # plain SGD, lr 1 (torch.optim would import torch._dynamo: seconds)
                logits_SA -= grad_SA
    return torch.softmax(logits_SA.detach(), -1)[:, GOOD]


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "step_grpo"])
def test_every_critic_free_estimator_learns_both_steps(estimator):
    assert (train(estimator, "ppo_clip") > 0.6).all()  # from 1/3


@pytest.mark.parametrize("loss_name", ["gspo", "cispo", "reinforce"])
def test_every_policy_loss_learns_both_steps(loss_name):
    assert (train("grpo", loss_name) > 0.6).all()
