"""Multi-hop question answering with the search tool (HotpotQA, 2WikiMultihopQA, MuSiQue), scored by EM or F1.

The model searches a passage corpus (``agent_r1.tools.search``) as often as it needs and ends with
``<answer>...</answer>`` — the setting of Search-R1 (Jin et al. 2025, arXiv 2503.09516) and of the
Agent-R1 paper's multi-hop QA experiments. Scoring follows the official HotpotQA evaluation script
(Yang et al. 2018): answers are normalised (lower case, no punctuation, no articles ``a/an/the``,
single spaces); ``exact_match`` is 1.0 for equal normal forms; ``f1`` is the token-overlap F1, which is
0 when either side is ``yes`` / ``no`` / ``noanswer`` and they differ. A row's ``answer_aliases``
(MuSiQue's) are gold answers too: the score is the maximum over answer and aliases, as in MuSiQue's
official metric (Trivedi et al. 2022, ``metrics/answer.py``).

Data: ``load_questions(path)`` reads three formats (a JSON array, or JSONL), told apart per row by
their fields, or fixed by ``format``:

- ``hotpotqa`` (Yang et al. 2018): ``_id``, ``question``, ``answer``, optionally ``type``, ``level``,
  ``supporting_facts`` (``[[title, sentence_index], ...]``) and ``context`` (``[[title, [sentence, ...]], ...]``);
- ``2wikimultihopqa`` (Ho et al. 2020): the same layout, told apart by its ``evidences`` field or its
  question types (``comparison``, ``inference``, ``compositional``, ``bridge_comparison``);
- ``musique`` (Trivedi et al. 2022, JSONL): ``id``, ``question``, ``answer``, ``answer_aliases``,
  ``paragraphs`` (``[{idx, title, paragraph_text, is_supporting}, ...]``) and ``answerable``. Rows with
  ``answerable: false`` (MuSiQue-Full's unanswerable contrasts) are left out: an answer metric cannot
  score them.

``path`` may be one file or a list (e.g. HotpotQA + 2WikiMultihopQA train files). The corpus is a
passage file (``agent_r1.tools.search.load_corpus``: ``{id, title, text}`` rows or Search-R1's wiki-18
``{id, contents}`` rows: the open-domain setting), or is built from the files' own paragraphs
(``corpus_from_questions``: the distractor setting, pooled over all questions), or is a Search-R1
retrieval server (``retriever_url``). ``data/hotpotqa_sample.json`` (8 hand-written questions over
``data/wiki_sample.jsonl``) is shipped for tests and demos; bring the real files yourself (they are
not downloaded). See docs/search_agent.md.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import json
import random
import re
import string
from collections.abc import Callable, Iterable, Mapping, Sequence
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
    "FORMATS",
    "check_reward",
    "corpus_from_questions",
    "exact_match",
    "extract_answer",
    "f1",
    "load_questions",
    "make_dataset",
    "normalize_answer",
    "search_task",
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
    """1.0 when the normalised answer equals the normalised ``task["answer"]`` or one of its aliases."""
    return max(float(normalize_answer(answer) == normalize_answer(gold)) for gold in _references(task))


def f1(answer: str, task: Mapping[str, Any]) -> float:
    """Token-overlap F1 (the HotpotQA script's ``f1_score``), the best over answer and aliases."""
    return max(_f1(answer, gold) for gold in _references(task))


def _f1(answer: str, gold: str) -> float:
    prediction, reference = normalize_answer(answer), normalize_answer(gold)
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


def _references(task: Mapping[str, Any]) -> list[str]:
    if "answer" not in task:
        raise ValueError(f"multi-hop QA scoring needs task['answer']; the task has fields {sorted(task)}")
    return [str(task["answer"]), *(str(alias) for alias in task.get("answer_aliases") or ())]


def extract_answer(text: str) -> str | None:
    """The text inside the last ``<answer>...</answer>``, stripped; None when there is none."""
    found = _ANSWER_RE.findall(text)
    return found[-1].strip() if found else None


REWARDS = {"exact_match": exact_match, "f1": f1}


# --------------------------------------------------------------------------------------------- data


FORMATS = ("hotpotqa", "2wikimultihopqa", "musique")
_TWOWIKI_TYPES = frozenset({"comparison", "inference", "compositional", "bridge_comparison"})
_LAYOUTS = (
    "a HotpotQA / 2WikiMultihopQA row (_id, question, answer, context: [[title, [sentences]], ...]) "
    "or a MuSiQue row (id, question, answer, paragraphs: [{title, paragraph_text, ...}, ...])"
)

PathOrPaths = str | Path | Sequence[str | Path]


def _as_paths(path: PathOrPaths) -> list[Path]:
    return [Path(path)] if isinstance(path, (str, Path)) else [Path(p) for p in path]


def _read_records(path: Path) -> list[Any]:
    if not path.exists():
        raise FileNotFoundError(f"multi-hop QA file {path} does not exist")
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


def _format_of(record: Any, where: str, format: str | None) -> str:
    """The row's format: ``format`` when given (checked), else told by its fields."""
    if not isinstance(record, Mapping):
        raise ValueError(f"{where}: expected an object, got {type(record).__name__}")
    if isinstance(record.get("paragraphs"), list):
        found = "musique"
    elif isinstance(record.get("context"), list) or "_id" in record:
        is_2wiki = "evidences" in record or record.get("type") in _TWOWIKI_TYPES
        found = "2wikimultihopqa" if is_2wiki else "hotpotqa"
    else:
        found = None
    strings = all(isinstance(record.get(key), str) for key in ("question", "answer"))
    if format is not None:
        if format not in FORMATS:
            raise ValueError(f"multi-hop QA format {format!r} is unknown; choose from {', '.join(FORMATS)}")
        # HotpotQA and 2WikiMultihopQA share a layout; only MuSiQue's differs.
        if strings and (found == "musique") == (format == "musique"):
            return format
        raise ValueError(f"{where}: not a {format} row; expected {_LAYOUTS}; it has fields {sorted(record)}")
    if found is None and strings:
        found = "hotpotqa"  # question + answer alone: a HotpotQA row without its context
    if found is None or not strings:
        raise ValueError(f"{where}: expected {_LAYOUTS}; it has fields {sorted(record)}")
    return found


def _paragraphs(record: Mapping[str, Any], row_format: str, where: str) -> list[tuple[str, str]]:
    """``(title, text)`` of every paragraph a row carries."""
    if row_format == "musique":
        items = record["paragraphs"]
        if not all(isinstance(p, Mapping) and isinstance(p.get("paragraph_text"), str) for p in items):
            raise ValueError(f"{where}: MuSiQue paragraphs must be objects with a string 'paragraph_text'")
        return [(str(p.get("title") or ""), p["paragraph_text"]) for p in items]
    pairs = []
    for item in record.get("context") or []:
        if not (isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[1], list)):
            raise ValueError(f"{where}: context items must be [title, [sentences]], got {item!r:.120}")
        pairs.append((str(item[0]), " ".join(item[1]).strip()))
    return pairs


