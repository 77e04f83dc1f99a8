"""The step table: trajectory groups flattened into tensors, one row per step (one MDP transition).

Every estimator, loss and penalty in ``agent_r1.algos`` reads this table and nothing else; it holds
no model. ``StepTable.from_groups`` builds it from ``agent_r1.types`` objects.

Layout (N steps, L = the longest response; per-token tensors are right-padded to L):

| field | shape | meaning |
|---|---|---|
| ``traj_index`` | (N,) long | which trajectory the step belongs to (equal ids = same trajectory) |
| ``group_index`` | (N,) long | which group (the n samples of one task) the trajectory belongs to |
| ``step_index`` | (N,) long | position of the step inside its trajectory (0, 1, ...) |
| ``reward`` | (N,) float | the step's *immediate* reward (``Step.reward``) |
| ``outcome_reward`` | (N,) float | the outcome reward of the step's trajectory, repeated on each of its rows |
| ``done`` | (N,) bool | the step is the last step of its trajectory |
| ``state_index`` | (N,) long | equal ids = the step starts from the same state (see below) |
| ``step_values`` | (N,) float, optional | a step-level critic's value of the step's start state |
| ``baseline`` | (N,) float, optional | a baseline of the step's trajectory's return kept across steps (``rae``: the running mean of its role's returns) |
| ``response_mask`` | (N, L) float | 1 for trained (model-generated) tokens; 0 for padding and forced tokens |
| ``sampler_logprobs`` | (N, L) float | log-probs the rollout engine sampled the response tokens with |
| ``old_logprobs`` | (N, L) float, optional | the learner's recomputation of the behaviour policy's (PPO's old policy) |
| ``ref_logprobs`` | (N, L) float, optional | log-probs under the frozen reference policy |
| ``token_values`` | (N, L) float, optional | a token-level critic's values, V(s) before each token |
| ``token_rewards`` | (N, L) float, optional | extra per-token rewards, e.g. the KL penalty (``kl.kl_reward_penalty``) |

**Reward accounting (nothing is counted twice).** ``outcome_reward`` is repeated on every row of a
trajectory only so that the table stays one row per step; every estimator counts it exactly once, at
the trajectory's ``done`` row. The reward an estimator credits to step k is ``step_rewards``:

    R_k = reward_k + [done_k] * outcome_reward + sum over the step's tokens of token_rewards

so the return of a trajectory (gamma = 1) is ``Trajectory.total_reward`` plus the summed per-token
penalties. The per-token estimator ``gae_token`` places ``reward_k + [done_k] * outcome_reward`` on
the step's last trained token and each ``token_rewards`` entry on its own token: the same sum.

**Episode ends.** ``done`` marks the last stored step, whether the episode terminated or was truncated;
estimators treat it as terminal (no bootstrap value after it), as is usual in LLM RL where a
truncated episode has no next prompt to evaluate.

**States.** ``state_index`` names the state a step starts from, for step-level group baselines
(GiGPO's anchor states). Two steps share a state when they are in the same group and either carry the
same ``Step.state_key`` (when the environment sets one) or, without a key, have identical
``prompt_ids``. Steps of different groups never share a state.

**What the caller filters.** Trajectories with status ERROR carry no trustworthy reward: the caller
drops them before building the table (``from_groups`` raises on one). Trajectories without steps have
nothing to train and add no rows; they therefore do not count in group statistics either. Groups may
have any size, including 1 (group baselines then give zero advantage).

Row order is groups, then trajectories, then steps, as given; no estimator depends on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import torch
from torch import Tensor

from agent_r1.types import Trajectory, TrajectoryGroup, TrajectoryStatus

__all__ = ["PerStep", "PerToken", "StepColumns", "StepTable", "step_rewards"]

PerStep = Tensor | Sequence[float]
"""Per-step values for ``from_groups``: a (N,) tensor or one number per step, in table row order."""

PerToken = Tensor | Sequence[Sequence[float]]
"""Per-token values for ``from_groups``: a (N, L) tensor or one sequence per step (its response
length, or padded to L), in table row order."""

_PER_STEP = ("traj_index", "group_index", "step_index", "reward", "outcome_reward", "done", "state_index")
_OPTIONAL_PER_STEP = ("step_values", "baseline")
_PER_TOKEN = ("response_mask", "sampler_logprobs")
_OPTIONAL_PER_TOKEN = ("old_logprobs", "ref_logprobs", "token_values", "token_rewards")


@dataclass(frozen=True)
class StepTable:
    """Steps of trajectory groups as tensors; see the module docstring for every field."""

    traj_index: Tensor  # (N,) long
    group_index: Tensor  # (N,) long
    step_index: Tensor  # (N,) long
    reward: Tensor  # (N,) float
    outcome_reward: Tensor  # (N,) float
    done: Tensor  # (N,) bool
    state_index: Tensor  # (N,) long
    response_mask: Tensor  # (N, L) float
    sampler_logprobs: Tensor  # (N, L) float
    step_values: Tensor | None = None  # (N,) float
    baseline: Tensor | None = None  # (N,) float
    old_logprobs: Tensor | None = None  # (N, L) float
    ref_logprobs: Tensor | None = None  # (N, L) float
    token_values: Tensor | None = None  # (N, L) float
    token_rewards: Tensor | None = None  # (N, L) float

    def __post_init__(self) -> None:
        if self.response_mask.dtype == torch.bool:
            object.__setattr__(self, "response_mask", self.response_mask.to(torch.float32))
        n = self.traj_index.shape[0] if self.traj_index.dim() == 1 else -1
        for name in _PER_STEP + _OPTIONAL_PER_STEP:
            value = getattr(self, name)
            if value is not None and (value.dim() != 1 or value.shape[0] != n):
                raise ValueError(
                    f"StepTable.{name} must have shape (N,) = ({n},) like traj_index, got {tuple(value.shape)}"
                )
        if self.response_mask.dim() != 2 or self.response_mask.shape[0] != n:
            raise ValueError(
                f"StepTable.response_mask must have shape (N, L) with N = {n}, got {tuple(self.response_mask.shape)}"
            )
        for name in _PER_TOKEN + _OPTIONAL_PER_TOKEN:
            value = getattr(self, name)
            if value is not None and value.shape != self.response_mask.shape:
                raise ValueError(
                    f"StepTable.{name} must have the shape of response_mask {tuple(self.response_mask.shape)}, "
                    f"got {tuple(value.shape)}"
                )
        if n:
            self._check_trajectories()

    def _check_trajectories(self) -> None:
        order = self.sorted_rows()
        traj = self.traj_index[order]
        step = self.step_index[order]
        same_traj = traj[1:] == traj[:-1]
        repeated = same_traj & (step[1:] == step[:-1])
        if repeated.any():
            row = int(order[1:][repeated][0])
            raise ValueError(
                f"StepTable: trajectory {int(self.traj_index[row])} has step_index {int(self.step_index[row])} twice"
            )
        mixed_group = same_traj & (self.group_index[order][1:] != self.group_index[order][:-1])
        if mixed_group.any():
            row = int(order[1:][mixed_group][0])
            raise ValueError(
                f"StepTable: trajectory {int(self.traj_index[row])} spans several group_index values"
            )
        is_last = torch.ones_like(traj, dtype=torch.bool)
        is_last[:-1] = ~same_traj
        wrong_done = is_last != self.done[order]
        if wrong_done.any():
            row = int(order[wrong_done][0])
            raise ValueError(
                f"StepTable: done must be set exactly on the last step of each trajectory; row {row} "
                f"(trajectory {int(self.traj_index[row])}, step {int(self.step_index[row])}) has done="
                f"{bool(self.done[row])}"
            )

    @property
    def num_steps(self) -> int:
        return self.traj_index.shape[0]

    @property
    def max_response_len(self) -> int:
        return self.response_mask.shape[1]

    @property
    def behaviour_logprobs(self) -> Tensor:
        """The behaviour policy's log-probs: the learner's recomputation when set, else the sampler's."""
        return self.sampler_logprobs if self.old_logprobs is None else self.old_logprobs

    def sorted_rows(self) -> Tensor:
        """Row indices ordered by (trajectory, step index): each trajectory's steps, in order. (N,)"""
        by_step = torch.argsort(self.step_index, stable=True)
        return by_step[torch.argsort(self.traj_index[by_step], stable=True)]

    def select(self, rows: Tensor) -> StepTable:
        """The table restricted to (or reordered by) ``rows``; whole trajectories must be kept."""
        return replace(
            self,
            **{
                f.name: getattr(self, f.name)[rows] for f in fields(self) if getattr(self, f.name) is not None
            },
        )

    @classmethod
    def from_groups(
        cls,
        groups: Sequence[TrajectoryGroup],
        *,
        token_values: PerToken | None = None,
        step_values: PerStep | None = None,
        ref_logprobs: PerToken | None = None,
    ) -> StepTable:
        """Flatten groups into a table: rows are groups, then trajectories, then steps, in order.

        ``sampler_logprobs`` are the sampler's ``Step.logprobs``; ``old_logprobs`` (the learner's
        recomputation) are set with ``dataclasses.replace`` when the trainer has them. Optional per-step /
        per-token values are given in the same row order. Raises ValueError on a trajectory with
        status ERROR (the caller drops those; see the module docstring).
        """
        columns = StepColumns()
        for g, group in enumerate(groups):
            for t, trajectory in enumerate(group.trajectories):
                if trajectory.status is TrajectoryStatus.ERROR:
                    raise ValueError(
                        f"StepTable.from_groups: group {g} ({group.group_id!r}) trajectory {t} has status "
                        f"ERROR ({trajectory.error!r}); drop ERROR trajectories before building the table"
                    )
                columns.add(g, trajectory)
        return columns.table(token_values=token_values, step_values=step_values, ref_logprobs=ref_logprobs)


