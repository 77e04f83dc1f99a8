"""Tool-call formats: parsing calls, reporting every malformed call, and rendering results."""

import asyncio
import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent_r1.tools import (
    FORMATS,
    ParsedResponse,
    ToolCall,
    ToolCallFormat,
    ToolResult,
    ToolSet,
    get_format,
    register_format,
    tool,
)

HERMES_HINT = 'Write each call as <tool_call>{"name": "<tool name>", "arguments": {<arguments>}}</tool_call>.'
REACT_HINT = 'Write each call as two lines: "Action: <tool name>" then "Action Input: {<JSON arguments>}".'
LLAMA_HINT = (
    'Write a call as {"name": "<tool name>", "parameters": {<arguments>}}; separate several calls with ";".'
)

hermes = get_format("hermes")
react = get_format("react")
llama = get_format("llama3_json")


# -------------------------------------------------------------------------------------- registry


def test_registry():
    assert {"hermes", "react", "llama3_json"} <= set(FORMATS)
    assert isinstance(get_format("hermes"), ToolCallFormat)
    with pytest.raises(
        ValueError, match="unknown tool-call format 'qwen'; available formats: .*hermes.*react"
    ):
        get_format("qwen")
    with pytest.raises(ValueError, match="'hermes' is already registered by HermesFormat"):

        @register_format
        class Other(ToolCallFormat):
            name = "hermes"

            def parse(self, text):
                return ParsedResponse(text)

            def observation_messages(self, results, errors):
                return []

    with pytest.raises(TypeError, match="needs a class attribute `name`"):
        register_format(type("Nameless", (), {}))


# ---------------------------------------------------------------------------------------- hermes


def test_hermes_parses_several_calls_with_whitespace_and_content():
    text = (
        "Let me look both up.\n<tool_call>\n"
        '{"name": "search", "arguments": {"query": "Paris"}}\n'
        "</tool_call>\n<tool_call>"
        '  {"name":"add","arguments":{"a":1,"b":[2,3]}}  '
        "</tool_call>\nDone."
    )
    parsed = hermes.parse(text)
    assert parsed == ParsedResponse(
        content="Let me look both up.\n\n\nDone.",  # the text outside the markup, exactly
        calls=(
            ToolCall("search", {"query": "Paris"}, "call_0"),
            ToolCall("add", {"a": 1, "b": [2, 3]}, "call_1"),
        ),
        errors=(),
    )
    assert not parsed.is_final


def test_hermes_plain_answer_is_final():
    parsed = hermes.parse("  The answer is 42.\n")
    assert parsed == ParsedResponse("The answer is 42.", (), ())
    assert parsed.is_final


def test_hermes_accepts_arguments_as_a_json_string_and_missing_arguments():
    parsed = hermes.parse(
        '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>'
        '<tool_call>{"name": "now"}</tool_call>'
        '<tool_call>{"name": "f", "parameters": {"x": 1}}</tool_call>'
    )
    assert parsed.calls == (
        ToolCall("add", {"a": 1}, "call_0"),
        ToolCall("now", {}, "call_1"),
        ToolCall("f", {"x": 1}, "call_2"),
    )
    assert parsed.errors == ()


