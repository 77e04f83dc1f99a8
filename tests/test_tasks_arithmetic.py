"""The arithmetic task: calculator safety, dataset splits, answer scoring, the demonstrator's
systematic errors, the task registry, and replay through the real ToolEnv."""

from __future__ import annotations

import json
import random

import pytest

from agent_r1.tasks import TaskSpec, available_tasks, get_task
from agent_r1.tasks import arithmetic as ar


@pytest.mark.parametrize(
    ("expression", "result"),
    [("12*7", "84"), ("3108-612", "2496"), (" 5 + 6 ", "11"), ("-3*4", "-12"), ("10--2", "12")],
)
def test_calculator_evaluates_one_operation(expression, result):
    assert ar.calculator(expression) == result


def test_calculator_knows_the_task_values_and_its_last_result():
    memory = ar.CalculatorMemory()
    memory.reset({"a": 37, "b": 84, "c": 612})
    assert memory.resolve("ans") is None
    assert memory.evaluate("x*y") == "3108"
    assert memory.evaluate("ans-z") == "2496"
    assert memory.resolve("ans") == "2496" and memory.resolve("17") == "17"
    with pytest.raises(ValueError, match="unknown name 'w'"):
        memory.evaluate("w*2")


@pytest.mark.parametrize(
    "expression",
    ["1+2+3", "12*7-1", "(3)", "7", "2**10", "8/2", "a*b", "__import__('os')", "1.5*2", "12*", "10**13*1"],
)
def test_calculator_rejects_anything_but_one_integer_operation(expression):
    with pytest.raises(ValueError, match="operation|integers|parse|below|unknown name"):
        ar.calculator(expression)


def test_dataset_is_reproducible_and_splits_are_disjoint():
    train = ar.make_dataset(300, split="train", seed=0)
    assert train == ar.make_dataset(300, split="train", seed=0)
    assert train != ar.make_dataset(300, split="train", seed=1)
    test_rows = ar.make_dataset(300, split="test", seed=0) + ar.make_dataset(300, split="test", seed=5)
    assert not {r["expression"] for r in train} & {r["expression"] for r in test_rows}
    assert len({r["expression"] for r in train}) == 300
    for row in train[:50]:
        a, b, c = row["a"], row["b"], row["c"]
        assert int(row["answer"]) == a * b + c and 100 <= abs(c) <= 999
        assert row["prompt"][-1] == {"role": "user", "content": f"Compute x*y+z for x={a}, y={b}, z={c}"}
    assert {r["c"] > 0 for r in train} == {True, False}
    with pytest.raises(ValueError, match="split"):
        ar.make_dataset(1, split="validation")


def test_answer_extraction_and_score():
    task = {"answer": "2496"}
    assert ar.extract_answer("so <answer> 2496 </answer>") == "2496"
    assert ar.extract_answer("<answer>1</answer> then <answer>-7</answer>") == "-7"
    assert ar.extract_answer("2496") is None
    assert ar.extract_answer("<answer>ans</answer>") == "ans"
    assert ar.score("2496", task) == 1.0
    assert ar.score("2495", task) == 0.0
    assert ar.score(None, task) == 0.0
    assert ar.score("x", task) == 0.0


def _follow(task, responses):
    """Run the demonstrator's responses through the calculator; return the final answer."""
    memory = ar.CalculatorMemory()
    memory.reset(task)
    for text in responses[:-1]:
        assert text.startswith("<tool_call>\n") and text.endswith("\n</tool_call>")
        memory.evaluate(json.loads(text.split("\n")[1])["arguments"]["expression"])
    return memory.resolve(ar.extract_answer(responses[-1]))


def test_demonstrator_is_right_without_errors_and_uses_two_calls():
    rng = random.Random(0)
    for task in ar.make_dataset(200, seed=0):
        responses = ar.demonstrate(task, rng, error_rate=0.0)
        assert len(responses) == 3
        assert _follow(task, responses) == task["answer"]


def test_demonstrator_errors_are_systematic():
    """Where the habit applies, the demonstrator's MOST COMMON answer is wrong; elsewhere it is right."""
    rng = random.Random(0)
    tasks = ar.make_dataset(400, seed=0)
    big = [t for t in tasks if t["a"] * t["b"] >= ar.PREMATURE_PRODUCT]
    plain = [t for t in tasks if t["a"] * t["b"] < ar.PREMATURE_PRODUCT]
    assert 0.35 < len(big) / len(tasks) < 0.65

    def success(rows, repeats=10):
        hits = [_follow(t, ar.demonstrate(t, rng)) == t["answer"] for t in rows for _ in range(repeats)]
        return sum(hits) / len(hits)

    assert success(plain) == 1.0
    assert 0.2 < success(big) < 0.4


def test_registry():
    assert "arithmetic" in available_tasks()
    spec = get_task("arithmetic")
    assert isinstance(spec, TaskSpec) and spec.name == "arithmetic"
    [calc] = spec.tools()
    assert calc.name == "calculator"
    with pytest.raises(ValueError, match="available tasks: .*arithmetic"):
        get_task("nope")


def test_demonstrations_replay_through_tool_env(tiny_tokenizer):
    """The real ToolEnv runs the calculator, renders no schema block, and scores the demonstrator."""
    from agent_r1.train.sft import replay_demonstrations

    def env_factory():
        return ar.make_env(tiny_tokenizer)

    tasks = ar.make_dataset(40, seed=1)
    right = replay_demonstrations(
        env_factory, tiny_tokenizer, tasks, lambda t, r: ar.demonstrate(t, r, error_rate=0)
    )
    assert all(t.outcome_reward == 1.0 and t.info["success"] for t in right)
    first = right[0]
    assert [s.info["tool_results"] for s in first.steps[:2]] == [
        [str(tasks[0]["a"] * tasks[0]["b"])],
        [tasks[0]["answer"]],
    ]
    prompt = tiny_tokenizer.decode(first.steps[0].prompt_ids)
    assert ar.SYSTEM_PROMPT in prompt and "# Tools" not in prompt
    assert len(first.steps[0].prompt_ids) < 200
    imperfect = replay_demonstrations(env_factory, tiny_tokenizer, tasks, ar.demonstrate, seed=0)
    # Seeded: the same 11 of 40 go wrong every run, each a large product answered after one call.
    failed = [(task, t) for task, t in zip(tasks, imperfect, strict=True) if t.outcome_reward == 0.0]
    assert sum(t.outcome_reward for t in imperfect) == 29.0 and len(failed) == 11
    assert all(task["a"] * task["b"] >= ar.PREMATURE_PRODUCT and len(t.steps) == 2 for task, t in failed)
