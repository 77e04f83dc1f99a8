"""Tool-call near misses (issue 18): a call in a spelling the format does not accept is recognised per
format and, in ToolEnv's default "hint" mode, answered with an error that shows the correct form; per
step counts of calls, parse errors, tool errors and near misses reach the step info, the trainer's
metrics and the report. Negatives are tested as carefully as positives."""

from __future__ import annotations

import asyncio
import json

import pytest
from doubles import ScriptedEngine
from hypothesis import example, given, settings
from hypothesis import strategies as st

from agent_r1.envs import ToolEnv
from agent_r1.flows.base import rollout_groups
from agent_r1.models.tokens import encode_text
from agent_r1.report import load_run, render_html
from agent_r1.report.html import chart_groups
from agent_r1.tasks.arithmetic import make_dataset
from agent_r1.tools import get_format, tool
from agent_r1.train.config import config_from_dict
from agent_r1.train.summary import env_metrics, summarize_rollout
from agent_r1.train.trainer import Trainer
from agent_r1.types import Action, Step, StopReason, Trajectory, write_jsonl

hermes = get_format("hermes")
react = get_format("react")
llama = get_format("llama3_json")
FORMATS = (hermes, react, llama)

HERMES_HINT = hermes.HINT
REACT_HINT = react.HINT
LLAMA_HINT = llama.HINT
ADD = '{"name": "add", "arguments": {"a": 1}}'


def near_miss(fmt, text):
    """What ToolEnv sees: near_miss is consulted only for a response that parses as final."""
    assert fmt.parse(text).is_final, text
    return fmt.near_miss(text)


# -------------------------------------------------------------------------- positives, exact messages


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            f"<TOOL_CALL>{ADD}</TOOL_CALL>",
            "<TOOL_CALL> at character 0 is not a tool-call tag: the tags are exactly <tool_call> and "
            f"</tool_call>. Correctly written: <tool_call>{ADD}</tool_call> {HERMES_HINT}",
        ),
        (
            f"Adding.\n<tool-call>\n{ADD}\n</tool-call>",
            "<tool-call> at character 8 is not a tool-call tag: the tags are exactly <tool_call> and "
            f"</tool_call>. Correctly written: <tool_call>{ADD}</tool_call> {HERMES_HINT}",
        ),
        (
            f"<tool_call >{ADD}</tool_call >",
            "<tool_call > at character 0 is not a tool-call tag: the tags are exactly <tool_call> and "
            f"</tool_call>. Correctly written: <tool_call>{ADD}</tool_call> {HERMES_HINT}",
        ),
        (
            # A variant tag around something that is not call JSON is still a near miss, shown as such.
            "<ToolCall>add(1, 2)</ToolCall>",
            "<ToolCall> at character 0 is not a tool-call tag: the tags are exactly <tool_call> and "
            f"</tool_call>. {HERMES_HINT}",
        ),
        (
            f"I will add.\n```json\n{ADD}\n```",
            "a tool call written as JSON in a ``` code fence without <tool_call> tags is not a call. "
            f"Correctly written: <tool_call>{ADD}</tool_call> {HERMES_HINT}",
        ),
        (
            '{"name": "add", "arguments": "{\\"a\\": 1}"}',  # arguments as a JSON string, decoded
            "a tool call written as JSON without <tool_call> tags is not a call. "
            f"Correctly written: <tool_call>{ADD}</tool_call> {HERMES_HINT}",
        ),
        (
            '{"type": "function", "function": {"name": "add", "arguments": {"a": 1}}, "id": "c1"}',
            "a tool call written as JSON without <tool_call> tags is not a call. "
            f"Correctly written: <tool_call>{ADD}</tool_call> {HERMES_HINT}",
        ),
    ],
)
def test_hermes_near_misses(text, message):
    assert near_miss(hermes, text) == message


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            'Thought: add them\naction: add\naction input: {"a": 1}',
            "'action: add' and 'action input: {\"a\": 1}' (line 2) are not an action: the keywords are "
            'exactly "Action:" and "Action Input:", capitalised so, at the start of a line. Correctly '
            f'written:\nAction: add\nAction Input: {{"a": 1}}\n{REACT_HINT}',
        ),
        (
            '**Action:** add\n\n**Action_Input:** {"a": 1,\n  "b": 2}',  # JSON over lines, decoded whole
            "'**Action:** add' and '**Action_Input:** {\"a\": 1,' (line 1) are not an action: the keywords "
            'are exactly "Action:" and "Action Input:", capitalised so, at the start of a line. Correctly '
            f'written:\nAction: add\nAction Input: {{"a": 1, "b": 2}}\n{REACT_HINT}',
        ),
        (
            "- ACTION: search\n- ACTION-INPUT: paris",  # not JSON: shown as written
            "'- ACTION: search' and '- ACTION-INPUT: paris' (line 1) are not an action: the keywords are "
            'exactly "Action:" and "Action Input:", capitalised so, at the start of a line. Correctly '
            f"written:\nAction: search\nAction Input: paris\n{REACT_HINT}",
        ),
        (
            # LangChain's JSON agent blob.
            '```json\n{"action": "add", "action_input": {"a": 1}}\n```',
            "a tool call written as JSON in a ``` code fence is not an action. Correctly written:\n"
            f'Action: add\nAction Input: {{"a": 1}}\n{REACT_HINT}',
        ),
    ],
)
def test_react_near_misses(text, message):
    assert near_miss(react, text) == message


