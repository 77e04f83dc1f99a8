"""The Responses API and Anthropic's Messages API, in the gateway and in ``agent-r1 serve``, with the
real ``openai`` and ``anthropic`` SDKs: tool round trips, streaming, exact prompts, header routing,
and bad input answered 400 in each API's own error shape."""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager

import aiohttp
import anthropic
import openai
import pytest
import torch
from doubles import ScriptedEngine
from test_gateway import QUESTION, TOOLS, add, call_text, openai_tool_loop, script
from transformers import AutoModelForCausalLM

from agent_r1.envs.gateway import SESSION_HEADER, Gateway, engine_sampler, exact_fraction
from agent_r1.rollout import HFEngine
from agent_r1.rollout.server import build_app, start_server

RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]
ANTHROPIC_TOOLS = [
    {"name": f["name"], "description": f["description"], "input_schema": f["parameters"]}
    for f in (t["function"] for t in TOOLS)
]


async def responses_loop(client: openai.AsyncOpenAI, *, chain: bool, question: str = QUESTION) -> str:
    """A tool loop over ``client.responses.create``: resending the whole input, or (``chain``) only
    the new items after ``previous_response_id``."""
    items: list[dict] = [{"role": "user", "content": question}]
    new, previous = items, None
    for _ in range(8):
        if chain:
            response = await client.responses.create(
                model="policy", input=new, tools=RESPONSES_TOOLS, previous_response_id=previous
            )
        else:
            response = await client.responses.create(model="policy", input=items, tools=RESPONSES_TOOLS)
        items += [o.model_dump(exclude_none=True) for o in response.output]
        calls = [o for o in response.output if o.type == "function_call"]
        if not calls:
            return response.output_text
        new = [
            {
                "type": "function_call_output",
                "call_id": c.call_id,
                "output": add.fn(**json.loads(c.arguments)),
            }
            for c in calls
        ]
        items += new
        previous = response.id
    return ""


async def anthropic_loop(client: anthropic.AsyncAnthropic, question: str = QUESTION) -> str:
    """The usual Anthropic tool loop: resend the messages with tool_use and tool_result blocks."""
    messages: list[dict] = [{"role": "user", "content": question}]
    for _ in range(8):
        message = await client.messages.create(
            model="policy", max_tokens=256, messages=messages, tools=ANTHROPIC_TOOLS
        )
        messages.append(
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]}
        )
        uses = [b for b in message.content if b.type == "tool_use"]
        if not uses:
            assert message.stop_reason == "end_turn"
            return "".join(b.text for b in message.content if b.type == "text")
        assert message.stop_reason == "tool_use"
        messages.append(
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": u.id, "content": add.fn(**u.input)} for u in uses
                ],
            }
        )
    return ""


def through_gateway(tokenizer, loop):
    engine = ScriptedEngine(tokenizer, script(tokenizer))

    async def main():
        async with Gateway(tokenizer, engine_sampler(engine)) as gateway:
            session = gateway.open_session()
            answer = await loop(session)
            return answer, session.steps()

    return asyncio.run(main())


async def with_openai(session, agent):
    client = openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
    try:
        return await agent(client)
    finally:
        await client.close()


async def with_anthropic(session, agent):
    client = anthropic.AsyncAnthropic(
        base_url=session.anthropic_base_url, api_key=session.api_key, max_retries=0
    )
    try:
        return await agent(client)
    finally:
        await client.close()


def test_every_dialect_gives_the_prompt_ids_of_the_chat_tool_loop(tiny_tokenizer):
    """The five-turn tool conversation of test_gateway (a byte-spelled call among them), spoken as chat
    completions, as Responses resending the input, as Responses chained by previous_response_id, and
    as Anthropic messages: the same exact steps, every later prompt an extension."""
    chat = through_gateway(tiny_tokenizer, lambda s: with_openai(s, openai_tool_loop))
    full = through_gateway(tiny_tokenizer, lambda s: with_openai(s, lambda c: responses_loop(c, chain=False)))
    chained = through_gateway(
        tiny_tokenizer, lambda s: with_openai(s, lambda c: responses_loop(c, chain=True))
    )
    claude = through_gateway(tiny_tokenizer, lambda s: with_anthropic(s, anthropic_loop))
    for answer, steps in (chat, full, chained, claude):
        assert answer == "15" and len(steps) == 5
        assert [s.prompt_ids for s in steps] == [s.prompt_ids for s in chat[1]]
        assert [s.response_ids for s in steps] == [s.response_ids for s in chat[1]]
        assert [s.info["gateway"]["prompt"] for s in steps] == ["fresh", *["extends"] * 4]
        assert [s.info["gateway"].get("extends_call") for s in steps] == [None, 0, 1, 2, 3]
        assert exact_fraction(steps) == 1.0


