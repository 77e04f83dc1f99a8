import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent_r1.types import (
    Completion,
    Observation,
    SamplingParams,
    Step,
    StepResult,
    StopReason,
    Trajectory,
    TrajectoryGroup,
    TrajectoryStatus,
    read_jsonl,
    write_jsonl,
)


def make_step(n_prompt=3, n_resp=2, **kw) -> Step:
    return Step(
        prompt_ids=list(range(n_prompt)),
        response_ids=list(range(100, 100 + n_resp)),
        logprobs=[-0.5] * n_resp,
        **kw,
    )


def test_step_defaults_mask_to_all_ones_and_validates_lengths():
    s = make_step()
    assert s.response_mask == (1, 1)
    with pytest.raises(ValueError, match="same length"):
        Step(prompt_ids=[1], response_ids=[1, 2], logprobs=[0.0])


def test_observation_needs_exactly_one_form():
    assert Observation(text="hi").text == "hi"
    with pytest.raises(ValueError, match="exactly one"):
        Observation()
    with pytest.raises(ValueError, match="exactly one"):
        Observation(text="a", token_ids=[1])


def test_sampling_params_reject_bad_values_by_name():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=0)
    assert SamplingParams(stop=["x"]).stop == ("x",)


def test_completion_checks_lengths():
    with pytest.raises(ValueError):
        Completion(token_ids=[1, 2], logprobs=[0.0], finish_reason="stop")
    assert Completion([1], [-1.0], "length").finish_reason is StopReason.LENGTH


def test_error_trajectory_needs_text():
    with pytest.raises(ValueError):
        Trajectory(task_id="t", steps=(), status=TrajectoryStatus.ERROR)


def test_step_result_needs_observation_unless_done():
    with pytest.raises(ValueError):
        StepResult(observation=None)
    assert StepResult(observation=None, terminated=True, outcome_reward=1.0).outcome_reward == 1.0


def test_total_reward_counts_each_reward_once():
    t = Trajectory(task_id="t", steps=(make_step(reward=0.25), make_step(reward=-0.5)), outcome_reward=1.0)
    assert t.total_reward == pytest.approx(0.75)


finite = st.floats(allow_nan=False, allow_infinity=False, width=32)
any_float = st.floats(width=64)
json_scalar = st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.text(max_size=8)


@st.composite
def steps(draw):
    n = draw(st.integers(0, 6))
    return Step(
        prompt_ids=draw(st.lists(st.integers(0, 300_000), max_size=8)),
        response_ids=draw(st.lists(st.integers(0, 300_000), min_size=n, max_size=n)),
        logprobs=draw(st.lists(any_float, min_size=n, max_size=n)),
        response_mask=draw(st.lists(st.integers(0, 1), min_size=n, max_size=n)) if n else (),
        reward=draw(any_float),
        terminated=draw(st.booleans()),
        truncated=draw(st.booleans()),
        stop_reason=draw(st.sampled_from(list(StopReason))),
        response_text=draw(st.text(max_size=20)),
        state_key=draw(st.none() | st.text(max_size=5)),
        policy_version=draw(st.integers(0, 1000)),
        info=draw(st.dictionaries(st.text(max_size=5), json_scalar, max_size=3)),
        timings=draw(st.dictionaries(st.text(max_size=5), finite, max_size=3)),
    )


@st.composite
def groups(draw):
    trajs = []
    for i in range(draw(st.integers(1, 2))):
        status = draw(st.sampled_from(list(TrajectoryStatus)))
        trajs.append(
            Trajectory(
                task_id="task-1",
                group_id="g",
                steps=tuple(draw(st.lists(steps(), max_size=2))),
                outcome_reward=draw(any_float),
                status=status,
                error="Traceback: boom" if status is TrajectoryStatus.ERROR else None,
                info={"i": i},
            )
        )
    return TrajectoryGroup(group_id="g", task_id="task-1", trajectories=tuple(trajs))


def _same(a, b) -> bool:
    # NaN != NaN, so compare through the JSON form, where NaN is a stable string.
    return a.to_dict() == b.to_dict()


@given(groups())
def test_jsonl_round_trip_is_lossless(tmp_path_factory, group):
    path = tmp_path_factory.mktemp("rt") / "g.jsonl"
    write_jsonl(path, [group, *group.trajectories])
    back = list(read_jsonl(path))
    assert len(back) == 1 + len(group.trajectories)
    assert isinstance(back[0], TrajectoryGroup) and _same(back[0], group)
    for original, restored in zip(group.trajectories, back[1:], strict=True):
        assert isinstance(restored, Trajectory)
        assert _same(original, restored)
        for s0, s1 in zip(original.steps, restored.steps, strict=True):
            assert s0.prompt_ids == s1.prompt_ids and s0.response_ids == s1.response_ids
            for a, b in zip(s0.logprobs, s1.logprobs, strict=True):
                assert (math.isnan(a) and math.isnan(b)) or a == b


def test_step_metrics_are_numbers_kept_through_json_and_averaged_as_env_metrics():
    from agent_r1.train.summary import env_metrics

    step = Step((1,), (2,), (0.0,), metrics={"win": True, "invalid": 2})
    assert step.metrics == {"win": 1.0, "invalid": 2.0}
    assert Step.from_dict(step.to_dict()) == step
    with pytest.raises(TypeError, match="'bad' must be a str naming a number"):
        StepResult(None, terminated=True, metrics={"bad": "x"})
    other = Step((1,), (2,), (0.0,), metrics={"invalid": 0})
    # each name is averaged over the steps that report it: "win" only on one step -> 1.0, not 0.5
    assert env_metrics([step, other, Step((1,), (2,), (0.0,))]) == {"env/invalid": 1.0, "env/win": 1.0}
