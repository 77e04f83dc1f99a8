"""The OpenEnv adapter (env.name: openenv) against the real openenv-core: environments in OpenEnv's own
format (tests/openenv_envs.py, examples/openenv_gridwalk.py, and OpenEnv's own template made by
``openenv init``) run in-process and served by OpenEnv's server under uvicorn; chat and MCP tool mode,
invalid actions, a killed server, a hanging step, bad configuration, and one training run."""

from __future__ import annotations

import asyncio
import importlib
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from doubles import ScriptedEngine

from agent_r1.envs import check_env, make_env
from agent_r1.envs.ecosystem import MissingPackageError, require
from agent_r1.envs.ecosystem.openenv import (
    LocalServer,
    OpenEnvEnv,
    OpenEnvError,
    default_render_observation,
    text_field,
)
from agent_r1.flows import AgentEnvLoop
from agent_r1.models.tiny import build_tiny_tokenizer
from agent_r1.train.config import config_from_dict
from agent_r1.train.trainer import Trainer
from agent_r1.types import Action, SamplingParams, TrajectoryStatus, read_jsonl

TESTS = Path(__file__).resolve().parent
EXAMPLES = TESTS.parent / "examples"
TEXT_SERVER = {"app": "openenv_envs:text_app", "cwd": str(TESTS)}
GUESS_SERVER = {"app": "openenv_envs:guess_app", "cwd": str(TESTS)}
GRID_SERVER = {"app": "openenv_gridwalk:app", "cwd": str(EXAMPLES)}
GRID_TASK = {"id": "w1", "dx": 2, "dy": -1, "budget": 3}
GUESS_TASK = {"id": "g1", "prompt": "Guess my number.", "secret": 7}


@pytest.fixture(scope="module", autouse=True)
def importable_and_stopped():
    """The test envs and the example importable here too (in-process), and every server this
    module started stopped at the end."""
    sys.path[:0] = [str(TESTS), str(EXAMPLES)]
    yield
    sys.path.remove(str(TESTS))
    sys.path.remove(str(EXAMPLES))
    import openenv_envs

    openenv_envs.RELEASE.set()
    LocalServer.stop_all()


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def act(tokenizer, text: str) -> Action:
    text += tokenizer.eos_token
    return Action(text, tuple(tokenizer.encode(text, add_special_tokens=False)))


def call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def play(env, tokenizer, task, texts):
    """(first observation, every StepResult) of an episode driven by ``texts``; the env is closed."""

    async def run():
        try:
            first = await env.reset(task)
            results = []
            for text in texts:
                results.append(await env.step(act(tokenizer, text)))
                if results[-1].observation is None:
                    break
            return first, results
        finally:
            await env.close()

    return asyncio.run(run())


def text_of(tokenizer, observation) -> str:
    return tokenizer.decode(list(observation.token_ids))


# ------------------------------------------------------------------------------ the default hooks


def test_the_default_observation_text_is_its_fields_without_reward_done_and_metadata():
    from openenv_envs import TextObservation
    from openenv_gridwalk import GoalObservation

    assert default_render_observation(GoalObservation(goal="Goal 3E", reward=1.0, done=True)) == "Goal 3E"
    assert default_render_observation(TextObservation(echoed="hi", turns=2, metadata={"x": 1})) == (
        "echoed: hi\nturns: 2"
    )
    assert default_render_observation({"echoed_message": "hi", "message_length": 2}) == (
        "echoed_message: hi\nmessage_length: 2"
    )
    assert default_render_observation({"tools": [{"name": "a"}]}) == '[{"name": "a"}]'
    assert default_render_observation({}) == ""


def test_the_response_fills_the_actions_one_string_field_or_parse_action_is_asked_for():
    from openenv_gridwalk import MoveAction

    assert text_field(MoveAction.model_json_schema(), "MoveAction") == "move"  # a Literal of strings
    two = {"properties": {"a": {"type": "string"}, "b": {"type": "string"}}, "required": ["b"]}
    assert text_field(two, "Two") == "b"
    with pytest.raises(
        ValueError, match=r"OpenEnv action Num has fields \['n'\].*set env.kwargs.parse_action"
    ):
        text_field({"properties": {"n": {"type": "integer"}, "metadata": {}}}, "Num")


# ----------------------------------------------------------------------------- chat mode episodes


