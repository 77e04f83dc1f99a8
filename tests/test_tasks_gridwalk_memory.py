"""gridwalk_memory: the goal told once in an opening look, each move answered with what is left on its
axis, and the three context policies that make it differ (append grows, sliding_window is bounded and
loses the goal, summarize adds a trained summary step); the demonstrator's summaries; rewards; and
bad rows."""

from __future__ import annotations

import asyncio
import random

import pytest

from agent_r1.envs import check_env, make_env
from agent_r1.envs.context import SUMMARY_STEP_KEY, SummarizeContext
from agent_r1.flows import AgentEnvLoop, rollout_group
from agent_r1.models.tiny import build_tiny, build_tiny_tokenizer
from agent_r1.rollout.hf import HFEngine
from agent_r1.tasks import gridwalk_memory as gm
from agent_r1.train.batch import batch_of
from agent_r1.train.builders import env_factory
from agent_r1.train.config import config_from_dict
from agent_r1.train.sft import replay_demonstrations
from agent_r1.types import Action, SamplingParams

TOKENIZER = build_tiny_tokenizer()
TASK = {"id": "t", "dx": 3, "dy": -2, "budget": 7}
MOVES = ["E", "S", "E", "S", "E"]  # the shortest walk to (3, -2)


def demo_env(context: str, **context_kwargs):
    """A factory of envs lent the scripted demonstrator policy (it writes the summaries)."""

    def build():
        env = gm.GridMemoryEnv(TOKENIZER, context=context, context_kwargs=context_kwargs)
        env.lend_policy(gm.demonstrator_policy(TOKENIZER))
        return env

    return build


def replay(context: str, moves=MOVES, **context_kwargs):
    (trajectory,) = replay_demonstrations(
        demo_env(context, **context_kwargs), TOKENIZER, [TASK], lambda task, rng: list(moves)
    )
    return trajectory


def text(ids) -> str:
    return TOKENIZER.decode(list(ids), skip_special_tokens=False)


def test_the_goal_is_told_once_and_each_move_is_answered_for_its_axis_only():
    steps = replay("append").steps
    first, last = text(steps[0].prompt_ids), text(steps[-1].prompt_ids)
    assert "<|im_start|>assistant\nlook<|im_end|>\n<|im_start|>user\nGoal 3E 2S<|im_end|>" in first
    assert last.count("Goal") == 1  # never the whole offset again
    effects = ["moved E, 2E left", "moved S, 1S left", "moved E, 1E left", "moved S, 0S left"]
    assert [e for e in effects if f"user\n{e}<|im_end|>" in last] == effects


@pytest.mark.parametrize(
    ("move", "dx", "dy", "answer"),
    [
        ("E", 2, -1, "moved E, 2E left"),
        ("E", -1, 3, "moved E, 1W left"),  # overshot
        ("N", 3, 0, "moved N, 0N left"),
        ("S", 0, -2, "moved S, 2S left"),
        (None, 1, 1, "no move: answer E, W, N or S"),
    ],
)
def test_the_answer_to_a_move_is_what_is_left_on_its_axis(move, dx, dy, answer):
    assert gm.effect_text(move, dx, dy) == answer


def test_append_grows_the_prompt_as_an_exact_extension_of_prompt_plus_response():
    steps = replay("append").steps
    assert len(steps) == len(MOVES)
    for before, after in zip(steps, steps[1:], strict=False):
        assert after.prompt_ids[: len(before.prompt_ids) + len(before.response_ids)] == (
            before.prompt_ids + before.response_ids
        )
    lengths = [len(s.prompt_ids) for s in steps]
    growth = {b - a for a, b in zip(lengths, lengths[1:], strict=False)}
    assert len(growth) == 1 and growth.pop() > 0  # every turn adds the same bytes: one move, one effect
    assert len(batch_of([replay("append")], micro_batch_tokens=4096).sequences) == 1  # one training sequence


def test_sliding_window_keeps_the_last_k_turns_so_the_prompt_is_bounded_and_the_goal_is_lost():
    steps = replay("sliding_window", k=2).steps
    lengths = [len(s.prompt_ids) for s in steps]
    assert lengths[0] < lengths[1] and lengths[2] == lengths[3] == lengths[4]
    # The carried conversation is the window itself: each build drops the one turn that fell out.
    assert [s.info["context"]["dropped_turns"] for s in steps[:-1]] == [0, 1, 1, 1]
    assert "Goal 3E 2S" in text(steps[1].prompt_ids)
    assert all("Goal" not in text(s.prompt_ids) for s in steps[2:])  # the look fell out
    last = text(steps[-1].prompt_ids)
    assert "moved E, 1E left" in last and "moved S, 0S left" in last and last.count("moved") == 2