def test_streams_reassemble_in_both_sdks(tiny_tokenizer):
    two_calls = f"Let me add.{call_text(1, 2)}{call_text(3, 4)}"
    engine = ScriptedEngine(tiny_tokenizer, lambda prompt: two_calls)

    async def main():
        async with Gateway(tiny_tokenizer, engine_sampler(engine)) as gateway:
            session = gateway.open_session()
            oai = openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
            claude = anthropic.AsyncAnthropic(
                base_url=session.anthropic_base_url, api_key=session.api_key, max_retries=0
            )
            question = [{"role": "user", "content": "add twice"}]
            async with oai.responses.stream(model="p", input=question, tools=RESPONSES_TOOLS) as stream:
                kinds = [event.type async for event in stream]
                helper = await stream.get_final_response()
            raw = await oai.responses.create(model="p", input=question, tools=RESPONSES_TOOLS, stream=True)
            raw_events = [event async for event in raw]
            async with claude.messages.stream(
                model="p", max_tokens=256, messages=question, tools=ANTHROPIC_TOOLS
            ) as stream:
                text = "".join([t async for t in stream.text_stream])
                final = await stream.get_final_message()
            await oai.close()
            await claude.close()
            return kinds, helper, raw_events, text, final, session.steps()

    kinds, helper, raw_events, text, final, steps = asyncio.run(main())
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert kinds.count("response.function_call_arguments.done") == 2
    assert helper.output_text == "Let me add."
    calls = [(o.call_id, o.name, json.loads(o.arguments)) for o in helper.output if o.type == "function_call"]
    assert calls == [("call_0_0", "add", {"a": 1, "b": 2}), ("call_0_1", "add", {"a": 3, "b": 4})]
    completed = raw_events[-1].response
    assert [o.type for o in completed.output] == ["message", "function_call", "function_call"]
    assert completed.usage.output_tokens == len(steps[1].response_ids)
    assert [e.sequence_number for e in raw_events] == list(range(len(raw_events)))
    assert text == "Let me add."
    assert [(b.type, getattr(b, "input", None)) for b in final.content] == [
        ("text", None),
        ("tool_use", {"a": 1, "b": 2}),
        ("tool_use", {"a": 3, "b": 4}),
    ]
    assert final.stop_reason == "tool_use" and final.usage.output_tokens == len(steps[2].response_ids)
    assert len(steps) == 3


