"""The first hour of an agent program: where its module is found, a bad import path refused before the
model loads (exit 2, one message), a shorter tool block, and where the call record lives."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from doubles import ScriptedEngine

from agent_r1.envs.agent_program import AgentProgramEnv
from agent_r1.envs.gateway import Gateway
from agent_r1.flows.base import AgentEnvLoop
from agent_r1.types import SamplingParams, TrajectoryStatus

ROOT = Path(__file__).resolve().parents[1]
AGENT_R1 = Path(sys.executable).parent / "agent-r1"  # the console script: the cwd is not on its sys.path

AGENT_MODULE = """
from agent_r1.envs.agent_program import AgentResult


async def solve(task, client):
    response = await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": task["prompt"]}]
    )
    return AgentResult(reward=float(len(response.choices[0].message.content or "") % 2), answer="x")
"""


def write_package(folder: Path) -> None:
    (folder / "my_pkg").mkdir(parents=True)
    (folder / "my_pkg" / "__init__.py").write_text("")
    (folder / "my_pkg" / "agents.py").write_text(AGENT_MODULE)


def write_config(folder: Path, model: str, run_dir: Path, **env_kwargs) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    train = folder / "train.jsonl"
    train.write_text("".join(json.dumps({"id": f"t{i}", "prompt": f"Say {i}."}) + "\n" for i in range(2)))
    config = {
        "model": {"path": model},
        "data": {"train": str(train)},
        "env": {"name": "agent_program", "kwargs": {"agent": "my_pkg.agents:solve", **env_kwargs}},
        "rollout": {"n": 2, "max_tokens": 4, "max_steps": 1},
        "trainer": {"steps": 1, "tasks_per_step": 2, "run_dir": str(run_dir), "torch_threads": 1},
        "logging": {"progress": False, "tensorboard": False, "report": False},
    }
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def train(config: Path, cwd: Path, command: str = "train") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [str(AGENT_R1), command, str(config)], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


# ---------------------------------------------------------------------------- where the agent is found


def test_the_agent_module_beside_the_config_trains_without_pythonpath(tiny_checkpoint, tmp_path):
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    write_package(project)
    elsewhere.mkdir()
    config = write_config(project, str(tiny_checkpoint), tmp_path / "run")
    done = train(config, cwd=elsewhere)
    assert done.returncode == 0, done.stdout + done.stderr
    records = [
        json.loads(line)
        for line in (tmp_path / "run" / "trajectories" / "step_000001.jsonl").read_text().splitlines()
    ]
    assert len(records) == 4 and all(r["status"] == "ok" for r in records)
    assert all(r["steps"][0]["info"]["gateway"]["prompt"] == "fresh" for r in records)


def test_the_agent_module_in_the_working_directory_is_found(tmp_path):
    """The agent imports (so the run goes on to the model, whose missing folder then stops it)."""
    configs, cwd = tmp_path / "configs", tmp_path / "work"
    write_package(cwd)
    config = write_config(configs, str(tmp_path / "no-model-here"), tmp_path / "run")
    done = train(config, cwd=cwd)
    assert done.returncode == 2
    assert "no-model-here" in done.stdout and "env.kwargs" not in done.stdout + done.stderr


# ----------------------------------------------------------------- bad import paths, before the model


@pytest.mark.parametrize(
    ("env_kwargs", "key", "cause"),
    [
        ({"agent": "no_such_pkg.agents:solve"}, "env.kwargs.agent", "No module named 'no_such_pkg'"),
        (
            {"reward_fn": "my_pkg.agents:no_such_score"},
            "env.kwargs.reward_fn",
            "has no attribute 'no_such_score'",
        ),
    ],
)
def test_a_bad_agent_program_kwarg_is_refused_before_the_model_loads(env_kwargs, key, cause, tmp_path):
    """Exit 2, each problem once, found without loading a model: the bad kwarg, and (an independent
    problem, listed beside it) the model path that does not exist; no traceback."""
    write_package(tmp_path)
    config = write_config(tmp_path, str(tmp_path / "no-model-here"), tmp_path / "run", **env_kwargs)
    done = train(config, cwd=tmp_path)
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    assert output.count(f"config key '{key}'") == 1 and cause in output, output
    assert "2 problems found without the weights" in output, output
    assert output.count("no-model-here' is not a local folder") == 1 and "Traceback" not in output
    if "No module" in cause:
        assert "beside the config file, in the working directory" in output


def test_agent_r1_eval_refuses_a_bad_agent_before_the_model_loads(tmp_path):
    config = write_config(tmp_path, str(tmp_path / "no-model-here"), tmp_path / "run", agent="nowhere:solve")
    done = train(config, cwd=tmp_path, command="eval")
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    assert output.count("config key 'env.kwargs.agent'") == 1 and "No module named 'nowhere'" in output
    # and the config gives no data.val: every problem in one run, each once
    assert "agent-r1 eval: 3 problems found without the weights" in output, output
    assert output.count("config key 'data.val': no tasks") == 1
    assert output.count("no-model-here' is not a local folder") == 1 and "Traceback" not in output


@pytest.mark.parametrize(
    ("env_kwargs", "key", "cause"),
    [
        ({"agent": "json:dumps"}, "env.kwargs.agent", "'json:dumps' must be an async function"),
        ({"agent": "json"}, "env.kwargs.agent", "entry point must look like 'package.module:Attribute'"),
        (None, "env.kwargs.agent", "required: the agent's import path"),
        ({"call_reward": "json:no_such"}, "env.kwargs.call_reward", "has no attribute 'no_such'"),
        (
            {"tool_prompt": "short"},
            "env.kwargs.tool_prompt",
            "must be one of ('template', 'compact', 'none')",
        ),
        ({"format": "no_such_format"}, "env.kwargs.format", "no_such_format"),
        ({"agnet": "x:y"}, "env.kwargs.agnet", "not an agent_program option; the options are ['agent',"),
    ],
)
def test_check_env_names_the_bad_kwarg(env_kwargs, key, cause):
    from agent_r1.train.builders import check_env
    from agent_r1.train.config import ConfigError, config_from_dict

    good = {"agent": "test_agent_program:two_turn_agent"}
    kwargs = {} if env_kwargs is None else {**good, **env_kwargs}
    with pytest.raises(ConfigError) as raised:
        check_env(config_from_dict({"env": {"name": "agent_program", "kwargs": kwargs}}))
    assert raised.value.key == key and cause in raised.value.why
    check_env(config_from_dict({"env": {"name": "agent_program", "kwargs": good}}))


# ------------------------------------------------------------------------------ the tool block

UNITS = ["mm", "cm", "m", "km", "in", "ft", "mi"]


def converter(name: str, description: str, units: list[str]) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {
                    "value": {"type": "number", "description": "The quantity to convert, in from_unit."},
                    "from_unit": {"type": "string", "enum": units, "description": "The unit of value."},
                    "to_unit": {"type": "string", "enum": units, "description": "The unit to convert to."},
                },
                "required": ["value", "from_unit", "to_unit"],
                "additionalProperties": False,
            },
        },
    }


TOOLS = [
    converter("convert_length", "Convert a length from one unit to another.", UNITS),
    converter(
        "convert_temperature",
        "Convert a temperature between Celsius, Fahrenheit and Kelvin.",
        ["C", "F", "K"],
    ),
]
COMPACT = (
    "# Tools\n"
    'convert_length(value: number, from_unit: "mm"|"cm"|"m"|"km"|"in"|"ft"|"mi", to_unit: '
    '"mm"|"cm"|"m"|"km"|"in"|"ft"|"mi") - Convert a length from one unit to another.\n'
    'convert_temperature(value: number, from_unit: "C"|"F"|"K", to_unit: "C"|"F"|"K") - Convert a '
    "temperature between Celsius, Fahrenheit and Kelvin.\n"
    'Write each call as <tool_call>{"name": "<tool name>", "arguments": {<arguments>}}</tool_call>.'
)


def tool_block_tokens(tokenizer, tool_prompt: str) -> int:
    messages = (
        {"role": "system", "content": "You convert units."},
        {"role": "user", "content": "3 m in ft?"},
    )

    def count(msgs, tools) -> int:
        ids = tokenizer.apply_chat_template(
            list(msgs), tools=tools, add_generation_prompt=True, return_dict=False
        )
        return len(ids)

    rendered, tools = Gateway(tokenizer, tool_prompt=tool_prompt).tool_block(messages, tuple(TOOLS))
    return count(rendered, list(tools) if tools else None) - count(messages, None)


def test_the_compact_tool_block_is_a_quarter_of_the_template_block(tiny_tokenizer):
    """The tiny model's tokenizer: one token per byte except its special tokens (``<tool_call>`` and
    ``</tool_call>`` are one each), so the compact block costs its text and the two newlines joining
    it to the system message, less 21; the template's block is 3.7 times longer."""
    rendered, tools = Gateway(tiny_tokenizer, tool_prompt="compact").tool_block(
        ({"role": "system", "content": "S"},), tuple(TOOLS)
    )
    assert tools is None and rendered[0]["content"] == f"S\n\n{COMPACT}"
    compact, template = (
        tool_block_tokens(tiny_tokenizer, "compact"),
        tool_block_tokens(tiny_tokenizer, "template"),
    )
    assert compact == len(f"\n\n{COMPACT}".encode()) - len("<tool_call>") - len("</tool_call>") + 2 == 393
    assert template == 1465  # the JSON schemas in full, and the template's instructions
    assert tool_block_tokens(tiny_tokenizer, "none") == 0


