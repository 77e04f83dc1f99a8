"""``agent-r1 serve`` under load, and the fixes that load found.

The load test runs ``benchmarks/serve_load.py``'s mix (64 clients, 2,000 requests: valid, malformed,
over-long, disconnecting) against a real ``agent-r1 serve`` process, then checks every valid answer
against the model itself. The unit tests below it each failed before their fix.
"""

from __future__ import annotations

import asyncio
import importlib.util
import math
import re
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
import torch
from transformers import AutoModelForCausalLM

from agent_r1.rollout.sampling import sample_next_tokens
from agent_r1.rollout.server import build_app, start_server
from agent_r1.types import SamplingParams

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("serve_load", REPO / "benchmarks" / "serve_load.py")
serve_load = importlib.util.module_from_spec(_spec)
sys.modules["serve_load"] = serve_load  # dataclasses look their module up there
_spec.loader.exec_module(serve_load)


# ---------------------------------------------------------------------------------------- load test


def answers(outcome, tokenizer) -> list[tuple[list[int], list[int], list[float], str, str]]:
    """``(prompt_ids, token_ids, logprobs, finish_reason, text)`` per choice of a valid request's
    answer, after checking that the answer is about the prompt that was sent."""
    request, answer = outcome.request, outcome.answer
    if request.name == "chat":
        rendered = tokenizer.apply_chat_template(request.prompt, add_generation_prompt=True, tokenize=False)
        prompt_ids = tokenizer.encode(rendered, add_special_tokens=False)
        assert answer["prompt_token_ids"] == prompt_ids
        (choice,) = answer["choices"]
        logprobs = [entry["logprob"] for entry in choice["logprobs"]["content"]]
        return [
            (prompt_ids, choice["token_ids"], logprobs, choice["finish_reason"], choice["message"]["content"])
        ]
    prompts = request.prompt if request.name == "completions/batch" else [request.prompt]
    prompts = [tokenizer.encode(p, add_special_tokens=False) if isinstance(p, str) else p for p in prompts]
    assert len(answer["choices"]) == len(prompts)
    result = []
    for prompt_ids, choice in zip(prompts, answer["choices"], strict=True):
        assert choice["prompt_token_ids"] == prompt_ids
        assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
        logprobs = choice["logprobs"]["token_logprobs"]
        result.append((prompt_ids, choice["token_ids"], logprobs, choice["finish_reason"], choice["text"]))
    return result


@pytest.mark.slow
def test_serve_under_load_stays_up_and_answers_every_valid_request_correctly(
    tiny_checkpoint, tiny_tokenizer, tmp_path
):
    requests = serve_load.build_requests(2000, seed=0)
    kinds = {r.kind for r in requests}
    names = {r.name for r in requests}
    assert kinds == {serve_load.VALID, serve_load.MALFORMED, serve_load.TOO_LONG, serve_load.DISCONNECT}
    assert {"closed after sending", "closed mid-body", "wrong API key", "NaN", "unknown model"} <= names
    assert serve_load.TINY_TEMPERATURE in names

    port, log_path = serve_load.free_port(), tmp_path / "serve.log"
    base_url = f"http://127.0.0.1:{port}"
    server = serve_load.start_serve(tiny_checkpoint, port, log_path)
    try:
        asyncio.run(serve_load.wait_healthy(base_url, server, log_path))
        outcomes = asyncio.run(serve_load.send_all(base_url, requests, clients=64))
        # still up, and still serving, after the last request
        (after,) = asyncio.run(
            serve_load.send_all(base_url, [r for r in requests if r.kind == "valid"][:1], 1)
        )
        assert server.poll() is None
    finally:
        server.terminate()
        server.wait(timeout=60)
    assert len(outcomes) == len(requests)
    assert serve_load.unexpected(outcomes + [after]) == []  # every status as its kind allows; no 5xx
    assert serve_load.logged_errors(log_path.read_text()) == []

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    eos_ids = {eos} if isinstance(eos, int) else set(eos)
    # (prompt, answer) -> [(greedy?, reported log-probs)]
    checked: dict[tuple[tuple[int, ...], tuple[int, ...]], list[tuple[bool, list[float]]]] = {}
    for outcome in [o for o in outcomes if o.request.kind == serve_load.VALID] + [after]:
        max_tokens = outcome.request.max_tokens
        for prompt_ids, token_ids, logprobs, finish, text in answers(outcome, tiny_tokenizer):
            assert 1 <= len(token_ids) <= max_tokens and len(logprobs) == len(token_ids)
            stopped = finish == "stop"
            assert (token_ids[-1] in eos_ids) if stopped else (finish == "length")
            if finish == "length":
                assert (
                    len(token_ids) == max_tokens or len(prompt_ids) + len(token_ids) == serve_load.MAX_CONTEXT
                )
            shown = token_ids[:-1] if stopped else token_ids
            assert text == tiny_tokenizer.decode(shown, skip_special_tokens=False)
            greedy = outcome.request.name != serve_load.TINY_TEMPERATURE
            checked.setdefault((tuple(prompt_ids), tuple(token_ids)), []).append((greedy, logprobs))

    # Greedy means each token is the argmax of the model's logits there, and the reported log-prob
    # is its log-softmax: recompute both with one plain forward per distinct (prompt, answer). At
    # temperature 1e-40 the token is the argmax as well, and log softmax(logits / T) there is 0.
    with torch.no_grad():
        for (prompt_ids, token_ids), reported in checked.items():
            ids = torch.tensor([list(prompt_ids) + list(token_ids[:-1])])
            logits_TV = model(ids).logits[0, len(prompt_ids) - 1 :]  # (len(token_ids), V)
            chosen = logits_TV.gather(1, torch.tensor(token_ids)[:, None]).squeeze(1)
            assert (chosen >= logits_TV.max(dim=-1).values - 1e-3).all(), (prompt_ids, token_ids)
            greedy_logprobs = chosen - logits_TV.logsumexp(dim=-1)
            for greedy, logprobs in reported:
                expected = greedy_logprobs if greedy else torch.zeros_like(greedy_logprobs)
                assert torch.allclose(torch.tensor(logprobs), expected, atol=1e-4), (prompt_ids, token_ids)


