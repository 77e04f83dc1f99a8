"""Flows with the ScriptedEngine test double (tests/doubles.py) on the real tiny tokenizer."""

import asyncio
import json

import pytest
from doubles import ScriptedEngine

from agent_r1.envs import AgentEnv, ToolEnv
from agent_r1.flows import (
    AgentEnvLoop,
    AgentFlow,
    EngineError,
    PromptTooLongError,
    SingleStepFlow,
    rollout_group,
    rollout_groups,
)
from agent_r1.models.tokens import encode_text, render_messages
from agent_r1.tools import tool
from agent_r1.types import (
    Completion,
    Observation,
    SamplingParams,
    StepResult,
    StopReason,
    TrajectoryStatus,
)

PARAMS = SamplingParams(max_tokens=200)


@tool
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: first.
        b: second.
    """
    return a + b


def call(name, **arguments):
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def tool_env_factory(tokenizer, **kwargs):
    return lambda: ToolEnv(tokenizer, [add], **kwargs)


TASK = {"id": "sum", "prompt": "What is 2 + 3 + 4?", "answer": "9"}


def test_agent_env_loop_runs_a_tool_episode(tiny_tokenizer):
    engine = ScriptedEngine(tiny_tokenizer, [call("add", a=2, b=3), call("add", a=5, b=4), "9"])
    flow = AgentEnvLoop(tool_env_factory(tiny_tokenizer), tiny_tokenizer, PARAMS, max_steps=5)
    trajectory = asyncio.run(flow.run(engine, TASK))
    assert trajectory.status is TrajectoryStatus.OK and trajectory.task_id == "sum"
    assert len(trajectory.steps) == 3 and trajectory.outcome_reward == 1.0
    assert trajectory.info == {"success": True}
    first, second, last = trajectory.steps
    # Each step stores exactly the prompt the engine saw and the ids/logprobs it returned.
    assert [list(s.prompt_ids) for s in trajectory.steps] == [p for p, _ in engine.calls]
    assert first.response_text.endswith("</tool_call><|im_end|>")
    assert first.logprobs[:3] == pytest.approx((-0.1, -0.2, -0.3))
    assert first.info["tool_results"] == ["5"] and second.info["tool_results"] == ["9"]
    assert second.prompt_ids[: len(first.prompt_ids) + len(first.response_ids)] == (
        first.prompt_ids + first.response_ids
    )
    assert last.terminated and not last.truncated and last.info["answer"] == "9"
    assert all(set(s.timings) == {"generate", "env_step"} for s in trajectory.steps)
    assert all(t >= 0 for s in trajectory.steps for t in s.timings.values())


class ChatEnv(AgentEnv):
    """Observations as chat messages (first) and plain text (after)."""

    async def reset(self, task):
        return Observation(messages=[{"role": "user", "content": task["prompt"]}])

    async def step(self, action):
        if action.text.startswith("done"):
            return StepResult(None, reward=0.5, terminated=True)
        return StepResult(Observation(text="raw <|im_start|>text"), reward=0.25)


def test_messages_are_rendered_with_the_template_and_text_is_encoded_as_written(tiny_tokenizer):
    engine = ScriptedEngine(tiny_tokenizer, ["more", "done"])
    flow = AgentEnvLoop(ChatEnv, tiny_tokenizer, PARAMS)
    trajectory = asyncio.run(flow.run(engine, {"prompt": "hi"}))
    first, second = trajectory.steps
    expected = render_messages(tiny_tokenizer, [{"role": "user", "content": "hi"}])
    assert expected.endswith("<|im_start|>assistant\n")
    assert list(first.prompt_ids) == encode_text(tiny_tokenizer, expected)
    assert list(second.prompt_ids) == encode_text(tiny_tokenizer, "raw <|im_start|>text")
    assert trajectory.total_reward == 0.75 and trajectory.outcome_reward == 0.0


class CounterEnv(AgentEnv):
    """Appends every response to its prompt (so no two prompts are equal) and names the state it shows:
    the count of responses so far."""

    async def reset(self, task):
        self.count, self.text = 0, task["prompt"]
        return Observation(text=self.text, state_key="count 0")

    async def step(self, action):
        self.count, self.text = self.count + 1, self.text + action.text
        if self.count == 2:
            return StepResult(None, terminated=True, outcome_reward=1.0)
        return StepResult(Observation(text=self.text, state_key=f"count {self.count}"))


def test_an_observations_state_key_names_the_step_taken_from_it(tiny_tokenizer):
    engine = ScriptedEngine(tiny_tokenizer, lambda prompt: "more")
    trajectory = asyncio.run(AgentEnvLoop(CounterEnv, tiny_tokenizer, PARAMS).run(engine, {"prompt": "x"}))
    assert [s.state_key for s in trajectory.steps] == ["count 0", "count 1"]
    observation = Observation(text="x", state_key="count 1")
    assert Observation.from_dict(observation.to_dict()) == observation
    assert Observation.from_dict(Observation(text="x").to_dict()).state_key is None
    with pytest.raises(TypeError, match="Observation.state_key must be a str or None, got int"):
        Observation(text="x", state_key=3)


def test_max_steps_marks_the_last_step_truncated(tiny_tokenizer):
    engine = ScriptedEngine(tiny_tokenizer, lambda prompt: "more")
    trajectory = asyncio.run(
        AgentEnvLoop(ChatEnv, tiny_tokenizer, PARAMS, max_steps=3).run(engine, {"prompt": "x"})
    )
    assert trajectory.status is TrajectoryStatus.OK and len(trajectory.steps) == 3
    assert [s.truncated for s in trajectory.steps] == [False, False, True]
    assert trajectory.info["truncated"] == "max_steps=3 reached"


def test_a_prompt_over_the_limit_truncates_or_raises(tiny_tokenizer):
    engine = ScriptedEngine(tiny_tokenizer, lambda prompt: call("add", a=1, b=1))
    factory = tool_env_factory(tiny_tokenizer)
    first_len = len(asyncio.run(factory().reset(TASK)).token_ids)
    limit = first_len + 20  # room for the first prompt, not the second
    flow = AgentEnvLoop(factory, tiny_tokenizer, PARAMS, max_prompt_tokens=limit)
    trajectory = asyncio.run(flow.run(engine, TASK))
    assert trajectory.status is TrajectoryStatus.TRUNCATED and len(trajectory.steps) == 1
    assert f"> max_prompt_tokens={limit}" in trajectory.info["truncated"]

    strict = AgentEnvLoop(
        factory, tiny_tokenizer, PARAMS, max_prompt_tokens=limit, on_prompt_overflow="raise"
    )
    with pytest.raises(PromptTooLongError, match="max_prompt_tokens"):
        asyncio.run(strict.run(engine, TASK))
    with pytest.raises(PromptTooLongError):  # not swallowed by rollout_group
        asyncio.run(rollout_group(strict, engine, TASK, n=2, group_id="g"))
    with pytest.raises(ValueError, match="on_prompt_overflow must be 'truncate' or 'raise'"):
        AgentEnvLoop(factory, tiny_tokenizer, PARAMS, on_prompt_overflow="drop")


def test_an_engine_with_a_full_context_truncates_or_raises(tiny_tokenizer):
    full = Completion((), (), StopReason.LENGTH, error="prompt has 900 tokens; the model's context is 512")
    engine = ScriptedEngine(
        tiny_tokenizer, lambda prompt: full if "<tool_response>" in prompt else call("add", a=1, b=2)
    )
    trajectory = asyncio.run(
        AgentEnvLoop(tool_env_factory(tiny_tokenizer), tiny_tokenizer, PARAMS).run(engine, TASK)
    )
    assert trajectory.status is TrajectoryStatus.TRUNCATED and len(trajectory.steps) == 1
    assert "the model's context is 512" in trajectory.info["truncated"]
    strict = AgentEnvLoop(
        tool_env_factory(tiny_tokenizer), tiny_tokenizer, PARAMS, on_prompt_overflow="raise"
    )
    with pytest.raises(PromptTooLongError, match="no room for a response"):
        asyncio.run(strict.run(engine, TASK))


def test_max_tokens_is_capped_so_prompt_and_response_fit(tiny_tokenizer):
    engine = ScriptedEngine(tiny_tokenizer, ["x" * 500])
    factory = tool_env_factory(tiny_tokenizer)
    first_len = len(asyncio.run(factory().reset(TASK)).token_ids)
    flow = AgentEnvLoop(factory, tiny_tokenizer, PARAMS, max_total_tokens=first_len + 50)
    trajectory = asyncio.run(flow.run(engine, TASK))
    assert engine.calls[0][1].max_tokens == 50
    step = trajectory.steps[0]
    assert len(step.response_ids) == 50 and step.stop_reason is StopReason.LENGTH
    assert len(step.prompt_ids) + len(step.response_ids) == first_len + 50


class FlakyEnv(ChatEnv):
    """Raises in reset for task "bad_reset", in its second step for "bad_step"."""

    def __init__(self):
        self.steps = 0

    async def reset(self, task):
        if task["prompt"] == "bad_reset":
            raise ConnectionError("sandbox did not start")
        return await super().reset(task)

    async def step(self, action):
        self.steps += 1
        if self.steps == 2:
            raise ZeroDivisionError("scorer divided by zero")
        return await super().step(action)


def test_an_env_error_marks_only_that_trajectory(tiny_tokenizer):
    flow = AgentEnvLoop(FlakyEnv, tiny_tokenizer, PARAMS, max_steps=4)
    engine = ScriptedEngine(tiny_tokenizer, lambda prompt: "done" if "ok" in prompt else "more")
    groups = asyncio.run(
        rollout_groups(
            flow, engine, [{"prompt": "ok"}, {"id": "r", "prompt": "bad_reset"}, {"prompt": "bad_step"}], n=3
        )
    )
    assert [g.group_id for g in groups] == ["0", "1:r", "2"]
    ok, bad_reset, bad_step = groups
    assert all(t.status is TrajectoryStatus.OK and len(t.steps) == 1 for t in ok.trajectories)
    assert all(t.group_id == "0" for t in ok.trajectories)
    for t in bad_reset.trajectories:
        assert t.status is TrajectoryStatus.ERROR and t.steps == () and t.task_id == "r"
        assert "ConnectionError: sandbox did not start" in t.error and "in reset" in t.error
        assert t.error.count('File "') <= 4  # a short traceback
    for t in bad_step.trajectories:
        # The completed step is kept, and so is the sampled action whose env.step raised (marked;
        # an ERROR trajectory is never trained, but the dump shows every call the model made).
        assert t.status is TrajectoryStatus.ERROR and len(t.steps) == 2
        assert "env_error" not in t.steps[0].info and t.steps[1].info == {"env_error": True}
        assert "ZeroDivisionError: scorer divided by zero" in t.error


def test_engine_errors_and_aborts_become_error_trajectories(tiny_tokenizer):
    aborted = Completion((), (), StopReason.ABORT, error="out of memory")
    engine = ScriptedEngine(tiny_tokenizer, [aborted, RuntimeError("engine crashed"), "done"])
    flow = AgentEnvLoop(ChatEnv, tiny_tokenizer, PARAMS)
    group = asyncio.run(rollout_group(flow, engine, {"prompt": "p"}, n=3, group_id="g"))
    statuses = sorted(t.status.value for t in group.trajectories)
    assert statuses == ["error", "error", "ok"]
    errors = " ".join(t.error for t in group.trajectories if t.error)
    assert "EngineError" in errors and "out of memory" in errors and "engine crashed" in errors
    assert EngineError.__name__ == "EngineError"


def test_rollout_group_turns_an_escaping_flow_exception_into_an_error_trajectory(tiny_tokenizer):
    class FailingFlow(AgentFlow):
        def __init__(self):
            self.runs = 0

        async def run(self, engine, task):
            self.runs += 1
            if self.runs == 2:
                raise ValueError("bad row")
            return await SingleStepFlow(tiny_tokenizer, PARAMS, lambda text, task: 1.0).run(engine, task)

    engine = ScriptedEngine(tiny_tokenizer, lambda prompt: "fine")
    group = asyncio.run(rollout_group(FailingFlow(), engine, {"id": 7, "prompt": "q"}, n=3, group_id="g7"))
    assert [t.status.value for t in group.trajectories] == ["ok", "error", "ok"]
    assert group.task_id == "7" and "ValueError: bad row" in group.trajectories[1].error
    assert group.rewards == [1.0, 0.0, 1.0]


def test_single_step_flow(tiny_tokenizer):
    engine = ScriptedEngine(tiny_tokenizer, ["9"])
    flow = SingleStepFlow(
        tiny_tokenizer, PARAMS, lambda text, task: text.removesuffix("<|im_end|>") == task["answer"]
    )
    trajectory = asyncio.run(flow.run(engine, TASK))
    (step,) = trajectory.steps
    assert trajectory.outcome_reward == 1.0 and step.terminated and step.response_text == "9<|im_end|>"
    assert list(step.prompt_ids) == encode_text(
        tiny_tokenizer, render_messages(tiny_tokenizer, [{"role": "user", "content": TASK["prompt"]}])
    )
    short = SingleStepFlow(tiny_tokenizer, PARAMS, lambda t, task: 1.0, max_prompt_tokens=5)
    assert asyncio.run(short.run(engine, TASK)).status is TrajectoryStatus.TRUNCATED


def test_a_tokenizer_without_chat_template_is_refused_at_construction(tiny_checkpoint):
    from agent_r1.models.loading import load_tokenizer

    bare = load_tokenizer(tiny_checkpoint)
    bare.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        AgentEnvLoop(ChatEnv, bare, PARAMS)
    with pytest.raises(ValueError, match="no chat template"):
        SingleStepFlow(bare, PARAMS, lambda t, task: 0.0)
