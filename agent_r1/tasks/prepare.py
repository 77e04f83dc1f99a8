"""Use any registered task from a training config: write its data files, build its environment.

    python -m agent_r1.tasks.prepare gsm_symbolic --out data/gsm --train 2000 --test 200
    python -m agent_r1.tasks.prepare multihop_qa --out data/qa --train all --test all \
        --task-kwargs '{"path": "hotpot_train.json", "test_path": "hotpot_dev.json"}'

writes ``data/gsm/train.jsonl`` and ``data/gsm/test.jsonl``; a config then names the same task:

    data: {train: data/gsm/train.jsonl, val: data/gsm/test.jsonl}
    env:
      name: agent_r1.tasks.prepare:task_env
      kwargs: {task: gsm_symbolic}

``task_kwargs`` go to the task's builder (e.g. ``{path: hotpot_train.json, corpus: wiki.jsonl}`` for
``multihop_qa``); the other keyword arguments go to ``ToolEnv`` (``max_turns`` and ``format`` default to
the task's; ``format: react`` suits chat templates that do not render tools).
"""

from __future__ import annotations

import argparse
import importlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from agent_r1.tasks import TASKS, TaskSpec, available_tasks

__all__ = ["build", "task_env", "write_dataset"]


def build(task: str, task_kwargs: Mapping[str, Any] | None = None) -> TaskSpec:
    """The registered task ``task`` built with ``task_kwargs`` (an unknown name lists the known ones)."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; available tasks: {', '.join(available_tasks())}")
    module_name, _, function_name = TASKS[task].partition(":")
    builder = getattr(importlib.import_module(module_name), function_name)
    try:
        return builder(**dict(task_kwargs or {}))
    except TypeError as e:
        raise ValueError(
            f"task {task!r} does not take these task_kwargs {dict(task_kwargs or {})}: {e}"
        ) from e


def task_env(tokenizer, task: str, *, task_kwargs: Mapping[str, Any] | None = None, **env_kwargs: Any):
    """A ``ToolEnv`` for the registered task: its tools, tool-call format, answer rule and reward."""
    from agent_r1.envs.tool_env import ToolEnv

    spec = build(task, task_kwargs)
    env_kwargs.setdefault("max_turns", spec.max_turns)
    if spec.make_env is not None:
        return spec.make_env(tokenizer, **env_kwargs)
    env_kwargs.setdefault("format", spec.tool_format())
    return ToolEnv(
        tokenizer,
        spec.tools(),
        outcome_reward=spec.reward,
        extract_answer=spec.extract_answer,
        **env_kwargs,
    )


def _task_env_fields(task: str, *, task_kwargs: Mapping[str, Any] | None = None, **_: Any) -> tuple[str, ...]:
    return build(task, task_kwargs).required_fields


task_env.required_fields = _task_env_fields  # type: ignore[attr-defined]  # depends on env.kwargs.task


def write_dataset(spec: TaskSpec, path: str | Path, n: int | None, *, split: str, seed: int = 0) -> int:
    """Write ``n`` rows of ``split`` as JSONL (the format ``data.train`` / ``data.val`` read)."""
    rows = spec.make_dataset(n, split=split, seed=seed)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return len(rows)


def _count(text: str) -> int | None:
    return None if text == "all" else int(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m agent_r1.tasks.prepare", description="Write a task's train/test JSONL files."
    )
    parser.add_argument("task", help=f"one of: {', '.join(available_tasks())}")
    parser.add_argument("--out", required=True, help="folder for train.jsonl and test.jsonl")
    parser.add_argument(
        "--train", type=_count, required=True, help="training rows, or 'all' (file-based tasks)"
    )
    parser.add_argument("--test", type=_count, required=True, help="test rows, or 'all' (file-based tasks)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--task-kwargs", default="{}", help='JSON builder arguments, e.g. \'{"path": "x.json"}\''
    )
    args = parser.parse_args(argv)
    try:
        spec = build(args.task, json.loads(args.task_kwargs))
        counts = {
            split: write_dataset(spec, Path(args.out) / f"{split}.jsonl", n, split=split, seed=args.seed)
            for split, n in (("train", args.train), ("test", args.test))
        }
    except (ValueError, FileNotFoundError, ImportError) as e:
        print(f"agent_r1.tasks.prepare: {e}")
        return 2
    print(f"wrote {counts['train']} train and {counts['test']} test rows of {args.task!r} to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
