"""On-policy distillation on Ray: the learner workers hold the local teacher (like the reference
model) and score their shards of the packed micro-batches; the run computes the single-process
trainer's reverse KL and losses on the same trajectories."""

from __future__ import annotations

import json

import pytest
from trainer_envs import tasks

from agent_r1.models.tiny import save_tiny_checkpoint
from agent_r1.train.config import config_from_dict
from agent_r1.train.trainer import Trainer

pytestmark = pytest.mark.ray


def test_ray_learner_workers_score_with_the_teacher_like_one_process(
    cluster, tiny_checkpoint, tiny_tokenizer, tmp_path
):
    teacher = save_tiny_checkpoint(tmp_path / "teacher", seed=5, tokenizer=tiny_tokenizer, num_layers=2)
    rows = {}
    for backend in ("none", "ray"):
        run_dir = tmp_path / backend
        config = config_from_dict(
            {
                "model": {"path": str(tiny_checkpoint)},
                "env": {"name": "trainer_envs:LowByteEnv"},
                "rollout": {"n": 4, "max_tokens": 8, "max_steps": 2},
                "algorithm": {"distill": {"teacher": str(teacher), "reward_weight": 1.0}},
                "trainer": {
                    "steps": 2,
                    "tasks_per_step": 4,
                    "lr": 3e-3,
                    "run_dir": str(run_dir),
                    "mini_batches": 1,
                    "micro_batch_tokens": 64,  # several micro-batches: both workers get a shard
                    "torch_threads": 1,
                },
                "logging": {"progress": False, "tensorboard": False, "dump_trajectories": False},
                "distributed": {"backend": backend, "num_rollout_actors": 1, "num_learner_workers": 2},
            }
        )
        Trainer(config, train_tasks=tasks(8)).fit()
        metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        rows[backend] = {r["step"]: r for r in metrics if "distill/reverse_kl" in r}
    for step in (1, 2):
        single, distributed = rows["none"][step], rows["ray"][step]
        assert distributed["time/teacher"] > 0
        # the same trajectories (sync Ray reproduces the single-process run) scored by the same teacher
        # in fp32 on both sides, and the same update: equal to float rounding
        for key in ("distill/reverse_kl", "loss/policy", "grad_norm"):
            assert distributed[key] == pytest.approx(single[key], rel=1e-4, abs=1e-6), (step, key)
