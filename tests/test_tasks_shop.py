"""The shop task: pages, actions and their feedback, the purchase reward (WebShop's formula on hand-made
cases) and the budget, the search's results, the train / test split, the demonstrator (every task
bought right at error_rate 0, partial credit by its habit), bad rows and arguments, prompt lengths and
the TaskSpec."""

from __future__ import annotations

import asyncio
import random

import pytest
from episodes import play_replies

from agent_r1.envs import check_env
from agent_r1.models.tiny import build_tiny_tokenizer
from agent_r1.models.tokens import observation_ids
from agent_r1.tasks import TaskSpec, available_tasks, get_task
from agent_r1.tasks import shop as sh
from agent_r1.train.sft import replay_demonstrations

# The first train row of seed 0; the catalog is the same for every seed, so its products are fixed.
HEADPHONES = {
    "id": "t",
    "goal": "i need a pair of over ear headphones in blue, and price lower than 130.00 dollars",
    "category": "headphones",
    "attributes": ["over ear"],
    "options": {"color": "blue"},
    "price_limit": 130.0,
    "target": "p214",
    "budget": 6,
}
SOLUTION = ["search[over ear headphones]", "click[p214]", "click[blue]", "click[buy now]"]


def play(task: dict, replies: list[str], env: sh.ShopEnv | None = None):
    """The first observation and every StepResult of an episode driven by ``replies``."""
    return play_replies(env or sh.ShopEnv(), task, replies)


def user_text(observation) -> str:
    return observation.messages[-1]["content"]


def goal_of(task: dict) -> sh.Goal:
    return sh.Goal(task["category"], tuple(task["attributes"]), task["options"], task["price_limit"])


def test_an_episode_reads_as_webshop_and_buying_the_right_product_scores_one():
    assert sh.make_dataset(1, split="train", seed=0)[0] == {**HEADPHONES, "id": "train-0-0"}
    replies = [SOLUTION[0], "click[p214]", "click[silver]", " Click[Blue]<|im_end|>", "click[buy now]"]
    first, results = play(HEADPHONES, replies)
    assert user_text(first) == (
        f"Instruction: {HEADPHONES['goal']}\nPage: search.\n> You are on the search page.\n"
        "Actions:\nsearch[<your query>]"
    )
    listed = user_text(results[0].observation)
    assert 'Page: results for "over ear headphones".' in listed
    assert "1. click[back to search]\n2. click[p214] - sandor over ear headphones, $120.49\n" in listed
    assert listed.count(" - ") == sh.RESULTS_SHOWN
    item = user_text(results[1].observation)
    assert "Page: item p214: sandor over ear headphones, $120.49.\n" in item
    assert "Attributes: over ear, lightweight, bluetooth.\nSelected: none." in item
    assert "1. click[back to search]\n2. click[< prev]\n3. click[buy now]\n4. click[silver] - color" in item
    assert "Selected: color silver." in user_text(results[2].observation)
    replaced = user_text(results[3].observation)
    assert "Selected: color blue." in replaced and "> You select blue (color)." in replaced
    assert results[3].info == {"state": "item p214|silver", "action": "click[blue]", "invalid": False}
    assert all(r.outcome_reward is None and r.reward == 0.0 for r in results[:-1])
    last = results[-1]
    assert last.terminated and not last.truncated and last.observation is None
    assert last.outcome_reward == 1.0 and last.info["success"] is True


def test_an_action_not_admissible_answers_nothing_happens_and_costs_a_step():
    replies = ["click[buy now]", "search[ ]", "p214", SOLUTION[0], "search[mug]", "click[p999]", "99"]
    _, results = play(HEADPHONES, [*replies, "click[p214]"])
    assert [r.info["invalid"] for r in results] == [True, True, True, False, True, True]
    assert "> Nothing happens." in user_text(results[0].observation)
    assert "Page: search." in user_text(results[2].observation)  # unchanged
    assert "Page: results" in user_text(results[4].observation)  # no search bar on the results page
    assert len(results) == HEADPHONES["budget"] and results[-1].truncated  # each one cost its step
    assert results[-1].outcome_reward == 0.0 and results[-1].info["success"] is False


