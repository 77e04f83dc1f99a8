"""The fictional multi-hop world: determinism, disjoint splits, every question reachable by BM25 with
the demonstrator's queries, the demonstrator replayed through the real env, EM/F1 through the env,
and the closed-book benchmark's smoke run."""

from __future__ import annotations

import asyncio
import collections
import importlib.util
import random
import sys
from pathlib import Path

import pytest

from agent_r1.tasks import get_task
from agent_r1.tasks import multihop_world as mw
from agent_r1.tasks.multihop_qa import exact_match, extract_answer, normalize_answer
from agent_r1.tasks.prepare import task_env
from agent_r1.types import Action

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def world() -> mw.World:
    return mw.shared_world(0)


@pytest.fixture(scope="module")
def heldout() -> list[dict]:
    return mw.make_dataset(300, split="test", seed=0)


def test_world_and_questions_are_deterministic_by_seed(world) -> None:
    again = mw.generate_world(0)  # built anew
    assert again is not world and again.passages == world.passages
    assert mw.generate_world(1).passages != world.passages
    assert mw.make_dataset(50, split="train", seed=3) == mw.make_dataset(50, split="train", seed=3)
    other = mw.make_dataset(50, split="train", seed=4)
    assert [r["id"] for r in other] != [r["id"] for r in mw.make_dataset(50, split="train", seed=3)]
    # a question keeps its id whatever the seed
    ids = {r["question"]: r["id"] for r in mw.make_dataset(400, split="train", seed=3)}
    assert all(ids.get(r["question"], r["id"]) == r["id"] for r in other)


def test_splits_involve_disjoint_entities(world, heldout) -> None:
    train = mw.make_dataset(600, split="train", seed=0) + mw.make_dataset(300, split="train", seed=1)
    train_entities = {e for row in train for e in row["entities"]}
    test_entities = {e for row in heldout for e in row["entities"]}
    assert not train_entities & test_entities
    assert {world.entities[e].split for e in train_entities} == {"train"}
    assert {world.entities[e].split for e in test_entities} == {"test"}
    # no held-out entity is even named in a train question or answer
    train_text = " ".join(f"{r['question']} {r['answer']}" for r in train)
    assert not [world.entities[e].name for e in test_entities if world.entities[e].name in train_text]


def test_kinds_and_hops_in_both_splits(heldout) -> None:
    train = mw.make_dataset(300, split="train", seed=0)
    for rows in (train, heldout):
        counts = collections.Counter((r["kind"], r["type"], r["hops"]) for r in rows)
        assert set(counts) == {("bridge", "bridge", 2), ("comparison", "comparison", 2),
                               ("3-hop", "compose", 3), ("4-hop", "compose", 4)}  # fmt: skip
        assert min(counts.values()) > 30
        assert {r["answer_type"] for r in rows} >= {
            "person",
            "city",
            "country",
            "organisation",
            "work",
            "year",
        }
        assert all(len(r["steps"]) == r["hops"] for r in rows)
    only_bridges = mw.make_dataset(20, split="test", mix={"bridge": 1.0})
    assert {r["kind"] for r in only_bridges} == {"bridge"}
    with pytest.raises(ValueError, match="mix .* kinds among bridge, comparison, 3-hop, 4-hop"):
        mw.make_dataset(5, mix={"5-hop": 1.0})
    with pytest.raises(ValueError, match="split must be 'train' or 'test'"):
        mw.make_dataset(5, split="dev")


def test_every_heldout_answer_is_reachable_with_the_demonstrators_queries(world, heldout) -> None:
    """Each step's query brings its supporting passage into BM25's top 3, and that passage states the
    step's value; the last step's value is the answer (the comparison's: one of its candidates)."""
    passages = {p.id: p for p in world.passages}
    for row in heldout:
        assert row["supporting_ids"] == list(dict.fromkeys(s["passage"] for s in row["steps"]))
        for step in row["steps"]:
            found = [p.id for p in world.retriever.search(step["query"], 3)]
            assert step["passage"] in found, (row["question"], step)
            assert step["value"] in passages[step["passage"]].text
        if row["type"] == "comparison":
            assert row["answer"] in row["candidates"] and len(set(row["candidates"])) == 2
        else:
            assert row["answer"] == row["steps"][-1]["value"]


