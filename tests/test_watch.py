"""A run that does not learn says why, and keeps its best policy (issue 65): the held-out watch's
arithmetic by hand, its causes from the run's own metrics, and in a real run the best evaluation's
checkpoint as ``checkpoints/best``, taken by ``eval --checkpoint`` and ``train --resume-from``."""

from __future__ import annotations

import json
import logging
import math

import pytest

from agent_r1.train.watch import HeldOutWatch, drop_noise


def test_the_noise_is_two_standard_errors_of_two_success_rates():
    # pooled p = 0.5 over n = 100 each: se = sqrt(2 * 0.25 / 100) = 0.0707; two of them
    assert drop_noise(0.6, 0.4, 100) == pytest.approx(2 * math.sqrt(0.005))
    assert drop_noise(0.0, 0.0, 50) == 0.0 and drop_noise(1.0, 1.0, 50) == 0.0


def _eval(success: float, n: int = 100, reward: float | None = None) -> dict[str, float]:
    return {
        "eval/success": success,
        "eval/reward": success if reward is None else reward,
        "eval/trajectories": n,
    }


def test_best_is_a_strict_improvement_on_every_earlier_evaluation():
    watch = HeldOutWatch()
    assert watch.observe_eval(0, _eval(0.4))[0] is False  # the start is model.path, never "best"
    assert watch.observe_eval(2, _eval(0.5))[0] is True
    assert watch.observe_eval(4, _eval(0.5))[0] is False  # a tie keeps the earlier one
    assert watch.observe_eval(6, _eval(0.5, reward=0.9))[0] is True  # then the reward decides
    best, metrics = watch.observe_eval(8, _eval(0.45))
    assert not best and metrics == {
        "watch/best_success": 0.5,
        "watch/best_step": 6.0,
        "watch/below_start": 0.0,
    }


def test_a_drop_within_the_noise_is_not_reported(caplog):
    watch = HeldOutWatch()
    watch.observe_eval(0, _eval(0.42, n=100))
    with caplog.at_level(logging.WARNING, logger="agent_r1.train.watch"):
        _, metrics = watch.observe_eval(12, _eval(0.367, n=400))  # -5.3 points; noise = 2 * 0.052
    assert metrics["watch/below_start"] == 0.0 and not caplog.records


def _steps(watch: HeldOutWatch, first: int, last: int, **metrics: float) -> None:
    for step in range(first, last + 1):
        watch.observe_step(step, metrics)


def test_the_causes_are_read_from_the_steps_since_the_best_evaluation(caplog):
    watch = HeldOutWatch()
    watch.observe_eval(0, _eval(0.5))
    calm = {"entropy/mean": 1.2, "grad_norm": 0.2, "filter/zero_variance_groups": 2, "filter/groups": 16}
    _steps(watch, 1, 4, **calm, **{"rollout/truncated_fraction": 0.05})
    watch.observe_eval(4, _eval(0.7))  # the best: what came after it is compared with what came before
    _steps(
        watch,
        5,
        8,
        **{"entropy/mean": 0.4, "grad_norm": 0.25, "filter/zero_variance_groups": 14, "filter/groups": 16},
        **{"rollout/truncated_fraction": 0.3},
    )
    watch.observe_step(9, {**calm, "policy/solver/grad_norm": 1.1})  # any policy's counts
    with caplog.at_level(logging.WARNING, logger="agent_r1.train.watch"):
        best, metrics = watch.observe_eval(9, _eval(0.3))
    assert not best and metrics["watch/below_start"] == 1.0
    causes = {k.removeprefix("watch/cause/") for k in metrics if k.startswith("watch/cause/")}
    # since step 4: entropy mean 0.56 < 0.6 (half of the first, 1.2); max grad norm 1.1 > 3 x 0.2;
    # zero-variance 0.725 of the groups against 0.125 before; truncated 0.3 against 0.05; no mismatch
    # metric was logged
    assert causes == {"entropy_collapse", "grad_norm_spikes", "zero_variance_groups", "truncation"}
    (record,) = caplog.records
    assert "held-out success fell below the start: 0.300 at step 9 against 0.500" in record.message
    assert "the best was 0.700 at step 4 (checkpoints/best)" in record.message
    assert "1.1, 5.5x its median 0.2" in record.message
    with caplog.at_level(logging.WARNING, logger="agent_r1.train.watch"):
        watch.observe_eval(10, _eval(0.3))
    assert len(caplog.records) == 1  # said once, while the causes stay the same


