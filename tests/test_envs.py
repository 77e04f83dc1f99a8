"""Env registry, check_env and ToolEnv, driven by scripted actions on the real tiny tokenizer."""

import asyncio
import json
import math

import pytest
from doubles import ScriptedEngine

from agent_r1.envs import (
    AgentEnv,
    EnvCheckError,
    ToolEnv,
    available_envs,
    check_env,
    get_env_factory,
    make_env,
    register_env,
)
from agent_r1.envs.context import get_context_policy
from agent_r1.envs.tool_env import CUT_OFF_ERROR
from agent_r1.models.tokens import encode_text, render_messages
from agent_r1.tools import tool
from agent_r1.types import Action, Observation, StepResult, StopReason


class CountdownEnv(AgentEnv):
    """Says a number; the episode ends when the model answers "0"."""

    def __init__(self, start: int = 2) -> None:
        self.start = start

    async def reset(self, task):
        self.n = task.get("start", self.start)
        return Observation(text=f"count down from {self.n}:")

    async def step(self, action):
        done = action.text.strip() == "0"
        return StepResult(
            observation=None if done else Observation(messages=[{"role": "user", "content": "go on"}]),
            terminated=done,
            outcome_reward=1.0 if done else None,
            info={"said": action.text},
        )


# ----------------------------------------------------------------------------------------- registry


