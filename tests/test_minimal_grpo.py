"""examples/minimal_grpo.py: its hand-written environment matches the real ToolEnv token for token,
its sampler and learner agree on log-probs (PPO ratio exactly 1 before an update), and a short run
learns."""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

import pytest
import torch

from agent_r1.models.tiny import build_tiny_model, build_tiny_tokenizer
from agent_r1.tasks import arithmetic

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "minimal_grpo.py"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("minimal_grpo", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["minimal_grpo"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def test_example_is_one_short_file():
    assert len(EXAMPLE.read_text().splitlines()) < 300


def test_episodes_match_the_real_tool_env(example, tok):
    """Same tokens as ToolEnv + append context for the same responses (demonstrations and garbage)."""
    from agent_r1.train.sft import replay_demonstrations, sft_sequences

    tasks = arithmetic.make_dataset(30, seed=4)
    trajectories = replay_demonstrations(
        lambda: arithmetic.make_env(tok), tok, tasks, arithmetic.demonstrate, seed=7
    )
    replayed = sft_sequences(trajectories)
    rng = random.Random(7)
    for task, sequence, trajectory in zip(tasks, replayed, trajectories, strict=True):
        episode = example.start_episode(tok, task)
        for text in arithmetic.demonstrate(task, rng):
            ids = example.encode(tok, text) + [tok.eos_token_id]
            example.env_step(tok, episode, ids, [0.0] * len(ids), max_turns=4)
        assert episode.done
        assert episode.tokens == list(sequence.token_ids)
        assert [i for i, m in enumerate(episode.mask) if m] == [
            i for span in sequence.spans for i in range(span.start, span.start + span.length)
        ]
        assert episode.reward == trajectory.outcome_reward


def test_sampler_and_learner_logprobs_agree(example, tok):
    """The PPO ratio is exactly 1 before the first update: one distribution, no masking in either."""
    torch.manual_seed(0)
    model = build_tiny_model(len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id).eval()
    args = example.Args(max_new_tokens=12, max_turns=1)
    tasks = arithmetic.make_dataset(6, seed=0)
    episodes = example.rollout(model, tok, tasks, args, temperature=1.0)
    with torch.no_grad():
        learner_BT = example.token_logprobs(model, tok, [e.tokens for e in episodes], 1.0)
    for row, ep in enumerate(episodes):
        positions = [i for i, m in enumerate(ep.mask) if m]
        sampled = torch.tensor([ep.logprobs[i] for i in positions])
        recomputed = learner_BT[row, [i - 1 for i in positions]]
        assert torch.allclose(sampled, recomputed, atol=1e-4), (sampled, recomputed)


@pytest.mark.slow
def test_short_run_end_to_end(example):
    """SFT, held-out evaluation, RL steps and evaluation again, on a CI budget: the warm start must
    solve a real share of the held-out tasks, sampled (the demonstrator's habit leaves it well short);
    ``tests/test_quickstart.py`` asserts the RL gain with the real trainer."""
    args = example.Args(rl_steps=1, tasks_per_step=4, group_size=4, eval_tasks=32)
    result = example.main(args)
    first, *_, last = result["sft_losses"]
    assert last < first < 5.0  # from ~5.6 nats (uniform over 263 tokens) at initialisation
    assert 0.1 <= result["before"] <= 0.8, result  # sampled success; measured 0.19
    assert 0.0 <= result["after"] <= 1.0
