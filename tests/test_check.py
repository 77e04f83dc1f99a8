"""``agent-r1 check`` (``agent_r1.train.preflight``), issue 52: each mistake a new user made is found
without the weights, printed once, exit 2, naming the key, the file and the row; ``train`` and
``eval`` run the same checks first. Issue 65: every problem one run can find is listed at once, the
engine's keyword arguments are checked, and what async needs is chosen and said. Most cases call the real CLI in this process (``cli.main``);
the model-path cases run it as a subprocess (offline Hub behaviour, the working directory)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from agent_r1.cli import main

pytest.importorskip("gymnasium")
pytest.importorskip("textarena")

FROZEN_LAKE = {"name": "gymnasium", "kwargs": {"id": "FrozenLake-v1", "make_kwargs": {"is_slippery": False}}}


def write_config(folder: Path, model: str, env: dict, rows: list[dict], **data) -> Path:
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = {
        "model": {"path": model, "device": "cpu"},
        "data": {"train": str(folder / "train.jsonl"), **data},
        "env": env,
        "trainer": {"run_dir": str(folder / "run")},
    }
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def refused(capsys, command: str, config: Path, *overrides: str) -> str:
    """Run ``agent-r1 COMMAND config`` in this process; assert exit 2 and one printed error."""
    code = main([command, str(config), *overrides])
    out = capsys.readouterr()
    printed = out.out + out.err
    assert code == 2, printed
    assert printed.count(f"agent-r1 {command}:") == 1, printed
    return printed


def test_check_passes_on_a_real_config_and_says_what_it_checked(tiny_checkpoint, tmp_path):
    config = write_config(tmp_path, str(tiny_checkpoint), FROZEN_LAKE, [{"id": "a", "seed": 0}])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "agent_r1.cli", "check", str(config)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "data.train: 1 rows, fields checked" in done.stdout
    assert "env 'gymnasium': built and reset on data.train row 0" in done.stdout
    assert done.stdout.strip().endswith("passed")


def test_a_wrong_gymnasium_id(tiny_checkpoint, tmp_path, capsys):
    env = {"name": "gymnasium", "kwargs": {"id": "FrozenLak-v1"}}
    config = write_config(tmp_path, str(tiny_checkpoint), env, [{"id": "a"}])
    printed = refused(capsys, "check", config)
    assert "config key 'env.kwargs.id': unknown Gymnasium id 'FrozenLak-v1'" in printed


def test_a_hook_module_that_does_not_exist(tiny_checkpoint, tmp_path, capsys):
    env = {"name": "gymnasium", "kwargs": {"id": "FrozenLake-v1", "hook": "no_such_hooks:Text"}}
    config = write_config(tmp_path, str(tiny_checkpoint), env, [{"id": "a"}])
    printed = refused(capsys, "train", config)  # train runs the check before anything loads
    assert "config key 'env.kwargs.hook': entry point 'no_such_hooks:Text': cannot import" in printed


def test_a_hook_that_raises_in_render(tiny_checkpoint, tmp_path, capsys):
    (tmp_path / "raising_hook_52.py").write_text(
        "class Text:\n"
        "    def render(self, observation, info, env):\n"
        "        raise RuntimeError('render is broken')\n"
        "    def parse(self, text, env):\n"
        "        return 0\n"
    )
    env = {"name": "gymnasium", "kwargs": {"id": "FrozenLake-v1", "hook": "raising_hook_52:Text"}}
    config = write_config(tmp_path, str(tiny_checkpoint), env, [{"id": "a", "seed": 1}])
    printed = refused(capsys, "check", config)
    assert f"data.train: {tmp_path / 'train.jsonl'}: row 0 (id 'a'): env 'gymnasium'" in printed
    assert "RuntimeError: render is broken" in printed


def test_eval_checks_the_validation_rows_before_the_weights_load(tiny_checkpoint, tmp_path, capsys):
    (tmp_path / "val.jsonl").write_text(json.dumps({"id": "v", "sead": 1}) + "\n")
    config = write_config(
        tmp_path, str(tiny_checkpoint), FROZEN_LAKE, [{"id": "a"}], val=str(tmp_path / "val.jsonl")
    )
    printed = refused(capsys, "eval", config)
    assert f"data.val: {tmp_path / 'val.jsonl'}: row 0 (id 'v'): unknown field(s) 'sead'" in printed


def test_an_unknown_textarena_game(tiny_checkpoint, tmp_path, capsys):
    env = {"name": "textarena", "kwargs": {"game": "TicTacTo-v0"}}
    config = write_config(tmp_path, str(tiny_checkpoint), env, [{"id": "a", "seed": 0}])
    printed = refused(capsys, "check", config)
    assert "config key 'env.kwargs.game': unknown TextArena game 'TicTacTo-v0'" in printed


def test_an_unknown_textarena_game_in_a_row(tiny_checkpoint, tmp_path, capsys):
    env = {"name": "textarena", "kwargs": {}}
    config = write_config(tmp_path, str(tiny_checkpoint), env, [{"id": "a", "game": "Chesss-v0"}])
    printed = refused(capsys, "check", config)
    assert "row 0 (id 'a')" in printed and "unknown TextArena game 'Chesss-v0'" in printed


def test_a_seat_the_game_lacks(tiny_checkpoint, tmp_path, capsys):
    env = {"name": "textarena", "kwargs": {"game": "TicTacToe-v0"}}
    config = write_config(tmp_path, str(tiny_checkpoint), env, [{"id": "a", "seed": 0, "seat": 2}])
    printed = refused(capsys, "check", config)
    assert f"data.train: {tmp_path / 'train.jsonl'}: row 0 (id 'a')" in printed
    assert "seat 2 does not exist in TicTacToe-v0 with 2 player(s)" in printed


def test_a_misspelt_textarena_row_field(tiny_checkpoint, tmp_path, capsys):
    """Before: ``"seet": 1`` played seat 0 silently. Every row is read, not only the first."""
    env = {"name": "textarena", "kwargs": {"game": "TicTacToe-v0"}}
    rows = [{"id": "a", "seed": 0, "seat": 1}, {"id": "b", "seed": 0, "seet": 1}]
    config = write_config(tmp_path, str(tiny_checkpoint), env, rows)
    printed = refused(capsys, "check", config)
    assert f"data.train: {tmp_path / 'train.jsonl'}: row 1 (id 'b'): unknown field(s) 'seet'" in printed
    assert "'seet' (did you mean 'seed' or 'seat'?)" in printed


def test_textarena_reset_refuses_an_unknown_row_field(tiny_tokenizer):
    from agent_r1.envs.ecosystem.textarena import TextArenaEnv

    env = TextArenaEnv(tiny_tokenizer, game="TicTacToe-v0")
    with pytest.raises(
        ValueError, match=r"task a: unknown field\(s\) 'seet' \(did you mean 'seed' or 'seat'\?\)"
    ):
        run(env.reset({"id": "a", "seed": 0, "seet": 1}))


def test_a_rows_num_players_is_the_games_player_count(tiny_tokenizer):
    """Before: a row's ``num_players`` was ignored (the game was probed for 2 players)."""
    from agent_r1.envs.ecosystem.textarena import TextArenaEnv

    env = TextArenaEnv(tiny_tokenizer, game="TicTacToe-v0")
    with pytest.raises(ValueError, match="TicTacToe-v0 refuses num_players 3"):
        run(env.reset({"id": "a", "seed": 0, "num_players": 3}))
    with pytest.raises(ValueError, match="'num_players' must be an integer >= 1, got 0"):
        run(env.reset({"id": "a", "seed": 0, "num_players": 0}))
    run(env.reset({"id": "a", "seed": 0, "num_players": 2}))
    assert env.episode["num_players"] == 2


