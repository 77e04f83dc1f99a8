"""The Gymnasium adapter (env.name: gymnasium) against the real gymnasium package: scripted episodes
of the toy-text envs through the built-in text hooks, invalid actions, seeds, exact append token ids,
a user hook by entry point, bad input, and one warm-started training run on Blackjack."""

from __future__ import annotations

import asyncio
import json
import random
import sys
from collections import deque

import pytest
import torch

from agent_r1.envs import check_env, make_env
from agent_r1.envs.context import encode_text, render_messages
from agent_r1.envs.ecosystem import MissingPackageError
from agent_r1.envs.ecosystem import gymnasium as eco
from agent_r1.models.tiny import build_tiny, build_tiny_tokenizer
from agent_r1.train.builders import env_factory
from agent_r1.train.config import config_from_dict
from agent_r1.train.sft import SFTConfig, replay_demonstrations, sft_sequences, train_sft
from agent_r1.train.trainer import Trainer
from agent_r1.types import Action

TOKENIZER = build_tiny_tokenizer()
EOS = TOKENIZER.eos_token


def action(text: str) -> Action:
    return Action(text + EOS, (*TOKENIZER.encode(text, add_special_tokens=False), TOKENIZER.eos_token_id))


def play(replies: list[str], task: dict | None = None, **kwargs):
    """(env, first observation, every StepResult) of an episode driven by ``replies``."""

    async def run():
        env = make_env("gymnasium", tokenizer=TOKENIZER, **kwargs)
        first = await env.reset(task or {"id": "t", "seed": 0})
        results = []
        for reply in replies:
            results.append(await env.step(action(reply)))
            if results[-1].observation is None:
                break
        await env.close()
        return env, first, results

    return asyncio.run(run())


def user_texts(env) -> list[str]:
    return [m["content"] for m in env.messages if m["role"] == "user"]


LAKE = {"id": "FrozenLake-v1", "make_kwargs": {"is_slippery": False}}


def test_frozen_lake_scripted_to_the_goal_with_gymnasiums_reward_and_success():
    env, first, results = play(["right", "right", "down", "down", "down", "right"], **LAKE)
    assert first.state_key == "PFFF\nFHFH\nFFFH\nHFFG"
    assert user_texts(env)[1:3] == ["SPFF\nFHFH\nFFFH\nHFFG", "SFPF\nFHFH\nFFFH\nHFFG"]
    assert [r.reward for r in results] == [0.0] * 5 + [1.0]
    assert [r.info["action"] for r in results] == [2, 2, 1, 1, 1, 2]
    last = results[-1]
    assert last.terminated and not last.truncated and last.observation is None
    assert last.outcome_reward is None and last.info["success"] is True
    assert last.metrics == {"invalid_actions": 0.0, "return": 1.0, "episode_success": 1.0}
    assert all(r.metrics == {"invalid_actions": 0.0} for r in results[:-1])


def test_a_hole_ends_the_episode_without_success():
    _, _, results = play(["down", "right"], **LAKE)
    assert len(results) == 2 and results[-1].terminated
    assert results[-1].info["success"] is False and results[-1].metrics["return"] == 0.0


def test_invalid_actions_are_observations_counted_and_do_not_step_the_env():
    env, _, results = play(["jump", "Right.", "UP"], invalid_action_reward=-0.5, **LAKE)
    assert (
        results[0].info["invalid_action"]
        == "'jump' is not an action; reply with one of: left, down, right, up"
    )
    assert results[0].reward == -0.5 and results[0].metrics == {"invalid_actions": 1.0}
    assert "action" not in results[0].info and results[0].observation.state_key is None
    assert user_texts(env)[1] == "Invalid action: " + results[0].info["invalid_action"]
    assert [r.info.get("action") for r in results[1:]] == [2, 3]  # case and a full stop are forgiven
    assert user_texts(env)[2] == "SPFF\nFHFH\nFFFH\nHFFG"  # moved once: the bad reply changed nothing


class OutOfSpaceHook(eco.FrozenLakeText):
    def parse(self, text, env):
        return 7


def test_an_action_outside_the_action_space_is_invalid_too():
    _, _, results = play(["left"], hook=OutOfSpaceHook(), **LAKE)
    assert (
        results[0].info["invalid_action"]
        == "7 is not in the action space Discrete(4): an integer from 0 to 3"
    )


