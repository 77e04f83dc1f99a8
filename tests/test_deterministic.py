"""Issue 43: ``trainer.deterministic`` (bitwise reruns and resumes) and preemption (SIGTERM / SIGINT
checkpoint and exit 4, then ``--resume``).

Every run is a real ``agent-r1 train`` process over the tiny model, on ``JitteryLowByteEnv``: its
resets and steps pause for a random few milliseconds (drawn from the OS), so which turns the HF engine
finds live together changes from run to run. Runs are compared to the bit: every metric but
``time/*``, ``timeline/*`` and ``throughput/*``, every trajectory dump, and the final weights.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

TESTS = Path(__file__).parent
VOLATILE = ("time", "timeline/", "throughput/")  # wall-clock keys: time, time/*, ...
STEPS = 4


def _config(tmp_path: Path, checkpoint: Path, **trainer) -> Path:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"t{i}", "prompt": f"task {i}"}) + "\n" for i in range(6)))
    config = {
        "model": {"path": str(checkpoint)},
        "data": {"train": str(tasks), "required_fields": ["prompt"]},
        "env": {"name": "trainer_envs:JitteryLowByteEnv"},
        "rollout": {"n": 3, "max_tokens": 6, "max_steps": 2, "max_batch_size": 8},
        "trainer": {
            "steps": STEPS,
            "tasks_per_step": 2,
            "lr": 3e-3,
            "checkpoint_every": 1,
            "keep_checkpoints": 2,
            "mini_batches": 2,
            "torch_threads": 1,
            **trainer,
        },
        "logging": {"progress": False, "tensorboard": False, "report": False},
    }
    path = tmp_path / f"config-{len(list(tmp_path.glob('config-*')))}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _start(config: Path, run_dir: Path, *extra: str, env: dict | None = None) -> subprocess.Popen:
    environment = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
    environment.update(PYTHONPATH=f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **(env or {}))
    return subprocess.Popen(
        [sys.executable, "-m", "agent_r1.cli", "train", str(config), f"trainer.run_dir={run_dir}", *extra],
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _finish(process: subprocess.Popen, code: int = 0) -> str:
    out, _ = process.communicate(timeout=600)
    assert process.returncode == code, out
    return out


def _wait_for(path: Path, process: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while not path.exists():
        if process.poll() is not None:
            raise AssertionError(f"the run ended before {path.name}:\n{process.stdout.read()}")
        assert time.time() < deadline, f"timed out waiting for {path}"
        time.sleep(0.02)


def _rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


def _without_timings(trajectory: dict) -> dict:
    """A dumped trajectory without its steps' ``timings`` (wall-clock seconds)."""
    steps = [{k: v for k, v in s.items() if k != "timings"} for s in trajectory["steps"]]
    return {**trajectory, "steps": steps}


def _dumps(run_dir: Path) -> dict[str, list[dict]]:
    return {
        f.name: [_without_timings(json.loads(line)) for line in f.read_text().splitlines()]
        for f in sorted((run_dir / "trajectories").glob("step_*.jsonl"))
    }


def _weights(run_dir: Path) -> dict:
    return load_file(run_dir / "checkpoints" / f"step_{STEPS:06d}" / "model" / "model.safetensors")


def _differences(a: Path, b: Path) -> list[str]:
    """What differs between runs ``a`` and ``b``, to the bit (empty: the same run)."""
    found = []
    rows_a, rows_b = _rows(a), _rows(b)
    if [r["step"] for r in rows_a] != [r["step"] for r in rows_b]:
        return [f"steps {[r['step'] for r in rows_a]} vs {[r['step'] for r in rows_b]}"]
    for ra, rb in zip(rows_a, rows_b, strict=True):
        for key in sorted(ra.keys() | rb.keys()):
            if ra.get(key) != rb.get(key):
                found.append(f"step {ra['step']} {key}: {ra.get(key)!r} vs {rb.get(key)!r}")
    dumps_a, dumps_b = _dumps(a), _dumps(b)
    if dumps_a.keys() != dumps_b.keys():
        found.append(f"dumps {sorted(dumps_a)} vs {sorted(dumps_b)}")
    found += [f"trajectories/{name} differ" for name in dumps_a if dumps_a[name] != dumps_b.get(name)]
    wa, wb = _weights(a), _weights(b)
    found += [f"weight {name} differs" for name in wa if not wa[name].equal(wb[name])]
    return found


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_checkpoint):
    """An uninterrupted deterministic run, and its config."""
    tmp = tmp_path_factory.mktemp("deterministic")
    config = _config(tmp, tiny_checkpoint, deterministic=True)
    run = tmp / "reference"
    _finish(_start(config, run))
    return config, run


