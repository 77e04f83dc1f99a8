"""The agent gateway over the real ``openai`` client: exact prompts, tool calls, streaming, sessions."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest
from doubles import ScriptedEngine

from agent_r1.envs.gateway import Gateway, engine_sampler, exact_fraction
from agent_r1.envs.tool_env import ToolEnv
from agent_r1.flows.base import AgentEnvLoop
from agent_r1.models.tokens import encode_text, render_messages
from agent_r1.tools import tool
from agent_r1.types import Completion, SamplingParams, StopReason


@tool
def add(a: int, b: int) -> str:
    """Add two integers.

    Args:
        a: the first.
        b: the second.
    """
    return str(a + b)


TOOLS = [add.schema()]
QUESTION = "What is 1 + 2 + 3 + 4 + 5?"


def call_text(a: int, b: int) -> str:
    return f'<tool_call>{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call>'


def byte_spelled_call(tokenizer, a: int, b: int) -> Completion:
    """A response whose ``<tool_call>`` tag is sampled as bytes, not as the special token: decoding and
    re-encoding it gives other ids, so only a token-level append reproduces it."""
    text = call_text(a, b)
    ids = [
        *encode_text(tokenizer, "<tool"),
        *encode_text(tokenizer, text[len("<tool") :]),
        tokenizer.eos_token_id,
    ]
    return Completion(ids, [-0.5] * len(ids), StopReason.STOP)


def script(tokenizer):
    """Four tool calls (the second byte-spelled), then the answer: a five-turn conversation."""
    return [call_text(1, 2), byte_spelled_call(tokenizer, 3, 3), call_text(6, 4), call_text(10, 5), "15"]


async def openai_tool_loop(client: openai.AsyncOpenAI, question: str = QUESTION, max_turns: int = 8) -> str:
    """The usual tool loop, written only with the openai package."""
    messages = [{"role": "user", "content": question}]
    for _ in range(max_turns):
        response = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return message.content or ""
        for call in message.tool_calls:
            arguments = json.loads(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": add.fn(**arguments)})
    return ""


def test_five_turn_tool_conversation_has_the_prompt_ids_of_tool_env_append(tiny_tokenizer):
    engine = ScriptedEngine(tiny_tokenizer, script(tiny_tokenizer))

    async def through_gateway():
        async with Gateway(tiny_tokenizer, engine_sampler(engine)) as gateway:
            session = gateway.open_session()
            client = openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
            answer = await openai_tool_loop(client)
            await client.close()
            return answer, session.steps()

    answer, steps = asyncio.run(through_gateway())
    assert answer == "15"
    reference = ScriptedEngine(tiny_tokenizer, script(tiny_tokenizer))
    loop = AgentEnvLoop(
        lambda: ToolEnv(
            tiny_tokenizer, [add], context="append", outcome_reward=lambda a, t: float(a == "15")
        ),
        tiny_tokenizer,
        SamplingParams(max_tokens=256),
    )
    expected = asyncio.run(loop.run(reference, {"prompt": QUESTION}))
    assert expected.outcome_reward == 1.0 and len(expected.steps) == 5
    assert [s.prompt_ids for s in steps] == [s.prompt_ids for s in expected.steps]
    assert [s.response_ids for s in steps] == [s.response_ids for s in expected.steps]
    assert [s.logprobs for s in steps] == [s.logprobs for s in expected.steps]
    assert [s.info["gateway"]["prompt"] for s in steps] == ["fresh", *["extends"] * 4]
    assert [s.info["gateway"].get("extends_call") for s in steps] == [None, 0, 1, 2, 3]
    assert exact_fraction(steps) == 1.0
    # the byte-spelled tag survives: re-rendering the conversation would have re-tokenised it
    third = steps[2].prompt_ids
    assert third[: len(steps[1].prompt_ids) + len(steps[1].response_ids)] == (
        *steps[1].prompt_ids,
        *steps[1].response_ids,
    )
    transcript = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": call_text(1, 2)},
        {"role": "tool", "content": "3"},
        {"role": "assistant", "content": call_text(3, 3)},
        {"role": "tool", "content": "6"},
    ]
    rerendered = tuple(encode_text(tiny_tokenizer, render_messages(tiny_tokenizer, transcript, tools=TOOLS)))
    assert tiny_tokenizer.decode(list(rerendered)) == tiny_tokenizer.decode(list(third))
    assert rerendered != third


def test_rewritten_history_starts_a_fresh_prompt_and_says_why(tiny_tokenizer):
    engine = ScriptedEngine(tiny_tokenizer, [call_text(1, 2), "3", "again"])

    async def main():
        async with Gateway(tiny_tokenizer, engine_sampler(engine)) as gateway:
            session = gateway.open_session()
            client = openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
            assert await openai_tool_loop(client, "1 + 2?") == "3"
            # the agent drops the tool turn and asks again: not an extension of anything
            await client.chat.completions.create(
                model="policy",
                messages=[{"role": "user", "content": "1 + 2?"}, {"role": "user", "content": "again"}],
                tools=TOOLS,
            )
            await client.close()
            return session.steps()

    steps = asyncio.run(main())
    assert [s.info["gateway"]["prompt"] for s in steps] == ["fresh", "extends", "fresh"]
    assert "message 1 differs" in steps[2].info["gateway"]["fresh_reason"]
    assert "rewritten" in steps[2].info["gateway"]["fresh_reason"]
    assert exact_fraction(steps) == 0.5
    assert exact_fraction(steps[:1]) == 1.0 and exact_fraction([]) is None  # one call is exact


def test_streaming_sends_tool_call_deltas_the_openai_client_reassembles(tiny_tokenizer):
    two_calls = f"Let me add.{call_text(1, 2)}{call_text(3, 4)}"
    engine = ScriptedEngine(tiny_tokenizer, [two_calls, two_calls])

    async def main():
        async with Gateway(tiny_tokenizer, engine_sampler(engine)) as gateway:
            session = gateway.open_session()
            client = openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
            messages = [{"role": "user", "content": "add twice"}]
            chunks = []
            stream = await client.chat.completions.create(
                model="policy",
                messages=messages,
                tools=TOOLS,
                stream=True,
                stream_options={"include_usage": True},
            )
            async for chunk in stream:
                chunks.append(chunk)
            plain = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
            await client.close()
            return chunks, plain

    chunks, plain = asyncio.run(main())
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls: dict[int, dict] = {}
    for c in chunks:
        for delta in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            entry = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
            entry["id"] = delta.id or entry["id"]
            entry["name"] += delta.function.name or ""
            entry["arguments"] += delta.function.arguments or ""
    assert content == "Let me add."
    assert [(v["id"], v["name"], json.loads(v["arguments"])) for v in calls.values()] == [
        ("call_0_0", "add", {"a": 1, "b": 2}),
        ("call_0_1", "add", {"a": 3, "b": 4}),
    ]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert (
        chunks[-1].usage is not None
        and chunks[-1].usage.completion_tokens
        == len(tiny_tokenizer.encode(two_calls, add_special_tokens=False)) + 1
    )
    # the same call without streaming: one message holding both calls
    message = plain.choices[0].message
    assert plain.choices[0].finish_reason == "tool_calls"
    assert [json.loads(c.function.arguments) for c in message.tool_calls] == [
        {"a": 1, "b": 2},
        {"a": 3, "b": 4},
    ]


def test_malformed_call_comes_back_as_content_and_is_flagged(tiny_tokenizer):
    broken = '<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>'
    engine = ScriptedEngine(
        tiny_tokenizer, [broken, '```json\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n```']
    )

    async def main():
        async with Gateway(tiny_tokenizer, engine_sampler(engine)) as gateway:
            session = gateway.open_session()
            client = openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
            first = await client.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "add"}], tools=TOOLS
            )
            second = await client.chat.completions.create(
                model="policy",
                messages=[{"role": "user", "content": "add"}],
                tools=TOOLS,
                tool_choice="required",
            )
            await client.close()
            return first, second, session.records

    first, second, records = asyncio.run(main())
    assert first.choices[0].message.content == broken and first.choices[0].message.tool_calls is None
    assert first.choices[0].finish_reason == "stop"
    assert "invalid JSON" in records[0].info["tool_parse_errors"][0]
    assert "without <tool_call> tags" in records[1].info["near_miss"]
    assert records[1].info["tool_choice_unmet"] == "required"
    assert second.choices[0].message.tool_calls is None


def test_sessions_are_isolated_and_errors_are_clear(tiny_tokenizer):
    engine = ScriptedEngine(tiny_tokenizer, lambda prompt: "A" if "alpha" in prompt else "B")

    async def main():
        async with Gateway(tiny_tokenizer, engine_sampler(engine), max_calls=2) as gateway:
            a, b = gateway.open_session(), gateway.open_session()
            clients = [
                openai.AsyncOpenAI(base_url=s.base_url, api_key=s.api_key, max_retries=0) for s in (a, b)
            ]

            async def chat(client, word):
                r = await client.chat.completions.create(
                    model="x", messages=[{"role": "user", "content": word}]
                )
                return r.choices[0].message.content

            answers = await asyncio.gather(
                *(chat(c, w) for c, w in zip(clients * 2, ["alpha", "beta"] * 2, strict=True))
            )
            models = await clients[0].models.list()
            errors = {}
            try:
                await chat(clients[0], "alpha")  # a third call
            except openai.APIStatusError as e:
                errors["limit"] = e.status_code, e.message
            async with aiohttp.ClientSession() as http:
                url = f"{gateway.url}/sessions/{b.id}/v1/chat/completions"
                auth = {"Authorization": f"Bearer {b.api_key}"}
                bad = [
                    ({"messages": [{"role": "user", "content": "x"}], "n": 2}, auth),
                    ({"messages": []}, auth),
                    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "web"}]}, auth),
                    (
                        {"messages": [{"role": "user", "content": "x"}]},
                        {"Authorization": f"Bearer {a.api_key}"},
                    ),
                ]
                for body, headers in bad:
                    response = await http.post(url, json=body, headers=headers)
                    errors.setdefault("bad", []).append(
                        (response.status, (await response.json())["error"]["message"])
                    )
                response = await http.post(
                    f"{gateway.url}/sessions/nope/v1/chat/completions", json={}, headers=auth
                )
                errors["unknown"] = response.status
                gateway.close_session(a)
                response = await http.post(
                    f"{gateway.url}/sessions/{a.id}/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": "x"}]},
                    headers={"Authorization": f"Bearer {a.api_key}"},
                )
                errors["ended"] = response.status, (await response.json())["error"]["message"]
            for c in clients:
                await c.close()
            return answers, models, errors, a.records, b.records

    answers, models, errors, records_a, records_b = asyncio.run(main())
    assert answers == ["A", "B", "A", "B"]
    assert [m.id for m in models.data] == ["agent-r1"]
    assert [r.text for r in records_a] == ["A<|im_end|>"] * 2 and [r.text for r in records_b] == [
        "B<|im_end|>"
    ] * 2
    assert errors["limit"][0] == 429 and "limit of 2 model calls" in errors["limit"][1]
    statuses = [s for s, _ in errors["bad"]]
    assert statuses == [400, 400, 400, 401]
    assert "'n' must be 1" in errors["bad"][0][1] and "tools[0]" in errors["bad"][2][1]
    assert errors["unknown"] == 404
    assert errors["ended"][0] == 410 and "has ended" in errors["ended"][1]


def test_a_client_that_disconnects_mid_request_leaves_the_gateway_serving(tiny_tokenizer):
    class StuckEngine(ScriptedEngine):
        """TEST DOUBLE: a scripted engine whose first generate never finishes unless cancelled."""

        cancelled: asyncio.Event

        async def generate(self, prompt_ids, params):
            if not self.calls:
                self.calls.append((list(prompt_ids), params))
                try:
                    await asyncio.Event().wait()
                except asyncio.CancelledError:
                    self.cancelled.set()
                    raise
            return await super().generate(prompt_ids, params)

    engine = StuckEngine(tiny_tokenizer, lambda prompt: "fine")

    async def main():
        engine.cancelled = asyncio.Event()
        async with Gateway(tiny_tokenizer, engine_sampler(engine)) as gateway:
            session = gateway.open_session()
            client = openai.AsyncOpenAI(
                base_url=session.base_url, api_key=session.api_key, max_retries=0, timeout=0.5
            )
            with pytest.raises(openai.APITimeoutError):
                await client.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}])
            await engine.cancelled.wait()  # the disconnect cancelled the engine request
            r = await client.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}])
            await client.close()
            return r.choices[0].message.content, session.records

    content, records = asyncio.run(main())
    assert content == "fine" and [r.index for r in records] == [1]


def test_max_tokens_is_capped_and_a_prompt_over_the_context_is_refused(tiny_tokenizer):
    engine = ScriptedEngine(tiny_tokenizer, lambda prompt: "ok")

    async def main():
        async with Gateway(tiny_tokenizer, engine_sampler(engine), max_tokens=5, max_context=200) as gateway:
            session = gateway.open_session()
            client = openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
            await client.chat.completions.create(
                model="x", messages=[{"role": "user", "content": "hi"}], max_tokens=100, temperature=0.5
            )
            with pytest.raises(openai.BadRequestError, match="maximum context length is 200"):
                await client.chat.completions.create(
                    model="x", messages=[{"role": "user", "content": "x" * 300}]
                )
            await client.close()

    asyncio.run(main())
    (_, params), *_ = engine.calls
    assert params.max_tokens == 5 and params.temperature == 0.5 and len(engine.calls) == 1
