"""MCP tools against a real MCP server (the official SDK's, tests/mcp_example_server.py) over stdio."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent_r1.envs.tool_env import ToolEnv
from agent_r1.tools import ToolCall, ToolSet
from agent_r1.tools.mcp import MCPClient, MCPError, mcp_tools
from agent_r1.types import Action

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("mcp") is None,
    reason="the test server needs the `mcp` package (in the dev extra)",
)

SERVER = [sys.executable, str(Path(__file__).with_name("mcp_example_server.py"))]


@pytest.fixture(scope="module")
def client() -> Iterator[MCPClient]:
    with MCPClient(SERVER, request_timeout=30) as c:
        yield c


def test_tools_keep_their_mcp_names_descriptions_and_schemas(client: MCPClient) -> None:
    tools = ToolSet(mcp_tools(client))
    assert tools.names == ["add", "shout", "refuse", "crash"]
    add = tools["add"].schema()["function"]
    assert add["description"] == "Add two integers."
    assert add["parameters"]["required"] == ["a", "b"]
    assert add["parameters"]["properties"]["a"]["type"] == "integer"
    assert client.server_info["name"] == "agent-r1-test-server"


def test_calls_results_and_errors(client: MCPClient) -> None:
    tools = ToolSet(mcp_tools(client, include=["add", "shout", "refuse"], prefix="srv_"))
    calls = [
        ToolCall("srv_add", {"a": 2, "b": 3}, "call_0"),
        ToolCall("srv_shout", {"text": "hi", "times": 2}, "call_1"),
        ToolCall("srv_refuse", {"reason": "not today"}, "call_2"),
        ToolCall("srv_add", {"a": "two", "b": 3}, "call_3"),
    ]
    added, shouted, refused, bad = asyncio.run(tools.execute(calls))
    assert (added.content, added.is_error) == ("5", False)
    assert shouted.content == "HI HI"
    assert refused.is_error and "refused: not today" in refused.content
    assert bad.is_error and "argument 'a': expected integer" in bad.content  # checked before the server


def test_unknown_included_tool_names_the_servers_tools(client: MCPClient) -> None:
    with pytest.raises(ValueError, match="has no tool 'multiply'; its tools: add, shout, refuse, crash"):
        mcp_tools(client, include=["multiply"])


def test_calls_from_several_event_loops_share_one_server(client: MCPClient) -> None:
    add = mcp_tools(client, include=["add"])[0]

    async def many(offset: int) -> list[str]:
        calls = [add(ToolCall("add", {"a": offset, "b": i})) for i in range(5)]
        return [r.content for r in await asyncio.gather(*calls)]

    assert asyncio.run(many(0)) == ["0", "1", "2", "3", "4"]
    assert asyncio.run(many(10)) == ["10", "11", "12", "13", "14"]


def test_mcp_tools_in_a_tool_env(client: MCPClient, tiny_tokenizer) -> None:
    env = ToolEnv(tiny_tokenizer, mcp_tools(client, include=["add"]), max_turns=3)
    task = {"prompt": "What is 2 + 3? Use the add tool.", "answer": "5"}

    async def episode():
        first = await env.reset(task)
        call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
        step = await env.step(Action(call, tiny_tokenizer.encode(call, add_special_tokens=False)))
        final = await env.step(Action("5", tiny_tokenizer.encode("5", add_special_tokens=False)))
        return first, step, final

    first, step, final = asyncio.run(episode())
    prompt = tiny_tokenizer.decode(list(first.token_ids))
    assert '"name": "add"' in prompt and "Add two integers." in prompt  # the schema reached the template
    assert step.info["tool_results"] == ["5"]
    assert "<tool_response>\n5\n</tool_response>" in tiny_tokenizer.decode(list(step.observation.token_ids))
    assert final.terminated and final.outcome_reward == 1.0


def test_a_server_that_dies_becomes_an_error_result() -> None:
    with MCPClient(SERVER, request_timeout=30) as dying:
        tools = ToolSet(mcp_tools(dying))
        crashed, after = asyncio.run(tools.execute([ToolCall("crash", {}, "call_0")])) + asyncio.run(
            tools.execute([ToolCall("add", {"a": 1, "b": 1}, "call_1")])
        )
    assert crashed.is_error and "exit code 3" in crashed.content and "about to crash" in crashed.content
    assert after.is_error and "closed its output" in after.content


def test_a_server_that_cannot_start_is_a_clear_error() -> None:
    with pytest.raises(MCPError, match="cannot start MCP server /nonexistent/server"):
        MCPClient(["/nonexistent/server"])
    with pytest.raises(MCPError, match="closed its output"):
        MCPClient([sys.executable, "-c", "import sys; print('not an MCP server', file=sys.stderr)"])
