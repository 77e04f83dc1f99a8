"""Tasks from config by name: data files written by the CLI, envs built by the entry point."""

from __future__ import annotations

import asyncio
import json

import pytest

from agent_r1.envs.registry import make_env
from agent_r1.envs.tool_env import ToolEnv
from agent_r1.tasks.prepare import build, main
from agent_r1.types import Action


def test_cli_writes_train_and_test_files(tmp_path, capsys) -> None:
    assert main(["code", "--out", str(tmp_path), "--train", "all", "--test", "2"]) == 0
    train = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    test = [json.loads(line) for line in (tmp_path / "test.jsonl").read_text().splitlines()]
    assert len(train) == 14 and len(test) == 2 and "tests" in train[0]
    assert "wrote 14 train and 2 test rows of 'code'" in capsys.readouterr().out
    assert main(["nope", "--out", str(tmp_path), "--train", "1", "--test", "1"]) == 2
    assert "unknown task 'nope'; available tasks: " in capsys.readouterr().out


def test_entry_point_builds_the_tasks_env_from_config_kwargs(tiny_tokenizer) -> None:
    env = make_env(
        "agent_r1.tasks.prepare:task_env",
        tokenizer=tiny_tokenizer,
        task="multihop_qa",
        task_kwargs={"reward": "f1", "top_k": 1},
        max_turns=3,
    )
    assert isinstance(env, ToolEnv) and env.max_turns == 3 and env.tools.names == ["search"]
    task = {"prompt": "Who directed Jaws?", "answer": "Steven Spielberg"}
    call = '<tool_call>\n{"name": "search", "arguments": {"query": "Jaws film"}}\n</tool_call>'

    async def episode():
        await env.reset(task)
        searched = await env.step(Action(call, tiny_tokenizer.encode(call, add_special_tokens=False)))
        final = await env.step(Action("<answer>Spielberg</answer>", (1, 2)))
        return searched, final

    searched, final = asyncio.run(episode())
    assert (
        searched.info["tool_results"][0].count("[1]") == 1 and "[2]" not in searched.info["tool_results"][0]
    )
    assert final.outcome_reward == pytest.approx(2 / 3)  # F1 of "Spielberg" against "Steven Spielberg"


def test_bad_task_kwargs_are_named() -> None:
    with pytest.raises(ValueError, match="task 'code' does not take these task_kwargs"):
        build("code", {"colour": "red"})
