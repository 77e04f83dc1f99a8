"""Issue 43 on Ray: ``trainer.deterministic`` reruns bitwise, the driver's SIGTERM mid-rollout
checkpoints, exits 4 and resumes bitwise, and a driver killed mid-update resumes bitwise (``tests/test_deterministic.py`` has the single-process
tier). Each run is an ``agent-r1 train`` process that starts its own local Ray cluster: two rollout
actors (whose engines see turns arrive in a timing-dependent order, ``JitteryLowByteEnv``) and one
learner worker."""

from __future__ import annotations

import signal

import pytest
import yaml
from test_deterministic import RESETS_PER_STEP, _config, _differences, _finish, _start, _wait_for

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def _ray_config(tmp_path, tiny_checkpoint, **trainer):
    path = _config(tmp_path, tiny_checkpoint, deterministic=True, **trainer)
    data = yaml.safe_load(path.read_text())
    data["distributed"] = {"backend": "ray", "num_rollout_actors": 2, "num_learner_workers": 1}
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="module")
def ray_reference(tmp_path_factory, tiny_checkpoint):
    tmp = tmp_path_factory.mktemp("deterministic_ray")
    run = tmp / "reference"
    _finish(_start(_ray_config(tmp, tiny_checkpoint), run))
    return run


def test_a_deterministic_ray_rerun_is_bitwise_equal(ray_reference, tmp_path, tiny_checkpoint):
    rerun = tmp_path / "rerun"
    _finish(_start(_ray_config(tmp_path, tiny_checkpoint), rerun))
    assert _differences(ray_reference, rerun) == []


@pytest.mark.parametrize(("where", "saved"), [("rollout", 2), ("update", 3)])
def test_sigterm_to_the_ray_driver_checkpoints_and_resumes_bitwise(
    ray_reference, tmp_path, tiny_checkpoint, where, saved
):
    """Mid-rollout the driver stops sampling and checkpoints step 2; mid-update (the driver pauses 3 s
    between step 3's two optimizer steps, on the learner worker) it finishes step 3 and checkpoints it."""
    config = _ray_config(tmp_path, tiny_checkpoint, checkpoint_every=0)
    marker = tmp_path / f"at-{where}"
    if where == "rollout":  # each actor holds one task's samples per step: its 8th reset is in step 3
        env = {"JITTER_PAUSE": f"{2 * RESETS_PER_STEP // 2 + 2}:120:{marker}"}
    else:
        env = {"AGENT_R1_UPDATE_DELAY": f"3:3:{marker}"}
    run = tmp_path / "run"
    process = _start(config, run, env=env)
    _wait_for(marker, process)
    process.send_signal(signal.SIGTERM)
    out = _finish(process, code=4)
    assert "preempted by SIGTERM" in out
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [f"step_{saved:06d}"]
    _finish(_start(config, run, "--resume"))
    assert _differences(ray_reference, run) == []


def test_sigkill_of_the_ray_driver_mid_update_then_resume_is_bitwise_equal(
    ray_reference, tmp_path, tiny_checkpoint
):
    """The driver killed outright while its learner worker is inside step 3's update (paused there):
    the Ray cluster the driver started goes with it, and ``--resume`` from checkpoint 2 ends where
    the uninterrupted run ended, to the bit."""
    config = _ray_config(tmp_path, tiny_checkpoint)
    marker = tmp_path / "at-update"
    run = tmp_path / "run"
    process = _start(config, run, env={"AGENT_R1_UPDATE_DELAY": f"3:120:{marker}"})
    _wait_for(marker, process)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not (run / "checkpoints" / "step_000003").exists()
    _finish(_start(config, run, "--resume"))
    assert _differences(ray_reference, run) == []
