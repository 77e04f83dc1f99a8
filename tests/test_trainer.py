"""The RL trainer end to end on the tiny model and a real two-turn environment (tests/trainer_envs.py)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file
from trainer_envs import tasks

from agent_r1.cli import main
from agent_r1.train import phases
from agent_r1.train.backends import export_weights
from agent_r1.train.config import ConfigError, config_from_dict
from agent_r1.train.learner import load_policy
from agent_r1.train.summary import summarize_rollout
from agent_r1.train.trainer import Trainer
from agent_r1.types import Step, Trajectory, TrajectoryGroup, TrajectoryStatus


def _config(tiny_checkpoint, run_dir, **sections):
    data = {
        "model": {"path": str(tiny_checkpoint)},
        "env": {"name": "trainer_envs:LowByteEnv"},
        "rollout": {"n": 4, "max_tokens": 8, "max_steps": 2},
        "trainer": {
            "steps": 6,
            "tasks_per_step": 4,
            "lr": 3e-3,
            "run_dir": str(run_dir),
            "eval_every": 6,
            "mini_batches": 2,
            "checkpoint_every": 3,
        },
        "logging": {"progress": False},
    }
    for section, values in sections.items():
        data[section] = {**data.get(section, {}), **values}
    return config_from_dict(data)


@pytest.fixture(scope="module")
def trained(tiny_checkpoint, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    trainer = Trainer(
        _config(tiny_checkpoint, run_dir), train_tasks=tasks(12), val_tasks=tasks(4, offset=100)
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    final = trainer.fit()
    return trainer, run_dir, before, final


def test_training_improves_reward_and_changes_the_weights(trained):
    trainer, run_dir, before, final = trained
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/reward" in r]
    assert [r["step"] for r in evals] == [0, 6]
    assert evals[-1]["eval/reward"] > evals[0]["eval/reward"]  # greedy held-out reward went up
    train_rows = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in train_rows] == list(range(1, 7))
    assert train_rows[-1]["reward/mean"] + train_rows[-2]["reward/mean"] > (
        train_rows[0]["reward/mean"] + train_rows[1]["reward/mean"]
    )
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    assert final["eval/success"] == evals[-1]["eval/success"]


def test_metrics_follow_the_run_directory_contract(trained):
    _, run_dir, _, _ = trained
    row = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[1])
    for key in (
        "step",
        "time",
        "reward/mean",
        "success/mean",
        "entropy/mean",
        "response_length/mean",
        "steps_per_trajectory/mean",
        "throughput/tokens_per_s",
        "loss/policy",
        "grad_norm",
        "lr",
        "clip_fraction",
        "time/step",
        "time/rollout",
        "time/score",
        "time/filter",
        "time/batch",
        "time/old_logprobs",
        "time/reference",
        "time/values",
        "time/advantage",
        "time/update",
        "time/sync",
    ):
        assert key in row, key
    # two appended turns merge into one sequence: fewer tokens than one row per step
    assert row["train/tokens"] < row["train/tokens_per_step_layout"]
    # LowByteEnv terminates on its second turn = rollout.max_steps: nothing ran out of steps
    assert row["rollout/step_limit_fraction"] == 0.0 and row["rollout/truncated_fraction"] == 0.0
    assert row["throughput/sampled_tokens"] == pytest.approx(
        row["throughput/tokens_per_s"] * row["time/step"]
    )
    assert (run_dir / "config.yaml").is_file()
    assert list((run_dir / "tb").glob("events.out.tfevents.*"))
    assert sorted(p.name for p in (run_dir / "trajectories").iterdir()) == [
        f"step_{s:06d}.jsonl" for s in range(1, 7)
    ]
    # the step-6 evaluation beat the start's: its checkpoint is also kept as checkpoints/best
    evaluated = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last_eval = [r for r in evaluated if "eval/success" in r][-1]
    best = ["best"] if last_eval["watch/best_step"] == 6 else []
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == best + [
        "step_000003",
        "step_000006",
    ]
    report = (run_dir / "report.html").read_text()  # written when fit() ends
    assert "<html" in report and "reward/mean" in report


def test_trajectory_dumps_carry_the_viewer_keys(trained, tiny_tokenizer):
    _, run_dir, _, _ = trained
    records = [
        json.loads(line) for line in (run_dir / "trajectories" / "step_000001.jsonl").read_text().splitlines()
    ]
    assert len(records) == 16 and all(r["type"] == "Trajectory" for r in records)
    assert all(isinstance(r["info"]["success"], bool) for r in records)
    step = records[0]["steps"][0]
    assert step["info"]["prompt_text"] == tiny_tokenizer.decode(step["prompt_ids"])
    assert step["info"]["response_tokens"] == [tiny_tokenizer.decode([t]) for t in step["response_ids"]]
    # Each step's advantage is its trajectory's GRPO advantage (the default estimator, broadcast to
    # every token): (G - mean) / (unbiased std + 1e-6) over its group. The viewer's value is the mean
    # over the step's tokens of equal float32 values: within a few float32 ulps of |A| <= 2.
    groups: dict[str, list[dict]] = {}
    for record in records:
        groups.setdefault(record["group_id"], []).append(record)
    assert len(groups) == 4
    for members in groups.values():
        returns = torch.tensor([sum(s["reward"] for s in r["steps"]) + r["outcome_reward"] for r in members])
        expected = ((returns - returns.mean()) / (returns.std() + 1e-6)).tolist()
        for record, advantage in zip(members, expected, strict=True):
            for s in record["steps"]:
                assert s["info"]["advantage"] == pytest.approx(advantage, abs=4e-6)


def test_trajectories_cut_by_the_step_limit_are_counted(tiny_checkpoint, tmp_path):
    """A flow limit below the env's two turns: every trajectory ends OK on a truncated last step, so
    ``rollout/step_limit_fraction`` is 1 (``rollout/truncated_fraction`` counts context overflows)."""
    config = _config(tiny_checkpoint, tmp_path, rollout={"n": 2, "max_steps": 1})
    trainer = Trainer(config, train_tasks=tasks(2))
    try:
        groups = trainer.rollout(tasks(2), step=1)
        metrics = summarize_rollout(groups, trainer.policy_version).metrics
    finally:
        trainer.close()
    assert all(
        t.status is TrajectoryStatus.OK and t.steps[-1].truncated for g in groups for t in g.trajectories
    )
    assert metrics["rollout/step_limit_fraction"] == 1.0 and metrics["rollout/truncated_fraction"] == 0.0


def test_final_checkpoint_is_a_loadable_hugging_face_model(trained):
    trainer, run_dir, _, _ = trained
    weights = load_file(run_dir / "checkpoints" / "step_000006" / "model" / "model.safetensors")
    for name, p in trainer.model.state_dict().items():
        if name in weights:
            assert torch.equal(weights[name], p), name
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(run_dir / "checkpoints" / "step_000006" / "model")


def test_sampler_and_learner_log_probs_agree(trained):
    trainer, _, _, _ = trained
    trainer.rollouts.engine.engine.__init__(
        trainer.model, tokenizer=trainer.tokenizer
    )  # the engine was closed by fit
    try:
        groups = trainer.rollout(tasks(2), step=99)
        batch, _ = phases.old_logprobs(trainer.batch(groups, 1), trainer.context(1))
    finally:
        trainer.close()
    torch.testing.assert_close(batch.tokens.old_logprobs, batch.tokens.sampler_logprobs, atol=1e-4, rtol=0)


def _group(rewards, status=TrajectoryStatus.OK):
    step = Step(prompt_ids=(1, 2), response_ids=(3,), logprobs=(-1.0,))
    return TrajectoryGroup(
        "g",
        "t",
        tuple(
            Trajectory(
                "t", (step,), outcome_reward=r, status=status, error="boom" if status == "error" else None
            )
            for r in rewards
        ),
    )


def test_filter_drops_errors_and_with_dapo_zero_variance_groups(trained):
    trainer, _, _, _ = trained
    groups = [_group([1.0, 1.0]), _group([0.0, 1.0]), _group([1.0], status=TrajectoryStatus.ERROR)]
    kept, metrics = trainer.filter(groups)
    assert len(kept) == 2 and metrics["filter/zero_variance_groups"] == 1
    trainer.config = replace(trainer.config, algorithm=replace(trainer.config.algorithm, dynamic_filter=True))
    kept, metrics = trainer.filter(groups)
    assert [g.rewards for g in kept] == [[0.0, 1.0]]


def test_separate_engine_copy_with_lora_is_synced_with_merged_weights(tiny_checkpoint, tmp_path):
    config = _config(
        tiny_checkpoint,
        tmp_path,
        model={"lora": {"rank": 4, "alpha": 8}},
        rollout={"share_model": False, "n": 2},
        trainer={
            "steps": 2,
            "tasks_per_step": 2,
            "eval_every": 0,
            "checkpoint_every": 0,
            "lr": 1e-2,
            "mini_batches": 1,
        },
        logging={"tensorboard": False, "dump_trajectories": False},
    )
    trainer = Trainer(config, train_tasks=tasks(4))
    assert not trainer.rollouts.shares_model
    trainer.fit()
    engine_state = trainer.rollouts.engine.engine.model.state_dict()
    exported = dict(export_weights(trainer.model))
    base = load_policy(replace(config.model, lora=replace(config.model.lora, rank=0))).state_dict()
    assert exported.keys() == base.keys()
    changed = 0
    for name, tensor in exported.items():
        assert torch.equal(engine_state[name], tensor), name
        changed += not torch.equal(tensor, base[name])
    assert changed > 0  # the merged LoRA deltas reached the engine
    assert trainer.rollouts.engine.engine.weight_version == 2
    adapter = load_file(tmp_path / "checkpoints" / "step_000002" / "model" / "adapter_model.safetensors")
    assert adapter and all("lora_" in k for k in adapter)


def test_kl_to_a_reference_model_is_reported(tiny_checkpoint, tmp_path):
    config = _config(
        tiny_checkpoint,
        tmp_path,
        algorithm={"kl": {"coef": 0.1}},
        rollout={"n": 2},
        trainer={"steps": 2, "tasks_per_step": 2, "eval_every": 0, "checkpoint_every": 0, "mini_batches": 1},
        logging={"tensorboard": False, "dump_trajectories": False},
    )
    trainer = Trainer(config, train_tasks=tasks(4))
    assert trainer.learner.policy.reference is not None
    trainer.fit()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    kl = [r["kl/mean"] for r in rows if "kl/mean" in r]
    # Step 1's only update starts from the reference's own weights: the KL is exactly 0; after one
    # optimizer step the policy has moved, and the k-estimators are positive away from it.
    assert kl[0] == 0.0 and kl[1] > 0


def test_config_errors_name_the_key(tiny_checkpoint, tmp_path):
    with pytest.raises(ConfigError, match="'env.name'"):
        Trainer(_config(tiny_checkpoint, tmp_path, env={"name": ""}), train_tasks=tasks(2))
    config_file = tmp_path / "bad.yaml"
    config_file.write_text("trainer:\n  stepz: 3\n")
    assert main(["train", str(config_file)]) == 2


@pytest.mark.parametrize("estimator", ["gae_token", "gae_step"])
def test_critic_estimators_train_a_value_head_and_resume_it(tiny_checkpoint, tmp_path, estimator):
    config = _config(
        tiny_checkpoint,
        tmp_path,
        algorithm={"advantage": {"name": estimator, "gamma": 0.9, "lam": 0.95}},
        rollout={"n": 2},
        trainer={
            "steps": 2,
            "tasks_per_step": 2,
            "eval_every": 0,
            "checkpoint_every": 0,
            "mini_batches": 1,
            "critic_lr": 1e-2,
        },
        logging={"tensorboard": False, "dump_trajectories": False},
    )
    trainer = Trainer(config, train_tasks=tasks(4))
    head_before = trainer.learner.critic.model.head.weight.detach().clone()
    final = trainer.fit()
    assert final["update/skipped"] == 0 and final["critic/update_skipped"] == 0
    assert final["loss/value"] > 0 and "critic/value_error" in final
    first = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert first["critic/value_mean"] == 0.0  # the head starts at zero: every value is exactly 0
    assert not torch.equal(trainer.learner.critic.model.head.weight, head_before)
    resumed = Trainer(
        replace(config, trainer=replace(config.trainer, steps=3)), train_tasks=tasks(4), resume=True
    )
    resumed._restore()
    resumed.close()
    for name, tensor in trainer.learner.critic.model.state_dict().items():
        assert torch.equal(resumed.learner.critic.model.state_dict()[name], tensor), name
    assert resumed.learner.critic.optimizer_steps == trainer.learner.critic.optimizer_steps == 2


def test_eval_command_scores_a_checkpoint(trained, tmp_path, capsys):
    _, run_dir, _, _ = trained
    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps(t) + "\n" for t in tasks(4, offset=100)))
    code = main(
        [
            "eval",
            str(run_dir / "config.yaml"),
            f"data.val={val}",
            "--checkpoint",
            str(run_dir / "checkpoints" / "step_000006"),
        ]
    )
    assert code == 0
    metrics = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert metrics["eval/reward"] == pytest.approx(rows[-1]["eval/reward"], abs=1e-6)  # same greedy policy


def test_score_replaces_outcome_rewards_with_reward_fn(trained):
    trainer, _, _, _ = trained
    groups = [_group([0.0, 1.0]), _group([1.0], status=TrajectoryStatus.ERROR)]
    trainer.reward_fn = lambda trajectory, task: len(task["prompt"])
    try:
        scored = trainer.score(groups, [{"prompt": "abc"}, {"prompt": "x"}])
    finally:
        trainer.reward_fn = None
    assert scored[0].rewards == [3.0, 3.0]
    assert scored[1].rewards == [1.0]  # ERROR trajectories keep what they had; the filter drops them


def test_steps_record_the_policy_version_that_sampled_them(trained):
    trainer, run_dir, _, _ = trained
    versions = [
        {
            s["policy_version"]
            for line in (run_dir / "trajectories" / f"step_{k:06d}.jsonl").read_text().splitlines()
            for s in json.loads(line)["steps"]
        }
        for k in (1, 6)
    ]
    assert versions == [{0}, {5}]


def test_dapo_resampling_refills_the_groups_the_filter_dropped(tiny_checkpoint, tmp_path):
    """With dynamic filtering, groups whose rewards all agree are dropped and fresh tasks are rolled
    out (up to ``algorithm.resample_rounds`` rounds) until ``tasks_per_step`` groups are kept."""
    flat = {f"t{i}" for i in range(0, 12, 2)}

    def reward_fn(trajectory, task):  # even tasks: every sample totals 0, a zero-variance group
        return -sum(s.reward for s in trajectory.steps) if task["id"] in flat else 0.0

    def run(rounds: int, name: str) -> list[dict]:
        config = _config(
            tiny_checkpoint,
            tmp_path / name,
            algorithm={"dynamic_filter": True, "resample_rounds": rounds},
            trainer={"steps": 3, "eval_every": 0, "checkpoint_every": 0},
            logging={"tensorboard": False, "dump_trajectories": False, "report": False},
        )
        Trainer(config, train_tasks=tasks(12), reward_fn=reward_fn).fit()
        return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]

    plain = run(0, "plain")
    assert any(row["filter/kept_groups"] < 4 for row in plain)
    refilled = run(4, "refilled")
    assert all(row["filter/kept_groups"] == 4 for row in refilled), refilled
    assert any(row["filter/resample_rounds"] >= 1 for row in refilled)
    with pytest.raises(ConfigError, match="algorithm.resample_rounds"):
        _config(tiny_checkpoint, tmp_path, algorithm={"resample_rounds": 2})


def test_bf16_sampler_and_learner_log_probs_agree_to_bf16_rounding(tiny_checkpoint, tmp_path):
    """``model.dtype: bfloat16`` end to end on the CPU: the HF engine samples (KV-cached decode) and the
    learner rescores (packed forward, chunked LM head) from one bf16 model. Each path rounds every
    logit z to bf16 (relative 2^-8) before the fp32 log-softmax, so log p = z_t - logsumexp(z) can move
    by about 2^-8 |z| per term and path: the bound below is 4 * 2^-8 * max|z|. Measured on the 2-core
    development machine: max gap 5.8e-3, mean 8.1e-4 over 1,013 tokens."""
    config = _config(
        tiny_checkpoint,
        tmp_path,
        model={"dtype": "bfloat16"},
        rollout={"max_tokens": 16},
        trainer={"steps": 1, "tasks_per_step": 4},
        logging={"dump_trajectories": False, "tensorboard": False},
    )
    trainer = Trainer(config, train_tasks=tasks(8))
    try:
        assert next(trainer.model.parameters()).dtype is torch.bfloat16
        groups = trainer.rollout(tasks(8), step=1)
        batch, _ = phases.old_logprobs(
            trainer.batch(groups, 1), trainer.context(1)
        )  # two mini-batches: the learner recomputes the old log-probs
    finally:
        trainer.close()
    gap = (batch.tokens.old_logprobs - batch.tokens.sampler_logprobs).abs()
    with torch.no_grad():
        ids = torch.tensor([list(s.prompt_ids) + list(s.response_ids) for s in [batch.rows.steps[0]]])
        max_logit = float(trainer.model(input_ids=ids).logits.float().abs().max())
    assert gap.numel() > 100
    assert float(gap.max()) <= 4 * 2**-8 * max_logit, (float(gap.max()), max_logit)