def test_steps_without_a_gradient_are_no_baseline():
    """A step whose every group agreed has grad norm 0 (nothing forwarded): a median of zeros would
    make any later gradient a 'spike' (and divide by zero); only steps that updated count."""
    watch = HeldOutWatch()
    watch.observe_eval(0, _eval(0.5))
    _steps(watch, 1, 3, grad_norm=0.0)
    watch.observe_step(4, {"grad_norm": 0.4})
    _, metrics = watch.observe_eval(4, _eval(0.1))
    assert metrics["watch/below_start"] == 1.0 and "watch/cause/grad_norm_spikes" not in metrics
    watch.observe_step(5, {"grad_norm": 0.1})
    watch.observe_eval(5, _eval(0.6))  # the best: steps 1-5 are before it, 0.4 and 0.1 their updates
    watch.observe_step(6, {"grad_norm": 0.9})
    _, metrics = watch.observe_eval(6, _eval(0.1))
    assert metrics["watch/cause/grad_norm_spikes"] == 1.0  # 0.9 > 3 x 0.25, the updates' median


def test_no_moved_signal_is_said_too(caplog):
    watch = HeldOutWatch()
    watch.observe_eval(0, _eval(0.8))
    _steps(watch, 1, 6, **{"entropy/mean": 1.0, "grad_norm": 0.3, "off_policy/kl_k3": 0.001})
    with caplog.at_level(logging.WARNING, logger="agent_r1.train.watch"):
        _, metrics = watch.observe_eval(6, _eval(0.5))
    assert not any(k.startswith("watch/cause/") for k in metrics)
    assert "None of the watched signals moved since step 0" in caplog.records[0].message


def test_updates_that_hurt_the_training_reward_too_are_named(caplog):
    """The verifiers arm's drop (benchmarks/HISTORY.md): one update at lr 1e-3 took the training
    success from 0.53 to 0.03; the rollouts after it stay below the first (before any update)."""
    watch = HeldOutWatch()
    watch.observe_eval(0, _eval(0.609, n=128))
    rewards = (0.531, 0.031, 0.234, 0.359, 0.422, 0.375, 0.438, 0.203, 0.375, 0.469)
    for step, reward in enumerate(rewards, 1):
        watch.observe_step(step, {"reward/mean": reward})
    with caplog.at_level(logging.WARNING, logger="agent_r1.train.watch"):
        _, metrics = watch.observe_eval(10, _eval(0.398, n=128))
    # the first step's rollout (before any update) is the baseline: 0.531; since: mean 0.323 of 9
    assert metrics["watch/cause/training_reward_fell"] == 1.0
    assert "the training reward fell too (0.531 to 0.323, lowest 0.031)" in caplog.records[0].message


def test_the_watch_resumes_as_it_stood():
    watch = HeldOutWatch()
    watch.observe_eval(0, _eval(0.5))
    _steps(watch, 1, 3, **{"entropy/mean": 1.0})
    watch.observe_eval(3, _eval(0.6))
    resumed = HeldOutWatch()
    resumed.load_state_dict(json.loads(json.dumps(watch.state_dict())))  # as a checkpoint round trip
    assert resumed == watch


class LowBytesReward:
    """Test double for a reward function: the fraction of the trajectory's response tokens below 128
    times ``sign``; -4 outweighs the env's own per-step rewards (at most 1 a turn), so that RL then
    unlearns what the held-out tasks reward."""

    def __init__(self, sign: float) -> None:
        self.sign = sign

    def __call__(self, trajectory, task) -> float:
        ids = [t for step in trajectory.steps for t in step.response_ids]
        return self.sign * sum(1 for t in ids if t < 128) / max(len(ids), 1)


