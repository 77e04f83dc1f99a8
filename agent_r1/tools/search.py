"""The ``search`` tool: retrieval over a passage corpus, behind a ``Retriever`` protocol.

Any object with ``search(query, k) -> list[Passage]`` is a retriever. Shipped:

- ``BM25Retriever`` — Okapi BM25 (Robertson & Zaragoza 2009, "The Probabilistic Relevance Framework:
  BM25 and Beyond") over an in-memory inverted index, pure Python:
  ``score(q, d) = sum_t idf(t) * tf(t, d) * (k1 + 1) / (tf(t, d) + k1 * (1 - b + b * |d| / avgdl))``
  with the non-negative idf of Lucene, ``idf(t) = ln(1 + (N - df(t) + 0.5) / (df(t) + 0.5))``.
  Fine up to ~10^5-10^6 short passages; beyond that use a dedicated engine behind ``HTTPRetriever``.
- ``HTTPRetriever`` — any search service that answers ``POST {"query": str, "k": int}`` with
  ``{"passages": [{"id", "title", "text", "score"}, ...]}`` (e.g. a dense retriever on a GPU box).

Corpora load from JSONL or parquet (``load_corpus``): one passage per row with ``text`` and optional
``id`` and ``title``, or Search-R1's wiki-18 rows ``{"id", "contents"}`` with ``contents`` =
``'"Title"\\ntext'`` (``split_contents``). ``builtin_corpus()`` is a small encyclopedia sample
shipped for tests and demos.

    retriever = BM25Retriever(load_corpus("wiki.jsonl"))
    search = search_tool(retriever, k=3)          # a Tool named "search" taking {"query": str}
"""

from __future__ import annotations

import asyncio
import heapq
import json
import math
import re
import urllib.request
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from agent_r1.tools.base import Tool

__all__ = [
    "BM25Retriever",
    "HTTPRetriever",
    "Passage",
    "Retriever",
    "SearchTool",
    "builtin_corpus",
    "format_passages",
    "load_corpus",
    "search_tool",
    "split_contents",
    "tokenize",
]

BUILTIN_CORPUS = Path(__file__).resolve().parent.parent / "tasks" / "data" / "wiki_sample.jsonl"

_TOKEN_RE = re.compile(r"\w+", re.UNICODE)
_STOPWORDS = frozenset(
    [
        "a",
        "an",
        "and",
        "are",
        "as",
        "at",
        "be",
        "but",
        "by",
        "for",
        "from",
        "had",
        "has",
        "have",
        "he",
        "her",
        "his",
        "how",
        "in",
        "is",
        "it",
        "its",
        "of",
        "on",
        "or",
        "she",
        "that",
        "the",
        "their",
        "them",
        "they",
        "this",
        "to",
        "was",
        "were",
        "what",
        "when",
        "where",
        "which",
        "who",
        "whom",
        "why",
        "will",
        "with",
    ]
)


@dataclass(frozen=True)
class Passage:
    id: str
    text: str
    title: str = ""
    score: float = 0.0  # the retriever's relevance score for the query that returned it


@runtime_checkable
class Retriever(Protocol):
    def search(self, query: str, k: int) -> list[Passage]:
        """The ``k`` most relevant passages for ``query``, best first."""
        ...


def tokenize(text: str) -> list[str]:
    """Lower-cased word tokens without English stopwords (the BM25 analyser)."""
    return [t for t in _TOKEN_RE.findall(text.lower()) if t not in _STOPWORDS]


class BM25Retriever:
    """Okapi BM25 over passages (title and text are indexed together). See the module docstring."""

    def __init__(self, passages: Iterable[Passage], *, k1: float = 1.5, b: float = 0.75) -> None:
        if k1 < 0 or not 0 <= b <= 1:
            raise ValueError(f"BM25Retriever needs k1 >= 0 and 0 <= b <= 1, got k1={k1}, b={b}")
        self.k1, self.b = k1, b
        self.passages: list[Passage] = list(passages)
        self._postings: dict[str, list[tuple[int, int]]] = {}  # term -> [(passage index, tf)]
        self._lengths: list[int] = []
        for index, passage in enumerate(self.passages):
            terms = tokenize(f"{passage.title} {passage.text}")
            self._lengths.append(len(terms))
            for term, tf in Counter(terms).items():
                self._postings.setdefault(term, []).append((index, tf))
        n = len(self.passages)
        self._avgdl = sum(self._lengths) / n if n else 0.0
        self._idf = {
            term: math.log(1 + (n - len(posts) + 0.5) / (len(posts) + 0.5))
            for term, posts in self._postings.items()
        }

    def __len__(self) -> int:
        return len(self.passages)

    def scores(self, query: str) -> dict[int, float]:
        """BM25 score of every passage sharing a term with the query, by passage index."""
        scores: dict[int, float] = {}
        for term in set(tokenize(query)):
            idf = self._idf.get(term)
            if idf is None:
                continue
            for index, tf in self._postings[term]:
                norm = self.k1 * (1 - self.b + self.b * self._lengths[index] / self._avgdl)
                scores[index] = scores.get(index, 0.0) + idf * tf * (self.k1 + 1) / (tf + norm)
        return scores

    def search(self, query: str, k: int) -> list[Passage]:
        best = heapq.nlargest(k, self.scores(query).items(), key=lambda item: (item[1], -item[0]))
        return [_with_score(self.passages[index], score) for index, score in best]