@pytest.mark.parametrize("where", ["in-process", "served"])
def test_a_gridwalk_episode_maps_rewards_done_and_task_fields(tokenizer, where):
    """Task fields dx, dy and budget reach reset; reward 1 and done on the goal end the episode
    (terminated, success); token ids are appended exactly."""
    source = (
        {"environment": "openenv_gridwalk:GridWalkEnvironment"}
        if where == "in-process"
        else {"server": GRID_SERVER}
    )
    env = make_env("openenv", tokenizer=tokenizer, **source)
    first, results = play(env, tokenizer, GRID_TASK, ["E", "E", "S"])
    assert text_of(tokenizer, first).endswith(
        "<|im_start|>user\nGoal 2E 1S<|im_end|>\n<|im_start|>assistant\n"
    )
    assert text_of(tokenizer, results[0].observation).endswith(
        "user\nGoal 1E 1S<|im_end|>\n<|im_start|>assistant\n"
    )
    assert [r.reward for r in results] == [0.0, 0.0, 1.0]
    assert [(r.terminated, r.truncated) for r in results] == [(False, False), (False, False), (True, False)]
    assert results[-1].observation is None and results[-1].outcome_reward is None
    assert results[-1].info == {"turn": 3, "success": True}
    assert all(r.metrics == {"invalid_actions": 0.0} for r in results)
    # Append: each prompt is the previous prompt + the response ids + the template's delta.
    e = act(tokenizer, "E").token_ids
    assert results[0].observation.token_ids[: len(first.token_ids) + len(e)] == (*first.token_ids, *e)


def test_running_out_of_moves_is_done_with_reward_zero_and_no_success(tokenizer):
    env = make_env("openenv", tokenizer=tokenizer, environment="openenv_gridwalk:GridWalkEnvironment")
    _, results = play(env, tokenizer, GRID_TASK, ["W", "W", "W"])
    assert [r.reward for r in results] == [0.0, 0.0, 0.0]
    assert results[-1].terminated and results[-1].info["success"] is False


@pytest.mark.parametrize("where", ["in-process", "served"])
def test_an_invalid_action_is_an_observation_that_says_what_is_wrong(tokenizer, where):
    source = (
        {"environment": "openenv_gridwalk:GridWalkEnvironment"}
        if where == "in-process"
        else {"server": GRID_SERVER}
    )
    env = make_env("openenv", tokenizer=tokenizer, **source)
    _, results = play(env, tokenizer, GRID_TASK, ["north", "E"])
    invalid, after = results
    shown = text_of(tokenizer, invalid.observation)
    if where == "in-process":  # validated here against the Action class
        assert "Invalid action: move: Input should be 'E', 'W', 'N' or 'S'" in shown
    else:  # the server says only "Invalid message"; the fields come from its /schema
        assert (
            'Invalid action: the environment\'s server rejected {"move": "north"} (VALIDATION_ERROR)' in shown
        )
        assert '"enum": ["E", "W", "N", "S"]' in shown
    assert invalid.metrics == {"invalid_actions": 1.0} and invalid.reward == 0.0 and not invalid.terminated
    assert invalid.info["invalid_action"].startswith("Invalid action: ")
    # The environment never saw it: the next move still starts from the goal 2E 1S.
    assert text_of(tokenizer, after.observation).endswith(
        "user\nGoal 1E 1S<|im_end|>\n<|im_start|>assistant\n"
    )


def test_max_turns_truncates_and_hooks_and_prompts_apply(tokenizer):
    env = make_env(
        "openenv",
        tokenizer=tokenizer,
        environment="openenv_envs:TextEnvironment",
        render_observation=lambda obs: f"<{obs.echoed}>",
        parse_action=lambda text: {"message": text.upper()},
        system_prompt="Talk.",
        max_turns=2,
        success_threshold=None,
    )
    first, results = play(env, tokenizer, {"id": 5, "prompt": "Begin.", "greeting": "hello"}, ["a", "b", "c"])
    assert (
        "system\nTalk.<|im_end|>\n<|im_start|>user\nBegin.<|im_end|>\n<|im_start|>user\n<hello (episode 5)>"
        in (text_of(tokenizer, first))
    )
    assert "user\n<A><|im_end|>" in text_of(tokenizer, results[0].observation)
    assert [r.reward for r in results] == [0.25, 0.25]
    assert results[-1].truncated and not results[-1].terminated
    assert results[-1].info == {"turn": 2, "truncated": "max_turns=2 reached"}  # no success key


