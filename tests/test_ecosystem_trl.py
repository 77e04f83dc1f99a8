"""The TRL environment-class adapter (env.name: trl_environment), with TRL's own side of the
multi-turn race (benchmarks/vs_trl_multiturn.py: ``CalculatorEnvironment`` and its reward function
``trl_success``, written for ``GRPOTrainer(environment_factory=...)``): the quickstart's exact tokens,
tools from methods, reset text, TRL's reward conventions, bad input, no TRL needed, and training."""

from __future__ import annotations

import asyncio
import json
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from agent_r1.envs import check_env, make_env
from agent_r1.envs.context import encode_text, render_messages
from agent_r1.envs.ecosystem.trl import TRLEnvironment
from agent_r1.models.tiny import build_tiny_tokenizer
from agent_r1.tasks import arithmetic
from agent_r1.tasks.arithmetic import SystemPromptHermes, tool_call_text
from agent_r1.train.builders import env_factory
from agent_r1.train.config import config_from_dict
from agent_r1.train.sft import replay_demonstrations
from agent_r1.train.trainer import Trainer
from agent_r1.types import Action

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
TOKENIZER = build_tiny_tokenizer()
EOS = TOKENIZER.eos_token
TASK = arithmetic.make_dataset(1, seed=0)[0]  # x=53, y=74, z=-305


@pytest.fixture(scope="module", autouse=True)
def race():
    """benchmarks/vs_trl_multiturn.py, importable (it imports its neighbours by bare name)."""
    sys.path.append(str(BENCHMARKS))
    try:
        import vs_trl_multiturn

        yield vs_trl_multiturn
    finally:
        sys.path.remove(str(BENCHMARKS))


def action(text: str) -> Action:
    return Action(text + EOS, (*TOKENIZER.encode(text, add_special_tokens=False), TOKENIZER.eos_token_id))


def play(env: TRLEnvironment, replies: list[str], task: dict = TASK):
    async def run():
        first = await env.reset(task)
        results = []
        for reply in replies:
            results.append(await env.step(action(reply)))
            if results[-1].observation is None:
                break
        await env.close()
        return first, results

    return asyncio.run(run())


def calculator_env(race, **kwargs) -> TRLEnvironment:
    kwargs.setdefault("reward", race.trl_success(Counter()))
    return TRLEnvironment(TOKENIZER, race.CalculatorEnvironment, **kwargs)


def untimed(env):
    """``env`` with its tools' time limits lifted. The replay compares tokens, and the two sides' limits
    differ (the quickstart's calculator 5 s, the adapter's default 30 s): a call that waits past 5 s on
    a busy machine (a full suite; the test failed there 2 times in ~20 suites, at a step after a tool
    result) would read as a timeout error on one side only."""
    for each in env.tools:
        each.timeout = None
    return env


def test_the_race_class_replays_the_quickstart_with_identical_tokens_and_reward(race):
    """TRL's class + TRL's reward function through the adapter = the quickstart's ArithmeticEnv."""
    tally = Counter()
    tasks = arithmetic.make_dataset(24, seed=3)

    def ours():
        return untimed(
            calculator_env(race, reward=race.trl_success(tally), format=SystemPromptHermes(), max_turns=4)
        )

    adapted = replay_demonstrations(ours, TOKENIZER, tasks, arithmetic.demonstrate, seed=1)
    native = replay_demonstrations(
        lambda: untimed(arithmetic.make_env(TOKENIZER)), TOKENIZER, tasks, arithmetic.demonstrate, seed=1
    )
    for a, b in zip(adapted, native, strict=True):
        assert [(s.prompt_ids, s.response_ids) for s in a.steps] == [
            (s.prompt_ids, s.response_ids) for s in b.steps
        ]
        assert a.outcome_reward == b.outcome_reward and a.info == b.info
    assert {t.outcome_reward for t in adapted} == {0.0, 1.0}  # the demonstrator's habit fails some
    assert tally == Counter(rollouts=24, ended_without_answer=0)


