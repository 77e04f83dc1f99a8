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
    assert "no-such-model" not in out  # refused before the model was looked for