@pytest.mark.slow
def test_a_deterministic_rerun_in_another_process_is_bitwise_equal(reference, tmp_path):
    config, run = reference
    rerun = tmp_path / "rerun"
    _finish(_start(config, rerun))
    assert _differences(run, rerun) == []


@pytest.mark.slow
def test_a_deterministic_async_run_is_bitwise_equal_to_its_rerun(tmp_path, tiny_checkpoint):
    """The mode's cheapest schedule (docs/training.md, Cost): sampling step k+1 from its own copy of
    the weights while step k updates, without partial rollouts. Which weights each rollout samples
    from is set by the schedule, not by timing, so two runs agree to the bit."""
    config = _config(
        tmp_path, tiny_checkpoint, deterministic=True, mode="async", max_staleness=1, partial_rollouts=False
    )
    settings = yaml.safe_load(config.read_text())
    settings["rollout"]["share_model"] = False  # the engine samples from its own copy meanwhile
    settings["algorithm"] = {"old_logprobs": "sampler"}  # the ratio against the stale sampler
    config.write_text(yaml.safe_dump(settings))
    runs = [tmp_path / "run", tmp_path / "rerun"]
    for process in [_start(config, run) for run in runs]:  # side by side: other timings, other batches
        _finish(process)
    assert _differences(*runs) == []


@pytest.mark.slow
def test_a_deterministic_run_in_bf16_is_bitwise_equal_to_its_rerun(tmp_path):
    """Issue 63: the mode holds at whatever type it computes in. A model whose layers the engine packs
    (hidden 512), sampled in bf16 (the batch-invariant engine checks its bf16 products at every row
    count first) and trained under bf16 autocast; two mini-batches recompute the old log-probs, which
    measure the mismatch every step."""
    from agent_r1.models.tiny import save_tiny_checkpoint

    model = save_tiny_checkpoint(tmp_path / "model", hidden_size=512, num_layers=2, intermediate_size=1024)
    config = _config(tmp_path, model, deterministic=True)
    settings = yaml.safe_load(config.read_text())
    settings["rollout"]["compute_dtype"] = "bfloat16"
    settings["model"]["compute_dtype"] = "bfloat16"
    config.write_text(yaml.safe_dump(settings))
    runs = [tmp_path / "run", tmp_path / "rerun"]
    for process in [_start(config, run) for run in runs]:  # side by side: other timings, other batches
        _finish(process)
    assert _differences(*runs) == []
    assert all("mismatch/kl_k3" in row for row in _rows(runs[0]))


# A kill point: (environment for the run, the file that appears once the run is there).
RESETS_PER_STEP = 2 * 3  # tasks_per_step x rollout.n


def _kill_point(where: str, tmp_path: Path, pause_s: float = 120) -> tuple[dict, Path]:
    """Step 3's rollout, update or checkpoint pauses for ``pause_s`` there."""
    marker = tmp_path / f"at-{where}"
    if where == "rollout":  # the 3rd of step 3's resets pauses
        return {"JITTER_PAUSE": f"{2 * RESETS_PER_STEP + 3}:{pause_s}:{marker}"}, marker
    if where == "update":  # after step 3's first of two optimizer steps
        return {"AGENT_R1_UPDATE_DELAY": f"3:{pause_s}:{marker}"}, marker
    assert where == "checkpoint"  # halfway through writing checkpoint 3
    return {
        "AGENT_R1_CHECKPOINT_WRITE_DELAY": "3:120"
    }, tmp_path / "run" / "checkpoints" / ".tmp-step_000003" / "model"


@pytest.mark.slow
@pytest.mark.parametrize("where", ["rollout", "update", "checkpoint"])
def test_sigkill_anywhere_then_resume_is_bitwise_equal_to_the_uninterrupted_run(reference, tmp_path, where):
    config, run = reference
    env, marker = _kill_point(where, tmp_path)
    killed = tmp_path / "run"
    process = _start(config, killed, env=env)
    _wait_for(marker, process)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not (killed / "checkpoints" / "step_000003").exists()
    _finish(_start(config, killed, "--resume"))
    assert _differences(run, killed) == []