def test_header_routing_and_bad_input_in_each_apis_error_shape(tiny_tokenizer):
    engine = ScriptedEngine(
        tiny_tokenizer, lambda prompt: "3" if "<tool_response>" in prompt else call_text(1, 2)
    )

    async def main():
        async with Gateway(tiny_tokenizer, engine_sampler(engine)) as gateway:
            session = gateway.open_session()
            route = {SESSION_HEADER: session.id}
            bearer = {**route, "Authorization": f"Bearer {session.api_key}"}
            x_key = {**route, "x-api-key": session.api_key}
            bad_responses = [
                {"input": [{"type": "reasoning", "summary": []}]},
                {"input": [{"type": "function_call_output", "call_id": "call_9_0", "output": "3"}]},
                {"input": "hi", "tools": [{"type": "web_search"}]},
                {"input": "hi", "background": True},
                {"input": "hi", "n": 2},
                {"input": "hi", "previous_response_id": "resp_unknown"},
                {"input": "hi", "text": {"format": {"type": "json_schema", "schema": {}}}},
            ]
            bad_messages = [
                {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
                {
                    "messages": [
                        {
                            "role": "user",
                            "content": [{"type": "tool_result", "tool_use_id": "x", "content": "3"}],
                        }
                    ]
                },
                {
                    "messages": [{"role": "user", "content": "hi"}],
                    "tools": [{"type": "web_search_20250305", "name": "web_search"}],
                },
                {
                    "messages": [{"role": "user", "content": "hi"}],
                    "thinking": {"type": "enabled", "budget_tokens": 1024},
                },
                {
                    "messages": [
                        {"role": "user", "content": "hi"},
                        {"role": "assistant", "content": "The answer is"},
                    ]
                },
            ]
            answers = {"responses": [], "messages": []}
            async with aiohttp.ClientSession() as http:
                for body in bad_responses:
                    r = await http.post(
                        f"{gateway.url}/v1/responses", json={"model": "p", **body}, headers=bearer
                    )
                    answers["responses"].append((r.status, await r.json()))
                for body in bad_messages:
                    r = await http.post(
                        f"{gateway.url}/v1/messages",
                        json={"model": "p", "max_tokens": 8, **body},
                        headers=x_key,
                    )
                    answers["messages"].append((r.status, await r.json()))
                good = {"model": "p", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
                r = await http.post(
                    f"{gateway.url}/v1/messages", json=good, headers={**route, "x-api-key": "wrong"}
                )
                answers["wrong_key"] = r.status, await r.json()
                r = await http.post(
                    f"{gateway.url}/v1/responses", json={"input": "hi"}, headers={"x-api-key": "k"}
                )
                answers["no_session"] = r.status, await r.json()
            # the session goes on: both SDKs, routed by the header on the gateway's root URL
            oai = openai.AsyncOpenAI(
                base_url=f"{gateway.url}/v1", api_key=session.api_key, default_headers=route, max_retries=0
            )
            claude = anthropic.AsyncAnthropic(
                base_url=gateway.url, api_key=session.api_key, default_headers=route, max_retries=0
            )
            first = await claude.messages.create(
                model="p",
                max_tokens=256,
                messages=[{"role": "user", "content": "1 + 2?"}],
                tools=ANTHROPIC_TOOLS,
            )
            with pytest.raises(anthropic.BadRequestError) as refused:
                await claude.messages.create(
                    model="p",
                    max_tokens=256,
                    messages=[
                        {
                            "role": "user",
                            "content": [{"type": "tool_result", "tool_use_id": "nope", "content": "3"}],
                        }
                    ],
                )
            with pytest.raises(openai.BadRequestError) as refused_oai:
                await oai.responses.create(model="p", input=[{"type": "item_reference", "id": "x"}])
            second = await oai.responses.create(model="p", input="1 + 2?", tools=RESPONSES_TOOLS)
            await oai.close()
            await claude.close()
            return answers, first, refused.value, refused_oai.value, second, session.records

    answers, first, refused, refused_oai, second, records = asyncio.run(main())
    for status, body in answers["responses"]:
        assert status == 400 and set(body["error"]) == {"message", "type", "param", "code"}
        assert body["error"]["type"] == "invalid_request_error" and body["error"]["code"] == 400
    messages = [b["error"]["message"] for _, b in answers["responses"]]
    assert "item type 'reasoning' is not supported" in messages[0]
    assert "call_id 'call_9_0', which no function_call" in messages[1]
    assert "type 'web_search'" in messages[2] and "built-in tools" in messages[2]
    assert "'background'" in messages[3] and "'n' must be 1" in messages[4]
    assert "no response 'resp_unknown'" in messages[5] and "text.format" in messages[6]
    assert [b["error"]["param"] for _, b in answers["responses"]][:3] == ["input[0]", "input[0]", "tools"]
    for status, body in answers["messages"]:
        assert status == 400 and body["type"] == "error"
        assert body["error"]["type"] == "invalid_request_error" and set(body["error"]) == {"type", "message"}
    messages = [b["error"]["message"] for _, b in answers["messages"]]
    assert "messages.0.content.0: block type 'image' is not supported" in messages[0]
    assert "tool_use_id 'x', which no tool_use block" in messages[1]
    assert "type 'web_search_20250305'" in messages[2] and "'thinking'" in messages[3]
    assert "prefilling" in messages[4]
    assert answers["wrong_key"][0] == 401
    assert answers["wrong_key"][1]["error"]["type"] == "authentication_error"
    assert answers["no_session"][0] == 404 and SESSION_HEADER in answers["no_session"][1]["error"]["message"]
    assert refused.status_code == 400 and "tool_use_id 'nope'" in refused.message
    assert refused_oai.status_code == 400 and "item_reference" in refused_oai.message
    assert [b.type for b in first.content] == ["tool_use"] and first.content[0].input == {"a": 1, "b": 2}
    assert [o.type for o in second.output] == ["function_call"]
    assert [r.index for r in records] == [0, 1]  # the refused requests made no call


# ---------------------------------------------------------------------------------------------------
# agent-r1 serve
# ---------------------------------------------------------------------------------------------------

KEY = "sk-dialects"


@pytest.fixture(scope="module")
def engine(tiny_checkpoint, tiny_tokenizer):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    return HFEngine(model, tokenizer=tiny_tokenizer, max_context=256)


@asynccontextmanager
async def serving(engine, tokenizer, name="tiny"):
    runner, port = await start_server(build_app(engine, model_name=name, tokenizer=tokenizer, api_key=KEY))
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def rendered_ids(tokenizer, messages, tools=None) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def test_serve_answers_both_apis_with_the_real_tiny_model(engine, tiny_tokenizer):
    async def main():
        async with serving(engine, tiny_tokenizer) as url:
            oai = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
            claude = anthropic.AsyncAnthropic(base_url=url, api_key=KEY, max_retries=0)
            first = await oai.responses.create(
                model="tiny", instructions="Be brief.", input="hi", max_output_tokens=4, temperature=0
            )
            follow = await oai.responses.create(
                model="tiny", input="more", previous_response_id=first.id, max_output_tokens=4, temperature=0
            )
            message = await claude.messages.create(
                model="tiny", system="Be brief.", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
            )
            async with claude.messages.stream(
                model="tiny", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
            ) as stream:
                streamed = await stream.get_final_message()
            with pytest.raises(anthropic.NotFoundError):
                await claude.messages.create(
                    model="other", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
                )
            with pytest.raises(anthropic.AuthenticationError):
                await anthropic.AsyncAnthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(
                    model="tiny", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
                )
            await oai.close()
            await claude.close()
            return first, follow, message, streamed

    first, follow, message, streamed = asyncio.run(main())
    assert first.status == "incomplete" and first.incomplete_details.reason == "max_output_tokens"
    assert first.usage.output_tokens == 4
    assert first.usage.input_tokens == len(
        rendered_ids(
            tiny_tokenizer, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
        )
    )
    # previous_response_id continues the conversation (the instructions are not carried over, as in the API)
    history = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "more"},
    ]
    assert follow.usage.input_tokens == len(rendered_ids(tiny_tokenizer, history))
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 4
    assert [b.type for b in message.content] == ["text"]
    assert streamed.stop_reason == "max_tokens" and streamed.usage.output_tokens == 4