def test_methods_become_tools_with_schemas_from_hints_and_docstrings(race):
    env = calculator_env(race)
    assert env.tools.schemas() == [
        {
            "type": "function",
            "function": {
                "name": "calculator",
                "description": "Evaluate one operation (+, - or *) on integers or the names x, y, z and ans.",
                "parameters": {
                    "type": "object",
                    "properties": {"expression": {"type": "string", "description": "e.g. x*y or ans+z"}},
                    "required": ["expression"],
                    "additionalProperties": False,
                },
            },
        }
    ]


class Counting:
    """A TRL-convention class with state, a get_reward, a private helper and a numeric attribute."""

    def __init__(self) -> None:
        self.count = 0
        self.calls: list[int] = []
        self.bonus = 0.5

    def reset(self, **row) -> str:
        self.count = row["start"]
        return f" Start at {self.count}."

    def add(self, n: int) -> int:
        """Add n to the counter and return it.

        Args:
            n: how much to add.
        """
        self._note(n)
        self.count += n
        return self.count

    def fail(self) -> str:
        """Always raises."""
        raise RuntimeError("boom")

    def get_reward(self) -> float:
        return float(self.count == 10)

    def _note(self, n: int) -> None:
        self.calls.append(n)


SEEN: list[dict] = []


def recording_reward(
    prompts, completions, completion_ids, environments, log_metric, **columns
) -> list[float]:
    """A TRL reward function that records what it was given and logs a metric."""
    SEEN.append(
        {"prompts": prompts, "completions": completions, "completion_ids": completion_ids, "columns": columns}
    )
    log_metric("calls", len(environments[0].calls))
    return [0.25 * len(completions[0])]


def none_reward(**_) -> list[None]:
    return [None]


def call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


COUNT_TASK = {"id": "c", "prompt": "Reach ten.", "start": 4, "target": 10}


def test_tools_reset_text_and_trls_reward_arguments():
    SEEN.clear()
    env = TRLEnvironment(
        TOKENIZER,
        Counting,
        reward=["test_ecosystem_trl:recording_reward", "bonus"],
        reward_weights=[2.0, 1.0],
    )
    assert env.tools.names == ["add", "fail"]  # reset, get_reward, _note and the reward member are not tools
    first, results = play(env, [call("add", n=3) + call("add", n=3), call("fail"), "done"], COUNT_TASK)
    assert env.messages[0] == {"role": "user", "content": "Reach ten. Start at 4."}
    assert env.instance.calls == [3, 3] and results[0].info["tool_results"] == ["7", "10"]  # in call order
    assert results[1].info["tool_results"] == ["Error: tool 'fail' raised RuntimeError: boom"]
    last = results[-1]
    # recording_reward: 0.25 x 6 completion messages, weight 2; bonus attribute 0.5; get_reward 1.0
    assert last.info["trl_rewards"] == {"recording_reward": 1.5, "bonus": 0.5, "get_reward": 1.0}
    assert last.outcome_reward == 2 * 1.5 + 0.5 + 1.0 and last.info["success"] is True
    # log_metric's counter beside ToolEnv's own counts (a final answer: no calls)
    assert last.metrics == {
        "calls": 2.0,
        "tools/calls_per_step": 0.0,
        "tools/parse_errors_per_step": 0.0,
        "tools/tool_errors_per_step": 0.0,
        "tools/near_misses_per_step": 0.0,
    }
    assert all(r.outcome_reward is None and r.reward == 0.0 for r in results[:-1])
    (seen,) = SEEN
    assert seen["prompts"] == [[{"role": "user", "content": "Reach ten. Start at 4."}]]
    assert seen["columns"] == {
        "id": ["c"],
        "start": [4],
        "target": [10],
        "trainer_state": None,
        "log_extra": seen["columns"]["log_extra"],
    }
    (completion,) = seen["completions"]
    assert completion == [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "add", "arguments": {"n": 3}}},
                {"type": "function", "function": {"name": "add", "arguments": {"n": 3}}},
            ],
        },
        {"role": "tool", "name": "add", "content": "7"},
        {"role": "tool", "name": "add", "content": "10"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "fail", "arguments": {}}}],
        },
        {"role": "tool", "name": "fail", "content": "Error: tool 'fail' raised RuntimeError: boom"},
        {"role": "assistant", "content": "done"},
    ]
    # completion_ids: everything after the first prompt, as TRL's (responses and the tool turns)
    final_prompt = list(first.token_ids) + list(seen["completion_ids"][0])
    assert final_prompt[: len(results[-2].observation.token_ids)] == list(results[-2].observation.token_ids)
    assert seen["completion_ids"][0][-len(action("done").token_ids) :] == list(action("done").token_ids)