class StepColumns:
    """The step table's columns, filled one trajectory at a time (``add``) and tensorised once
    (``table``): ``StepTable.from_groups`` and the trainer's batch (``agent_r1.train.batch``, which
    walks the same trajectories for its token layout in the same pass) build tables with it.

    Trajectories without steps add no rows and take no trajectory index: ``traj_index`` counts the
    trajectories added with steps, in order (``num_trajectories``)."""

    def __init__(self) -> None:
        self.traj_index: list[int] = []
        self.group_index: list[int] = []
        self.step_index: list[int] = []
        self.reward: list[float] = []
        self.outcome: list[float] = []
        self.done: list[bool] = []
        self.state_index: list[int] = []
        self.masks: list[Sequence[int]] = []
        self.logprobs: list[Sequence[float]] = []
        self._states: dict[tuple, int] = {}
        self.num_trajectories = 0

    def add(self, group: int, trajectory: Trajectory) -> None:
        """The rows of ``trajectory`` (of group ``group``), one per step."""
        if not trajectory.steps:
            return
        last = len(trajectory.steps) - 1
        for k, step in enumerate(trajectory.steps):
            key = ("key", step.state_key) if step.state_key is not None else ("ids", step.prompt_ids)
            self.traj_index.append(self.num_trajectories)
            self.group_index.append(group)
            self.step_index.append(k)
            self.reward.append(step.reward)
            self.outcome.append(trajectory.outcome_reward)
            self.done.append(k == last)
            self.state_index.append(self._states.setdefault((group, key), len(self._states)))
            self.masks.append(step.response_mask)
            self.logprobs.append(step.logprobs)
        self.num_trajectories += 1

    def table(
        self,
        *,
        token_values: PerToken | None = None,
        step_values: PerStep | None = None,
        ref_logprobs: PerToken | None = None,
    ) -> StepTable:
        n = len(self.traj_index)
        width = max((len(m) for m in self.masks), default=0)
        return StepTable(
            traj_index=torch.tensor(self.traj_index, dtype=torch.long),
            group_index=torch.tensor(self.group_index, dtype=torch.long),
            step_index=torch.tensor(self.step_index, dtype=torch.long),
            reward=torch.tensor(self.reward, dtype=torch.float32),
            outcome_reward=torch.tensor(self.outcome, dtype=torch.float32),
            done=torch.tensor(self.done, dtype=torch.bool),
            state_index=torch.tensor(self.state_index, dtype=torch.long),
            response_mask=_pad_rows(self.masks, width, "response_mask"),
            sampler_logprobs=_pad_rows(self.logprobs, width, "sampler_logprobs"),
            step_values=None if step_values is None else _per_step(step_values, n, "step_values"),
            ref_logprobs=None if ref_logprobs is None else _per_token(ref_logprobs, n, width, "ref_logprobs"),
            token_values=None if token_values is None else _per_token(token_values, n, width, "token_values"),
        )


