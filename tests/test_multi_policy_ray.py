"""Several policies on Ray (issue 50, item 4): rollout actors serve every role's adapter and return
every role's trajectory of a sample; the learner workers hold one DDP per adapter (each syncs exactly
its adapter's gradients) and update each policy from its own roles' steps; each sync sends every
trained adapter, so a restarted actor gets the whole set.

The Ray run reproduces the single-process run: the same trajectories (token ids) at every step, which
needs each policy's weights to agree to rounding, and each policy's loss and gradient norm to the
relative 1e-4 of ``test_distributed``'s parity test (the gradients' summation order differs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file
from test_multi_policy import _policies_config, tasks

from agent_r1.train.trainer import Trainer

pytestmark = pytest.mark.ray


def _config(tiny_checkpoint, run_dir, backend: str):
    return _policies_config(
        tiny_checkpoint,
        run_dir,
        trainer={"steps": 3, "micro_batch_tokens": 64, "torch_threads": 1},
        distributed={"backend": backend, "num_rollout_actors": 2, "num_learner_workers": 2},
    )


def _dump(run_dir, step):
    path = Path(run_dir) / "trajectories" / f"step_{step:06d}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def _rows(run_dir):
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "policy/low/loss/policy" in r}


def test_two_policies_on_ray_train_as_in_one_process(cluster, tiny_checkpoint, tmp_path):
    single_dir, ray_dir = tmp_path / "single", tmp_path / "ray"
    Trainer(_config(tiny_checkpoint, single_dir, "none"), train_tasks=tasks(6)).fit()
    Trainer(_config(tiny_checkpoint, ray_dir, "ray"), train_tasks=tasks(6)).fit()
    for step in (1, 2, 3):
        ours, theirs = _dump(ray_dir, step), _dump(single_dir, step)
        assert [(t["group_id"], t.get("role")) for t in ours] == [
            (t["group_id"], t.get("role")) for t in theirs
        ]
        assert [t["info"].get("episode") for t in ours] == [t["info"].get("episode") for t in theirs]
        assert [[s["response_ids"] for s in t["steps"]] for t in ours] == [
            [s["response_ids"] for s in t["steps"]] for t in theirs
        ], step
    single, distributed = _rows(single_dir), _rows(ray_dir)
    assert sorted(distributed) == [1, 2, 3]
    for step in (1, 2, 3):
        for policy in ("low", "high"):
            for key in ("loss/policy", "grad_norm"):
                name = f"policy/{policy}/{key}"
                assert distributed[step][name] == pytest.approx(single[step][name], rel=1e-4, abs=1e-6), (
                    step,
                    name,
                )
    for policy in ("low", "high"):
        folder = "checkpoints/step_000003/model/" + policy + "/adapter_model.safetensors"
        ours, theirs = load_file(ray_dir / folder), load_file(single_dir / folder)
        assert ours.keys() == theirs.keys()
