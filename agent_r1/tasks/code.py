"""Code tasks: write a Python program, try it with the ``python`` tool, be scored by test cases.

The model may run code in the sandbox (``agent_r1.tools.python_sandbox``) while it works and ends with
its program in a fenced block, `````python ... `````, as the last code block of its final response. The
reward runs that program against the task's tests in the same kind of sandbox:

- ``{"input": str, "output": str}``: the program reads ``input`` on stdin; it passes when its stdout
  equals ``output`` up to trailing whitespace on each line and trailing blank lines;
- ``{"assert": str}``: the statement (e.g. ``assert add(1, 2) == 3``) is appended to the program; it
  passes when the run exits with status 0 (MBPP / HumanEval style).

The reward is the fraction of tests passed (``reward="fraction"``, default) or 1.0 only when all pass
(``reward="all"``). ``data/code_problems.jsonl`` holds 16 small stdin/stdout problems; load your own
JSONL with ``load_problems(path)`` (fields ``id``, ``question``, ``tests``).
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from agent_r1.tasks import TaskSpec
from agent_r1.tools.python_sandbox import PythonSandbox, SandboxLimits, python_tool

__all__ = [
    "PROBLEMS_PATH",
    "SYSTEM_PROMPT",
    "build_task",
    "extract_code",
    "load_problems",
    "make_dataset",
    "run_tests",
    "passed_tests_reward",
]

PROBLEMS_PATH = Path(__file__).resolve().parent / "data" / "code_problems.jsonl"
SYSTEM_PROMPT = (
    "Write a Python 3 program that solves the problem. You may run code with the python tool to test "
    "it. When you are done, reply with the complete final program in one ```python code block."
)
_CODE_BLOCK_RE = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(text: str) -> str | None:
    """The last fenced code block (```python, ```py or bare ```) of ``text``; None when there is none."""
    found = _CODE_BLOCK_RE.findall(text)
    return found[-1] if found else None


def _normalise_output(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.rstrip().splitlines())


def _check_test(test: Any, where: str) -> None:
    if isinstance(test, Mapping):
        if isinstance(test.get("assert"), str):
            return
        if isinstance(test.get("input"), str) and isinstance(test.get("output"), str):
            return
    raise ValueError(
        f"{where}: a test is {{'input': str, 'output': str}} or {{'assert': str}}, got {test!r:.200}"
    )


def run_tests(code: str, tests: Sequence[Mapping[str, str]], sandbox: PythonSandbox) -> list[bool]:
    """Whether ``code`` passes each test (see the module docstring), one sandboxed run per test."""
    passed = []
    for test in tests:
        if "assert" in test:
            result = sandbox.run(f"{code}\n\n{test['assert']}\n")
            passed.append(result.ok)
        else:
            result = sandbox.run(code, stdin=test["input"])
            passed.append(result.ok and _normalise_output(result.stdout) == _normalise_output(test["output"]))
    return passed


def passed_tests_reward(
    answer: str,
    task: Mapping[str, Any],
    *,
    sandbox: PythonSandbox | None = None,
    all_or_nothing: bool = False,
) -> float:
    """The fraction of ``task["tests"]`` that the program ``answer`` passes (or 1/0 if all_or_nothing)."""
    tests = task.get("tests")
    if not tests:
        raise ValueError(f"code task {task.get('id', '?')!r} has no 'tests'; it has fields {sorted(task)}")
    passed = run_tests(answer, tests, sandbox or _default_sandbox())
    if all_or_nothing:
        return float(all(passed))
    return sum(passed) / len(passed)


@functools.lru_cache(maxsize=1)
def _default_sandbox() -> PythonSandbox:
    return PythonSandbox(SandboxLimits(wall_timeout_s=10.0, cpu_time_s=5))


def load_problems(path: str | Path = PROBLEMS_PATH) -> list[dict[str, Any]]:
    """Problems of a JSONL file as task rows: ``id``, ``prompt`` (system + user), ``question``, ``tests``."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"code problems file {path} does not exist")
    rows = []
    for line_number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}, line {line_number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON ({e})") from e
        if not isinstance(record.get("question"), str):
            raise ValueError(f"{where}: needs a string 'question'; it has {sorted(record)}")
        tests = record.get("tests")
        if not isinstance(tests, list) or not tests:
            raise ValueError(f"{where}: needs a non-empty list 'tests'")
        for test in tests:
            _check_test(test, where)
        rows.append(
            {
                "id": str(record.get("id", f"line-{line_number}")),
                "prompt": [
                    {"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": record["question"]},
                ],
                "question": record["question"],
                "tests": tests,
            }
        )
    return rows


def make_dataset(
    n: int | None = None,
    *,
    split: str = "train",
    seed: int = 0,
    path: str | Path = PROBLEMS_PATH,
    test_fraction: float = 0.25,
) -> list[dict[str, Any]]:
    """``n`` problems (all when None) of ``split``; a hash of the id decides the split, ``seed`` the order."""
    if split not in ("train", "test"):
        raise ValueError(f"code make_dataset: split must be 'train' or 'test', got {split!r}")
    rows = [
        row
        for row in load_problems(path)
        if (hashlib.sha256(row["id"].encode()).digest()[0] < 256 * test_fraction) == (split == "test")
    ]
    random.Random(f"code-{split}-{seed}").shuffle(rows)
    if n is not None and n > len(rows):
        raise ValueError(f"code tasks: asked for {n} {split} problems, but {path} has {len(rows)}")
    return rows if n is None else rows[:n]


REWARDS = ("fraction", "all")


def build_task(
    path: str | Path = PROBLEMS_PATH,
    *,
    reward: str = "fraction",
    limits: SandboxLimits | None = None,
    isolation: str = "namespaces",
    max_turns: int = 6,
) -> TaskSpec:
    """Code problems from ``path`` with the python tool; test-case reward in a sandbox with ``limits``
    and ``isolation`` (``"rlimits"`` only where namespaces cannot be had: see docs/tool_library.md)."""
    if reward not in REWARDS:
        raise ValueError(f"code task reward {reward!r} is unknown; choose from {', '.join(REWARDS)}")
    sandbox = PythonSandbox(limits or SandboxLimits(wall_timeout_s=10.0, cpu_time_s=5), isolation=isolation)
    return TaskSpec(
        name="code",
        make_dataset=functools.partial(make_dataset, path=path),
        tools=lambda: [python_tool(sandbox)],
        tool_format=lambda: "hermes",
        extract_answer=extract_code,
        reward=functools.partial(passed_tests_reward, sandbox=sandbox, all_or_nothing=reward == "all"),
        max_turns=max_turns,
        required_fields=("prompt", "tests"),
    )
