"""SearchR1Retriever against a local test double of Search-R1's retrieval server, and its failures.

The double speaks the API of ``search_r1/search/retrieval_server.py`` (github.com/PeterGriffinJin/
Search-R1 at a14dc3a): ``POST /retrieve`` with ``{"queries", "topk", "return_scores"}``, answering
``{"result": [[{"document": {"id", "contents"}, "score"}, ...] per query]}`` (bare documents when
``return_scores`` is false), 404 on other paths and 422 on a request without ``queries`` as FastAPI does.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from agent_r1.tasks.multihop_qa import build_task
from agent_r1.tools import ToolCall, ToolSet
from agent_r1.tools.search import Passage, Retriever, search_tool
from agent_r1.tools.search_r1 import RetrieverError, SearchR1Retriever, split_contents

# Search-R1's wiki-18 corpus rows: {"id", "contents": '"Title"\ntext'}.
CORPUS = [
    {"id": "0", "contents": '"Danube"\nThe Danube flows into the Black Sea.'},
    {"id": "1", "contents": '"Vltava"\nThe Vltava flows through Prague into the Elbe.'},
    {"id": "2", "contents": '"Elbe"\nThe Elbe flows into the North Sea near Hamburg.'},
    {"id": "3", "contents": '"Prague"\nPrague is the capital of the Czech Republic.'},
]

Answer = Callable[[str, dict], tuple[int, bytes]]


def _overlap_search(query: str, topk: int) -> list[tuple[dict, float]]:
    """The double's index: score = number of query words in the document, ties by id."""
    words = set(query.lower().split())
    scored = [
        (doc, float(len(words & set(doc["contents"].lower().replace(".", "").split())))) for doc in CORPUS
    ]
    scored.sort(key=lambda pair: (-pair[1], pair[0]["id"]))
    return [pair for pair in scored if pair[1] > 0][:topk]


def search_r1_api(path: str, request: dict) -> tuple[int, bytes]:
    """What Search-R1's retrieve_endpoint answers (its default topk is 3)."""
    if path != "/retrieve":
        return 404, b'{"detail":"Not Found"}'
    if not isinstance(request.get("queries"), list):
        return 422, b'{"detail":[{"loc":["body","queries"],"msg":"field required"}]}'
    topk = request.get("topk") or 3
    result = []
    for query in request["queries"]:
        hits = _overlap_search(query, topk)
        if request.get("return_scores", False):
            result.append([{"document": doc, "score": score} for doc, score in hits])
        else:
            result.append([doc for doc, _ in hits])
    return 200, json.dumps({"result": result}).encode()


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:  # a client that timed out left
        return None


