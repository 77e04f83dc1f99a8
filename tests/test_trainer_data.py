"""Task data: parquet, JSONL, JSON and Hugging Face datasets inputs; missing fields name row and field;
the step-to-tasks order is a pure function of (seed, step)."""

from __future__ import annotations

import json

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from agent_r1.train.data import DataError, TaskSampler, load_tasks

ROWS = [{"id": f"t{i}", "prompt": f"what is {i} + 1?", "answer": str(i + 1)} for i in range(5)]


def test_every_input_format_gives_the_same_rows(tmp_path):
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "tasks.parquet")
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS) + "\n")
    (tmp_path / "tasks.json").write_text(json.dumps(ROWS))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "saved"))
    sources = [
        tmp_path / "tasks.parquet",
        str(tmp_path / "tasks.jsonl"),
        tmp_path / "tasks.json",
        tmp_path / "saved",
        datasets.Dataset.from_list(ROWS),
        ROWS,
    ]
    for source in sources:
        assert load_tasks(source, required_fields=["prompt", "answer"]) == ROWS, source


def test_a_row_without_a_required_field_names_the_row_and_the_field(tmp_path):
    rows = [*ROWS[:3], {"id": "broken", "prompt": "no answer here"}]
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match=r"tasks.jsonl: row 3 \(id 'broken'\) has no field 'answer'"):
        load_tasks(path, required_fields=["prompt", "answer"])


def test_bad_files_are_clear_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{not json\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: not valid JSON"):
        load_tasks(bad)
    with pytest.raises(DataError, match="unsupported extension"):
        load_tasks(tmp_path / "tasks.csv")
    (tmp_path / "scalar.json").write_text("[1, 2]")
    with pytest.raises(DataError, match="row 0 is a int, not a mapping"):
        load_tasks(tmp_path / "scalar.json")
    with pytest.raises(DataError, match="no split 'validation'"):
        load_tasks(datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}), split="validation")


def test_sampler_order_is_a_function_of_seed_and_step():
    tasks = [{"id": i} for i in range(7)]
    sampler = TaskSampler(tasks, 3, seed=1)
    seen = [t["id"] for step in range(1, 8) for t in sampler.batch(step)]
    assert sorted(seen[:7]) == list(range(7)) and sorted(seen[7:14]) == list(range(7))  # whole epochs
    assert seen[:7] != seen[7:14]  # reshuffled each epoch
    fresh = TaskSampler(tasks, 3, seed=1)
    assert [t["id"] for t in fresh.batch(5)] == seen[12:15]  # no state: resume needs only the step
    assert [t["id"] for t in TaskSampler(tasks, 3, seed=2).batch(1)] != seen[:3]
    assert [t["id"] for t in TaskSampler(tasks, 3, shuffle=False).batch(3)] == [6, 0, 1]
