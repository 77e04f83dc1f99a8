"""Code tasks: code extraction, test-case scoring in the sandbox, the shipped problems, an episode."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from agent_r1.envs.tool_env import ToolEnv
from agent_r1.tasks import get_task
from agent_r1.tasks.code import build_task, extract_code, load_problems, make_dataset, passed_tests_reward
from agent_r1.tools.python_sandbox import PythonSandbox, SandboxLimits
from agent_r1.types import Action

SANDBOX = PythonSandbox(SandboxLimits(wall_timeout_s=30.0, cpu_time_s=3))  # CPU stops loops

REFERENCE_SOLUTIONS = {
    "sum_two": "a, b = map(int, input().split())\nprint(a + b)",
    "palindrome": "w = input().strip()\nprint('YES' if w == w[::-1] else 'NO')",
    "factorial": "import math\nprint(math.factorial(int(input())))",
    "run_length": (
        "import itertools\ns = input().strip()\n"
        "print(''.join(f'{k}{len(list(g))}' for k, g in itertools.groupby(s)))"
    ),
}


def test_extract_code_takes_the_last_block() -> None:
    text = "try:\n```python\nprint(1)\n```\nfinal:\n```python\nprint(2)\n```\ndone"
    assert extract_code(text) == "print(2)\n"
    assert extract_code("```\nx = 1\n```") == "x = 1\n"
    assert extract_code("no code here") is None


def test_shipped_problems_are_solved_by_reference_solutions_and_not_by_wrong_ones() -> None:
    problems = {row["id"]: row for row in load_problems()}
    assert len(problems) == 16
    for problem_id, code in REFERENCE_SOLUTIONS.items():
        assert passed_tests_reward(code, problems[problem_id], sandbox=SANDBOX) == 1.0, problem_id
    assert passed_tests_reward("print(3)", problems["sum_two"], sandbox=SANDBOX) == pytest.approx(1 / 3)
    assert passed_tests_reward("print(3)", problems["sum_two"], sandbox=SANDBOX, all_or_nothing=True) == 0.0


def test_hostile_or_broken_answers_score_zero_and_end() -> None:
    task = {"id": "t", "tests": [{"input": "1\n", "output": "1\n"}]}
    assert passed_tests_reward("while True: pass", task, sandbox=SANDBOX) == 0.0
    assert passed_tests_reward("print(", task, sandbox=SANDBOX) == 0.0
    assert passed_tests_reward("import sys; sys.exit(1)", task, sandbox=SANDBOX) == 0.0


def test_assert_style_tests() -> None:
    task = {"id": "t", "tests": [{"assert": "assert add(1, 2) == 3"}, {"assert": "assert add(5, 0) == 5"}]}
    assert passed_tests_reward("def add(a, b):\n    return a + b", task, sandbox=SANDBOX) == 1.0
    assert passed_tests_reward("def add(a, b):\n    return a - b", task, sandbox=SANDBOX) == 0.5


def test_splits_and_loader_errors(tmp_path: Path) -> None:
    train, test = make_dataset(split="train"), make_dataset(split="test")
    assert len(train) + len(test) == 16 and test
    assert not {r["id"] for r in train} & {r["id"] for r in test}
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "a", "question": "q", "tests": [{"input": "1"}]}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl, line 1: a test is"):
        load_problems(bad)
    with pytest.raises(ValueError, match="choose from fraction, all"):
        build_task(reward="most")
    with pytest.raises(ValueError, match="isolation 'chroot' is unknown"):
        build_task(isolation="chroot")  # the task's sandbox takes the isolation it is given


def test_episode_with_the_python_tool(tiny_tokenizer) -> None:
    spec = get_task("code")
    row = next(r for r in load_problems() if r["id"] == "sum_two")
    env = ToolEnv(
        tiny_tokenizer,
        spec.tools(),
        format=spec.tool_format(),
        outcome_reward=spec.reward,
        extract_answer=spec.extract_answer,
        max_turns=spec.max_turns,
    )
    trial = json.dumps({"name": "python", "arguments": {"code": "print(sum(map(int, '2 3'.split())))"}})
    responses = [
        f"<tool_call>\n{trial}\n</tool_call>",
        f"```python\n{REFERENCE_SOLUTIONS['sum_two']}\n```",
    ]

    async def episode():
        await env.reset(row)
        return [
            await env.step(Action(text, tiny_tokenizer.encode(text, add_special_tokens=False)))
            for text in responses
        ]

    tried, final = asyncio.run(episode())
    assert tried.info["tool_results"] == ["5\n"]
    assert final.terminated and final.outcome_reward == 1.0