@pytest.mark.parametrize(
    ("text", "error"),
    [
        (
            '<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>',
            "<tool_call> #1: invalid JSON: Expecting property name enclosed in double quotes "
            """(line 1 column 38, near 'arguments": {"a": 1,}}'). """ + HERMES_HINT,
        ),
        (
            "<tool_call>\n{'name': 'add'}\n</tool_call>",
            "<tool_call> #1: invalid JSON: Expecting property name enclosed in double quotes "
            """(line 2 column 2, near "\\n{'name': 'add'}\\n"). """ + HERMES_HINT,
        ),
        (
            '<tool_call>{"arguments": {"a": 1}}</tool_call>',
            '<tool_call> #1: missing "name" (the object has keys: "arguments"). ' + HERMES_HINT,
        ),
        (
            '<tool_call>{"name": "", "arguments": {}}</tool_call>',
            '<tool_call> #1: "name" must be a non-empty string, got "". ' + HERMES_HINT,
        ),
        (
            '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>',
            '<tool_call> #1: "arguments" must be a JSON object, got array [1, 2]. ' + HERMES_HINT,
        ),
        (
            '<tool_call>{"name": "add", "arguments": null}</tool_call>',
            '<tool_call> #1: "arguments" must be a JSON object, got null null. ' + HERMES_HINT,
        ),
        (
            '<tool_call>{"name": "add", "arguments": "a=1"}</tool_call>',
            '<tool_call> #1: "arguments" is a string that is not valid JSON: Expecting value '
            """(line 1 column 1, near 'a=1'). """ + HERMES_HINT,
        ),
        (
            '<tool_call>{"name": "add", "arguments": "[1]"}</tool_call>',
            '<tool_call> #1: "arguments" must be a JSON object, got a string holding array [1]. '
            + HERMES_HINT,
        ),
        (
            '<tool_call>["add", {"a": 1}]</tool_call>',
            '<tool_call> #1: expected a JSON object {"name": ..., "arguments": {...}}, got array ["add", {"a": 1}]. '
            + HERMES_HINT,
        ),
        ("<tool_call> \n </tool_call>", "<tool_call> #1 is empty. " + HERMES_HINT),
        (
            '<tool_call>{"name": "add", "arguments": {"a": 1}}',
            "<tool_call> #1 is not closed: the response ends before </tool_call>. " + HERMES_HINT,
        ),
        (
            '{"name": "add", "arguments": {"a": 1}}</tool_call>',
            "stray </tool_call> at character 38 without an opening <tool_call>. " + HERMES_HINT,
        ),
    ],
)
def test_hermes_malformed_calls_are_errors_never_a_final_answer(text, error):
    parsed = hermes.parse(text)
    assert parsed.calls == ()
    assert parsed.errors == (error,)
    assert not parsed.is_final


def test_hermes_unclosed_call_followed_by_a_good_one():
    parsed = hermes.parse('<tool_call>{"name": "a"}\n<tool_call>{"name": "b"}</tool_call> ok')
    assert parsed.calls == (ToolCall("b", {}, "call_0"),)
    assert parsed.errors == (
        "<tool_call> #1 is not closed: another <tool_call> starts before its </tool_call>. " + HERMES_HINT,
    )
    assert parsed.content == "ok"


def test_hermes_good_and_bad_calls_together_number_calls_and_blocks():
    parsed = hermes.parse(
        '<tool_call>{"name": "a"}</tool_call><tool_call>{"name": 1}</tool_call><tool_call>{"name": "c"}</tool_call>'
    )
    assert [c.id for c in parsed.calls] == ["call_0", "call_1"]
    assert [c.name for c in parsed.calls] == ["a", "c"]
    assert parsed.errors == ('<tool_call> #2: "name" must be a non-empty string, got 1. ' + HERMES_HINT,)


def test_hermes_observation_messages():
    call = ToolCall("add", {"a": 1}, "call_0")
    messages = hermes.observation_messages(
        [ToolResult(call, "2"), ToolResult(call, "Error: tool 'add' raised ValueError", True)], ["bad JSON"]
    )
    assert messages == [
        {"role": "tool", "name": "add", "tool_call_id": "call_0", "content": "2"},
        {
            "role": "tool",
            "name": "add",
            "tool_call_id": "call_0",
            "content": "Error: tool 'add' raised ValueError",
        },
        {"role": "tool", "content": "Error: bad JSON"},
    ]
    assert hermes.system_prompt([]) is None