@pytest.mark.slow
@pytest.mark.parametrize(
    ("where", "signum", "saved"), [("rollout", signal.SIGTERM, 2), ("update", signal.SIGINT, 3)]
)
def test_a_preemption_signal_checkpoints_exits_4_and_resume_is_bitwise_equal(
    reference, tmp_path, tiny_checkpoint, where, signum, saved
):
    """SIGTERM mid-rollout stops sampling and checkpoints the step before; SIGINT mid-update finishes
    the step (its update pauses 3 s, within the 30 s grace) and checkpoints it. The run checkpoints
    only at its end otherwise (checkpoint_every: 0), so the checkpoint found is the preemption's own."""
    _, run = reference
    config = _config(tmp_path, tiny_checkpoint, deterministic=True, checkpoint_every=0)
    env, marker = _kill_point(where, tmp_path, pause_s=120 if where == "rollout" else 3)
    preempted = tmp_path / "run"
    process = _start(config, preempted, env=env)
    _wait_for(marker, process)
    process.send_signal(signum)
    out = _finish(process, code=4)
    assert f"preempted by {signal.Signals(signum).name}" in out
    assert sorted(p.name for p in (preempted / "checkpoints").iterdir()) == [f"step_{saved:06d}"]
    _finish(_start(config, preempted, "--resume"))
    assert _differences(run, preempted) == []


@pytest.mark.slow
def test_a_grace_too_short_for_the_update_exits_5_and_keeps_the_previous_checkpoint(
    reference, tmp_path, tiny_checkpoint
):
    _, run = reference
    config = _config(tmp_path, tiny_checkpoint, deterministic=True, preemption_grace_s=1.0)
    env, marker = _kill_point("update", tmp_path)
    preempted = tmp_path / "run"
    process = _start(config, preempted, env=env)
    _wait_for(marker, process)
    process.send_signal(signal.SIGTERM)
    out = _finish(process, code=5)
    assert "not written within trainer.preemption_grace_s=1.0 s" in out
    assert sorted(p.name for p in (preempted / "checkpoints").iterdir()) == ["step_000001", "step_000002"]
    _finish(_start(config, preempted, "--resume"))
    assert _differences(run, preempted) == []


def test_a_signal_landing_inside_an_envs_code_stops_the_rollout_not_one_trajectory(tmp_path, tiny_checkpoint):
    """In one process: a signal that lands inside an env's ``step`` stops the rollout and checkpoints
    step 1, instead of becoming one ERROR trajectory (as an ``Exception`` would, caught by
    ``rollout_group``) while sampling goes on, and without waiting for the trajectories of its group
    still running (as ``StopSampling`` raised inside that step did: the run then outlasted its grace)."""
    from trainer_envs import SignalAtStepEnv, tasks

    from agent_r1.train.config import load_config
    from agent_r1.train.preemption import Preempted
    from agent_r1.train.trainer import Trainer

    config = load_config(
        _config(tmp_path, tiny_checkpoint, checkpoint_every=0, preemption_grace_s=600),
        [f"trainer.run_dir={tmp_path / 'run'}", "trainer.tasks_per_step=1"],
    )
    trainer = None

    def env():
        # step 2's 3rd env step: each step takes 1 task x 3 samples x 2 turns; step 2's first reset
        # (the 4th) stalls for a minute meanwhile, in the same group
        return SignalAtStepEnv(trainer.tokenizer, signal.SIGTERM, at=3 * 2 + 3, stall_at=3 + 1, stall_s=60)

    SignalAtStepEnv.steps = SignalAtStepEnv.resets = 0
    SignalAtStepEnv.stalled = None
    trainer = Trainer(config, env_factory=env, train_tasks=tasks(6))
    with pytest.raises(Preempted, match="preempted by SIGTERM: checkpoint .*step_000001 holds step 1"):
        trainer.fit()
    # the stalled trajectory was cancelled, not waited for: a rollout stops at once, whatever code
    # of it the signal lands in (waiting for it could outlast trainer.preemption_grace_s)
    assert SignalAtStepEnv.stalled == "cancelled"
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step_000001"]
    assert [r["step"] for r in _rows(tmp_path / "run")] == [1]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is uninstalled


def test_the_guard_stops_an_event_loop_in_this_thread_whatever_task_the_signal_lands_in():
    """The local backend's sync rollout: the loop is stopped and its tasks cancelled, and a rollout
    that finished in the loop's last iteration is dropped all the same (its step is sampled again)."""
    from agent_r1.train.preemption import PreemptionGuard, StopSampling

    ended = []

    async def sleeper() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            ended.append("cancelled")
            raise

    async def rollout(finish: bool) -> int:
        waiting = asyncio.ensure_future(sleeper())
        await asyncio.sleep(0)
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs here, inside this task
        if finish:
            waiting.cancel()
            return 1
        await waiting
        return 0

    for finish in (False, True):
        with PreemptionGuard(grace_s=60) as guard:
            with pytest.raises(StopSampling), guard.stoppable():
                asyncio.run(rollout(finish))
            assert guard.signum == signal.SIGTERM
    assert ended == ["cancelled", "cancelled"]