def test_append_ids_are_exact_and_the_schema_is_rendered_by_the_template(race):
    env = calculator_env(race)
    first, results = play(env, [tool_call_text("x*y"), tool_call_text("ans+z"), "<answer>ans</answer>"])
    prompts = [first.token_ids, *(r.observation.token_ids for r in results[:-1])]
    replies = [action(t).token_ids for t in (tool_call_text("x*y"), tool_call_text("ans+z"))]
    for before, reply, after in zip(prompts, replies, prompts[1:], strict=False):
        assert after[: len(before) + len(reply)] == (*before, *reply)
    history = env.messages[:-1]  # the conversation up to the last prompt
    assert list(prompts[-1]) == encode_text(
        TOKENIZER, render_messages(TOKENIZER, history, tools=env.tools.schemas())
    )
    assert '"name": "calculator"' in TOKENIZER.decode(list(first.token_ids))  # the # Tools block
    assert results[-1].outcome_reward == 1.0


def test_max_turns_still_scores_the_episode_and_none_rewards_are_skipped():
    env = TRLEnvironment(TOKENIZER, Counting, reward="test_ecosystem_trl:none_reward", max_turns=2)
    _, results = play(env, [call("add", n=6), call("add", n=1)], COUNT_TASK)
    last = results[-1]
    assert last.truncated and last.info["trl_rewards"] == {"none_reward": None, "get_reward": 0.0}
    assert last.outcome_reward == 0.0 and last.info["success"] is False


def test_reset_text_without_a_prompt_is_the_first_user_message():
    env = TRLEnvironment(TOKENIZER, Counting, max_turns=1)
    play(env, ["hi"], {"start": 10})
    assert env.messages[0] == {"role": "user", "content": " Start at 10."}


def test_check_env_registration_and_the_config_path(race):
    check_env(
        lambda: calculator_env(race),
        TASK,
        actions=[tool_call_text("x*y"), "<answer>ans</answer>"],
        tokenizer=TOKENIZER,
    )
    config = config_from_dict(
        {
            "env": {
                "name": "trl_environment",
                "kwargs": {
                    "environment": "vs_trl_multiturn:CalculatorEnvironment",
                    "reward": "test_ecosystem_trl:ascii_share",
                },
            }
        }
    )
    env = env_factory(config, TOKENIZER)()
    assert isinstance(env, TRLEnvironment) and env.tools.names == ["calculator"]


def test_trl_is_not_needed(race, monkeypatch):
    monkeypatch.setitem(sys.modules, "trl", None)  # `import trl` now fails as if absent
    _, results = play(calculator_env(race), [tool_call_text("x*y"), "<answer>3922</answer>"])
    assert results[-1].outcome_reward == 0.0 and results[-1].terminated


class NoReset:
    def add(self, n: int) -> int:
        """Add."""
        return n


class Untyped:
    def reset(self, **row):
        return None

    def move(self, direction):
        """Move."""


class BadReset(Counting):
    def reset(self, **row):
        return 3


