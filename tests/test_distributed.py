"""Scale-out on Ray: a local cluster with rollout actors and gloo learner workers trains the tiny model.

- synchronous Ray training reproduces the single-process trainer (same trajectories, losses and
  gradients; weights within what AdamW makes of the gradients' rounding, see ``update_parity``),
  with DDP learner workers (the default) and, for a critic estimator, with FSDP2 workers, whose
  checkpoint (policy and critic) resumes to the uninterrupted run's next step;
- a rollout actor killed mid-rollout is restarted and exactly its unfinished samples are re-queued;
- async mode overlaps rollout and update with the staleness bound and records policy versions;
- a learner worker that dies mid-update is recovered in-process: the group is rebuilt from the last
  checkpoint, the optimizer steps since are replayed and the failed update retried, so the run ends
  as the uninterrupted one; with ``distributed.max_learner_restarts: 0`` the death stops the run
  cleanly and ``agent-r1 train --resume`` continues it exactly.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import ray
import torch
from safetensors.torch import load_file
from trainer_envs import ReinforceObjective, tasks
from update_parity import (
    adam_difference_bound,
    assert_gradients_match,
    load_optimizer_steps,
    record_optimizer_steps,
    record_worker_optimizer_steps,
)

from agent_r1.cli import main
from agent_r1.distributed import LearnerFailure, RolloutPool
from agent_r1.distributed.rollout_actor import SampleKey
from agent_r1.train.config import config_from_dict, dump_config
from agent_r1.train.trainer import Trainer

pytestmark = pytest.mark.ray


def _config(tiny_checkpoint, run_dir, *, backend="ray", **sections):
    data = {
        "model": {"path": str(tiny_checkpoint)},
        "env": {"name": "trainer_envs:LowByteEnv"},
        "rollout": {"n": 4, "max_tokens": 8, "max_steps": 2},
        "trainer": {
            "steps": 3,
            "tasks_per_step": 4,
            "lr": 3e-3,
            "run_dir": str(run_dir),
            "mini_batches": 2,
            "micro_batch_tokens": 64,
            "checkpoint_every": 1,
            "torch_threads": 1,
        },
        "logging": {"progress": False, "tensorboard": False},
        "distributed": {"backend": backend, "num_rollout_actors": 2, "num_learner_workers": 2},
    }
    for section, values in sections.items():
        data[section] = {**data.get(section, {}), **values}
    return config_from_dict(data)


def _rows(run_dir):
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "loss/policy" in r}


def _dump(run_dir, step):
    path = Path(run_dir) / "trajectories" / f"step_{step:06d}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def single_and_ray(cluster, tiny_checkpoint, tmp_path_factory):
    """Both runs' directories, and the optimizer steps each took (``update_parity``)."""
    single_dir, ray_dir = tmp_path_factory.mktemp("single"), tmp_path_factory.mktemp("ray")
    ray_steps = tmp_path_factory.mktemp("ray_steps")
    single = Trainer(_config(tiny_checkpoint, single_dir, backend="none"), train_tasks=tasks(12))
    single_steps = record_optimizer_steps(single.learner.policy, single.model)
    single.fit()
    distributed = Trainer(_config(tiny_checkpoint, ray_dir), train_tasks=tasks(12))
    ray.get(
        [
            w.__ray_call__.remote(record_worker_optimizer_steps, str(ray_steps))
            for w in distributed.learner.workers
        ]
    )
    distributed.fit()
    return single_dir, ray_dir, single_steps, load_optimizer_steps(ray_steps)