def test_a_text_action_space_is_described_in_a_few_words_not_its_charset():
    import string

    from gymnasium.spaces import Text

    printable = eco.space_text(Text(20, charset=string.printable))
    assert printable == (
        "Text: 1 to 20 characters (lowercase letters, uppercase letters, digits, punctuation, whitespace)"
    )
    assert string.ascii_lowercase not in printable  # the charset itself is not pasted into the prompt
    assert eco.space_text(Text(4, charset="abc-")) == "Text: 1 to 4 characters (the characters '-abc')"
    assert eco.space_text(Text(3, charset="αβγδεζηθικλμ")) == "Text: 1 to 3 characters (12 characters)"


def test_max_turns_truncates_with_success_false():
    _, _, results = play(["left", "jump", "left"], max_turns=2, **LAKE)
    assert len(results) == 2
    last = results[-1]
    assert last.truncated and not last.terminated and last.info["truncated"] == "max_turns=2 reached"
    assert last.info["success"] is False and last.metrics["invalid_actions"] == 1.0


def taxi_plan(env_id: str, seed: int) -> list[str]:
    """The shortest action sequence that ends a Taxi episode (breadth-first over Gymnasium's own P)."""
    import gymnasium as gym

    env = gym.make(env_id).unwrapped
    start, _ = env.reset(seed=seed)
    names = list(eco.TaxiText.ACTIONS)
    parents, queue = {start: None}, deque([start])
    while queue:
        state = queue.popleft()
        for a in range(6):
            ((_, nxt, _, done),) = env.P[state][a]
            if done:
                path = [names[a]]
                while parents[state] is not None:
                    state, prev = parents[state]
                    path.insert(0, names[prev])
                return path
            if nxt not in parents:
                parents[nxt] = (state, a)
                queue.append(nxt)
    raise AssertionError("no plan")


def test_taxi_renders_the_map_and_a_planned_episode_earns_gymnasiums_return():
    plan = taxi_plan("Taxi-v4", seed=0)
    env, first, results = play(plan, id="Taxi-v4")
    assert first.state_key == (
        "+---------+\n|R: | : :G|\n| : | : : |\n| : : : : |\n|T| : | : |\n|Y| : |B: |\n+---------+\n"
        "Passenger at B, destination Y."
    )
    assert results[-1].terminated and results[-1].info["success"] is True
    assert results[-1].metrics["return"] == 20.0 - (len(plan) - 1)  # -1 per move, +20 for the drop-off
    assert "in the taxi" in user_texts(env)[-1]


def test_blackjack_and_cliff_walking_hooks():
    _, first, results = play(["hit", "stick"], id="Blackjack-v1")
    assert first.state_key == "Your sum: 11. Dealer shows: 10."
    assert results[-1].terminated and results[-1].reward == -1.0 and results[-1].info["success"] is False
    env, first, results = play(["up", *["right"] * 11, "down"], id="CliffWalking-v1")
    assert first.state_key == "............\n............\n............\nPCCCCCCCCCCG"
    assert results[-1].terminated and results[-1].info["success"] is True  # by the hook's own rule
    assert results[-1].metrics["return"] == -13.0


def test_the_seed_fixes_the_start_so_a_group_compares_the_same_state():
    starts = [play([], {"id": "t", "seed": seed}, id="Taxi-v4")[1].token_ids for seed in (3, 3, 4)]
    assert starts[0] == starts[1] != starts[2]


def test_append_prompts_extend_the_previous_prompt_and_response_exactly():
    env, first, results = play(["right", "jump", "right", "down"], **LAKE)
    prompts = [first.token_ids, *(r.observation.token_ids for r in results)]
    replies = [action(t).token_ids for t in ("right", "jump", "right", "down")]
    for before, reply, after in zip(prompts, replies, prompts[1:], strict=False):
        assert after[: len(before) + len(reply)] == (*before, *reply)
    assert list(prompts[-1]) == encode_text(TOKENIZER, render_messages(TOKENIZER, env.messages))


def test_task_make_kwargs_override_the_configs():
    task = {"id": "m", "seed": 0, "make_kwargs": {"desc": ["SH", "FG"]}}
    _, first, results = play(["down", "right"], task, **LAKE)
    assert first.state_key == "PH\nFG" and results[-1].info["success"] is True