def test_the_budget_truncates_without_a_purchase_and_pages_go_back():
    replies = [SOLUTION[0], "click[p105]", "click[< prev]", "click[back to search]", SOLUTION[0], "2"]
    _, results = play(HEADPHONES, replies)
    assert [r.info["invalid"] for r in results] == [False] * 6
    assert "Page: results" in user_text(results[2].observation)
    assert "Page: search." in user_text(results[3].observation)
    last = results[-1]
    assert len(results) == HEADPHONES["budget"] and last.truncated and not last.terminated
    assert last.outcome_reward == 0.0 and last.info["success"] is False
    _, capped = play(HEADPHONES, SOLUTION, sh.make_env(None, max_turns=3))
    assert len(capped) == 3 and capped[-1].truncated and capped[-1].outcome_reward == 0.0


JACKET_GOAL = sh.Goal("jacket", ("waterproof", "lightweight"), {"color": "blue", "size": "m"}, 50.0)


def jacket(attributes=("waterproof", "lightweight", "hooded"), price=45.99, category="jacket") -> sh.Product:
    options = {"color": ("black", "blue"), "size": ("s", "m")}
    return sh.Product("p1", category, f"brand {category}", attributes, options, price)


@pytest.mark.parametrize(
    ("product", "chosen", "expected"),
    [
        (jacket(), {"color": "blue", "size": "m"}, 1.0),
        (jacket(), {"color": "blue"}, 4 / 5),  # an option missing
        (jacket(), {"color": "black", "size": "m"}, 4 / 5),  # an option wrong
        (jacket(), {}, 3 / 5),
        (jacket(price=55.49), {"color": "blue", "size": "m"}, 4 / 5),  # over the limit
        (jacket(("waterproof", "hooded")), {"color": "blue", "size": "m"}, 4 / 5),  # an attribute missing
        (jacket(category="backpack"), {"color": "blue", "size": "m"}, 0.1),  # wrong category: r_type 0.1
        (jacket(("padded",), 80.49, "backpack"), {"color": "black"}, 0.0),
    ],
)
def test_the_purchase_reward_follows_webshops_formula(product, chosen, expected):
    assert sh.purchase_reward(JACKET_GOAL, product, chosen) == pytest.approx(expected)


def test_a_product_satisfies_a_goal_when_buying_it_can_score_one():
    assert sh.satisfies(jacket(), JACKET_GOAL)
    assert not sh.satisfies(jacket(price=55.49), JACKET_GOAL)
    assert not sh.satisfies(jacket(("waterproof", "hooded")), JACKET_GOAL)
    assert not sh.satisfies(jacket(category="backpack"), JACKET_GOAL)
    assert not sh.satisfies(jacket(), sh.Goal("jacket", (), {"size": "xl"}, 50.0))  # not offered


def test_buying_through_the_env_pays_the_formula():
    _, results = play(HEADPHONES, ["search[waterproof backpack]", "click[p148]", "click[buy now]"])
    product = next(p for p in sh.catalog() if p.id == "p148")
    assert product.category == "backpack" and results[-1].terminated
    expected = sh.purchase_reward(goal_of(HEADPHONES), product, {})
    assert 0.0 < results[-1].outcome_reward == expected < 0.1  # partial credit, r_type 0.1
    _, results = play(HEADPHONES, ["search[over ear headphones]", "click[p264]", "3"])  # $171.49
    assert results[-1].outcome_reward == pytest.approx(1 / 3) and results[-1].info["success"] is False


def test_the_catalog_and_the_search():
    catalog = sh.catalog()
    assert len(catalog) == 360 and len({p.id for p in catalog}) == 360
    assert {p.category for p in catalog} == set(sh.CATEGORIES)
    assert len({p.category for p in sh.search("waterproof")}) > 1  # a shared attribute
    assert sh.search("kelto xyz") and not sh.search("xyz")  # a brand matches; nothing else does
    with_distractor = 0
    for task in sh.make_dataset(200, split="train", seed=2):
        goal = goal_of(task)
        results = sh.search(sh.demonstrator_query(goal))
        assert len(results) == sh.RESULTS_SHOWN and task["target"] in [p.id for p in results]
        assert sh.satisfies(next(p for p in results if p.id == task["target"]), goal)
        with_distractor += any(not sh.satisfies(p, goal) for p in results)
    assert with_distractor >= 160  # most result pages hold a product that does not satisfy it


def test_the_env_passes_check_env():
    check_env(sh.ShopEnv, HEADPHONES, actions=SOLUTION, tokenizer=build_tiny_tokenizer())


