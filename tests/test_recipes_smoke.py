"""Every recipe's --smoke path runs its whole pipeline on a CPU: the header's data command, the
recipe's env, tools and reward, 2 RL steps and evaluation, with a tiny stand-in of the recipe model's
architecture and chat-template family (agent_r1.train.smoke, agent_r1.models.stand_in)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent_r1.cli import main
from agent_r1.models.chat_templates import QWEN3_CHATML_TOOLS, QWEN25_CHATML_TOOLS
from agent_r1.models.loading import load_tokenizer
from agent_r1.models.stand_in import family_of, save_stand_in
from agent_r1.models.tiny import build_tiny_tokenizer
from agent_r1.tasks.multihop_qa import SAMPLE_PATH
from agent_r1.tasks.prepare import build
from agent_r1.train.config import load_config
from agent_r1.train.smoke import SmokeError, data_command, smoke_config

RECIPES = sorted((Path(__file__).resolve().parent.parent / "recipes").glob("*.yaml"))
TEMPLATES = {"qwen2": QWEN25_CHATML_TOOLS, "qwen3": QWEN3_CHATML_TOOLS}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_the_recipe_smoke_run_trains_its_pipeline(recipe: Path, tmp_path, capsys) -> None:
    family = "qwen3" if recipe.name.startswith("qwen3") else "qwen2"
    run_dir = tmp_path / "run"
    assert main(["train", str(recipe), f"trainer.run_dir={run_dir}", "--smoke"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith(f"done: 2 steps in {tmp_path}/run-smoke/run")
    smoke = tmp_path / "run-smoke"
    model_config = json.loads((smoke / "model" / "config.json").read_text())
    assert model_config["model_type"] == family
    assert load_tokenizer(smoke / "model").chat_template == TEMPLATES[family]
    rows = [json.loads(line) for line in (smoke / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "eval/success" in r] == [0, 2]
    assert [r["step"] for r in rows if "reward/mean" in r] == [1, 2]
    assert (smoke / "run" / "checkpoints").is_dir()
    # The recipe's own task and tool reached the model: its tool schema is in the first prompt.
    config = load_config(str(recipe), [])
    tool = "calculator" if config.env.kwargs["task"] == "gsm_symbolic" else "search"
    dumped = json.loads((smoke / "run" / "trajectories" / "step_000001.jsonl").read_text().splitlines()[0])
    tokenizer = load_tokenizer(smoke / "model")
    prompt = tokenizer.decode(dumped["steps"][0]["prompt_ids"])
    assert "# Tools" in prompt and f'"name": "{tool}"' in prompt
    # The header's data command, with 4 + 2 rows; "all" of multi-hop QA's shipped sample.
    rows_written = [
        len((smoke / "data" / f"{split}.jsonl").read_text().splitlines()) for split in ("train", "test")
    ]
    if tool == "calculator":
        assert rows_written == [4, 2]
    else:
        sample = build("multihop_qa", {"path": str(SAMPLE_PATH)})
        assert rows_written == [len(sample.make_dataset(None, split=s)) for s in ("train", "test")]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_the_header_names_the_smoke_command(recipe: Path) -> None:
    assert f"# Smoke: agent-r1 train recipes/{recipe.name} --smoke " in recipe.read_text()


def test_the_smoke_config_keeps_the_recipe_and_shrinks_the_run(tmp_path) -> None:
    recipe = next(r for r in RECIPES if "gsm" in r.name)
    original = load_config(str(recipe), [])
    config = smoke_config(original, recipe, tmp_path)
    assert config.env == original.env and config.algorithm == original.algorithm
    assert config.rollout.temperature == original.rollout.temperature
    assert config.rollout.max_prompt_tokens == original.rollout.max_prompt_tokens
    assert (config.trainer.steps, config.rollout.n, config.distributed.backend) == (2, 2, "none")
    assert (config.rollout.engine, config.model.dtype) == ("hf", "float32")
    assert config.model.path == str(tmp_path / "model")
    assert config.data.train == str(tmp_path / "data" / "train.jsonl")
    assert len((tmp_path / "data" / "test.jsonl").read_text().splitlines()) == 2


def test_model_families_and_their_errors(tmp_path) -> None:
    assert family_of("Qwen/Qwen2.5-3B-Instruct") == "qwen2"
    assert family_of("Qwen/Qwen3-4B-Instruct-2507") == "qwen3"
    assert family_of(str(save_stand_in("qwen3", tmp_path / "q3"))) == "qwen3"  # a local folder's model_type
    with pytest.raises(
        ValueError, match=r"model\.path = 'meta-llama/Llama-3.1-8B'.*known families: qwen2, qwen3"
    ):
        family_of("meta-llama/Llama-3.1-8B")
    no_header = tmp_path / "recipe.yaml"
    no_header.write_text("model: {path: Qwen/Qwen2.5-3B-Instruct}\n")
    with pytest.raises(SmokeError, match=r"recipe\.yaml: a recipe's header needs a '# Data: python -m"):
        data_command(no_header)


def test_the_qwen3_template_renders_tools_calls_and_results_as_the_family_does() -> None:
    tokenizer = build_tiny_tokenizer(QWEN3_CHATML_TOOLS, ("<think>", "</think>"))
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "system", "content": "Solve it."},
        {"role": "user", "content": "2+3?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "calculator", "arguments": {"expression": "2+3"}}}],
        },
        {"role": "tool", "content": "5"},
        {"role": "tool", "content": "again 5"},
    ]
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nSolve it.\n\n# Tools\n\nYou may call one or more functions")
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n'
        "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\n"
        "again 5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    ) in text
    # Unlike Qwen2.5's, no default system prompt.
    plain = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert plain == "<|im_start|>user\nhi<|im_end|>\n"
    assert tokenizer.convert_tokens_to_ids("<think>") != tokenizer.unk_token_id
    assert len(tokenizer.encode("<think>", add_special_tokens=False)) == 1
