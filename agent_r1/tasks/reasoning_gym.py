"""Reasoning Gym tasks (``gsm_symbolic``, ``basic_arithmetic``, any other) with the calculator tool.

Problems are generated locally by the ``reasoning-gym`` package (procedural generators, no
download; ``pip install 'agent-r1[tasks]'``). The model may call ``calculator`` (see
``agent_r1.tools.calculator``) and ends with ``<answer>...</answer>``; the reward is exact-answer
scoring (``exact_answer``): 1.0 when the answer equals the reference, numerically when both are
numbers (``"1,000"`` equals ``"1000.0"``), else as text ignoring case and surrounding spaces/periods.
This is stricter than reasoning-gym's own ``score_answer``, which gives partial credit on some
datasets.

Train and test splits are disjoint: a problem belongs to the test split when a hash of its question
says so (20%), whatever the seed.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import itertools
import re
from collections.abc import Mapping, Sequence
from typing import Any

from agent_r1.tasks import TaskSpec
from agent_r1.tools.calculator import calculator

__all__ = [
    "SYSTEM_PROMPT",
    "basic_arithmetic",
    "build_task",
    "exact_answer",
    "extract_answer",
    "gsm_symbolic",
    "make_dataset",
]

SYSTEM_PROMPT = (
    "Solve the problem. You may call the calculator tool for any arithmetic. "
    "When you are done, write the final answer alone as <answer>...</answer>."
)
TEST_FRACTION = 0.2
_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NUMBER_RE = re.compile(r"^[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?$")


def _in_test_split(question: str) -> bool:
    return hashlib.sha256(question.encode()).digest()[0] < 256 * TEST_FRACTION


def _generate(name: str, n: int, split: str, seed: int, config: Mapping[str, Any]) -> list[dict[str, Any]]:
    import reasoning_gym

    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    for attempt in range(50):
        size = max(32, 2 * n) if split == "test" else max(16, n + n // 2)
        try:
            dataset = reasoning_gym.create_dataset(name, size=size * 3, seed=seed * 1000 + attempt, **config)
        except (KeyError, ValueError) as e:
            raise ValueError(f"reasoning-gym cannot create dataset {name!r}: {e}") from e
        for index, entry in enumerate(dataset):
            question = entry["question"]
            if question in seen or _in_test_split(question) != (split == "test"):
                continue
            seen.add(question)
            rows.append(
                {
                    "id": f"{name}-{split}-{seed}-{len(rows)}",
                    "prompt": [
                        {"role": "system", "content": SYSTEM_PROMPT},
                        {"role": "user", "content": question},
                    ],
                    "answer": str(entry["answer"]),
                    "source": name,
                    "source_index": f"{seed * 1000 + attempt}:{index}",
                }
            )
            if len(rows) == n:
                return rows
    raise ValueError(f"reasoning-gym dataset {name!r} has fewer than {n} distinct {split} problems")


def make_dataset(
    n: int | None,
    *,
    split: str = "train",
    seed: int = 0,
    datasets: Sequence[str] = ("gsm_symbolic", "basic_arithmetic"),
    config: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """``n`` problems, spread evenly over ``datasets`` (reasoning-gym names), reproducible from ``seed``.

    ``config`` maps a dataset name to keyword arguments of its generator (e.g. difficulty settings).
    Rows hold ``id``, ``prompt`` (system + user messages), ``answer`` and ``source`` (the dataset).
    """
    if n is None or n < 1:
        raise ValueError(
            f"reasoning_gym make_dataset: problems are generated, give a positive count, got {n!r}"
        )
    if split not in ("train", "test"):
        raise ValueError(f"reasoning_gym make_dataset: split must be 'train' or 'test', got {split!r}")
    if not datasets:
        raise ValueError("reasoning_gym make_dataset: give at least one reasoning-gym dataset name")
    if importlib.util.find_spec("reasoning_gym") is None:
        raise ImportError("reasoning-gym tasks need the package: pip install 'agent-r1[tasks]'")
    shares = [n // len(datasets) + (i < n % len(datasets)) for i in range(len(datasets))]
    per_dataset = [
        _generate(name, share, split, seed, (config or {}).get(name, {}))
        for name, share in zip(datasets, shares, strict=True)
        if share
    ]
    # Interleave so that any prefix of the dataset mixes the sources.
    return [row for group in itertools.zip_longest(*per_dataset) for row in group if row is not None]


def extract_answer(text: str) -> str | None:
    """The text inside the last ``<answer>...</answer>``, stripped; None when there is none."""
    found = _ANSWER_RE.findall(text)
    return found[-1].strip() if found else None


def _normalise(text: str) -> str:
    text = " ".join(text.strip().split()).rstrip(".").strip()
    return text.replace("$", "").lower()


def _as_number(text: str) -> float | None:
    candidate = text.replace(",", "").replace(" ", "")
    return float(candidate) if _NUMBER_RE.match(candidate) else None


def exact_answer(answer: str, task: Mapping[str, Any]) -> float:
    """1.0 when ``answer`` equals ``task["answer"]`` (numerically for numbers), else 0.0."""
    if "answer" not in task:
        raise ValueError(f"exact_answer needs task['answer']; the task has fields {sorted(task)}")
    given, reference = _normalise(answer), _normalise(str(task["answer"]))
    given_number, reference_number = _as_number(given), _as_number(reference)
    if given_number is not None and reference_number is not None:
        return float(abs(given_number - reference_number) <= 1e-9 * max(1.0, abs(reference_number)))
    return float(given == reference)


def build_task(
    datasets: Sequence[str] = ("gsm_symbolic", "basic_arithmetic"),
    config: Mapping[str, Mapping[str, Any]] | None = None,
    *,
    name: str = "reasoning_gym",
    max_turns: int = 6,
) -> TaskSpec:
    """A ``TaskSpec`` over the given reasoning-gym datasets, with the calculator and exact answers."""
    return TaskSpec(
        name=name,
        make_dataset=functools.partial(make_dataset, datasets=tuple(datasets), config=config),
        tools=lambda: [calculator],
        tool_format=lambda: "hermes",
        extract_answer=extract_answer,
        reward=exact_answer,
        max_turns=max_turns,
        required_fields=("prompt", "answer"),
    )


def gsm_symbolic() -> TaskSpec:
    """Grade-school math word problems (GSM-Symbolic templates) with the calculator."""
    return build_task(("gsm_symbolic",), name="gsm_symbolic")


def basic_arithmetic() -> TaskSpec:
    """Arithmetic expressions of a few terms with the calculator."""
    return build_task(("basic_arithmetic",), name="basic_arithmetic", max_turns=4)
