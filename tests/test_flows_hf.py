"""Flows with a real model: the tiny Qwen2 built from config, saved, reloaded with from_pretrained and
served by HFEngine (continuous batching). Checks token-in/token-out end to
end: every prompt extends the previous prompt+response by the exact sampled ids, and the stored
log-probs are the model's own."""

import asyncio

import pytest
import torch
from trainer_envs import EveryResponseEchoes, echo
from transformers import AutoModelForCausalLM

from agent_r1.envs import ToolEnv
from agent_r1.flows import AgentEnvLoop, rollout_group
from agent_r1.rollout.hf import HFEngine
from agent_r1.types import SamplingParams, TrajectoryStatus


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return AutoModelForCausalLM.from_pretrained(tiny_checkpoint).eval()


def test_tool_env_append_with_a_real_model_keeps_exact_ids_and_logprobs(model, tiny_tokenizer):
    engine = HFEngine(model, tokenizer=tiny_tokenizer)
    params = SamplingParams(max_tokens=12, temperature=1.0)

    def env():
        return ToolEnv(tiny_tokenizer, [echo], format=EveryResponseEchoes(), max_turns=3)

    flow = AgentEnvLoop(env, tiny_tokenizer, params, max_steps=5)
    try:
        group = asyncio.run(
            rollout_group(flow, engine, {"id": "e", "prompt": "Say hi.", "answer": "hi"}, 3, "g")
        )
    finally:
        engine.close()
    for trajectory in group.trajectories:
        assert trajectory.status is TrajectoryStatus.OK, trajectory.error
        steps = trajectory.steps
        assert len(steps) == 3 and steps[-1].truncated  # max_turns=3
        for before, after in zip(steps, steps[1:], strict=False):
            assert after.prompt_ids[: len(before.prompt_ids) + len(before.response_ids)] == (
                before.prompt_ids + before.response_ids
            )
        # Append makes every step a prefix of the last one: one forward pass scores them all.
        last = steps[-1]
        ids = torch.tensor([last.prompt_ids + last.response_ids])
        with torch.no_grad():
            logprobs_TV = torch.log_softmax(model(ids).logits[0].float(), dim=-1)  # (T, V)
        for step in steps:
            start = len(step.prompt_ids)
            positions = torch.arange(start - 1, start - 1 + len(step.response_ids))
            expected = logprobs_TV[positions, torch.tensor(step.response_ids)]
            assert torch.allclose(torch.tensor(step.logprobs), expected, atol=1e-3)
            assert set(step.timings) == {"generate", "env_step"}
