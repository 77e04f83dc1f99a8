"""``rae``: a running mean of each role's returns as the baseline (issue 50, item 3; SPIRAL).

One shared policy in a zero-sum game has a group mean of zero over both seats of a game, and one game
per task (``rollout.n: 1``) has no group at all: ``rae`` subtracts each role's running mean instead,
which the trainer keeps from step to step and saves in checkpoints."""

from __future__ import annotations

import pytest
import torch
from test_multi_policy import tasks

from agent_r1.algos import StepTable
from agent_r1.train import phases
from agent_r1.train.config import ConfigError, config_from_dict
from agent_r1.train.health import ZeroVarianceWatch
from agent_r1.train.role_baseline import RoleBaselines
from agent_r1.train.trainer import Trainer
from agent_r1.types import Step, Trajectory, TrajectoryGroup


def _trajectory(role: str | None, reward: float, steps: int = 1) -> Trajectory:
    step = Step(prompt_ids=(1, 2), response_ids=(3, 4), logprobs=(-1.0, -1.0))
    return Trajectory("t", (step,) * steps, outcome_reward=reward, role=role)


def _table(*trajectories: Trajectory) -> StepTable:
    return StepTable.from_groups([TrajectoryGroup(f"g{i}", "t", (t,)) for i, t in enumerate(trajectories)])


def test_a_role_s_first_batch_sets_its_mean_and_later_ones_move_it_by_the_decay():
    baselines = RoleBaselines(decay=0.75)
    first = [_trajectory("a", 1.0), _trajectory("b", -1.0, steps=2), _trajectory("a", 0.0)]
    table, metrics = baselines.apply(_table(*first), [t.role for t in first])
    assert baselines.means == {"a": 0.5, "b": -1.0}
    assert table.baseline.tolist() == [0.5, -1.0, -1.0, 0.5]  # per step row: a, b, b, a
    assert metrics == {"rae/baseline/a": 0.5, "rae/baseline/b": -1.0}
    second = [_trajectory("a", 1.0)]  # b is not in this batch: its mean stays
    table, metrics = baselines.apply(_table(*second), ["a"])
    assert baselines.means == {"a": 0.75 * 0.5 + 0.25 * 1.0, "b": -1.0}
    assert table.baseline.tolist() == [0.625] and metrics == {"rae/baseline/a": 0.625}
    restored = RoleBaselines(decay=0.75)
    restored.load_state_dict(baselines.state_dict())
    assert restored.means == baselines.means
    restored.load_state_dict({})  # a checkpoint from before rae: no means
    assert restored.means == {}
    with pytest.raises(ValueError, match="decay"):
        RoleBaselines(decay=1.5)


def test_a_run_without_roles_keeps_one_baseline():
    baselines = RoleBaselines(decay=0.95)
    _, metrics = baselines.apply(_table(_trajectory(None, 2.0), _trajectory(None, 0.0)), [None, None])
    assert metrics == {"rae/baseline": 1.0}


def test_the_group_watch_is_silent_without_a_group_baseline():
    """With one sample per task every group's rewards agree; under rae that is no sign of a run that
    does not learn, so the zero-variance warning stays silent."""
    silent, watch = ZeroVarianceWatch(group_baseline=False), ZeroVarianceWatch()
    assert all(silent.observe(step, 8, 8) is None for step in range(1, 6))
    assert any(watch.observe(step, 8, 8) is not None for step in range(1, 6))


def _config(tiny_checkpoint, run_dir, **algorithm):
    return config_from_dict(
        {
            "model": {"path": str(tiny_checkpoint), "lora": {"rank": 4, "alpha": 8}},
            "env": {"name": "trainer_envs:LowHighEnv"},
            "rollout": {"n": 1, "max_tokens": 8, "max_steps": 2},
            "algorithm": {"advantage": {"name": "rae", "baseline_decay": 0.5}, **algorithm},
            "trainer": {
                "steps": 3,
                "tasks_per_step": 4,
                "lr": 1e-2,
                "run_dir": str(run_dir),
                "eval_every": 0,
                "checkpoint_every": 2,
            },
            "logging": {"progress": False, "tensorboard": False},
        }
    )


def test_one_sample_per_task_is_allowed_with_rae_and_dapo_s_filter_is_refused(tiny_checkpoint, tmp_path):
    assert _config(tiny_checkpoint, tmp_path).rollout.n == 1
    with pytest.raises(ConfigError, match="every group would be dropped") as error:
        _config(tiny_checkpoint, tmp_path, dynamic_filter=True)
    assert error.value.key == "algorithm.dynamic_filter"
    with pytest.raises(ConfigError, match="n >= 2"):
        _config(tiny_checkpoint, tmp_path, advantage="grpo")


def test_the_advantage_phase_subtracts_each_role_s_running_mean(tiny_checkpoint, tmp_path):
    """One shared policy, two roles, one sample per task: each trajectory's advantage is its return
    minus its role's running mean after the batch (decay 0.5), on every trained token."""
    trainer = Trainer(_config(tiny_checkpoint, tmp_path / "run"), train_tasks=tasks(4))
    try:
        rewards = {"low": [1.0, 0.0], "high": [0.0, 0.5]}
        groups = [
            TrajectoryGroup(f"t{i}@{role}", f"t{i}", (_trajectory(role, reward),), role=role)
            for role, values in rewards.items()
            for i, reward in enumerate(values)
        ]
        batch = trainer.batch(groups, 1)
        batch, metrics = phases.advantages(batch, trainer.context(1))
        means = {"low": 0.5, "high": 0.25}
        assert metrics == {f"rae/baseline/{role}": mean for role, mean in means.items()}
        expected = [t.outcome_reward - means[t.role] for t in batch.trajectories]
        assert batch.step_means(batch.tokens.advantages) == pytest.approx(expected)
        # the next batch moves each mean halfway to the batch's
        groups = [TrajectoryGroup("t9@low", "t9", (_trajectory("low", 1.5),), role="low")]
        batch, metrics = phases.advantages(trainer.batch(groups, 2), trainer.context(2))
        assert metrics == {"rae/baseline/low": 1.0}
        assert batch.step_means(batch.tokens.advantages) == pytest.approx([0.5])
    finally:
        trainer.close()


def test_self_play_with_one_sample_per_task_trains_and_its_baselines_resume(tiny_checkpoint, tmp_path):
    config = _config(tiny_checkpoint, tmp_path / "run")
    trainer = Trainer(config, train_tasks=tasks(8))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    metrics = trainer.fit()
    assert {"rae/baseline/low", "rae/baseline/high"} <= set(metrics)
    assert metrics["update/skipped"] == 0 and metrics["grad_norm"] > 0
    after = dict(trainer.model.named_parameters())
    assert any(not torch.equal(after[n].detach(), value) for n, value in before.items())  # it learned
    saved = dict(trainer.baselines.means)
    assert set(saved) == {"low", "high"}
    state = torch.load(
        tmp_path / "run" / "checkpoints" / "step_000003" / "trainer_state.pt", weights_only=False
    )
    assert state["role_baselines"]["means"] == saved
    resumed = Trainer(config, train_tasks=tasks(8), resume=True)
    try:
        resumed._restore()
        assert resumed.baselines.means == saved
    finally:
        resumed.close()