def test_the_env_passes_check_env_in_both_modes(tokenizer):
    check_env(
        lambda: make_env("openenv", tokenizer=tokenizer, environment="openenv_gridwalk:GridWalkEnvironment"),
        GRID_TASK,
        actions=["E", "bad", "E", "S"],
        tokenizer=tokenizer,
    )
    check_env(
        lambda: make_env("openenv", tokenizer=tokenizer, server=GUESS_SERVER),
        GUESS_TASK,
        actions=[call("guess", number=3), call("guess", number=7)],
        tokenizer=tokenizer,
    )


# ------------------------------------------------------------------------------------ tool mode


@pytest.mark.parametrize("where", ["in-process", "served"])
def test_an_mcp_environments_tools_become_tools_the_model_calls(tokenizer, where):
    source = (
        {"environment": "openenv_envs:GuessEnvironment"}
        if where == "in-process"
        else {"server": GUESS_SERVER}
    )
    env = make_env("openenv", tokenizer=tokenizer, **source)
    first, results = play(
        env,
        tokenizer,
        GUESS_TASK,
        [
            call("guess", number=5),
            call("guess", numbr=5),
            "<tool_call>{oops</tool_call>",
            call("guess", number=7),
        ],
    )
    prompt = text_of(tokenizer, first)
    assert '"name": "guess"' in prompt and '"number": {"type": "integer"' in prompt  # listed for the model
    assert prompt.endswith("user\nGuess my number.<|im_end|>\n<|im_start|>assistant\n")
    assert [r.info["tool_results"] for r in results[:2]] == [
        ["higher"],
        ["Error: tool 'guess' got unknown argument 'numbr'; its arguments are: number"],
    ]
    assert "<tool_response>\nhigher\n</tool_response>" in text_of(tokenizer, results[0].observation)
    assert [r.metrics["invalid_actions"] for r in results] == [0.0, 1.0, 1.0, 0.0]
    assert [r.reward for r in results] == [0.0, 0.0, 0.0, 1.0]
    last = results[-1]
    assert last.terminated and last.observation is None and last.outcome_reward is None
    assert last.info["success"] is True and last.info["tool_results"] == ["correct"]


def test_a_final_answer_without_a_call_ends_the_episode_unsolved(tokenizer):
    env = make_env("openenv", tokenizer=tokenizer, environment="openenv_envs:GuessEnvironment")
    _, results = play(env, tokenizer, GUESS_TASK, ["I give up."])
    (last,) = results
    assert last.terminated and last.reward == 0.0 and last.outcome_reward is None
    assert last.info["success"] is False


# ------------------------------------------------------------------------- failures end the episode


def test_a_killed_server_ends_the_trajectory_with_an_error_and_the_next_one_restarts_it(tokenizer):
    server_options = {**TEXT_SERVER, "env": {"KILL_TEST": "1"}}  # a server of this test's own

    async def run():
        env = make_env("openenv", tokenizer=tokenizer, server=server_options)
        await env.reset({"id": "k"})
        assert (await env.step(act(tokenizer, "one"))).reward == 0.25
        server = env.session.server
        server.process.kill()
        with pytest.raises(OpenEnvError, match=r"step failed: ConnectionClosedError.*exited with code -9"):
            await env.step(act(tokenizer, "two"))
        await env.close()
        again = make_env("openenv", tokenizer=tokenizer, server=server_options)
        await again.reset({"id": "k2"})
        assert again.session.server is not server and again.session.server.alive
        assert (await again.step(act(tokenizer, "stop"))).terminated
        await again.close()

    asyncio.run(run())