_MKL_PROBE = """
import torch
from agent_r1.train import process
if {matmul_first}:
    torch.ones(64, 64) @ torch.ones(64, 64)
try:
    process.deterministic_settings()
except RuntimeError as error:
    print("refused:", error)
print("branch", process._torch_mkl().mkl_serv_cbwr_get(-1), torch.are_deterministic_algorithms_enabled())
"""


@pytest.mark.skipif(
    not __import__("torch").backends.mkl.is_available(), reason="this torch is built without MKL"
)
@pytest.mark.parametrize("matmul_first", [False, True])
def test_deterministic_settings_put_mkl_in_its_reproducible_mode_or_say_it_is_too_late(matmul_first):
    """torch's CPU wheel runs its float32 matmuls in MKL: in a fresh process MKL's branch becomes
    AUTO (2) instead of off (1); after MKL ran, the error asks for MKL_CBWR in the environment."""
    environment = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
    out = subprocess.run(
        [sys.executable, "-c", _MKL_PROBE.format(matmul_first=matmul_first)],
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    if matmul_first:
        assert "refused: trainer.deterministic: MKL already ran" in out and "MKL_CBWR=AUTO" in out
        assert "branch 1 " in out
    else:
        assert "refused" not in out and "branch 2 True" in out


@pytest.mark.slow
def test_sigterm_mid_async_update_saves_the_finished_rollout_in_flight_and_resume_samples_none_twice(
    tiny_checkpoint, tmp_path, monkeypatch
):
    """Async (in one process): SIGTERM during update 2 lets step 2 finish; its checkpoint holds rollout
    3, which ran beside the update, finished. The resumed run trains exactly those samples at step 3
    and samples only rollout 4: every reset of the two processes together is one of rollouts 1-4."""
    import threading

    import torch
    from trainer_envs import tasks

    from agent_r1.train.config import config_from_dict
    from agent_r1.train.preemption import Preempted
    from agent_r1.train.trainer import Trainer

    counter, marker = tmp_path / "resets", tmp_path / "at-update"
    batch = 2 * 2  # tasks_per_step x rollout.n

    def config():
        return config_from_dict(
            {
                "model": {"path": str(tiny_checkpoint)},
                "env": {
                    "name": "trainer_envs:KillOnceEnv",
                    "kwargs": {"counter": str(counter), "kill_at": 0},
                },
                "rollout": {"n": 2, "max_tokens": 6, "max_steps": 2, "share_model": False},
                "algorithm": {"off_policy": "tis"},
                "trainer": {
                    **{"steps": 4, "tasks_per_step": 2, "lr": 3e-3, "mode": "async", "torch_threads": 1},
                    **{"run_dir": str(tmp_path / "run"), "checkpoint_every": 0, "partial_rollouts": False},
                },
                "logging": {"progress": False, "tensorboard": False, "report": False},
            }
        )

    monkeypatch.setenv("AGENT_R1_UPDATE_DELAY", f"2:2:{marker}")

    def signal_at_the_marker():
        while not marker.exists():
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=signal_at_the_marker, daemon=True).start()
    with pytest.raises(Preempted, match="step_000002 holds step 2"):
        Trainer(config(), train_tasks=tasks(6)).fit()
    stored = torch.load(
        tmp_path / "run" / "checkpoints" / "step_000002" / "trainer_state.pt", weights_only=False
    )
    assert stored["in_flight"]["step"] == 3
    saved = [[s.response_ids for s in t.steps] for g in stored["in_flight"]["groups"] for t in g.trajectories]
    assert len(saved) == batch and int(counter.read_text()) == 3 * batch

    monkeypatch.delenv("AGENT_R1_UPDATE_DELAY")
    Trainer(config(), train_tasks=tasks(6), resume=True).fit()
    trained = [
        json.loads(line)
        for line in (tmp_path / "run" / "trajectories" / "step_000003.jsonl").read_text().splitlines()
    ]
    assert [[list(ids) for ids in t] for t in saved] == [
        [s["response_ids"] for s in t["steps"]] for t in trained
    ]
    assert int(counter.read_text()) == 4 * batch
    assert [r["step"] for r in _rows(tmp_path / "run") if "reward/mean" in r] == [1, 2, 3, 4]


def test_the_guard_stops_a_rollout_ignores_a_second_sigterm_and_a_second_sigint_interrupts():
    from agent_r1.train.preemption import PreemptionGuard, StopSampling

    previous = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with PreemptionGuard(grace_s=60) as guard:
        assert not guard.requested
        with pytest.raises(StopSampling), guard.stoppable():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)  # the handler interrupts it
        assert guard.signum == signal.SIGTERM
        os.kill(os.getpid(), signal.SIGTERM)  # logged, nothing else
        time.sleep(0.05)
        with pytest.raises(StopSampling), guard.stoppable():  # a rollout after the signal: not started
            pass
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == previous