def test_summarize_adds_a_summary_step_written_by_the_lent_policy():
    """max_turns 2, keep_last 1: after the 2nd move the look and the 1st move are summarised
    (Goal 3E 2S, then E: 2E left = Goal 2E 2S); after the 4th, that summary and moves 2-3 roll
    forward (S: 1S left, E: 1E left = Goal 1E 1S)."""
    trajectory = replay("summarize", max_turns=2, keep_last=1)
    steps = trajectory.steps
    rows = [i for i, s in enumerate(steps) if SUMMARY_STEP_KEY in s.info]
    assert rows == [2, 5] and len(steps) == len(MOVES) + 2
    assert [steps[r].response_text for r in rows] == ["Goal 2E 2S<|im_end|>", "Goal 1E 1S<|im_end|>"]
    first_request, second_request = text(steps[2].prompt_ids), text(steps[5].prompt_ids)
    assert gm.SUMMARY_INSTRUCTION in first_request and "user: Goal 3E 2S" in first_request
    assert "user: Summary: Goal 2E 2S" in second_request  # rolled forward
    for row in rows:
        written = steps[row].response_text.removesuffix("<|im_end|>")
        following = text(steps[row + 1].prompt_ids)
        assert f"Summary: {written}<|im_end|>" in following and following.count("Goal") == 1
    # Each summary step is a training sequence of its own, its response the target.
    sequences = batch_of([trajectory], micro_batch_tokens=4096).sequences
    summary_spans = [sp for seq in sequences for sp in seq.spans if sp.row in rows]
    assert [sp.length for sp in summary_spans] == [len(steps[r].response_ids) for r in rows]
    assert trajectory.outcome_reward == 1.0


def test_the_real_flow_trains_the_policys_own_summaries():
    """Random-weight tiny model through AgentEnvLoop + HFEngine: summary steps appear in the
    trajectories with the sampler's log-probs, and the next prompt holds their exact ids."""
    model, tokenizer = build_tiny(seed=0)
    engine = HFEngine(model, tokenizer=tokenizer)

    def env():
        return gm.GridMemoryEnv(
            tokenizer, context="summarize", context_kwargs={"max_turns": 2, "keep_last": 1}
        )

    flow = AgentEnvLoop(env, tokenizer, SamplingParams(max_tokens=6, seed=0), max_steps=8)
    try:
        group = asyncio.run(rollout_group(flow, engine, {"id": "t", "dx": 6, "dy": 2, "budget": 8}, 2, "g"))
    finally:
        engine.close()
    for trajectory in group.trajectories:
        steps = trajectory.steps
        rows = [i for i, s in enumerate(steps) if SUMMARY_STEP_KEY in s.info]
        assert rows and rows[0] == 2  # the first summary follows the 2nd move
        for row in rows:
            summary = steps[row]
            assert summary.response_ids and len(summary.logprobs) == len(summary.response_ids)
            assert all(lp < 0 for lp in summary.logprobs)  # sampled, not scripted
            spliced = [i for i in summary.response_ids if i not in tokenizer.all_special_ids]
            following = steps[row + 1].prompt_ids
            n = len(spliced)
            assert any(following[i : i + n] == tuple(spliced) for i in range(len(following) - n + 1))


def test_reaching_the_goal_ends_with_one_running_out_with_zero_and_nothing_in_between():
    async def play(task, replies):
        env = gm.GridMemoryEnv(TOKENIZER)
        await env.reset(task)
        return [await env.step(Action(r, tuple(TOKENIZER.encode(r)))) for r in replies]

    won = asyncio.run(play({"id": "a", "dx": 1, "dy": 1, "budget": 3}, ["N", "E<|im_end|>"]))
    assert won[0].reward == 0.0 and won[0].outcome_reward is None and not won[0].terminated
    assert won[1].terminated and won[1].outcome_reward == 1.0 and won[1].info["success"] is True
    lost = asyncio.run(play({"id": "b", "dx": 1, "dy": 1, "budget": 3}, ["W", "north", "E"]))
    assert lost[1].info["invalid"] is True and "no move" in text(lost[1].observation.token_ids)
    assert [r.info["state"] for r in lost] == ["+1,+1", "+2,+1", "+2,+1"]  # the bad reply moves nothing
    assert lost[2].truncated and lost[2].outcome_reward == 0.0 and lost[2].info["success"] is False