LLAMA_RULE = 'the response must be the call alone (several separated by ";", without brackets).'


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            '[{"name": "add", "parameters": {"a": 1}}, {"name": "mul", "parameters": {"b": 2}}]',
            f"tool-call JSON written as a JSON list is not a call: {LLAMA_RULE} Correctly written: "
            f'{{"name": "add", "parameters": {{"a": 1}}}}; {{"name": "mul", "parameters": {{"b": 2}}}} {LLAMA_HINT}',
        ),
        (
            '```json\n{"name": "add", "parameters": {"a": 1}}\n```',
            f"tool-call JSON written in a ``` code fence is not a call: {LLAMA_RULE} Correctly written: "
            f'{{"name": "add", "parameters": {{"a": 1}}}} {LLAMA_HINT}',
        ),
        (
            f"Let me add them: {ADD}",
            f"tool-call JSON written after other text is not a call: {LLAMA_RULE} Correctly written: "
            f'{{"name": "add", "parameters": {{"a": 1}}}} {LLAMA_HINT}',
        ),
    ],
)
def test_llama3_json_near_misses(text, message):
    assert near_miss(llama, text) == message


def test_a_long_call_is_shown_shortened():
    text = json.dumps({"name": "write", "arguments": {"text": "x" * 1000}})
    message = near_miss(hermes, f"```\n{text}\n```")
    shown = message.split("Correctly written: ")[1].removesuffix(f" {HERMES_HINT}")
    assert len(shown) == 300 and shown.endswith("...") and shown.startswith('<tool_call>{"name": "write"')


# --------------------------------------------------------------------------------------- negatives


@pytest.mark.parametrize(
    "text",
    [
        "The answer is 42.",
        "The next action: wait for the bus. Action items are listed below.",
        "action: none needed\nresult: 4",  # an "action:" line without an "Action Input:" line after it
        "Action items:\n- buy milk\nTransaction: 5",
        "Reaction: surprise\nFraction input: 1/2",
        "I would use the tool_call syntax, but the answer is 7.",
        "The <tool> and <call> elements, and `tool_call`, are documented; see <toolbar>.",
        "```python\ndef f(name, arguments):\n    return {'name': name}\nprint(f('a', {}))\n```",
        '```json\n{"name": "Alice", "age": 3}\n```',
        '```json\n{"name": "get_weather", "description": "Weather.", "parameters": {"type": "object"}}\n```',
        '[{"name": "add", "arguments": {}}, 3]',  # a list that is not all calls is data
        '{"name": "add", "arguments": 5}',  # arguments neither an object nor a string
        '{"action": "Final Answer", "action_input": "42"}',  # LangChain's final answer, not a call
        '{"records": [{"name": "add", "arguments": {}}]}',  # a call-shaped object inside other data
        '{"name": "", "arguments": {}}',
        "```\n```\n{not json",
        "",
    ],
)
def test_ordinary_final_answers_are_not_near_misses(text):
    for fmt in FORMATS:
        if fmt.parse(text).is_final:
            assert fmt.near_miss(text) is None, (fmt.name, text)