def test_splits_are_reproducible_and_disjoint():
    def key(r: dict) -> tuple:
        return (r["category"], tuple(r["attributes"]), tuple(sorted(r["options"].items())), r["price_limit"])

    train = sh.make_dataset(400, split="train", seed=0)
    test = sh.make_dataset(200, split="test", seed=0)
    assert train == sh.make_dataset(400, split="train", seed=0) != sh.make_dataset(400, split="train", seed=1)
    assert not {key(r) for r in train} & {key(r) for r in test}
    assert {r["category"] for r in train} == set(sh.CATEGORIES)
    assert len({r["id"] for r in train + test}) == 600


@pytest.mark.parametrize("split", ["train", "test"])
def test_the_demonstrator_at_error_rate_zero_buys_right_in_four_or_five_actions(split):
    for task in sh.make_dataset(200, split=split, seed=5):
        actions = sh.demonstrate(task, random.Random(0), error_rate=0.0)
        assert 4 <= len(actions) <= 5 and task["budget"] == len(actions) + sh.DEFAULT_SLACK
        assert actions[:2] == [f"search[{sh.demonstrator_query(goal_of(task))}]", f"click[{task['target']}]"]
        _, results = play(task, actions)
        assert results[-1].terminated and results[-1].outcome_reward == 1.0, task["id"]


def test_the_demonstrators_habit_forgets_the_last_option_for_partial_credit():
    habit = sh.demonstrate(HEADPHONES, random.Random(0), error_rate=1.0)
    assert habit == ["search[over ear headphones]", "click[p214]", "click[buy now]"]
    for task in sh.make_dataset(200, split="train", seed=0):
        actions = sh.demonstrate(task, random.Random(0), error_rate=1.0)
        _, results = play(task, actions)
        terms = len(task["attributes"]) + len(task["options"]) + 1
        assert results[-1].outcome_reward == pytest.approx((terms - 1) / terms), task["id"]
        assert 0.0 < results[-1].outcome_reward < 1.0 and results[-1].info["success"] is False
        assert f"click[{list(task['options'].values())[-1]}]" not in actions


def test_the_category_demonstrator_searches_the_category_and_buys_the_best_listed_product():
    """``query="category"``: one of 12 strings to write; when its results hold no product that
    satisfies the goal it buys the one worth most, with the goal's options that product offers."""
    best_of_page, right = [], 0
    for task in sh.make_dataset(200, split="train", seed=4):
        goal = goal_of(task)
        actions = sh.demonstrate(task, random.Random(0), error_rate=0.0, query="category")
        assert actions[0] == f"search[{task['category']}]"
        _, results = play(task, actions)
        listed = sh.search(task["category"])
        offered = [{g: v for g, v in goal.options.items() if v in p.options.get(g, ())} for p in listed]
        worth = [sh.purchase_reward(goal, p, chosen) for p, chosen in zip(listed, offered, strict=True)]
        assert results[-1].terminated and results[-1].outcome_reward == pytest.approx(max(worth)), task["id"]
        right += results[-1].outcome_reward == 1.0
        best_of_page.append(max(worth))
    assert 0 < right < 200 and min(best_of_page) > 0  # some pages hold no right product; none is worthless
    with pytest.raises(ValueError, match="query must be one of goal, category"):
        sh.build_task(query="title")


def test_numbered_replies_play_the_same_episodes_as_text():
    """A listed click's number (``3`` or ``3.``) stands for it; a number past the list, or on the
    search page, is not admissible. The numbered demonstrator plays the text one's actions."""
    _, results = play(HEADPHONES, ["1", SOLUTION[0], "2.", "4", "3"])
    assert results[0].info["invalid"] and [r.info["action"] for r in results[2:]] == [
        "click[p214]",
        "click[silver]",
        "click[buy now]",
    ]
    for task in sh.make_dataset(40, split="test", seed=3):
        texts = sh.demonstrate(task, random.Random(5), error_rate=0.5)
        numbers = sh.demonstrate(task, random.Random(5), error_rate=0.5, numbered=True)
        mixed = sh.demonstrate(task, random.Random(5), error_rate=0.5, numbered=True, options_by_text=True)
        assert numbers[0] == texts[0] and all(n.isdigit() for n in numbers[1:])
        options = {f"click[{v}]" for v in task["options"].values()}
        assert mixed == [t if t in options else n for t, n in zip(texts, numbers, strict=True)]
        _, by_text = play(task, texts)
        for replies in (numbers, mixed):
            _, by_number = play(task, replies)
            assert [r.info["action"] for r in by_number] == [r.info["action"] for r in by_text]
            assert by_number[-1].outcome_reward == by_text[-1].outcome_reward