def test_opponent_self_in_a_single_player_game(tiny_checkpoint, tmp_path, capsys):
    """Before: accepted, and the episode said ``opponent: random``."""
    env = {"name": "textarena", "kwargs": {"game": "GuessTheNumber-v0", "opponent": "self"}}
    config = write_config(tmp_path, str(tiny_checkpoint), env, [{"id": "a", "seed": 0}])
    printed = refused(capsys, "check", config)
    assert "row 0 (id 'a')" in printed
    assert "GuessTheNumber-v0 is a single-player game, so there is no seat for opponent 'self'" in printed


def test_a_single_player_episode_names_no_opponent(tiny_tokenizer):
    from agent_r1.envs.ecosystem.textarena import TextArenaEnv

    env = TextArenaEnv(tiny_tokenizer, game="GuessTheNumber-v0")
    run(env.reset({"id": "a", "seed": 0}))
    assert env.episode["opponent"] is None and env.episode["num_players"] == 1


def test_a_missing_data_file(tiny_checkpoint, tmp_path, capsys):
    config = write_config(tmp_path, str(tiny_checkpoint), FROZEN_LAKE, [{"id": "a"}])
    printed = refused(capsys, "check", config, f"data.train={tmp_path / 'nope.jsonl'}")
    assert f"data.train: {tmp_path / 'nope.jsonl'}: no such file" in printed