def call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


async def two_tool_agent(task, client) -> float:
    """A plain tool loop over the two converters (the tool results are fixed strings)."""
    messages = [
        {"role": "system", "content": "You convert units."},
        {"role": "user", "content": task["prompt"]},
    ]
    for _ in range(4):
        response = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return float("9.84" in (message.content or ""))
        for tool_call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": tool_call.id, "content": "9.84"})
    return 0.0


@pytest.mark.parametrize("tool_prompt", ["compact", "none"])
def test_a_shorter_tool_block_keeps_every_call_exact(tool_prompt, tiny_tokenizer):
    script = [
        call("convert_length", value=3, from_unit="m", to_unit="ft"),
        call("convert_temperature", value=20, from_unit="C", to_unit="F"),
        "About 9.84 ft.",
    ]
    loop = AgentEnvLoop(
        lambda: AgentProgramEnv(tiny_tokenizer, two_tool_agent, tool_prompt=tool_prompt),
        tiny_tokenizer,
        SamplingParams(max_tokens=128),
    )
    trajectory = asyncio.run(
        loop.run(ScriptedEngine(tiny_tokenizer, script), {"id": "u", "prompt": "3 m in ft?"})
    )
    assert trajectory.status is TrajectoryStatus.OK and trajectory.outcome_reward == 1.0
    steps = trajectory.steps
    assert [s.info["gateway"]["prompt"] for s in steps] == ["fresh", "extends", "extends"]
    assert [s.info["gateway"]["tool_calls"] for s in steps] == [1, 1, 0]
    assert steps[-1].metrics == {"gateway/exact_fraction": 1.0}
    for before, after in zip(steps, steps[1:], strict=False):
        assert after.prompt_ids[: len(before.prompt_ids) + len(before.response_ids)] == (
            *before.prompt_ids,
            *before.response_ids,
        )
    first = tiny_tokenizer.decode(list(steps[0].prompt_ids))
    assert "<tools>" not in first and (COMPACT in first) == (tool_prompt == "compact")
    assert first.startswith("<|im_start|>system\nYou convert units.")


