"""The agent_program env: a user's agent program, run through the gateway, trained as steps."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest
import torch
from doubles import ScriptedEngine

from agent_r1.envs import make_env
from agent_r1.envs.agent_program import AgentProgramEnv, AgentResult
from agent_r1.flows.base import AgentEnvLoop
from agent_r1.train.batch import build_batch, keep_groups
from agent_r1.train.config import config_from_dict
from agent_r1.train.summary import env_metrics
from agent_r1.train.trainer import Trainer
from agent_r1.types import SamplingParams, Trajectory, TrajectoryGroup, TrajectoryStatus

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
TASK = {"id": "t", "prompt": "What is 3 * (4 + 5)?", "answer": "27"}


@pytest.fixture(scope="module")
def openai_agent():
    sys.path.insert(0, str(EXAMPLES))
    try:
        import openai_agent

        yield openai_agent
    finally:
        sys.path.remove(str(EXAMPLES))


def run(tokenizer, script, agent, *, max_steps: int = 8, **env_kwargs):
    loop = AgentEnvLoop(
        lambda: AgentProgramEnv(tokenizer, agent, **env_kwargs),
        tokenizer,
        SamplingParams(max_tokens=128),
        max_steps=max_steps,
    )
    return asyncio.run(loop.run(ScriptedEngine(tokenizer, script), TASK))


CALL = '<tool_call>{"name": "calculate", "arguments": {"expression": "3 * (4 + 5)"}}</tool_call>'


def test_the_example_agent_solves_a_task_in_exact_steps(openai_agent, tiny_tokenizer):
    trajectory = run(tiny_tokenizer, [CALL, "The answer is 27."], openai_agent.calculator_agent)
    assert trajectory.status is TrajectoryStatus.OK
    assert trajectory.outcome_reward == 1.0 and trajectory.info["success"] is True
    first, second = trajectory.steps
    assert first.info["gateway"]["prompt"] == "fresh" and first.info["gateway"]["tool_calls"] == 1
    assert second.info["gateway"]["prompt"] == "extends" and second.terminated
    assert second.info["exact_fraction"] == 1.0
    assert second.prompt_ids[: len(first.prompt_ids) + len(first.response_ids)] == (
        *first.prompt_ids,
        *first.response_ids,
    )
    delta = tiny_tokenizer.decode(list(second.prompt_ids[len(first.prompt_ids) + len(first.response_ids) :]))
    assert (
        delta
        == "\n<|im_start|>user\n<tool_response>\n27\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert "calculate" in tiny_tokenizer.decode(list(first.prompt_ids))  # the tools went to the template


async def raises(task, client):
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    raise KeyError("the agent's own bug")


async def hangs(task, client):
    await asyncio.Event().wait()


async def no_call(task, client):
    return 1.0


async def says_text(task, client):
    r = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    return r.choices[0].message.content


async def loops(task, client):
    messages = [{"role": "user", "content": "hi"}]
    while True:
        r = await client.chat.completions.create(model="m", messages=messages)
        messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]


def test_agent_failures_become_error_trajectories_with_the_reason(tiny_tokenizer):
    raised = run(tiny_tokenizer, ["ok"], raises)
    assert raised.status is TrajectoryStatus.ERROR
    assert (
        "KeyError" in raised.error and "the agent's own bug" in raised.error and "in raises" in raised.error
    )
    # The call the agent made before it raised stays in the dump (what the model was asked and said)...
    (called,) = raised.steps
    assert called.info == {"env_error": True} and called.response_text == "ok<|im_end|>"
    assert tiny_tokenizer.decode(list(called.prompt_ids)).endswith("hi<|im_end|>\n<|im_start|>assistant\n")
    timed_out = run(tiny_tokenizer, ["ok"], hangs, timeout_s=0.2)
    assert timed_out.status is TrajectoryStatus.ERROR and "timeout_s=0.2" in timed_out.error
    silent = run(tiny_tokenizer, ["ok"], no_call)
    assert silent.status is TrajectoryStatus.ERROR and "without making a model call" in silent.error
    text = run(tiny_tokenizer, ["ok"], says_text)
    assert text.status is TrajectoryStatus.ERROR and "configure reward_fn" in text.error
    scored = run(tiny_tokenizer, ["ok"], says_text, reward_fn=lambda result, task: float(result == "ok"))
    assert scored.status is TrajectoryStatus.OK and scored.outcome_reward == 1.0
    # One call is exact (it was absent before: the metric needed two calls to judge).
    assert scored.steps[-1].info["exact_fraction"] == 1.0
    assert scored.steps[-1].metrics == {"gateway/exact_fraction": 1.0}
    # ... and is never trained: the filter keeps the OK trajectory only, and the batch has its step only.
    group = TrajectoryGroup("g", "t", (raised, scored))
    (kept,), _ = keep_groups([group], dynamic_filter=False)
    assert kept.trajectories == (scored,)
    batch = build_batch([kept], micro_batch_tokens=4096)
    assert batch.trajectories == (scored,) and len(batch.rows.steps) == len(scored.steps)
    with pytest.raises(ValueError, match="holds an ERROR trajectory"):
        build_batch([group], micro_batch_tokens=4096)


def test_max_steps_truncates_and_cancels_the_agent(tiny_tokenizer):
    trajectory = run(tiny_tokenizer, lambda prompt: "again", loops, max_steps=3)
    assert trajectory.status is TrajectoryStatus.OK and len(trajectory.steps) == 3
    assert trajectory.steps[-1].truncated and trajectory.info["truncated"] == "max_steps=3 reached"
    assert [s.info["gateway"]["prompt"] for s in trajectory.steps] == ["fresh", "extends", "extends"]


def test_registered_by_name_with_the_agent_as_an_import_path(openai_agent, tiny_tokenizer):
    env = make_env("agent_program", tokenizer=tiny_tokenizer, agent="openai_agent:calculator_agent")
    assert env.agent is openai_agent.calculator_agent
    with pytest.raises(TypeError, match="must be an async function"):
        AgentProgramEnv(tiny_tokenizer, "json:dumps")


def call_reward(record, task) -> float:
    """A per-call reward: -0.5 for a response with a malformed tool call."""
    return -0.5 if record.info.get("tool_parse_errors") else 0.0


def test_per_call_rewards(tiny_tokenizer, openai_agent):
    broken = '<tool_call>{"name": "calculate"</tool_call>'
    trajectory = run(tiny_tokenizer, [broken], openai_agent.calculator_agent, call_reward=call_reward)
    assert [s.reward for s in trajectory.steps] == [-0.5]
    assert trajectory.outcome_reward == 0.0  # the malformed call came back as the (wrong) answer


def ascii_share(result: AgentResult, task) -> float:
    """A dense reward for a random tiny model: the share of ASCII characters in its final answer."""
    answer = result.answer or ""
    return sum(ch.isascii() for ch in answer) / max(len(answer), 1)


def test_training_the_openai_example_agent_through_the_gateway(openai_agent, tiny_checkpoint, tmp_path):
    config = config_from_dict(
        {
            "model": {"path": str(tiny_checkpoint)},
            "env": {
                "name": "agent_program",
                "kwargs": {
                    "agent": "openai_agent:calculator_agent",
                    "reward_fn": "test_agent_program:ascii_share",
                },
            },
            "rollout": {"n": 4, "max_tokens": 8, "max_steps": 2},
            "trainer": {
                "steps": 2,
                "tasks_per_step": 2,
                "lr": 3e-3,
                "run_dir": str(tmp_path),
                "eval_every": 0,
            },
            "logging": {"progress": False},
        }
    )
    tasks = [{"id": f"t{i}", "prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(4)]
    trainer = Trainer(config, train_tasks=tasks)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.fit()
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    records = [
        json.loads(line)
        for line in (tmp_path / "trajectories" / "step_000001.jsonl").read_text().splitlines()
    ]
    assert len(records) == 8 and all(r["status"] == "ok" for r in records)
    for record in records:
        steps = record["steps"]
        assert 1 <= len(steps) <= 2 and steps[0]["info"]["gateway"]["prompt"] == "fresh"
        assert openai_agent.SYSTEM in steps[0]["info"]["prompt_text"]
        assert all(len(s["response_ids"]) == len(s["logprobs"]) > 0 for s in steps)


async def two_turn_agent(task, client) -> AgentResult:
    """Two calls in one conversation (the second extends the first); the answer is both replies."""
    messages = [{"role": "user", "content": task["prompt"]}]
    replies = []
    for follow_up in ("Once more.", None):
        response = await client.chat.completions.create(model="policy", messages=messages)
        message = response.choices[0].message
        replies.append(message.content or "")
        messages.append(message.model_dump(exclude_none=True))
        if follow_up:
            messages.append({"role": "user", "content": follow_up})
    return AgentResult(answer="".join(replies))


def test_learning_through_the_gateway(tiny_checkpoint, tmp_path):
    """Reward (the ASCII share of the agent's replies, ~0.5 for the random tiny model) goes up, and the
    two calls of each trajectory pack into one training sequence (an exact extension)."""
    config = config_from_dict(
        {
            "model": {"path": str(tiny_checkpoint)},
            "env": {
                "name": "agent_program",
                "kwargs": {
                    "agent": "test_agent_program:two_turn_agent",
                    "reward_fn": "test_agent_program:ascii_share",
                },
            },
            "rollout": {"n": 4, "max_tokens": 8, "max_steps": 2},
            "trainer": {
                "steps": 6,
                "tasks_per_step": 4,
                "lr": 3e-3,
                "run_dir": str(tmp_path),
                "eval_every": 0,
                "mini_batches": 2,
            },
            "logging": {"progress": False},
        }
    )
    tasks = [{"id": f"t{i}", "prompt": f"Say something about {i}."} for i in range(12)]
    Trainer(config, train_tasks=tasks).fit()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
    assert len(rewards) == 6
    assert rewards[-1] + rewards[-2] > rewards[0] + rewards[1]
    assert all(r["train/tokens"] < r["train/tokens_per_step_layout"] for r in rows if "train/tokens" in r)
    exact = [r["gateway/exact_fraction"] for r in rows if "reward/mean" in r]  # the rollout metric
    assert exact == [1.0] * 6
    records = [
        json.loads(line)
        for line in (tmp_path / "trajectories" / "step_000006.jsonl").read_text().splitlines()
    ]
    trajectories = [Trajectory.from_dict({k: v for k, v in r.items() if k != "type"}) for r in records]
    assert env_metrics(s for t in trajectories for s in t.steps) == {"gateway/exact_fraction": 1.0}
    assert all(t.steps[-1].metrics == {"gateway/exact_fraction": 1.0} for t in trajectories)
