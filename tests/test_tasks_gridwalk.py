"""The gridwalk task: transitions, the outcome reward, recurring states as step_grpo sees them, the
dataset splits, the demonstrator's systematic habit, and errors on bad rows."""

from __future__ import annotations

import asyncio
import random

import pytest
from episodes import play_replies

from agent_r1.algos import StepTable
from agent_r1.envs import check_env, make_env
from agent_r1.flows import AgentEnvLoop, rollout_group
from agent_r1.models.tiny import build_tiny, build_tiny_tokenizer
from agent_r1.rollout.hf import HFEngine
from agent_r1.tasks import gridwalk as gw
from agent_r1.train.builders import env_factory
from agent_r1.train.config import config_from_dict
from agent_r1.train.sft import replay_demonstrations
from agent_r1.types import SamplingParams, TrajectoryGroup


def play(task: dict, replies: list[str]):
    """Every StepResult of an episode driven by ``replies`` (test helper; stops when it ends)."""
    return play_replies(gw.GridWalkEnv(), task, replies)


def test_moves_change_the_offset_and_the_goal_ends_the_episode_with_reward_one():
    task = {"id": "t", "dx": 2, "dy": -1, "budget": 5}
    first, results = play(task, ["E", "S<|im_end|>", " E\n"])
    assert first.messages[-1] == {"role": "user", "content": "Goal 2E 1S"}
    assert [r.observation.messages[-1]["content"] for r in results[:2]] == ["Goal 1E 1S", "Goal 1E"]
    assert [r.info["state"] for r in results] == ["+2,-1", "+1,-1", "+1,+0"]
    assert [r.info["move"] for r in results] == ["E", "S", "E"]
    assert all(r.reward == 0.0 and r.outcome_reward is None for r in results[:2])  # delayed reward
    last = results[-1]
    assert last.terminated and not last.truncated and last.observation is None
    assert last.outcome_reward == 1.0 and last.info["success"] is True


def test_running_out_of_moves_truncates_with_reward_zero_and_invalid_replies_cost_a_move():
    task = {"id": "t", "dx": 0, "dy": 2, "budget": 3}
    _, results = play(task, ["E", "north", "W"])
    assert results[1].info["invalid"] is True and results[1].info["move"] is None
    assert results[1].observation.messages[-1]["content"] == "Goal 1W 2N"  # unchanged by the bad reply
    last = results[-1]
    assert len(results) == 3 and last.truncated and not last.terminated
    assert last.outcome_reward == 0.0 and last.info["success"] is False


@pytest.mark.parametrize(
    ("dx", "dy", "text"),
    [(3, -2, "Goal 3E 2S"), (-1, 4, "Goal 1W 4N"), (0, 6, "Goal 6N"), (-7, 0, "Goal 7W")],
)
def test_the_observation_writes_the_moves_toward_the_goal(dx, dy, text):
    assert gw.observation_text(dx, dy) == text


def test_the_env_passes_check_env_and_is_registered_by_name():
    task = {"id": "t", "dx": 1, "dy": 1, "budget": 3}
    check_env(gw.GridWalkEnv, task, actions=["N", "E"])
    assert isinstance(make_env("gridwalk"), gw.GridWalkEnv)
    config = config_from_dict({"env": {"name": "gridwalk"}})  # as a training config names it
    assert isinstance(env_factory(config, build_tiny_tokenizer())(), gw.GridWalkEnv)


@pytest.mark.parametrize(
    ("reply", "move"),
    [
        ("E", "E"),
        ("W<|im_end|>", "W"),
        ("  N \n", "N"),
        ("S<|endoftext|>", "S"),
        ("EE", None),
        ("e", None),
        ("", None),
    ],
)
def test_parse_move(reply, move):
    assert gw.parse_move(reply) == move


def test_equal_cells_give_equal_prompt_ids_so_step_grpo_groups_them():
    """Two demonstrations of one task that take different paths to the same cell: their steps from
    that cell share a state_index (identical prompt ids, no state_key), other cells do not."""
    tokenizer = build_tiny_tokenizer()
    task = {"id": "t", "dx": 1, "dy": 1, "budget": 4}
    paths = iter([["E", "N"], ["N", "E"]])
    a, b = replay_demonstrations(gw.GridWalkEnv, tokenizer, [task, task], lambda t, rng: next(paths))
    table = StepTable.from_groups([TrajectoryGroup("g", "t", (a, b))])
    assert a.steps[0].prompt_ids == b.steps[0].prompt_ids  # the shared start
    assert a.steps[1].prompt_ids != b.steps[1].prompt_ids  # Goal 1N vs Goal 1E
    assert all(s.state_key is None for s in (*a.steps, *b.steps))
    states = table.state_index.tolist()  # rows: a0, a1, b0, b1
    assert states[0] == states[2] and len({states[0], states[1], states[3]}) == 3


