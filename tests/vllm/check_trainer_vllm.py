"""The trainer with vLLM engines on CPU: in one process, and on Ray (the production path).

Run by ``tests/test_rollout_vllm.py`` with ``.venv-vllm/bin/python`` (vLLM's CPU build and Ray) and
``PYTHONPATH=tests``: ``check_trainer_vllm.py none`` trains 2 steps with ``rollout.engine: vllm`` in
this process (the engine beside the learner, weights pushed after each update); ``... ray`` starts a
local Ray cluster with 2 rollout actors (each an in-process vLLM engine on the tiny model, fp32) and 1
learner worker. Step 2 is sampled after the
weight sync of step 1's update; its trajectories' sampler log-probs are compared with a Hugging Face
forward of (a) the synced weights (checkpoint step_000001) and (b) the initial weights: the engines
must agree with (a) to vLLM's numerical gap and measurably disagree with (b), i.e. the trained
weights reached every engine. ``check_trainer_vllm.py none async`` trains 3 steps with
``trainer.mode: async`` in this process (the vLLM engine samples on a rollout thread while the learner
updates; partial rollouts): every step's sampler log-probs must match the weights of the version it
records (checkpoint step_00000v; version 0 the initial weights), so each update reached the engine
between requests, mid-rollout. ``check_trainer_vllm.py none policies`` trains 2 steps of two
policies (``policies: {low, high}``, each a LoRA adapter, on ``trainer_envs:LowHighEnv``) with one
vLLM engine serving both roles: the learner sends each trained adapter after its update and the
engine loads it as a new version; step 2's log-probs of each role must match a Hugging Face forward
under that role's adapter of checkpoint step_000001 (and not the other's, nor the base model's).
``... none policies frozen`` freezes ``high``: it samples with the base model, beside ``low``'s adapter.
Prints one JSON object of measurements; exits non-zero on a failed check.
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
ROLLOUT = {
    "n": 4,
    "max_tokens": 8,
    "max_steps": 2,
    "temperature": TEMPERATURE,
    "engine": "vllm",
    "engine_kwargs": {"max_model_len": 256, "enforce_eager": True, "kv_cache_memory_bytes": 64 << 20},
}
"""The rollout section of every trainer run here: vLLM in this process, small and eager."""


def recomputed_gap(model, trajectories) -> float:
    """Largest |sampler log-prob - HF forward log-prob| over every sampled token."""
    return step_gap(lambda step: model, trajectories)


def step_gap(model_of, trajectories) -> float:
    """Largest |sampler log-prob - HF forward log-prob of ``model_of(step)``| over every sampled token."""
    gaps = []
    for trajectory in trajectories:
        for step in trajectory.steps:
            model = model_of(step)
            ids = torch.tensor([list(step.prompt_ids) + list(step.response_ids)])
            with torch.no_grad():
                logits = model(ids).logits[0].float() / TEMPERATURE
            p = len(step.prompt_ids)
            positions = torch.arange(p - 1, ids.shape[1] - 1)
            recomputed = logits.log_softmax(-1)[positions, ids[0, p:]]
            gaps.append((recomputed - torch.tensor(step.logprobs)).abs())
    return float(torch.cat(gaps).max())


def main(backend: str, mode: str = "sync", *options: str) -> int:
    if mode == "policies":
        return check_policies(frozen="frozen" in options)
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = save_tiny_checkpoint(Path(tmp) / "model", seed=0)
        run_dir = Path(tmp) / "run"
        config = config_from_dict(
            {
                "model": {"path": str(checkpoint)},
                "env": {"name": "trainer_envs:LowByteEnv"},
                "rollout": ROLLOUT,
                "trainer": {
                    "steps": 3 if mode == "async" else 2,
                    "mode": mode,
                    "tasks_per_step": 4,
                    "lr": 3e-2,  # large, so that two steps move the log-probs well past vLLM's gap
                    "run_dir": str(run_dir),
                    "micro_batch_tokens": 64,
                    "checkpoint_every": 1,
                    "keep_checkpoints": 3,  # async reads the weights of every version
                    "torch_threads": 1,
                },
                "logging": {"progress": False, "tensorboard": False},
                "distributed": {"backend": backend, "num_rollout_actors": 2, "num_learner_workers": 1},
                **({"algorithm": {"off_policy": "tis"}} if mode == "async" else {}),
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
        if mode == "async":
            return check_versions(run_dir, checkpoint)
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


def check_versions(run_dir: Path, checkpoint: Path) -> int:
    """Async: every step was sampled by the weights of the version it records."""
    paths = {0: checkpoint, **{v: run_dir / "checkpoints" / f"step_{v:06d}" / "model" for v in (1, 2)}}
    models = {
        v: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval() for v, p in paths.items()
    }
    trajectories = [
        t for k in (1, 2, 3) for t in read_jsonl(run_dir / "trajectories" / f"step_{k:06d}.jsonl")
    ]
    results = {
        "versions_by_step": {
            k: sorted(
                {
                    s.policy_version
                    for t in read_jsonl(run_dir / "trajectories" / f"step_{k:06d}.jsonl")
                    for s in t.steps
                }
            )
            for k in (1, 2, 3)
        },
        "gap_to_recorded_version": step_gap(lambda step: models[step.policy_version], trajectories),
        "gap_to_initial_weights": recomputed_gap(
            models[0], [t for t in trajectories if any(s.policy_version for s in t.steps)]
        ),
    }
    print("RESULT " + json.dumps(results))
    assert results["versions_by_step"][1] == [0], results
    assert set(results["versions_by_step"][3]) <= {1, 2}, results
    assert results["gap_to_recorded_version"] < 1e-2, results
    assert results["gap_to_initial_weights"] > 10 * max(results["gap_to_recorded_version"], 1e-3), results
    return 0


def check_policies(frozen: bool) -> int:
    """Two policies, one vLLM engine: step 2 samples each role with its adapter as step 1 trained it
    (``frozen``: the high role with the base model)."""
    from peft import PeftModel

    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = save_tiny_checkpoint(Path(tmp) / "model", seed=0)
        run_dir = Path(tmp) / "run"
        config = config_from_dict(
            {
                "model": {"path": str(checkpoint), "lora": {"rank": 4, "alpha": 8}},
                "env": {"name": "trainer_envs:LowHighEnv"},
                "rollout": ROLLOUT,
                "trainer": {
                    "steps": 2,
                    "tasks_per_step": 4,
                    "lr": 1e-1,  # large, so that one step moves each adapter well past vLLM's gap
                    "run_dir": str(run_dir),
                    "micro_batch_tokens": 64,
                    "mini_batches": 1,
                    "checkpoint_every": 1,
                    "torch_threads": 1,
                },
                "logging": {"progress": False, "tensorboard": False},
                "policies": {"low": {}, "high": {"frozen": True} if frozen else {}},
            }
        )
        trainer = Trainer(config, train_tasks=tasks(8))
        metrics = trainer.fit()
        assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values()), metrics
        trainer.close()
        first = list(read_jsonl(run_dir / "trajectories" / "step_000001.jsonl"))
        trajectories = list(read_jsonl(run_dir / "trajectories" / "step_000002.jsonl"))
        synced = run_dir / "checkpoints" / "step_000001" / "model"
        model = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32),
            synced / "low",
            adapter_name="low",
        )
        if not frozen:
            model.load_adapter(synced / "high", adapter_name="high")
        model.eval()
        adapters = ("low", None) if frozen else ("low", "high", None)

        def gap(role: str, adapter: str | None) -> float:
            mine = [t for t in trajectories if t.role == role]
            if adapter is None:
                with model.disable_adapter():
                    return recomputed_gap(model, mine)
            model.set_adapter(adapter)
            return recomputed_gap(model, mine)

        results = {
            "roles": sorted({t.role for t in trajectories}),
            # step 1 sampled with the adapters the learner sent before it (an engine without them aborts)
            "step_1_errors": [t.error for t in first if t.error],
            "policy_versions_sampled": sorted({s.policy_version for t in trajectories for s in t.steps}),
            **{f"gap_{role}_to_{a or 'base'}": gap(role, a) for role in ("low", "high") for a in adapters},
        }
    print("RESULT " + json.dumps(results))
    assert results["roles"] == ["high", "low"] and not results["step_1_errors"], results
    assert results["policy_versions_sampled"] == [1], results
    plays = {"low": "low", "high": None if frozen else "high"}  # role -> the adapter that plays it
    for role, adapter in plays.items():
        own = results[f"gap_{role}_to_{adapter or 'base'}"]
        assert own < 1e-2, results  # vLLM's kernels vs HF (docs/rollout.md)
        others = [results[f"gap_{role}_to_{a or 'base'}"] for a in adapters if a != adapter]
        assert min(others) > 10 * max(own, 1e-3), results
    return 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    sys.exit(main(*sys.argv[1:]))
