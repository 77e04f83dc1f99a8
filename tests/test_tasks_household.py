"""The household task: actions and their feedback, the outcome reward and the budget, the seen /
unseen / held-out splits, the demonstrator (solves every task at error_rate 0, fails by its habit),
bad rows, prompt lengths, the TaskSpec, and a tiny model warm-started on it end to end."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from episodes import play_replies

from agent_r1.envs import check_env
from agent_r1.flows import AgentEnvLoop, rollout_group
from agent_r1.models.tiny import build_tiny, build_tiny_tokenizer
from agent_r1.models.tokens import observation_ids
from agent_r1.rollout.hf import HFEngine
from agent_r1.tasks import TaskSpec, available_tasks, get_task
from agent_r1.tasks import household as hh
from agent_r1.train.sft import SFTConfig, replay_demonstrations, sft_sequences, train_sft
from agent_r1.types import SamplingParams

KITCHEN = ["countertop 1", "cabinet 1", "fridge 1", "microwave 1", "sinkbasin 1", "coffeemachine 1", "desk 1"]


def row(task_type: str, obj: str, target: str, objects: dict[str, str], budget: int = 10) -> dict:
    return {
        "id": "t",
        "receptacles": KITCHEN,
        "objects": objects,
        "task_type": task_type,
        "object": obj,
        "target": target,
        "budget": budget,
    }


def play(task: dict, replies: list[str], env: hh.HouseholdEnv | None = None):
    """The first observation and every StepResult of an episode driven by ``replies``."""
    return play_replies(env or hh.HouseholdEnv(), task, replies)


def user_text(observation) -> str:
    return observation.messages[-1]["content"]


CLEAN_MUG = row(
    "pick_clean_then_place", "mug", "coffeemachine", {"mug 1": "cabinet 1", "apple 1": "fridge 1"}, budget=9
)
CLEAN_MUG_SOLUTION = [
    "go to cabinet 1",
    "open cabinet 1",
    "take mug 1 from cabinet 1",
    "go to sinkbasin 1",
    "clean mug 1 with sinkbasin 1",
    "go to coffeemachine 1",
    "put mug 1 in/on coffeemachine 1",
]


def test_a_clean_then_place_episode_reads_as_alfworld_and_ends_with_reward_one():
    first, results = play(
        CLEAN_MUG, [*CLEAN_MUG_SOLUTION[:2], " Take mug 1 from cabinet 1<|im_end|>", *CLEAN_MUG_SOLUTION[3:]]
    )
    text = user_text(first)
    assert text.startswith("Your task is to: put a clean mug in coffeemachine.\n")
    assert "Seen: mug 1 in cabinet 1, apple 1 in fridge 1." in text
    assert "go to cabinet 1" in text and "take" not in text  # nothing to take in the middle of the room
    at_cabinet = user_text(results[0].observation)
    assert "open cabinet 1" in at_cabinet and "take mug 1" not in at_cabinet  # closed: open it first
    assert "take mug 1 from cabinet 1" in user_text(results[1].observation)
    assert "Holding: mug 1 (clean)." in user_text(results[4].observation)
    assert "> You clean the mug 1 using the sinkbasin 1." in user_text(results[4].observation)
    assert [r.info["invalid"] for r in results] == [False] * 7
    assert results[2].info["action"] == "take mug 1 from cabinet 1"  # lenient parse
    assert all(r.outcome_reward is None and r.reward == 0.0 for r in results[:-1])
    last = results[-1]
    assert last.terminated and not last.truncated and last.observation is None
    assert last.outcome_reward == 1.0 and last.info["success"] is True


def test_an_action_not_admissible_answers_nothing_happens_and_costs_a_step():
    _, results = play(CLEAN_MUG, ["take mug 1 from cabinet 1", "go to cabinet 1", "fly away"])
    assert results[0].info["invalid"] is True and results[2].info["invalid"] is True
    assert "> Nothing happens." in user_text(results[0].observation)
    assert "At: the middle of the room." in user_text(results[0].observation)  # unchanged
    assert results[1].info["invalid"] is False


def test_putting_the_object_unprocessed_does_not_satisfy_the_goal_and_the_budget_truncates():
    task = {**CLEAN_MUG, "budget": 7}
    skipped = ["go to cabinet 1", "open cabinet 1", "take mug 1 from cabinet 1", "go to coffeemachine 1"]
    _, results = play(task, [*skipped, "put mug 1 in/on coffeemachine 1", "look", "inventory"])
    assert not results[4].terminated  # the mug is in place but not clean
    last = results[-1]
    assert len(results) == 7 and last.truncated and not last.terminated
    assert last.outcome_reward == 0.0 and last.info["success"] is False


def test_heat_cool_and_the_desklamp():
    heat = row("pick_heat_then_place", "apple", "countertop", {"apple 1": "fridge 1"})
    _, results = play(
        heat,
        [
            "go to fridge 1",
            "open fridge 1",
            "take apple 1 from fridge 1",
            "go to microwave 1",
            "heat apple 1 with microwave 1",
            "go to countertop 1",
            "put apple 1 in/on countertop 1",
        ],
    )
    assert results[-1].terminated and results[-1].outcome_reward == 1.0
    cool_into_fridge = row("pick_cool_then_place", "egg", "fridge", {"egg 1": "countertop 1"})
    assert hh.demonstrate(cool_into_fridge, random.Random(0), error_rate=0.0) == [
        "go to countertop 1",
        "take egg 1 from countertop 1",
        "go to fridge 1",
        "cool egg 1 with fridge 1",
        "open fridge 1",  # cooling needs no open fridge; putting does
        "put egg 1 in/on fridge 1",
    ]
    look = row("look_at_obj_in_light", "book", "desklamp", {"book 1": "countertop 1", "desklamp 1": "desk 1"})
    first, results = play(
        look, ["go to desk 1", "use desklamp 1", "go to countertop 1", "take book 1 from countertop 1"]
    )
    assert "desklamp 1" not in user_text(first).split("Seen:")[1].split("\n")[0]  # fixed furniture
    assert "take desklamp" not in user_text(results[0].observation)
    assert not results[1].terminated  # the lamp without the book
    _, results = play(look, ["go to desk 1", "go to desk 1"])
    assert results[1].info["invalid"] is True  # no "go to" where the agent stands
    assert hh.demonstrate(look, random.Random(0), error_rate=1.0)[-2:] == ["go to desk 1", "use desklamp 1"]


def test_the_env_passes_check_env():
    check_env(hh.HouseholdEnv, CLEAN_MUG, actions=CLEAN_MUG_SOLUTION, tokenizer=build_tiny_tokenizer())


def test_splits_are_reproducible_and_disjoint():
    seen, unseen = hh.split_layouts("train"), hh.split_layouts("unseen")
    assert hh.split_layouts("test") == seen and seen and unseen and not set(seen) & set(unseen)
    rooms = {tuple(sorted(hh.layout(i))) for i in seen}
    assert not rooms & {tuple(sorted(hh.layout(i))) for i in unseen}  # unseen rooms differ

    def key(r: dict) -> tuple:
        return (r["layout"], r["task_type"], r["object"], r["target"], r["objects"][f"{r['object']} 1"])

    train = hh.make_dataset(400, split="train", seed=0)
    test = hh.make_dataset(200, split="test", seed=0)
    unseen_rows = hh.make_dataset(200, split="unseen", seed=0)
    assert train == hh.make_dataset(400, split="train", seed=0) != hh.make_dataset(400, split="train", seed=1)
    assert not {key(r) for r in train} & {key(r) for r in test}
    assert {r["layout"] for r in train} | {r["layout"] for r in test} <= set(seen)
    assert {r["layout"] for r in unseen_rows} <= set(unseen)
    assert {r["task_type"] for r in train} == set(hh.TASK_TYPES)
    assert len({r["id"] for r in train + test + unseen_rows}) == 800


@pytest.mark.parametrize("split", ["train", "test", "unseen"])
def test_the_demonstrator_at_error_rate_zero_solves_every_task_in_four_to_eight_actions(split):
    tasks = hh.make_dataset(200, split=split, seed=5)
    for task in tasks:
        actions = hh.demonstrate(task, random.Random(0), error_rate=0.0)
        assert 4 <= len(actions) <= 8 and task["budget"] == len(actions) + hh.DEFAULT_SLACK
        _, results = play(task, actions)
        assert results[-1].terminated and results[-1].outcome_reward == 1.0, task["id"]


def test_the_demonstrators_habit_skips_the_processing_and_fails_only_there():
    rng = random.Random(0)
    habit = hh.demonstrate(CLEAN_MUG, rng, error_rate=1.0)
    assert habit[3:5] == ["go to coffeemachine 1", "put mug 1 in/on coffeemachine 1"]  # unwashed
    assert habit[5:] == [
        "take mug 1 from coffeemachine 1",
        "go to sinkbasin 1",
        "clean mug 1 with sinkbasin 1",
        "go to coffeemachine 1",
    ]
    assert len(habit) == CLEAN_MUG["budget"]  # it recovers until the budget runs out
    _, results = play(CLEAN_MUG, habit)
    assert results[-1].truncated and results[-1].outcome_reward == 0.0
    tasks = hh.make_dataset(300, split="train", seed=0)
    for task in tasks:
        _, results = play(task, hh.demonstrate(task, rng, error_rate=1.0))
        assert results[-1].outcome_reward == float(task["task_type"] not in hh.PROCESSING), task["id"]


def test_prompts_stay_short_for_the_byte_level_model():
    tokenizer = build_tiny_tokenizer()
    tasks = hh.make_dataset(100, split="train", seed=0) + hh.make_dataset(100, split="unseen", seed=0)
    demos = replay_demonstrations(hh.make_env, tokenizer, tasks, hh.demonstrate, seed=0)
    lengths = [len(step.prompt_ids) for t in demos for step in t.steps]
    assert max(lengths) < 700
    first = asyncio.run(hh.HouseholdEnv().reset(tasks[0]))
    assert len(observation_ids(first, tokenizer)) == lengths[0]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"objects": None}, "r1.*missing field 'objects'"),
        ({"budget": None}, "r1.*missing field 'budget'"),
        ({"budget": "9"}, "r1.*'budget' must be an integer"),
        ({"budget": 3}, "r1.*'budget' 3 is below the shortest solution \\(7 actions\\)"),
        ({"task_type": "juggle"}, "r1.*'task_type' 'juggle' is not one of"),
        ({"objects": {"mug 1": "attic 1"}}, "r1.*'objects' must map each object"),
        ({"object": "kettle"}, "r1.*'object' 'kettle'.*unsolvable"),
    ],
)
def test_bad_rows_raise_naming_the_row_and_the_field(change, message):
    task = {**CLEAN_MUG, "id": "r1", **change}
    task = {k: v for k, v in task.items() if v is not None}
    with pytest.raises(ValueError, match=message):
        asyncio.run(hh.HouseholdEnv().reset(task))


def test_bad_dataset_and_demonstrator_arguments_raise():
    with pytest.raises(ValueError, match="split must be one of train, test, unseen"):
        hh.make_dataset(1, split="val")
    with pytest.raises(ValueError, match="n must be >= 1"):
        hh.make_dataset(0)
    with pytest.raises(ValueError, match="slack must be >= 0"):
        hh.make_dataset(1, slack=-1)
    with pytest.raises(ValueError, match="error_rate"):
        hh.demonstrate(CLEAN_MUG, random.Random(0), error_rate=2.0)
    with pytest.raises(ValueError, match="takes only max_turns"):
        hh.make_env(None, context="append")
    with pytest.raises(ValueError, match="max_turns must be >= 1"):
        hh.make_env(None, max_turns=0)
    _, results = play(CLEAN_MUG, CLEAN_MUG_SOLUTION, hh.make_env(None, max_turns=3))  # budget 9
    assert len(results) == 3 and results[-1].truncated and results[-1].outcome_reward == 0.0


def test_the_task_spec_builds_the_env_and_declares_its_fields():
    spec = get_task("household")
    assert "household" in available_tasks() and isinstance(spec, TaskSpec)
    assert isinstance(spec.make_env(build_tiny_tokenizer()), hh.HouseholdEnv)
    assert spec.required_fields == hh.HouseholdEnv.required_fields == hh.make_env.required_fields
    task = spec.make_dataset(1, split="test", seed=0)[0]
    assert set(spec.required_fields) <= set(task) <= set(hh.HouseholdEnv.task_fields)
    assert spec.max_turns >= task["budget"]
    assert spec.demonstrate(task, random.Random(0))


def test_a_tiny_model_warm_started_on_demonstrations_learns_and_plays_episodes():
    """Behaviour cloning on 16 demonstrations (one epoch) lowers the loss and changes the weights;
    the model then samples whole episodes through AgentEnvLoop, each step's info labelled."""
    torch.manual_seed(0)
    model, tokenizer = build_tiny(seed=0)
    before = [p.detach().clone() for p in model.parameters()]
    demos = replay_demonstrations(hh.make_env, tokenizer, hh.make_dataset(16, seed=1), hh.demonstrate, seed=0)
    losses = train_sft(
        model,
        sft_sequences(demos),
        SFTConfig(epochs=1, batch_size=16, micro_batch_size=16),
        pad_token_id=tokenizer.pad_token_id,
    )
    assert losses[-1] < losses[0]
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    engine = HFEngine(model, tokenizer=tokenizer)
    flow = AgentEnvLoop(hh.make_env, tokenizer, SamplingParams(max_tokens=40, seed=0), max_steps=10)
    task = hh.make_dataset(1, split="unseen", seed=0)[0]
    try:
        group = asyncio.run(rollout_group(flow, engine, task, n=2, group_id="g"))
    finally:
        engine.close()
    for trajectory in group.trajectories:
        assert 1 <= len(trajectory.steps) <= task["budget"]
        assert trajectory.outcome_reward in (0.0, 1.0)
        assert all("state" in s.info and "invalid" in s.info for s in trajectory.steps)