def test_through_the_flow_a_dead_server_is_an_error_trajectory_not_a_stuck_rollout(tokenizer):
    options = {**TEXT_SERVER, "env": {"FLOW_TEST": "1"}}

    def script(prompt: str) -> str:
        if prompt.count("<|im_start|>assistant") == 2:  # the second turn: kill the server first
            LocalServer.shared(options["app"], cwd=options["cwd"], env=options["env"]).process.kill()
        return "hello"

    flow = AgentEnvLoop(
        lambda: make_env("openenv", tokenizer=tokenizer, server=options),
        tokenizer,
        SamplingParams(max_tokens=16),
        max_steps=4,
    )
    trajectory = asyncio.run(flow.run(ScriptedEngine(tokenizer, script), {"id": "f"}))
    assert trajectory.status is TrajectoryStatus.ERROR
    assert "OpenEnvError" in trajectory.error and "exited with code -9" in trajectory.error
    # the step before the kill is kept, and so is the action whose env.step failed: shown in the dump,
    # marked env_error (an ERROR trajectory is never trained)
    assert len(trajectory.steps) == 2 and trajectory.steps[-1].info == {"env_error": True}


def test_a_server_does_not_outlive_a_killed_trainer():
    """SIGKILL skips atexit: the server notices its parent is gone and exits by itself."""
    script = (
        f"import os, sys; sys.path[:0] = [{str(TESTS.parent)!r}, {str(TESTS)!r}]\n"
        "from agent_r1.envs.ecosystem.openenv import LocalServer\n"
        f"server = LocalServer.shared('openenv_envs:text_app', cwd={str(TESTS)!r})\n"
        "print(server.process.pid, flush=True)\n"
        "os.kill(os.getpid(), 9)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    pid = int(done.stdout.split()[0])

    def running() -> bool:
        try:
            return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] != "Z"
        except (FileNotFoundError, IndexError):
            return False

    for _ in range(60):  # the server polls its parent every second
        if not running():
            break
        time.sleep(0.5)
    assert not running()


@pytest.mark.parametrize("where", ["in-process", "served"])
def test_a_step_that_hangs_times_out_with_an_error(tokenizer, where):
    source = (
        {"environment": "openenv_envs:TextEnvironment"}
        if where == "in-process"
        else {"server": {**TEXT_SERVER, "env": {"HANG_TEST": "1"}}}
    )
    env = make_env("openenv", tokenizer=tokenizer, timeout_s=1.5, **source)
    expected = (
        "step did not return within timeout_s=1.5s"
        if where == "in-process"
        else ("no answer to step within timeout_s=1.5s; the server process .* still running")
    )
    with pytest.raises(OpenEnvError, match=expected):
        play(env, tokenizer, {"id": "h"}, ["sleep"])
    if where == "served":
        LocalServer.shared(TEXT_SERVER["app"], cwd=TEXT_SERVER["cwd"], env={"HANG_TEST": "1"}).stop()


@pytest.mark.parametrize("where", ["in-process", "served"])
def test_an_environment_that_raises_is_an_error_naming_it(tokenizer, where):
    source = (
        {"environment": "openenv_envs:TextEnvironment"} if where == "in-process" else {"server": TEXT_SERVER}
    )
    env = make_env("openenv", tokenizer=tokenizer, **source)
    expected = (
        "step raised RuntimeError: boom"
        if where == "in-process"
        else "step failed: RuntimeError: Server error: boom"
    )
    with pytest.raises(OpenEnvError, match=expected):
        play(env, tokenizer, {"id": "c"}, ["crash"])


def test_a_full_server_makes_the_next_session_wait_until_one_closes(tokenizer, tmp_path, monkeypatch):
    """OpenEnv's template serves one session at a time (max_concurrent_envs=1): a second episode
    waits for the first to close instead of failing."""
    template = openenv_template(tmp_path, monkeypatch)

    async def run():
        first = make_env("openenv", tokenizer=tokenizer, server=template, max_turns=3)
        second = make_env("openenv", tokenizer=tokenizer, server=template, max_turns=3)
        await first.reset({"id": "a"})
        waiting = asyncio.ensure_future(second.reset({"id": "b"}))
        await asyncio.sleep(1.0)
        assert not waiting.done()
        await first.close()
        observation = await asyncio.wait_for(waiting, 30)
        assert "Echo Game environment ready!" in text_of(tokenizer, observation)
        await second.close()

    asyncio.run(run())