def test_sync_ray_training_matches_the_single_process_trainer(single_and_ray, tiny_checkpoint):
    single_dir, ray_dir, single_steps, ray_steps = single_and_ray
    assert _config(tiny_checkpoint, ray_dir).distributed.strategy == "ddp"
    for step in (1, 2, 3):
        ours, theirs = _dump(ray_dir, step), _dump(single_dir, step)
        assert [t["group_id"] for t in ours] == [t["group_id"] for t in theirs]
        assert [[s["response_ids"] for s in t["steps"]] for t in ours] == [
            [s["response_ids"] for s in t["steps"]] for t in theirs
        ]
        assert {s["policy_version"] for t in ours for s in t["steps"]} == {step - 1}
    single, distributed = _rows(single_dir), _rows(ray_dir)
    assert sorted(distributed) == [1, 2, 3]
    for step in (1, 2, 3):
        for key in ("loss/policy", "grad_norm", "clip_fraction", "reward/mean"):
            assert distributed[step][key] == pytest.approx(single[step][key], rel=1e-4, abs=1e-6), (step, key)
        assert distributed[step]["async/staleness_max"] == 0
    assert len(single_steps) == 3 * 2  # steps x mini-batches
    assert_gradients_match(ray_steps, single_steps)
    ours = load_file(Path(ray_dir) / "checkpoints" / "step_000003" / "model" / "model.safetensors")
    theirs = load_file(Path(single_dir) / "checkpoints" / "step_000003" / "model" / "model.safetensors")
    first = load_file(Path(tiny_checkpoint) / "model.safetensors")
    assert any(not torch.equal(first[name], theirs[name]) for name in first)  # training moved the weights
    assert ours.keys() == theirs.keys() == single_steps[0]["grads"].keys()
    bounds = adam_difference_bound(ray_steps, single_steps, theirs)
    for name, tensor in theirs.items():
        excess = (ours[name].double() - tensor.double()).abs() - bounds[name]
        worst = int(excess.argmax())
        assert excess.max() <= 0, (name, worst, float(bounds[name].flatten()[worst]))
    # Not vacuous: where the gradients are large against their rounding, the bound is tighter than a
    # flat 1e-5 (measured: all but a few in 10^5 weights, whose gradients are rounding-sized).
    tight = sum(int((b <= 1e-5).sum()) for b in bounds.values())
    assert tight >= 0.99 * sum(b.numel() for b in bounds.values())


def test_a_custom_objective_trains_on_ray_as_in_one_process(cluster, tiny_checkpoint, tmp_path):
    """``Trainer(objective=...)`` travels to the learner workers: the Ray run computes the user's loss
    and its statistics, with the single-process run's values."""
    runs = {}
    for backend in ("none", "ray"):
        run_dir = tmp_path / backend
        config = _config(tiny_checkpoint, run_dir, backend=backend, trainer={"steps": 2, "mini_batches": 1})
        Trainer(config, train_tasks=tasks(8), objective=ReinforceObjective(scale=0.5)).fit()
        runs[backend] = _rows(run_dir)
    for step in (1, 2):
        single, distributed = runs["none"][step], runs["ray"][step]
        assert "clip_fraction" not in distributed  # not the default PPO objective
        for key in ("custom/mean_logprob", "loss/policy", "grad_norm"):
            assert distributed[key] == pytest.approx(single[key], rel=1e-4, abs=1e-6), (step, key)


def test_a_killed_rollout_actor_is_restarted_and_exactly_its_unfinished_samples_requeued(
    cluster, tiny_checkpoint, tmp_path
):
    config = _config(tiny_checkpoint, tmp_path, rollout={"max_batch_size": 1, "max_tokens": 12})
    pool = RolloutPool(config)
    try:
        job = pool.submit(tasks(4), 4, "0:train:1")
        victim = pool.actors[0]  # holds tasks 0 and 2 (task index modulo 2)
        finished_before_kill: set[SampleKey] = set()

        def kill_after_first_result(key, slot):
            if slot == 0 and not finished_before_kill:
                finished_before_kill.update(job.done)
                ray.kill(victim)

        groups = pool.collect(job, on_result=kill_after_first_result)
    finally:
        pool.close()
    assert pool.restarts == 1
    victim_keys = {SampleKey(i, j) for i in (0, 2) for j in range(4)}
    assert job.requeued, "the kill came after every sample of the actor had finished"
    assert set(job.requeued) <= victim_keys - finished_before_kill
    assert set(job.done) == {SampleKey(i, j) for i in range(4) for j in range(4)}
    assert [len(g.trajectories) for g in groups] == [4, 4, 4, 4]
    assert [g.group_id for g in groups] == ["0:t0", "1:t1", "2:t2", "3:t3"]
    for group in groups:
        assert all(t.status.value == "ok" and len(t.steps) == 2 for t in group.trajectories)
        responses = [tuple(s.response_ids for s in t.steps) for t in group.trajectories]
        assert len(set(responses)) == 4  # a re-queued sample is a fresh sample, not a sibling's copy


