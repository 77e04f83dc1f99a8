"""The verifiers env: a verifiers v1 taskset's harness, its model calls through the gateway, its reward
functions as the outcome reward. The taskset is ``examples/verifiers/parity`` (verifiers' own
format); verifiers itself runs in ``.venv-verifiers`` (``scripts/install_verifiers.sh``): the tests
that need it are marked ``verifiers`` and skip without it, like the vllm tier."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from doubles import ScriptedEngine

from agent_r1.envs import check_env, make_env
from agent_r1.envs.ecosystem import MissingPackageError
from agent_r1.envs.ecosystem.verifiers import (
    UnknownTasksetError,
    VerifiersEnv,
    find_venv,
    load_tasks,
)
from agent_r1.flows.base import AgentEnvLoop
from agent_r1.train.builders import env_factory
from agent_r1.train.config import ConfigError, config_from_dict
from agent_r1.train.trainer import Trainer
from agent_r1.types import SamplingParams, TrajectoryStatus, read_jsonl

ROOT = Path(__file__).resolve().parents[1]
TASKSETS = str(ROOT / "examples" / "verifiers")
ROW = {"idx": 0, "id": "parity-381", "prompt": "is 381 even?", "answer": "no"}
BASH_CALL = '<tool_call>{"name": "bash", "arguments": {"command": "echo $((381 % 2))"}}</tool_call>'


def _has_venv() -> bool:
    try:
        find_venv()
    except MissingPackageError:
        return False
    return True


def needs_venv(test):
    """The verifiers tier: marked ``verifiers``, skipped only when the verifiers venv is absent."""
    skip = pytest.mark.skipif(
        not _has_venv(), reason="no .venv-verifiers (bash scripts/install_verifiers.sh)"
    )
    return pytest.mark.verifiers(skip(test))


def env(tokenizer, **kwargs) -> VerifiersEnv:
    return VerifiersEnv(tokenizer, "parity", python_path=[TASKSETS], timeout_s=120, **kwargs)


def play(tokenizer, script, task=ROW, *, max_steps: int = 4, **kwargs):
    loop = AgentEnvLoop(
        lambda: env(tokenizer, **kwargs), tokenizer, SamplingParams(max_tokens=128), max_steps=max_steps
    )
    return asyncio.run(loop.run(ScriptedEngine(tokenizer, script), task))


# ---------------------------------------------------------------------------------------------------
# Without the verifiers venv
# ---------------------------------------------------------------------------------------------------


def test_a_missing_venv_is_one_error_naming_the_install_script(tiny_tokenizer, tmp_path, monkeypatch):
    with pytest.raises(MissingPackageError, match=r"bash scripts/install_verifiers\.sh") as raised:
        env(tiny_tokenizer, venv=tmp_path / "nowhere")
    assert str(tmp_path / "nowhere") in str(raised.value)
    monkeypatch.setenv("AGENT_R1_VERIFIERS_VENV", str(tmp_path / "elsewhere"))
    with pytest.raises(MissingPackageError, match="elsewhere.*install_verifiers"):
        find_venv()
    # From a config: the trainer's one error names env.kwargs and still the script.
    config = config_from_dict(
        {"env": {"name": "verifiers", "kwargs": {"taskset": "parity"}}, "model": {"path": "unused"}}
    )
    with pytest.raises(ConfigError, match="env.kwargs.*install_verifiers"):
        env_factory(config, tiny_tokenizer)()


def test_a_venv_without_verifiers_names_the_install_script(tiny_tokenizer, tmp_path, monkeypatch):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").symlink_to(sys.executable)  # agent-r1's python: no verifiers there
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the worker's log folder goes
    with pytest.raises(MissingPackageError, match=r"no usable verifiers.*install_verifiers\.sh"):
        env(tiny_tokenizer, venv=tmp_path)
    assert not list(tmp_path.glob("agent-r1-verifiers-*"))  # the failed start leaves no log folder behind


def test_options_the_adapter_owns_are_refused_before_anything_starts(tiny_tokenizer, tmp_path):
    nowhere = tmp_path / "nowhere"  # the config is checked before the venv is looked for
    with pytest.raises(ValueError, match="set the harness with env.kwargs.harness"):
        env(tiny_tokenizer, agent={"harness": {"id": "bash"}}, venv=nowhere)
    with pytest.raises(ValueError, match="harness_config needs a harness id"):
        env(tiny_tokenizer, harness=None, harness_config={"edit": False}, venv=nowhere)
    with pytest.raises(ValueError, match="taskset must be a verifiers taskset id"):
        VerifiersEnv(tiny_tokenizer, "", venv=nowhere)


def test_registered_by_name(tiny_tokenizer, tmp_path):
    with pytest.raises(MissingPackageError):  # the registry reaches the adapter, which looks for its venv
        make_env("verifiers", tokenizer=tiny_tokenizer, taskset="parity", venv=tmp_path)


# ---------------------------------------------------------------------------------------------------
# With the verifiers venv: the real package's env, scripted policies
# ---------------------------------------------------------------------------------------------------


@needs_venv
def test_null_harness_one_exact_step_scored_by_the_tasksets_reward(tiny_tokenizer):
    right = play(tiny_tokenizer, ["no"])
    assert right.status is TrajectoryStatus.OK, right.error
    (step,) = right.steps
    assert right.outcome_reward == 1.0 and right.info["success"] is True and step.terminated
    # The prompt is the chat template of the harness's messages, rendered by the gateway.
    expected = tiny_tokenizer.apply_chat_template(
        [{"role": "user", "content": "is 381 even?"}], add_generation_prompt=True, tokenize=True
    )
    assert list(step.prompt_ids) == list(getattr(expected, "input_ids", expected))
    assert step.info["gateway"]["prompt"] == "fresh"
    assert step.info["verifiers"] == {
        "rewards": {"correct": 1.0},
        "metrics": {"yes_no": 1.0},
        "turns": 1,
        "stop": "agent_completed",
    }
    # one call: exact by definition, reported whenever there is a call to judge (docs/gateway.md)
    assert step.metrics == {"reward_correct": 1.0, "yes_no": 1.0, "turns": 1.0, "gateway/exact_fraction": 1.0}
    wrong = play(tiny_tokenizer, ["yes"])
    assert wrong.outcome_reward == 0.0 and wrong.info["success"] is False
    assert wrong.steps[-1].metrics == {
        "reward_correct": 0.0,
        "yes_no": 1.0,
        "turns": 1.0,
        "gateway/exact_fraction": 1.0,
    }
    unsure = play(tiny_tokenizer, ["maybe"])
    assert unsure.steps[-1].metrics == {
        "reward_correct": 0.0,
        "yes_no": 0.0,
        "turns": 1.0,
        "gateway/exact_fraction": 1.0,
    }


@needs_venv
def test_check_env_passes(tiny_tokenizer):
    check_env(lambda: env(tiny_tokenizer), ROW, actions=["no"], tokenizer=tiny_tokenizer)


@needs_venv
def test_bash_harness_tool_call_then_answer_extends_the_prompt_exactly(tiny_tokenizer):
    trajectory = play(tiny_tokenizer, [BASH_CALL, "no"], harness="bash")
    assert trajectory.status is TrajectoryStatus.OK, trajectory.error
    first, second = trajectory.steps
    assert first.info["gateway"]["tool_calls"] == 1 and second.info["gateway"]["prompt"] == "extends"
    assert second.info["exact_fraction"] == 1.0 and trajectory.outcome_reward == 1.0
    head = (*first.prompt_ids, *first.response_ids)
    assert second.prompt_ids[: len(head)] == head
    delta = tiny_tokenizer.decode(list(second.prompt_ids[len(head) :]))
    # The bash tool really ran (in verifiers' subprocess runtime) and its output came back.
    assert (
        delta
        == "\n<|im_start|>user\n<tool_response>\n1\n\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert '"name": "bash"' in tiny_tokenizer.decode(list(first.prompt_ids))  # the harness's tools
    assert second.metrics["turns"] == 2.0


@needs_venv
def test_the_harness_does_not_see_the_gateway_keys(tiny_tokenizer):
    look = (
        '<tool_call>{"name": "bash", "arguments": {"command": "env | grep -c AGENT_R1_GATEWAY"}}</tool_call>'
    )
    trajectory = play(tiny_tokenizer, [look, "no"], harness="bash")
    first, second = trajectory.steps
    delta = tiny_tokenizer.decode(list(second.prompt_ids[len(first.prompt_ids) + len(first.response_ids) :]))
    assert "<tool_response>\n0\n" in delta  # the subprocess runtime drops *API_KEY* variables


@needs_venv
def test_max_steps_truncates_and_the_worker_goes_on(tiny_tokenizer):
    looping = play(tiny_tokenizer, lambda prompt: BASH_CALL, harness="bash", max_steps=2)
    assert looping.status is TrajectoryStatus.OK and len(looping.steps) == 2
    assert looping.steps[-1].truncated and looping.info["truncated"] == "max_steps=2 reached"
    after = play(tiny_tokenizer, [BASH_CALL, "no"], harness="bash")
    assert after.status is TrajectoryStatus.OK and after.outcome_reward == 1.0


@needs_venv
def test_unknown_taskset_lists_the_available_ones(tiny_tokenizer):
    with pytest.raises(UnknownTasksetError, match="unknown verifiers taskset 'no_such_taskset'") as raised:
        VerifiersEnv(tiny_tokenizer, "no_such_taskset", python_path=[TASKSETS])
    assert "'parity'" in str(raised.value) and "'textarena'" in str(raised.value)  # ours and built-in


@needs_venv
def test_bad_verifiers_config_is_one_error_naming_it(tiny_tokenizer):
    with pytest.raises(ValueError, match="verifiers rejected the env config.*splitt"):
        env(tiny_tokenizer, taskset_config={"splitt": "test"})
    with pytest.raises(ValueError, match="harness 'no_such_harness' not found.*null"):
        env(tiny_tokenizer, harness="no_such_harness")


@needs_venv
def test_a_failed_verifiers_episode_is_an_error_trajectory(tiny_tokenizer):
    no_answer = {"id": "broken", "prompt": "is 381 even?"}  # parity's rows need an answer
    trajectory = play(tiny_tokenizer, ["no"], task=no_answer)
    assert trajectory.status is TrajectoryStatus.ERROR and not trajectory.steps
    assert "the verifiers episode failed" in trajectory.error and "answer" in trajectory.error


def _kill(pid: int):
    def script(prompt: str) -> str:
        os.kill(pid, signal.SIGKILL)
        return "no"

    return script


@needs_venv
def test_a_dying_worker_is_an_error_trajectory_and_is_restarted(tiny_tokenizer):
    worker = env(tiny_tokenizer, recycle_after=61).worker  # a worker of its own
    died = play(tiny_tokenizer, _kill(worker.process.pid), recycle_after=61)
    assert died.status is TrajectoryStatus.ERROR
    assert f"verifiers worker (pid {worker.process.pid})" in died.error and "exited with -9" in died.error
    again = play(tiny_tokenizer, ["no"], recycle_after=61)
    assert again.status is TrajectoryStatus.OK and again.outcome_reward == 1.0
    assert env(tiny_tokenizer, recycle_after=61).worker.process.pid != worker.process.pid


@needs_venv
def test_a_worker_stopped_cleanly_leaves_no_log_folder(tiny_tokenizer):
    """What the exit hook does to each worker: stop it, then drop its log's folder, which holds nothing
    to read after a clean exit (a dead worker's log stays: the warning that restarts it names it)."""
    worker = env(tiny_tokenizer, recycle_after=63).worker  # a worker of its own
    folder = worker.log_path.parent
    assert folder.is_dir()
    worker.stop()
    worker.discard_log()
    assert worker.process.returncode == 0 and not folder.exists()


@needs_venv
def test_a_hung_worker_is_an_error_trajectory_after_timeout_s(tiny_tokenizer):
    worker = env(tiny_tokenizer, recycle_after=62).worker
    os.kill(worker.process.pid, signal.SIGSTOP)
    try:
        loop = AgentEnvLoop(
            lambda: VerifiersEnv(
                tiny_tokenizer, "parity", python_path=[TASKSETS], recycle_after=62, timeout_s=1.0
            ),
            tiny_tokenizer,
            SamplingParams(max_tokens=8),
        )
        hung = asyncio.run(loop.run(ScriptedEngine(tiny_tokenizer, ["no"]), ROW))
    finally:
        os.kill(worker.process.pid, signal.SIGKILL)
        worker.process.wait()
    assert hung.status is TrajectoryStatus.ERROR and "timeout_s=1.0" in hung.error


@needs_venv
def test_rows_listing_and_export(tmp_path):
    train = load_tasks("parity", python_path=[TASKSETS])
    test = load_tasks("parity", python_path=[TASKSETS], overrides={"split": "test"})
    assert (len(train), len(test)) == (800, 200)
    assert train[0] == {
        "idx": 0,
        "id": train[0]["id"],
        "prompt": train[0]["prompt"],
        "answer": train[0]["answer"],
    }
    assert not {r["id"] for r in train} & {r["id"] for r in test}  # held out
    numbers = [int(r["prompt"].split()[1]) for r in train + test]
    assert sorted(numbers) == list(range(1000))
    assert all(
        r["answer"] == ("yes" if n % 2 == 0 else "no") for r, n in zip(train + test, numbers, strict=True)
    )
    assert load_tasks("parity", python_path=[TASKSETS], skip=3, limit=2) == train[3:5]
    out = tmp_path / "val.jsonl"
    subprocess.run(
        [sys.executable, "-m", "agent_r1.envs.ecosystem.verifiers", "export", "parity", str(out),
         "--python-path", TASKSETS, "--taskset-config", '{"split": "test"}'],
        check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
    )  # fmt: skip
    assert [json.loads(line) for line in out.read_text().splitlines()] == test


# ---------------------------------------------------------------------------------------------------
# End to end: the real Trainer on the verifiers taskset
# ---------------------------------------------------------------------------------------------------


@needs_venv
def test_training_a_verifiers_taskset_end_to_end(tiny_checkpoint, tmp_path):
    """A few real Trainer steps; a reward plugged by verifiers' own config (the ASCII share of the
    reply, tests/verifiers_rewards.py) is added to the taskset's ``correct``, so the random tiny model
    sees reward variance."""
    plugged = {"ascii": {"fn": f"{ROOT / 'tests' / 'verifiers_rewards.py'}:ascii_share", "weight": 1.0}}
    kwargs = {
        "taskset": "parity",
        "taskset_config": {"task": {"rewards": plugged}},
        "python_path": [TASKSETS],
        "timeout_s": 120,
    }
    tasks = load_tasks(**kwargs, limit=4)
    config = config_from_dict(
        {
            "model": {"path": str(tiny_checkpoint)},
            "env": {"name": "verifiers", "kwargs": kwargs},
            "rollout": {"n": 4, "max_tokens": 4, "max_steps": 2},
            "trainer": {
                "steps": 2,
                "tasks_per_step": 2,
                "lr": 3e-3,
                "run_dir": str(tmp_path),
                "eval_every": 0,
            },
            "logging": {"progress": False},
        }
    )
    trainer = Trainer(config, train_tasks=tasks)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.fit()
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    trajectories = list(read_jsonl(tmp_path / "trajectories" / "step_000002.jsonl"))
    assert len(trajectories) == 8 and all(t.status is TrajectoryStatus.OK for t in trajectories)
    for trajectory in trajectories:
        (step,) = trajectory.steps  # the null harness: one model call
        assert step.info["gateway"]["prompt"] == "fresh" and 1 <= len(step.response_ids) <= 4
        rewards = step.info["verifiers"]["rewards"]
        assert set(rewards) == {"correct", "ascii"}
        assert trajectory.outcome_reward == pytest.approx(rewards["correct"] + rewards["ascii"])
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if "reward/mean" in r]
    assert len(logged) == 2
    assert all(
        {"env/reward_correct", "env/reward_ascii", "env/yes_no", "env/turns"} <= set(r) for r in logged
    )
    assert all(r["env/turns"] == 1.0 for r in logged)


@needs_venv
@pytest.mark.slow
def test_benchmark_arm_quick():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import eco_verifiers
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    result = eco_verifiers.run(seed=0, quick=True)
    assert {"env", "metric", "before", "after", "tasks", "rl_steps", "seconds"} <= set(result)
    assert result["tasks"] == 4 and result["rl_steps"] == 1 and result["warm_start"]["demos"] == 16
    assert 0.0 <= result["before"] <= 1.0 and 0.0 <= result["after"] <= 1.0
    assert {"env/reward_correct", "env/yes_no", "env/turns"} <= set(result["env_metrics"])
