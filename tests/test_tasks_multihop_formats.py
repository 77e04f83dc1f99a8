"""Multi-hop QA reads 2WikiMultihopQA and MuSiQue files beside HotpotQA's, scores MuSiQue's aliases, and
searches a Search-R1 wiki-18 passage file (hand-written rows of each format; nothing is downloaded)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent_r1.tasks.multihop_qa import build_task, corpus_from_questions, exact_match, f1, load_questions
from agent_r1.tools.search import load_corpus

TWOWIKI = [
    {
        "_id": "2w-1",
        "type": "compositional",
        "question": "Who is the mother of the director of film Nightfall Harbour?",
        "answer": "Ada Lindqvist",
        "supporting_facts": [["Nightfall Harbour", 0], ["Piet Lindqvist", 1]],
        "evidences": [["Nightfall Harbour", "director", "Piet Lindqvist"]],
        "context": [
            ["Nightfall Harbour", ["Nightfall Harbour is a 1961 film directed by Piet Lindqvist."]],
            ["Piet Lindqvist", ["Piet Lindqvist was a Swedish director.", "His mother was Ada Lindqvist."]],
        ],
    },
    {
        "_id": "2w-2",
        "type": "comparison",
        "question": "Which film came out first, Nightfall Harbour or Grey Tide?",
        "answer": "Nightfall Harbour",
        "supporting_facts": [["Nightfall Harbour", 0], ["Grey Tide", 0]],
        "evidences": [],
        "context": [
            ["Nightfall Harbour", ["Nightfall Harbour is a 1961 film directed by Piet Lindqvist."]],
            ["Grey Tide", ["Grey Tide is a 1974 drama film."]],
        ],
    },
]

MUSIQUE = [
    {
        "id": "2hop__1_2",
        "question": "What river flows through the birthplace of Mara Voss?",
        "answer": "Oder",
        "answer_aliases": ["Odra", "Oder River"],
        "answerable": True,
        "paragraphs": [
            {
                "idx": 0,
                "title": "Mara Voss",
                "paragraph_text": "Mara Voss was born in Frankfurt (Oder).",
                "is_supporting": True,
            },
            {
                "idx": 1,
                "title": "Frankfurt (Oder)",
                "paragraph_text": "The town lies on the Oder.",
                "is_supporting": True,
            },
            {
                "idx": 2,
                "title": "Mara Voss",
                "paragraph_text": "She later moved to Leipzig.",
                "is_supporting": False,
            },
        ],
    },
    {
        "id": "2hop__3_4",
        "question": "Who founded the label that signed Grey Tide's composer?",
        "answer": "",
        "answer_aliases": [],
        "answerable": False,
        "paragraphs": [
            {"idx": 0, "title": "Grey Tide", "paragraph_text": "Music by I. Berg.", "is_supporting": False}
        ],
    },
]


def _write(tmp_path: Path) -> tuple[Path, Path]:
    twowiki, musique = tmp_path / "2wiki_dev.json", tmp_path / "musique_ans_dev.jsonl"
    twowiki.write_text(json.dumps(TWOWIKI))
    musique.write_text("\n".join(json.dumps(r) for r in MUSIQUE))
    return twowiki, musique


def test_2wiki_and_musique_rows_are_read_by_their_fields(tmp_path: Path) -> None:
    twowiki, musique = _write(tmp_path)
    rows = load_questions([twowiki, musique])
    # MuSiQue-Full's unanswerable contrast question is left out.
    assert [(r["id"], r["dataset"]) for r in rows] == [
        ("2w-1", "2wikimultihopqa"),
        ("2w-2", "2wikimultihopqa"),
        ("2hop__1_2", "musique"),
    ]
    assert rows[0]["supporting_titles"] == ["Nightfall Harbour", "Piet Lindqvist"]
    assert rows[0]["type"] == "compositional" and rows[0]["answer_aliases"] == []
    assert rows[2]["supporting_titles"] == ["Frankfurt (Oder)", "Mara Voss"]
    assert rows[2]["answer_aliases"] == ["Odra", "Oder River"]
    assert rows[2]["prompt"][-1] == {"role": "user", "content": MUSIQUE[0]["question"]}
    assert load_questions(musique, format="musique") == rows[2:]


def test_musique_aliases_are_gold_answers_too() -> None:
    task = {"answer": "Oder", "answer_aliases": ["Odra", "Oder River"]}
    assert exact_match("the Odra", task) == 1.0
    assert f1("Oder River", task) == 1.0
    assert f1("river", task) == pytest.approx(2 * 1 * 0.5 / 1.5)  # best: "Oder River", p 1, r 1/2
    assert exact_match("Elbe", task) == 0.0


def test_distractor_corpus_keeps_paragraphs_of_the_same_title_apart(tmp_path: Path) -> None:
    twowiki, musique = _write(tmp_path)
    passages = corpus_from_questions([twowiki, musique])
    assert [p.id for p in passages] == [
        "Nightfall Harbour",
        "Piet Lindqvist",
        "Grey Tide",
        "Mara Voss",
        "Frankfurt (Oder)",
        "Mara Voss (2)",
        "Grey Tide (2)",
    ]
    assert passages[1].text == "Piet Lindqvist was a Swedish director. His mother was Ada Lindqvist."


def test_a_row_of_no_format_names_the_file_and_row(tmp_path: Path) -> None:
    bad = tmp_path / "mixed.jsonl"
    bad.write_text(json.dumps(MUSIQUE[0]) + "\n" + json.dumps({"id": "z", "query": "q?", "label": "a"}))
    with pytest.raises(
        ValueError,
        match=r"mixed.jsonl, row 1: expected a HotpotQA / 2WikiMultihopQA row .*"
        r"or a MuSiQue row .* it has fields \['id', 'label', 'query'\]",
    ):
        load_questions(bad)
    twowiki, _ = _write(tmp_path)
    with pytest.raises(ValueError, match=r"2wiki_dev.json, row 0: not a musique row"):
        load_questions(twowiki, format="musique")
    with pytest.raises(ValueError, match=r"format 'nq' is unknown; choose from hotpotqa, 2wikimultihopqa"):
        build_task(twowiki, format="nq")


def test_train_on_two_files_test_on_musique_with_a_wiki18_corpus(tmp_path: Path) -> None:
    twowiki, musique = _write(tmp_path)
    hotpot = tmp_path / "hotpot.json"
    hotpot.write_text(json.dumps([{"_id": "h1", "question": "Where is Grey Tide set?", "answer": "Hull"}]))
    wiki = tmp_path / "wiki-18.jsonl"
    wiki.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"id": "0", "contents": '"Mara Voss"\nMara Voss was born in Frankfurt (Oder).'},
                {"id": "1", "contents": '"Frankfurt (Oder)"\nThe town lies on the Oder river.'},
                {"id": "2", "contents": '"Grey Tide"\nGrey Tide is a 1974 drama film set in Hull.'},
            ]
        )
    )
    assert [(p.id, p.title) for p in load_corpus(wiki)][1] == ("1", "Frankfurt (Oder)")
    spec = build_task([hotpot, twowiki], test_path=musique, corpus=wiki, top_k=1)
    assert {r["id"] for r in spec.make_dataset(split="train")} == {"h1", "2w-1", "2w-2"}
    assert [r["id"] for r in spec.make_dataset(split="test")] == ["2hop__1_2"]
    [search] = spec.tools()
    assert len(search.retriever) == 3
    assert [p.title for p in search.retriever.search("which river flows through the town", 1)] == [
        "Frankfurt (Oder)"
    ]
    assert spec.reward("Odra", spec.make_dataset(split="test")[0]) == 1.0