@pytest.mark.slow
def test_serve_load_benchmark_reports_latency():
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "serve_load.py"), "--quick"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("machine: ") and "UNEXPECTED" not in proc.stdout
    assert re.search(r"200 requests in [\d.]+ s; \d+ valid: p50 \d+ ms, p99 \d+ ms", proc.stdout), proc.stdout


def test_percentile_is_the_nearest_rank():
    values = [float(v) for v in range(1, 101)]  # 1 .. 100
    assert serve_load.percentile(values, 50) == 50.0
    assert serve_load.percentile(values, 99) == 99.0
    assert serve_load.percentile(values, 100) == 100.0
    assert serve_load.percentile([7.0], 99) == 7.0


# ------------------------------------------------------------------------ fixes found by the load


@pytest.fixture(scope="module")
def engine(tiny_checkpoint, tiny_tokenizer):
    from agent_r1.rollout import HFEngine

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    return HFEngine(model, tokenizer=tiny_tokenizer, max_context=128)


async def post(app, path: str, data: bytes) -> tuple[int, str, dict | None]:
    runner, port = await start_server(app)
    try:
        async with aiohttp.ClientSession() as http:
            response = await http.post(
                f"http://127.0.0.1:{port}{path}", data=data, headers={"Content-Type": "application/json"}
            )
            body = (
                await response.json(content_type=None)
                if response.content_type == "application/json"
                else None
            )
            return response.status, response.content_type, body
    finally:
        await runner.cleanup()


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        # Python's json accepted NaN; SamplingParams let it through and the NaN probabilities then
        # failed the sampling step of every request in the same batch (HTTP 500 for all of them).
        (b'{"prompt": [1, 2], "temperature": NaN}', 400, "NaN is not valid JSON"),
        (b'{"prompt": [1, 2], "top_p": Infinity}', 400, "Infinity is not valid JSON"),
        # torch.Generator.manual_seed overflowed: an unhandled ValueError, HTTP 500 in plain text
        (b'{"prompt": [1, 2], "seed": 100000000000000000000000000000}', 400, "'seed' is out of range"),
        # torch.tensor overflowed inside the decode step: every row of the batch failed with 500
        (b'{"prompt": [1, 2], "top_k": 100000000000000000000000000000}', 400, "'top_k' is out of range"),
        # queued n samples however many: n=10**9 coroutines would exhaust the server's memory
        (b'{"prompt": [1, 2], "n": 1000}', 400, "'n' must be between 1 and 128"),
        (b'{"prompt": [1, 2], "logprobs": -1}', 400, "'logprobs' must be >= 0"),
        # the model name was ignored: any model was "served"
        (b'{"model": "gpt-4", "prompt": [1, 2]}', 404, "The model `gpt-4` does not exist"),
        (b'{"model": 7, "prompt": [1, 2]}', 400, "'model' must be of type str"),
    ],
)
def test_requests_the_server_used_to_mishandle(engine, tiny_tokenizer, body, status, needle):
    app = build_app(engine, model_name="tiny", tokenizer=tiny_tokenizer)
    got_status, content_type, answer = asyncio.run(post(app, "/v1/completions", body))
    assert (got_status, content_type) == (status, "application/json")
    assert needle in answer["error"]["message"]