@pytest.mark.parametrize(
    ("env", "key"),
    [
        ({"name": "agent_program", "kwargs": {"agent": "no_such_agents:solve"}}, "env.kwargs.agent"),
        (
            {"name": "trl_environment", "kwargs": {"environment": "no_such_envs:Calc"}},
            "env.kwargs.environment",
        ),
        ({"name": "no_such_tools:make_env", "kwargs": {}}, "env.name"),
        ({"name": "textarena", "kwargs": {"opponent": "no_such_players:move"}}, "env.kwargs.opponent"),
    ],
)
def test_a_bad_import_path(tiny_checkpoint, tmp_path, capsys, env, key):
    config = write_config(tmp_path, str(tiny_checkpoint), env, [{"id": "a"}])
    printed = refused(capsys, "check", config)
    assert f"config key '{key}'" in printed and "cannot import module" in printed


def test_a_trl_reward_path_that_does_not_import(tiny_checkpoint, tmp_path, capsys):
    env = {
        "name": "trl_environment",
        "kwargs": {"environment": "agent_r1.envs:AgentEnv", "reward": ["no_such_rewards:f"]},
    }
    config = write_config(tmp_path, str(tiny_checkpoint), env, [{"id": "a"}])
    printed = refused(capsys, "check", config)
    assert "config key 'env.kwargs.reward': entry point 'no_such_rewards:f'" in printed


# ---------------------------------------------------------- every problem at once (issue 65, "Ask once")


def test_check_lists_every_error_of_the_config(tiny_checkpoint, tmp_path, capsys):
    config = write_config(tmp_path, str(tiny_checkpoint), FROZEN_LAKE, [{"id": "a"}])
    printed = refused(capsys, "check", config, "trainer.stepz=1", "model.dtype=float16")
    lines = printed.splitlines()
    assert lines[0] == "agent-r1 check: 2 configuration errors:"
    assert lines[1].startswith("  config key 'trainer.stepz': unknown key (did you mean 'steps'?)")
    assert lines[2].startswith("  config key 'model.dtype': must be one of")


def test_check_goes_on_past_an_independent_failure(tiny_checkpoint, tmp_path, capsys):
    """A wrong env.name and a missing data file: both reported by one run, one per line."""
    env = {"name": "no_such_tools:make_env", "kwargs": {}}
    config = write_config(tmp_path, str(tiny_checkpoint), env, [{"id": "a"}])
    printed = refused(capsys, "check", config, f"data.train={tmp_path / 'nope.jsonl'}")
    lines = printed.splitlines()
    assert lines[0] == "agent-r1 check: 2 problems found without the weights:"
    assert lines[1].startswith("  config key 'env.name'") and "cannot import module" in lines[1]
    assert lines[2] == f"  data.train: {tmp_path / 'nope.jsonl'}: no such file"


def test_preflight_failures_that_are_all_config_errors_stay_one_config_error(tiny_checkpoint, tmp_path):
    from agent_r1.train.config import ConfigErrors, load_config
    from agent_r1.train.preflight import preflight

    env = {"name": "no_such_tools:make_env", "kwargs": {}}
    path = write_config(tmp_path, str(tiny_checkpoint), env, [{"id": "a"}])
    with pytest.raises(ConfigErrors) as error:
        preflight(load_config(path, ["rollout.engine_kwargs={gpu_memory_utilization: 0.6}"]))
    assert [e.key for e in error.value.errors] == ["rollout.engine_kwargs.gpu_memory_utilization", "env.name"]


# the report: a recipe switched to the HF engine on a CPU, its vLLM engine_kwargs left in
HF_WITH_VLLM_KWARGS = ("rollout.engine=hf", "rollout.engine_kwargs={gpu_memory_utilization: 0.6}")


@pytest.mark.parametrize("command", ["check", "eval"])
def test_an_engine_kwarg_the_engine_does_not_take(tiny_checkpoint, tmp_path, capsys, command):
    """Before: check passed and eval died with a raw ``TypeError: HFEngine.__init__() got an
    unexpected keyword argument 'gpu_memory_utilization'``."""
    rows = [{"id": "a", "seed": 0}]
    config = write_config(
        tmp_path, str(tiny_checkpoint), FROZEN_LAKE, rows, val=str(tmp_path / "train.jsonl")
    )
    printed = refused(capsys, command, config, *HF_WITH_VLLM_KWARGS)
    assert (
        f"agent-r1 {command}: config key 'rollout.engine_kwargs.gpu_memory_utilization': not an argument "
        "of rollout.engine 'hf', which takes ['batch_invariant', 'cascade_attention', 'eos_token_ids', "
        "'max_context', 'narrow_attention', 'narrow_head', 'packed_linears', 'prefix_cache_entries']"
    ) in printed
    assert "Traceback" not in printed and "TypeError" not in printed


