"""Multi-hop question answering with the search tool (HotpotQA-style), scored by exact match or F1.

The model searches a passage corpus (``agent_r1.tools.search``) as often as it needs and ends with
``<answer>...</answer>`` — the setting of Search-R1 (Jin et al. 2025, arXiv 2503.09516) and of the
Agent-R1 paper's multi-hop QA experiments. Scoring follows the official HotpotQA evaluation script
(Yang et al. 2018): answers are normalised (lower case, no punctuation, no articles ``a/an/the``,
single spaces); ``exact_match`` is 1.0 for equal normal forms; ``f1`` is the token-overlap F1, which is
0 when either side is ``yes`` / ``no`` / ``noanswer`` and they differ.

Data: ``load_hotpotqa(path)`` reads files in the HotpotQA format (a JSON array as distributed, or
JSONL): ``_id``, ``question``, ``answer``, optionally ``type``, ``level``, ``supporting_facts`` and
``context`` (``[[title, [sentence, ...]], ...]``). The corpus is a JSONL/parquet passage file, or is
built from the files' ``context`` paragraphs (``corpus_from_hotpotqa``). ``data/hotpotqa_sample.json``
(8 hand-written questions over ``data/wiki_sample.jsonl``) is shipped for tests and demos; bring the
real HotpotQA files yourself (they are not downloaded).
"""

from __future__ import annotations

import collections
import functools
import hashlib
import json
import random
import re
import string
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from agent_r1.tasks import TaskSpec
from agent_r1.tools.search import BM25Retriever, Passage, load_corpus, search_tool
from agent_r1.tools.search_r1 import SearchR1Retriever

__all__ = [
    "SAMPLE_CORPUS",
    "SAMPLE_PATH",
    "SYSTEM_PROMPT",
    "build_task",
    "corpus_from_hotpotqa",
    "exact_match",
    "extract_answer",
    "f1",
    "load_hotpotqa",
    "make_dataset",
    "normalize_answer",
]

DATA_DIR = Path(__file__).resolve().parent / "data"
SAMPLE_PATH = DATA_DIR / "hotpotqa_sample.json"
SAMPLE_CORPUS = DATA_DIR / "wiki_sample.jsonl"
SYSTEM_PROMPT = (
    "Answer the question. Use the search tool to look facts up; a question may need several searches, "
    "one fact at a time. When you know the answer, write it alone, as short as possible, as "
    "<answer>...</answer>."
)
_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_PUNCTUATION = set(string.punctuation)


# ------------------------------------------------------------------------------------------ scoring


def normalize_answer(text: str) -> str:
    """HotpotQA/SQuAD normal form: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(answer: str, task: Mapping[str, Any]) -> float:
    """1.0 when the normalised answer equals the normalised ``task["answer"]``."""
    return float(normalize_answer(answer) == normalize_answer(_reference(task)))


def f1(answer: str, task: Mapping[str, Any]) -> float:
    """Token-overlap F1 between normalised answer and reference (the HotpotQA script's ``f1_score``)."""
    prediction, reference = normalize_answer(answer), normalize_answer(_reference(task))
    special = ("yes", "no", "noanswer")
    if (prediction in special or reference in special) and prediction != reference:
        return 0.0
    predicted_tokens, reference_tokens = prediction.split(), reference.split()
    common = collections.Counter(predicted_tokens) & collections.Counter(reference_tokens)
    overlap = sum(common.values())
    if overlap == 0:
        return 0.0
    precision, recall = overlap / len(predicted_tokens), overlap / len(reference_tokens)
    return 2 * precision * recall / (precision + recall)


def _reference(task: Mapping[str, Any]) -> str:
    if "answer" not in task:
        raise ValueError(f"multi-hop QA scoring needs task['answer']; the task has fields {sorted(task)}")
    return str(task["answer"])


def extract_answer(text: str) -> str | None:
    """The text inside the last ``<answer>...</answer>``, stripped; None when there is none."""
    found = _ANSWER_RE.findall(text)
    return found[-1].strip() if found else None


REWARDS = {"exact_match": exact_match, "f1": f1}


# --------------------------------------------------------------------------------------------- data


def _read_records(path: Path) -> list[Any]:
    if not path.exists():
        raise FileNotFoundError(f"HotpotQA file {path} does not exist")
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        records = []
        for line_number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}, line {line_number}: not JSON ({e})") from e
        return records
    try:
        records = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e}); HotpotQA files are a JSON array (or use .jsonl)") from e
    if not isinstance(records, list):
        raise ValueError(f"{path}: expected a JSON array of questions, got {type(records).__name__}")
    return records