def test_a_tiny_temperature_samples_its_own_row_without_failing_the_batch():
    """``logits / 1e-40`` overflowed to inf, softmax gave NaN, and ``torch.multinomial`` raised for
    the whole batch; the greedy row beside it failed too."""
    logits_BV = torch.tensor([[1.0, 3.0, 2.0], [0.5, -1.0, 4.0]])
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1e-40)]
    generators = [None, torch.Generator().manual_seed(0)]
    tokens_B, logprobs_B = sample_next_tokens(logits_BV, params, generators)
    assert tokens_B.tolist() == [1, 2]  # greedy's argmax; T -> 0 is the argmax too
    assert logprobs_B[0].item() == pytest.approx(torch.log_softmax(logits_BV[0], -1)[1].item())
    assert logprobs_B[1].item() == 0.0  # all the mass on the argmax


def test_sampling_log_probs_are_unchanged_by_the_shift():
    logits_BV = torch.randn(4, 50, generator=torch.Generator().manual_seed(1)) * 5
    params = [SamplingParams(temperature=t, seed=0) for t in (0.3, 0.7, 1.0, 2.5)]
    generators = [torch.Generator().manual_seed(i) for i in range(4)]
    tokens_B, logprobs_B = sample_next_tokens(logits_BV, params, generators)
    temperature_B = torch.tensor([0.3, 0.7, 1.0, 2.5])[:, None]
    expected_B = (logits_BV / temperature_B).log_softmax(-1).gather(1, tokens_B[:, None]).squeeze(1)
    assert torch.allclose(logprobs_B, expected_B, atol=1e-6)


@pytest.mark.parametrize("temperature", [math.nan, math.inf, -0.5])
def test_sampling_params_refuse_a_temperature_that_is_not_a_finite_non_negative_number(temperature):
    with pytest.raises(ValueError, match="temperature must be finite and >= 0"):
        SamplingParams(temperature=temperature)


class BlockingEngine:
    """Test double for an engine: ``generate`` never finishes; it records its start and its
    cancellation, which is all the disconnect test needs to see."""

    max_context = 128
    vocab_size = 256

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.cancelled = asyncio.Event()

    async def generate(self, prompt_ids, params):
        self.started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


def test_a_client_that_disconnects_cancels_its_engine_request():
    """aiohttp (>= 3.9) let a handler run on after its client had gone, so the engine kept decoding
    for nobody; the server now cancels the handler, and with it the engine request."""

    async def main():
        engine = BlockingEngine()
        runner, port = await start_server(build_app(engine, model_name="tiny"))
        try:
            body = b'{"prompt": [1, 2, 3], "max_tokens": 64}'
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            await writer.drain()
            await asyncio.wait_for(engine.started.wait(), 60)
            writer.close()
            await writer.wait_closed()
            await asyncio.wait_for(engine.cancelled.wait(), 60)  # a hang guard, not a timing check
        finally:
            await runner.cleanup()

    asyncio.run(main())


class RaisingEngine:
    """Test double for an engine with a bug: ``generate`` raises."""

    max_context = 128
    vocab_size = 256

    async def generate(self, prompt_ids, params):
        raise RuntimeError("engine bug")


def test_an_unexpected_failure_is_a_500_in_the_api_error_format():
    app = build_app(RaisingEngine(), model_name="tiny")
    status, content_type, answer = asyncio.run(post(app, "/v1/completions", b'{"prompt": [1, 2]}'))
    assert (status, content_type) == (500, "application/json")  # was aiohttp's text/plain page
    assert answer["error"]["message"] == "internal server error: RuntimeError: engine bug"