def step_rewards(table: StepTable) -> Tensor:
    """R_k = reward_k + [done_k] * outcome_reward + sum_t token_rewards[k, t]: each reward once. (N,)"""
    rewards_N = table.reward + table.done.to(table.reward.dtype) * table.outcome_reward
    if table.token_rewards is not None:
        rewards_N = rewards_N + (table.token_rewards * table.response_mask).sum(-1)
    return rewards_N


def _pad_rows(rows: Sequence[Sequence[float]], width: int, name: str) -> Tensor:
    out = torch.zeros(len(rows), width, dtype=torch.float32)
    for i, row in enumerate(rows):
        if len(row) > width:
            raise ValueError(
                f"{name}: row {i} has {len(row)} entries, more than the longest response ({width})"
            )
        out[i, : len(row)] = torch.as_tensor(row, dtype=torch.float32)
    return out


def _per_step(values: PerStep, n: int, name: str) -> Tensor:
    tensor = torch.as_tensor(values, dtype=torch.float32)
    if tensor.shape != (n,):
        raise ValueError(f"{name} must hold one value per step, shape ({n},); got {tuple(tensor.shape)}")
    return tensor


def _per_token(values: PerToken, n: int, width: int, name: str) -> Tensor:
    if isinstance(values, Tensor):
        if values.shape != (n, width):
            raise ValueError(f"{name} must have shape (N, L) = ({n}, {width}); got {tuple(values.shape)}")
        return values.to(torch.float32)
    if len(values) != n:
        raise ValueError(f"{name} must hold one sequence per step ({n}); got {len(values)}")
    return _pad_rows(values, width, name)
