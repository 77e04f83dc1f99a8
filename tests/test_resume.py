"""Kill a real training process (mid-training, and mid-checkpoint-write), resume it with --resume,
and compare with an uninterrupted run: same data order, samples, metrics and final weights."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

TESTS = Path(__file__).parent
VOLATILE = ("time", "time/", "throughput/")  # wall-clock keys differ between runs


def _config(tmp_path: Path, checkpoint: Path) -> Path:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"t{i}", "prompt": f"task {i}"}) + "\n" for i in range(5)))
    config = {
        "model": {"path": str(checkpoint)},
        "data": {"train": str(tasks), "required_fields": ["prompt"]},
        "env": {"name": "trainer_envs:LowByteEnv"},
        "rollout": {"n": 2, "max_tokens": 6, "max_steps": 2, "max_batch_size": 8},
        "trainer": {
            "steps": 5,
            "tasks_per_step": 2,
            "lr": 3e-3,
            "checkpoint_every": 2,
            "keep_checkpoints": 2,
            "mini_batches": 2,
            "torch_threads": 1,
        },
        "logging": {"progress": False, "tensorboard": False},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _start(config: Path, run_dir: Path, *extra: str, env_extra: dict | None = None) -> subprocess.Popen:
    env = {
        **os.environ,
        "PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        **(env_extra or {}),
    }
    return subprocess.Popen(
        [sys.executable, "-m", "agent_r1.cli", "train", str(config), f"trainer.run_dir={run_dir}", *extra],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _finish(process: subprocess.Popen) -> None:
    out, _ = process.communicate(timeout=300)
    assert process.returncode == 0, out


def _wait_for(condition, process: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while not condition():
        if process.poll() is not None:
            raise AssertionError(f"the run ended before the kill point:\n{process.stdout.read()}")
        assert time.time() < deadline, "timed out waiting for the kill point"
        time.sleep(0.05)


def _rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


def _last_step(run_dir: Path) -> int:
    f = run_dir / "metrics.jsonl"
    return (
        max(
            (json.loads(line)["step"] for line in f.read_text().splitlines() if line.endswith("}")), default=0
        )
        if f.exists()
        else 0
    )


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "checkpoints" / "step_000005" / "model" / "model.safetensors")


def _dumps(run_dir: Path) -> list[list[str]]:
    return [
        [json.loads(line)["task_id"] for line in f.read_text().splitlines()]
        for f in sorted((run_dir / "trajectories").glob("step_*.jsonl"))
    ]


def _assert_same_run(a: Path, b: Path) -> None:
    rows_a, rows_b = _rows(a), _rows(b)
    assert [r["step"] for r in rows_a] == [r["step"] for r in rows_b]
    for ra, rb in zip(rows_a, rows_b, strict=True):
        assert ra.keys() == rb.keys()
        for key in ra:
            assert ra[key] == pytest.approx(rb[key], rel=1e-4, abs=1e-6), (ra["step"], key)
    assert _dumps(a) == _dumps(b)
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], atol=1e-5, rtol=1e-4)
    assert sorted(p.name for p in (b / "checkpoints").iterdir()) == ["step_000004", "step_000005"]


@pytest.mark.slow
def test_sigkill_mid_training_and_mid_checkpoint_then_resume_matches_uninterrupted(tmp_path, tiny_checkpoint):
    config = _config(tmp_path, tiny_checkpoint)
    reference = tmp_path / "uninterrupted"
    _finish(_start(config, reference))

    killed = tmp_path / "killed_mid_training"
    process = _start(config, killed)
    _wait_for(lambda: _last_step(killed) >= 3, process)  # past checkpoint 2, before checkpoint 4
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not (killed / "checkpoints" / "step_000004").exists()
    _finish(_start(config, killed, "--resume"))
    _assert_same_run(reference, killed)

    torn = tmp_path / "killed_mid_checkpoint"
    process = _start(config, torn, env_extra={"AGENT_R1_CHECKPOINT_WRITE_DELAY": "4:60"})
    _wait_for(lambda: (torn / "checkpoints" / ".tmp-step_000004" / "model").exists(), process)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not (torn / "checkpoints" / "step_000004").exists()
    _finish(_start(config, torn, "--resume"))
    assert not list((torn / "checkpoints").glob(".tmp-*"))
    _assert_same_run(reference, torn)
