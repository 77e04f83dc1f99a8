"""What a new user meets in the first hour (issue 19, item 3): the tiny model in one call, the
zero-variance warning of a run that cannot learn, env errors on the console, and no transformers
progress bars around agent-r1's own loads and saves."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from trainer_envs import tasks
from transformers.utils import logging as hf_logging

from agent_r1.models.loading import load_frozen_model, quiet_progress_bars, save_model
from agent_r1.models.tiny import build_tiny
from agent_r1.tasks import get_task
from agent_r1.train.checkpoint import save_checkpoint
from agent_r1.train.config import config_from_dict, dump_config
from agent_r1.train.health import ZeroVarianceWatch
from agent_r1.train.learner import load_policy
from agent_r1.train.trainer import Trainer

TESTS = Path(__file__).parent
BARS = ("Loading weights", "Writing model shards")

# ------------------------------------------------------------------------------ the tiny model


def test_build_tiny_returns_a_model_sized_to_its_tokenizer() -> None:
    model, tokenizer = build_tiny(seed=0)
    assert model.config.model_type == "qwen2"
    assert model.get_input_embeddings().num_embeddings == len(tokenizer)
    assert (
        model.config.eos_token_id == tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    )
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id
    again, _ = build_tiny(seed=0)
    other, _ = build_tiny(seed=1)
    weight = model.get_input_embeddings().weight
    assert torch.equal(weight, again.get_input_embeddings().weight)
    assert not torch.equal(weight, other.get_input_embeddings().weight)
    qwen3, _ = build_tiny(architecture="qwen3", num_layers=2)
    assert qwen3.config.model_type == "qwen3" and qwen3.config.num_hidden_layers == 2
    with pytest.raises(ValueError, match=r"unknown tiny architecture 'llama'; known: qwen2, qwen3"):
        build_tiny(architecture="llama")


# ------------------------------------------------------------------------ the zero-variance watch


def test_the_watch_warns_once_after_patience_steps_of_mostly_zero_variance() -> None:
    watch = ZeroVarianceWatch(threshold=0.9, patience=3)
    assert watch.observe(1, 16, 16, 0.0) is None
    assert watch.observe(2, 15, 16, 0.0) is None  # 15/16 = 0.94 >= 0.9: the streak goes on
    message = watch.observe(3, 16, 16, 0.0)
    assert message.startswith("step 3: 16 of 16 groups had zero reward variance (reward/mean 0)")
    assert "for 3 steps in a row" in message and "agent_r1.train.sft" in message
    assert "docs/tutorial.md" in message
    assert watch.observe(4, 16, 16, 0.0) is None  # once per run


def test_a_step_below_the_threshold_restarts_the_streak_and_a_step_without_groups_does_not() -> None:
    watch = ZeroVarianceWatch(threshold=0.9, patience=2)
    assert watch.observe(1, 16, 16) is None
    assert watch.observe(2, 14, 16) is None  # 14/16 = 0.875 < 0.9
    assert watch.observe(3, 16, 16) is None
    assert watch.observe(4, 0, 0) is None  # every trajectory ended in ERROR: not counted either way
    message = watch.observe(5, 9, 10)
    assert message.startswith("step 5: 9 of 10 groups had zero reward variance, and at least 90% did for 2")


@pytest.mark.parametrize(
    "success_mean, cause",
    [
        (None, "Most likely the model never succeeds"),
        (0.0, "The model almost never succeeds (success/mean 0)"),
        (0.95, "Nearly every sample succeeds (success/mean 0.95): the model has learned these tasks"),
        (0.5, "Some tasks are always solved and the others never (success/mean 0.5)"),
    ],
)
def test_the_warning_names_the_cause_the_success_rate_points_to(success_mean, cause) -> None:
    # A run that has learned its tasks (seen in benchmarks/real_model.py at step 18, reward/mean 1)
    # must not be told to warm-start its model.
    watch = ZeroVarianceWatch(threshold=0.9, patience=1)
    message = watch.observe(7, 4, 4, None if success_mean is None else success_mean, success_mean)
    assert cause in message and message.endswith("Look at a few trajectories: agent-r1 view RUN_DIR.")
    assert ("agent_r1.train.sft" in message) == (success_mean is None or success_mean <= 0.1)


def test_the_watch_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match=r"threshold must be in \(0, 1\], got 0"):
        ZeroVarianceWatch(threshold=0)
    with pytest.raises(ValueError, match=r"patience must be >= 1, got 0"):
        ZeroVarianceWatch(patience=0)


def test_a_trainer_on_a_task_it_never_solves_warns_of_zero_variance(
    tiny_checkpoint, tmp_path, caplog
) -> None:
    """Needs the watch wired into Trainer.train_step (the lines in the issue-19 report). A random tiny
    model never answers the arithmetic task (an exact <answer>N</answer> after tool calls): every group
    earns 0 on every sample, step after step."""
    spec = get_task("arithmetic")
    config = config_from_dict(
        {
            "model": {"path": str(tiny_checkpoint)},
            "env": {"name": "agent_r1.tasks.arithmetic:make_env", "kwargs": {"max_turns": 2}},
            "rollout": {"n": 2, "max_tokens": 8, "max_steps": 2},
            "trainer": {"steps": 4, "tasks_per_step": 2, "run_dir": str(tmp_path), "torch_threads": 1},
            "logging": {"progress": False, "tensorboard": False, "report": False},
        }
    )
    caplog.set_level(logging.WARNING)
    Trainer(config, train_tasks=spec.make_dataset(8, split="train", seed=0)).fit()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(r["filter/zero_variance_groups"] == 2 and r["reward/mean"] == 0 for r in rows)
    warnings = [r.getMessage() for r in caplog.records if "zero reward variance" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith("step 3: 2 of 2 groups had zero reward variance")


# ----------------------------------------------------------------------- env errors on the console


def test_env_errors_reach_the_console_of_agent_r1_train(tiny_checkpoint, tmp_path) -> None:
    """The first error of each kind per rollout is printed on stderr by the real command (no logging
    set up by the user), and the run goes on within its error budget."""
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(t) + "\n" for t in tasks(2)))
    config = config_from_dict(
        {
            "model": {"path": str(tiny_checkpoint)},
            "data": {"train": str(train)},
            "env": {"name": "health_envs:FailingResetEnv", "kwargs": {"failing": ["t1"]}},
            "rollout": {"n": 2, "max_tokens": 4, "max_steps": 2},
            "trainer": {
                "steps": 1,
                "tasks_per_step": 2,
                "run_dir": str(tmp_path / "run"),
                "torch_threads": 1,
            },
            "logging": {"progress": False, "tensorboard": False, "report": False},
        }
    )
    dump_config(config, tmp_path / "config.yaml")
    env = {**os.environ, "PYTHONPATH": str(TESTS), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "agent_r1.cli", "train", str(tmp_path / "config.yaml")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    assert "step 1: 2 of 4 trajectories ended in ERROR with RuntimeError: reset is broken for task t1" in (
        done.stderr
    )
    assert not any(bar in done.stderr for bar in BARS)


# ------------------------------------------------------------------------ no progress bars


def test_loads_and_saves_draw_no_progress_bars_and_warnings_still_print(
    tiny_checkpoint, tmp_path, capfd, caplog
):
    from agent_r1.rollout.hf import HFEngine
    from agent_r1.train.config import ModelConfig

    assert hf_logging.is_progress_bar_enabled()
    model = load_policy(ModelConfig(path=str(tiny_checkpoint)))
    load_frozen_model(tiny_checkpoint)
    HFEngine.from_pretrained(str(tiny_checkpoint)).close()
    save_model(model, None, tmp_path / "saved")
    save_checkpoint(tmp_path / "checkpoints", 1, model, {}, {}, keep=1)
    verbosity = hf_logging.get_verbosity()
    with quiet_progress_bars():
        assert hf_logging.get_verbosity() == verbosity  # only the bars are off, not the logging
        hf_logging.get_logger("transformers.modeling_utils").warning("a warning inside still prints")
    err = capfd.readouterr().err
    assert not any(bar in err for bar in BARS), err
    assert [r.getMessage() for r in caplog.records] == ["a warning inside still prints"]
    assert hf_logging.is_progress_bar_enabled()  # restored for the user's own code

    # The control: the same save outside draws the bar, so the check above can fail.
    model.save_pretrained(tmp_path / "plain")
    assert "Writing model shards" in capfd.readouterr().err
