"""Where a step's time goes (docs/training.md, "Metrics"): the HF engine's prefill / decode seconds and
the idle rest, the seconds trajectories wait on their env and on the engine, and the learner's
forward, backward and optimizer seconds, from a real tiny model and a real training run."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from trainer_envs import LowByteEnv, tasks
from transformers import AutoModelForCausalLM

from agent_r1.rollout import HFEngine
from agent_r1.train.backends import EngineClock
from agent_r1.train.config import config_from_dict
from agent_r1.train.summary import summarize_rollout
from agent_r1.train.trainer import Trainer
from agent_r1.types import SamplingParams, Step, Trajectory, TrajectoryGroup

ENV_SECONDS = 0.05  # SlowEnv's real wait per step


def test_the_engine_counts_prefill_and_decode_seconds_within_the_wall_time(tiny_checkpoint, tiny_tokenizer):
    engine = HFEngine(AutoModelForCausalLM.from_pretrained(tiny_checkpoint), tokenizer=tiny_tokenizer)
    params = SamplingParams(max_tokens=5, seed=1)

    async def three():
        return await asyncio.gather(*(engine.generate([5, 6, 7 + i], params) for i in range(3)))

    start = time.perf_counter()
    completions = asyncio.run(three())
    engine.wait_for_step()  # the last step hands its completions back before it ends (and is counted)
    wall = time.perf_counter() - start
    engine.close()
    assert all(c.token_ids for c in completions)
    assert engine.prefill_seconds > 0 and engine.decode_seconds > 0
    assert engine.prefill_seconds + engine.decode_seconds <= wall  # counted once, inside the call


class CountingEngine:
    """Test double: an engine's busy-time counters, set by the test."""

    prefill_seconds = 0.0
    decode_seconds = 0.0


def test_the_engine_clock_reports_each_window_and_nothing_for_an_engine_that_does_not_count():
    now = [100.0]
    engine = CountingEngine()
    clock = EngineClock(engine, clock=lambda: now[0])
    now[0], engine.prefill_seconds, engine.decode_seconds = 110.0, 1.0, 3.0
    assert clock.read() == {
        "time/engine_prefill": 1.0,
        "time/engine_decode": 3.0,
        "time/engine_idle": 6.0,
        "throughput/engine_busy_fraction": 0.4,
    }
    now[0], engine.decode_seconds = 112.0, 5.0  # the next window: 2 s, all of it decoding
    assert clock.read() == {
        "time/engine_prefill": 0.0,
        "time/engine_decode": 2.0,
        "time/engine_idle": 0.0,
        "throughput/engine_busy_fraction": 1.0,
    }
    assert EngineClock(object()).read() == {}  # vLLM, a server: absent, not zero


def _step(**timings) -> Step:
    return Step(prompt_ids=(1,), response_ids=(2, 3), logprobs=(-0.1, -0.2), timings=timings)


def test_a_rollout_summary_gives_each_trajectorys_env_and_engine_waits():
    slow = Trajectory("a", (_step(generate=0.5, env_step=2.0), _step(generate=0.25, env_step=3.0)))
    fast = Trajectory("b", (_step(generate=1.0, env_step=0.5),))
    metrics = summarize_rollout([TrajectoryGroup("g", "a", (slow, fast))], 0).metrics
    assert metrics["time/env_wait"] == pytest.approx((5.0 + 0.5) / 2)
    assert metrics["time/env_wait_max"] == 5.0
    assert metrics["time/generate_wait"] == pytest.approx((0.75 + 1.0) / 2)
    # A flow that records no env steps (single-turn, a gateway) leaves them out.
    single = summarize_rollout([TrajectoryGroup("g", "a", (Trajectory("a", (_step(generate=1.0),)),))], 0)
    assert "time/env_wait" not in single.metrics and single.metrics["time/generate_wait"] == 1.0


class SlowEnv(LowByteEnv):
    """LowByteEnv whose every step really waits ``ENV_SECONDS`` (a tool or a judge)."""

    async def step(self, action):
        await asyncio.sleep(ENV_SECONDS)
        return await super().step(action)


def test_a_training_step_accounts_for_engine_env_and_learner_time(tiny_checkpoint, tiny_tokenizer, tmp_path):
    config = config_from_dict(
        {
            "model": {"path": str(tiny_checkpoint)},
            "rollout": {"n": 2, "max_tokens": 6, "max_steps": 2},
            "trainer": {
                "steps": 2,
                "tasks_per_step": 2,
                "mini_batches": 2,
                "run_dir": str(tmp_path),
                "torch_threads": 1,
            },
            "logging": {"progress": False, "tensorboard": False, "report": False},
        }
    )
    Trainer(config, env_factory=lambda: SlowEnv(tiny_tokenizer), train_tasks=tasks(4)).fit()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        learner = row["time/learner_forward"] + row["time/learner_backward"] + row["time/optimizer"]
        assert min(row["time/learner_forward"], row["time/learner_backward"], row["time/optimizer"]) > 0
        assert learner <= row["time/update"]  # two optimizer steps, summed, inside the update phase
        # Sync mode: the engine works only during the rollout and idles through the update.
        assert 0 < row["time/engine_prefill"] + row["time/engine_decode"] <= row["time/rollout"]
        assert row["time/engine_idle"] >= row["time/update"]
        assert 0 < row["throughput/engine_busy_fraction"] < 1
        # Two env steps per trajectory, each a real wait of ENV_SECONDS.
        assert 2 * ENV_SECONDS <= row["time/env_wait"] <= row["time/env_wait_max"] <= row["time/rollout"]
        assert 0 < row["time/generate_wait"] <= row["time/rollout"]
