"""The running baselines of ``rae``: per role, a running mean of its trajectories' returns.

The ``rae`` advantage estimator (``agent_r1.algos.advantages.rae``; SPIRAL, Liu et al. 2025, arXiv
2506.24119) subtracts from each return the running mean of the returns of the trajectory's role, a
baseline that needs no group: one sample per task (``rollout.n: 1``) learns, and so does each seat of
a zero-sum game played by one shared policy, where a group over both seats of one game has mean zero
by construction (docs/multi_agent.md, "Credit"). ``RoleBaselines`` keeps those means from step to step
and fills the step table's ``baseline`` column (``apply``); the trainer saves them in its checkpoints
(``state_dict``), so a resumed run continues with the baselines it stopped with.

Each step, before the advantages, a role's mean takes the batch:

    b_role <- decay * b_role + (1 - decay) * (mean return of the role's trajectories in the batch)

with ``decay`` = ``algorithm.advantage.baseline_decay`` (SPIRAL's 0.95). A role's first batch sets
b_role to its mean (SPIRAL starts b at 0, where the first steps' advantages are the raw returns). The
key is the trajectory's ``role`` (``Trajectory.role``; a run without roles has one key); several
games in one run keep one baseline per role name, so name the roles per game where their returns
differ.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

import torch

from agent_r1.algos import StepTable
from agent_r1.algos.advantages import trajectory_returns

__all__ = ["RoleBaselines"]


class RoleBaselines:
    """``rae``'s running mean of the returns per role (``means``: role -> b; None is the role of a
    run without roles)."""

    def __init__(self, decay: float) -> None:
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"RoleBaselines: decay must be in [0, 1], got {decay}")
        self.decay = decay
        self.means: dict[str | None, float] = {}

    def observe(self, returns: Mapping[str | None, Sequence[float]]) -> None:
        """Each role's trajectory returns of one batch into its running mean."""
        for role, values in returns.items():
            if not values:
                continue
            batch_mean = sum(values) / len(values)
            previous = self.means.get(role)
            self.means[role] = (
                batch_mean if previous is None else self.decay * previous + (1.0 - self.decay) * batch_mean
            )

    def apply(
        self, table: StepTable, roles: Sequence[str | None], gamma: float = 1.0
    ) -> tuple[StepTable, dict[str, float]]:
        """``table`` with its ``baseline`` column: each row its trajectory's role's mean after this
        batch's returns (``roles[i]``: the role of trajectory index i of ``table.traj_index``;
        ``gamma``: the estimator's discount, that of the returns averaged); and each role's
        baseline as a metric (``rae/baseline`` or ``rae/baseline/<role>``)."""
        if table.num_steps == 0:
            return replace(table, baseline=torch.zeros(0)), {}
        returns_N = trajectory_returns(table, gamma)
        last = table.done.nonzero().flatten().tolist()  # one row per trajectory
        batch: dict[str | None, list[float]] = {}
        for row in last:
            batch.setdefault(roles[int(table.traj_index[row])], []).append(float(returns_N[row]))
        self.observe(batch)
        row_roles = [roles[i] for i in table.traj_index.tolist()]
        baseline_N = torch.tensor([self.means[role] for role in row_roles], dtype=torch.float32)
        metrics = {
            "rae/baseline" if role is None else f"rae/baseline/{role}": self.means[role] for role in batch
        }
        return replace(table, baseline=baseline_N), metrics

    def state_dict(self) -> dict:
        return {"decay": self.decay, "means": dict(self.means)}

    def load_state_dict(self, state: Mapping) -> None:
        """The means a checkpoint saved (none: a checkpoint from before ``rae``, or of a run that did
        not use it)."""
        self.means = dict(state.get("means", {}))