def openenv_template(tmp_path, monkeypatch) -> dict:
    """OpenEnv's own echo template, made by ``openenv init`` (offline), as a ``server`` option."""
    done = subprocess.run(
        [sys.executable, "-m", "openenv.cli", "init", "echo_game", "--output-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (tmp_path / "echo_game" / "server" / "app.py").is_file(), done.stdout + done.stderr
    monkeypatch.syspath_prepend(str(tmp_path))  # its client and models, for this process
    return {"app": "echo_game.server.app:app", "cwd": str(tmp_path)}


# ------------------------------------------------------------------------------------- bad input


def test_a_missing_openenv_is_one_error_naming_the_extra(monkeypatch):
    real_import = importlib.import_module

    def without_openenv(name, *args):
        if name.startswith("openenv"):
            raise ModuleNotFoundError(f"No module named {name!r}", name="openenv")
        return real_import(name, *args)

    monkeypatch.setattr(importlib, "import_module", without_openenv)
    with pytest.raises(
        MissingPackageError, match=r"needs the 'openenv' package: pip install 'agent-r1\[openenv\]'"
    ):
        require("openenv.core", "openenv", "the OpenEnv adapter")


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({}, ValueError, r"exactly one of environment .*got none"),
        (
            {"environment": "openenv_envs:TextEnvironment", "base_url": "http://x"},
            ValueError,
            r"got \['environment', 'base_url'\]",
        ),
        (
            {"environment": "openenv_envs:NoSuchEnvironment"},
            ValueError,
            r"no attribute 'NoSuchEnvironment'; OpenEnv Environments in 'openenv_envs': "
            r"\['openenv_envs:GuessEnvironment', 'openenv_envs:TextEnvironment'\]",
        ),
        ({"environment": "openenv_envs:TextAction"}, TypeError, "is not an OpenEnv Environment subclass"),
        (
            {"server": {"app": "a:b", "port": 1}},
            ValueError,
            r"server: keys are \['app', 'cwd', 'env', 'startup_timeout_s'\]",
        ),
        ({"server": {"cwd": "."}}, ValueError, r"'app' required"),
        (
            {"base_url": "http://x", "client": "openenv_envs:TextAction"},
            TypeError,
            "not an OpenEnv EnvClient",
        ),
        (
            {"environment": "openenv_envs:TextEnvironment", "max_turns": 0},
            ValueError,
            "max_turns must be >= 1",
        ),
        (
            {"environment": "openenv_envs:TextEnvironment", "timeout_s": 0},
            ValueError,
            "timeout_s must be > 0",
        ),
        (
            {"environment": "openenv_envs:TextEnvironment", "context": "nope"},
            ValueError,
            "unknown context policy 'nope'",
        ),
        (
            {"base_url": "http://x", "environment_kwargs": {"a": 1}},
            ValueError,
            "environment_kwargs apply to an in-process",
        ),
    ],
)
def test_bad_configuration_is_one_clear_error(tokenizer, kwargs, error, message):
    with pytest.raises(error, match=message):
        OpenEnvEnv(tokenizer, **kwargs)


def test_an_unknown_option_is_refused_by_name_through_a_training_config(tokenizer):
    from agent_r1.train.builders import env_factory
    from agent_r1.train.config import ConfigError

    config = config_from_dict(
        {"env": {"name": "openenv", "kwargs": {"environment": "openenv_envs:TextEnvironment", "colour": 1}}}
    )
    with pytest.raises(ConfigError, match=r"env.kwargs.*unexpected keyword argument 'colour'"):
        env_factory(config, tokenizer)()


def test_an_app_that_does_not_exist_fails_to_start_with_uvicorns_words(tokenizer):
    env = make_env("openenv", tokenizer=tokenizer, server={"app": "openenv_envs:no_app", "cwd": str(TESTS)})
    with pytest.raises(
        OpenEnvError, match=r"(?s)did not start.*exited with code 3.*Attribute \"no_app\" not found"
    ):
        play(env, tokenizer, {"id": "x"}, [])


def test_a_server_that_is_not_there_is_an_error_not_a_hang(tokenizer):
    env = make_env("openenv", tokenizer=tokenizer, base_url="http://127.0.0.1:9", timeout_s=5, tools=False)
    with pytest.raises(
        OpenEnvError, match=r"OpenEnv server http://127.0.0.1:9: reset failed: ConnectionError"
    ):
        play(env, tokenizer, {"id": "x"}, [])