def load_hotpotqa(path: str | Path) -> list[dict[str, Any]]:
    """Questions of a HotpotQA-format file as task rows.

    Rows hold ``id`` (``_id``), ``prompt`` (system + user messages), ``question``, ``answer``, ``type``,
    ``level`` and ``supporting_titles`` (the titles of the supporting facts, for analysis).
    """
    path = Path(path)
    rows = []
    for index, record in enumerate(_read_records(path)):
        where = f"{path}, question {index}"
        if not isinstance(record, Mapping):
            raise ValueError(f"{where}: expected an object, got {type(record).__name__}")
        for key in ("question", "answer"):
            if not isinstance(record.get(key), str):
                raise ValueError(f"{where}: needs a string {key!r} field; it has {sorted(record)}")
        facts = record.get("supporting_facts") or []
        rows.append(
            {
                "id": str(record.get("_id", record.get("id", index))),
                "prompt": [
                    {"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": record["question"]},
                ],
                "question": record["question"],
                "answer": record["answer"],
                "type": str(record.get("type", "")),
                "level": str(record.get("level", "")),
                "supporting_titles": sorted({fact[0] for fact in facts}),
            }
        )
    return rows


def corpus_from_hotpotqa(paths: Iterable[str | Path]) -> list[Passage]:
    """One passage per distinct ``context`` paragraph title of the given HotpotQA files."""
    passages: dict[str, Passage] = {}
    for path in paths:
        for index, record in enumerate(_read_records(Path(path))):
            for item in record.get("context") or []:
                if not (isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[1], list)):
                    raise ValueError(f"{path}, question {index}: context items must be [title, [sentences]]")
                title, sentences = item
                passages.setdefault(title, Passage(id=title, title=title, text=" ".join(sentences).strip()))
    return list(passages.values())


def _in_test_split(row_id: str, fraction: float) -> bool:
    return hashlib.sha256(row_id.encode()).digest()[0] < 256 * fraction


def make_dataset(
    n: int | None = None,
    *,
    split: str = "train",
    seed: int = 0,
    path: str | Path = SAMPLE_PATH,
    test_path: str | Path | None = None,
    test_fraction: float = 0.25,
) -> list[dict[str, Any]]:
    """The first ``n`` questions (all when None) of ``split``, shuffled with ``seed``.

    With ``test_path`` the test split is that file; without it, a hash of each question's id puts a
    ``test_fraction`` of ``path`` in the test split (disjoint from train whatever the seed).
    """
    if split not in ("train", "test"):
        raise ValueError(f"multihop_qa make_dataset: split must be 'train' or 'test', got {split!r}")
    if test_path is not None:
        rows = load_hotpotqa(test_path if split == "test" else path)
    else:
        rows = [r for r in load_hotpotqa(path) if _in_test_split(r["id"], test_fraction) == (split == "test")]
    random.Random(f"multihop_qa-{split}-{seed}").shuffle(rows)
    if n is not None and n > len(rows):
        raise ValueError(f"multihop_qa: asked for {n} {split} questions, but {path} has {len(rows)}")
    return rows if n is None else rows[:n]


@functools.lru_cache(maxsize=8)
def _retriever(corpus: str | None, hotpotqa_paths: tuple[str, ...]) -> BM25Retriever:
    passages = load_corpus(corpus) if corpus else corpus_from_hotpotqa(hotpotqa_paths)
    return BM25Retriever(passages)


def build_task(
    path: str | Path = SAMPLE_PATH,
    *,
    test_path: str | Path | None = None,
    corpus: str | Path | None = None,
    reward: str = "exact_match",
    top_k: int = 3,
    max_turns: int = 6,
    retriever_url: str | None = None,
) -> TaskSpec:
    """Multi-hop QA over a HotpotQA-format file with BM25 search, or a Search-R1 retrieval server.

    ``corpus``: a JSONL/parquet passage file; default: the built-in sample corpus for the shipped
    sample, else the ``context`` paragraphs of ``path`` (and ``test_path``). ``reward``:
    ``"exact_match"`` or ``"f1"``. The index is built once per process and shared by all environments.
    ``retriever_url``: search a Search-R1 ``retrieval_server.py`` there instead (``SearchR1Retriever``;
    the server's base URL or its ``/retrieve`` endpoint), e.g. an E5 / FAISS index; no corpus is loaded.
    """
    if reward not in REWARDS:
        raise ValueError(f"multihop_qa reward {reward!r} is unknown; choose from {', '.join(REWARDS)}")
    if retriever_url is not None and corpus is not None:
        raise ValueError(f"multihop_qa: give corpus ({corpus}) or retriever_url ({retriever_url}), not both")
    remote = None if retriever_url is None else SearchR1Retriever(retriever_url)
    if corpus is None and Path(path) == SAMPLE_PATH:
        corpus = SAMPLE_CORPUS
    sources = tuple(str(p) for p in (path, test_path) if p is not None)
    corpus_key = None if corpus is None else str(corpus)

    def tools() -> list[Any]:
        return [search_tool(remote or _retriever(corpus_key, sources), k=top_k)]

    return TaskSpec(
        name="multihop_qa",
        make_dataset=functools.partial(make_dataset, path=path, test_path=test_path),
        tools=tools,
        tool_format=lambda: "hermes",
        extract_answer=extract_answer,
        reward=REWARDS[reward],
        max_turns=max_turns,
        required_fields=("prompt", "answer"),
    )