WORDS = [
    "action",
    "Action",
    "action:",
    "ACTION:",
    "the",
    "answer",
    "is",
    "tool_call",
    "tool-call",
    "<tool>",
    "call",
    "name",
    '"name":',
    "arguments",
    "Final",
    "Answer:",
    "42",
    "**",
    "-",
    "#",
]
CALL_KEY_SETS = [
    {"name", "arguments"},
    {"name", "parameters"},
    {"type", "function"},
    {"action", "action_input"},
]
leaf = st.none() | st.booleans() | st.integers() | st.text(max_size=8)
records = st.dictionaries(
    st.sampled_from(["name", "arguments", "parameters", "type", "function", "action", "action_input", "id"])
    | st.text(max_size=6),
    st.recursive(
        leaf, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3)
    ),
    max_size=5,
).filter(lambda d: (set(d) - {"id"}) not in CALL_KEY_SETS)
prose_lines = st.lists(st.lists(st.sampled_from(WORDS), max_size=8).map(" ".join), max_size=6).map("\n".join)
code = st.sampled_from(["print(1)", "x = {'name': 1}", "SELECT name FROM tools", "<div>call</div>"])
final_answers = st.builds(
    lambda prose, fence, body, record, tail: (
        f"{prose}\n```{fence}\n{body if fence != 'json' else json.dumps(record)}\n```\n{tail}"
    ),
    prose_lines,
    st.sampled_from(["", "python", "json", "sql"]),
    code,
    records,
    prose_lines,
)


@settings(max_examples=200)
@given(final_answers)
def test_prose_and_unrelated_code_fences_are_never_near_misses(text):
    for fmt in FORMATS:
        if fmt.parse(text).is_final:
            assert fmt.near_miss(text) is None, (fmt.name, text)


# -------------------------------------------------------------- positives, as properties (hypothesis)

names = st.from_regex(r"[a-z][a-z0-9_]{0,9}", fullmatch=True)
arguments = st.dictionaries(
    st.from_regex(r"[a-z]{1,6}", fullmatch=True), st.integers() | st.text("abc xyz", max_size=6), max_size=3
)
calls = st.lists(st.tuples(names, arguments), min_size=1, max_size=3)


def hermes_form(calls):
    return "".join(f"<tool_call>{json.dumps({'name': n, 'arguments': a})}</tool_call>" for n, a in calls)


def react_form(calls):
    return "\n".join(f"Action: {n}\nAction Input: {json.dumps(a)}" for n, a in calls)


def llama_form(calls):
    return "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)


def json_spellings(calls):
    """The calls written as JSON in the ways models get wrong, for every format."""
    objects = [json.dumps({"name": n, "arguments": a}) for n, a in calls]
    listed = json.dumps([{"name": n, "parameters": a} for n, a in calls])
    return [f"```json\n{listed}\n```", f"Calling now.\n```\n{objects[0]}\n```" if len(calls) == 1 else listed]


@settings(max_examples=60)
@given(calls, st.sampled_from(["<TOOL_CALL>", "<tool-call>", "<tool_call >", "<Tool_Call>", "< toolcall>"]))
@example([("a_", {})], "<TOOL_CALL>")  # found by hypothesis: ReAct's hint stripped a name's "_" as markdown
def test_every_near_miss_shows_the_correct_form_which_parses_to_the_meant_calls(calls, tag):
    closing = tag.replace("<", "</", 1)
    spellings = {
        hermes: [
            "".join(f"{tag}{json.dumps({'name': n, 'arguments': a})}{closing}" for n, a in calls),
            *json_spellings(calls),
        ],
        react: json_spellings(calls),
        llama: json_spellings(calls),
    }
    if len(calls) == 1:
        (n, a), lower = calls[0], "action: {}\naction input: {}"
        spellings[react].append("Thought: go\n" + lower.format(n, json.dumps(a)))
    for fmt, form in ((hermes, hermes_form), (react, react_form), (llama, llama_form)):
        correct = form(calls)
        assert [(c.name, c.arguments) for c in fmt.parse(correct).calls] == calls
        if len(correct) > 300:  # the message shows a long correct form cut to 300 characters
            correct = correct[:297] + "..."
        for text in spellings[fmt]:
            message = near_miss(fmt, text)
            assert message is not None and correct in message and message.endswith(fmt.HINT), (fmt.name, text)


