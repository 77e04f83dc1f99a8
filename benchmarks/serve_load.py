"""``agent-r1 serve`` under load: concurrent clients sending valid, malformed, over-long and abandoned
requests.

    python benchmarks/serve_load.py                                # 64 clients, 2,000 requests
    python benchmarks/serve_load.py --quick                        # smoke size: 16 clients, 200 requests

Starts ``agent-r1 serve`` on the tiny model (loopback, ``--max-context 128``, an API key from
``AGENT_R1_API_KEY``) in its own process, then ``--clients`` workers share ``--requests`` requests
drawn (seeded) from this mix:

- valid (half): greedy completions with token-id, text or batched prompts, seeded ones at
  temperature 1e-40, and greedy chat completions; 1-8 new tokens, log-probs and token ids asked
  for -- expected 200;
- malformed (a quarter): not JSON, not an object, ``NaN``, missing or mistyped fields, out-of-range
  integers, token ids outside the vocabulary, too large ``n`` (400), an unknown model (404), a wrong
  API key (401);
- over-long (an eighth): token-id, text and chat prompts beyond the context -- expected 400;
- disconnects (an eighth): the client sends a request for 64 tokens and closes its socket at once,
  or closes half-way through the body -- no answer is read.

Prints the machine, one row per kind (count, statuses seen), and the p50 / p99 latency of the valid
requests; exits 1 if any request got a status its kind does not allow or the server died.
``tests/test_serve_load.py`` drives the same code and also checks every valid answer against the
model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import aiohttp

API_KEY = "load-test-key"
MAX_CONTEXT = 128
VALID, MALFORMED, TOO_LONG, DISCONNECT = "valid", "malformed", "too long", "disconnect"
TINY_TEMPERATURE = "completions/temperature 1e-40"


@dataclass(frozen=True)
class LoadRequest:
    """One request of the mix. ``body`` is the raw bytes sent; ``expected`` the allowed status
    (``None``: the client disconnects and reads nothing). ``prompt`` is what a valid request asks
    the model to continue: token ids, a text, or chat messages."""

    kind: str  # VALID, MALFORMED, TOO_LONG or DISCONNECT
    name: str  # e.g. "completions/ids", "bad json", "closed after sending"
    path: str
    body: bytes
    expected: int | None
    api_key: str = API_KEY
    max_tokens: int = 0
    prompt: object = None


def _json(obj) -> bytes:
    return json.dumps(obj).encode()


def build_requests(count: int, seed: int = 0) -> list[LoadRequest]:
    """``count`` requests drawn from the mix with ``random.Random(seed)``: the same list every run."""
    rng = random.Random(seed)
    id_prompts = [[rng.randrange(256) for _ in range(rng.randrange(3, 40))] for _ in range(12)]
    texts = [f"Task {i}: add {i} and {3 * i + 1}." for i in range(8)]
    chats = [[{"role": "user", "content": f"What is {i} + {i}?"}] for i in range(6)]
    long_ids = [rng.randrange(256) for _ in range(MAX_CONTEXT + 40)]

    def greedy(max_tokens: int) -> dict:
        return {"model": "tiny", "max_tokens": max_tokens, "temperature": 0, "logprobs": 1}

    def completion(name, prompt, max_tokens, **extra):
        body = {**greedy(max_tokens), "prompt": prompt, "return_token_ids": True, **extra}
        body["return_tokens_as_token_ids"] = True
        return LoadRequest(
            VALID, name, "/v1/completions", _json(body), 200, max_tokens=max_tokens, prompt=prompt
        )

    def valid() -> LoadRequest:
        max_tokens = rng.randint(1, 8)
        choice = rng.randrange(5)
        if choice == 0:
            return completion("completions/ids", rng.choice(id_prompts), max_tokens)
        if choice == 1:
            return completion("completions/text", rng.choice(texts), max_tokens)
        if choice == 2:
            return completion("completions/batch", rng.sample(id_prompts, 2), max_tokens)
        if choice == 3:  # valid, and the limit T -> 0 is greedy; it once made a batch's sampling fail
            prompt = rng.choice(id_prompts)
            return completion(
                TINY_TEMPERATURE, prompt, max_tokens, temperature=1e-40, seed=rng.randrange(100)
            )
        messages = rng.choice(chats)
        body = {**greedy(max_tokens), "messages": messages, "logprobs": True, "return_token_ids": True}
        return LoadRequest(
            VALID, "chat", "/v1/chat/completions", _json(body), 200, max_tokens=max_tokens, prompt=messages
        )

    ok = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2}
    malformed = [
        ("bad json", b'{"prompt": [1, 2', 400),
        ("not an object", b"[1, 2, 3]", 400),
        ("NaN", b'{"prompt": [1, 2], "temperature": NaN}', 400),
        ("missing prompt", _json({"model": "tiny", "max_tokens": 2}), 400),
        ("mistyped max_tokens", _json({**ok, "max_tokens": "many"}), 400),
        ("mistyped prompt", _json({**ok, "prompt": [1, "a"]}), 400),
        ("mistyped temperature", _json({**ok, "temperature": "hot"}), 400),
        ("seed out of range", _json({**ok, "seed": 10**30}), 400),
        ("top_k out of range", _json({**ok, "top_k": 10**30}), 400),
        ("token id outside vocab", _json({**ok, "prompt": [1, 10**6]}), 400),
        ("n too large", _json({**ok, "n": 100_000}), 400),
        ("negative temperature", _json({**ok, "temperature": -1}), 400),
        ("unknown model", _json({**ok, "model": "gpt-4"}), 404),
    ]
    too_long = [
        ("ids", "/v1/completions", {"model": "tiny", "prompt": long_ids, "max_tokens": 4}),
        ("text", "/v1/completions", {"model": "tiny", "prompt": "x" * (MAX_CONTEXT + 60), "max_tokens": 4}),
        (
            "chat",
            "/v1/chat/completions",
            {"model": "tiny", "messages": [{"role": "user", "content": "y" * MAX_CONTEXT}], "max_tokens": 4},
        ),
    ]
    abandoned = _json({"model": "tiny", "prompt": rng.choice(id_prompts), "max_tokens": 64, "temperature": 1})

    requests = []
    for _ in range(count):
        kind = rng.choices([VALID, MALFORMED, TOO_LONG, DISCONNECT], weights=[4, 2, 1, 1])[0]
        if kind == VALID:
            requests.append(valid())
        elif kind == MALFORMED:
            if rng.random() < 1 / 14:
                requests.append(
                    LoadRequest(
                        MALFORMED, "wrong API key", "/v1/completions", _json(ok), 401, api_key="wrong"
                    )
                )
            else:
                name, body, status = rng.choice(malformed)
                requests.append(LoadRequest(MALFORMED, name, "/v1/completions", body, status))
        elif kind == TOO_LONG:
            name, path, body = rng.choice(too_long)
            requests.append(LoadRequest(TOO_LONG, name, path, _json(body), 400))
        else:
            name = rng.choice(["closed after sending", "closed mid-body"])
            requests.append(LoadRequest(DISCONNECT, name, "/v1/completions", abandoned, None))
    return requests


@dataclass(frozen=True)
class Outcome:
    request: LoadRequest
    status: int | None  # None: disconnected on purpose
    answer: dict | None  # the JSON body, when it was one
    seconds: float


async def _disconnect(host: str, port: int, request: LoadRequest) -> None:
    """Send ``request`` over a raw socket and close it without reading: all of it, or the headers and
    half the body (the ``Content-Length`` promised is never delivered)."""
    body = request.body if request.name == "closed after sending" else request.body[: len(request.body) // 2]
    head = (
        f"POST {request.path} HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {request.api_key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(request.body)}\r\n\r\n"
    )
    _, writer = await asyncio.open_connection(host, port)
    writer.write(head.encode() + body)
    await writer.drain()
    writer.close()
    await writer.wait_closed()


async def send_all(base_url: str, requests: list[LoadRequest], clients: int) -> list[Outcome]:
    """``clients`` workers send ``requests`` (each worker takes the next one when it is done)."""
    host, port = base_url.removeprefix("http://").rsplit(":", 1)
    queue: asyncio.Queue[LoadRequest] = asyncio.Queue()
    for r in requests:
        queue.put_nowait(r)
    outcomes: list[Outcome] = []
    timeout = aiohttp.ClientTimeout(total=600)

    async def worker(http: aiohttp.ClientSession) -> None:
        while not queue.empty():
            request = queue.get_nowait()
            start = time.perf_counter()
            if request.expected is None:
                await _disconnect(host, int(port), request)
                outcomes.append(Outcome(request, None, None, time.perf_counter() - start))
                continue
            headers = {"Authorization": f"Bearer {request.api_key}", "Content-Type": "application/json"}
            async with http.post(base_url + request.path, data=request.body, headers=headers) as response:
                text = await response.text()
            seconds = time.perf_counter() - start
            try:
                answer = json.loads(text)
            except ValueError:
                answer = None
            outcomes.append(Outcome(request, response.status, answer, seconds))

    connector = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        await asyncio.gather(*(worker(http) for _ in range(clients)))
    return outcomes


def unexpected(outcomes: list[Outcome]) -> list[str]:
    """Every outcome whose status its kind does not allow, or whose error has no OpenAI error body."""
    problems = []
    for o in outcomes:
        r = o.request
        if r.expected is None:
            continue
        if o.status != r.expected:
            problems.append(f"{r.kind}/{r.name}: HTTP {o.status}, expected {r.expected}: {o.answer}")
        elif o.status != 200 and not (
            isinstance(o.answer, dict) and o.answer.get("error", {}).get("message")
        ):
            problems.append(f"{r.kind}/{r.name}: HTTP {o.status} without an error message: {o.answer}")
    return problems


def logged_errors(server_log: str) -> list[str]:
    """Tracebacks in the server's output: an exception that escaped a handler or the engine."""
    return [f"the server logged: {chunk[:2000]}" for chunk in server_log.split("Traceback")[1:]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_serve(model_dir: Path, port: int, log_path: Path) -> subprocess.Popen:
    """``agent-r1 serve`` on loopback with ``API_KEY`` from the environment; output to ``log_path``."""
    env = {**os.environ, "AGENT_R1_API_KEY": API_KEY, "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "agent_r1.cli", "serve", str(model_dir), "--port", str(port)]
    command += ["--max-context", str(MAX_CONTEXT), "--served-model-name", "tiny"]
    log = log_path.open("w")
    return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)


async def wait_healthy(base_url: str, server: subprocess.Popen, log_path: Path, limit_s: float = 300) -> None:
    deadline = time.monotonic() + limit_s
    async with aiohttp.ClientSession() as http:
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"agent-r1 serve exited with {server.returncode}:\n{log_path.read_text()}")
            try:
                async with http.get(f"{base_url}/health") as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientConnectionError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"agent-r1 serve did not come up in {limit_s} s:\n{log_path.read_text()}")
            await asyncio.sleep(0.2)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in [0, 100])."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q * len(ordered) / 100))  # the smallest value with >= q% at or below it
    return ordered[rank - 1]


