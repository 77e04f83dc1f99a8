"""Issue 43 item 4: failures that used to pass silently.

- a dataset row missing a field the task's env or reward reads is refused when the data is loaded,
  naming the row and the field (each env / task declares ``required_fields``);
- a full disk or an unwritable run directory during a checkpoint is one clear error, and the previous
  checkpoint stays intact and resumable;
- a run started into a run directory that already holds checkpoints is refused unless ``--resume``,
  ``--resume-or-start`` or ``--overwrite``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent_r1.tasks.arithmetic import make_dataset
from agent_r1.train.config import load_config
from agent_r1.train.data import DataError, config_tasks


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ---------------------------------------------------------------- rows missing a field the env reads


def test_an_arithmetic_row_without_answer_is_refused_naming_the_row_and_field(tmp_path):
    rows = make_dataset(4, seed=3)
    del rows[2]["answer"]
    tasks = _write_jsonl(tmp_path / "tasks.jsonl", rows)
    config = load_config(None, [f"data.train={tasks}", "env.name=agent_r1.tasks.arithmetic:make_env"])
    with pytest.raises(DataError) as caught:
        config_tasks(config, None, "data.train")
    message = str(caught.value)
    assert message.startswith(f"data.train: {tasks}: row 2 (id '{rows[2]['id']}') has no field 'answer'")
    assert "'agent_r1.tasks.arithmetic:make_env' declares it" in message
    # The same rows given in Python, and the complete file, pass.
    rows[2]["answer"] = "1"
    assert config_tasks(config, rows, "data.train") == rows


def test_a_registered_task_through_prepare_declares_its_fields(tmp_path):
    rows = [{"id": "q0", "prompt": "Who?", "answer": "Ada"}, {"id": "q1", "prompt": "Where?"}]
    tasks = _write_jsonl(tmp_path / "qa.jsonl", rows)
    config = load_config(
        None,
        [
            f"data.val={tasks}",
            "env.name=agent_r1.tasks.prepare:task_env",
            "env.kwargs={task: multihop_qa}",
        ],
    )
    with pytest.raises(DataError, match=r"data\.val: .*qa\.jsonl: row 1 \(id 'q1'\) has no field 'answer'"):
        config_tasks(config, None, "data.val")


def test_a_custom_env_class_declares_its_fields(tmp_path):
    rows = [{"id": "g0", "dx": 1, "dy": 0, "budget": 2}, {"id": "g1", "dx": 1, "budget": 2}]
    config = load_config(None, ["env.name=gridwalk"])
    with pytest.raises(DataError, match=r"data\.train: row 1 \(id 'g1'\) has no field 'dy'"):
        config_tasks(config, rows, "data.train")


def test_the_trainer_refuses_before_loading_the_model(tmp_path, tiny_checkpoint, capsys):
    from agent_r1.cli import main

    rows = make_dataset(3, seed=0)
    del rows[1]["answer"]
    tasks = _write_jsonl(tmp_path / "tasks.jsonl", rows)
    config = tmp_path / "config.yaml"
    config.write_text(
        json.dumps(
            {
                "model": {"path": str(tmp_path / "no-such-model"), "tokenizer": str(tiny_checkpoint)},
                "data": {"train": str(tasks)},
                "env": {"name": "agent_r1.tasks.arithmetic:make_env"},
                "trainer": {"steps": 1, "run_dir": str(tmp_path / "run")},
                "logging": {"progress": False, "tensorboard": False, "report": False},
            }
        )
    )
    assert main(["train", str(config)]) == 2
    out = capsys.readouterr().out
    assert "row 1 (id 'train-0-1') has no field 'answer'" in out
    # found without loading any weight, beside the data row: the model folder that is not there
    assert "2 problems found without the weights" in out and "no-such-model' is not a local folder" in out


# ---------------------------------------------------------------- a checkpoint that cannot be written


def _train_config(tmp_path: Path, run_dir: Path, **trainer) -> Path:
    tasks = _write_jsonl(tmp_path / "low.jsonl", [{"id": f"t{i}", "prompt": f"task {i}"} for i in range(4)])
    config = {
        "model": {"path": str(trainer.pop("model"))},
        "data": {"train": str(tasks)},
        "env": {"name": "trainer_envs:LowByteEnv"},
        "rollout": {"n": 2, "max_tokens": 4, "max_steps": 1, "max_batch_size": 8},
        "trainer": {
            "steps": 1,
            "tasks_per_step": 2,
            "lr": 3e-3,
            "checkpoint_every": 1,
            "keep_checkpoints": 3,
            "torch_threads": 1,
            "run_dir": str(run_dir),
            **trainer,
        },
        "logging": {"progress": False, "tensorboard": False, "report": False},
    }
    path = tmp_path / "config.yaml"
    path.write_text(json.dumps(config))
    return path


@pytest.fixture
def tmpfs(tmp_path):
    """A real file system of its own (a tmpfs), so that a full disk is a real ENOSPC."""
    import subprocess

    mounted: list[Path] = []

    def mount(path: Path, size: str) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
        mounted.append(path)
        return path

    yield mount
    for path in reversed(mounted):
        subprocess.run(["umount", "-l", str(path)], check=False)


def _fill(disk: Path, leave: int) -> Path:
    """Take all but ``leave`` bytes of the file system of ``disk`` (allocated, not sparse)."""
    import os
    import shutil

    ballast = disk / "ballast"
    fd = os.open(ballast, os.O_CREAT | os.O_WRONLY)
    try:
        os.posix_fallocate(fd, 0, shutil.disk_usage(disk).free - leave)
    finally:
        os.close(fd)
    return ballast


def test_a_full_disk_during_a_checkpoint_is_one_error_and_the_previous_one_resumes(
    tmp_path, tmpfs, tiny_checkpoint, capsys
):
    import torch

    from agent_r1.cli import main
    from agent_r1.train.checkpoint import checkpoint_problem

    disk = tmpfs(tmp_path / "disk", "48m")
    run = disk / "run"
    config = _train_config(tmp_path, run, model=tiny_checkpoint)
    assert main(["train", str(config)]) == 0
    checkpoints = run / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_000001"]
    capsys.readouterr()

    ballast = _fill(disk, leave=256 * 1024)  # room for the logs, not for a 3 MB model
    assert main(["train", str(config), "trainer.steps=2", "--resume"]) == 2
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1, out  # one error, no traceback
    assert "cannot write checkpoint step_000002 under" in out[0]
    assert "No space left on device" in out[0]
    assert "the previous checkpoint step_000001 is intact" in out[0]
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_000001"]  # the partial write is gone
    assert checkpoint_problem(checkpoints / "step_000001") is None

    ballast.unlink()
    assert main(["train", str(config), "trainer.steps=2", "--resume"]) == 0
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_000001", "step_000002"]
    state = torch.load(checkpoints / "step_000002" / "trainer_state.pt", weights_only=False)
    assert state["step"] == 2
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]


def test_an_unwritable_checkpoint_directory_is_one_error_and_the_previous_one_resumes(
    tmp_path, tmpfs, tiny_checkpoint, capsys
):
    import subprocess

    from agent_r1.cli import main
    from agent_r1.train.checkpoint import checkpoint_problem

    run = tmp_path / "run"
    checkpoints = tmpfs(run / "checkpoints", "48m")
    config = _train_config(tmp_path, run, model=tiny_checkpoint)
    assert main(["train", str(config)]) == 0
    capsys.readouterr()
    subprocess.run(["mount", "-o", "remount,ro", str(checkpoints)], check=True)
    assert main(["train", str(config), "trainer.steps=2", "--resume"]) == 2
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1, out
    assert "cannot write checkpoint step_000002" in out[0] and "Read-only file system" in out[0]
    assert "the previous checkpoint step_000001 is intact" in out[0]
    subprocess.run(["mount", "-o", "remount,rw", str(checkpoints)], check=True)
    assert checkpoint_problem(checkpoints / "step_000001") is None
    assert main(["train", str(config), "trainer.steps=2", "--resume"]) == 0
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_000001", "step_000002"]


# ---------------------------------------------------------------- a run dir that holds an earlier run


def test_a_fresh_start_into_a_run_with_checkpoints_is_refused_unless_a_flag_says_what_to_do(
    tmp_path, tiny_checkpoint, capsys, caplog
):
    import logging

    from agent_r1.cli import main

    run = tmp_path / "run"
    config = _train_config(tmp_path, run, model=tiny_checkpoint, steps=2, checkpoint_every=1)
    assert main(["train", str(config)]) == 0
    checkpoints = run / "checkpoints"
    before = {p.name: p.stat().st_mtime_ns for p in checkpoints.iterdir()}
    assert sorted(before) == ["step_000001", "step_000002"]
    metrics = (run / "metrics.jsonl").read_text()
    capsys.readouterr()

    assert main(["train", str(config)]) == 2
    out = capsys.readouterr().out
    assert f"trainer.run_dir {run} already holds checkpoints (step_000001, step_000002)" in out
    assert "--resume" in out and "--resume-or-start" in out and "--overwrite" in out
    assert {p.name: p.stat().st_mtime_ns for p in checkpoints.iterdir()} == before  # untouched
    assert (run / "metrics.jsonl").read_text() == metrics

    # --resume-or-start continues (nothing left to train at steps=2, one more at steps=3).
    assert main(["train", str(config), "trainer.steps=3", "--resume-or-start"]) == 0
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_000001", "step_000002", "step_000003"]
    with pytest.raises(SystemExit) as refused:  # argparse: one or the other
        main(["train", str(config), "--resume", "--overwrite"])
    assert refused.value.code == 2
    capsys.readouterr()

    with caplog.at_level(logging.WARNING, logger="agent_r1.train.resume"):
        assert main(["train", str(config), "trainer.steps=1", "--overwrite"]) == 0
    assert "--overwrite: deleted the earlier run in" in caplog.text
    assert "checkpoints/{step_000001, step_000002, step_000003}, metrics.jsonl" in caplog.text
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_000001"]
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1]

    # A run directory without checkpoints (a run killed before its first) starts without a flag.
    fresh = tmp_path / "fresh"
    (fresh / "checkpoints").mkdir(parents=True)
    assert main(["train", str(config), f"trainer.run_dir={fresh}", "trainer.steps=1"]) == 0