def test_hermes_observations_render_as_tool_responses_in_the_qwen_template(tiny_tokenizer):
    response = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    parsed = hermes.parse(response)
    observations = hermes.observation_messages(
        [ToolResult(parsed.calls[0], "2")], ["<tool_call> #2 is empty."]
    )
    messages = [
        {"role": "user", "content": "1+1?"},
        {"role": "assistant", "content": response},
        *observations,
    ]
    rendered = tiny_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith(
        "<|im_start|>assistant\n" + response + "<|im_end|>\n"
        "<|im_start|>user\n"
        "<tool_response>\n2\n</tool_response>\n"
        "<tool_response>\nError: <tool_call> #2 is empty.\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


# ------------------------------------------------------------- errors detected by the tools


@tool
def add(a: int, b: int = 0) -> int:
    """Add two integers."""
    return a + b


@pytest.mark.parametrize("name", ["hermes", "react", "llama3_json"])
def test_unknown_tools_and_bad_argument_types_come_back_readable(name):
    fmt = get_format(name)
    rendered = {
        "hermes": '<tool_call>{"name": "sub", "arguments": {"a": 1}}</tool_call>'
        '<tool_call>{"name": "add", "arguments": {"a": "one"}}</tool_call>'
        '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>',
        "react": 'Action: sub\nAction Input: {"a": 1}\nAction: add\nAction Input: {"a": "one"}\n'
        'Action: add\nAction Input: {"a": 1, "b": 2}',
        "llama3_json": '{"name": "sub", "parameters": {"a": 1}}; {"name": "add", "parameters": {"a": "one"}}; '
        '{"name": "add", "parameters": {"a": 1, "b": 2}}',
    }[name]
    parsed = fmt.parse(rendered)
    assert parsed.errors == ()
    results = asyncio.run(ToolSet([add]).execute(parsed.calls))
    assert [(r.content, r.is_error) for r in results] == [
        ("Error: unknown tool 'sub'; available tools: add", True),
        ("""Error: tool 'add' argument 'a': expected integer, got "one\"""", True),
        ("3", False),
    ]
    text = json.dumps(fmt.observation_messages(results, parsed.errors))
    assert "unknown tool 'sub'" in text and "expected integer" in text


# ----------------------------------------------------------------------------------------- react


def test_react_parses_actions_with_multiline_json_and_keeps_the_thought():
    text = (
        "Thought: I need two things.\n"
        "Action: search\n"
        'Action Input: {"query": "Paris",\n  "k": 2}\n'
        "Action:  add \n"
        'Action Input: {"a": 1}\n'
    )
    assert react.parse(text) == ParsedResponse(
        "Thought: I need two things.",
        (ToolCall("search", {"query": "Paris", "k": 2}, "call_0"), ToolCall("add", {"a": 1}, "call_1")),
        (),
    )


def test_react_ignores_an_imagined_observation_and_what_follows():
    text = 'Action: add\nAction Input: {"a": 1}\nObservation: 1\nAction: add\nAction Input: {"a": 5}'
    assert react.parse(text) == ParsedResponse("", (ToolCall("add", {"a": 1}, "call_0"),), ())


def test_react_final_answer_is_final():
    text = "Observation: (quoting the task)\nThought: I know it.\nFinal Answer: 42"
    parsed = react.parse(text)
    assert parsed == ParsedResponse(text, (), ())
    assert parsed.is_final


@pytest.mark.parametrize(
    ("text", "errors"),
    [
        (
            "Action: add\nThought: hmm",
            ["Action #1 ('add') has no \"Action Input:\" line after it. " + REACT_HINT],
        ),
        (
            "Action:\nAction Input: {}",
            [
                "Action #1 names no tool. " + REACT_HINT,
                '"Action Input:" at character 8 follows no "Action:" line. ' + REACT_HINT,
            ],
        ),
        (
            'Action Input: {"a": 1}',
            ['"Action Input:" at character 0 follows no "Action:" line. ' + REACT_HINT],
        ),
        (
            "Action: add\nAction Input:",
            ["Action #1 ('add'): Action Input is empty; give the arguments as a JSON object. " + REACT_HINT],
        ),
        (
            "Action: add\nAction Input: {a: 1}",
            [
                "Action #1 ('add'): Action Input is not valid JSON: Expecting property name enclosed in double "
                """quotes (line 2 column 16, near ' add\\nAction Input: {a: 1}'). """ + REACT_HINT
            ],
        ),
        (
            "Action: add\nAction Input: 5",
            ["Action #1 ('add'): Action Input must be a JSON object, got number 5. " + REACT_HINT],
        ),
        (
            "Action: add\nAction: sub\nAction Input: {}",
            ["Action #1 ('add') has no \"Action Input:\" line after it. " + REACT_HINT],
        ),
    ],
)
def test_react_malformed_actions(text, errors):
    parsed = react.parse(text)
    assert list(parsed.errors) == errors
    assert not parsed.is_final


def test_react_accepts_action_input_as_a_json_string():
    parsed = react.parse('Action: add\nAction Input: "{\\"a\\": 2}"')
    assert parsed.calls == (ToolCall("add", {"a": 2}, "call_0"),)


def test_react_observations_and_system_prompt():
    call = ToolCall("add", {"a": 1}, "call_0")
    messages = react.observation_messages(
        [ToolResult(call, "1"), ToolResult(call, "Error: x", True)], ["no input"]
    )
    assert messages == [
        {"role": "user", "content": "Observation: 1\n\nObservation: Error: x\n\nObservation: Error: no input"}
    ]
    assert react.observation_messages([], []) == []
    prompt = react.system_prompt(ToolSet([add]).schemas())
    assert "- add: Add two integers." in prompt
    assert '"required": ["a"]' in prompt
    assert "Action: the tool to use, one of [add]" in prompt
    assert "Final Answer:" in prompt


# ----------------------------------------------------------------------------------- llama3_json


def test_llama3_json_calls():
    assert llama.parse('{"name": "add", "parameters": {"a": 1}}') == ParsedResponse(
        "", (ToolCall("add", {"a": 1}, "call_0"),), ()
    )
    parsed = llama.parse(
        '<|python_tag|>{"name": "add", "parameters": {"a": 1}}; {"name": "now", "arguments": {}}'
    )
    assert parsed.calls == (ToolCall("add", {"a": 1}, "call_0"), ToolCall("now", {}, "call_1"))
    assert parsed.errors == ()
    assert llama.parse("It is 3.").is_final
    assert llama.parse("It is 3.").content == "It is 3."


@pytest.mark.parametrize(
    ("text", "error"),
    [
        (
            '{"name": "add", "parameters": {"a": 1}',
            """tool call #1: invalid JSON: Expecting ',' delimiter (line 1 column 39, near 'arameters": {"a": 1}'). """
            + LLAMA_HINT,
        ),
        (
            '{"parameters": {}}',
            'tool call #1: missing "name" (the object has keys: "parameters"). ' + LLAMA_HINT,
        ),
        (
            '{"name": "add", "parameters": {}} then I add',
            "tool call #1: unexpected text after the JSON object: 'then I add'. " + LLAMA_HINT,
        ),
        ("<|python_tag|>add(1, 2)", "<|python_tag|> is not followed by a JSON object. " + LLAMA_HINT),
    ],
)
def test_llama3_json_malformed_calls(text, error):
    parsed = llama.parse(text)
    assert parsed.errors == (error,)
    assert not parsed.is_final


def test_llama3_json_observation_messages():
    call = ToolCall("add", {"a": 1}, "call_0")
    assert llama.observation_messages([ToolResult(call, "1")], ["oops"]) == [
        {"role": "tool", "name": "add", "tool_call_id": "call_0", "content": "1"},
        {"role": "tool", "content": "Error: oops"},
    ]
    assert llama.system_prompt([]) is None


# ------------------------------------------------------------------------ properties (hypothesis)

PIECES = [
    "<tool_call>",
    "</tool_call>",
    "<|python_tag|>",
    "Action:",
    "Action Input:",
    "Observation:",
    "\n",
    "{",
    "}",
    "[",
    "]",
    '"name"',
    '"arguments"',
    '"parameters"',
    ":",
    ",",
    ";",
    '"',
    "\\",
    " ",
    "null",
    "1e999",
    '"\\ud800"',
]
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=12,
)
texts = st.one_of(
    st.text(),
    st.lists(st.one_of(st.text(max_size=6), st.sampled_from(PIECES)), max_size=40).map("".join),
    st.builds(
        lambda obj, before, after: before + json.dumps(obj) + after,
        json_values,
        st.sampled_from(["", "<tool_call>", "<|python_tag|>", "Action: t\nAction Input: "]),
        st.sampled_from(["", "</tool_call>", ";", "\nObservation: x"]),
    ),
    st.builds(lambda n: "[" * n, st.integers(1, 50_000)),  # deeper than the JSON decoder's recursion limit
)