def test_a_listed_actions_number_stands_for_it_and_the_numbered_demonstrator_replays_the_same_episode():
    """Each listed action is numbered; answering ``3`` (or ``3.``) performs the third; a number past
    the list is not admissible. The numbered demonstrator plays the same actions as the text one."""
    first, _ = play(CLEAN_MUG, [])
    listed = user_text(first).split("Actions:\n", 1)[1].splitlines()
    assert listed[0].startswith("1. ") and all(line.split(". ", 1)[0].isdigit() for line in listed)
    go_to_cabinet = next(line.split(". ", 1)[0] for line in listed if line.endswith("go to cabinet 1"))
    _, results = play(CLEAN_MUG, [go_to_cabinet + ".", "99"])
    assert results[0].info["action"] == "go to cabinet 1" and not results[0].info["invalid"]
    assert results[1].info["invalid"] and results[1].observation.messages[-1]["content"].count(
        "Nothing happens."
    )

    for task in hh.make_dataset(30, split="test", seed=3):
        texts = hh.demonstrate(task, random.Random(5), error_rate=0.5)
        numbers = hh.demonstrate(task, random.Random(5), error_rate=0.5, numbered=True)
        assert all(n.isdigit() for n in numbers) and len(numbers) == len(texts)
        _, by_text = play(task, texts)
        _, by_number = play(task, numbers)
        assert [r.info["action"] for r in by_number] == [r.info["action"] for r in by_text]
        assert by_number[-1].outcome_reward == by_text[-1].outcome_reward
    spec = get_task("household")
    assert (
        spec.demonstrate(CLEAN_MUG, random.Random(0)) == CLEAN_MUG_SOLUTION
    )  # text by default (Random(0) draws no skip)
    with pytest.raises(ValueError, match="error_rate"):
        hh.build_task(error_rate=2.0)
