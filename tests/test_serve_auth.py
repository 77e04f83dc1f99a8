"""``agent-r1 serve`` closed to strangers: ``--api-key`` checked with the real ``openai`` client, and a
non-loopback bind refused without a key unless ``--allow-unauthenticated`` is given."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from contextlib import asynccontextmanager

import aiohttp
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from agent_r1.rollout import HFEngine, OpenAIEngine
from agent_r1.rollout.server import build_app, check_exposure, is_loopback, start_server
from agent_r1.types import SamplingParams, StopReason

KEY = "sk-test-3f9a"


@pytest.fixture(scope="module")
def engine(tiny_checkpoint, tiny_tokenizer):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    return HFEngine(model, tokenizer=tiny_tokenizer, max_context=128)


@asynccontextmanager
async def serving_with_key(engine, tokenizer):
    runner, port = await start_server(build_app(engine, model_name="tiny", tokenizer=tokenizer, api_key=KEY))
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def test_openai_client_with_the_key_is_served_and_without_it_is_refused(engine, tiny_tokenizer):
    async def main():
        async with serving_with_key(engine, tiny_tokenizer) as url:
            right = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
            completion = await right.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=3)
            chat = await right.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3
            )
            models = await right.models.list()
            wrong = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY + "x", max_retries=0)
            with pytest.raises(openai.AuthenticationError) as refused:
                await wrong.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=3)
            with pytest.raises(openai.AuthenticationError):
                await wrong.models.list()
            await right.close()
            await wrong.close()
            async with aiohttp.ClientSession() as http:
                no_key = await http.post(f"{url}/v1/completions", json={"prompt": [5], "max_tokens": 1})
                other_scheme = await http.get(f"{url}/v1/models", headers={"Authorization": f"Basic {KEY}"})
                unknown_path = await http.get(f"{url}/v2/anything")
                health = await http.get(f"{url}/health")
                return (
                    completion,
                    chat,
                    models,
                    refused.value,
                    (no_key.status, await no_key.json(), no_key.headers.get("WWW-Authenticate")),
                    other_scheme.status,
                    unknown_path.status,
                    health.status,
                )

    completion, chat, models, refused, no_key, other_scheme, unknown_path, health = asyncio.run(main())
    assert 1 <= completion.usage.completion_tokens <= 3 and completion.choices[0].text
    assert chat.choices[0].message.role == "assistant"
    assert [m.id for m in models.data] == ["tiny"]
    assert refused.status_code == 401 and "API key" in refused.message
    status, body, challenge = no_key
    assert status == 401 and body["error"]["type"] == "authentication_error" and challenge == "Bearer"
    assert other_scheme == 401
    assert unknown_path == 401  # every path but /health is guarded, known or not
    assert health == 200  # load balancers probe /health without credentials


def test_openai_engine_sends_the_key_and_a_401_is_not_retried(engine, tiny_tokenizer):
    async def main():
        async with serving_with_key(engine, tiny_tokenizer) as url:
            keyed = OpenAIEngine(f"{url}/v1", "tiny", api_key=KEY)
            unkeyed = OpenAIEngine(f"{url}/v1", "tiny", max_retries=3, backoff_s=0.01)
            results = await asyncio.gather(
                keyed.generate([5, 6, 7], SamplingParams(max_tokens=4, temperature=0)),
                unkeyed.generate([5, 6, 7], SamplingParams(max_tokens=4, temperature=0)),
            )
            await keyed.aclose()
            await unkeyed.aclose()
            return results

    served, refused = asyncio.run(main())
    assert served.error is None and 1 <= len(served.token_ids) <= 4
    assert refused.finish_reason is StopReason.ABORT and "HTTP 401" in refused.error
    assert "attempts" not in refused.error  # a wrong key is final: retrying cannot fix it


def test_build_app_refuses_an_empty_key(engine):
    with pytest.raises(ValueError, match="api_key is empty"):
        build_app(engine, model_name="tiny", api_key="")


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.8.9.10", True),
        ("::1", True),
        ("[::1]", True),
        ("::ffff:127.0.0.1", True),
        ("localhost", True),
        ("LocalHost.", True),
        ("0.0.0.0", False),
        ("::", False),
        ("", False),
        ("192.168.1.7", False),
        ("10.0.0.1", False),
        ("fe80::1", False),
        ("myhost.example.com", False),  # a name may resolve to any interface
        ("localhost.example.com", False),
    ],
)
def test_is_loopback(host, loopback):
    assert is_loopback(host) is loopback


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.7", "gpu-node-3"])
def test_a_non_loopback_bind_needs_a_key_or_an_explicit_opt_out(host):
    with pytest.raises(ValueError, match="without an API key.*--allow-unauthenticated"):
        check_exposure(host, api_key=None)
    check_exposure(host, api_key=KEY)
    check_exposure(host, api_key=None, allow_unauthenticated=True)


def test_loopback_needs_no_key_and_an_empty_key_is_refused():
    check_exposure("127.0.0.1", api_key=None)
    check_exposure("localhost", api_key=KEY)
    with pytest.raises(ValueError, match="API key is empty"):
        check_exposure("0.0.0.0", api_key="", allow_unauthenticated=True)


def run_serve(*args: str, env_key: str | None = None) -> subprocess.CompletedProcess:
    """``agent-r1 serve`` on a folder that does not exist: the exposure check runs before the model
    loads, so the message says which check stopped it, and nothing is ever bound."""
    env = {k: v for k, v in os.environ.items() if k != "AGENT_R1_API_KEY"}
    if env_key is not None:
        env["AGENT_R1_API_KEY"] = env_key
    return subprocess.run(
        [sys.executable, "-m", "agent_r1.cli", "serve", "/nonexistent/model", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_serve_command_refuses_a_public_bind_without_a_key():
    refused = run_serve("--host", "0.0.0.0")
    assert refused.returncode == 1
    assert "refusing to serve on '0.0.0.0' without an API key" in refused.stderr
    empty = run_serve("--host", "127.0.0.1", "--api-key", "")
    assert empty.returncode == 1 and "API key is empty" in empty.stderr
    # allowed: the command gets past the exposure check and stops at the missing model instead
    for args, env_key in (
        (("--host", "0.0.0.0", "--allow-unauthenticated"), None),
        (("--host", "0.0.0.0"), KEY),  # the key from AGENT_R1_API_KEY
    ):
        allowed = run_serve(*args, env_key=env_key)
        assert allowed.returncode == 1, (args, allowed.stderr)
        assert "is not a model folder" in allowed.stderr, (args, allowed.stderr)


# ---------------------------------------------------------------- agent-r1 view: the same rule


def test_view_command_refuses_a_public_bind_without_a_key(tmp_path, monkeypatch, capsys):
    """``agent-r1 view`` of a run directory that does not exist: the exposure check runs first, so a
    refused start names the check and an allowed one stops at the missing folder; nothing is bound."""
    from agent_r1.cli import main

    missing = str(tmp_path / "no-run")
    monkeypatch.delenv("AGENT_R1_API_KEY", raising=False)
    assert main(["view", missing, "--port", "0", "--host", "0.0.0.0"]) == 1
    refused = capsys.readouterr().err
    assert "refusing to serve on '0.0.0.0' without an API key" in refused
    assert "read the run's trajectories" in refused
    for args, env_key in (
        (("--host", "0.0.0.0", "--allow-unauthenticated"), None),
        (("--host", "0.0.0.0"), KEY),  # the key from AGENT_R1_API_KEY
        (("--host", "0.0.0.0", "--api-key", KEY), None),
        (("--host", "127.0.0.1"), None),
    ):
        if env_key is None:
            monkeypatch.delenv("AGENT_R1_API_KEY", raising=False)
        else:
            monkeypatch.setenv("AGENT_R1_API_KEY", env_key)
        assert main(["view", missing, "--port", "0", *args]) == 1, args
        allowed = capsys.readouterr().err
        assert "does not exist" in allowed and "refusing" not in allowed, (args, allowed)


def test_view_with_a_key_serves_only_requests_that_carry_it(tmp_path, capsys):
    import threading
    import urllib.error
    import urllib.request

    from agent_r1.report.server import make_server

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n')
    server = make_server(tmp_path, host="127.0.0.1", port=0, api_key=KEY)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/"

    def status(address: str, headers: dict | None = None) -> int:
        try:
            with urllib.request.urlopen(
                urllib.request.Request(address, headers=headers or {}), timeout=30
            ) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    try:
        assert status(url) == 401
        assert status(url + "?key=wrong") == 401
        assert status(url, {"Authorization": f"Bearer {KEY}x"}) == 401
        assert status(url + f"?key={KEY}") == 200
        assert status(url, {"Authorization": f"Bearer {KEY}"}) == 200
        assert status(url + f"elsewhere?key={KEY}") == 404  # the key first, then the path
    finally:
        server.shutdown()
        server.server_close()
    with pytest.raises(ValueError, match="API key is empty"):
        make_server(tmp_path, api_key="")
    log = capsys.readouterr().err
    assert "GET /?key=*** " in log and KEY not in log  # the access log does not leak the key