def test_async_mode_overlaps_rollout_and_update_within_the_staleness_bound(
    cluster, tiny_checkpoint, tmp_path
):
    config = _config(
        tiny_checkpoint,
        tmp_path,
        trainer={"steps": 4, "mode": "async", "max_staleness": 2, "partial_rollouts": False},
        distributed={"num_rollout_actors": 1, "num_learner_workers": 1},
        algorithm={"off_policy": "tis"},
    )
    Trainer(config, train_tasks=tasks(16)).fit()
    rows = _rows(tmp_path)
    # Step k+1's rollout is submitted before step k's update, so it can only carry an older version.
    # Version 0 samples steps 1-3; refreshing before step 3's rollout is not needed (staleness 2 is
    # allowed), before step 4's it is: version 2 samples it and is trained from version 3.
    assert [rows[s]["async/staleness_max"] for s in (1, 2, 3, 4)] == [0, 1, 2, 1]
    versions = [{s["policy_version"] for t in _dump(tmp_path, k) for s in t["steps"]} for k in (1, 2, 3, 4)]
    assert versions == [{0}, {0}, {0}, {2}]
    assert all(rows[s]["update/skipped"] == 0 and math.isfinite(rows[s]["loss/policy"]) for s in rows)


def test_async_partial_rollouts_on_ray_land_each_update_in_the_rollout_in_flight(
    cluster, tiny_checkpoint, tmp_path
):
    """The same mechanism as in one process (tests/test_async.py): each actor swaps weights between
    requests, so step k's samples come from version k-2 or, once update k-1 lands, k-1."""
    config = _config(
        tiny_checkpoint,
        tmp_path,
        trainer={"steps": 4, "mode": "async"},
        distributed={"num_rollout_actors": 1, "num_learner_workers": 1},
        algorithm={"off_policy": "tis"},
    )
    Trainer(config, train_tasks=tasks(16)).fit()
    rows = _rows(tmp_path)
    for step in (1, 2, 3, 4):
        assert rows[step]["async/staleness_max"] <= 1 and rows[step]["update/skipped"] == 0
        versions = {s["policy_version"] for t in _dump(tmp_path, step) for s in t["steps"]}
        assert versions <= {max(step - 2, 0), step - 1}
        if step > 1:  # rollout k was submitted before update k-1 began
            assert rows[step]["timeline/rollout_start"] <= rows[step - 1]["timeline/update_start"]


def test_with_no_learner_restarts_a_dead_worker_stops_the_run_and_cli_resume_continues_it(
    cluster, tiny_checkpoint, tmp_path, single_and_ray
):
    train_file = tmp_path / "train.jsonl"
    train_file.write_text("".join(json.dumps(t) + "\n" for t in tasks(12)))
    run_dir = tmp_path / "run"
    config = _config(
        tiny_checkpoint,
        run_dir,
        data={"train": str(train_file)},
        distributed={"num_rollout_actors": 1, "max_learner_restarts": 0},
    )
    calls = {"n": 0}
    trainer = None

    def reward_that_kills_a_worker_in_step_2(trajectory, task):
        calls["n"] += 1
        if calls["n"] == 16 + 1:  # the first trajectory scored in step 2
            ray.kill(trainer.learner.workers[1])
        return trajectory.outcome_reward

    trainer = Trainer(config, reward_fn=reward_that_kills_a_worker_in_step_2)
    with pytest.raises(LearnerFailure, match="worker 1 died.*--resume"):
        trainer.fit()
    assert trainer.learner.workers == [] and trainer.rollouts.actors == []
    assert sorted(_rows(run_dir)) == [1]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_000001"]

    dump_config(config, tmp_path / "config.yaml")
    assert main(["train", str(tmp_path / "config.yaml"), "--resume", "--quiet"]) == 0
    resumed, uninterrupted = _rows(run_dir), _rows(single_and_ray[1])
    assert sorted(resumed) == [1, 2, 3]
    for step in (2, 3):  # one rollout actor instead of two: the same seeded samples, the same losses
        assert resumed[step]["loss/policy"] == pytest.approx(
            uninterrupted[step]["loss/policy"], rel=1e-4, abs=1e-6
        )


def _exit_in_next_update(worker) -> None:
    """Runs inside a learner worker (``__ray_call__``): its next ``update`` kills the process, while
    the other rank is already in the same update (its collective then fails or waits)."""
    import os

    def update(*args, **kwargs):
        os._exit(1)

    worker.learner.update = update


