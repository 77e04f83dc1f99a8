"""The OpenAI-compatible server (in process and as ``agent-r1 serve``) and the OpenAIEngine client."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from contextlib import asynccontextmanager

import aiohttp
import pytest
import torch
from aiohttp import web
from transformers import AutoModelForCausalLM

from agent_r1.rollout import HFEngine, OpenAIEngine
from agent_r1.rollout.server import build_app, start_server
from agent_r1.types import SamplingParams, StopReason


@pytest.fixture(scope="module")
def engine(tiny_checkpoint, tiny_tokenizer):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    return HFEngine(model, tokenizer=tiny_tokenizer, max_context=128)


@asynccontextmanager
async def serving(app: web.Application):
    runner, port = await start_server(app)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def our_app(engine, tokenizer):
    return build_app(engine, model_name="tiny", tokenizer=tokenizer)


def test_client_token_in_token_out_matches_the_engine(engine, tiny_tokenizer):
    prompts = [[10 + i for i in range(n)] for n in (4, 19, 33)]
    params = [SamplingParams(max_tokens=12, seed=s, temperature=t) for s, t in ((1, 1.0), (2, 0.6), (3, 0.0))]

    async def main():
        async with serving(our_app(engine, tiny_tokenizer)) as url:
            client = OpenAIEngine(f"{url}/v1", "tiny", max_concurrency=2)
            remote = await asyncio.gather(
                *(client.generate(p, sp) for p, sp in zip(prompts, params, strict=True))
            )
            await client.aclose()
        direct = await asyncio.gather(
            *(engine.generate(p, sp) for p, sp in zip(prompts, params, strict=True))
        )
        return remote, direct

    remote, direct = asyncio.run(main())
    for r, d in zip(remote, direct, strict=True):
        assert r.error is None
        assert r.token_ids == d.token_ids and r.finish_reason == d.finish_reason
        assert max(abs(a - b) for a, b in zip(r.logprobs, d.logprobs, strict=True)) < 1e-5
        assert r.text == d.text


def test_completions_chat_models_and_health(engine, tiny_tokenizer):
    async def main():
        async with serving(our_app(engine, tiny_tokenizer)) as url, aiohttp.ClientSession() as http:
            health = await (await http.get(f"{url}/health")).json()
            models = await (await http.get(f"{url}/v1/models")).json()
            text = await (
                await http.post(
                    f"{url}/v1/completions",
                    json={"model": "tiny", "prompt": "hello", "max_tokens": 5, "logprobs": 1, "seed": 0},
                )
            ).json()
            batch = await (
                await http.post(
                    f"{url}/v1/completions",
                    json={"prompt": [[5, 6, 7], [8, 9]], "n": 2, "max_tokens": 3, "return_token_ids": True},
                )
            ).json()
            chat = await (
                await http.post(
                    f"{url}/v1/chat/completions",
                    json={
                        "messages": [{"role": "user", "content": "2+2?"}],
                        "max_tokens": 6,
                        "logprobs": True,
                        "return_token_ids": True,
                    },
                )
            ).json()
            return health, models, text, batch, chat

    health, models, text, batch, chat = asyncio.run(main())
    assert health == {"status": "ok"}
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == 128
    choice = text["choices"][0]
    assert len(choice["logprobs"]["tokens"]) == len(choice["logprobs"]["token_logprobs"]) == 5
    assert "".join(choice["logprobs"]["tokens"]).startswith(choice["text"][:1])
    assert text["usage"]["prompt_tokens"] == len("hello")  # byte-level tokenizer
    assert [c["prompt_token_ids"] for c in batch["choices"]] == [[5, 6, 7]] * 2 + [[8, 9]] * 2
    assert all(len(c["token_ids"]) <= 3 for c in batch["choices"])
    rendered = tiny_tokenizer.apply_chat_template(
        [{"role": "user", "content": "2+2?"}], add_generation_prompt=True, tokenize=False
    )
    assert chat["prompt_token_ids"] == tiny_tokenizer.encode(rendered, add_special_tokens=False)
    message = chat["choices"][0]
    assert message["message"]["role"] == "assistant"
    assert len(message["logprobs"]["content"]) == len(message["token_ids"])


@pytest.mark.parametrize(
    ("path", "body", "needle"),
    [
        ("/v1/completions", "not json", "JSON object"),
        ("/v1/completions", [1, 2], "JSON object"),
        ("/v1/completions", {"max_tokens": 3}, "'prompt' is required"),
        ("/v1/completions", {"prompt": [1, "a"]}, "'prompt' must be"),
        ("/v1/completions", {"prompt": [1, 2], "temperature": -1}, "temperature"),
        ("/v1/completions", {"prompt": [1, 2], "max_tokens": "many"}, "'max_tokens' must be of type int"),
        ("/v1/completions", {"prompt": [1, 2], "stream": True}, "'stream' is not supported"),
        ("/v1/completions", {"prompt": list(range(200))}, "maximum context length is 128"),
        ("/v1/completions", {"prompt": [1, 10**7]}, "outside the vocabulary"),
        ("/v1/completions", {"prompt": []}, "empty"),
        ("/v1/chat/completions", {"messages": "hi"}, "'messages' must be"),
        ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, "messages[0] has no 'role'"),
    ],
)
def test_invalid_requests_get_400_with_a_message(engine, tiny_tokenizer, path, body, needle):
    async def main():
        async with serving(our_app(engine, tiny_tokenizer)) as url, aiohttp.ClientSession() as http:
            kwargs = {"data": body} if isinstance(body, str) else {"json": body}
            response = await http.post(f"{url}{path}", **kwargs)
            return response.status, await response.json()

    status, answer = asyncio.run(main())
    assert status == 400
    assert needle in answer["error"]["message"]


def test_client_reports_too_long_prompt_as_length(engine, tiny_tokenizer):
    async def main():
        async with serving(our_app(engine, tiny_tokenizer)) as url:
            client = OpenAIEngine(f"{url}/v1", "tiny")
            long, ok = await asyncio.gather(
                client.generate([t % 200 for t in range(300)], SamplingParams(max_tokens=4)),
                client.generate([5, 6, 7], SamplingParams(max_tokens=4)),
            )
            await client.aclose()
            return long, ok

    long, ok = asyncio.run(main())
    assert long.finish_reason is StopReason.LENGTH and "maximum context length" in long.error
    assert ok.error is None and 1 <= len(ok.token_ids) <= 4


def flaky_server_app(failures: int, delay_s: float = 0.0) -> tuple[web.Application, dict]:
    """Test double: answers 503 ``failures`` times, then a fixed completion; records concurrency and
    the model each request named."""
    state = {"calls": 0, "in_flight": 0, "max_in_flight": 0, "models": []}

    async def completions(request: web.Request) -> web.Response:
        state["models"].append((await request.json())["model"])
        state["calls"] += 1
        state["in_flight"] += 1
        state["max_in_flight"] = max(state["max_in_flight"], state["in_flight"])
        try:
            await asyncio.sleep(delay_s)
            if state["calls"] <= failures:
                return web.json_response({"error": {"message": "warming up"}}, status=503)
            choice = {
                "index": 0,
                "text": "ab",
                "finish_reason": "stop",
                "logprobs": {"tokens": ["token_id:97", "token_id:98"], "token_logprobs": [-0.5, -0.25]},
            }
            return web.json_response({"choices": [choice]})
        finally:
            state["in_flight"] -= 1

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return app, state


def test_client_retries_5xx_then_succeeds():
    app, state = flaky_server_app(failures=2)

    async def main():
        async with serving(app) as url:
            client = OpenAIEngine(f"{url}/v1", "m", max_retries=3, backoff_s=0.01)
            result = await client.generate([1, 2], SamplingParams())
            await client.aclose()
            return result

    result = asyncio.run(main())
    assert state["calls"] == 3
    assert result.token_ids == (97, 98) and result.logprobs == (-0.5, -0.25)  # parsed from "token_id:N"
    assert result.finish_reason is StopReason.STOP


def test_client_gives_up_with_an_abort_and_limits_concurrency():
    app, state = flaky_server_app(failures=0, delay_s=0.05)
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]

    async def main():
        dead = OpenAIEngine(f"http://127.0.0.1:{dead_port}/v1", "m", max_retries=1, backoff_s=0.01)
        refused = await dead.generate([1], SamplingParams())
        await dead.aclose()
        async with serving(app) as url:
            slow = OpenAIEngine(f"{url}/v1", "m", max_concurrency=2, timeout=0.01, max_retries=0)
            timed_out = await slow.generate([1], SamplingParams())
            await slow.aclose()
            await asyncio.sleep(0.2)  # let the server finish the abandoned request
            state["max_in_flight"] = 0
            limited = OpenAIEngine(f"{url}/v1", "m", max_concurrency=2)
            results = await asyncio.gather(*(limited.generate([1], SamplingParams()) for _ in range(6)))
            await limited.aclose()
        return refused, timed_out, results

    refused, timed_out, results = asyncio.run(main())
    assert refused.finish_reason is StopReason.ABORT and "2 attempts" in refused.error
    assert timed_out.finish_reason is StopReason.ABORT and "TimeoutError" in timed_out.error
    assert all(r.token_ids == (97, 98) for r in results)
    assert state["max_in_flight"] == 2


def test_client_sends_each_role_as_its_model_name_and_aborts_an_unknown_role():
    """``roles``: a request goes out under its role's model name (e.g. a vLLM LoRA module); a request
    with no role or a role not served is answered at once, without a request to the server."""
    app, state = flaky_server_app(failures=0)
    roles = {"planner": "alpha-lora", "executor": "beta-lora", "judge": "base"}

    async def main():
        async with serving(app) as url:
            client = OpenAIEngine(f"{url}/v1", "unused", roles=roles)
            served = await asyncio.gather(
                *(
                    client.generate([1], SamplingParams(role=r))
                    for r in ("planner", "executor", "judge", "planner")
                )
            )
            unknown = await client.generate([1], SamplingParams(role="critic"))
            no_role = await client.generate([1], SamplingParams())
            await client.aclose()
            one = OpenAIEngine(f"{url}/v1", "m")  # roles=None: the role is ignored
            ignored = await one.generate([1], SamplingParams(role="anyone"))
            await one.aclose()
        return served, unknown, no_role, ignored

    served, unknown, no_role, ignored = asyncio.run(main())
    assert all(c.error is None and c.token_ids == (97, 98) for c in [*served, ignored])
    assert sorted(state["models"]) == sorted(["alpha-lora", "beta-lora", "base", "alpha-lora", "m"])
    for refused in (unknown, no_role):
        assert refused.finish_reason is StopReason.ABORT and refused.token_ids == ()
        assert "['executor', 'judge', 'planner']" in refused.error
    assert "unknown role 'critic'" in unknown.error and "role is None" in no_role.error
    assert (
        OpenAIEngine("http://x/v1", "m", roles={"p": "a"}).request_body([1], SamplingParams(role="p"))[
            "model"
        ]
        == "a"
    )
    with pytest.raises(ValueError, match="at least one role"):
        OpenAIEngine("http://x/v1", "m", roles={})
    with pytest.raises(TypeError, match="model name"):
        OpenAIEngine("http://x/v1", "m", roles={"p": None})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


TOOL = {
    "type": "function",
    "function": {
        "name": "convert",
        "description": "Convert a length between units.",
        "parameters": {
            "type": "object",
            "properties": {"value": {"type": "number", "description": "how much"}},
            "required": ["value"],
        },
    },
}


def test_agent_r1_serve_command(tiny_checkpoint, tiny_tokenizer):
    """The command serves the model; --tool-prompt compact shows a request's tools as the agent
    gateway's tool_prompt does (one line in the system message, no template block of schemas)."""
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    command = ["serve", str(tiny_checkpoint), "--port", str(port), "--tool-prompt", "compact"]
    server = subprocess.Popen(
        [sys.executable, "-m", "agent_r1.cli", *command],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120

        async def main():
            async with aiohttp.ClientSession() as http:
                while True:
                    if server.poll() is not None:
                        raise AssertionError(f"agent-r1 serve exited: {server.stdout.read()}")
                    try:
                        if (await http.get(f"http://127.0.0.1:{port}/health")).status == 200:
                            break
                    except aiohttp.ClientConnectionError:
                        assert time.monotonic() < deadline, "agent-r1 serve did not come up"
                        await asyncio.sleep(0.2)
                chat = await (
                    await http.post(
                        f"http://127.0.0.1:{port}/v1/chat/completions",
                        json={
                            "messages": [{"role": "user", "content": "3 feet?"}],
                            "tools": [TOOL],
                            "max_tokens": 1,
                            "return_token_ids": True,
                        },
                    )
                ).json()
            client = OpenAIEngine(f"http://127.0.0.1:{port}/v1", tiny_checkpoint.name)
            result = await client.generate([5, 6, 7, 8], SamplingParams(max_tokens=6, seed=0))
            await client.aclose()
            return result, chat

        result, chat = asyncio.run(main())
        assert result.error is None and 1 <= len(result.token_ids) <= 6
        prompt = tiny_tokenizer.decode(chat["prompt_token_ids"])
        assert "# Tools\nconvert(value: number) - Convert a length between units." in prompt
        assert '"description": "how much"' not in prompt  # the template's JSON schema block is not there
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_serve_help_says_where_the_tool_options_apply():
    """``serve --help`` and docs/rollout.md agree: both tool options apply to chat completions with
    tools, Responses and Messages."""
    import argparse
    from pathlib import Path

    from agent_r1.commands import serve

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    help_text = " ".join(parser.format_help().split())
    assert (
        "/v1/chat/completions answers to requests with tools and in /v1/responses and /v1/messages"
        in help_text
    )
    assert "--tool-prompt {template,compact,none}" in help_text
    docs = " ".join((Path(__file__).parents[1] / "docs" / "rollout.md").read_text().split())
    assert "the answers are parsed with it in **all three chat APIs**" in docs