def _row(record: Mapping[str, Any], row_format: str, index: int) -> dict[str, Any]:
    if row_format == "musique":
        row_id = record.get("id", index)
        supporting = {p.get("title") for p in record["paragraphs"] if p.get("is_supporting")}
        aliases = [str(a) for a in record.get("answer_aliases") or []]
    else:
        row_id = record.get("_id", record.get("id", index))
        supporting = {fact[0] for fact in record.get("supporting_facts") or []}
        aliases = []
    return {
        "id": str(row_id),
        "prompt": [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": record["question"]},
        ],
        "question": record["question"],
        "answer": record["answer"],
        "answer_aliases": aliases,
        "dataset": row_format,
        "type": str(record.get("type", "")),
        "level": str(record.get("level", "")),
        "supporting_titles": sorted(str(t) for t in supporting if t is not None),
    }


def load_questions(path: PathOrPaths, *, format: str | None = None) -> list[dict[str, Any]]:
    """Questions of HotpotQA / 2WikiMultihopQA / MuSiQue files as task rows.

    Rows hold ``id`` (``_id`` or ``id``), ``prompt`` (system + user messages), ``question``, ``answer``,
    ``answer_aliases`` (MuSiQue's; else empty), ``dataset`` (the format), ``type``, ``level`` and
    ``supporting_titles`` (the titles of the supporting facts or paragraphs, for analysis). ``format``:
    one of ``FORMATS`` for every row, or None to tell each row's format by its fields.
    """
    rows = []
    for file in _as_paths(path):
        for index, record in enumerate(_read_records(file)):
            row_format = _format_of(record, f"{file}, row {index}", format)
            if row_format == "musique" and record.get("answerable") is False:
                continue
            rows.append(_row(record, row_format, index))
    return rows


def corpus_from_questions(paths: Iterable[str | Path], *, format: str | None = None) -> list[Passage]:
    """One passage per distinct (title, text) paragraph of the given question files (the distractor
    setting's paragraphs, pooled over all questions); ids are titles, ``title (2)`` etc. on repeats."""
    passages: dict[tuple[str, str], Passage] = {}
    per_title: collections.Counter[str] = collections.Counter()
    for file in paths:
        for index, record in enumerate(_read_records(Path(file))):
            where = f"{file}, row {index}"
            for title, text in _paragraphs(record, _format_of(record, where, format), where):
                if (title, text) not in passages:
                    per_title[title] += 1
                    passage_id = title if per_title[title] == 1 else f"{title} ({per_title[title]})"
                    passages[title, text] = Passage(id=passage_id, title=title, text=text)
    return list(passages.values())


def _in_test_split(row_id: str, fraction: float) -> bool:
    return hashlib.sha256(row_id.encode()).digest()[0] < 256 * fraction


