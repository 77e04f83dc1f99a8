"""Summaries are actions: with the ``summarize`` context policy the policy's own summary of the history
is a Step of the trajectory (its request as the prompt, the sampled summary as the response, reward 0),
trained like any other action. On the tiny real model: the flow puts it where it happened, the next
prompt holds its exact ids, the packed layout starts a new sequence for it and after it, and one
update moves its log-probs."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
import torch
from trainer_envs import echo_env, tasks
from transformers import AutoModelForCausalLM

from agent_r1.envs.context import SUMMARY_STEP_KEY
from agent_r1.flows import AgentEnvLoop
from agent_r1.rollout.hf import HFEngine
from agent_r1.train import phases
from agent_r1.train.batch import batch_of
from agent_r1.types import SamplingParams, Trajectory


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return AutoModelForCausalLM.from_pretrained(tiny_checkpoint).eval()


def summary_rows(trajectory: Trajectory) -> list[int]:
    return [i for i, step in enumerate(trajectory.steps) if SUMMARY_STEP_KEY in step.info]


def spliced_ids(tokenizer, response_ids) -> list[int]:
    """The summary's ids as the next prompt shows them: less the end-of-turn token(s) it stopped on."""
    ids = list(response_ids)
    while ids and ids[-1] in tokenizer.all_special_ids:
        ids.pop()
    return ids


def contains(haystack, needle) -> bool:
    n = len(needle)
    return any(tuple(haystack[i : i + n]) == tuple(needle) for i in range(len(haystack) - n + 1))


def run_episode(model, tokenizer, **context_kwargs) -> Trajectory:
    # summarise once more than 2 turns pile up, keeping 1: after responses 3 and 5 of 6
    def env():
        return echo_env(
            tokenizer,
            context="summarize",
            context_kwargs={"keep_last": 1, "max_turns": 2, **context_kwargs},
            max_turns=6,
        )

    engine = HFEngine(model, tokenizer=tokenizer)
    flow = AgentEnvLoop(env, tokenizer, SamplingParams(max_tokens=8, seed=3), max_steps=6)
    try:
        return asyncio.run(flow.run(engine, {"id": "e", "prompt": "Say hi.", "answer": "hi"}))
    finally:
        engine.close()


def test_the_policy_summary_is_a_step_and_the_next_prompt_holds_its_sampled_ids(model, tiny_tokenizer):
    trajectory = run_episode(model, tiny_tokenizer)
    steps = trajectory.steps
    assert summary_rows(trajectory) == [3, 6] and len(steps) == 8  # 6 actions, 2 summaries
    assert steps[3].info[SUMMARY_STEP_KEY] == {"turns": 2} and steps[6].info[SUMMARY_STEP_KEY] == {"turns": 4}
    assert steps[2].info["context"]["summarised"] and steps[5].info["context"]["summarised"]
    for row in (3, 6):
        summary, after = steps[row], steps[row + 1]
        assert summary.reward == 0.0 and summary.response_ids and set(summary.response_mask) == {1}
        # The sampler's log-probs: the model's own for these ids after this request (atol as in
        # tests/test_flows_hf.py: the engine's batched forward against this unbatched one).
        ids = torch.tensor([summary.prompt_ids + summary.response_ids])
        with torch.no_grad():
            logprobs_TV = torch.log_softmax(model(ids).logits[0].float(), dim=-1)  # (T, V)
        start = len(summary.prompt_ids)
        positions = torch.arange(start - 1, start - 1 + len(summary.response_ids))
        expected = logprobs_TV[positions, torch.tensor(summary.response_ids)]
        assert torch.allclose(torch.tensor(summary.logprobs), expected, atol=1e-3)
        assert "Summarise the conversation" in tiny_tokenizer.decode(list(summary.prompt_ids))
        assert contains(after.prompt_ids, spliced_ids(tiny_tokenizer, summary.response_ids))
    # The second summary rolls the first one forward: its request quotes the first summary's text.
    first_text = tiny_tokenizer.decode(spliced_ids(tiny_tokenizer, steps[3].response_ids))
    assert f"user: Summary of the earlier conversation:\n{first_text}" in tiny_tokenizer.decode(
        list(steps[6].prompt_ids)
    )
    # A summary step, and the step after it, start new training sequences; the steps that extend
    # the summarised prompt (token-level append between summaries) share one.
    sequences = batch_of([trajectory], micro_batch_tokens=4096).sequences
    assert [[span.row for span in seq.spans] for seq in sequences] == [[0, 1, 2], [3], [4, 5], [6], [7]]
    assert sequences[1].token_ids == steps[3].prompt_ids + steps[3].response_ids
    # Dumps keep the marker.
    assert Trajectory.from_dict(trajectory.to_dict()).steps[3].info == steps[3].info


