"""BM25 against hand-computed scores, corpus loading, the HTTP retriever against a local server, the tool."""

from __future__ import annotations

import asyncio
import json
import math
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from agent_r1.tools import ToolCall, ToolSet
from agent_r1.tools.search import (
    BM25Retriever,
    HTTPRetriever,
    Passage,
    Retriever,
    builtin_corpus,
    format_passages,
    load_corpus,
    search_tool,
    tokenize,
)


def test_tokenize_lowercases_and_drops_stopwords() -> None:
    assert tokenize("The Eiffel Tower, in PARIS!") == ["eiffel", "tower", "paris"]


def test_bm25_scores_match_the_formula_by_hand() -> None:
    docs = [Passage("d0", "apple banana"), Passage("d1", "apple apple cherry"), Passage("d2", "cherry")]
    retriever = BM25Retriever(docs, k1=1.5, b=0.75)
    # N = 3, df(apple) = 2 -> idf = ln(1 + 1.5 / 2.5); avgdl = 6 / 3 = 2.
    idf = math.log(1.6)
    d0 = idf * 1 * 2.5 / (1 + 1.5 * (0.25 + 0.75 * 2 / 2))
    d1 = idf * 2 * 2.5 / (2 + 1.5 * (0.25 + 0.75 * 3 / 2))
    assert retriever.scores("apple") == pytest.approx({0: d0, 1: d1})
    hits = retriever.search("apple", k=5)
    assert [p.id for p in hits] == ["d1", "d0"]
    assert hits[0].score == pytest.approx(d1)
    assert retriever.search("durian", k=3) == []


def test_builtin_corpus_finds_the_right_passages() -> None:
    retriever = BM25Retriever(builtin_corpus())
    assert len(retriever) >= 20
    assert retriever.search("who directed Jaws", k=1)[0].title == "Jaws (film)"
    assert retriever.search("Steven Spielberg born", k=1)[0].title == "Steven Spielberg"
    assert {p.title for p in retriever.search("Eiffel Tower engineer", k=2)} == {
        "Eiffel Tower",
        "Gustave Eiffel",
    }
    assert len(retriever.search("river", k=2)) == 2
    assert isinstance(retriever, Retriever)


def test_load_corpus_jsonl_and_parquet(tmp_path: Path) -> None:
    rows = [{"id": "a", "title": "A", "text": "alpha"}, {"text": "beta"}]
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    parquet = tmp_path / "c.parquet"
    pq.write_table(
        pa.Table.from_pylist(
            [{"id": "a", "title": "A", "text": "alpha"}, {"id": "1", "title": None, "text": "beta"}]
        ),
        parquet,
    )
    expected = [Passage("a", "alpha", "A"), Passage("1", "beta", "")]
    assert load_corpus(jsonl) == expected
    assert load_corpus(parquet) == expected


def test_load_corpus_errors_name_the_file_and_row(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"title": "no text"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl, row 1: a passage needs a string 'text'"):
        load_corpus(bad)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "ok"}\n{not json\n')
    with pytest.raises(ValueError, match=r"broken.jsonl, line 2: not JSON"):
        load_corpus(broken)
    with pytest.raises(ValueError, match="unsupported format '.csv'"):
        (tmp_path / "c.csv").write_text("x")
        load_corpus(tmp_path / "c.csv")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_corpus(tmp_path / "missing.jsonl")


@pytest.fixture
def search_service() -> Iterator[str]:
    """A real HTTP search service on loopback, answering from BM25 over the built-in corpus."""
    retriever = BM25Retriever(builtin_corpus())

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            passages = retriever.search(request["query"], request["k"])
            body = json.dumps({"passages": [vars(p) for p in passages]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            return None

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/search"
    server.shutdown()
    server.server_close()


def test_http_retriever_matches_local_bm25(search_service: str) -> None:
    remote = HTTPRetriever(search_service, timeout=5)
    local = BM25Retriever(builtin_corpus())
    query = "Alan Turing PhD university"
    assert remote.search(query, 3) == local.search(query, 3)


def test_search_tool_returns_numbered_passages(search_service: str) -> None:
    tools = ToolSet([search_tool(k=2), search_tool(HTTPRetriever(search_service), k=1, name="web")])
    calls = [
        ToolCall("search", {"query": "where was Vivaldi born"}, "call_0"),
        ToolCall("web", {"query": "Danube sea"}, "call_1"),
        ToolCall("search", {"query": "   "}, "call_2"),
        ToolCall("search", {"q": "x"}, "call_3"),
    ]
    local, remote, empty, bad = asyncio.run(tools.execute(calls))
    assert local.content.startswith("[1] Antonio Vivaldi: ") and "\n\n[2] " in local.content
    assert remote.content.startswith("[1] Danube: ") and "[2]" not in remote.content
    assert empty.is_error and "query is empty" in empty.content
    assert bad.is_error and "unknown argument 'q'" in bad.content
    assert format_passages([]) == "No results."


def test_http_retriever_rejects_a_bad_answer() -> None:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = b'{"results": []}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            return None

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(ValueError, match="without a 'passages' list"):
            HTTPRetriever(f"http://127.0.0.1:{server.server_port}/").search("x", 1)
    finally:
        server.shutdown()
        server.server_close()


def test_search_tool_rejects_a_non_retriever() -> None:
    with pytest.raises(TypeError, match="needs a Retriever"):
        search_tool(object())  # type: ignore[arg-type]
