"""Two Ray nodes on one machine (``ray.cluster_utils.Cluster``: a head node and a second node, each
with a custom resource naming it): ``distributed.placement: spread`` puts rollout actors and learner
workers on both, and removing the second node mid-rollout leaves a run that finishes, with its rollout
actor restarted (unfinished samples re-queued) and its learner worker's group rebuilt, every
(task, sample) of every step trained exactly once; a learner worker then killed mid-update (step 3)
is recovered too and the run finishes."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster
from test_distributed import _exit_in_next_update
from trainer_envs import tasks

from agent_r1.distributed import actor_runtime_env
from agent_r1.train.config import config_from_dict
from agent_r1.train.trainer import Trainer

pytestmark = pytest.mark.ray
TESTS = str(Path(__file__).parent)
# Node deaths noticed within about a second (Ray's default health check takes tens of seconds).
FAST_HEALTH_CHECK = {
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 500,
    "health_check_failure_threshold": 3,
}


@pytest.fixture
def two_nodes(tmp_path_factory):
    temp = str(tmp_path_factory.mktemp("r"))
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "resources": {"head_node": 1},
            "include_dashboard": False,
            "temp_dir": temp,
            "_system_config": FAST_HEALTH_CHECK,
        },
    )
    second = cluster.add_node(num_cpus=1, resources={"second_node": 1}, temp_dir=temp)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, runtime_env=actor_runtime_env([TESTS]))
    # wait_for_nodes() sees the second node registered; its resources reach the scheduler a moment
    # later (seconds on a loaded machine), and until then a soft affinity to it falls back to the head.
    deadline = time.monotonic() + 120
    while ray.available_resources().get("second_node", 0) < 1 or ray.available_resources().get("CPU", 0) < 2:
        assert time.monotonic() < deadline, (
            f"the second node's resources never arrived: {ray.available_resources()}"
        )
        time.sleep(0.1)
    yield cluster, cluster.head_node.node_id, second
    ray.shutdown()
    cluster.shutdown()


def _node_of(actor) -> str:
    return ray.get(actor.__ray_call__.remote(lambda _: ray.get_runtime_context().get_node_id()))


def _dump(run_dir: Path, step: int) -> list[dict]:
    path = run_dir / "trajectories" / f"step_{step:06d}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_removing_the_second_node_mid_rollout_leaves_a_run_that_trains_every_sample_once(
    two_nodes, tiny_checkpoint, tmp_path
):
    cluster, head, second = two_nodes
    n, per_step, steps = 4, 4, 3
    config = config_from_dict(
        {
            "model": {"path": str(tiny_checkpoint)},
            "env": {"name": "trainer_envs:LowByteEnv"},
            "rollout": {"n": n, "max_tokens": 8, "max_steps": 2, "max_batch_size": 2},
            "trainer": {
                "steps": steps,
                "tasks_per_step": per_step,
                "lr": 3e-3,
                "run_dir": str(tmp_path),
                "micro_batch_tokens": 64,
                "checkpoint_every": 1,
                "torch_threads": 1,
            },
            "logging": {"progress": False, "tensorboard": False, "report": False},
            "distributed": {
                "backend": "ray",
                "num_rollout_actors": 2,
                "num_learner_workers": 2,
                "placement": "spread",
            },
        }
    )
    trainer = Trainer(config, train_tasks=tasks(12))
    pool, group = trainer.rollouts, trainer.learner
    rollout_nodes = [_node_of(a) for a in pool.actors]
    learner_nodes = [_node_of(w) for w in group.workers]
    assert set(rollout_nodes) == {head, second.node_id}, rollout_nodes
    assert set(learner_nodes) == {head, second.node_id}, learner_nodes
    doomed_slot = rollout_nodes.index(second.node_id)

    collect, rollouts, seen = pool.collect, {"n": 0}, {}

    def collect_and_remove_the_second_node_in_step_2(job, on_result=None):
        rollouts["n"] += 1

        def after_each_sample(key, slot):
            if rollouts["n"] == 2 and slot == doomed_slot and not seen:
                seen.update(job.done)  # what had come back when the node went
                cluster.remove_node(second)

        return collect(job, on_result=after_each_sample)

    update, armed = group.update, []

    def update_that_kills_a_worker_in_step_3(*args, **kwargs):
        if rollouts["n"] == 3 and not armed:  # the group rebuilt in step 2 is on the head node now
            armed.append(_node_of(group.workers[1]))
            ray.get(group.workers[1].__ray_call__.remote(_exit_in_next_update))
        return update(*args, **kwargs)

    pool.collect = collect_and_remove_the_second_node_in_step_2
    group.update = update_that_kills_a_worker_in_step_3
    trainer.fit()

    assert seen, "the second node was never removed"
    assert armed == [head]
    rows = {}
    for line in (tmp_path / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        rows.setdefault(row["step"], {}).update(row)
    assert sorted(rows) == [1, 2, 3]
    assert [rows[s]["rollout/actor_restarts"] for s in (1, 2, 3)] == [0, 1, 1]
    assert [rows[s]["learner/restarts"] for s in (1, 2, 3)] == [0, 1, 2]
    for step in (1, 2, 3):
        assert rows[step]["update/skipped"] == 0 and rows[step]["filter/kept_groups"] == per_step
        records = _dump(tmp_path, step)
        # Each of the step's tasks is one group of exactly n samples, none missing, none twice.
        expected = [f"{i}:{t['id']}" for i, t in enumerate(trainer.sampler.batch(step))]
        assert sorted({r["group_id"] for r in records}) == sorted(expected)
        for group_id in expected:
            members = [r for r in records if r["group_id"] == group_id]
            assert len(members) == n, (step, group_id)
            assert all(r["status"] == "ok" for r in members)
            responses = [tuple(tuple(s["response_ids"]) for s in r["steps"]) for r in members]
            assert len(set(responses)) == n, (step, group_id)  # a re-queued sample is not a copy