def make_dataset(
    n: int | None = None,
    *,
    split: str = "train",
    seed: int = 0,
    path: PathOrPaths = SAMPLE_PATH,
    test_path: PathOrPaths | None = None,
    test_fraction: float = 0.25,
    format: str | None = None,
) -> list[dict[str, Any]]:
    """The first ``n`` questions (all when None) of ``split``, shuffled with ``seed``.

    With ``test_path`` the test split is that file (or files); without it, a hash of each question's id puts a
    ``test_fraction`` of ``path`` in the test split (disjoint from train whatever the seed).
    """
    if split not in ("train", "test"):
        raise ValueError(f"multihop_qa make_dataset: split must be 'train' or 'test', got {split!r}")
    if test_path is not None:
        rows = load_questions(test_path if split == "test" else path, format=format)
    else:
        rows = [
            r
            for r in load_questions(path, format=format)
            if _in_test_split(r["id"], test_fraction) == (split == "test")
        ]
    random.Random(f"multihop_qa-{split}-{seed}").shuffle(rows)
    if n is not None and n > len(rows):
        raise ValueError(f"multihop_qa: asked for {n} {split} questions, but {path} has {len(rows)}")
    return rows if n is None else rows[:n]


@functools.lru_cache(maxsize=8)
def _retriever(corpus: str | None, question_paths: tuple[str, ...], format: str | None) -> BM25Retriever:
    passages = load_corpus(corpus) if corpus else corpus_from_questions(question_paths, format=format)
    return BM25Retriever(passages)


def build_task(
    path: PathOrPaths = SAMPLE_PATH,
    *,
    test_path: PathOrPaths | None = None,
    corpus: str | Path | None = None,
    reward: str = "exact_match",
    top_k: int = 3,
    max_turns: int = 6,
    retriever_url: str | None = None,
    format: str | None = None,
) -> TaskSpec:
    """Multi-hop QA over HotpotQA / 2WikiMultihopQA / MuSiQue files with BM25 search, or a Search-R1
    retrieval server.

    ``path`` / ``test_path``: a file or a list of files (``format``: see ``load_questions``).
    ``corpus``: a JSONL/parquet passage file, e.g. Search-R1's wiki-18 (the open-domain setting);
    default: the built-in sample corpus for the shipped sample, else the paragraphs of ``path`` (and
    ``test_path``): the distractor setting. ``reward``:
    ``"exact_match"`` or ``"f1"``. The index is built once per process and shared by all environments.
    ``retriever_url``: search a Search-R1 ``retrieval_server.py`` there instead (``SearchR1Retriever``;
    the server's base URL or its ``/retrieve`` endpoint), e.g. an E5 / FAISS index; no corpus is loaded.
    """
    check_reward("multihop_qa", reward)
    if retriever_url is not None and corpus is not None:
        raise ValueError(f"multihop_qa: give corpus ({corpus}) or retriever_url ({retriever_url}), not both")
    if format is not None and format not in FORMATS:
        raise ValueError(f"multihop_qa format {format!r} is unknown; choose from {', '.join(FORMATS)}")
    if corpus is None and _as_paths(path) == [SAMPLE_PATH]:
        corpus = SAMPLE_CORPUS
    sources = tuple(str(p) for p in [*_as_paths(path), *_as_paths(test_path or [])])
    corpus_key = None if corpus is None else str(corpus)
    return search_task(
        "multihop_qa",
        make_dataset=functools.partial(make_dataset, path=path, test_path=test_path, format=format),
        retriever=lambda: _retriever(corpus_key, sources, format),
        retriever_url=retriever_url,
        reward=reward,
        top_k=top_k,
        max_turns=max_turns,
    )


def check_reward(task: str, reward: str) -> None:
    """Refuse a ``reward`` that is not one of ``REWARDS``, naming ``task``."""
    if reward not in REWARDS:
        raise ValueError(f"{task} reward {reward!r} is unknown; choose from {', '.join(REWARDS)}")


def search_task(
    name: str,
    *,
    make_dataset: Callable[..., list[dict]],
    retriever: Callable[[], Any],
    retriever_url: str | None,
    reward: str,
    top_k: int,
    max_turns: int,
    demonstrate: Callable | None = None,
) -> TaskSpec:
    """A multi-hop QA task ``name``: the ``search`` tool over ``retriever()`` (called in each
    environment's process), or a Search-R1 retrieval server at ``retriever_url`` instead, the
    ``<answer>`` rule and ``reward`` (``REWARDS``: exact match or F1)."""
    check_reward(name, reward)
    remote = None if retriever_url is None else SearchR1Retriever(retriever_url)

    def tools() -> list[Any]:
        return [search_tool(remote or retriever(), k=top_k)]

    return TaskSpec(
        name=name,
        make_dataset=make_dataset,
        tools=tools,
        tool_format=lambda: "hermes",
        extract_answer=extract_answer,
        reward=REWARDS[reward],
        demonstrate=demonstrate,
        max_turns=max_turns,
        required_fields=("prompt", "answer"),
    )