def test_a_copied_listing_line_reads_as_its_action():
    assert sh.parse_action("Click[ p214 ] - sandor over ear headphones, $120.49<|im_end|>") == "click[p214]"
    assert sh.parse_action("  SEARCH[Over  Ear headphones]") == "search[over ear headphones]"
    assert sh.parse_action("buy it") == "buy it"


def test_prompts_stay_short_for_the_byte_level_model():
    tokenizer = build_tiny_tokenizer()
    tasks = sh.make_dataset(150, split="train", seed=0) + sh.make_dataset(50, split="test", seed=0)
    demos = replay_demonstrations(sh.make_env, tokenizer, tasks, sh.demonstrate, seed=0)
    lengths = [len(step.prompt_ids) for t in demos for step in t.steps]
    assert max(lengths) < 800
    first = asyncio.run(sh.ShopEnv().reset(tasks[0]))
    assert len(observation_ids(first, tokenizer)) == lengths[0]
    _, results = play(HEADPHONES, ["search[" + "headphones " * 30 + "]"])
    assert len(results[0].info["action"]) > 300
    assert 'results for "headphones headphones' in user_text(results[0].observation)
    assert len(user_text(results[0].observation)) < 700  # the query is read up to 60 characters


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"options": None}, "r1.*missing field 'options'"),
        ({"budget": None}, "r1.*missing field 'budget'"),
        ({"budget": "6"}, "r1.*'budget' must be an integer"),
        ({"budget": 3}, "r1.*'budget' 3 is below the shortest solution \\(4 actions\\)"),
        ({"category": "kettle"}, "r1.*'category' 'kettle' is not one of"),
        (
            {"attributes": ["waterproof", "fluffy"]},
            "r1.*'attributes' must be a list of 'headphones' attributes",
        ),
        ({"options": {"size": "m"}}, "r1.*'options' must map 'headphones' option groups"),
        ({"price_limit": "cheap"}, "r1.*'price_limit' must be a positive number"),
        ({"price_limit": 5.0}, "r1.*no product in the catalog satisfies .*unsolvable"),
    ],
)
def test_bad_rows_raise_naming_the_row_and_the_field(change, message):
    task = {**HEADPHONES, "id": "r1", **change}
    task = {k: v for k, v in task.items() if v is not None}
    with pytest.raises(ValueError, match=message):
        asyncio.run(sh.ShopEnv().reset(task))


def test_bad_dataset_and_demonstrator_arguments_raise():
    with pytest.raises(ValueError, match="split must be one of train, test"):
        sh.make_dataset(1, split="unseen")
    with pytest.raises(ValueError, match="n must be >= 1"):
        sh.make_dataset(0)
    with pytest.raises(ValueError, match="slack must be >= 0"):
        sh.make_dataset(1, slack=-1)
    with pytest.raises(ValueError, match="error_rate"):
        sh.demonstrate(HEADPHONES, random.Random(0), error_rate=2.0)
    with pytest.raises(ValueError, match="error_rate"):
        sh.build_task(error_rate=-0.1)
    with pytest.raises(ValueError, match="takes only max_turns"):
        sh.make_env(None, context="append")
    with pytest.raises(ValueError, match="max_turns must be >= 1"):
        sh.make_env(None, max_turns=0)


def test_the_task_spec_builds_the_env_and_declares_its_fields():
    spec = get_task("shop")
    assert "shop" in available_tasks() and isinstance(spec, TaskSpec)
    assert isinstance(spec.make_env(build_tiny_tokenizer()), sh.ShopEnv)
    assert spec.required_fields == sh.ShopEnv.required_fields == sh.make_env.required_fields
    task = spec.make_dataset(1, split="test", seed=0)[0]
    assert set(spec.required_fields) <= set(task) <= set(sh.ShopEnv.task_fields)
    assert spec.max_turns >= task["budget"]
    assert spec.demonstrate(HEADPHONES, random.Random(0)) == SOLUTION  # text by default (no habit drawn)
    assert spec.extract_answer("Click[buy now]<|im_end|>") == "click[buy now]"