def _with_score(passage: Passage, score: float) -> Passage:
    return Passage(passage.id, passage.text, passage.title, score)


class HTTPRetriever:
    """A remote search service: ``POST url`` with ``{"query", "k"}`` -> ``{"passages": [...]}``."""

    def __init__(self, url: str, *, timeout: float = 10.0, headers: Mapping[str, str] | None = None) -> None:
        self.url, self.timeout = url, timeout
        self.headers = {"Content-Type": "application/json", **(headers or {})}

    def search(self, query: str, k: int) -> list[Passage]:
        body = json.dumps({"query": query, "k": k}).encode()
        request = urllib.request.Request(self.url, data=body, headers=self.headers, method="POST")
        with urllib.request.urlopen(request, timeout=self.timeout) as response:
            payload = json.loads(response.read())
        if not isinstance(payload, Mapping) or not isinstance(payload.get("passages"), list):
            raise ValueError(
                f"search service {self.url} answered without a 'passages' list: {payload!r:.200}"
            )
        return [
            _passage_from_row(row, i, f"search service {self.url}")
            for i, row in enumerate(payload["passages"])
        ]


def split_contents(contents: str) -> tuple[str, str]:
    """``(title, text)`` of a Search-R1 ``contents`` string: first line (quotes stripped), then the rest."""
    if "\n" not in contents:
        return "", contents
    title, text = contents.split("\n", 1)
    return title.strip().strip('"'), text


def _passage_from_row(row: Any, index: int, where: str) -> Passage:
    if isinstance(row, Mapping) and "text" not in row and isinstance(row.get("contents"), str):
        title, text = split_contents(row["contents"])  # Search-R1's wiki-18 layout
        return Passage(id=str(row.get("id", index)), text=text, title=title)
    if not isinstance(row, Mapping) or not isinstance(row.get("text"), str):
        raise ValueError(
            f"{where}, row {index}: a passage needs a string 'text' field (or Search-R1's 'contents'), "
            f"got {row!r:.200}"
        )
    return Passage(
        id=str(row.get("id", index)),
        text=row["text"],
        title=str(row.get("title") or ""),
        score=float(row.get("score") or 0.0),
    )


def load_corpus(path: str | Path) -> list[Passage]:
    """Passages from a ``.jsonl`` or ``.parquet`` file: ``text`` required, ``id`` and ``title`` optional;
    or Search-R1's ``{"id", "contents"}`` rows (wiki-18), split into title and text."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"corpus file {path} does not exist")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows: Sequence[Any] = pq.read_table(path).to_pylist()
    elif path.suffix in (".jsonl", ".json"):
        rows = []
        with path.open(encoding="utf-8") as f:
            for line_number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}, line {line_number}: not JSON ({e})") from e
    else:
        raise ValueError(f"corpus {path}: unsupported format {path.suffix!r}; use .jsonl or .parquet")
    return [_passage_from_row(row, i, str(path)) for i, row in enumerate(rows)]


def builtin_corpus() -> list[Passage]:
    """The small encyclopedia sample shipped with agent-r1 (also the corpus of the QA sample)."""
    return load_corpus(BUILTIN_CORPUS)


def format_passages(passages: Sequence[Passage]) -> str:
    """What the model reads: numbered passages with their titles."""
    if not passages:
        return "No results."
    return "\n\n".join(
        f"[{i}] {p.title}: {p.text}" if p.title else f"[{i}] {p.text}" for i, p in enumerate(passages, 1)
    )


class SearchTool(Tool):
    """The ``search`` tool over any ``Retriever``; returns the top ``k`` passages as numbered text."""

    def __init__(
        self, retriever: Retriever, *, k: int = 3, name: str = "search", timeout: float = 30.0
    ) -> None:
        if not isinstance(retriever, Retriever):
            raise TypeError(
                f"search_tool needs a Retriever (an object with search(query, k)), got {retriever!r}"
            )
        if k < 1:
            raise ValueError(f"search_tool k must be >= 1, got {k}")
        self.retriever, self.k = retriever, k
        super().__init__(
            name,
            f"Search the knowledge base and return the {k} most relevant passages.",
            {
                "type": "object",
                "properties": {"query": {"type": "string", "description": "what to look for, in keywords"}},
                "required": ["query"],
                "additionalProperties": False,
            },
            timeout=timeout,
        )

    async def run(self, arguments: dict[str, Any]) -> str:
        query = arguments["query"].strip()
        if not query:
            raise ValueError("the query is empty; pass some keywords")
        return format_passages(await asyncio.to_thread(self.retriever.search, query, self.k))


def search_tool(retriever: Retriever | None = None, *, k: int = 3, name: str = "search") -> Tool:
    """The ``search`` tool over ``retriever`` (default: BM25 over the built-in corpus)."""
    return SearchTool(retriever or BM25Retriever(builtin_corpus()), k=k, name=name)
