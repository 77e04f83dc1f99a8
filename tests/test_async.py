"""Asynchronous training in one process: weight swaps between requests (``VersionedEngine``), a
background rollout that takes new weights mid-trajectory, the async trainer's pacing, staleness and
timeline, reproducibility without partial rollouts, and resume after SIGKILL (no sample lost to the
checkpoint, none sampled twice)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from trainer_envs import LowByteEnv, tasks
from transformers import AutoModelForCausalLM

from agent_r1.flows.base import AgentEnvLoop
from agent_r1.models.tiny import save_tiny_checkpoint
from agent_r1.rollout import HFEngine
from agent_r1.rollout.versioned import VersionedEngine
from agent_r1.train.backends import LocalRollout, engine_copy
from agent_r1.train.config import ConfigError, config_from_dict, dump_config
from agent_r1.train.data import TaskSampler
from agent_r1.train.trainer import Trainer
from agent_r1.types import Completion, SamplingParams, StopReason

TESTS = Path(__file__).parent
PARAMS = SamplingParams(max_tokens=4)


class HeldEngine:
    """Test double: every ``generate`` waits until the test releases it (``release(i)``), so the
    order of requests and swaps is fixed by the test, not by timing."""

    def __init__(self) -> None:
        self.started: list[tuple[int, ...]] = []
        self.gates: list[asyncio.Event] = []

    async def generate(self, prompt_ids, params):
        self.started.append(tuple(prompt_ids))
        gate = asyncio.Event()
        self.gates.append(gate)
        await gate.wait()
        return Completion((1,), (-0.5,), StopReason.STOP)


async def _settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


def test_a_swap_waits_for_requests_in_flight_and_holds_new_ones():
    async def scenario():
        engine = HeldEngine()
        versioned = VersionedEngine(engine)
        first = asyncio.create_task(versioned.generate([1], PARAMS))
        await _settle()
        applied: list[int] = []
        swap = asyncio.create_task(versioned.swap(lambda: applied.append(versioned.active), 1))
        await _settle()
        second = asyncio.create_task(versioned.generate([2], PARAMS))
        await _settle()
        # The swap waits for the first request; the second is held, not started on old weights.
        assert applied == [] and engine.started == [(1,)] and not swap.done()
        engine.gates[0].set()
        first_completion = await first
        await swap
        assert applied == [0] and versioned.version == 1 and first_completion.policy_version == 0
        await _settle()
        assert engine.started == [(1,), (2,)]
        engine.gates[1].set()
        assert (await second).policy_version == 1
        assert versioned.held_requests == 1 and versioned.swaps == 1

    asyncio.run(scenario())


def test_a_swap_with_nothing_in_flight_applies_at_once_and_a_second_concurrent_swap_is_refused():
    async def scenario():
        versioned = VersionedEngine(HeldEngine())
        await versioned.swap(lambda: None, 4)
        assert versioned.version == 4
        request = asyncio.create_task(versioned.generate([1], PARAMS))
        await _settle()
        pending = asyncio.create_task(versioned.swap(lambda: None, 5))
        await _settle()
        with pytest.raises(RuntimeError, match="already in progress"):
            await versioned.swap(lambda: None, 6)
        versioned.engine.gates[0].set()
        await request
        await pending
        assert versioned.version == 5

    asyncio.run(scenario())


class GatedEnv(LowByteEnv):
    """``LowByteEnv`` whose first step waits (off the event loop's critical path) until the test
    opens ``gate``; ``arrived`` counts the trajectories waiting there."""

    gate = threading.Event()
    arrived = 0

    async def step(self, action):
        result = await super().step(action)
        if self.turn == 1:
            type(self).arrived += 1
            while not self.gate.is_set():
                await asyncio.sleep(0.01)
        return result


def _logprobs(model, prompt_ids, response_ids) -> torch.Tensor:
    ids = torch.tensor([list(prompt_ids) + list(response_ids)])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    positions = torch.arange(len(prompt_ids) - 1, ids.shape[1] - 1)
    return logits.log_softmax(-1)[positions, ids[0, len(prompt_ids) :]]


def test_a_background_rollout_takes_new_weights_from_each_trajectorys_next_step(
    tiny_checkpoint, tiny_tokenizer, tmp_path
):
    policy = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    other = AutoModelForCausalLM.from_pretrained(save_tiny_checkpoint(tmp_path / "b", seed=1)).eval()
    engine = HFEngine(engine_copy(policy, None), tokenizer=tiny_tokenizer, max_batch_size=8)
    flow = AgentEnvLoop(lambda: GatedEnv(tiny_tokenizer), tiny_tokenizer, SamplingParams(max_tokens=5))
    rollouts = LocalRollout(engine, flow, None, shares_model=False, background=True)
    GatedEnv.gate.clear()
    GatedEnv.arrived = 0
    try:
        job = rollouts.submit(tasks(3), 2, "seed")
        deadline = time.monotonic() + 120
        while GatedEnv.arrived < 6:  # every trajectory has taken its first step (by construction)
            assert time.monotonic() < deadline, "the background rollout did not progress"
            time.sleep(0.01)
        rollouts.update_weights(lambda: list(other.state_dict().items()), 1)
        GatedEnv.gate.set()
        groups = rollouts.collect(job)
    finally:
        rollouts.close()
    trajectories = [t for g in groups for t in g.trajectories]
    assert len(trajectories) == 6
    for trajectory in trajectories:
        first, second = trajectory.steps
        assert (first.policy_version, second.policy_version) == (0, 1)
        # The recorded sampler log-probs are those of the weights that sampled each step.
        for step, model in ((first, policy.eval()), (second, other)):
            recomputed = _logprobs(model, step.prompt_ids, step.response_ids)
            assert (recomputed - torch.tensor(step.logprobs)).abs().max() < 1e-4


def test_closing_a_background_rollout_cancels_the_job_in_flight(tiny_checkpoint, tiny_tokenizer):
    policy = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    engine = HFEngine(engine_copy(policy, None), tokenizer=tiny_tokenizer)
    flow = AgentEnvLoop(lambda: GatedEnv(tiny_tokenizer), tiny_tokenizer, SamplingParams(max_tokens=5))
    rollouts = LocalRollout(engine, flow, None, shares_model=False, owns_engine=False, background=True)
    GatedEnv.gate.clear()  # never opened: the job cannot finish by itself
    GatedEnv.arrived = 0
    job = rollouts.submit(tasks(2), 2, "seed")
    deadline = time.monotonic() + 120
    while GatedEnv.arrived < 4:
        assert time.monotonic() < deadline, "the background rollout did not progress"
        time.sleep(0.01)
    rollouts.close()  # returns: the job is cancelled, not waited for
    assert job.running.cancelled() or isinstance(job.running.exception(), asyncio.CancelledError)
    GatedEnv.gate.set()


def _config(tiny_checkpoint, run_dir, **sections):
    data = {
        "model": {"path": str(tiny_checkpoint)},
        "env": {"name": "trainer_envs:LowByteEnv"},
        "rollout": {"n": 2, "max_tokens": 6, "max_steps": 2, "share_model": False},
        "algorithm": {"off_policy": "tis"},
        "trainer": {
            "steps": 4,
            "tasks_per_step": 2,
            "lr": 3e-3,
            "run_dir": str(run_dir),
            "mode": "async",
            "torch_threads": 1,
        },
        "logging": {"progress": False, "tensorboard": False},
    }
    for section, values in sections.items():
        data[section] = {**data.get(section, {}), **values}
    return config_from_dict(data)


def _rows(run_dir: Path) -> dict[int, dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if "reward/mean" in r}


def _dump(run_dir: Path, step: int) -> list[dict]:
    path = run_dir / "trajectories" / f"step_{step:06d}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_async_in_one_process_overlaps_the_next_rollout_with_the_update_within_the_bound(
    tiny_checkpoint, tmp_path
):
    Trainer(_config(tiny_checkpoint, tmp_path), train_tasks=tasks(8)).fit()
    rows = _rows(tmp_path)
    assert sorted(rows) == [1, 2, 3, 4]
    for step, row in rows.items():
        assert row["update/skipped"] == 0 and row["async/staleness_max"] <= 1
        # Step k's samples come from version k-2 (submitted before update k-1) or, once update k-1
        # lands mid-rollout, k-1; step 1's rollout runs before any update.
        versions = {s["policy_version"] for t in _dump(tmp_path, step) for s in t["steps"]}
        assert versions <= {max(step - 2, 0), step - 1}
    for step in (1, 2, 3):  # rollout k+1 was submitted before update k began: they overlap
        assert rows[step + 1]["timeline/rollout_start"] <= rows[step]["timeline/update_start"]
        assert rows[step]["timeline/update_start"] < rows[step]["timeline/update_end"]


def test_async_without_partial_rollouts_is_reproducible(tiny_checkpoint, tmp_path):
    """Weights change only between rollouts, at steps fixed by the staleness bound, and every request
    is seeded by content: two runs sample the same tokens and compute the same losses."""
    runs = []
    for name in ("a", "b"):
        config = _config(
            tiny_checkpoint, tmp_path / name, trainer={"partial_rollouts": False, "max_staleness": 2}
        )
        Trainer(config, train_tasks=tasks(8)).fit()
        runs.append(tmp_path / name)
    a, b = (_rows(r) for r in runs)
    # max_staleness 2: version 0 samples steps 1-3 and version 2 step 4 (refreshed before it).
    assert [a[s]["async/staleness_max"] for s in (1, 2, 3, 4)] == [0, 1, 2, 1]
    for step in (1, 2, 3, 4):
        responses = [[s["response_ids"] for s in t["steps"]] for t in _dump(runs[0], step)]
        assert responses == [[s["response_ids"] for s in t["steps"]] for t in _dump(runs[1], step)]
        assert a[step]["loss/policy"] == pytest.approx(b[step]["loss/policy"], rel=1e-4, abs=1e-6)


def test_async_refuses_an_engine_that_shares_the_learners_model(tiny_checkpoint, tiny_tokenizer, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    with pytest.raises(ConfigError, match="trainer.mode.*learner's own model object.*copy"):
        Trainer(
            _config(tiny_checkpoint, tmp_path),
            model=model,
            tokenizer=tiny_tokenizer,
            engine=HFEngine(model, tokenizer=tiny_tokenizer),
            train_tasks=tasks(4),
        )


@pytest.mark.slow
def test_sigkill_mid_async_step_then_resume_loses_no_checkpointed_sample_and_samples_none_twice(
    tiny_checkpoint, tmp_path
):
    train_file = tmp_path / "train.jsonl"
    train_file.write_text("".join(json.dumps(t) + "\n" for t in tasks(6)))
    counter = tmp_path / "resets"
    batch = 2 * 2  # tasks_per_step * n
    config = _config(
        tiny_checkpoint,
        tmp_path / "run",
        data={"train": str(train_file)},
        # The preflight (agent-r1 check) resets once per command, on data.train's first row; then
        # reset 1 + 2 * batch + 1 is the first of rollout 3, submitted before update 2 (async): the
        # process dies mid-step 2, after checkpoint 1, which holds rollout 2's finished samples.
        env={
            "name": "trainer_envs:KillOnceEnv",
            "kwargs": {"counter": str(counter), "kill_at": 1 + 2 * batch + 1},
        },
        trainer={"checkpoint_every": 1},
    )
    dump_config(config, tmp_path / "config.yaml")
    env = {**os.environ, "PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    command = [sys.executable, "-m", "agent_r1.cli", "train", str(tmp_path / "config.yaml"), "--quiet"]
    killed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert killed.returncode == -9, killed.stdout + killed.stderr
    run_dir = tmp_path / "run"
    assert sorted(_rows(run_dir)) == [1]
    stored = torch.load(run_dir / "checkpoints" / "step_000001" / "trainer_state.pt", weights_only=False)
    assert stored["in_flight"]["step"] == 2
    saved = [[s.response_ids for s in t.steps] for g in stored["in_flight"]["groups"] for t in g.trajectories]

    resumed = subprocess.run([*command, "--resume"], env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    rows = _rows(run_dir)
    assert sorted(rows) == [1, 2, 3, 4]
    # Step 2 trains exactly the samples saved with checkpoint 1 ...
    assert [[list(ids) for ids in t] for t in saved] == [
        [s["response_ids"] for s in t["steps"]] for t in _dump(run_dir, 2)
    ]
    # ... and nothing was sampled again: 2 rollouts before the kill, the killing reset, then only
    # rollouts 3 and 4 (batch resets each); and each command's preflight reset.
    assert int(counter.read_text()) == 1 + 2 * batch + 1 + 1 + 2 * batch
    sampler = TaskSampler(tasks(6), 2, seed=0, shuffle=True)
    for step in (1, 2, 3, 4):  # every step trains its own tasks, each rollout.n times
        expected = sorted(t["id"] for t in sampler.batch(step) for _ in range(2))
        assert sorted(t["task_id"] for t in _dump(run_dir, step)) == expected