def test_the_engine_is_never_built_with_an_argument_it_does_not_take(tiny_checkpoint):
    """The Python API too: rollout_engine checks before it loads anything."""
    from agent_r1.train.builders import rollout_engine
    from agent_r1.train.config import ConfigError, config_from_dict

    config = config_from_dict(
        {"model": {"path": str(tiny_checkpoint)}, "rollout": {"engine_kwargs": {"prefix_cache_entrie": 0}}}
    )
    with pytest.raises(ConfigError, match="did you mean 'prefix_cache_entries'") as error:
        rollout_engine(config, None)
    assert error.value.key == "rollout.engine_kwargs.prefix_cache_entrie"


def test_engine_kwargs_that_agent_r1_fills_in_name_their_own_key():
    from agent_r1.train.builders import check_engine_kwargs
    from agent_r1.train.config import ConfigErrors, config_from_dict

    config = config_from_dict({"rollout": {"engine_kwargs": {"dtype": "bfloat16", "max_batch_size": 4}}})
    with pytest.raises(ConfigErrors) as error:
        check_engine_kwargs(config)
    assert [e.key for e in error.value.errors] == [
        "rollout.engine_kwargs.dtype",
        "rollout.engine_kwargs.max_batch_size",
    ]
    assert "from model.dtype" in str(error.value) and "from rollout.max_batch_size" in str(error.value)
    fine = config_from_dict({"rollout": {"engine_kwargs": {"prefix_cache_entries": 0}}})
    assert (
        check_engine_kwargs(fine)
        == "rollout.engine_kwargs ['prefix_cache_entries']: arguments of rollout.engine 'hf'"
    )


def test_vllm_engine_kwargs_are_checked_where_vllm_is_installed(monkeypatch):
    from agent_r1.rollout import factory
    from agent_r1.train.builders import check_engine_kwargs
    from agent_r1.train.config import ConfigError, config_from_dict

    if factory.engine_problem("vllm") is None:  # the real arguments, in the vLLM environment
        assert {"gpu_memory_utilization", "max_model_len", "enable_sleep_mode"} <= factory.engine_arguments(
            "vllm"
        )
    else:
        assert factory.engine_arguments("vllm") is None
    kwargs = {"gpu_memory_utilization": 0.6, "max_model_lenn": 8192}
    config = config_from_dict({"rollout": {"engine": "vllm", "engine_kwargs": kwargs}})
    monkeypatch.setattr(factory, "engine_arguments", lambda kind: None)
    assert check_engine_kwargs(config) == (
        "rollout.engine_kwargs ['gpu_memory_utilization', 'max_model_lenn']: not checked, vLLM not installed here"
    )
    known = frozenset({"gpu_memory_utilization", "max_model_len", "seed"})
    monkeypatch.setattr(factory, "engine_arguments", lambda kind: known)
    with pytest.raises(ConfigError, match="did you mean 'max_model_len'") as error:
        check_engine_kwargs(config)
    assert error.value.key == "rollout.engine_kwargs.max_model_lenn" and "vllm.EngineArgs" in str(error.value)


def test_check_says_what_async_chose(tiny_checkpoint, tmp_path, capsys):
    config = write_config(tmp_path, str(tiny_checkpoint), FROZEN_LAKE, [{"id": "a", "seed": 0}])
    assert main(["check", str(config), "trainer.mode=async"]) == 0
    chose = [line for line in capsys.readouterr().out.splitlines() if line.startswith("ok  chose ")]
    assert [line.split(" (")[0] for line in chose] == [
        "ok  chose rollout.share_model: false",
        "ok  chose algorithm.off_policy: tis",
    ]


def test_train_says_what_async_chose_once(tiny_checkpoint, tmp_path, capsys):
    """Said at the start, before the checks (here a missing data file stops the run)."""
    config = write_config(tmp_path, str(tiny_checkpoint), FROZEN_LAKE, [{"id": "a"}])
    code = main(["train", str(config), "trainer.mode=async", f"data.train={tmp_path / 'nope.jsonl'}"])
    out = capsys.readouterr().out
    assert code == 2, out
    assert out.count("agent-r1 train: chose rollout.share_model: false") == 1
    assert out.count("agent-r1 train: chose algorithm.off_policy: tis") == 1
    assert out.splitlines()[-1] == f"agent-r1 train: data.train: {tmp_path / 'nope.jsonl'}: no such file"