@pytest.mark.parametrize(
    ("request_text", "summary"),
    [
        (
            "assistant: look\n\nuser: Goal 3E 2S\n\nassistant: E\n\nuser: moved E, 2E left\n\n"
            "assistant: S\n\nuser: moved S, 1S left<|im_end|>",
            "Goal 2E 1S",
        ),
        ("user: Summary: Goal 1E 2S\n\nassistant: S\n\nuser: moved S, 1S left", "Goal 1E 1S"),
        ("user: Goal 2N\n\nuser: moved W, 1E left\n\nuser: no move: answer E, W, N or S", "Goal 1E 2N"),
        ("user: Goal 1W 3N\n\nassistant: W\n\nuser: moved W, 0W left", "Goal 3N"),
        ("user: Goal 5E\n\nuser: Summary: Goal 2E 1N\n\nuser: moved N, 0N left", "Goal 2E"),
    ],
)
def test_the_demonstrated_summary_is_the_last_goal_updated_by_the_later_answers(request_text, summary):
    assert gm.demonstrated_summary(request_text) == summary


@pytest.mark.parametrize(
    ("request_text", "summary"),
    [
        ("user: Summary: Goal \n\nuser: moved E, 1E left\n\nuser: moved N, 4N left", "Goal 1E 4N"),
        ("user: Summary: Gaol 3E\n\nuser: moved S, 2S left", "Goal 2S"),
        ("user: Summary: Goal\n\nassistant: E", "Goal"),
    ],
)
def test_a_request_whose_summary_states_no_offset_starts_from_nothing_left(request_text, summary):
    """The policy's own summaries may be wrong; the next request is then judged on what it shows."""
    assert gm.demonstrated_summary(request_text) == summary


def test_bad_task_rows_raise_one_clear_error_naming_the_field():
    env = gm.GridMemoryEnv(TOKENIZER)
    with pytest.raises(ValueError, match=r"gridwalk task 'x': missing field 'budget'"):
        asyncio.run(env.reset({"id": "x", "dx": 1, "dy": 2}))
    with pytest.raises(ValueError, match=r"'budget' 2 is below the distance 3"):
        asyncio.run(env.reset({"id": "x", "dx": 1, "dy": 2, "budget": 2}))
    with pytest.raises(ValueError, match="context_kwargs apply to a context policy given by name only"):
        gm.GridMemoryEnv(TOKENIZER, context=SummarizeContext(), context_kwargs={"k": 2})
    with pytest.raises(ValueError, match="unknown context policy 'windowed'"):
        gm.GridMemoryEnv(TOKENIZER, context="windowed")


def test_the_env_passes_check_env_and_is_registered_by_name():
    check_env(demo_env("summarize", max_turns=2, keep_last=1), TASK, actions=MOVES, tokenizer=TOKENIZER)
    assert isinstance(make_env("gridwalk_memory", tokenizer=TOKENIZER), gm.GridMemoryEnv)
    config = config_from_dict(
        {
            "env": {
                "name": "gridwalk_memory",
                "kwargs": {"context": "sliding_window", "context_kwargs": {"k": 2}},
            }
        }
    )
    env = env_factory(config, TOKENIZER)()
    assert isinstance(env, gm.GridMemoryEnv) and env.context.k == 2


def test_the_axis_by_axis_demonstrator_finishes_one_axis_then_the_other():
    rng = random.Random(0)
    walks = [gm.demonstrate_axis_by_axis(TASK, rng) for _ in range(20)]
    assert {tuple(w) for w in walks} == {("E",) * 3 + ("S",) * 2, ("S",) * 2 + ("E",) * 3}
    assert gm.demonstrate_axis_by_axis({"id": "s", "dx": 0, "dy": 4, "budget": 6}, rng) == ["N"] * 4
    trajectory = replay("sliding_window", moves=walks[0], k=2)
    assert trajectory.outcome_reward == 1.0