def _assert_well_formed(parsed: ParsedResponse) -> None:
    assert isinstance(parsed.content, str)
    assert [c.id for c in parsed.calls] == [f"call_{i}" for i in range(len(parsed.calls))]
    for call in parsed.calls:
        assert isinstance(call.name, str) and call.name
        assert isinstance(call.arguments, dict)
    assert all(isinstance(e, str) and e for e in parsed.errors)


@settings(max_examples=300)
@given(texts)
def test_parse_never_raises_and_markup_is_never_a_final_answer(text):
    for fmt in (hermes, react, llama):
        _assert_well_formed(fmt.parse(text))
    if "<tool_call>" in text or "</tool_call>" in text:
        assert not hermes.parse(text).is_final
    if re.search(r"^[ \t]*Action( Input)?[ \t]*:", text, re.MULTILINE):
        assert not react.parse(text).is_final
    if text.strip().startswith(("{", "<|python_tag|>")):
        assert not llama.parse(text).is_final


names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_-]{0,15}", fullmatch=True)
arguments = st.dictionaries(st.text(max_size=6), json_values, max_size=4)
calls_strategy = st.lists(st.tuples(names, arguments), min_size=1, max_size=4)
plain = st.text(alphabet=st.characters(blacklist_characters="<>:{}"), max_size=20)