def test_a_learner_worker_dying_mid_update_is_recovered_and_the_run_ends_as_uninterrupted(
    cluster, tiny_checkpoint, tmp_path, single_and_ray
):
    """Worker 1 dies inside step 2's second update (no checkpoint yet: the group is rebuilt from
    model.path and replays step 1's two updates and step 2's first) and again inside step 3's second
    update (rebuilt from checkpoint 2, replaying step 3's first). Every mini-batch is applied exactly
    once, so losses and weights are those of the uninterrupted Ray run: a mini-batch skipped or
    applied twice would move the weights by about lr = 3e-3 (Adam's step size), far above 1e-5."""
    run_dir = tmp_path / "run"
    config = _config(
        tiny_checkpoint,
        run_dir,
        trainer={"checkpoint_every": 2},
        distributed={"max_learner_restarts": 2},
    )
    trainer = Trainer(config, train_tasks=tasks(12))
    group, actors = trainer.learner, list(trainer.rollouts.actors)
    update, calls = group.update, {"n": 0}

    def update_that_kills_worker_1(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] in (4, 6):  # 2 mini-batches per step: step 2's and step 3's second update
            ray.get(group.workers[1].__ray_call__.remote(_exit_in_next_update))
        return update(*args, **kwargs)

    group.update = update_that_kills_worker_1
    trainer.fit()
    assert calls["n"] == 6
    rows, uninterrupted = _rows(run_dir), _rows(single_and_ray[1])
    assert sorted(rows) == [1, 2, 3]
    assert [rows[s]["learner/restarts"] for s in (1, 2, 3)] == [0, 1, 2]
    assert [rows[s]["rollout/actor_restarts"] for s in (1, 2, 3)] == [0, 0, 0]
    assert trainer.rollouts.actors == [] and actors  # closed at the end; the same actors ran throughout
    for step in (1, 2, 3):
        for key in ("loss/policy", "grad_norm", "reward/mean"):
            assert rows[step][key] == pytest.approx(uninterrupted[step][key], rel=1e-4, abs=1e-6), (step, key)
    ours = load_file(run_dir / "checkpoints" / "step_000003" / "model" / "model.safetensors")
    theirs = load_file(
        Path(single_and_ray[1]) / "checkpoints" / "step_000003" / "model" / "model.safetensors"
    )
    worst = max(float((ours[k] - theirs[k]).abs().max()) for k in theirs)
    assert worst <= 1e-5, worst


def test_a_critic_estimator_trains_on_fsdp2_workers_like_the_single_process_trainer_and_resumes(
    cluster, tiny_checkpoint, tmp_path
):
    def config(run_dir, steps, **overrides):
        return _config(
            tiny_checkpoint,
            run_dir,
            algorithm={"advantage": "gae_token"},
            trainer={"steps": steps, "critic_lr": 1e-3},
            **overrides,
        )

    single_dir, ray_dir = tmp_path / "single", tmp_path / "ray"
    Trainer(config(single_dir, 3, backend="none"), train_tasks=tasks(12)).fit()
    fsdp2 = {"distributed": {"strategy": "fsdp2"}}
    Trainer(config(ray_dir, 2, **fsdp2), train_tasks=tasks(12)).fit()
    resumed, ran = Trainer(config(ray_dir, 3, **fsdp2), train_tasks=tasks(12), resume=True), []
    train_step = resumed.train_step
    resumed.train_step = lambda step: ran.append(step) or train_step(step)
    resumed.fit()
    assert ran == [3]  # continued from the step-2 checkpoint
    single, distributed = _rows(single_dir), _rows(ray_dir)
    assert sorted(distributed) == [1, 2, 3]
    for step in (1, 2, 3):
        for key in ("loss/policy", "grad_norm", "loss/value", "critic/grad_norm"):
            assert math.isfinite(distributed[step][key]), (step, key)
            assert distributed[step][key] == pytest.approx(single[step][key], rel=1e-4, abs=1e-6), (step, key)
    assert single[3]["loss/value"] != single[1]["loss/value"]


def test_an_agent_program_trains_on_ray_with_a_gateway_in_each_rollout_actor(
    cluster, tiny_checkpoint, tmp_path
):
    """``env.name: agent_program`` on Ray: each rollout actor builds the env from the config and hosts
    the agents' gateways; every call is an exact step, as in one process."""
    config = _config(
        tiny_checkpoint,
        tmp_path,
        env={
            "name": "agent_program",
            "kwargs": {
                "agent": "test_agent_program:two_turn_agent",
                "reward_fn": "test_agent_program:ascii_share",
            },
        },
        trainer={"steps": 1, "tasks_per_step": 2, "mini_batches": 1, "checkpoint_every": 0},
        distributed={"num_learner_workers": 1},
    )
    prompts = [{"id": f"t{i}", "prompt": f"Say something about {i}."} for i in range(2)]
    Trainer(config, train_tasks=prompts).fit()
    row = _rows(tmp_path)[1]
    assert row["gateway/exact_fraction"] == 1.0 and row["rollout/error_fraction"] == 0.0
    records = _dump(tmp_path, 1)
    assert len(records) == 2 * 4
    assert all(
        len(r["steps"]) == 2 and r["steps"][1]["info"]["gateway"]["prompt"] == "extends" for r in records
    )