def test_a_server_that_is_not_there_is_named_by_the_request_tried_not_as_an_mcp_probe(tokenizer):
    # tools: None (the default) asks the server first whether it serves MCP tools; a server that is
    # not there fails at the first request, which says so without talking of MCP.
    env = make_env("openenv", tokenizer=tokenizer, base_url="http://127.0.0.1:9", timeout_s=5)
    with pytest.raises(OpenEnvError) as failure:
        play(env, tokenizer, {"id": "x"}, [])
    message = str(failure.value)
    assert message.startswith("OpenEnv server http://127.0.0.1:9: opening a session failed: ")
    assert "GET http://127.0.0.1:9/health: cannot connect" in message
    assert "mcp" not in message.lower()


def test_an_in_process_environment_without_an_action_class_asks_for_one(tokenizer):
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import State
    from openenv_envs import TextObservation

    class Untyped(Environment):  # no Environment[...] parameters, step(action) unannotated
        def reset(self, **kwargs):
            return TextObservation(echoed="hi")

        def step(self, action, timeout_s=None, **kwargs):
            return TextObservation(echoed=action.message, reward=1.0, done=True)

        @property
        def state(self):
            return State()

    env = OpenEnvEnv(tokenizer, environment=Untyped)
    with pytest.raises(
        OpenEnvError, match=r"Untyped declares no Action class .* give action: 'module:Class'"
    ):
        play(env, tokenizer, {"id": "x"}, ["a"])
    typed = OpenEnvEnv(tokenizer, environment=Untyped, action="openenv_envs:TextAction")
    _, (result,) = play(typed, tokenizer, {"id": "x"}, ["stop"])
    assert result.terminated and result.reward == 1.0


# ------------------------------------------------------------------------ training end to end


@pytest.mark.slow
def test_training_openenvs_own_template_served_by_its_own_server(tiny_checkpoint, tmp_path, monkeypatch):
    """OpenEnv's echo template (``openenv init``; reward 0.1 x the message's length each step, never
    done), served by its ``server.app`` under uvicorn, reached through its generated typed client,
    trained by the real Trainer for two steps."""
    template = openenv_template(tmp_path, monkeypatch)
    run_dir = tmp_path / "run"
    config = config_from_dict(
        {
            "model": {"path": str(tiny_checkpoint)},
            "env": {
                "name": "openenv",
                "kwargs": {"server": template, "client": "echo_game.client:EchoGameEnv", "max_turns": 2},
            },
            "rollout": {"n": 2, "max_tokens": 6, "max_steps": 4},
            "trainer": {
                "steps": 2,
                "tasks_per_step": 2,
                "lr": 1e-3,
                "run_dir": str(run_dir),
                "torch_threads": 1,
            },
            "logging": {"progress": False, "tensorboard": False, "report": False, "dump_trajectories": True},
        }
    )
    tasks = [{"id": f"t{i}", "prompt": "Say something long."} for i in range(4)]
    trainer = Trainer(config, train_tasks=tasks)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.fit()
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in train_rows] == [1, 2]
    assert all(r["env/invalid_actions"] == 0.0 for r in train_rows)
    trajectories = list(read_jsonl(run_dir / "trajectories" / "step_000001.jsonl"))
    assert len(trajectories) == 4 and all(t.status is TrajectoryStatus.OK for t in trajectories)
    eos = trainer.tokenizer.eos_token
    for trajectory in trajectories:
        assert len(trajectory.steps) == 2 and trajectory.steps[-1].truncated  # never done: max_turns
        for step in trajectory.steps:  # the server's reward, kept as the step's immediate reward
            assert step.reward == len(step.response_text.removesuffix(eos)) * 0.1
            assert step.metrics == {"invalid_actions": 0.0}
        assert trajectory.outcome_reward == 0.0 and trajectory.info["success"] is False
    trainer.close()


@pytest.mark.slow
def test_the_benchmark_arm_runs_quick():
    sys.path.insert(0, str(TESTS.parent / "benchmarks"))
    try:
        import eco_openenv
    finally:
        sys.path.remove(str(TESTS.parent / "benchmarks"))
    result = eco_openenv.run(seed=0, quick=True)
    assert {"env", "metric", "before", "after", "tasks", "rl_steps", "seconds"} <= set(result)
    assert result["tasks"] == 24 and result["rl_steps"] == 2
    assert 0.0 <= result["before"] <= 1.0 and 0.0 <= result["after"] <= 1.0
    assert result["demonstrator_success"] == 1.0  # always toward the goal, replayed through the server
