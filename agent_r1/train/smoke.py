"""A recipe's smoke run: its whole pipeline, small, on a CPU, with nothing downloaded.

``agent-r1 train recipes/qwen3-4b-instruct-gsm-calculator.yaml --smoke`` runs what the recipe runs —
its data command (the ``# Data:`` line of its header), its env, tools, tool-call format, reward,
algorithm and checkpointing — with these substitutions, so that it finishes in a minute on a CPU:

- the model is a tiny stand-in of the same architecture family and chat-template family
  (``agent_r1.models.stand_in``), random weights, saved under the smoke folder;
- the data command writes a few rows (file-based tasks read their shipped sample instead of files
  the recipe expects you to bring: ``SAMPLE_TASK_KWARGS``);
- 2 steps of 2 tasks x 2 samples, 16 tokens per response, at most 2 turns, evaluation on 2 tasks
  before and after, float32, in one process (``distributed.backend: none``, the HF engine: Ray,
  vLLM and NCCL are not exercised).

Everything lands in the smoke folder (``trainer.run_dir`` + ``-smoke`` by default): ``model/``,
``data/`` and ``run/`` (the run directory).
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from agent_r1.train.config import TrainConfig, config_from_dict, config_to_dict

__all__ = ["SAMPLE_TASK_KWARGS", "SMOKE", "SmokeError", "data_command", "smoke_config"]

SMOKE: dict[str, dict[str, Any]] = {
    "model": {"dtype": "float32", "device": "cpu"},
    "data": {"max_val_tasks": 2},
    "rollout": {"n": 2, "max_tokens": 16, "max_steps": 2, "eval_n": 1, "engine": "hf", "engine_kwargs": {}},
    "trainer": {"steps": 2, "tasks_per_step": 2, "mini_batches": 1, "eval_every": 2, "warmup_steps": 0},
    "logging": {"progress": False, "tensorboard": False},
    "distributed": {"backend": "none"},
}
ROWS = {"--train": "4", "--test": "2"}


class SmokeError(ValueError):
    """A recipe that cannot be smoke-run: no data command in its header, a failing one, or a model
    without a tiny stand-in."""


def _multihop_sample() -> dict[str, Any]:
    from agent_r1.tasks.multihop_qa import SAMPLE_PATH

    # The sample and its corpus stand in for the user's files, passage file or retrieval server.
    return {
        "path": str(SAMPLE_PATH),
        "test_path": None,
        "corpus": None,
        "retriever_url": None,
        "format": None,
    }


# Task kwargs that name files a recipe expects you to bring, replaced by the task's shipped sample.
SAMPLE_TASK_KWARGS = {"multihop_qa": _multihop_sample}


def data_command(recipe: str | Path) -> list[str]:
    """The arguments of the recipe header's ``# Data: python -m agent_r1.tasks.prepare ...`` line."""
    match = re.search(r"^# Data: (.*)$", Path(recipe).read_text(), re.MULTILINE)
    prefix = ["python", "-m", "agent_r1.tasks.prepare"]
    argv = shlex.split(match.group(1)) if match else []
    if argv[:3] != prefix:
        raise SmokeError(
            f"{recipe}: a recipe's header needs a '# Data: {' '.join(prefix)} TASK --out ...' line "
            "(the smoke run prepares its data with it)"
        )
    return argv[3:]


def _with_flag(argv: list[str], flag: str, value: str) -> list[str]:
    """``argv`` with ``flag``'s value replaced (or the flag added)."""
    if flag not in argv:
        return [*argv, flag, value]
    index = argv.index(flag) + 1
    return [*argv[:index], value, *argv[index + 1 :]]


def _smoke_data_argv(argv: list[str], out: Path, task_kwargs: Mapping[str, Any] | None) -> list[str]:
    """The data command writing a few rows to ``out`` (with ``task_kwargs`` when given)."""
    argv = _with_flag(argv, "--out", str(out))
    for flag, rows in ROWS.items():
        if flag not in argv or argv[argv.index(flag) + 1] != "all":  # "all" of a shipped sample is few
            argv = _with_flag(argv, flag, rows)
    if task_kwargs is not None:
        argv = _with_flag(argv, "--task-kwargs", json.dumps(task_kwargs))
    return argv


def smoke_config(config: TrainConfig, recipe: str | Path, folder: str | Path | None = None) -> TrainConfig:
    """Build the stand-in model and the data under ``folder``; return ``config`` rewritten to use them
    (``SMOKE``). ``config`` is the recipe loaded with any command-line overrides."""
    from agent_r1.models.stand_in import family_of, save_stand_in
    from agent_r1.tasks.prepare import main as prepare

    folder = Path(folder if folder is not None else f"{config.trainer.run_dir}-smoke")
    try:
        family = family_of(config.model.path)
    except ValueError as e:
        raise SmokeError(str(e)) from None
    data = config_to_dict(config)
    env_kwargs = dict(data["env"]["kwargs"])
    task = env_kwargs.get("task")
    sample_kwargs = None
    if task in SAMPLE_TASK_KWARGS:
        sample_kwargs = {**env_kwargs.get("task_kwargs", {}), **SAMPLE_TASK_KWARGS[task]()}
        env_kwargs["task_kwargs"] = sample_kwargs
    argv = _smoke_data_argv(data_command(recipe), folder / "data", sample_kwargs)
    if prepare(argv) != 0:
        raise SmokeError(
            f"{recipe}: the data command failed: python -m agent_r1.tasks.prepare {shlex.join(argv)}"
        )

    # Positions for the recipe's longest prompt plus a response (a tiny model has no other cost).
    context = data["rollout"]["max_prompt_tokens"] + SMOKE["rollout"]["max_tokens"]
    model_path = save_stand_in(family, folder / "model", max_position_embeddings=max(context, 2048))
    for section, values in SMOKE.items():
        data[section] = {**data[section], **values}
    data["model"] = {**data["model"], "path": str(model_path), "tokenizer": None}
    data["env"]["kwargs"] = env_kwargs
    data["data"] = {
        **data["data"],
        "train": str(folder / "data" / "train.jsonl"),
        "val": str(folder / "data" / "test.jsonl"),
    }
    data["trainer"]["run_dir"] = str(folder / "run")
    return config_from_dict(data)
