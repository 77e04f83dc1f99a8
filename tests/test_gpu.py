"""The trainer on one CUDA device: where every model lives, bf16 log-prob parity between the engine and
the learner, and vLLM colocated with the learner (sleep mode, weights pushed after each update).

Marked ``gpu`` (deselected by default: run ``pytest -m gpu tests/test_gpu.py`` on a machine with a
CUDA device) and skipped where torch sees none; the vLLM test also needs the ``vllm`` package.
``benchmarks/gpu.py`` measures the same setting (throughput, memory, sleep).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from trainer_envs import tasks
from transformers import AutoModelForCausalLM

from agent_r1.train import phases
from agent_r1.train.config import config_from_dict
from agent_r1.train.trainer import Trainer
from agent_r1.types import read_jsonl

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
# tests/vllm/ (the CPU checks) is a namespace package named vllm wherever tests/ is on sys.path, as
# under pytest: only a spec with an origin is the real package.
_VLLM = importlib.util.find_spec("vllm")
HAS_VLLM = _VLLM is not None and _VLLM.origin is not None


def _config(tiny_checkpoint, run_dir, **sections):
    data = {
        "model": {"path": str(tiny_checkpoint), "device": "cuda"},
        "env": {"name": "trainer_envs:LowByteEnv"},
        "rollout": {"n": 4, "max_tokens": 16, "max_steps": 2},
        "trainer": {"steps": 1, "tasks_per_step": 4, "mini_batches": 2, "run_dir": str(run_dir)},
        "logging": {"progress": False, "tensorboard": False, "report": False},
    }
    for section, values in sections.items():
        data[section] = {**data.get(section, {}), **values}
    return config_from_dict(data)


def _device_types(module) -> set[str]:
    return {p.device.type for p in module.parameters()}


def test_every_model_and_the_engine_run_on_cuda(tiny_checkpoint, tmp_path):
    """``model.device: cuda`` places the policy, the reference (KL), the critic (GAE) and the HF
    engine's model on the GPU, and a whole step runs there."""
    config = _config(tiny_checkpoint, tmp_path, algorithm={"kl": {"coef": 0.1}, "advantage": "gae_token"})
    trainer = Trainer(config, train_tasks=tasks(4))
    learner = trainer.learner
    assert _device_types(trainer.model) == {"cuda"}
    assert learner.policy.reference is not None and _device_types(learner.policy.reference) == {"cuda"}
    assert learner.critic is not None and _device_types(learner.critic.model) == {"cuda"}
    engine = trainer.rollouts.engine.engine
    assert engine.model is trainer.model and engine.device.type == "cuda"  # shared, not copied
    metrics = trainer.fit()
    assert metrics["update/skipped"] == 0.0, metrics
    for key in ("loss/policy", "loss/value", "kl/mean", "grad_norm", "critic/grad_norm"):
        assert torch.isfinite(torch.tensor(metrics[key])), (key, metrics)


def test_bf16_engine_and_learner_log_probs_agree_on_cuda(tiny_checkpoint, tmp_path):
    """The CPU test's bound on the GPU (tests/test_trainer.py::
    test_bf16_sampler_and_learner_log_probs_agree_to_bf16_rounding): each path rounds every logit z
    to bf16 (relative 2^-8) before the fp32 log-softmax, here with CUDA's kernels (KV-cached decode
    vs packed forward), so log p can move by about 2^-8 |z| per term and path: 4 * 2^-8 * max|z|."""
    config = _config(
        tiny_checkpoint, tmp_path, model={"dtype": "bfloat16"}, logging={"dump_trajectories": False}
    )
    trainer = Trainer(config, train_tasks=tasks(8))
    try:
        assert next(trainer.model.parameters()).dtype is torch.bfloat16
        groups = trainer.rollout(tasks(8), step=1)
        batch, _ = phases.old_logprobs(
            trainer.batch(groups, 1), trainer.context(1)
        )  # two mini-batches: the learner recomputes the old log-probs
        with torch.no_grad():
            step = batch.rows.steps[0]
            ids = torch.tensor([list(step.prompt_ids) + list(step.response_ids)], device="cuda")
            max_logit = float(trainer.model(input_ids=ids).logits.float().abs().max())
    finally:
        trainer.close()
    gap = (batch.tokens.old_logprobs - batch.tokens.sampler_logprobs).abs()
    assert gap.numel() > 100
    assert float(gap.max()) <= 4 * 2**-8 * max_logit, (float(gap.max()), max_logit)


def _sampler_gap(model, trajectories) -> float:
    """Largest |sampler log-prob - fp32 Hugging Face forward log-prob| over every sampled token."""
    gaps = []
    for trajectory in trajectories:
        for step in trajectory.steps:
            ids = torch.tensor([list(step.prompt_ids) + list(step.response_ids)], device="cuda")
            with torch.no_grad():
                logits = model(ids).logits[0].float()
            p = len(step.prompt_ids)
            positions = torch.arange(p - 1, ids.shape[1] - 1, device="cuda")
            recomputed = logits.log_softmax(-1)[positions, ids[0, p:]].cpu()
            gaps.append((recomputed - torch.tensor(step.logprobs)).abs())
    return float(torch.cat(gaps).max())


@pytest.mark.skipif(not HAS_VLLM, reason="needs the vllm package")
def test_colocated_vllm_samples_with_the_synced_weights(tiny_checkpoint, tmp_path, monkeypatch):
    """vLLM in the learner's process on the same GPU, asleep during each update (sleep mode): step 2 is
    sampled after the sync of step 1's update, so its log-probs must match the checkpoint of step 1
    to bf16 rounding (the bound above) and must not match the initial weights (the GPU version of
    tests/vllm/check_trainer_vllm.py)."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
    config = _config(
        tiny_checkpoint,
        tmp_path,
        model={"dtype": "bfloat16"},
        rollout={
            "engine": "vllm",
            "temperature": 1.0,
            "engine_kwargs": {"gpu_memory_utilization": 0.3, "enable_sleep_mode": True},
        },
        # lr large, so that one step moves the log-probs well past the bf16 gap
        trainer={"steps": 2, "mini_batches": 1, "lr": 3e-2, "checkpoint_every": 1},
    )
    trainer = Trainer(config, train_tasks=tasks(8))
    assert trainer.rollouts.sleeps and not trainer.rollouts.shares_model
    metrics = trainer.fit()
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values()), metrics
    trajectories = list(read_jsonl(tmp_path / "trajectories" / "step_000002.jsonl"))
    assert sorted({s.policy_version for t in trajectories for s in t.steps}) == [1]
    synced = AutoModelForCausalLM.from_pretrained(
        tmp_path / "checkpoints" / "step_000001" / "model", dtype=torch.float32
    )
    initial = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    synced, initial = synced.to("cuda").eval(), initial.to("cuda").eval()
    with torch.no_grad():
        step = trajectories[0].steps[0]
        ids = torch.tensor([list(step.prompt_ids) + list(step.response_ids)], device="cuda")
        bound = 4 * 2**-8 * float(synced(ids).logits.abs().max())
    gap_synced, gap_initial = _sampler_gap(synced, trajectories), _sampler_gap(initial, trajectories)
    assert gap_synced <= bound, (gap_synced, bound)
    assert gap_initial > 2 * bound, (gap_initial, bound)  # the trained weights reached the engine
