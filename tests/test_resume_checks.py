"""Issue 18 items 3 and 7: clear errors instead of tracebacks or silent fresh starts, and checkpoint
integrity.

- a missing ``model.path``, a missing data file and a tokenizer without a chat template each give one
  message naming the config key, and the CLI exits 2;
- ``--resume`` with no checkpoint, or with a config that differs from the run's ``config.yaml``, is
  refused (listing each key old → new) unless ``--resume-or-start`` / ``--allow-config-change``;
- every checkpoint carries a manifest of sizes and sha256s; a truncated, changed or missing file is
  detected, and ``--resume`` falls back to the previous good checkpoint with a warning naming the file.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from agent_r1.cli import main
from agent_r1.models.loading import ModelNotFoundError
from agent_r1.train.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    rng_state,
    save_checkpoint,
)
from agent_r1.train.config import load_config
from agent_r1.train.resume import ResumeError, resume_checkpoint
from agent_r1.train.trainer import Trainer


def _config_file(tmp_path: Path, model: Path, run_dir: Path, **trainer) -> Path:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"t{i}", "prompt": f"task {i}"}) + "\n" for i in range(5)))
    config = {
        "model": {"path": str(model)},
        "data": {"train": str(tasks), "required_fields": ["prompt"]},
        "env": {"name": "trainer_envs:LowByteEnv"},
        "rollout": {"n": 2, "max_tokens": 4, "max_steps": 1, "max_batch_size": 8},
        "trainer": {
            "steps": 2,
            "tasks_per_step": 2,
            "lr": 3e-3,
            "checkpoint_every": 2,
            "keep_checkpoints": 2,
            "torch_threads": 1,
            "run_dir": str(run_dir),
            **trainer,
        },
        "logging": {"progress": False, "tensorboard": False, "report": False},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


# ---------------------------------------------------------------- item 3: clear errors


def test_a_missing_model_path_names_the_key_and_value(tmp_path, tiny_checkpoint, capsys):
    missing = tmp_path / "no-such-model"
    config = _config_file(tmp_path, missing, tmp_path / "run")
    assert main(["train", str(config)]) == 2
    out = capsys.readouterr().out
    assert f"model.path = '{missing}' is not a local folder" in out
    assert "Hugging Face Hub" in out

    # The tokenizer found elsewhere: the policy's own load names model.path too.
    with pytest.raises(ModelNotFoundError, match=r"model\.path = .*no-such-model.* is not a local folder"):
        Trainer(load_config(config, [f"model.tokenizer={tiny_checkpoint}"]))


@pytest.mark.parametrize("key", ["data.train", "data.val"])
def test_a_missing_data_file_names_the_config_key(tmp_path, tiny_checkpoint, capsys, key):
    config = _config_file(tmp_path, tiny_checkpoint, tmp_path / "run")
    missing = tmp_path / "missing.jsonl"
    assert main(["train", str(config), f"{key}={missing}"]) == 2
    assert f"agent-r1 train: {key}: {missing}: no such file" in capsys.readouterr().out


def test_a_tokenizer_without_chat_template_is_a_clear_cli_error(tmp_path, tiny_checkpoint, capsys):
    model = tmp_path / "no-template"
    shutil.copytree(tiny_checkpoint, model)
    (model / "chat_template.jinja").unlink()
    config = _config_file(tmp_path, model, tmp_path / "run")
    assert main(["train", str(config)]) == 2
    assert f"agent-r1 train: model.path = '{model}' has no chat template" in capsys.readouterr().out
    assert main(["eval", str(config), f"data.val={tmp_path / 'tasks.jsonl'}"]) == 2
    assert f"agent-r1 eval: model.path = '{model}' has no chat template" in capsys.readouterr().out


# ---------------------------------------------------------------- item 3: resume refusals


def test_resume_without_a_checkpoint_is_refused_unless_asked_to_start_fresh(
    tmp_path, tiny_checkpoint, capsys
):
    run_dir = tmp_path / "run"
    config = _config_file(tmp_path, tiny_checkpoint, run_dir, steps=1)
    with pytest.raises(
        ResumeError, match=r"no checkpoint to resume from in .*run/checkpoints.*--resume-or-start"
    ):
        Trainer(load_config(config), resume=True)
    assert main(["train", str(config), "--resume"]) == 2
    assert "--resume: no checkpoint to resume from in" in capsys.readouterr().out
    assert not (run_dir / "metrics.jsonl").exists()

    assert main(["train", str(config), "--resume-or-start"]) == 0
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1]


def test_resume_with_a_changed_config_is_refused_and_allowed_on_request(tmp_path, tiny_checkpoint, capsys):
    run_dir = tmp_path / "run"
    config = _config_file(tmp_path, tiny_checkpoint, run_dir)
    assert main(["train", str(config)]) == 0
    started_with = (run_dir / "config.yaml").read_text()
    changed = ["trainer.lr=0.001", "algorithm.advantage=rloo", "trainer.tasks_per_step=1"]

    capsys.readouterr()
    assert main(["train", str(config), *changed[:1], "--resume", *changed[1:]]) == 2  # either side
    out = capsys.readouterr().out
    assert "the config differs from the one this run was started with" in out
    assert "algorithm.advantage.name: 'grpo' → 'rloo'" in out
    assert "trainer.lr: 0.003 → 0.001" in out
    assert "trainer.tasks_per_step: 2 → 1" in out
    assert "--allow-config-change" in out
    assert (run_dir / "config.yaml").read_text() == started_with
    with pytest.raises(ResumeError, match=r"trainer\.lr: 0\.003 → 0\.001"):
        Trainer(load_config(config, changed), resume=True)

    with pytest.raises(SystemExit, match="2"):  # argparse's error: a word that is no key=value
        main(["train", str(config), "--resume", "trainer.steps"])
    assert "unrecognized arguments: trainer.steps" in capsys.readouterr().err

    # Extending the run under a constant schedule, and logging/checkpoint keys, need no flag.
    assert main(["train", str(config), "--resume", "trainer.steps=3", "trainer.keep_checkpoints=3"]) == 0
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir())[-1] == "step_000003"
    assert yaml.safe_load((run_dir / "config.prev-1.yaml").read_text()) == yaml.safe_load(started_with)
    # Under a cosine schedule trainer.steps sets the decay, so changing it is a real change.
    cosine = ["trainer.lr_schedule=cosine"]
    assert main(["train", str(config), "trainer.steps=4", *cosine, "--resume", "--allow-config-change"]) == 0
    before_cosine = yaml.safe_load((run_dir / "config.prev-2.yaml").read_text())
    assert before_cosine["trainer"]["lr_schedule"] == "constant"
    assert before_cosine["trainer"]["steps"] == 3
    with pytest.raises(ResumeError, match=r"trainer\.steps: 4 → 5"):
        Trainer(load_config(config, ["trainer.lr_schedule=cosine", "trainer.steps=5"]), resume=True)

    assert (
        main(
            ["train", str(config), "trainer.steps=5", *changed, *cosine, "--resume", "--allow-config-change"]
        )
        == 0
    )
    resumed_with = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert resumed_with["trainer"]["lr"] == 0.001 and resumed_with["algorithm"]["advantage"]["name"] == "rloo"
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5]
    # The allocator setting changes where memory comes from, not what is trained: no flag needed.
    retained = load_config(config, ["trainer.steps=5", *changed, *cosine, "trainer.retain_freed_memory=true"])
    assert resume_checkpoint(retained, True).name == "step_000005"


# ---------------------------------------------------------------- item 7: checkpoint integrity


def _truncate(file: Path) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


def _flip_byte(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


CORRUPTIONS = {
    "truncated": (_truncate, "model/model.safetensors", "bytes, the manifest says"),
    "byte flipped": (_flip_byte, "learner.pt", "does not match its sha256"),
    "deleted": (Path.unlink, "trainer_state.pt", "is missing"),
}


@pytest.fixture
def two_checkpoints(tmp_path, tiny_checkpoint) -> tuple[Path, torch.nn.Module]:
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint)
    directory = tmp_path / "checkpoints"
    for step in (1, 2):
        save_checkpoint(directory, step, model, {"lr": step}, {"rng": rng_state()}, keep=3)
    return directory, model


def test_a_checkpoint_records_every_file_in_its_manifest(two_checkpoints):
    directory, _ = two_checkpoints
    newest = directory / "step_000002"
    entries = json.loads((newest / "manifest.json").read_text())["files"]
    files = {p.relative_to(newest).as_posix() for p in newest.rglob("*") if p.is_file()}
    assert set(entries) == files - {"manifest.json"}
    assert {"model/model.safetensors", "learner.pt", "trainer_state.pt", "info.json"} <= set(entries)
    for name, entry in entries.items():
        assert entry["size"] == (newest / name).stat().st_size


@pytest.mark.parametrize("corruption", CORRUPTIONS)
def test_a_corrupt_newest_checkpoint_is_detected_and_skipped(two_checkpoints, caplog, corruption):
    directory, model = two_checkpoints
    damage, name, what = CORRUPTIONS[corruption]
    damage(directory / "step_000002" / name)

    with pytest.raises(CheckpointError, match=f"step_000002 is corrupt: {name} .*{what}"):
        load_checkpoint(directory / "step_000002", model)
    with caplog.at_level(logging.WARNING, logger="agent_r1.train.checkpoint"):
        assert latest_checkpoint(directory) == directory / "step_000001"
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "step_000002 is corrupt" in warning and name in warning and what in warning
    assert (directory / "corrupt-step_000002" / "info.json").is_file()  # kept aside for inspection
    assert latest_checkpoint(directory) == directory / "step_000001"
    _, trainer_state = load_checkpoint(directory / "step_000001", model)
    assert trainer_state["step"] == 1


def test_a_checkpoint_without_a_manifest_loads_with_a_warning(two_checkpoints, caplog):
    directory, model = two_checkpoints
    (directory / "step_000002" / "manifest.json").unlink()  # as written before manifests existed
    with caplog.at_level(logging.WARNING, logger="agent_r1.train.checkpoint"):
        assert latest_checkpoint(directory) == directory / "step_000002"
    assert "has no manifest.json" in caplog.text and "unverified" in caplog.text
    assert load_checkpoint(directory / "step_000002", model)[1]["step"] == 2


def test_resume_falls_back_from_a_corrupt_checkpoint_and_retrains_the_same_steps(
    tmp_path, tiny_checkpoint, caplog
):
    run_dir = tmp_path / "run"
    config = _config_file(tmp_path, tiny_checkpoint, run_dir, steps=4)
    assert main(["train", str(config)]) == 0
    weights_file = run_dir / "checkpoints" / "step_000004" / "model" / "model.safetensors"
    uninterrupted = load_file(weights_file)
    rows = (run_dir / "metrics.jsonl").read_text().splitlines()
    _flip_byte(weights_file)

    with caplog.at_level(logging.WARNING):
        assert main(["train", str(config), "--resume"]) == 0
    assert "step_000004 is corrupt: model/model.safetensors does not match its sha256" in caplog.text
    # Continued from step 2: steps 3 and 4 ran again and reproduced the uninterrupted weights.
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [
        1,
        2,
        3,
        4,
    ]
    assert (run_dir / "metrics.jsonl").read_text().splitlines()[:2] == rows[:2]
    resumed = load_file(weights_file)
    assert resumed.keys() == uninterrupted.keys()
    for name, tensor in uninterrupted.items():
        torch.testing.assert_close(resumed[name], tensor, atol=1e-5, rtol=1e-4)
    assert latest_checkpoint(run_dir / "checkpoints") == run_dir / "checkpoints" / "step_000004"
