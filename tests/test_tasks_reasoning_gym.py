"""Reasoning-gym tasks: locally generated problems, disjoint splits, exact answers, calculator episodes."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest

from agent_r1.envs.tool_env import ToolEnv
from agent_r1.tasks import get_task
from agent_r1.tasks.reasoning_gym import SYSTEM_PROMPT, exact_answer, extract_answer, make_dataset
from agent_r1.types import Action

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("reasoning_gym") is None,
    reason="reasoning-gym tasks need the reasoning-gym package (dev extra)",
)


def test_dataset_is_reproducible_mixed_and_splits_are_disjoint() -> None:
    train = make_dataset(12, split="train", seed=0)
    test = make_dataset(6, split="test", seed=0)
    assert train == make_dataset(12, split="train", seed=0)
    assert [r["source"] for r in train[:4]] == ["gsm_symbolic", "basic_arithmetic"] * 2
    assert len(train) == 12 and len(test) == 6

    def questions(rows: list[dict]) -> set[str]:
        return {r["prompt"][1]["content"] for r in rows}

    assert not questions(train) & questions(test)
    assert not questions(train) & questions(make_dataset(12, split="test", seed=1))
    row = train[0]
    assert row["prompt"][0] == {"role": "system", "content": SYSTEM_PROMPT}
    assert row["answer"] and len({r["id"] for r in train}) == 12


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="split must be 'train' or 'test'"):
        make_dataset(2, split="dev")
    with pytest.raises(ValueError, match="cannot create dataset 'no_such_dataset'"):
        make_dataset(2, datasets=("no_such_dataset",))


@pytest.mark.parametrize(
    ("answer", "reference", "expected"),
    [
        ("1000", "1000", 1.0),
        ("1,000", "1000", 1.0),
        ("1000.0", "1000", 1.0),
        (" -4 ", "-4", 1.0),
        ("$28080", "28080", 1.0),
        ("Paris.", "paris", 1.0),
        ("0.5", ".5", 1.0),
        ("12", "13", 0.0),
        ("12 apples", "12", 0.0),
        ("1000.1", "1000", 0.0),
        ("", "0", 0.0),
    ],
)
def test_exact_answer(answer: str, reference: str, expected: float) -> None:
    assert exact_answer(answer, {"answer": reference}) == expected


def test_extract_answer() -> None:
    assert extract_answer("so <answer>1</answer> no, <answer> 42 </answer>") == "42"
    assert extract_answer("the answer is 42") is None


def test_the_calculator_solves_basic_arithmetic_problems() -> None:
    """Every basic_arithmetic expression, sent to the calculator tool, gives reasoning-gym's answer."""
    spec = get_task("basic_arithmetic")
    [calculator] = spec.tools()
    rows = spec.make_dataset(20, split="train", seed=0)
    from agent_r1.tools import ToolCall

    for row in rows:
        expression = row["prompt"][1]["content"].removeprefix("Calculate ").rstrip(".")
        result = asyncio.run(calculator(ToolCall("calculator", {"expression": expression})))
        assert not result.is_error, (expression, result.content)
        assert spec.reward(result.content, row) == 1.0, (expression, result.content, row["answer"])


def test_episode_in_tool_env(tiny_tokenizer) -> None:
    spec = get_task("gsm_symbolic")
    row = spec.make_dataset(1, split="test", seed=0)[0]
    env = ToolEnv(
        tiny_tokenizer,
        spec.tools(),
        format=spec.tool_format(),
        outcome_reward=spec.reward,
        extract_answer=spec.extract_answer,
        max_turns=spec.max_turns,
    )
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n</tool_call>'
    final = f"The total is <answer>{row['answer']}</answer>"

    async def episode():
        first = await env.reset(row)
        step = await env.step(Action(call, tiny_tokenizer.encode(call, add_special_tokens=False)))
        last = await env.step(Action(final, tiny_tokenizer.encode(final, add_special_tokens=False)))
        return first, step, last

    first, step, last = asyncio.run(episode())
    prompt = tiny_tokenizer.decode(list(first.token_ids))
    assert '"name": "calculator"' in prompt and row["prompt"][1]["content"] in prompt
    assert step.info["tool_results"] == ["42"]
    assert last.terminated and last.outcome_reward == 1.0 and last.info["success"]