# ------------------------------------------------------------------------------------- model.path


def cli(*args: str, cwd: Path, offline: bool = False) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1])}
    env.pop("HF_HUB_OFFLINE", None)  # the no-network case is the Hub unreachable, not offline mode
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "agent_r1.cli", *args], cwd=cwd, env=env, capture_output=True, text=True
    )
    return done, time.monotonic() - start


def test_a_relative_model_path_is_found_beside_the_config(tiny_checkpoint, tmp_path):
    """Before: resolved against the working directory only, then a minute of Hub retries offline."""
    import shutil

    project = tmp_path / "project"
    project.mkdir()
    shutil.copytree(tiny_checkpoint, project / "model")
    config = write_config(project, "model", FROZEN_LAKE, [{"id": "a"}])
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done, _ = cli("check", str(config), cwd=elsewhere, offline=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"model.path '{project / 'model'}': tokenizer and chat template loaded" in done.stdout


@pytest.mark.parametrize("value", ["./models/missing", "models/missing"])
def test_a_model_folder_found_nowhere_fails_at_once(tmp_path, value):
    """A path that is no Hub name fails without the Hub; one that could be a Hub name fails at once
    when the Hub is out of reach (no network here) and the cache lacks it."""
    config = write_config(tmp_path, value, FROZEN_LAKE, [{"id": "a"}])
    done, seconds = cli("check", str(config), cwd=tmp_path)
    printed = done.stdout + done.stderr
    assert done.returncode == 2, printed
    assert printed.count(f"agent-r1 check: model.path = {value!r} is not a local folder") == 1, printed
    assert "a relative path is taken from the working directory" in printed
    if value.startswith("./"):
        assert "nor a Hugging Face Hub name: give the model's folder" in printed
    assert "Retrying" not in printed
    assert seconds < 60, seconds


def run(coroutine):
    import asyncio

    return asyncio.run(coroutine)


def test_a_role_that_no_policy_plays(tiny_checkpoint, tmp_path, capsys):
    """Several policies (issue 50): the env's first role is played by none of them: exit 2, before the
    weights load, naming the row, the role and the configured policies."""
    env = {"name": "trainer_envs:LowHighEnv"}
    config = write_config(tmp_path, str(tiny_checkpoint), env, [{"id": "a", "prompt": "hi"}])
    printed = refused(
        capsys, "check", config, "model.lora.rank=4", "policies.high={}", "policies.other.frozen=true"
    )
    assert "role 'low' acted, but no policy plays it" in printed and "row 0" in printed
    assert "policies: ['high', 'other']" in printed


def test_a_seat_that_no_policy_plays(tiny_checkpoint, tmp_path, capsys):
    """TextArena with both seats of one game: every seat's role is checked, not only the first mover's."""
    env = {"name": "textarena", "kwargs": {"game": "TicTacToe-v0", "seats": "all"}}
    config = write_config(tmp_path, str(tiny_checkpoint), env, [{"id": "g", "seed": 0}])
    printed = refused(capsys, "check", config, "model.lora.rank=4", "policies.player_0={}")
    assert "role 'player_1' acted, but no policy plays it" in printed


def test_an_agent_role_that_no_policy_plays(tiny_checkpoint, tmp_path, capsys):
    """An agent program's roles (its model names) are checked without running the agent."""
    env = {
        "name": "agent_program",
        "kwargs": {"agent": "test_agent_program:no_call", "roles": ["planner", "executor"]},
    }
    config = write_config(tmp_path, str(tiny_checkpoint), env, [{"id": "a", "prompt": "hi"}])
    printed = refused(capsys, "check", config, "model.lora.rank=4", "policies.planner={}")
    assert "role 'executor' acted, but no policy plays it" in printed and "agent_program" in printed


def test_an_env_without_roles_under_several_policies(tiny_checkpoint, tmp_path, capsys):
    config = write_config(tmp_path, str(tiny_checkpoint), FROZEN_LAKE, [{"id": "a", "seed": 0}])
    printed = refused(capsys, "check", config, "model.lora.rank=4", "policies.a={}", "policies.b={}")
    assert "an episode named no role (Observation.role unset)" in printed