ROUND_TRIP = settings(max_examples=30)  # generation dominates; the parse-never-raises test runs more


@ROUND_TRIP
@given(calls_strategy, plain, plain)
def test_hermes_round_trip(calls, before, after):
    text = (
        before
        + "".join(f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>" for n, a in calls)
        + after
    )
    parsed = hermes.parse(text)
    assert parsed.errors == ()
    assert [(c.name, c.arguments) for c in parsed.calls] == calls
    assert parsed.content == (before + after).strip()


@ROUND_TRIP
@given(calls_strategy, plain)
def test_react_round_trip(calls, thought):
    text = f"Thought: {thought}\n" + "".join(
        f"Action: {n}\nAction Input: {json.dumps(a)}\n" for n, a in calls
    )
    parsed = react.parse(text)
    assert parsed.errors == ()
    assert [(c.name, c.arguments) for c in parsed.calls] == calls


@ROUND_TRIP
@given(calls_strategy, st.booleans())
def test_llama3_json_round_trip(calls, tagged):
    text = ("<|python_tag|>" if tagged else "") + "; ".join(
        json.dumps({"name": n, "parameters": a}) for n, a in calls
    )
    parsed = llama.parse(text)
    assert parsed.errors == ()
    assert [(c.name, c.arguments) for c in parsed.calls] == calls


@pytest.mark.parametrize(
    ("fmt", "text", "error"),
    [
        (
            hermes,
            "<tool_call>" + "[" * 100_000 + "</tool_call>",
            "<tool_call> #1: invalid JSON: nested too deeply. ",
        ),
        (
            react,
            "Action: a\nAction Input: " + "[" * 100_000,
            "Action #1 ('a'): Action Input is not valid JSON: nested too deeply. ",
        ),
        (
            llama,
            '{"name": "a", "parameters": ' + "[" * 100_000,
            "tool call #1: invalid JSON: nested too deeply. ",
        ),
    ],
)
def test_json_nested_past_the_recursion_limit_is_an_error(fmt, text, error):
    (message,) = fmt.parse(text).errors
    assert message.startswith(error)