@pytest.fixture
def serve() -> Iterator[Callable[[Answer], tuple[str, list[dict]]]]:
    """Start a loopback server answering with ``answer(path, request)``; returns its URL and requests."""
    servers: list[ThreadingHTTPServer] = []

    def start(answer: Answer) -> tuple[str, list[dict]]:
        requests: list[dict] = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                requests.append(request)
                status, body = answer(self.path, request)
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                return None

        server = _QuietServer(("127.0.0.1", 0), Handler)
        servers.append(server)
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
        return f"http://127.0.0.1:{server.server_port}", requests

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.fixture
def closed_url() -> str:
    """A loopback port nobody listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def test_split_contents_like_search_r1() -> None:
    assert split_contents('"Danube"\nThe Danube\nflows.') == ("Danube", "The Danube\nflows.")
    assert split_contents("Plain title\ntext") == ("Plain title", "text")
    assert split_contents("no title line") == ("", "no title line")


def test_batched_queries_go_in_one_request_with_scores_and_topk(serve) -> None:
    url, requests = serve(search_r1_api)
    retriever = SearchR1Retriever(url)
    assert isinstance(retriever, Retriever)
    results = retriever.search_many(["Danube Black Sea", "Prague capital", "zebra"], k=2)
    assert requests == [
        {"queries": ["Danube Black Sea", "Prague capital", "zebra"], "topk": 2, "return_scores": True}
    ]
    danube, prague, nothing = results
    assert danube[0] == Passage(
        id="0", title="Danube", text="The Danube flows into the Black Sea.", score=3.0
    )
    assert len(danube) == 2 and danube[1].title == "Elbe" and danube[1].score == 1.0
    assert [p.title for p in prague] == ["Prague", "Vltava"] and prague[0].score == 2.0
    assert nothing == []
    assert retriever.search("Elbe Hamburg", k=1) == [
        Passage(id="2", title="Elbe", text="The Elbe flows into the North Sea near Hamburg.", score=2.0)
    ]
    assert retriever.search_many([], k=3) == [] and len(requests) == 2


def test_url_may_be_the_base_or_the_endpoint(serve) -> None:
    url, requests = serve(search_r1_api)
    for given in (url, url + "/", url + "/retrieve", url + "/retrieve/"):
        assert SearchR1Retriever(given).url == url + "/retrieve"
        assert SearchR1Retriever(given).search("Vltava", k=1)[0].id == "1"
    for bad in ("127.0.0.1:8000", "ftp://host/retrieve", "http:///retrieve"):
        with pytest.raises(ValueError, match="needs an http"):
            SearchR1Retriever(bad)


def test_without_scores_documents_come_bare(serve) -> None:
    url, requests = serve(search_r1_api)
    passages = SearchR1Retriever(url, return_scores=False).search("Prague Elbe", k=3)
    assert requests[0]["return_scores"] is False
    assert [(p.title, p.score) for p in passages] == [("Vltava", 0.0), ("Elbe", 0.0), ("Prague", 0.0)]


def test_a_server_that_is_down_is_one_clear_error(closed_url: str) -> None:
    with pytest.raises(RetrieverError) as info:
        SearchR1Retriever(closed_url, timeout_s=2).search("x", 1)
    message = str(info.value)
    assert f"{closed_url}/retrieve" in message and "refused the connection" in message
    assert "POST /retrieve" in message


def test_a_slow_server_times_out_naming_url_and_timeout(serve) -> None:
    release = threading.Event()

    def slow(path: str, request: dict) -> tuple[int, bytes]:
        release.wait(5)
        return search_r1_api(path, request)

    url, _ = serve(slow)
    try:
        with pytest.raises(RetrieverError, match=r"did not answer within timeout_s=0\.2s") as info:
            SearchR1Retriever(url, timeout_s=0.2).search("Danube", 1)
        assert f"{url}/retrieve" in str(info.value)
    finally:
        release.set()


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        ({"results": []}, r"no 'result' list"),
        ({"result": [[]]}, r"1 result lists for 2 queries"),
        ({"result": [[{"document": {"id": "0", "text": "t"}, "score": 1.0}], []]}, r"string 'contents'"),
        ({"result": [[{"id": "0", "contents": "t"}], []]}, r"result 0, item 0 has no 'document'"),
        (
            {"result": [[{"document": {"contents": "t"}, "score": "high"}], []]},
            r"has a 'score' that is not a number",
        ),
        ({"result": [{"document": {"contents": "t"}}, []]}, r"result 0 is not a list"),
    ],
)
def test_another_shape_names_what_was_expected(serve, answer: dict, expected: str) -> None:
    url, _ = serve(lambda path, request: (200, json.dumps(answer).encode()))
    with pytest.raises(RetrieverError, match=expected) as info:
        SearchR1Retriever(url).search_many(["a", "b"], k=1)
    message = str(info.value)
    assert f"{url}/retrieve answered another shape" in message
    assert 'expected {"result": [[{"document": {"id", "contents"}, "score"}, ...] per query]}' in message


def test_http_errors_and_non_json_are_clear(serve) -> None:
    url, _ = serve(search_r1_api)
    with pytest.raises(
        RetrieverError, match=r"/v1/retrieve answered HTTP 404 Not Found: \{\"detail\":\"Not Found\"\}"
    ):
        SearchR1Retriever(url + "/v1").search("x", 1)
    html, _ = serve(lambda path, request: (200, b"<html>proxy login</html>"))
    with pytest.raises(
        RetrieverError, match=r"not JSON \('<html>proxy login</html>'\); expected \{\"result\""
    ):
        SearchR1Retriever(html).search("x", 1)


def test_a_failing_retriever_is_an_observation_not_a_crash(serve, closed_url: str) -> None:
    broken = threading.Event()

    def flaky(path: str, request: dict) -> tuple[int, bytes]:
        return (500, b"Internal Server Error") if broken.is_set() else search_r1_api(path, request)

    url, _ = serve(flaky)
    tools = ToolSet(
        [search_tool(SearchR1Retriever(url), k=1), search_tool(SearchR1Retriever(closed_url), name="down")]
    )
    (ok,) = asyncio.run(tools.execute([ToolCall("search", {"query": "Danube"}, "call_0")]))
    assert not ok.is_error and ok.content == "[1] Danube: The Danube flows into the Black Sea."
    broken.set()  # the server fails mid-episode
    failed, down = asyncio.run(
        tools.execute(
            [ToolCall("search", {"query": "Danube"}, "call_1"), ToolCall("down", {"query": "x"}, "call_2")]
        )
    )
    assert failed.is_error and failed.content.startswith(
        f"Error: tool 'search' raised RetrieverError: Search-R1 retriever at {url}/retrieve answered HTTP 500"
    )
    assert down.is_error and f"{closed_url}/retrieve refused the connection" in down.content


def test_documents_without_scores_like_search_r1_online_servers(serve) -> None:
    """Search-R1's serp_search_server.py answers {"document": {"contents"}} items with no score and no id."""
    answer = {"result": [[{"document": {"contents": '"Peru"\nLima is the capital of Peru.'}}]]}
    url, _ = serve(lambda path, request: (200, json.dumps(answer).encode()))
    assert SearchR1Retriever(url).search("capital of Peru", k=3) == [
        Passage(id="", title="Peru", text="Lima is the capital of Peru.", score=0.0)
    ]


def test_more_than_k_documents_are_cut_to_k(serve) -> None:
    url, _ = serve(lambda path, request: search_r1_api(path, {**request, "topk": len(CORPUS)}))
    assert [p.title for p in SearchR1Retriever(url).search("the", k=2)] == ["Danube", "Vltava"]


def test_multihop_qa_task_searches_a_search_r1_server(serve) -> None:
    url, requests = serve(search_r1_api)
    spec = build_task(retriever_url=url + "/retrieve", top_k=2)
    (search,) = spec.tools()
    (result,) = asyncio.run(
        ToolSet([search]).execute([ToolCall("search", {"query": "Elbe Hamburg"}, "call_0")])
    )
    assert result.content.startswith("[1] Elbe: ") and requests[-1]["topk"] == 2
    with pytest.raises(ValueError, match="not both"):
        build_task(corpus="wiki.jsonl", retriever_url=url)