def wrong_length(**_) -> list[float]:
    return [1.0, 0.0]


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"environment": "nowhere:Env"}, ValueError, "cannot import module 'nowhere'"),
        ({"environment": NoReset}, TypeError, "NoReset has no reset method"),
        (
            {"environment": Untyped, "reward": "test_ecosystem_trl:none_reward"},
            TypeError,
            "Untyped: method 'move' as a tool.*no type annotation",
        ),
        ({"environment": "vs_trl_multiturn:CalculatorEnvironment"}, ValueError, "no reward source"),
        (
            {"environment": Counting, "reward": "missing"},
            ValueError,
            "reward 'missing': Counting has no such",
        ),
        (
            {"environment": Counting, "reward": ["bonus"], "reward_weights": [1.0, 2.0]},
            ValueError,
            "2 reward_weights for 1",
        ),
        ({"environment": Counting, "tools": []}, ValueError, r"unknown option\(s\) \['tools'\]"),
        ({"environment": Counting, "outcome_reward": len}, ValueError, "unknown option"),
        ({"environment": Counting, "context": "nope"}, ValueError, "unknown context policy 'nope'"),
    ],
)
def test_bad_configuration_is_one_clear_error(kwargs, error, message):
    with pytest.raises(error, match=message):
        make_env("trl_environment", tokenizer=TOKENIZER, **kwargs)


def test_bad_returns_from_the_class_or_a_reward_function_are_named():
    with pytest.raises(TypeError, match="BadReset.reset returned int; TRL's convention is None or a str"):
        play(TRLEnvironment(TOKENIZER, BadReset), ["x"], COUNT_TASK)
    env = TRLEnvironment(TOKENIZER, Counting, reward="test_ecosystem_trl:wrong_length")
    with pytest.raises(ValueError, match="'wrong_length' returned .*one reward per completion"):
        play(env, ["x"], COUNT_TASK)


def ascii_share(prompts, completions, log_metric, **_) -> list[float]:
    """A dense TRL reward for a random tiny model: the share of ASCII characters it wrote."""
    text = "".join(m["content"] for m in completions[0] if m["role"] == "assistant")
    share = sum(ch.isascii() for ch in text) / max(len(text), 1)
    log_metric("ascii_share", share)
    return [share]


def test_training_the_race_class_end_to_end(tiny_checkpoint, tmp_path):
    config = config_from_dict(
        {
            "model": {"path": str(tiny_checkpoint)},
            "env": {
                "name": "trl_environment",
                "kwargs": {
                    "environment": "vs_trl_multiturn:CalculatorEnvironment",
                    "reward": "test_ecosystem_trl:ascii_share",
                    "max_turns": 2,
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
    trainer = Trainer(config, train_tasks=arithmetic.make_dataset(4, seed=0))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.fit()
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    step_rows = [r for r in rows if "reward/mean" in r]
    assert len(step_rows) == 2 and all(0 < r["env/ascii_share"] <= 1 for r in step_rows)
    assert all("tools/calls_per_step" in r for r in step_rows)
    records = [
        json.loads(x) for x in (tmp_path / "trajectories" / "step_000001.jsonl").read_text().splitlines()
    ]
    assert len(records) == 8 and all(r["status"] == "ok" for r in records)
    for record in records:
        last = record["steps"][-1]
        assert 1 <= len(record["steps"]) <= 2 and "trl_rewards" in last["info"]
        assert record["outcome_reward"] == last["info"]["trl_rewards"]["ascii_share"]


@pytest.mark.slow
def test_the_benchmark_arm_runs_quick():
    import eco_trl

    result = eco_trl.run(seed=0, quick=True)
    assert {"env", "metric", "before", "after", "tasks", "rl_steps", "seconds"} <= set(result)
    assert 0.0 <= result["before"] <= 1.0 and 0.0 <= result["after"] <= 1.0
    assert result["tasks"] == 4 and result["rl_steps"] == 2 and result["trl_reward_calls"] > 48