def _replay(tokenizer, tasks, demonstrate, seed=0):
    from agent_r1.train.sft import replay_demonstrations

    return replay_demonstrations(
        lambda: task_env(tokenizer, "multihop_world"), tokenizer, tasks, demonstrate, seed=seed
    )


def test_demonstrations_replay_through_the_env(tiny_tokenizer, world, heldout) -> None:
    spec = get_task("multihop_world")
    tasks = [r for r in heldout if r["hops"] == 4][:4] + [r for r in heldout if r["type"] == "comparison"][:4]

    def right(task, rng):
        return mw.demonstrate(task, rng, world=world, error_rate=0.0)

    episodes = _replay(tiny_tokenizer, tasks, right)
    assert all(t.outcome_reward == 1.0 and t.info["success"] for t in episodes)
    for task, episode in zip(tasks, episodes, strict=True):
        assert len(episode.steps) == task["hops"] + 1
        for step, demonstrated in zip(episode.steps, task["steps"], strict=False):
            assert f"] {world.entities[demonstrated['passage']].name}: " in step.info["tool_results"][0]
    # The registered demonstrator errs at its rate; the env's reward equals EM of its answer offline.
    imperfect = _replay(tiny_tokenizer, heldout[:24], spec.demonstrate, seed=1)
    rng = random.Random(1)
    offline = [exact_match(extract_answer(spec.demonstrate(t, rng)[-1]), t) for t in heldout[:24]]
    assert [t.outcome_reward for t in imperfect] == offline and 0 < sum(offline) < 24


def test_demonstrator_error_rate_and_kinds_of_error(world, heldout) -> None:
    rng = random.Random(0)
    early = distractor = 0
    for rate in (0.0, 0.3):
        wrong = 0
        for task in heldout:
            responses = mw.demonstrate(task, rng, world=world, error_rate=rate)
            answer = extract_answer(responses[-1])
            calls = len(responses) - 1
            assert calls <= task["hops"] and all(r.startswith("<tool_call>\n") for r in responses[:-1])
            if exact_match(answer, task) == 1.0:
                assert calls == task["hops"]
                continue
            wrong += 1
            early += calls < task["hops"]
            distractor += calls == task["hops"] and task["type"] != "comparison"
        assert wrong == 0 if rate == 0 else abs(wrong / len(heldout) - rate) < 0.08
    assert early > 10 and distractor > 10


def test_em_and_f1_through_the_env(tiny_tokenizer, heldout) -> None:
    task = next(r for r in heldout if r["answer_type"] == "person")
    first, family = task["answer"].split()

    def episode(answer: str, reward: str) -> float:
        env = task_env(tiny_tokenizer, "multihop_world", task_kwargs={"reward": reward})
        text = f"<answer>{answer}</answer>"

        async def run():
            await env.reset(task)
            return await env.step(Action(text, tiny_tokenizer.encode(text, add_special_tokens=False)))

        result = asyncio.run(run())
        assert result.terminated
        return result.outcome_reward

    assert episode(task["answer"], "exact_match") == 1.0
    assert episode(family, "exact_match") == 0.0
    assert episode(task["answer"].lower() + ".", "f1") == 1.0
    assert episode(family, "f1") == pytest.approx(2 / 3)  # precision 1, recall 1/2
    assert normalize_answer(first) != normalize_answer(family)


def test_registry_and_errors(world) -> None:
    spec = get_task("multihop_world")
    assert spec.name == "multihop_world" and spec.required_fields == ("prompt", "answer")
    [search] = spec.tools()
    assert search.name == "search" and search.retriever is world.retriever
    assert len(world.retriever) == len(world.passages)
    with pytest.raises(ValueError, match="reward 'bleu' is unknown"):
        mw.build_task(reward="bleu")
    with pytest.raises(ValueError, match=r"size: unknown fields \['planets'\]"):
        mw.build_task(size={"planets": 3})
    with pytest.raises(ValueError, match="give a number of questions"):
        spec.make_dataset(None, split="train")


def test_closed_book_benchmark_quick(capsys) -> None:
    spec = importlib.util.spec_from_file_location(
        "multihop_world_benchmark", REPO / "benchmarks" / "multihop_world.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    module.main(["--closed-book", "--quick"])
    out = capsys.readouterr().out
    assert out.startswith("machine: ")
    for label in ("| train's most frequent answer", "| random entity of the answer's type", "| tiny"):
        assert label in out, out