def _run_config(path, run_dir, steps: int):
    from agent_r1.train.config import config_from_dict

    return config_from_dict(
        {
            "model": {"path": str(path)},
            "env": {"name": "trainer_envs:LowByteEnv"},
            # one request at a time, nothing stored: each response is computed from its own tokens
            # alone, so an evaluation of the same weights samples the same tokens in another process
            "rollout": {
                "n": 4,
                "max_tokens": 8,
                "max_steps": 2,
                "max_batch_size": 1,
                "engine_kwargs": {"prefix_cache_entries": 0},
            },
            "trainer": {
                "steps": steps,
                "tasks_per_step": 4,
                "lr": 1e-2,
                "run_dir": str(run_dir),
                "eval_every": 2,
                "mini_batches": 1,
                "checkpoint_every": 0,
            },
            "logging": {"progress": False, "tensorboard": False},
        }
    )


def _eval_rows(run_dir) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "eval/success" in r}


@pytest.mark.slow
def test_a_run_keeps_its_best_and_says_why_it_fell(tiny_checkpoint, tmp_path, caplog, capsys):
    """Run A learns the held-out reward (low bytes): its best evaluation's checkpoint is
    ``checkpoints/best``, which ``eval --checkpoint`` scores as the run did and ``--resume-from``
    continues. Run B starts from A's best and is trained against it: held-out success falls below the
    start, and the log says so with causes from the run's own metrics; no ``best`` is written."""
    from trainer_envs import tasks

    from agent_r1.cli import main
    from agent_r1.train.config import dump_config
    from agent_r1.train.trainer import Trainer

    run_a = tmp_path / "a"
    config = _run_config(tiny_checkpoint, run_a, steps=4)
    Trainer(config, train_tasks=tasks(12), val_tasks=tasks(8, offset=100), reward_fn=LowBytesReward(1)).fit()
    evals = _eval_rows(run_a)
    best_step = int(evals[4]["watch/best_step"])
    assert evals[0]["eval/success"] < evals[best_step]["eval/success"] == evals[4]["watch/best_success"]
    best = run_a / "checkpoints" / "best"
    assert json.loads((best / "info.json").read_text())["step"] == best_step
    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps(t) + "\n" for t in tasks(8, offset=100)))
    dump_config(_run_config(tiny_checkpoint, run_a, steps=4), tmp_path / "a.yaml")
    assert main(["eval", str(tmp_path / "a.yaml"), f"data.val={val}", "--checkpoint", str(best)]) == 0
    scored = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert scored["eval/success"] == evals[best_step]["eval/success"]

    run_b = tmp_path / "b"
    unlearn = Trainer(
        _run_config(best / "model", run_b, steps=4),
        train_tasks=tasks(12),
        val_tasks=tasks(8, offset=100),
        reward_fn=LowBytesReward(-4),
    )
    with caplog.at_level(logging.WARNING, logger="agent_r1.train.watch"):
        unlearn.fit()
    start = scored["eval/success"]
    evals = _eval_rows(run_b)
    assert evals[0]["eval/success"] == start > 0.5 and evals[4]["eval/success"] == 0.0
    assert evals[4]["watch/below_start"] == 1.0
    (said,) = [r.message for r in caplog.records if "fell below the start" in r.message]
    assert f"against {start:.3f} at the start" in said and "Likely cause" in said
    assert "training_reward_rose: the training reward rose" in said  # it was paid to unlearn
    assert evals[4]["watch/cause/training_reward_rose"] == 1.0
    assert not (run_b / "checkpoints" / "best").exists()  # nothing beat the start

    # run A goes on from its best: the newer checkpoint is set aside, the metrics after it forgotten
    resumed = Trainer(
        _run_config(tiny_checkpoint, run_a, steps=4),
        train_tasks=tasks(12),
        val_tasks=tasks(8, offset=100),
        reward_fn=LowBytesReward(1),
        resume=best,
    )
    assert resumed._restore() == best_step
    resumed.close()
    if best_step < 4:
        assert (run_a / "checkpoints" / "superseded-step_000004").is_dir()
