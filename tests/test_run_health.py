"""Run health: ERROR trajectories reach the console, and a run whose trajectories fail stops loudly.

The error budget (``trainer.max_error_fraction``, ``agent_r1.train.health``) on hand-built rollouts,
then on the real trainer with the tiny model: an env built from bad ``env.kwargs``, an env whose
``reset`` always raises (single process and Ray), a budget that tolerates some errors, evaluation,
and the CLI's exit code.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
from trainer_envs import tasks

from agent_r1.cli import main
from agent_r1.flows.base import short_traceback
from agent_r1.train.config import ConfigError, config_from_dict, dump_config
from agent_r1.train.evaluation import evaluate
from agent_r1.train.health import TrainingHalted, error_kinds, error_summary, rollout_health
from agent_r1.train.summary import summarize_rollout
from agent_r1.train.trainer import Trainer
from agent_r1.types import Step, Trajectory, TrajectoryGroup, TrajectoryStatus

TESTS = str(Path(__file__).parent)


def _config(tiny_checkpoint, run_dir, **sections):
    data = {
        "model": {"path": str(tiny_checkpoint)},
        "env": {"name": "health_envs:FailingResetEnv"},
        "rollout": {"n": 2, "max_tokens": 4, "max_steps": 2},
        "trainer": {"steps": 2, "tasks_per_step": 2, "run_dir": str(run_dir), "torch_threads": 1},
        "logging": {"progress": False, "tensorboard": False, "report": False},
    }
    for section, values in sections.items():
        data[section] = {**data.get(section, {}), **values}
    return config_from_dict(data)


def _raised(error: Exception) -> str:
    """The error text a flow stores for ``error``, raised for real (so it has a traceback)."""
    try:
        raise error
    except Exception as caught:
        return short_traceback(caught)


def _rows(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "agent_r1.train.health"]


# ---------------------------------------------------------------------------- the budget, by hand


def _cause() -> None:
    raise ValueError("bad corpus path")


def test_error_summary_is_the_exception_line_and_the_root_frame():
    summary, where = error_summary(_raised(TypeError("f() got an unexpected keyword argument 'x'")))
    assert summary == "TypeError: f() got an unexpected keyword argument 'x'"
    assert where is not None and where.endswith(" in _raised") and "test_run_health.py:" in where
    try:
        try:
            _cause()
        except ValueError as cause:
            raise ConfigError("env.kwargs", f"building env raised ValueError: {cause}") from cause
    except ConfigError as wrapper:
        chained = short_traceback(wrapper)
    summary, where = error_summary(chained)
    assert summary == "ConfigError: config key 'env.kwargs': building env raised ValueError: bad corpus path"
    assert where is not None and where.endswith(" in _cause")  # the root cause, not the re-raise
    assert error_summary("the engine aborted the request") == ("the engine aborted the request", None)


def _group(group_id: str, *errors: str | None) -> TrajectoryGroup:
    step = Step(prompt_ids=(1,), response_ids=(2,), logprobs=(-1.0,))
    return TrajectoryGroup(
        group_id,
        group_id,
        tuple(
            Trajectory(group_id, (step,))
            if error is None
            else Trajectory(group_id, (), status=TrajectoryStatus.ERROR, error=error)
            for error in errors
        ),
    )


def test_each_error_kind_is_logged_once_with_its_first_trajectory_and_the_budget_decides(caplog):
    type_error = _raised(TypeError("unexpected keyword argument 'nonsense'"))
    groups = [
        _group("0:a", None, type_error),
        _group("1:b", _raised(RuntimeError("reset is broken for task b")), type_error),
    ]
    caplog.set_level(logging.WARNING)
    assert rollout_health(groups, 0.75, "step 4") is None  # 3 of 4 is not more than 0.75
    lines = _warnings(caplog)
    assert len(lines) == 2
    assert lines[0].startswith("step 4: 2 of 4 trajectories ended in ERROR with TypeError: unexpected")
    assert "(first: group 0:a, sample 1, at " in lines[0]
    assert lines[1].startswith(
        "step 4: 1 of 4 trajectories ended in ERROR with RuntimeError: reset is broken"
    )
    assert "(first: group 1:b, sample 0, at " in lines[1]

    caplog.clear()
    halt = rollout_health(groups, 0.5, "step 4", see="RUN/trajectories/step_000004.jsonl")
    assert isinstance(halt, TrainingHalted)
    # the halt's message names the first kind: only the other kind is logged, each error said once
    (line,) = _warnings(caplog)
    assert line.startswith("step 4: 1 of 4 trajectories ended in ERROR with RuntimeError")
    message = str(halt)
    assert message.startswith(
        "step 4: 3 of 4 trajectories ended in ERROR, more than trainer.max_error_fraction=0.5 allows. "
        "First error (group 0:a, sample 1): TypeError: unexpected keyword argument 'nonsense'"
    )
    assert message.endswith("Full tracebacks: RUN/trajectories/step_000004.jsonl")
    assert halt.first_error == "TypeError: unexpected keyword argument 'nonsense'"

    all_failed = [_group("0:a", type_error, type_error)]
    assert "every trajectory (2 of 2) ended in ERROR" in str(rollout_health(all_failed, 1.0, "step 1"))
    assert rollout_health([_group("0:a", None, None)], 0.0, "step 1") is None
    assert isinstance(rollout_health(groups[:1], 0.0, "step 1"), TrainingHalted)  # 0: the first error stops


def test_the_budget_is_validated_with_its_key(tiny_checkpoint, tmp_path):
    with pytest.raises(ConfigError, match=r"'trainer.max_error_fraction': must be in \[0, 1\], got 1.5"):
        _config(tiny_checkpoint, tmp_path, trainer={"max_error_fraction": 1.5})


# ---------------------------------------------------------------------------- the real trainer


def test_an_env_built_from_bad_kwargs_stops_the_run_naming_env_kwargs(tiny_checkpoint, tmp_path, caplog):
    config = _config(
        tiny_checkpoint, tmp_path, env={"name": "trainer_envs:LowByteEnv", "kwargs": {"nonsense": 1}}
    )
    caplog.set_level(logging.WARNING)
    with pytest.raises(TrainingHalted) as halted:
        Trainer(config, train_tasks=tasks(4)).fit()
    message = str(halted.value)
    assert message.startswith("step 1: every trajectory (4 of 4) ended in ERROR. First error (group ")
    assert (
        "ConfigError: config key 'env.kwargs': building env 'trainer_envs:LowByteEnv' with env.kwargs "
        "['nonsense'] raised TypeError: LowByteEnv.__init__() got an unexpected keyword argument "
        "'nonsense'" in message
    )
    dump = tmp_path / "trajectories" / "step_000001.jsonl"
    assert message.endswith(f"Full tracebacks: {dump}")
    records = [json.loads(line) for line in dump.read_text().splitlines()]
    assert len(records) == 4 and all(r["status"] == "error" for r in records)
    assert "TypeError" in records[0]["error"]  # the original exception's traceback is kept, chained
    assert _warnings(caplog) == []  # one kind, said once: in the halt's message, not logged as well
    assert not (tmp_path / "metrics.jsonl").exists()  # the failed step logged no metrics


def test_an_env_whose_reset_always_raises_stops_the_run(tiny_checkpoint, tmp_path, caplog):
    trainer = Trainer(_config(tiny_checkpoint, tmp_path), train_tasks=tasks(4))
    caplog.set_level(logging.WARNING)
    with pytest.raises(
        TrainingHalted, match=r"^step 1: every trajectory \(4 of 4\) ended in ERROR"
    ) as halted:
        trainer.fit()
    assert "RuntimeError: reset is broken for task t" in str(halted.value)
    assert "health_envs.py:" in str(halted.value) and " in reset)" in str(halted.value)
    assert _warnings(caplog) == []  # said once, by the halt's message


def test_rollout_metrics_leave_out_means_over_no_trajectories(tiny_checkpoint, tmp_path):
    trainer = Trainer(_config(tiny_checkpoint, tmp_path), train_tasks=tasks(4))
    try:
        groups = trainer.rollout(tasks(2), step=1)
        summary = summarize_rollout(groups, trainer.policy_version)
    finally:
        trainer.close()
    metrics = summary.metrics
    # the same walk counted the errors the error budget reads, kind by kind
    assert summary.trajectories == sum(len(g.trajectories) for g in groups)
    assert (
        summary.error_kinds == error_kinds(groups) and sum(k.count for k in summary.error_kinds.values()) == 4
    )
    assert metrics["rollout/error_fraction"] == 1.0
    assert "reward/mean" not in metrics and "success/mean" not in metrics
    assert not any(math.isnan(v) for v in metrics.values())


def test_a_budget_that_tolerates_the_errors_trains_on_and_reports_them(tiny_checkpoint, tmp_path, caplog):
    # Every step samples both tasks (tasks_per_step = 2 of 2), and t1's reset raises: 2 of 4 errors.
    failing = {"kwargs": {"failing": ["t1"]}}
    caplog.set_level(logging.WARNING)
    for budget in (1.0, 0.5):
        run_dir = tmp_path / f"budget{budget}"
        config = _config(tiny_checkpoint, run_dir, env=failing, trainer={"max_error_fraction": budget})
        Trainer(config, train_tasks=tasks(2)).fit()
        rows = _rows(run_dir)
        assert [r["step"] for r in rows] == [1, 2]
        assert all(r["rollout/error_fraction"] == 0.5 and math.isfinite(r["reward/mean"]) for r in rows)
        assert all(r["update/skipped"] == 0 for r in rows)  # the healthy task's group trained
    lines = _warnings(caplog)
    assert len(lines) == 4 and [line.split(":")[0] for line in lines] == ["step 1", "step 2"] * 2
    assert all(
        "2 of 4 trajectories ended in ERROR with RuntimeError: reset is broken for task t1" in line
        for line in lines
    )

    config = _config(tiny_checkpoint, tmp_path / "strict", env=failing, trainer={"max_error_fraction": 0.25})
    with pytest.raises(
        TrainingHalted,
        match=r"2 of 4 trajectories ended in ERROR, more than trainer\.max_error_fraction=0\.25",
    ):
        Trainer(config, train_tasks=tasks(2)).fit()


def test_evaluation_whose_trajectories_all_fail_stops(tiny_checkpoint, tmp_path):
    config = _config(tiny_checkpoint, tmp_path)
    with pytest.raises(
        TrainingHalted, match=r"^evaluation at step 0: every trajectory \(2 of 2\) ended in ERROR"
    ):
        evaluate(config, val_tasks=tasks(2))
    half = _config(tiny_checkpoint, tmp_path, env={"kwargs": {"failing": ["t1"]}})
    metrics = evaluate(half, val_tasks=tasks(2))
    assert metrics["eval/error_fraction"] == 0.5 and math.isfinite(metrics["eval/reward"])


def test_the_cli_prints_the_reason_and_exits_non_zero(tiny_checkpoint, tmp_path, capsys):
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(t) + "\n" for t in tasks(4)))
    config_file = tmp_path / "config.yaml"
    config = _config(tiny_checkpoint, tmp_path / "run", env={"name": "trainer_envs:LowByteEnv"})
    dump_config(config, config_file)
    # An env that cannot be built is a configuration error, found before the model loads (issue 52).
    for command, data in (("train", "data.train"), ("eval", "data.val")):
        code = main([command, str(config_file), f"{data}={train}", "env.kwargs.nonsense=1"])
        out = capsys.readouterr().out
        assert code == 2
        assert out.count(f"agent-r1 {command}: config key 'env.kwargs': building env") == 1, out
        assert "TypeError" in out and "Traceback" not in out
    # An env that starts on the first row and fails on others stops the run within its error budget.
    failing = ["env.name=health_envs:FailingResetEnv", "env.kwargs.failing=[t1, t2, t3]"]
    budget = "trainer.max_error_fraction=0"
    code = main(["train", str(config_file), f"data.train={train}", *failing, budget])
    assert code == 3
    assert capsys.readouterr().out.startswith("agent-r1 train: stopped: step 1: ")
    code = main(["eval", str(config_file), f"data.val={train}", *failing, budget])
    assert code == 3
    assert capsys.readouterr().out.startswith("agent-r1 eval: stopped: evaluation at step 0: ")


@pytest.mark.ray
def test_an_env_whose_reset_always_raises_stops_a_ray_run(tiny_checkpoint, tmp_path, tmp_path_factory):
    import ray

    from agent_r1.distributed import actor_runtime_env

    ray.init(
        num_cpus=2,
        include_dashboard=False,
        _temp_dir=str(tmp_path_factory.mktemp("r")),  # short: Ray's socket paths have a length limit
        runtime_env=actor_runtime_env([TESTS]),
    )
    try:
        config = _config(
            tiny_checkpoint,
            tmp_path / "run",
            distributed={"backend": "ray", "num_rollout_actors": 1, "num_learner_workers": 1},
        )
        with pytest.raises(
            TrainingHalted, match=r"^step 1: every trajectory \(4 of 4\) ended in ERROR"
        ) as halted:
            Trainer(config, train_tasks=tasks(4)).fit()
        assert "RuntimeError: reset is broken for task t" in str(halted.value)
        assert (tmp_path / "run" / "trajectories" / "step_000001.jsonl").is_file()
    finally:
        ray.shutdown()
