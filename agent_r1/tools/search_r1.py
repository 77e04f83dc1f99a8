"""A client of Search-R1's retrieval server, so an existing E5 / FAISS (or BM25) index serves the search tool.

Search-R1 (Jin et al. 2025, arXiv 2503.09516) serves its retrievers with
``search_r1/search/retrieval_server.py`` (FastAPI, port 8000). The API, as read from that file at
commit a14dc3a of github.com/PeterGriffinJin/Search-R1:

    POST /retrieve  {"queries": [str, ...], "topk": int, "return_scores": bool}
    -> {"result": [[{"document": {"id": str, "contents": str, ...}, "score": float}, ...],  # query 1
                   ...]}                                                                  # one list per query
       (with "return_scores": false each item is the document itself, without the wrapper)

``contents`` is ``'"Title"\\ntext...'``: the first line is the title (quoted in Search-R1's wiki-18
corpus), the rest the text — the split of Search-R1's own client (``_passages2string`` in
``search_r1/llm_agent/generation.py``), with the quotes stripped as its BM25 path does. A document
without a newline is all text, no title. ``id`` is optional (its BM25 path omits it; Passage.id is
then ``""``), and so is ``score`` (its SerpAPI and Google servers omit it; Passage.score is then 0.0).

    retriever = SearchR1Retriever("http://127.0.0.1:8000")          # or ".../retrieve"
    search = search_tool(retriever, k=3)
    retriever.search_many(["who wrote Hamlet", "capital of Peru"], k=3)   # one request, two lists

Every failure — the server down, slower than ``timeout_s``, an HTTP error, an answer that is not JSON
or not of the shape above — raises one ``RetrieverError`` whose message names the URL and what was
expected. Inside the search tool that error becomes an observation the model reads (``Tool`` turns
every exception into an error result), so a retriever that fails mid-episode never crashes a run.
"""

from __future__ import annotations

import http.client
import json
import socket
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

from agent_r1.tools.search import Passage, split_contents

__all__ = ["RetrieverError", "SearchR1Retriever", "split_contents"]

_SERVER = "a Search-R1 retrieval server (search_r1/search/retrieval_server.py) answering POST /retrieve"


class RetrieverError(RuntimeError):
    """A remote retriever failed or answered something else; the message names the URL and the expectation."""


def _short(value: Any, limit: int = 160) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=repr)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class SearchR1Retriever:
    """Search-R1's ``POST /retrieve`` API as a ``Retriever`` (see the module docstring for the shapes).

    ``url`` is the server's base (``http://host:8000``, ``/retrieve`` is appended) or its endpoint
    (``http://host:8000/retrieve``, used as is). ``timeout_s`` bounds the connection and each read; it
    is below ``SearchTool``'s 30 s so that the model reads this error, which names the URL, rather than
    the tool's generic time-out. ``return_scores=False`` asks for bare documents (score 0.0), as the API
    allows, but Search-R1's ``retrieval_server.py`` (at a14dc3a) fails on it: keep the default with that
    server. A server that answers more than ``k`` documents for a query is cut to ``k``.
    """

    def __init__(self, url: str, *, timeout_s: float = 20.0, return_scores: bool = True) -> None:
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(
                f"SearchR1Retriever needs an http(s) URL such as http://127.0.0.1:8000, got {url!r}"
            )
        if not timeout_s > 0:
            raise ValueError(f"SearchR1Retriever timeout_s must be positive seconds, got {timeout_s!r}")
        path = parsed.path.rstrip("/")
        if not path.endswith("/retrieve"):
            path += "/retrieve"
        self.url = urllib.parse.urlunsplit((parsed.scheme, parsed.netloc, path, parsed.query, ""))
        self.timeout_s, self.return_scores = timeout_s, return_scores
        item = '{"document": {"id", "contents"}, "score"}' if return_scores else '{"id", "contents"}'
        self._expected = f'{{"result": [[{item}, ...] per query]}}'

    def __repr__(self) -> str:
        return f"SearchR1Retriever({self.url!r}, timeout_s={self.timeout_s!r})"

    def search(self, query: str, k: int) -> list[Passage]:
        return self.search_many([query], k)[0]

    def search_many(self, queries: Sequence[str], k: int) -> list[list[Passage]]:
        """The ``k`` best passages for each query, best first, from ONE request for all of them."""
        if k < 1:
            raise ValueError(f"SearchR1Retriever: k must be >= 1, got {k}")
        if not queries:
            return []
        payload = self._post({"queries": list(queries), "topk": k, "return_scores": self.return_scores})
        results = payload.get("result") if isinstance(payload, Mapping) else None
        if not isinstance(results, list):
            raise self._shape_error("no 'result' list", payload)
        if len(results) != len(queries):
            raise self._shape_error(f"{len(results)} result lists for {len(queries)} queries", payload)
        return [self._passages(i, items)[:k] for i, items in enumerate(results)]

    # ----------------------------------------------------------------------------------- internals
    def _post(self, body: dict[str, Any]) -> Any:
        request = urllib.request.Request(
            self.url,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                raw = response.read()
        except urllib.error.HTTPError as e:  # before URLError, its base class
            detail = e.read().decode("utf-8", "replace") if e.fp else ""
            raise self._error(f"answered HTTP {e.code} {e.reason}: {_short(detail)}") from e
        except urllib.error.URLError as e:
            raise self._error(self._unreachable(e.reason)) from e
        except (OSError, http.client.HTTPException) as e:  # while reading the answer (TimeoutError too)
            raise self._error(self._unreachable(e)) from e
        try:
            return json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise self._error(
                f"answered something that is not JSON ({_short(raw.decode('utf-8', 'replace'))!r})",
                self._expected,
            ) from e

    def _unreachable(self, reason: Any) -> str:
        if isinstance(reason, TimeoutError):  # socket.timeout is TimeoutError on Python >= 3.10
            return f"did not answer within timeout_s={self.timeout_s}s"
        if isinstance(reason, ConnectionRefusedError):
            return "refused the connection (is the server running, on this host and port?)"
        if isinstance(reason, socket.gaierror):
            return f"has a host name that does not resolve ({reason})"
        return f"could not be reached ({type(reason).__name__}: {reason})"

    def _error(self, what: str, expected: str = _SERVER) -> RetrieverError:
        return RetrieverError(f"Search-R1 retriever at {self.url} {what}; expected {expected}")

    def _shape_error(self, what: str, payload: Any) -> RetrieverError:
        return RetrieverError(
            f"Search-R1 retriever at {self.url} answered another shape ({what}): expected {self._expected}, "
            f"got {_short(payload)}"
        )

    def _passages(self, query_index: int, items: Any) -> list[Passage]:
        if not isinstance(items, list):
            raise self._shape_error(f"result {query_index} is not a list", items)
        passages = []
        for rank, item in enumerate(items):
            where = f"result {query_index}, item {rank}"
            document, score = item, 0.0
            if self.return_scores:
                if not isinstance(item, Mapping) or not isinstance(item.get("document"), Mapping):
                    raise self._shape_error(f"{where} has no 'document' object", item)
                score = item.get("score", 0.0)  # Search-R1's SerpAPI and Google servers send none
                if isinstance(score, bool) or not isinstance(score, (int, float)):
                    raise self._shape_error(f"{where} has a 'score' that is not a number", item)
                document = item["document"]
            if not isinstance(document, Mapping) or not isinstance(document.get("contents"), str):
                raise self._shape_error(f"{where}: a document needs a string 'contents'", item)
            title, text = split_contents(document["contents"])
            passages.append(
                Passage(id=str(document.get("id", "")), text=text, title=title, score=float(score))
            )
        return passages
