"""Multi-hop QA: HotpotQA scoring by hand, the loader and its errors, and a two-search episode."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from agent_r1.envs.tool_env import ToolEnv
from agent_r1.tasks import get_task
from agent_r1.tasks.multihop_qa import (
    SAMPLE_PATH,
    build_task,
    corpus_from_questions,
    exact_match,
    extract_answer,
    f1,
    load_questions,
    make_dataset,
    normalize_answer,
)
from agent_r1.tools.search import builtin_corpus
from agent_r1.types import Action


def test_normalize_answer_like_the_hotpotqa_script() -> None:
    assert normalize_answer("The  Black Sea!") == "black sea"
    assert normalize_answer("an Apple, a day") == "apple day"


@pytest.mark.parametrize(
    ("answer", "reference", "em", "f1_score"),
    [
        ("the Seine", "Seine", 1.0, 1.0),
        ("Portland, Maine", "Portland, Maine", 1.0, 1.0),
        ("Portland", "Portland, Maine", 0.0, 2 * (1 * 0.5) / 1.5),  # precision 1, recall 1/2
        ("University of Oxford in England", "University of Oxford", 0.0, 2 * (3 / 5) * 1 / (3 / 5 + 1)),
        ("no", "no", 1.0, 1.0),
        ("no way", "no", 0.0, 0.0),  # yes/no answers get no partial credit
        ("Cincinnati", "Dijon", 0.0, 0.0),
    ],
)
def test_exact_match_and_f1(answer: str, reference: str, em: float, f1_score: float) -> None:
    task = {"answer": reference}
    assert exact_match(answer, task) == em
    assert f1(answer, task) == pytest.approx(f1_score)


def test_shipped_sample_loads_and_its_facts_are_in_the_corpus() -> None:
    rows = load_questions(SAMPLE_PATH)
    assert len(rows) == 8
    titles = {p.title for p in builtin_corpus()}
    for row in rows:
        assert row["prompt"][-1] == {"role": "user", "content": row["question"]}
        assert set(row["supporting_titles"]) <= titles
    # The corpus built from the file's contexts is the shipped corpus.
    assert {p.title: p.text for p in corpus_from_questions([SAMPLE_PATH])} == {
        p.title: p.text for p in builtin_corpus()
    }


def test_splits_are_disjoint_and_seeded() -> None:
    train, test = make_dataset(split="train"), make_dataset(split="test")
    assert len(train) + len(test) == 8 and test
    assert not {r["id"] for r in train} & {r["id"] for r in test}
    assert make_dataset(3, seed=1) == make_dataset(3, seed=1)
    with pytest.raises(ValueError, match=r"asked for 100 train questions, but .* has 6"):
        make_dataset(100)


def test_user_files_jsonl_with_separate_test_file(tmp_path: Path) -> None:
    records = json.loads(SAMPLE_PATH.read_text())
    train, test = tmp_path / "train.jsonl", tmp_path / "dev.json"
    train.write_text("\n".join(json.dumps(r) for r in records[:5]))
    test.write_text(json.dumps(records[5:]))
    spec = build_task(train, test_path=test, reward="f1")
    assert [r["id"] for r in spec.make_dataset(split="test")] != []
    assert {r["id"] for r in spec.make_dataset(split="test")} == {r["_id"] for r in records[5:]}
    assert len(spec.make_dataset(split="train")) == 5
    [search] = spec.tools()  # a corpus built from both files' contexts
    assert len(search.retriever) == len(corpus_from_questions([train, test]))
    assert spec.reward("Portland", {"answer": "Portland, Maine"}) == pytest.approx(2 / 3)


def test_loader_errors_name_the_question(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(
        json.dumps([{"_id": "x", "question": "q?", "answer": "a"}, {"_id": "y", "question": "q?"}])
    )
    with pytest.raises(
        ValueError, match=r"bad.json, row 1: expected a HotpotQA .* it has fields \['_id', 'question'\]"
    ):
        load_questions(bad)
    with pytest.raises(ValueError, match="reward 'bleu' is unknown; choose from exact_match, f1"):
        build_task(reward="bleu")
    with pytest.raises(FileNotFoundError):
        load_questions(tmp_path / "missing.json")


def test_two_hop_episode_in_tool_env(tiny_tokenizer) -> None:
    spec = get_task("multihop_qa")
    row = next(r for r in load_questions(SAMPLE_PATH) if r["id"] == "sample-1")
    env = ToolEnv(
        tiny_tokenizer,
        spec.tools(),
        format=spec.tool_format(),
        outcome_reward=spec.reward,
        extract_answer=spec.extract_answer,
        max_turns=spec.max_turns,
    )

    def search(query: str) -> str:
        return f'<tool_call>\n{{"name": "search", "arguments": {{"query": "{query}"}}}}\n</tool_call>'

    responses = [
        search("Jaws 1975 film director"),
        search("Steven Spielberg born"),
        "<answer>Cincinnati</answer>",
    ]

    async def episode():
        await env.reset(row)
        return [
            await env.step(Action(text, tiny_tokenizer.encode(text, add_special_tokens=False)))
            for text in responses
        ]

    first, second, last = asyncio.run(episode())
    assert first.info["tool_results"][0].startswith("[1] Jaws (film): ")
    assert "born in Cincinnati" in second.info["tool_results"][0]
    assert last.terminated and last.outcome_reward == 1.0
    assert extract_answer(responses[-1]) == "Cincinnati"