def test_train_summaries_false_keeps_todays_untrained_summary(model, tiny_tokenizer):
    trajectory = run_episode(model, tiny_tokenizer, train_summaries=False)
    assert summary_rows(trajectory) == [] and len(trajectory.steps) == 6
    assert trajectory.steps[2].info["context"]["summarised"]
    sequences = batch_of([trajectory], micro_batch_tokens=4096).sequences
    assert [[span.row for span in seq.spans] for seq in sequences] == [[0, 1, 2], [3, 4], [5]]


def test_one_update_reaches_the_summary_tokens(tiny_checkpoint, tmp_path):
    from agent_r1.train.config import config_from_dict
    from agent_r1.train.summary import summarize_rollout
    from agent_r1.train.trainer import Trainer

    config = config_from_dict(
        {
            "model": {"path": str(tiny_checkpoint)},
            # Configured as a run would be: one summary after the 2nd of 3 responses.
            "env": {
                "name": "trainer_envs:echo_env",
                "kwargs": {
                    "context": "summarize",
                    "context_kwargs": {"keep_last": 1, "max_turns": 1},
                    "max_turns": 3,
                },
            },
            "rollout": {"n": 2, "max_tokens": 6, "max_steps": 3},
            "algorithm": {"advantage": "grpo"},
            "trainer": {"steps": 1, "tasks_per_step": 1, "lr": 1e-5, "run_dir": str(tmp_path / "run")},
            "logging": {"progress": False},
        }
    )
    trainer = Trainer(config, train_tasks=tasks(1))
    try:
        (group,) = trainer.rollout(tasks(1), step=1)
        assert [summary_rows(t) for t in group.trajectories] == [[2], [2]]
        assert summarize_rollout([group], 0).metrics["context/summary_steps_per_trajectory"] == 1.0
        # One sample succeeds, one fails: GRPO credits the outcome to every step, the summary included.
        won, lost = (
            replace(t, outcome_reward=r) for t, r in zip(group.trajectories, (1.0, 0.0), strict=True)
        )
        batch, _ = phases.advantages(
            trainer.batch([replace(group, trajectories=(won, lost))], step=1), trainer.context(1)
        )
        advantages = batch.tokens.advantages
        # GRPO with its defaults: (G - mean) / (unbiased std + 1e-6) of the two returns, on every step
        returns = torch.tensor([won.total_reward, lost.total_reward])
        expected_won, expected_lost = ((returns - returns.mean()) / (returns.std() + 1e-6)).tolist()
        rows = batch.rows
        summary_tokens = {}
        for row, step in enumerate(rows.steps):
            if SUMMARY_STEP_KEY in step.info:
                summary_tokens[rows.trajectory_index[row]] = torch.tensor(list(rows.token_index(row)))
        first_tokens = [torch.tensor(list(rows.token_index(rows.trajectory_index.index(t)))) for t in (0, 1)]
        for t, index in summary_tokens.items():
            assert bool((batch.tokens.mask[index] == 1).all())
            expected = (expected_won, expected_lost)[t]
            torch.testing.assert_close(advantages[first_tokens[t]][0], torch.tensor(expected))
            assert bool((advantages[index] == advantages[first_tokens[t]][0]).all())
        # An update whose only advantage is on the winning sample's summary raises that summary's
        # log-prob: a first-order step along its gradient (so the gradient reaches those tokens).
        index = summary_tokens[0]
        only_summary = torch.zeros_like(advantages)
        only_summary[index] = advantages[index]
        before = trainer.learner.logprobs(batch.all_micro_batches, rows.num_tokens)[index].sum()
        phases.update.update(batch.with_tokens(advantages=only_summary), trainer.context(1))
        after = trainer.learner.logprobs(batch.all_micro_batches, rows.num_tokens)[index].sum()
        assert after > before
    finally:
        trainer.close()


def test_check_env_lends_its_engine_as_a_flow_does(model, tiny_tokenizer):
    from agent_r1.envs import EnvCheckError, check_env

    def env():
        return echo_env(
            tiny_tokenizer, context="summarize", context_kwargs={"keep_last": 1, "max_turns": 1}, max_turns=3
        )

    task = {"prompt": "Say hi.", "answer": "hi"}
    # It summarises after the 2nd response: scripted actions leave nobody to ask.
    with pytest.raises(EnvCheckError, match="no policy was lent"):
        check_env(env, task, actions=["a", "b", "c"], tokenizer=tiny_tokenizer)
    engine = HFEngine(model, tokenizer=tiny_tokenizer)
    try:
        check_env(env, task, engine=engine, tokenizer=tiny_tokenizer)
    finally:
        engine.close()
