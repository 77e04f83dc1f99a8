"""The trainer with vLLM engines on CPU: in one process, and on Ray (the production path).

Run by ``tests/test_rollout_vllm.py`` with ``.venv-vllm/bin/python`` (vLLM's CPU build and Ray) and
``PYTHONPATH=tests``: ``check_trainer_vllm.py none`` trains 2 steps with ``rollout.engine: vllm`` in
this process (the engine beside the learner, weights pushed after each update); ``... ray`` starts a
local Ray cluster with 2 rollout actors (each an in-process vLLM engine on the tiny model, fp32) and 1
learner worker. Step 2 is sampled after the
weight sync of step 1's update; its trajectories' sampler log-probs are compared with a Hugging Face
forward of (a) the synced weights (checkpoint step_000001) and (b) the initial weights: the engines
must agree with (a) to vLLM's numerical gap and measurably disagree with (b), i.e. the trained
weights reached every engine. Prints one JSON object of
measurements; exits non-zero on a failed check.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import ray
import torch
from trainer_envs import tasks  # tests/ is on PYTHONPATH (the env module the actors import too)
from transformers import AutoModelForCausalLM

from agent_r1.distributed import actor_runtime_env
from agent_r1.models.tiny import save_tiny_checkpoint
from agent_r1.train.config import config_from_dict
from agent_r1.train.trainer import Trainer
from agent_r1.types import read_jsonl

TESTS = str(Path(__file__).resolve().parent.parent)
TEMPERATURE = 1.0


def recomputed_gap(model, trajectories) -> float:
    """Largest |sampler log-prob - HF forward log-prob| over every sampled token."""
    gaps = []
    for trajectory in trajectories:
        for step in trajectory.steps:
            ids = torch.tensor([list(step.prompt_ids) + list(step.response_ids)])
            with torch.no_grad():
                logits = model(ids).logits[0].float() / TEMPERATURE
            p = len(step.prompt_ids)
            positions = torch.arange(p - 1, ids.shape[1] - 1)
            recomputed = logits.log_softmax(-1)[positions, ids[0, p:]]
            gaps.append((recomputed - torch.tensor(step.logprobs)).abs())
    return float(torch.cat(gaps).max())


def main(backend: str) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = save_tiny_checkpoint(Path(tmp) / "model", seed=0)
        run_dir = Path(tmp) / "run"
        config = config_from_dict(
            {
                "model": {"path": str(checkpoint)},
                "env": {"name": "trainer_envs:LowByteEnv"},
                "rollout": {
                    "n": 4,
                    "max_tokens": 8,
                    "max_steps": 2,
                    "temperature": TEMPERATURE,
                    "engine": "vllm",
                    "engine_kwargs": {
                        "max_model_len": 256,
                        "enforce_eager": True,
                        "kv_cache_memory_bytes": 64 << 20,
                    },
                },
                "trainer": {
                    "steps": 2,
                    "tasks_per_step": 4,
                    "lr": 3e-2,  # large, so that two steps move the log-probs well past vLLM's gap
                    "run_dir": str(run_dir),
                    "micro_batch_tokens": 64,
                    "checkpoint_every": 1,
                    "torch_threads": 1,
                },
                "logging": {"progress": False, "tensorboard": False},
                "distributed": {"backend": backend, "num_rollout_actors": 2, "num_learner_workers": 1},
            }
        )
        if backend == "ray":
            ray.init(
                num_cpus=2,
                include_dashboard=False,
                _temp_dir=str(Path(tmp) / "ray"),
                runtime_env=actor_runtime_env([TESTS]),
            )
        try:
            trainer = Trainer(config, train_tasks=tasks(8))
            metrics = trainer.fit()
            assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values()), metrics
        finally:
            if backend == "ray":
                ray.shutdown()
        # Step 2 was sampled (on Ray: by both actors, tasks go round-robin) after the sync of step 1's
        # update, i.e. with the weights of checkpoint step_000001.
        trajectories = list(read_jsonl(run_dir / "trajectories" / "step_000002.jsonl"))
        versions = sorted({s.policy_version for t in trajectories for s in t.steps})
        synced = AutoModelForCausalLM.from_pretrained(
            run_dir / "checkpoints" / "step_000001" / "model", dtype=torch.float32
        ).eval()
        initial = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
        results = {
            "policy_versions_sampled": versions,
            "gap_to_synced_weights": recomputed_gap(synced, trajectories),
            "gap_to_initial_weights": recomputed_gap(initial, trajectories),
            "trajectories": len(trajectories),
        }
    print("RESULT " + json.dumps(results))
    assert results["policy_versions_sampled"] == [1], results
    assert results["trajectories"] == 16, results
    assert results["gap_to_synced_weights"] < 1e-2, results  # vLLM's kernels vs HF (docs/rollout.md)
    assert results["gap_to_initial_weights"] > 10 * max(results["gap_to_synced_weights"], 1e-3), results
    return 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    sys.exit(main(sys.argv[1]))