def test_a_trajectory_that_returns_to_a_cell_revisits_its_state():
    tokenizer = build_tiny_tokenizer()
    task = {"id": "t", "dx": 0, "dy": 1, "budget": 3}
    (trajectory,) = replay_demonstrations(gw.GridWalkEnv, tokenizer, [task], lambda t, rng: ["E", "W", "N"])
    assert trajectory.steps[0].prompt_ids == trajectory.steps[2].prompt_ids
    assert [s.info["state"] for s in trajectory.steps] == ["+0,+1", "-1,+1", "+0,+1"]
    assert trajectory.outcome_reward == 1.0


def test_a_sampled_group_revisits_states_through_the_real_flow():
    """Random-weight tiny model through AgentEnvLoop + HFEngine: the group's first steps share one
    state, and its steps carry the env's state labels."""
    model, tokenizer = build_tiny(seed=0)
    engine = HFEngine(model, tokenizer=tokenizer)
    flow = AgentEnvLoop(gw.GridWalkEnv, tokenizer, SamplingParams(max_tokens=4, seed=0), max_steps=10)
    task = {"id": "t", "dx": 3, "dy": 3, "budget": 8}
    try:
        group = asyncio.run(rollout_group(flow, engine, task, n=4, group_id="g"))
    finally:
        engine.close()
    table = StepTable.from_groups([group])
    first_rows = (table.step_index == 0).nonzero().squeeze(-1)
    assert len(set(table.state_index[first_rows].tolist())) == 1 and len(first_rows) == 4
    assert all(s.info["state"] for t in group.trajectories for s in t.steps)


def test_dataset_splits_are_disjoint_reproducible_and_at_least_six_decisions_long():
    train_offsets, test_offsets = gw.split_offsets("train"), gw.split_offsets("test")
    assert not set(train_offsets) & set(test_offsets)
    assert len(train_offsets) + len(test_offsets) == sum(4 * d for d in range(6, 9))
    rows = gw.make_dataset(200, split="train", seed=3)
    assert rows == gw.make_dataset(200, split="train", seed=3) != gw.make_dataset(200, split="train", seed=4)
    for row in rows:
        distance = abs(row["dx"]) + abs(row["dy"])
        assert 6 <= distance <= 8 and row["budget"] == distance + gw.DEFAULT_SLACK
        assert (row["dx"], row["dy"]) in train_offsets
    heldout = gw.make_dataset(split="test", slack=0)
    assert [(r["dx"], r["dy"]) for r in heldout] == test_offsets
    assert all(r["budget"] == abs(r["dx"]) + abs(r["dy"]) for r in heldout)


def test_the_demonstrator_sidesteps_only_when_the_goal_is_straight_ahead():
    rng = random.Random(0)
    never = gw.demonstrate({"dx": 3, "dy": 4, "budget": 9}, rng, error_rate=0.0)
    assert len(never) == 7 and sorted(never) == sorted("EEENNNN")
    # Straight ahead it always sidesteps; as every path's last move starts on an axis, it never arrives.
    for _ in range(20):
        always = gw.demonstrate({"dx": 0, "dy": 6, "budget": 8}, rng, error_rate=1.0)
        assert always[0] in ("E", "W") and len(always) == 8
    # Off the axes the habit does not apply: every move is toward the goal.
    for _ in range(20):
        moves = gw.demonstrate({"dx": -4, "dy": 3, "budget": 9}, rng, error_rate=1.0)
        assert moves[:1] in (["W"], ["N"])


def test_replayed_demonstrations_end_where_the_env_does():
    tokenizer = build_tiny_tokenizer()
    tasks = gw.make_dataset(64, split="train", seed=0)
    demos = replay_demonstrations(gw.GridWalkEnv, tokenizer, tasks, gw.demonstrate, seed=0)
    assert {t.outcome_reward for t in demos} == {0.0, 1.0}
    assert all(len(t.steps) >= 6 for t in demos)


@pytest.mark.parametrize(
    ("task", "message"),
    [
        ({"id": "r1", "dx": 1, "budget": 3}, "r1.*missing field 'dy'"),
        ({"id": "r2", "dx": 1, "dy": "2", "budget": 3}, "r2.*'dy' must be an integer"),
        ({"id": "r3", "dx": True, "dy": 2, "budget": 3}, "r3.*'dx' must be an integer"),
        ({"id": "r4", "dx": 0, "dy": 0, "budget": 3}, "r4.*goal is the start"),
        ({"id": "r5", "dx": 3, "dy": -2, "budget": 4}, "r5.*'budget' 4 is below the distance 5"),
    ],
)
def test_bad_rows_raise_naming_the_row_and_the_field(task, message):
    with pytest.raises(ValueError, match=message):
        asyncio.run(gw.GridWalkEnv().reset(task))


def test_bad_dataset_and_demonstrator_arguments_raise():
    with pytest.raises(ValueError, match="split must be 'train' or 'test'"):
        gw.make_dataset(1, split="val")
    with pytest.raises(ValueError, match="slack must be >= 0"):
        gw.make_dataset(1, slack=-1)
    with pytest.raises(ValueError, match="n must be >= 1"):
        gw.make_dataset(0)
    with pytest.raises(ValueError, match="error_rate"):
        gw.demonstrate({"dx": 1, "dy": 0, "budget": 1}, random.Random(0), error_rate=1.5)