def test_make_env_by_name_by_lazy_registration_and_by_entry_point(tmp_path, monkeypatch):
    register_env("countdown-test", CountdownEnv)
    env = make_env("countdown-test", start=5)
    assert isinstance(env, CountdownEnv) and env.start == 5
    assert "countdown-test" in available_envs() and "tool" in available_envs()

    (tmp_path / "my_envs.py").write_text(
        "from agent_r1.envs import AgentEnv\n"
        "class Echo(AgentEnv):\n"
        "    def __init__(self, word='hi'): self.word = word\n"
        "    async def reset(self, task): ...\n"
        "    async def step(self, action): ...\n"
        "NOT_AN_ENV = dict\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    register_env("echo-lazy", "my_envs:Echo")  # not imported until made
    assert make_env("echo-lazy", word="yo").word == "yo"
    assert make_env("my_envs:Echo").word == "hi"
    with pytest.raises(TypeError, match="not an agent_r1 AgentEnv"):
        make_env("my_envs:NOT_AN_ENV")
    assert get_env_factory("echo-lazy").__name__ == "Echo"  # imported, e.g. to inspect its signature


def test_registry_errors_name_what_is_wrong():
    with pytest.raises(ValueError, match=r"unknown env 'nope'; available: \[.*'tool'"):
        make_env("nope")
    with pytest.raises(ValueError, match="cannot import module 'no_such_module_xyz'"):
        make_env("no_such_module_xyz:Env")
    with pytest.raises(ValueError, match="has no attribute 'Missing'"):
        make_env("agent_r1.envs:Missing")
    with pytest.raises(ValueError, match="package.module:Attribute"):
        register_env("bad", "no_colon_here")
    register_env("countdown-twice", CountdownEnv)
    register_env("countdown-twice", CountdownEnv)  # same factory: fine
    with pytest.raises(ValueError, match="already registered"):
        register_env("countdown-twice", ToolEnv)


# ---------------------------------------------------------------------------------------- check_env


def test_check_env_passes_a_correct_env(tiny_tokenizer):
    check_env(CountdownEnv, {"start": 1}, actions=["1", "0"], tokenizer=tiny_tokenizer)
    check_env(CountdownEnv(), {})  # default actions, no tokenizer


class BrokenEnv(AgentEnv):
    async def reset(self, task):
        return Observation(messages=[{"role": "user"}])

    async def step(self, action):
        return StepResult(
            observation=Observation(token_ids=[10**9]),
            reward=math.nan,
            terminated=0,
            info={"obj": object()},
            outcome_reward=1.0,
        )

    async def close(self):
        raise OSError("socket already closed")


def test_check_env_lists_every_problem(tiny_tokenizer):
    with pytest.raises(EnvCheckError) as caught:
        check_env(BrokenEnv(), {}, tokenizer=tiny_tokenizer)
    assert caught.value.problems == [
        "reset(task): message 0 (user) has no string 'content'",
        "close() raised OSError: socket already closed",
    ]

    class BrokenAfterReset(BrokenEnv):
        async def reset(self, task):
            return Observation(text="hello")

    with pytest.raises(EnvCheckError) as caught:
        check_env(BrokenAfterReset(), {}, tokenizer=tiny_tokenizer)
    text = str(caught.value)
    for expected in (
        "reward is nan",
        "terminated must be a bool, got int",
        "info is not JSON-serialisable",
        "token ids outside the tokenizer's vocabulary",
        "close() raised OSError: socket already closed",
    ):
        assert expected in text, text


def test_check_env_reports_sync_methods_raising_steps_and_repeated_outcomes():
    class SyncEnv(AgentEnv):
        def reset(self, task):
            return Observation(text="x")

        async def step(self, action):
            raise NotImplementedError

    with pytest.raises(EnvCheckError, match=r"reset\(\) must be 'async def'"):
        check_env(SyncEnv(), {})

    class RaisingEnv(CountdownEnv):
        async def step(self, action):
            raise KeyError("score")

    with pytest.raises(EnvCheckError, match=r"step\(action 0\) raised KeyError: 'score'"):
        check_env(RaisingEnv(), {})

    class TwiceEnv(CountdownEnv):
        async def step(self, action):
            return StepResult(Observation(text="more"), outcome_reward=0.5)

    with pytest.raises(EnvCheckError, match="outcome_reward reported again"):
        check_env(TwiceEnv(), {}, actions=["a", "b"])

    with pytest.raises(EnvCheckError, match="not a subclass of agent_r1.envs.AgentEnv"):
        check_env(lambda: object(), {})


def test_check_env_takes_an_outcome_per_role_and_checks_each_reward():
    class SeatsEnv(CountdownEnv):
        def __init__(self, second: float) -> None:
            super().__init__()
            self.second = second

        async def step(self, action):
            return StepResult(
                None, terminated=True, outcome_reward={"player_0": 1.0, "player_1": self.second}
            )

    check_env(SeatsEnv(-1.0), {})
    with pytest.raises(EnvCheckError, match="a mapping of roles to finite floats.*'player_1': inf"):
        check_env(SeatsEnv(math.inf), {})


# ------------------------------------------------------------------------------------------ ToolEnv


@tool
def lookup(word: str) -> str:
    """Look a word up in the dictionary.

    Args:
        word: the word to look up.
    """
    return {"cat": "a small feline", "dog": "a loyal canine"}.get(word, "not found") + " " + "." * 50


@tool
def explode(reason: str) -> str:
    """Always fails.

    Args:
        reason: why.
    """
    raise RuntimeError(reason)


def call(name, **arguments):
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def act(tokenizer, text, *, eos=True, reason=StopReason.STOP):
    ids = encode_text(tokenizer, text) + ([tokenizer.eos_token_id] if eos else [])
    return Action(tokenizer.decode(ids, skip_special_tokens=False), ids, reason)


def make_tool_env(tokenizer, **kwargs):
    kwargs.setdefault("system_prompt", "Answer with one word.")
    return ToolEnv(tokenizer, [lookup, explode], **kwargs)


TASK = {"id": "t1", "prompt": "Which animal is loyal?", "answer": "dog"}


def test_tool_env_runs_tools_then_scores_the_final_answer(tiny_tokenizer):
    env = make_tool_env(tiny_tokenizer, max_tool_output_chars=30)

    async def episode():
        obs = await env.reset(TASK)
        first_prompt = tiny_tokenizer.decode(list(obs.token_ids))
        assert first_prompt.startswith("<|im_start|>system\nAnswer with one word.\n\n# Tools")
        assert '"name": "lookup"' in first_prompt and "Which animal is loyal?" in first_prompt
        a1 = act(
            tiny_tokenizer, "Checking.\n" + call("lookup", word="cat") + "\n" + call("lookup", word="dog")
        )
        r1 = await env.step(a1)
        assert not (r1.terminated or r1.truncated) and r1.outcome_reward is None
        assert r1.info["tool_calls"] == [
            {"name": "lookup", "arguments": {"word": "cat"}},
            {"name": "lookup", "arguments": {"word": "dog"}},
        ]
        assert r1.info["tool_results"][0].startswith("a small feline")
        assert all(r.endswith(" chars]") and "...[truncated" in r for r in r1.info["tool_results"])
        assert r1.info["tool_results"][1].startswith("a loyal canine ....")
        assert r1.info["tool_errors"] == []
        assert r1.info["context"] == {"policy": "append", "dropped_turns": 0, "summarised": False}
        # append: the next prompt extends prompt + response, and equals the full rendering.
        ids = r1.observation.token_ids
        assert ids[: len(obs.token_ids) + len(a1.token_ids)] == obs.token_ids + a1.token_ids
        tools = [t.schema() for t in env.tools]
        assert list(ids) == encode_text(
            tiny_tokenizer, render_messages(tiny_tokenizer, env.messages, tools=tools)
        )
        assert env.messages[2]["content"] == a1.text.removesuffix("<|im_end|>")  # raw response text
        r2 = await env.step(act(tiny_tokenizer, "dog"))
        return r2

    r2 = asyncio.run(episode())
    assert r2.terminated and r2.observation is None and r2.outcome_reward == 1.0 and r2.reward == 0.0
    assert r2.info["answer"] == "dog" and r2.info["success"] is True


def test_tool_env_malformed_calls_and_failing_tools_become_observations(tiny_tokenizer):
    env = make_tool_env(tiny_tokenizer)

    async def episode():
        await env.reset(TASK)
        bad = await env.step(act(tiny_tokenizer, '<tool_call>{"name": "lookup", "arguments": {</tool_call>'))
        failing = await env.step(act(tiny_tokenizer, call("explode", reason="boom") + call("fly")))
        return bad, failing

    bad, failing = asyncio.run(episode())
    assert not bad.terminated and bad.outcome_reward is None  # never taken as the final answer
    assert len(bad.info["tool_errors"]) == 1 and "invalid JSON" in bad.info["tool_errors"][0]
    text = tiny_tokenizer.decode(list(bad.observation.token_ids))
    assert text.endswith(
        "<tool_response>\n"
        + "Error: "
        + bad.info["tool_errors"][0].removeprefix("Error: ")
        + "\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert "boom" in failing.info["tool_errors"][0]
    assert (
        "unknown tool 'fly'" in failing.info["tool_errors"][1] and "lookup" in failing.info["tool_errors"][1]
    )


def test_tool_env_cut_mid_call_max_turns_and_step_reward(tiny_tokenizer):
    env = make_tool_env(
        tiny_tokenizer, max_turns=2, step_reward=lambda parsed, results, task: 0.1 * len(results)
    )

    async def episode():
        await env.reset(TASK)
        cut = await env.step(
            act(tiny_tokenizer, '<tool_call>\n{"name": "look', eos=False, reason=StopReason.LENGTH)
        )
        last = await env.step(act(tiny_tokenizer, call("lookup", word="cat")))
        return cut, last

    cut, last = asyncio.run(episode())
    assert any("cut off at the token limit" in e for e in cut.info["tool_errors"])
    assert "cut off" in tiny_tokenizer.decode(list(cut.observation.token_ids))
    assert cut.reward == 0.0 and last.reward == pytest.approx(0.1)
    assert last.truncated and not last.terminated and last.observation is None
    assert last.info["truncated"] == "max_turns=2 reached" and last.info["success"] is False


@pytest.mark.parametrize("max_errors_shown", [1, 2, None])
def test_tool_env_shows_a_bounded_number_of_parse_errors(tiny_tokenizer, max_errors_shown):
    # The degenerate response seen in training: <tool_call> repeated until the token limit. Each
    # repetition is a parse error; the model reads at most max_errors_shown of them and a count.
    env = make_tool_env(tiny_tokenizer, max_errors_shown=max_errors_shown)
    text = call("lookup", word="cat") + "<tool_call>" * 6

    async def episode():
        await env.reset(TASK)
        return await env.step(act(tiny_tokenizer, text, eos=False, reason=StopReason.LENGTH))

    step = asyncio.run(episode())
    parse_errors = [f"<tool_call> #{k} is not closed" for k in range(2, 8)]
    assert step.info["tool_counts"]["parse_errors"] == 6 and step.info["tool_counts"]["calls"] == 1
    assert [
        e[: len(p)] for e, p in zip(step.info["tool_errors"], parse_errors, strict=False)
    ] == parse_errors  # all kept
    assert step.info["tool_errors"][6] == CUT_OFF_ERROR
    prompt = tiny_tokenizer.decode(list(step.observation.token_ids))
    responses = prompt.split("<|im_start|>assistant\n")[-2].split("<tool_response>\n")[1:]
    shown = 6 if max_errors_shown is None else max_errors_shown
    expected = ["a small feline " + "." * 50] + [f"Error: {e}" for e in step.info["tool_errors"][:shown]]
    if shown < 6:
        expected.append(f"Error: {6 - shown} more errors in this response not shown")
    expected.append(f"Error: {CUT_OFF_ERROR}")
    assert [r.split("\n</tool_response>")[0] for r in responses] == expected


def test_tool_env_malformed_calls_answer_ends_the_episode_as_trl_does(tiny_tokenizer):
    # malformed_calls="answer" is TRL's tool loop: a response with a malformed call is plain text, so
    # the final answer, and none of its calls run (here a well-formed one beside the broken one).
    ran = []

    @tool
    def record(word: str) -> str:
        """Record a word.

        Args:
            word: any word
        """
        ran.append(word)
        return word

    def episode(env, text):
        async def run():
            await env.reset(TASK)
            return await env.step(act(tiny_tokenizer, text))

        return asyncio.run(run())

    broken = call("record", word="cat") + "\n<tool_call>\n{not json}\n</tool_call> dog"
    kwargs = {"system_prompt": "Answer with one word."}
    ends = episode(ToolEnv(tiny_tokenizer, [record], malformed_calls="answer", **kwargs), broken)
    assert ends.terminated and ends.observation is None and ran == []
    assert ends.outcome_reward == 0.0 and ends.info["success"] is False  # the whole text is the answer
    assert ends.info["answer"] == broken.strip()
    assert ends.info["tool_counts"] == {"calls": 0, "parse_errors": 1, "tool_errors": 0, "near_misses": 0}
    goes_on = episode(ToolEnv(tiny_tokenizer, [record], **kwargs), broken)  # the default: told, goes on
    assert not goes_on.terminated and goes_on.observation is not None and ran == ["cat"]
    assert goes_on.info["tool_counts"]["calls"] == 1 and goes_on.info["tool_counts"]["parse_errors"] == 1
    fine = episode(
        ToolEnv(tiny_tokenizer, [record], malformed_calls="answer", **kwargs), call("record", word="dog")
    )
    assert not fine.terminated and ran == ["cat", "dog"]  # a well-formed call still runs
    with pytest.raises(
        ValueError, match=r"ToolEnv: malformed_calls must be one of \('error', 'answer'\), got 'x'"
    ):
        ToolEnv(tiny_tokenizer, [record], malformed_calls="x")


def test_tool_env_custom_answer_extraction_and_scorer(tiny_tokenizer):
    import re

    def extract(text):
        match = re.search(r"<answer>(.*?)</answer>", text)
        return match.group(1) if match else None

    env = make_tool_env(
        tiny_tokenizer, extract_answer=extract, outcome_reward=lambda a, t: 0.5 if a == t["answer"] else 0.0
    )

    async def answer(text):
        await env.reset(TASK)
        return await env.step(act(tiny_tokenizer, text))

    right = asyncio.run(answer("It is <answer>dog</answer>."))
    assert right.outcome_reward == 0.5 and right.info["success"] is False  # below success_threshold=1
    missing = asyncio.run(answer("a dog"))
    assert missing.outcome_reward == 0.0 and missing.info["answer"] is None


def test_tool_env_passes_check_env(tiny_tokenizer):
    actions = [call("lookup", word="dog"), "dog"]
    check_env(lambda: make_tool_env(tiny_tokenizer), TASK, actions=actions, tokenizer=tiny_tokenizer)
    engine = ScriptedEngine(tiny_tokenizer, actions)  # actions from an engine, prompts rendered as flows do
    check_env(lambda: make_tool_env(tiny_tokenizer), TASK, engine=engine, tokenizer=tiny_tokenizer)
    assert len(engine.calls) == 2 and "dog" in tiny_tokenizer.decode(engine.calls[1][0])
    with pytest.raises(ValueError, match="an engine needs the tokenizer"):
        check_env(CountdownEnv, {}, engine=engine)
    check_env(
        lambda: make_env("tool", tokenizer=tiny_tokenizer, tools=[lookup]), TASK, tokenizer=tiny_tokenizer
    )


def test_tool_env_bad_configuration_is_named_at_construction(tiny_tokenizer, tiny_checkpoint):
    with pytest.raises(ValueError, match=r"unknown tool-call format 'xml'.*hermes"):
        ToolEnv(tiny_tokenizer, [lookup], format="xml")
    with pytest.raises(ValueError, match=r"unknown context policy 'all'.*append"):
        ToolEnv(tiny_tokenizer, [lookup], context="all")
    with pytest.raises(
        ValueError, match="ToolEnv: context_kwargs apply to a context policy given by name only"
    ):
        ToolEnv(
            tiny_tokenizer, [lookup], context=get_context_policy("sliding_window"), context_kwargs={"k": 2}
        )
    assert ToolEnv(tiny_tokenizer, [lookup], context="sliding_window", context_kwargs={"k": 3}).context.k == 3
    with pytest.raises(TypeError, match="ToolSet takes Tool objects"):
        ToolEnv(tiny_tokenizer, ["lookup"])
    for bad in (0, True):
        with pytest.raises(ValueError, match=f"ToolEnv: max_errors_shown must be >= 1 or None, got {bad}"):
            ToolEnv(tiny_tokenizer, [lookup], max_errors_shown=bad)
    from agent_r1.models.loading import load_tokenizer

    bare = load_tokenizer(tiny_checkpoint)
    bare.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        ToolEnv(bare, [lookup])
    env = make_tool_env(tiny_tokenizer)
    with pytest.raises(ValueError, match=r"no 'prompt' field; its fields: \['question'\]"):
        asyncio.run(env.reset({"question": "?"}))


def test_tool_env_with_a_format_that_writes_its_own_system_prompt(tiny_tokenizer):
    env = make_tool_env(tiny_tokenizer, format="react")
    obs = asyncio.run(env.reset(TASK))
    text = tiny_tokenizer.decode(list(obs.token_ids))
    assert "# Tools" not in text  # tools are not given to the chat template ...
    assert (
        "lookup" in text and text.count("<|im_start|>system") == 1
    )  # ... but described in the system message


@pytest.mark.parametrize(
    "context,kwargs",
    [("rerender", {}), ("sliding_window", {"k": 1}), ("token_budget", {"max_tokens": 1200})],
)
def test_tool_env_with_each_history_policy(tiny_tokenizer, context, kwargs):
    env = make_tool_env(tiny_tokenizer, context=context, context_kwargs=kwargs)

    async def episode():
        await env.reset(TASK)
        results = [await env.step(act(tiny_tokenizer, call("lookup", word=w))) for w in ("cat", "dog", "cow")]
        return results

    results = asyncio.run(episode())
    infos = [r.info["context"] for r in results]
    assert all(i["policy"] == context for i in infos)
    if context != "rerender":  # the head (system prompt with tools, task) is ~920 tokens, a turn ~140
        assert [i["dropped_turns"] for i in infos] == [0, 1, 1]
    tools = [t.schema() for t in env.tools]
    expected = encode_text(tiny_tokenizer, render_messages(tiny_tokenizer, env.messages, tools=tools))
    assert list(results[-1].observation.token_ids) == expected
    assert len(expected) <= 1200 or context == "rerender"


def test_envs_and_flows_are_exported_at_the_top_level():
    import agent_r1
    import agent_r1.envs
    import agent_r1.flows

    assert agent_r1.ToolEnv is ToolEnv and agent_r1.check_env is check_env
    assert agent_r1.AgentEnvLoop is agent_r1.flows.AgentEnvLoop
    assert all(getattr(agent_r1, name) is not None for name in agent_r1.__all__)
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        _ = agent_r1.Nope


def test_an_adapter_whose_package_is_missing_names_the_extra_to_install():
    from agent_r1.envs.ecosystem import MissingPackageError, require

    with pytest.raises(
        MissingPackageError, match=r"env 'x' needs the 'no_such_pkg_xyz' package: pip install 'agent-r1\[x\]'"
    ):
        require("no_such_pkg_xyz.sub", "x", "env 'x'")
    assert require("json", "x", "env 'x'").dumps(1) == "1"