# ------------------------------------------------------------------------ the call record's place


def test_a_standalone_gateway_keeps_the_record_at_info_gateway(tiny_tokenizer):
    from agent_r1.envs.gateway import engine_sampler, exact_fraction

    engine = ScriptedEngine(
        tiny_tokenizer, [call("convert_length", value=3, from_unit="m", to_unit="ft"), "9.84"]
    )

    async def main():
        import openai

        async with Gateway(tiny_tokenizer, engine_sampler(engine)) as gateway:
            session = gateway.open_session()
            client = openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
            await two_tool_agent({"prompt": "3 m in ft?"}, client)
            await client.close()
            return session.steps()

    steps = asyncio.run(main())
    assert [s.info["gateway"]["prompt"] for s in steps] == ["fresh", "extends"]
    assert steps[0].info["gateway"]["tool_calls"] == 1 and set(steps[0].info) == {"gateway"}
    assert exact_fraction(steps) == 1.0


# ------------------------------------------------------------------------------ the warm start


def test_the_documented_warm_start_of_an_agent_program(tiny_checkpoint, tmp_path):
    """docs/gateway.md's warm start: demonstrations (the text the model should write at each call)
    replayed through the agent program, behaviour cloning on them, then RL from the cloned model."""
    import random

    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from openai_agent import calculator_agent
    finally:
        sys.path.remove(str(ROOT / "examples"))
    from agent_r1.models.loading import load_tokenizer
    from agent_r1.train.config import config_from_dict
    from agent_r1.train.learner import load_policy
    from agent_r1.train.sft import SFTConfig, replay_demonstrations, sft_sequences, train_sft
    from agent_r1.train.trainer import Trainer

    rng = random.Random(0)
    tasks = []
    for i in range(8):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        tasks.append(
            {"id": f"t{i}", "prompt": f"What is {a} * {b}?", "expression": f"{a} * {b}", "answer": str(a * b)}
        )

    def demonstrate(task, rng) -> list[str]:
        call = json.dumps({"name": "calculate", "arguments": {"expression": task["expression"]}})
        return [f"<tool_call>\n{call}\n</tool_call>", task["answer"]]

    tokenizer = load_tokenizer(tiny_checkpoint)
    demos = replay_demonstrations(
        lambda: AgentProgramEnv(tokenizer, calculator_agent), tokenizer, tasks, demonstrate
    )
    assert all(d.outcome_reward == 1.0 and len(d.steps) == 2 for d in demos)  # the agent ran the tool
    sequences = sft_sequences(demos)
    assert len(sequences) == 8 and all(len(s.spans) == 2 for s in sequences)  # each episode one sequence
    config = config_from_dict(
        {
            "model": {"path": str(tiny_checkpoint)},
            "env": {"name": "agent_program", "kwargs": {"agent": "openai_agent:calculator_agent"}},
            "rollout": {"n": 2, "max_tokens": 8, "max_steps": 2},
            "trainer": {"steps": 1, "tasks_per_step": 2, "run_dir": str(tmp_path), "eval_every": 0},
            "logging": {"progress": False},
        }
    )
    model = load_policy(config.model)
    losses = train_sft(
        model, sequences, SFTConfig(epochs=8, lr=3e-3, batch_size=8), pad_token_id=tokenizer.pad_token_id
    )
    assert losses[-1] < 0.8 * losses[0]  # measured: 5.58 -> 3.75
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        Trainer(config, model=model, tokenizer=tokenizer, train_tasks=tasks).fit()
    finally:
        sys.path.remove(str(ROOT / "examples"))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward/mean" in r] == [1]