def test_check_env_registration_and_the_training_config_path():
    def factory():
        return eco.GymnasiumEnv(TOKENIZER, "FrozenLake-v1", make_kwargs={"is_slippery": False})

    check_env(factory, {"id": "t", "seed": 1}, actions=["right", "nonsense", "down"], tokenizer=TOKENIZER)
    config = config_from_dict({"env": {"name": "gymnasium", "kwargs": {"id": "Blackjack-v1"}}})
    env = env_factory(config, TOKENIZER)()
    assert isinstance(env, eco.GymnasiumEnv) and isinstance(env.hook, eco.BlackjackText)


class CartPoleText:
    """A user's hook, given as 'test_ecosystem_gymnasium:CartPoleText'."""

    instructions = "Balance the pole. Reply left or right."

    def render(self, observation, info, env):
        return " ".join(f"{x:.2f}" for x in observation)

    def parse(self, text, env):
        return eco.parse_choice(text, {"left": 0, "right": 1})


def test_a_user_hook_by_entry_point_runs_a_non_text_env():
    import gymnasium as gym

    env, first, results = play(["left", "up"], hook="test_ecosystem_gymnasium:CartPoleText", id="CartPole-v1")
    expected, _ = gym.make("CartPole-v1").reset(seed=0)
    assert first.state_key == " ".join(f"{x:.2f}" for x in expected) == "0.01 -0.02 -0.05 -0.05"
    assert results[0].reward == 1.0 and results[1].metrics == {"invalid_actions": 1.0}
    assert env.max_turns == 500  # the spec's max_episode_steps


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            {"id": "Nope-v0"},
            ValueError,
            r"unknown Gymnasium id 'Nope-v0'.*available ids: \[.*'FrozenLake-v1'",
        ),
        ({"id": "Taxi-v3"}, ValueError, r"Taxi-v3.*Please use `Taxi-v4`.*available ids"),
        ({"id": "no_such_module:X-v0"}, ValueError, "cannot import module 'no_such_module'"),
        (
            {"id": "CartPole-v1"},
            ValueError,
            r"no built-in text hook \(built in: FrozenLake, .*env.kwargs.hook",
        ),
        ({"id": "Blackjack-v1", "hook": "json:dumps"}, TypeError, "without render.*and parse"),
        ({"id": "Blackjack-v1", "hook": "nowhere:Hook"}, ValueError, "cannot import module 'nowhere'"),
        (
            {"id": "Blackjack-v1", "make_kwargs": {"render_mode": "human"}},
            ValueError,
            "make_kwargs: render_mode 'human' is not supported",
        ),
        ({"id": "Blackjack-v1", "max_turns": 0}, ValueError, "max_turns must be >= 1"),
        ({"id": "Blackjack-v1", "context": "nope"}, ValueError, "unknown context policy 'nope'"),
        ({"id": "Blackjack-v1", "colour": 1}, TypeError, "colour"),
    ],
)
def test_bad_configuration_is_one_clear_error(kwargs, error, message):
    with pytest.raises(error, match=message):
        make_env("gymnasium", tokenizer=TOKENIZER, **kwargs)


@pytest.mark.parametrize(
    ("task", "message"),
    [
        ({"id": "r1", "sead": 3}, r"task 'r1': unknown field\(s\) \['sead'\]"),
        ({"id": "r2", "seed": "3"}, "task 'r2': 'seed' must be an integer"),
        ({"id": "r3", "make_kwargs": {"colour": 1}}, r"task 'r3': gymnasium.make\('Blackjack-v1'.*colour"),
        ({"id": "r4", "make_kwargs": {"render_mode": "rgb_array"}}, "task 'r4' make_kwargs: render_mode"),
    ],
)
def test_bad_task_rows_name_the_row(task, message):
    env = make_env("gymnasium", tokenizer=TOKENIZER, id="Blackjack-v1")
    with pytest.raises(ValueError, match=message):
        asyncio.run(env.reset(task))


def test_a_missing_gymnasium_is_one_error_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "gymnasium", None)  # `import gymnasium` now fails as if absent
    with pytest.raises(MissingPackageError, match=r"pip install 'agent-r1\[gymnasium\]'"):
        make_env("gymnasium", tokenizer=TOKENIZER, id="FrozenLake-v1")