pieces = st.sampled_from(
    ["<TOOL_CALL>", "<tool-call>", "</tool call>", "action:", "Action_Input:", "**", "```", "```json", "\n"]
    + ["{", "}", "[", "]", '"name":', '"arguments":', '"parameters":', '"action":', '"action_input":', '"x"']
    + [":", ",", "1e999", '"\\ud800"', "null", ";", " "]
)
near_miss_texts = st.one_of(
    st.text(),
    st.lists(pieces | st.text(max_size=4), max_size=40).map("".join),
    st.builds(lambda n: '{"name": "a", "arguments": ' + "[" * n, st.integers(1, 50_000)),
    st.builds(lambda n: '{"name": ' * n, st.integers(1, 5_000)),  # many candidates, none closed
)


@settings(max_examples=300)
@given(near_miss_texts)
def test_near_miss_never_raises(text):
    for fmt in FORMATS:
        message = fmt.near_miss(text)
        assert message is None or (isinstance(message, str) and message.endswith(fmt.HINT))


# ------------------------------------------------------------------------------------------ ToolEnv


@tool
def lookup(word: str) -> str:
    """Look a word up.

    Args:
        word: the word.
    """
    return {"dog": "a loyal canine"}.get(word, "unknown")


@tool
def explode() -> str:
    """Always fails."""
    raise RuntimeError("boom")


TASK = {"id": "t1", "prompt": "Which animal is loyal?", "answer": "dog"}
MISS = '<tool-call>{"name": "lookup", "arguments": {"word": "dog"}}</tool-call>'
CALL = '<tool_call>{"name": "lookup", "arguments": {"word": "dog"}}</tool_call>'


def act(tokenizer, text):
    ids = encode_text(tokenizer, text) + [tokenizer.eos_token_id]
    return Action(tokenizer.decode(ids, skip_special_tokens=False), ids, StopReason.STOP)


def episode(tokenizer, responses, **kwargs):
    env = ToolEnv(tokenizer, [lookup, explode], **kwargs)

    async def run():
        await env.reset(TASK)
        return [await env.step(act(tokenizer, text)) for text in responses]

    return asyncio.run(run())


def counts(calls=0, parse_errors=0, tool_errors=0, near_misses=0):
    return {
        "calls": calls,
        "parse_errors": parse_errors,
        "tool_errors": tool_errors,
        "near_misses": near_misses,
    }


def test_tool_env_answers_a_near_miss_with_the_correct_form_by_default(tiny_tokenizer):
    miss, fixed, answer = episode(tiny_tokenizer, [MISS, CALL, "dog"])
    expected = hermes.near_miss(MISS)
    assert not (miss.terminated or miss.truncated) and miss.outcome_reward is None  # not the final answer
    assert miss.info["near_miss"] == expected and miss.info["tool_errors"] == [expected]
    assert miss.info["tool_counts"] == counts(near_misses=1)
    prompt = tiny_tokenizer.decode(list(miss.observation.token_ids))
    assert f"<tool_response>\nError: {expected}\n</tool_response>" in prompt
    assert fixed.info["tool_counts"] == counts(calls=1) and fixed.info["tool_results"] == ["a loyal canine"]
    assert "near_miss" not in fixed.info
    assert answer.terminated and answer.outcome_reward == 1.0
    assert answer.info["tool_counts"] == counts() and "near_miss" not in answer.info


def test_tool_env_strict_takes_a_near_miss_as_the_final_answer_and_still_counts_it(tiny_tokenizer):
    (miss,) = episode(tiny_tokenizer, [MISS], near_miss="strict")
    assert miss.terminated and miss.outcome_reward == 0.0 and miss.info["answer"] == MISS
    assert miss.info["tool_counts"] == counts(near_misses=1)
    assert miss.info["near_miss"] == hermes.near_miss(MISS)


def test_tool_env_counts_calls_parse_errors_and_tool_errors_per_step(tiny_tokenizer):
    text = CALL + '<tool_call>{"name": "explode"}</tool_call><tool_call>{"name": }</tool_call>'
    (step,) = episode(tiny_tokenizer, [text])
    assert step.info["tool_counts"] == counts(calls=2, parse_errors=1, tool_errors=1)
    assert len(step.info["tool_errors"]) == 2


def test_tool_env_near_miss_mode_is_checked(tiny_tokenizer):
    with pytest.raises(
        ValueError, match=r"ToolEnv: near_miss must be one of \('hint', 'strict'\), got 'loose'"
    ):
        ToolEnv(tiny_tokenizer, [lookup], near_miss="loose")


# -------------------------------------------------------------------------- trainer metrics and report