def test_serve_tool_round_trips_and_bad_input(tiny_tokenizer):
    """A scripted engine (TEST DOUBLE: no model) behind the real server isolates the protocol: the
    tool call is parsed into each API's shape, and the tool's result reaches the next prompt."""
    engine = ScriptedEngine(
        tiny_tokenizer, lambda prompt: "3" if "<tool_response>" in prompt else call_text(1, 2)
    )

    async def main():
        async with serving(engine, tiny_tokenizer, "policy") as url:
            oai = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
            claude = anthropic.AsyncAnthropic(base_url=url, api_key=KEY, max_retries=0)
            responses_answer = await responses_loop(oai, chain=True, question="1 + 2?")
            anthropic_answer = await anthropic_loop(claude, "1 + 2?")
            with pytest.raises(openai.BadRequestError) as web_search:
                await oai.responses.create(model="policy", input="hi", tools=[{"type": "web_search"}])
            with pytest.raises(anthropic.BadRequestError) as orphan:
                await claude.messages.create(
                    model="policy",
                    max_tokens=8,
                    messages=[
                        {
                            "role": "user",
                            "content": [{"type": "tool_result", "tool_use_id": "t", "content": "3"}],
                        }
                    ],
                )
            async with aiohttp.ClientSession() as http:
                r = await http.post(
                    f"{url}/v1/messages", json={"model": "tiny"}, headers={"Authorization": "Bearer no"}
                )
                unauthorized = r.status, await r.json()
            after = await claude.messages.create(
                model="policy",
                max_tokens=256,
                messages=[{"role": "user", "content": "1 + 2?"}],
                tools=ANTHROPIC_TOOLS,
            )
            chat_answer = await openai_tool_loop(oai, "1 + 2?")  # chat completions parse the same way
            await oai.close()
            await claude.close()
            return (
                responses_answer,
                anthropic_answer,
                chat_answer,
                web_search.value,
                orphan.value,
                unauthorized,
                after,
            )

    responses_answer, anthropic_answer, chat_answer, web_search, orphan, unauthorized, after = asyncio.run(
        main()
    )
    assert responses_answer == anthropic_answer == chat_answer == "3"
    prompts = [tiny_tokenizer.decode(ids) for ids, _ in engine.calls]
    assert len(prompts) == 7 and all("<tool_response>\n3\n</tool_response>" in prompts[i] for i in (1, 3, 6))
    assert web_search.status_code == 400 and web_search.body["param"] == "tools"
    assert orphan.status_code == 400 and orphan.body["error"]["type"] == "invalid_request_error"
    assert unauthorized[0] == 401 and unauthorized[1]["type"] == "error"
    assert after.stop_reason == "tool_use" and after.content[0].input == {"a": 1, "b": 2}