def blackjack_demo(task: dict, rng: random.Random) -> list[str]:
    """Hit below 17, then stick (replayed against the seeded deal, so it always fits the episode)."""
    import gymnasium as gym

    env = gym.make("Blackjack-v1")
    (total, _, _), _ = env.reset(seed=task["seed"])
    replies = []
    while True:
        move = "hit" if total < 17 else "stick"
        replies.append(move)
        (total, _, _), _, terminated, _, _ = env.step(int(move == "hit"))
        if terminated:
            return replies


def test_training_on_blackjack_end_to_end(tiny_checkpoint, tmp_path):
    """Warm start on a threshold player's demonstrations, then GRPO through the real Trainer: the
    parameters change, trajectories carry the env's rewards and info, env/* metrics are logged."""
    torch.manual_seed(0)
    model, tokenizer = build_tiny(seed=0)
    kwargs = {"id": "Blackjack-v1", "system_prompt": "hit or stick"}  # short: a quick SFT
    demo_tasks = [{"id": f"d{i}", "seed": i} for i in range(96)]
    demos = replay_demonstrations(
        lambda: eco.GymnasiumEnv(tokenizer, **kwargs), tokenizer, demo_tasks, blackjack_demo
    )
    sft = SFTConfig(epochs=3, lr=5e-3, batch_size=8, micro_batch_size=8)
    train_sft(model, sft_sequences(demos), sft, pad_token_id=tokenizer.pad_token_id)
    config = config_from_dict(
        {
            "model": {"path": str(tiny_checkpoint)},
            "env": {"name": "gymnasium", "kwargs": {**kwargs, "max_turns": 4}},
            "rollout": {"n": 4, "max_tokens": 6, "max_steps": 4},
            "trainer": {
                "steps": 2,
                "tasks_per_step": 4,
                "lr": 1e-3,
                "run_dir": str(tmp_path),
                "eval_every": 0,
            },
            "logging": {"progress": False},
        }
    )
    tasks = [{"id": f"t{i}", "seed": 1000 + i} for i in range(8)]
    trainer = Trainer(config, tokenizer=tokenizer, model=model, train_tasks=tasks)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.fit()
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    step_rows = [r for r in rows if "reward/mean" in r]
    assert len(step_rows) == 2
    assert all(0.0 <= r["env/invalid_actions"] <= 1.0 and -1.0 <= r["env/return"] <= 1.5 for r in step_rows)
    records = [
        json.loads(x) for x in (tmp_path / "trajectories" / "step_000001.jsonl").read_text().splitlines()
    ]
    assert len(records) == 16 and all(r["status"] == "ok" for r in records)
    for record in records:
        steps = record["steps"]
        assert 1 <= len(steps) <= 4 and "success" in record["info"]
        assert sum(s["reward"] for s in steps) == steps[-1]["metrics"]["return"]
        assert steps[-1]["terminated"] or steps[-1]["truncated"]


@pytest.mark.slow
def test_the_benchmark_arm_runs_quick(monkeypatch):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "eco_gymnasium.py"
    monkeypatch.syspath_prepend(str(path.parent))  # the arm imports its neighbour run_digest by name
    spec = importlib.util.spec_from_file_location("eco_gymnasium", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    train, test = bench.make_tasks(30, split="train", seed=0), bench.make_tasks(30, split="test", seed=0)
    maps = [tuple(t["make_kwargs"]["desc"]) for t in train], [tuple(t["make_kwargs"]["desc"]) for t in test]
    assert not set(maps[0]) & set(maps[1]) and len(set(maps[0])) == 30
    for task in test[:5]:  # the noiseless planner reaches G on every map
        replies = bench.demonstrate(task, random.Random(0), error_rate=0.0)
        _, _, results = play(replies, task, **bench.ENV_KWARGS)
        assert results[-1].info["success"] is True and len(replies) == len(results) >= 6
    result = bench.run(seed=0, quick=True)
    assert {"env", "metric", "before", "after", "tasks", "rl_steps", "seconds"} <= set(result)
    assert 0.0 <= result["before"] <= 1.0 and 0.0 <= result["after"] <= 1.0
    assert result["tasks"] == 4 and result["rl_steps"] == 2
    assert set(result["run"]["evals"]) == {0, 2} and isinstance(result["run"]["moved"], dict)