def test_tool_counts_are_step_metrics_averaged_over_the_steps_that_report_them(tiny_tokenizer):
    env = ToolEnv(tiny_tokenizer, [lookup])
    asyncio.run(env.reset({"prompt": "What is a dog?", "answer": "x"}))
    call = '<tool_call>{"name": "lookup", "arguments": {"word": "dog"}}</tool_call>'
    result = asyncio.run(env.step(Action(call + " <tool_call>{oops</tool_call>", ())))
    assert result.metrics == {
        "tools/calls_per_step": 1.0,
        "tools/parse_errors_per_step": 1.0,
        "tools/tool_errors_per_step": 0.0,
        "tools/near_misses_per_step": 0.0,
    }

    def step(metrics):
        return Step(prompt_ids=(1,), response_ids=(2,), logprobs=(0.0,), metrics=metrics)

    steps = [
        step({f"tools/{k}_per_step": v for k, v in counts(calls=2, tool_errors=1).items()}),
        step({f"tools/{k}_per_step": v for k, v in counts(near_misses=1).items()}),
    ]
    assert env_metrics([*steps, step({})]) == {
        "tools/calls_per_step": 1.0,
        "tools/near_misses_per_step": 0.5,
        "tools/parse_errors_per_step": 0.0,
        "tools/tool_errors_per_step": 0.5,
    }
    assert env_metrics([step({})]) == {}


@pytest.mark.parametrize("mode", ["hint", "strict"])
def test_trainer_takes_the_mode_from_env_kwargs_and_logs_the_counts(
    tiny_checkpoint, tiny_tokenizer, tmp_path, mode
):
    config = config_from_dict(
        {
            "model": {"path": str(tiny_checkpoint)},
            "env": {"name": "agent_r1.tasks.arithmetic:make_env", "kwargs": {"near_miss": mode}},
            "rollout": {"n": 2, "max_tokens": 96, "max_steps": 4},
            "trainer": {"steps": 1, "tasks_per_step": 1, "run_dir": str(tmp_path)},
            "logging": {"progress": False},
        }
    )
    tasks = make_dataset(1, seed=0)
    trainer = Trainer(config, train_tasks=tasks)
    miss = (
        "<TOOL_CALL>\n"
        + json.dumps({"name": "calculator", "arguments": {"expression": "x*y"}})
        + "\n</TOOL_CALL>"
    )
    # The scripted model answers once it has read the hint, and otherwise writes the near miss.
    engine = ScriptedEngine(
        tiny_tokenizer, lambda prompt: "<answer>0</answer>" if "not a tool-call tag" in prompt else miss
    )
    groups = asyncio.run(rollout_groups(trainer.rollouts.flow, engine, tasks, 2))
    metrics = summarize_rollout(groups, trainer.policy_version).metrics
    for trajectory in groups[0].trajectories:
        near_misses = [s.info["tool_counts"]["near_misses"] for s in trajectory.steps]
        # hint: the near miss is answered, then the model answers; strict: it was the final answer
        assert near_misses == ([1, 0] if mode == "hint" else [1])
    assert metrics["tools/near_misses_per_step"] == (0.5 if mode == "hint" else 1.0)
    assert metrics["tools/calls_per_step"] == 0.0


def test_report_shows_the_counts_per_step_and_charts_them(tmp_path):
    info = {"tool_counts": counts(near_misses=1), "near_miss": "<TOOL_CALL> at character 0 ..."}
    step = Step(prompt_ids=(1,), response_ids=(2,), logprobs=(-0.5,), response_text="<TOOL_CALL>", info=info)
    (tmp_path / "trajectories").mkdir()
    write_jsonl(tmp_path / "trajectories" / "step_000001.jsonl", [Trajectory("t", (step,))])
    rows = [{"step": 1, "reward/mean": 0.0, "tools/near_misses_per_step": 1.0, "tools/calls_per_step": 0.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = load_run(tmp_path)
    (view,) = run.trajectories[0]["steps"]
    assert view["tool_counts"] == info["tool_counts"] and view["near_miss"] == info["near_miss"]
    groups = chart_groups({"tools/calls_per_step": [(1, 0.0)], "steps_per_trajectory/mean": [(1, 1.0)]})
    assert [g["title"] for g in groups] == [
        "Steps per trajectory",
        "Tool calls, errors and near misses (per step)",
    ]
    page = render_html(run)
    assert "tools/near_misses_per_step" in page and '"near_misses":1' in page
