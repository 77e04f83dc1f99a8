"""The shipped recipes load under the config schema and name a registered task consistently."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from agent_r1.tasks.prepare import build
from agent_r1.train.config import load_config

RECIPES = sorted((Path(__file__).resolve().parent.parent / "recipes").glob("*.yaml"))


def test_there_are_recipes_for_qwen25_and_qwen3() -> None:
    names = [r.name for r in RECIPES]
    assert any(n.startswith("qwen2.5") for n in names) and any(n.startswith("qwen3") for n in names)
    assert any("gsm" in n for n in names) and any("multihop" in n for n in names)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipe_is_a_valid_config_for_a_registered_task(recipe: Path) -> None:
    config = load_config(str(recipe), [])
    assert config.env.name == "agent_r1.tasks.prepare:task_env"
    task, task_kwargs = config.env.kwargs["task"], config.env.kwargs.get("task_kwargs", {})
    assert config.rollout.engine == "vllm" and config.model.dtype == "bfloat16"
    # The data command in the header writes the files that data.train / data.val read, for the same task.
    command = re.search(r"^# Data: (.*)$", recipe.read_text(), re.MULTILINE).group(1)
    argv = shlex.split(command)
    assert argv[:4] == ["python", "-m", "agent_r1.tasks.prepare", task]
    out = argv[argv.index("--out") + 1]
    assert config.data.train == f"{out}/train.jsonl" and config.data.val == f"{out}/test.jsonl"
    if "--task-kwargs" in argv:
        header_kwargs = json.loads(argv[argv.index("--task-kwargs") + 1])
        assert {k: task_kwargs[k] for k in header_kwargs} == header_kwargs
    assert build(task, task_kwargs).max_turns >= 1  # builders read no files until data or tools are needed