def report(outcomes: list[Outcome], wall_s: float) -> str:
    rows = Counter((o.request.kind, o.request.name, o.status) for o in outcomes)
    lines = ["| kind | request | status | count |", "|---|---|---|---|"]
    for (kind, name, status), n in sorted(rows.items(), key=lambda kv: (kv[0][0], kv[0][1], str(kv[0][2]))):
        lines.append(f"| {kind} | {name} | {'closed' if status is None else status} | {n} |")
    latencies = [o.seconds for o in outcomes if o.request.kind == VALID]
    lines.append("")
    lines.append(
        f"{len(outcomes)} requests in {wall_s:.1f} s; {len(latencies)} valid: "
        f"p50 {percentile(latencies, 50) * 1000:.0f} ms, p99 {percentile(latencies, 99) * 1000:.0f} ms, "
        f"max {max(latencies) * 1000:.0f} ms"
    )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="smoke size: 16 clients, 200 requests")
    args = parser.parse_args()
    if args.quick:
        args.clients, args.requests = 16, 200

    from agent_r1.models.tiny import save_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_tiny_checkpoint(Path(tmp) / "tiny")
        requests = build_requests(args.requests, seed=args.seed)
        port, log_path = free_port(), Path(tmp) / "serve.log"
        base_url = f"http://127.0.0.1:{port}"
        server = start_serve(model_dir, port, log_path)
        try:
            asyncio.run(wait_healthy(base_url, server, log_path))
            load_before = os.getloadavg()[0]
            start = time.perf_counter()
            outcomes = asyncio.run(send_all(base_url, requests, args.clients))
            wall_s = time.perf_counter() - start
            alive = server.poll() is None
        finally:
            server.terminate()
            server.wait(timeout=60)
        print(
            f"machine: {platform.machine()}, {os.cpu_count()} cores, load average {load_before:.1f} "
            f"before the load, {os.getloadavg()[0]:.1f} after"
        )
        print(
            f"clients {args.clients}, requests {args.requests}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}"
        )
        print(report(outcomes, wall_s))
        problems = unexpected(outcomes) + ([] if alive else ["the server died"])
        problems += logged_errors(log_path.read_text())
        for p in problems:
            print("UNEXPECTED:", p)
        return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
