"""Advantage estimators: credit per token, per step or per trajectory, chosen by name.

Every estimator is ``fn(table: StepTable, cfg: AdvantageConfig) -> AdvantageOutput`` and is registered
in ``ADVANTAGE_ESTIMATORS`` with what it needs (``Needs``: a critic and at which level, a minimum group
size); ``AdvantageConfig`` is also the ``algorithm.advantage`` section of the training config. Both
outputs are (N, L) like ``table.response_mask`` and are zero wherever the mask is zero. Rewards are read through ``step_rewards`` (each reward counted once; see
``agent_r1.algos.step_table``). No estimator depends on the order of the table's rows.

Notation: trajectory i has steps k = 0..K_i-1 with rewards R_k (``step_rewards``); the per-step
discounted return-to-go is G_k = sum_{j >= k} gamma^(j-k) R_j ("gamma over steps"), and the trajectory
return is G_0. With the default gamma = 1 (common practice in LLM RL: episodes are short and the
outcome reward is what matters) G_0 is ``Trajectory.total_reward``.

| name | credit | needs (declared) |
|---|---|---|
| ``gae_token`` | per token: GAE over the action tokens of the whole trajectory | critic="token" |
| ``gae_step`` | per step: GAE over steps, one value per step | critic="step" |
| ``grpo`` | per trajectory: G_0 normalised within its group | min_group_size=2 |
| ``rloo`` | per trajectory: G_0 minus the mean of the group's other returns | min_group_size=2 |
| ``reinforce_pp`` | per step: G_k, normalised over the batch | |
| ``reinforce_pp_baseline`` | per step: group mean subtracted first, then as ``reinforce_pp`` | min_group_size=2 |
| ``step_grpo`` | per step: trajectory advantage + step advantage within anchor states (GiGPO) | |
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from agent_r1.algos.registry import InvalidOption, Registry
from agent_r1.algos.step_table import StepTable, step_rewards

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AdvantageConfig",
    "AdvantageEstimator",
    "AdvantageOutput",
    "compute_advantages",
    "get_advantage_estimator",
    "register_advantage",
    "trajectory_returns",
]


@dataclass(frozen=True)
class AdvantageConfig:
    """Settings shared by the advantage estimators (each field documented once, here); the
    ``algorithm.advantage`` config section (``algorithm.advantage: grpo`` is short for ``{name: grpo}``).

    name: the registered estimator (``ADVANTAGE_ESTIMATORS``). Default ``grpo`` (Shao et al. 2024).
    gamma: discount. Over steps for ``gae_step`` and the Monte-Carlo estimators (``grpo``, ``rloo``,
        ``reinforce_pp*``, ``step_grpo``); over action tokens for ``gae_token``. Default 1.0 as is
        common practice for LLM RL (PPO for RLHF, GRPO, REINFORCE++ all use 1.0); GiGPO uses 0.95.
    lam: GAE lambda (``gae_token``, ``gae_step``). Default 1.0 (verl/OpenRLHF default for LLMs);
        PPO's 0.95 trades bias for variance.
    norm_by_std: divide group- or batch-centred advantages by the standard deviation (``grpo``,
        ``step_grpo``, ``reinforce_pp*``). Default True as in GRPO; False gives Dr. GRPO.
    eps: added to the standard deviation before dividing.
    step_weight: omega, weight of the step-level (anchor-state) advantage in ``step_grpo``
        (GiGPO: A = A_episode + omega * A_step; the paper uses 1.0).
    whiten: after estimation, whiten the advantages over the batch's trained tokens,
        (A - mean) / (std + eps) (PPO implementations' advantage normalisation). Default False.
    baseline_decay: alpha of ``rae``'s running baseline per role, b <- alpha * b + (1 - alpha) *
        (the role's mean return in the step's batch). Default 0.95 (SPIRAL's).
    """

    name: str = "grpo"
    gamma: float = 1.0
    lam: float = 1.0
    norm_by_std: bool = True
    eps: float = 1e-6
    step_weight: float = 1.0
    whiten: bool = False
    baseline_decay: float = 0.95

    def __post_init__(self) -> None:
        for name in ("gamma", "lam", "baseline_decay"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise InvalidOption("AdvantageConfig", name, f"must be in [0, 1], got {value}")
        if self.eps <= 0:
            raise InvalidOption("AdvantageConfig", "eps", f"must be > 0, got {self.eps}")


@dataclass(frozen=True)
class AdvantageOutput:
    advantages: Tensor  # (N, L), zero where response_mask is zero
    # (N, L): value targets (A + V) for GAE; for Monte-Carlo estimators the return-to-go G_k of the
    # rewards the estimator credits (for reinforce_pp_baseline: after the group mean is subtracted)
    returns: Tensor


AdvantageEstimator = Callable[[StepTable, AdvantageConfig], AdvantageOutput]
ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")
register_advantage = ADVANTAGE_ESTIMATORS.register


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    return ADVANTAGE_ESTIMATORS.lookup(name)


def compute_advantages(table: StepTable, cfg: AdvantageConfig | str = "grpo") -> AdvantageOutput:
    """Run the estimator ``cfg.name`` with ``cfg`` (a name alone means its default settings), then
    whiten over the batch when ``cfg.whiten``."""
    cfg = AdvantageConfig(name=cfg) if isinstance(cfg, str) else cfg
    output = get_advantage_estimator(cfg.name)(table, cfg)
    if not cfg.whiten:
        return output
    live_NL = table.response_mask > 0
    values = output.advantages[live_NL]
    if values.numel() < 2:
        return output
    whitened_NL = (output.advantages - values.mean()) / (values.std() + cfg.eps)
    return AdvantageOutput(torch.where(live_NL, whitened_NL, 0.0), output.returns)


# ---------------------------------------------------------------------------------------------------
# Estimators


@register_advantage("gae_token", critic="token")
def gae_token(table: StepTable, cfg: AdvantageConfig) -> AdvantageOutput:
    """Token-level GAE across the steps of a trajectory (Schulman et al. 2016, arXiv 1506.02438).

    The trajectory's action tokens (``response_mask`` = 1) of all its steps, in order, form one
    sequence t = 0..T-1; prompts, tool outputs and masked tokens are skipped, so gamma and lambda
    advance only over action tokens (Agent-R1's token-level credit across turns):

        delta_t = r_t + gamma * V_{t+1} - V_t,   A_t = delta_t + gamma * lam * A_{t+1},   V_T = 0
        returns_t = A_t + V_t

    r_t is ``token_rewards`` at the token plus, on the step's last action token, the step's
    ``reward + [done] * outcome_reward``. A step without any action token passes its reward to the
    trajectory's preceding action token (rewards never credit later actions). V_t is ``token_values``.
    """
    if table.token_values is None:
        raise ValueError("gae_token needs StepTable.token_values (a token-level critic's values); got None")
    mask_NL = table.response_mask > 0
    traj_N, _, num_traj, _ = _step_grid(table)
    counts_N = mask_NL.sum(-1)
    offset_N = _exclusive_cumsum_within_trajectory(table, counts_N)
    pos_NL = offset_N[:, None] + mask_NL.cumsum(-1) - 1  # action-token position inside the trajectory
    length = int((offset_N + counts_N).max()) if table.num_steps else 0
    traj_NL = traj_N[:, None].expand_as(pos_NL)
    where = (traj_NL[mask_NL], pos_NL[mask_NL])

    values_TM = table.response_mask.new_zeros(num_traj, length)
    values_TM[where] = table.token_values[mask_NL]
    rewards_TM = torch.zeros_like(values_TM)
    if table.token_rewards is not None:
        rewards_TM.index_put_(where, table.token_rewards[mask_NL], accumulate=True)
    env_reward_N = table.reward + table.done.to(table.reward.dtype) * table.outcome_reward
    end_N = offset_N + counts_N - 1  # the step's last action token, or the preceding one
    credited = end_N >= 0
    rewards_TM.index_put_((traj_N[credited], end_N[credited]), env_reward_N[credited], accumulate=True)

    adv_TM = _gae(rewards_TM, values_TM, cfg.gamma, cfg.lam)
    advantages_NL = torch.zeros_like(table.response_mask)
    returns_NL = torch.zeros_like(table.response_mask)
    advantages_NL[mask_NL] = adv_TM[where]
    returns_NL[mask_NL] = adv_TM[where] + values_TM[where]
    return AdvantageOutput(advantages_NL, returns_NL)


@register_advantage("gae_step", critic="step")
def gae_step(table: StepTable, cfg: AdvantageConfig) -> AdvantageOutput:
    """Step-level GAE: one value per step, the advantage broadcast to the step's tokens.

    The step-level MDP's own estimator (Agent-R1, arXiv 2511.14460; GAE, arXiv 1506.02438) with
    steps as time: delta_k = R_k + gamma * V_{k+1} - V_k, A_k = delta_k + gamma * lam * A_{k+1},
    V_K = 0; returns_k = A_k + V_k. V_k is ``step_values`` (the value of the step's start state).
    """
    if table.step_values is None:
        raise ValueError("gae_step needs StepTable.step_values (a step-level critic's values); got None")
    traj_N, step_N, num_traj, num_steps = _step_grid(table)
    rewards_TK = _to_grid(step_rewards(table), traj_N, step_N, num_traj, num_steps)
    values_TK = _to_grid(table.step_values, traj_N, step_N, num_traj, num_steps)
    adv_N = _gae(rewards_TK, values_TK, cfg.gamma, cfg.lam)[traj_N, step_N]
    return AdvantageOutput(
        _broadcast(adv_N, table.response_mask), _broadcast(adv_N + table.step_values, table.response_mask)
    )


@register_advantage("grpo", min_group_size=2)
def grpo(table: StepTable, cfg: AdvantageConfig) -> AdvantageOutput:
    """GRPO: A_i = (G_0^i - mean_group G_0) / (std_group G_0 + eps), broadcast to all of i's steps.

    Shao et al. 2024 (DeepSeekMath, arXiv 2402.03300), outcome supervision, with the trajectory
    return G_0 as the reward. ``norm_by_std=False`` drops the division: Dr. GRPO (Liu et al. 2025,
    arXiv 2503.20783; pair it with the ``seq-mean-token-sum-norm`` aggregation). std is the unbiased
    sample std (as torch.std in TRL / verl). A group whose returns are all equal, including a group of
    one, gets exactly zero advantage.
    """
    mc = _MonteCarlo(table, step_rewards(table), cfg.gamma)
    adv_T = _group_normalise(mc.trajectory_returns, mc.trajectory_groups, cfg)
    return AdvantageOutput(
        _broadcast(adv_T[mc.traj_N], table.response_mask), _broadcast(mc.step_returns, table.response_mask)
    )


@register_advantage("rloo", min_group_size=2)
def rloo(table: StepTable, cfg: AdvantageConfig) -> AdvantageOutput:
    """RLOO: A_i = G_0^i - mean_{j != i in the group} G_0^j, broadcast to all of i's steps.

    Kool et al. 2019 ("Buy 4 REINFORCE samples, get a baseline for free!"); Ahmadian et al. 2024
    (arXiv 2402.14740). Equals n/(n-1) * (G_0^i - group mean). A group of one has no baseline and
    gets zero advantage; so does a group whose returns are all equal.
    """
    mc = _MonteCarlo(table, step_rewards(table), cfg.gamma)
    stats = _GroupStats(mc.trajectory_returns, mc.trajectory_groups)
    count_T = stats.count[stats.inverse]
    adv_T = (mc.trajectory_returns - stats.mean[stats.inverse]) * count_T / (count_T - 1).clamp(min=1)
    adv_T = torch.where(stats.constant, torch.zeros_like(adv_T), adv_T)
    return AdvantageOutput(
        _broadcast(adv_T[mc.traj_N], table.response_mask), _broadcast(mc.step_returns, table.response_mask)
    )


@register_advantage("reinforce_pp")
def reinforce_pp(table: StepTable, cfg: AdvantageConfig) -> AdvantageOutput:
    """REINFORCE++: A = G_k, whitened over all trained tokens of the batch.

    Hu et al. 2025 (arXiv 2501.03262). Deviation: the discounted return is per step (gamma over
    steps) rather than per token, since rewards arrive per step. Whitening is (A - mean) / (std + eps)
    with the mean and (biased) std over masked tokens, as OpenRLHF does; ``norm_by_std=False``
    only centres. A batch whose returns are all equal gets exactly zero advantage.
    """
    return _reinforce_pp(table, cfg, step_rewards(table))


@register_advantage("reinforce_pp_baseline", min_group_size=2)
def reinforce_pp_baseline(table: StepTable, cfg: AdvantageConfig) -> AdvantageOutput:
    """REINFORCE++-baseline: subtract the group mean of the trajectories' total rewards from each
    trajectory's last-step reward, then compute G_k and whiten as ``reinforce_pp``.

    Hu et al. 2025 (arXiv 2501.03262, v3+; OpenRLHF ``reinforce_baseline``): the group mean removes
    the prompt's difficulty before batch normalisation. The baseline is the mean of the undiscounted
    total sum_k R_k, subtracted where the outcome reward is counted (the ``done`` step).
    """
    rewards_N = step_rewards(table)
    undiscounted = _MonteCarlo(table, rewards_N, gamma=1.0)
    stats = _GroupStats(undiscounted.trajectory_returns, undiscounted.trajectory_groups)
    baseline_N = stats.mean[stats.inverse][undiscounted.traj_N]
    return _reinforce_pp(table, cfg, rewards_N - table.done.to(rewards_N.dtype) * baseline_N)


@register_advantage("step_grpo")
def step_grpo(table: StepTable, cfg: AdvantageConfig) -> AdvantageOutput:
    """Step-level group baselines (GiGPO, Feng et al. 2025, arXiv 2505.10978):

        A_k = A_episode(i) + step_weight * (G_k - mean_S G) / (std_S G + eps)

    A_episode is ``grpo``'s trajectory advantage; S is the anchor-state group of step k: steps of the
    same group that start from the same state (``state_index``: equal ``state_key``, else identical
    prompt ids). G_k is the discounted return-to-go from step k (GiGPO uses gamma = 0.95; the default
    here stays 1.0). A state visited once (a singleton S), or a state whose returns are all equal,
    adds nothing. ``norm_by_std`` applies to both levels.
    """
    mc = _MonteCarlo(table, step_rewards(table), cfg.gamma)
    episode_T = _group_normalise(mc.trajectory_returns, mc.trajectory_groups, cfg)
    step_adv_N = _group_normalise(mc.step_returns, table.state_index, cfg)
    return AdvantageOutput(
        _broadcast(episode_T[mc.traj_N] + cfg.step_weight * step_adv_N, table.response_mask),
        _broadcast(mc.step_returns, table.response_mask),
    )


@register_advantage("rae", role_baseline=True)
def rae(table: StepTable, cfg: AdvantageConfig) -> AdvantageOutput:
    """Role-conditioned advantage estimation: A_k = G_k - b_role, broadcast to the step's tokens.

    SPIRAL (Liu et al. 2025, arXiv 2506.24119), for self-play and teams with a policy shared by
    several roles: b_role is a running mean of the returns G_0 of the role's trajectories over the
    run (``baseline_decay``), which the trainer keeps and gives as ``StepTable.baseline``
    (``agent_r1.train.role_baseline``). It needs no group: it works with one sample per task
    (``rollout.n: 1``), where a group baseline is zero, and in zero-sum games, where the mean over
    both seats of one game is zero by construction. No division by a standard deviation (SPIRAL's).
    """
    if table.baseline is None:
        raise ValueError(
            "rae reads StepTable.baseline (a running mean of each role's returns), which is not set: "
            "the trainer's advantage phase sets it (agent_r1.train.role_baseline)"
        )
    mc = _MonteCarlo(table, step_rewards(table), cfg.gamma)
    return AdvantageOutput(
        _broadcast(mc.step_returns - table.baseline, table.response_mask),
        _broadcast(mc.step_returns, table.response_mask),
    )


def trajectory_returns(table: StepTable, gamma: float = 1.0) -> Tensor:
    """Each row's trajectory return G_0 (N,) of the rewards the estimators credit (``step_rewards``),
    discounted by ``gamma``: what ``rae``'s running baselines average."""
    mc = _MonteCarlo(table, step_rewards(table), gamma)
    return mc.trajectory_returns[mc.traj_N]


# ---------------------------------------------------------------------------------------------------
# Helpers


class _MonteCarlo:
    """Discounted returns of per-step rewards (N,): each step's return-to-go G_k (N,), each
    trajectory's return G_0 (T,) and group (T,), and each row's trajectory rank (N,)."""

    def __init__(self, table: StepTable, rewards_N: Tensor, gamma: float) -> None:
        self.traj_N, step_N, num_traj, num_steps = _step_grid(table)
        returns_TK = _returns_to_go(_to_grid(rewards_N, self.traj_N, step_N, num_traj, num_steps), gamma)
        self.step_returns = returns_TK[self.traj_N, step_N]
        self.trajectory_returns = returns_TK[:, 0]
        self.trajectory_groups = table.group_index.new_zeros(num_traj)
        self.trajectory_groups[self.traj_N] = table.group_index


def _reinforce_pp(table: StepTable, cfg: AdvantageConfig, rewards_N: Tensor) -> AdvantageOutput:
    returns_NL = _broadcast(_MonteCarlo(table, rewards_N, cfg.gamma).step_returns, table.response_mask)
    mask_NL = table.response_mask > 0
    advantages_NL = torch.zeros_like(returns_NL)
    if mask_NL.any():
        selected = returns_NL[mask_NL]
        centred = selected - selected.mean()
        if cfg.norm_by_std:
            centred = centred / (centred.pow(2).mean().sqrt() + cfg.eps)
        if selected.max() == selected.min():
            centred = torch.zeros_like(centred)
        advantages_NL[mask_NL] = centred
    return AdvantageOutput(advantages_NL * table.response_mask, returns_NL)


def _step_grid(table: StepTable) -> tuple[Tensor, Tensor, int, int]:
    """Each row's (trajectory rank, step rank), both 0-based and dense, and the grid size (T, K)."""
    order = table.sorted_rows()
    traj_sorted = table.traj_index[order]
    starts = torch.ones_like(traj_sorted, dtype=torch.bool)
    starts[1:] = traj_sorted[1:] != traj_sorted[:-1]
    rank_sorted = starts.cumsum(0) - 1
    first = torch.nonzero(starts).squeeze(-1)
    step_sorted = torch.arange(len(order), device=order.device) - first[rank_sorted]
    traj_N = torch.empty_like(rank_sorted)
    step_N = torch.empty_like(step_sorted)
    traj_N[order] = rank_sorted
    step_N[order] = step_sorted
    num_traj = int(first.numel())
    num_steps = int(step_N.max()) + 1 if len(order) else 0
    return traj_N, step_N, num_traj, num_steps


def _exclusive_cumsum_within_trajectory(table: StepTable, counts_N: Tensor) -> Tensor:
    """For each row: the sum of ``counts_N`` over the earlier steps of its trajectory. (N,)"""
    order = table.sorted_rows()
    traj_sorted = table.traj_index[order]
    counts_sorted = counts_N[order]
    exclusive = counts_sorted.cumsum(0) - counts_sorted
    starts = torch.ones_like(traj_sorted, dtype=torch.bool)
    starts[1:] = traj_sorted[1:] != traj_sorted[:-1]
    start_value = exclusive[starts][starts.cumsum(0) - 1]
    offset_N = torch.empty_like(counts_N)
    offset_N[order] = exclusive - start_value
    return offset_N


def _to_grid(values_N: Tensor, traj_N: Tensor, step_N: Tensor, num_traj: int, num_steps: int) -> Tensor:
    grid_TK = values_N.new_zeros(num_traj, num_steps)
    grid_TK[traj_N, step_N] = values_N
    return grid_TK


def _returns_to_go(rewards_TK: Tensor, gamma: float) -> Tensor:
    """G_k = R_k + gamma * G_{k+1} along dim 1 (zero padding after a trajectory's end is harmless)."""
    returns_TK = torch.zeros_like(rewards_TK)
    running_T = rewards_TK.new_zeros(rewards_TK.shape[0])
    for k in reversed(range(rewards_TK.shape[1])):
        running_T = rewards_TK[:, k] + gamma * running_T
        returns_TK[:, k] = running_T
    return returns_TK


def _gae(rewards_TM: Tensor, values_TM: Tensor, gamma: float, lam: float) -> Tensor:
    """GAE along dim 1; padding after a trajectory's end holds zero reward and value (terminal)."""
    adv_TM = torch.zeros_like(rewards_TM)
    running_T = rewards_TM.new_zeros(rewards_TM.shape[0])
    next_value_T = rewards_TM.new_zeros(rewards_TM.shape[0])
    for t in reversed(range(rewards_TM.shape[1])):
        delta_T = rewards_TM[:, t] + gamma * next_value_T - values_TM[:, t]
        running_T = delta_T + gamma * lam * running_T
        adv_TM[:, t] = running_T
        next_value_T = values_TM[:, t]
    return adv_TM


class _GroupStats:
    """Per-group count, mean, unbiased std and whether all members are equal, for values (n,)."""

    def __init__(self, values: Tensor, group_ids: Tensor) -> None:
        unique, self.inverse = torch.unique(group_ids, return_inverse=True)
        size = unique.numel()
        self.count = values.new_zeros(size).index_add_(0, self.inverse, torch.ones_like(values))
        self.mean = values.new_zeros(size).index_add_(0, self.inverse, values) / self.count
        squares = (values - self.mean[self.inverse]).pow(2)
        variance = values.new_zeros(size).index_add_(0, self.inverse, squares)
        self.std = (variance / (self.count - 1).clamp(min=1)).sqrt()
        high = values.new_full((size,), -torch.inf).scatter_reduce(0, self.inverse, values, "amax")
        low = values.new_full((size,), torch.inf).scatter_reduce(0, self.inverse, values, "amin")
        self.constant = (high == low)[self.inverse]  # per element


def _group_normalise(values: Tensor, group_ids: Tensor, cfg: AdvantageConfig) -> Tensor:
    """(x - group mean) [/ (group std + eps)], exactly 0 for groups whose members are all equal."""
    stats = _GroupStats(values, group_ids)
    centred = values - stats.mean[stats.inverse]
    if cfg.norm_by_std:
        centred = centred / (stats.std[stats.inverse] + cfg.eps)
    return torch.where(stats.constant, torch.zeros_like(centred), centred)


def _broadcast(per_step_N: Tensor, mask_NL: Tensor) -> Tensor:
    return per_step_N[:, None] * mask_NL
