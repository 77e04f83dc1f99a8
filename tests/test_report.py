"""The run report and trajectory viewer (agent_r1/report), on a realistic run directory built here with
the real types and the tiny byte-level tokenizer, plus one test in a real headless Chromium."""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent_r1.report import load_run, render_html, write_report
from agent_r1.report.html import (
    chart_groups,
    embed_json,
    headline,
    metric_unit,
    overlap_fraction,
    phase_timeline,
    time_breakdown,
)
from agent_r1.report.run import (
    SUMMARY_STEP_KEY,
    ContextChange,
    metric_series,
    outcome_reason,
    prompt_segments,
    read_metrics,
    trajectory_view,
)
from agent_r1.types import (
    Step,
    StopReason,
    Trajectory,
    TrajectoryGroup,
    TrajectoryStatus,
    read_jsonl,
    write_jsonl,
)

INJECTION = "</script><script>window.__pwned = 1</script><!--"
SYSTEM = "You are a careful calculator agent. Use the add tool, then answer as <answer>N</answer>."


def _turn(role: str, content: str) -> str:
    return f"<|im_start|>{role}\n{content}<|im_end|>\n"


def _call(a: int, b: int) -> str:
    return f'<tool_call>\n{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>'


def _add(a: int, b: int) -> dict:
    return {"name": "add", "arguments": {"a": a, "b": b}}


def _answer(n: int) -> str:
    return f"The sum is <answer>{n}</answer>"


def _trajectory(
    tokenizer,
    rng,
    task_id,
    group_id,
    question,
    turns,
    *,
    outcome,
    success,
    window=None,
    viewer_info=True,
    expected=None,
    **kw,
):
    """A trajectory whose prompts are built the way an "append" context policy builds them (each prompt
    = previous prompt + response + tool turn + generation prompt), except that from turn index
    ``window`` on a sliding window keeps only the system, user and last turn (the context is rewritten).
    Each step's ``info["context"]`` describes the next prompt, as ToolEnv's step info does.

    ``turns``: (response text, tool calls, tool results, tool errors, step reward) per step.
    ``viewer_info=False`` leaves out the Step.info keys that only the viewer needs (it must cope).
    """
    head = _turn("system", SYSTEM) + _turn("user", question)
    history: list[str] = []  # one string per finished turn: assistant response + tool turn
    steps = []
    for i, (response, calls, results, errors, reward) in enumerate(turns):
        if window is not None and i >= window:
            prompt_text = head + "".join(history[-1:]) + "<|im_start|>assistant\n"
        else:
            prompt_text = head + "".join(history) + "<|im_start|>assistant\n"
        prompt_ids = tokenizer.encode(prompt_text, add_special_tokens=False)
        response_ids = tokenizer.encode(response + "<|im_end|>", add_special_tokens=False)
        logprobs = [-1.2 * rng.random() ** 4 for _ in response_ids]
        for j in rng.sample(range(len(response_ids)), k=min(3, len(response_ids))):
            logprobs[j] = rng.uniform(-7.0, -2.5)  # a few unlikely tokens to highlight
        tool_turn = "".join(
            _turn("user", f"<tool_response>\n{r}\n</tool_response>") for r in results + errors
        )
        history.append("<|im_start|>assistant\n" + response + "<|im_end|>\n" + tool_turn)
        info = {
            "prompt_text": prompt_text,
            "response_tokens": [tokenizer.decode([t]) for t in response_ids],
            "advantage": round(rng.uniform(-1, 1), 3),
            "tool_calls": calls,
            "tool_results": results,
            "tool_errors": errors,
        }
        if i + 1 < len(turns):
            # As ToolEnv reports it: the step's info says how the context policy built the NEXT prompt.
            rewrites = window is not None and i + 1 >= window
            info["context"] = {
                "policy": "append" if window is None else "sliding_window",
                "dropped_turns": len(history) - 1 if rewrites else 0,
                "summarised": False,
            }
        last = i == len(turns) - 1
        if last and "<answer>" in response:  # as ToolEnv records the final answer
            info["answer"] = response.split("<answer>")[1].split("</answer>")[0]
            info["expected"] = expected
        if not viewer_info:
            info = {k: v for k, v in info.items() if k not in ("prompt_text", "response_tokens", "advantage")}
        steps.append(
            Step(
                prompt_ids=prompt_ids,
                response_ids=response_ids,
                logprobs=logprobs,
                reward=reward,
                terminated=last and kw.get("status", TrajectoryStatus.OK) is TrajectoryStatus.OK,
                truncated=last and kw.get("status") is TrajectoryStatus.TRUNCATED,
                response_text=response,
                policy_version=3,
                info=info,
                timings={"generate_s": round(rng.uniform(0.05, 0.3), 3)},
            )
        )
    info = {} if success is None else {"success": success}
    return Trajectory(task_id, tuple(steps), group_id=group_id, outcome_reward=outcome, info=info, **kw)


def _group(tokenizer, rng, task_number: int, train_step: int) -> list[Trajectory]:
    a, b, c = 10 + task_number, 25, 8
    s1, s2 = a + b, a + b + c
    task_id, group_id = f"add-{task_number}", f"s{train_step}-g{task_number}"
    q = f"What is {a}+{b}+{c}?"
    solved = [
        (_call(a, b), [_add(a, b)], [str(s1)], [], 0.0),
        (_call(s1, c), [_add(s1, c)], [str(s2)], [], 0.0),
        (_answer(s2), [], [], [], 0.0),
    ]
    malformed = f'<tool_call>\n{{"name": "add", "arguments": {{"a": {a}, "b": }}\n</tool_call>'
    return [
        _trajectory(
            tokenizer, rng, task_id, group_id, q, solved, outcome=1.0, success=True, expected=str(s2)
        ),
        _trajectory(
            tokenizer,
            rng,
            task_id,
            group_id,
            q,
            [(_answer(s2 - 2), [], [], [], 0.0)],
            outcome=0.0,
            success=False,
            expected=str(s2),
        ),
        _trajectory(
            tokenizer,
            rng,
            task_id,
            group_id,
            q,
            [
                (
                    malformed,
                    [],
                    [],
                    ["hermes: tool call 0 is not valid JSON: Expecting value (line 1 column 39)"],
                    -0.1,
                ),
                (_call(a, b), [_add(a, b)], [f"{s1}\n{INJECTION}"], [], 0.0),
                (_call(s1, c), [_add(s1, c)], [str(s2)], [], 0.0),
                (_answer(s2), [], [], [], 0.0),
            ],
            outcome=1.0,
            success=True,
            window=3,
        ),
        _trajectory(
            tokenizer,
            rng,
            task_id,
            group_id,
            q,
            solved[:2],
            outcome=0.0,
            success=False,
            status=TrajectoryStatus.TRUNCATED,
        ),
        _trajectory(
            tokenizer,
            rng,
            task_id,
            group_id,
            q,
            solved[:1],
            outcome=0.0,
            success=None,
            status=TrajectoryStatus.ERROR,
            viewer_info=False,
            error="Traceback (most recent call last):\n  ...\nTimeoutError: tool add timed out after 30 s",
        ),
    ]


def make_run_dir(root: Path, tokenizer, *, train_steps: int = 8, dump_every: int = 2) -> Path:
    """A run directory as docs/training.md ("The run directory") describes it, filled with realistic content."""
    rng = random.Random(0)
    run = root / "run"
    (run / "trajectories").mkdir(parents=True)
    (run / "tb").mkdir()
    (run / "config.yaml").write_text(
        "model:\n  path: tiny\nalgorithm:\n  advantage: grpo\n  kl:\n    coef: 0.001\nrollout:\n  n: 5\n  max_steps: 4\n"
    )
    t0 = 1_760_000_000.0
    evaluated_on = {"eval/tasks": 100, "eval/episodes": 400}  # 100 held-out tasks x 4 samples
    with open(run / "metrics.jsonl", "w") as f:
        # The evaluation before any update: the report's baseline.
        f.write(
            json.dumps({"step": 0, "time": t0, "eval/reward": 0.3, "eval/success": 0.37, **evaluated_on})
            + "\n"
        )
        for step in range(1, train_steps + 1):
            progress = step / train_steps
            row = {
                "step": step,
                "time": t0 + 30 * step,
                "reward/mean": 0.2 + 0.6 * progress + rng.uniform(-0.05, 0.05),
                "reward/std": 0.4 - 0.2 * progress,
                "success/mean": min(1.0, 0.1 + 0.8 * progress),
                "kl/mean": 0.002 * step,
                "entropy/mean": 1.5 - 0.5 * progress,
                "response_length/mean": 60 - 3 * step,
                "steps_per_trajectory/mean": 3.5 - 0.2 * step,
                "throughput/tokens_per_s": 9000 + 200 * rng.random(),
                "loss/policy": rng.uniform(-0.1, 0.1),
                "grad_norm": float("nan") if step == 3 else 0.5 + rng.random(),
                "lr": 1e-6,
                "clip_fraction": 0.01 * rng.random(),
                "time/step": 20.0 + step % 3,
                "time/rollout": 12.0 + 0.5 * (step % 2),
                "time/score": 0.5 + 0.01 * step,
                "time/update": 6.0 + 0.1 * step,
                "time/sync": 1.5,  # constant: folded into a note, not drawn
                "custom/buffer_size": 64 * step,
                "run_name": "demo",  # not numeric: ignored
                # async: rollout k+1 runs during the first half of update k (step 1's before it)
                "timeline/rollout_start": t0 + 10 * (step - 1),
                "timeline/rollout_end": t0 + 10 * (step - 1) + (9 if step == 1 else 4),
                "timeline/update_start": t0 + 10 * step,
                "timeline/update_end": t0 + 10 * step + 8,
            }
            if step >= 2:  # the engine's and the learner's seconds (step 1: a run from before they existed)
                row.update(
                    {
                        "time/engine_prefill": 2.0,
                        "time/engine_decode": 6.0,
                        "time/engine_idle": 12.0,
                        "time/learner_forward": 2.0,
                        "time/learner_backward": 3.0,
                        "time/optimizer": 0.5,
                    }
                )
            if step == 5:
                del row["kl/mean"]  # any key may be missing
            f.write(json.dumps(row) + "\n")
            if step % 4 == 0:
                f.write(
                    json.dumps(
                        {
                            "step": step,
                            "time": t0 + 30 * step + 5,
                            "eval/reward": 0.3 + 0.5 * progress,
                            "eval/success": 0.37 + 0.1425 * step / 4,
                            **evaluated_on,
                        }
                    )
                    + "\n"
                )
            if step % dump_every == 0:
                trajectories = [t for n in range(2) for t in _group(tokenizer, rng, n, step)]
                write_jsonl(run / "trajectories" / f"step_{step:06d}.jsonl", trajectories)
    return run


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    return make_run_dir(tmp_path_factory.mktemp("report"), tiny_tokenizer)


def _page_data(page: str) -> dict:
    match = re.search(r'<script type="application/json" id="report-data">(.*?)</script>', page, re.S)
    assert match, "the page embeds its data"
    return json.loads(match.group(1))


# ---------------------------------------------------------------- reading the run


def test_metrics_are_read_leniently_and_grouped_by_prefix(run_dir):
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert len(rows) == 8 + 3  # 8 training rows and 3 evaluation rows (step 0's the baseline)
    assert all("run_name" not in r for r in rows)
    series = metric_series(rows)
    assert [x for x, _ in series["kl/mean"]] == [1, 2, 3, 4, 6, 7, 8]  # step 5 lacks it
    assert [x for x, _ in series["grad_norm"]] == [1, 2, 4, 5, 6, 7, 8]  # NaN at step 3 is a gap
    assert series["eval/success"] == [(0, 0.37), (4, 0.5125), (8, 0.655)]
    charts = chart_groups(series)
    prefixes = [c["prefix"] for c in charts]
    assert prefixes[:3] == ["reward", "success", "eval"]
    assert prefixes[-1] == "custom"  # unknown prefixes are plotted too, after the known ones
    time_chart = next(c for c in charts if c["prefix"] == "time")
    assert {s["key"] for s in time_chart["series"]} == {
        "time/step",
        "time/rollout",
        "time/score",
        "time/update",
    }
    assert time_chart["title"] == "Time per phase (s)" and time_chart["unit"] == "s"
    assert time_chart["notes"] == ["time/sync = 1.5 at every step"]  # constant: a note, not a line
    lr_chart = next(c for c in charts if c["prefix"] == "lr")
    assert lr_chart["series"] == [] and lr_chart["notes"] == ["lr = 1.000e-06 at every step"]
    # One unit per chart: the held-out success (a fraction) and reward are drawn apart, and the
    # evaluation's size (a count, constant) is a note.
    eval_charts = {c["unit"]: c for c in charts if c["prefix"] == "eval"}
    assert set(eval_charts) == {"fraction", "reward"}
    assert [s["key"] for s in eval_charts["fraction"]["series"]] == ["eval/success"]
    assert eval_charts["fraction"]["notes"] == [
        "eval/episodes = 400 at every step",
        "eval/tasks = 100 at every step",
    ]


def test_a_chart_holds_one_unit_and_folds_repeated_series():
    series = {
        "throughput/sampled_tokens": [(1, 15000.0), (2, 16000.0)],
        "throughput/tokens_per_s": [(1, 1700.0), (2, 1800.0)],
        "eval/success": [(0, 0.4), (5, 0.6)],
        "eval/reward": [(0, 0.4), (5, 0.6)],  # the reward is the success here: drawn once
        "async/staleness_max": [(1, 0.0), (2, 0.0)],
    }
    charts = chart_groups(series)
    throughput = [c for c in charts if c["prefix"] == "throughput"]
    assert [(c["title"], [s["key"] for s in c["series"]]) for c in throughput] == [
        ("Throughput (tokens)", ["throughput/sampled_tokens"]),
        ("Throughput (tokens/s)", ["throughput/tokens_per_s"]),
    ]
    evaluation = [c for c in charts if c["prefix"] == "eval"]
    assert len(evaluation) == 1 and [s["key"] for s in evaluation[0]["series"]] == ["eval/success"]
    assert evaluation[0]["notes"] == ["eval/reward: the same values as eval/success"]
    staleness = next(c for c in charts if c["prefix"] == "async")
    assert staleness["series"] == [] and staleness["notes"] == ["async/staleness_max = 0 at every step"]
    assert metric_unit("time/update") == "s" and metric_unit("tools/calls_per_step") == "per step"
    assert metric_unit("custom/anything") == ""


def test_the_headline_names_the_baseline_and_what_was_evaluated(run_dir):
    result = headline(read_metrics(run_dir / "metrics.jsonl"))
    assert result["text"] == "held-out success 37% → 66% (+28.5 pts, 100 tasks × 4)"
    assert result["detail"] == "step 0 (before training) → step 8"
    assert (result["baseline_step"], result["final_step"]) == (0, 8)
    # Without a step-0 evaluation the first one is the baseline, and says so; no counts, no size.
    rows = [{"step": 3, "eval/reward": 0.5}, {"step": 9, "eval/reward": 0.75}]
    assert headline(rows)["text"] == "held-out reward 0.5 → 0.75 (+0.25)"
    assert headline(rows)["detail"] == "step 3 (the first evaluation) → step 9"
    assert headline([{"step": 1, "reward/mean": 0.2}]) is None
    # Episodes of two roles: the mean is over each role's trajectory, and the size says so.
    size = {"eval/tasks": 3, "eval/episodes": 6, "eval/trajectories": 12}
    rows = [{"step": 0, "eval/success": 0.5, **size}, {"step": 4, "eval/success": 0.75, **size}]
    assert headline(rows)["text"] == "held-out success 50% → 75% (+25.0 pts, 3 tasks × 2, 12 trajectories)"
    assert metric_unit("eval/trajectories") == metric_unit("eval/episodes") == "count"


def test_the_phase_timeline_is_drawn_from_its_own_metrics_not_charted(run_dir):
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert not any(c["prefix"] == "timeline" for c in chart_groups(metric_series(rows)))
    timeline = phase_timeline(rows)
    assert [r["step"] for r in timeline] == list(range(1, 9))
    assert timeline[0] == {"step": 1, "rollout": [0.0, 9.0], "update": [10.0, 18.0]}
    assert timeline[1] == {"step": 2, "rollout": [10.0, 14.0], "update": [20.0, 28.0]}
    # Updates 1-7 each overlap the next rollout for 4 of their 8 s; update 8 has none after it.
    assert overlap_fraction(timeline) == pytest.approx(7 * 4 / (8 * 8))
    sync = [
        {"step": k, "rollout": [10.0 * k, 10.0 * k + 6], "update": [10.0 * k + 6, 10.0 * k + 9]}
        for k in range(3)
    ]
    assert overlap_fraction(sync) == 0.0
    assert phase_timeline([{"step": 1, "reward/mean": 0.5}]) == [] and overlap_fraction([]) is None


def test_the_time_breakdown_stacks_the_engines_seconds_and_the_learners_step(run_dir):
    rows = read_metrics(run_dir / "metrics.jsonl")
    breakdown = time_breakdown(rows)
    assert [r["step"] for r in breakdown] == list(range(2, 9))  # step 1 logged none of the parts
    step2 = breakdown[0]
    assert step2["engine"] == [["engine_prefill", 2.0], ["engine_decode", 6.0], ["engine_idle", 12.0]]
    parts = dict(step2["learner"])
    assert list(parts) == [
        "rollout_wait",
        "learner_forward",
        "learner_backward",
        "optimizer",
        "other_learning",
        "sync",
    ]
    # time/step 22 = rollout and scoring 14.3 + update 6.2 (forward 2 + backward 3 + optimizer 0.5
    # + the rest 0.7) + sync 1.5
    assert parts["rollout_wait"] == pytest.approx(14.3) and parts["other_learning"] == pytest.approx(0.7)
    assert sum(parts.values()) == pytest.approx(step2["step_s"]) == 22.0
    # The parts are bars, not lines of the time chart.
    time_chart = next(c for c in chart_groups(metric_series(rows)) if c["prefix"] == "time")
    assert not any("engine" in s["key"] or "learner" in s["key"] for s in time_chart["series"])
    assert time_breakdown([{"step": 1, "time/step": 3.0, "time/rollout": 2.0}]) == []


def test_bad_metrics_lines_are_named_but_a_half_written_last_line_is_skipped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "reward/mean": 0.5}\n{"step": 2, "rew')
    assert read_metrics(path) == [{"step": 1, "reward/mean": 0.5}]
    path.write_text('{"step": 1}\n{"step": 2, oops}\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not valid JSON"):
        read_metrics(path)
    path.write_text('{"step": 1}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: expected a JSON object, got list"):
        read_metrics(path)
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_run(tmp_path / "nowhere")
    path.write_text('{"step": 1}\n')
    (tmp_path / "trajectories").mkdir()
    (tmp_path / "trajectories" / "step_000003.jsonl").write_text('{"type": "Trajectory", "steps": []}\n')
    with pytest.raises(
        ValueError, match=r"cannot read trajectory dump .*step_000003.jsonl, record 1: .*task_id"
    ):
        load_run(tmp_path)


def test_extension_prompt_shares_exactly_the_common_prefix():
    previous = "<s>sys</s><s>user: hi</s><s>assistant\nhello"
    prompt = "<s>sys</s><s>user: hi</s><s>assistant\nhello<|im_end|>\n<s>tool: 42</s>"
    segments = prompt_segments(previous, prompt, ContextChange.EXTENDS)
    assert segments == [["ctx", len(previous)], ["new", "<|im_end|>\n<s>tool: 42</s>"]]
    assert prompt_segments("", "abc", ContextChange.INITIAL) == [["new", "abc"]]


_PIECES = [
    "<|im_start|>system\nsys\n",
    "<|im_start|>user\nq\n",
    "<|im_start|>assistant\ncall a\n",
    "result 1\n",
]
_PIECES += ["<|im_start|>assistant\ncall b\n", "result 2\n", "summary of a\n", "[1 turn dropped]\n", "call "]


@given(st.lists(st.sampled_from(_PIECES), max_size=8), st.lists(st.sampled_from(_PIECES), max_size=8))
def test_rewritten_prompt_diff_rebuilds_both_texts(old_lines, new_lines):
    previous, prompt = "".join(old_lines), "".join(new_lines)
    segments = prompt_segments(previous, prompt, ContextChange.REWRITTEN)
    assert "".join(text for kind, text in segments if kind in ("same", "new")) == prompt
    assert "".join(text for kind, text in segments if kind in ("same", "drop")) == previous
    assert all(a[0] != b[0] for a, b in zip(segments, segments[1:], strict=False))  # neighbours are merged


def test_trajectory_views_show_context_changes_tools_tokens_and_outcomes(run_dir):
    run = load_run(run_dir, last_steps=1, per_step=0)
    assert run.dumped_steps == [2, 4, 6, 8] and run.embedded_steps == [8]
    views = run.trajectories
    assert len(views) == 10
    solved, failed, rewritten, truncated, errored = views[:5]
    assert solved["tags"] == ["success"] and failed["tags"] == ["failure"]
    assert truncated["tags"] == ["failure", "truncated"] and errored["tags"] == ["error"]
    assert "TimeoutError" in errored["error"]
    bare = errored["steps"][0]  # dumped without the viewer's Step.info keys
    assert bare["prompt"] is None and bare["tokens"] is None and bare["advantage"] is None
    assert bare["min_logprob"] < -2.5 and bare["response"].startswith("<tool_call>")
    assert [s["context"] for s in solved["steps"]] == ["initial", "extends", "extends"]
    assert [s["context"] for s in rewritten["steps"]] == ["initial", "extends", "extends", "rewritten"]
    step = rewritten["steps"][3]
    assert step["context_note"] == {"policy": "sliding_window", "dropped_turns": 2, "summarised": False}
    dropped = "".join(text for kind, text in step["prompt"] if kind == "drop")
    assert "not valid JSON" in dropped and INJECTION in dropped  # the first two turns left the context
    assert '"a": 35, "b": 8' not in dropped  # ... and the last one stayed
    assert rewritten["steps"][0]["tool_errors"][0].startswith("hermes: tool call 0 is not valid JSON")
    assert rewritten["steps"][1]["tool_calls"] == [{"name": "add", "arguments": {"a": 10, "b": 25}}]
    # An extension step stores only what is new; the earlier context is a reference into the previous step.
    kind, n = solved["steps"][1]["prompt"][0]
    first = solved["steps"][0]
    assert kind == "ctx" and n == len(first["prompt"][0][1]) + len(first["response"])
    assert "<tool_response>\n35\n</tool_response>" in solved["steps"][1]["prompt"][1][1]
    tokens = solved["steps"][0]["tokens"]
    assert "".join(t for t, _ in tokens) == solved["steps"][0]["response"] + "<|im_end|>"
    assert sum(lp < math.log(0.1) for _, lp in tokens) >= 3
    # One line per trajectory saying why it ended so; the outcome reward sits on the step that earned it.
    assert solved["reason"] == "solved: answered 43"
    assert failed["reason"] == "wrong answer: gave 41, expected 43"
    assert truncated["reason"] == "cut short: a time or context limit"
    assert errored["reason"] == "env error: TimeoutError: tool add timed out after 30 s"
    assert [s.get("outcome_reward") for s in solved["steps"]] == [None, None, 1.0]


def _ending(info: dict, *, stop=StopReason.STOP, terminated=True, truncated=False) -> Step:
    return Step((1,), (2,), (-0.5,), terminated=terminated, truncated=truncated, stop_reason=stop, info=info)


def test_the_outcome_reason_reads_what_the_env_and_the_flow_recorded():
    counts = {"tool_counts": {"calls": 0, "parse_errors": 2, "tool_errors": 0, "near_misses": 0}}
    calls = _ending(counts, terminated=False)
    cases = [
        # ToolEnv's turn limit: the last step truncated, no answer; parse errors counted over the steps.
        (
            Trajectory(
                "t",
                (
                    calls,
                    _ending(
                        {**counts, "truncated": "max_turns=4 reached", "expected": "7"},
                        terminated=False,
                        truncated=True,
                    ),
                ),
            ),
            "turn limit reached without an answer (max_turns=4), expected 7 · 4 parse errors",
        ),
        # The flow's max_steps: recorded on the trajectory.
        (
            Trajectory(
                "t",
                (_ending({}, terminated=False, truncated=True),),
                info={"truncated": "max_steps=1 reached"},
            ),
            "turn limit reached without an answer (max_steps=1)",
        ),
        # A response cut at max_tokens that ended the episode (the env answered it, no limit cut it).
        (
            Trajectory("t", (_ending({"expected": "7"}, stop=StopReason.LENGTH),)),
            "token cutoff: step 1's response hit max_tokens, expected 7",
        ),
        # The env's max_turns cut an episode whose last response also hit max_tokens: the turn limit
        # ended it, the cutoff is noted (it used to read "token cutoff").
        (
            Trajectory(
                "t",
                (
                    calls,
                    _ending(
                        {"truncated": "max_turns=2"}, stop=StopReason.LENGTH, terminated=False, truncated=True
                    ),
                ),
            ),
            "turn limit reached without an answer (max_turns=2) · step 2's response hit max_tokens"
            " · 2 parse errors",
        ),
        # The env truncated the episode with no reason recorded: its own step limit (Gymnasium's
        # TimeLimit), not a token cutoff.
        (
            Trajectory("t", (_ending({}, stop=StopReason.LENGTH, terminated=False, truncated=True),)),
            "truncated by the environment · step 1's response hit max_tokens",
        ),
        (
            Trajectory("t", (_ending({}, terminated=False, truncated=True),)),
            "truncated by the environment",
        ),
        # A game's own reason for its end (TextArena), not a bare "failed".
        (
            Trajectory(
                "t", (_ending({"success": False, "reason": "Player 1 has won!"}),), info={"success": False}
            ),
            "failed: Player 1 has won!",
        ),
        (
            Trajectory(
                "t", (_ending({"success": True, "reason": "Player 0 has won!"}),), info={"success": True}
            ),
            "solved: Player 0 has won!",
        ),
        (
            Trajectory("t", (), info={"ended_at_reset": {"reason": "Player 0 made an invalid move."}}),
            "ended before the first action: Player 0 made an invalid move.",
        ),
        # An answer naming a value (the arithmetic task's "ans") shows the value.
        (
            Trajectory(
                "t",
                (_ending({"answer": "ans", "answer_value": "2496", "expected": "2508"}),),
                info={"success": False},
            ),
            "wrong answer: gave ans = 2496, expected 2508",
        ),
        (
            Trajectory("t", (_ending({"answer": None, "expected": "3"}),)),
            "no answer found in the final response, expected 3",
        ),
        (
            Trajectory("t", (), status=TrajectoryStatus.ERROR, error="ValueError: bad seed"),
            "env error: ValueError: bad seed",
        ),
    ]
    for trajectory, reason in cases:
        assert outcome_reason(trajectory) == reason


def test_a_summary_step_shows_as_one_and_the_next_step_continues_the_episodes_context():
    from agent_r1.envs.context import SUMMARY_STEP_KEY as CONTEXT_KEY

    assert SUMMARY_STEP_KEY == CONTEXT_KEY
    summarised = {"policy": "summarize", "dropped_turns": 2, "summarised": True}
    steps = (
        Step((1, 2), (3,), (-0.1,), response_text="r0", info={"prompt_text": "A "}),
        Step(
            (1, 2, 3, 4),
            (5,),
            (-0.2,),
            response_text="r1",
            info={"prompt_text": "A r0 B ", "context": summarised},
        ),
        Step(
            (9, 9),
            (7,),
            (-0.3,),
            response_text="S",
            info={"prompt_text": "Summarise: A r0 B r1", SUMMARY_STEP_KEY: {"turns": 2}},
        ),
        Step((1, 2, 7, 8), (6,), (-0.4,), response_text="r2", info={"prompt_text": "A S C "}),
    )
    view = trajectory_view(Trajectory("t", steps), 1, 0)
    assert [s["context"] for s in view["steps"]] == ["initial", "extends", "summary", "rewritten"]
    summary, after = view["steps"][2], view["steps"][3]
    assert summary["summary"] == {"turns": 2} and summary["context_note"] is None
    assert summary["prompt"] == [["new", "Summarise: A r0 B r1"]]
    # The step after the summary is compared with the step that triggered it, and carries its note.
    assert after["context_note"] == summarised
    assert "".join(t for k, t in after["prompt"] if k != "drop") == "A S C "


def test_embedded_trajectories_are_capped_by_step_and_whole_groups(run_dir):
    run = load_run(run_dir, last_steps=2, per_step=3)
    assert run.embedded_steps == [6, 8]
    assert len(run.trajectories) == 2 * 5  # 3 rounded up to the whole first group of 5
    assert {t["group_id"] for t in run.trajectories} == {"s6-g0", "s8-g0"}
    assert len(load_run(run_dir, last_steps=0, per_step=0).trajectories) == 4 * 10


def test_group_records_are_read_as_their_members(run_dir, tmp_path):
    (tmp_path / "trajectories").mkdir()
    members = [t.with_group("") for t in _dumped(run_dir, 8)[:5]]
    write_jsonl(tmp_path / "trajectories" / "step_000001.jsonl", [TrajectoryGroup("g7", "add-0", members)])
    views = load_run(tmp_path).trajectories
    assert [v["group_id"] for v in views] == ["g7"] * 5
    assert [v["task_id"] for v in views] == [t.task_id for t in members]


def _dumped(run_dir: Path, step: int) -> list[Trajectory]:
    return list(read_jsonl(run_dir / "trajectories" / f"step_{step:06d}.jsonl"))


# ---------------------------------------------------------------- the page


def test_report_page_is_self_contained_and_its_data_cannot_break_out(run_dir, tmp_path):
    out = write_report(run_dir, tmp_path / "report.html")
    page = out.read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page), "no network resources"
    assert "<link" not in page
    assert page.count("</script>") == 2 and INJECTION not in page  # the tool output is escaped
    data = _page_data(page)
    outputs = [r for t in data["trajectories"] for s in t["steps"] for r in s["tool_results"]]
    assert any(INJECTION in r for r in outputs)  # ... and still arrives intact
    assert data["embedded_steps"] == [2, 4, 6, 8]
    assert "<th>eval/success</th>" in page and "<td>0.655</td>" in page
    assert "held-out success 37% → 66% (+28.5 pts, 100 tasks × 4)" in page  # the headline card
    assert "advantage: grpo" in page  # the resolved config
    assert 'class="card-key">reward/mean' in page  # a summary card
    assert len(page) < 2_000_000
    assert embed_json({"s": "\u2028<&>"}) == '{"s":"\\u2028\\u003c\\u0026\\u003e"}'


def test_empty_run_dir_still_renders(tmp_path):
    page = render_html(load_run(tmp_path))
    data = _page_data(page)
    assert data["charts"] == [] and data["trajectories"] == []
    assert "No config.yaml" in page and "No evaluation rows" in page


def _cli(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "agent_r1.cli", *args], capture_output=True, text=True, timeout=120, **kw
    )


def test_report_command_writes_the_page_and_names_bad_input(run_dir, tmp_path):
    out = tmp_path / "r.html"
    done = _cli("report", str(run_dir), "-o", str(out), "--last-steps", "1")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(out)
    assert _page_data(out.read_text())["embedded_steps"] == [8]
    done = _cli("report", str(tmp_path / "missing"))
    assert done.returncode == 1 and "missing" in done.stderr and "does not exist" in done.stderr
    done = _cli("view", str(run_dir), "--per-step", "-1")
    assert done.returncode == 1 and "per_step must be >= 0" in done.stderr


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""


def test_view_command_serves_fresh_data_on_every_reload(run_dir, tmp_path):
    run = tmp_path / "live"
    shutil.copytree(run_dir, run)
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent_r1.cli", "view", str(run), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        url = re.search(r"http://127\.0\.0\.1:\d+/", line).group(0)
        status, page = _get(url)
        assert status == 200
        steps = [x for x, _ in _page_data(page)["charts"][0]["series"][0]["points"]]
        assert max(steps) == 8
        with open(run / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": 9, "reward/mean": 0.9}) + "\n")
        status, page = _get(url)
        assert max(x for x, _ in _page_data(page)["charts"][0]["series"][0]["points"]) == 9
        assert _get(url + "elsewhere")[0] == 404
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# ---------------------------------------------------------------- in a real browser

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def _playwright():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed: run `bash scripts/install_browser.sh`")
    if not os.path.exists(CHROMIUM):
        pytest.skip("Debian's chromium is not installed: run `bash scripts/install_browser.sh`")
    return sync_playwright


def _save_screenshot(page, tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    page.screenshot(path=str(path), full_page=True)
    if os.environ.get("AGENT_R1_SCREENSHOT_DIR"):
        target = Path(os.environ["AGENT_R1_SCREENSHOT_DIR"])
        target.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, target / name)
    return path


@pytest.mark.browser
def test_report_in_headless_chromium(run_dir, tmp_path):
    sync_playwright = _playwright()
    report = write_report(run_dir, tmp_path / "report.html", last_steps=2)
    problems: list[str] = []
    requests: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.on(
                "console",
                lambda m: (
                    problems.append(f"console {m.type}: {m.text}") if m.type in ("error", "warning") else None
                ),
            )
            page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
            page.on("request", lambda r: requests.append(r.url))
            page.goto(report.as_uri())
            page.wait_for_selector(".chart svg path.series")

            # The headline: held-out success before -> after, step 0 named as the baseline.
            card = page.locator(".card.headline").inner_text()
            assert "held-out success 37% → 66% (+28.5 pts, 100 tasks × 4)" in card
            assert "step 0 (before training) → step 8" in card

            # The plots render: one chart per metric prefix and unit, every line has points and a
            # visible size; constant series (lr, time/sync, the evaluation's size) are a note instead.
            charts = page.locator(".chart")
            assert charts.count() == 14
            lines = page.locator("path.series")
            assert lines.count() == 18
            constant = page.locator("#constant-notes").inner_text()
            assert "lr = 1.000e-06 at every step" in constant
            assert (
                "time/sync = 1.5 at every step"
                in page.locator('.chart[data-prefix="time"] .chart-notes').inner_text()
            )
            assert page.locator('.chart[data-prefix="time"] h3').inner_text() == "Time per phase (s)"
            ticks = page.locator('.chart[data-prefix="reward"] .x-tick').all_text_contents()
            assert ticks and all(t.isdigit() for t in ticks), ticks  # whole training steps only
            y_ticks = [
                float(t) for t in page.locator('.chart[data-prefix="reward"] .y-tick').all_text_contents()
            ]
            reward = [
                v for r in read_metrics(run_dir / "metrics.jsonl") if (v := r.get("reward/mean")) is not None
            ]
            assert y_ticks[0] <= min(reward) and y_ticks[-1] >= max(reward)  # the axis spans the data
            for i in range(lines.count()):
                box = lines.nth(i).bounding_box()
                assert box and box["width"] > 50, lines.nth(i).get_attribute("data-key")
            reward_chart = page.locator('.chart[data-prefix="reward"] svg')
            reward_chart.hover()
            assert "step" in page.locator('.chart[data-prefix="reward"] .tooltip').inner_text()
            assert page.locator(".eval-table tbody tr").count() == 3  # step 0 (the baseline), 4 and 8
            assert page.locator("#timeline svg rect").count() == 16  # a rollout and an update per step
            assert page.locator("#timeline .bar-step").all_text_contents()[:2] == [
                "1",
                "2",
            ]  # bars name their step
            boxes = [
                page.locator("#timeline .tick").nth(i).bounding_box()
                for i in range(page.locator("#timeline .tick").count())
            ]
            assert all(
                a["x"] + a["width"] < b["x"] for a, b in zip(boxes, boxes[1:], strict=False)
            )  # no overlap
            assert "overlapped a rollout 44% of its time" in page.locator("#timeline-section").inner_text()
            # Beside it, where each step's seconds went: an engine bar (3 parts) and a learner bar (6)
            # for steps 2-8, each learner bar as tall as its time/step.
            segments = page.locator("#breakdown rect.seg")
            assert segments.count() == 7 * 9
            assert "the engine was busy 40% of its time" in page.locator("#timeline-section").inner_text()
            step_rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("time/step") is not None]
            heights = {}
            for i in range(segments.count()):
                seg = segments.nth(i)
                key = (seg.get_attribute("data-step"), seg.get_attribute("x"))
                heights[key] = heights.get(key, 0.0) + seg.bounding_box()["height"]
            assert len(heights) == 2 * 7  # two bars per step
            by_step = {str(r["step"]): r["time/step"] for r in step_rows}
            # the learner's bar: the taller of the two (time/step 22 s, 20 s; the engine's 20 s)
            tallest = {step: max(h for (at, _), h in heights.items() if at == step) for step in ("2", "3")}
            assert tallest["2"] / tallest["3"] == pytest.approx(by_step["2"] / by_step["3"], rel=0.02)
            assert "weight sync" in page.locator("#breakdown .legend").inner_text()

            # Clicking a trajectory shows its steps, with tool calls and low-probability tokens.
            items = page.locator(".traj-item")
            assert items.count() == 20
            assert page.locator(".step").count() == 0
            # Each row names its trajectory (the task id repeats per sample) and why it ended.
            assert "#6:1" in items.nth(1).inner_text() and "sample 2 of 5" in items.nth(1).inner_text()
            assert items.nth(1).locator(".reason").inner_text() == "wrong answer: gave 41, expected 43"
            items.first.click()
            assert page.locator("#detail .step").count() == 3
            assert page.locator("#detail .traj-head .reason").inner_text() == "solved: answered 43"
            assert (
                page.locator("#detail .step").nth(2).locator(".outcome-reward").inner_text()
                == "outcome reward 1"
            )
            assert page.locator("#detail .step").nth(0).locator(".outcome-reward").count() == 0
            assert page.locator("#detail .tool-call .name").first.inner_text() == "add"
            assert page.locator("#detail .seg-new").count() == 2  # what each later step added
            low = page.locator("#detail .tok.low").count()
            assert low >= 9
            page.fill("#threshold", "0.001")
            page.dispatch_event("#threshold", "change")
            assert page.locator("#detail .tok.low").count() < low

            # A trajectory dumped without the viewer's extra keys still shows what it has.
            page.locator(".traj-item").nth(4).click()
            assert "TimeoutError" in page.locator("#detail .traj-head .error-text").inner_text()
            assert page.locator("#detail", has_text="prompt text not dumped").count() == 1
            assert page.locator("#detail", has_text="per-token text not dumped").count() == 1

            # Filter by outcome.
            page.select_option("#filter-outcome", "failure")
            assert page.locator(".traj-item").count() == 8
            assert page.locator(".traj-item .badge.failure").count() == 8
            page.select_option("#filter-outcome", "all")

            # The rewritten context: a banner and the dropped text; the injected tool output is inert text.
            page.locator(".traj-item").nth(2).click()
            assert page.locator("#detail .step").count() == 4
            banner = page.locator("#detail .rewritten").inner_text()
            assert 'policy "sliding_window"' in banner and "reports 2 turns dropped" in banner
            assert "not valid JSON" in "".join(page.locator("#detail .seg-drop").all_inner_texts())
            assert page.locator("#detail .tool-out", has_text="window.__pwned").count() == 1
            assert page.evaluate("window.__pwned") is None
            page.fill("#threshold", "0.1")
            page.dispatch_event("#threshold", "change")
            shot = _save_screenshot(page, tmp_path, "report_trajectory.png")

            # Compare the members of a group side by side.
            page.click(".compare-btn")
            assert page.locator(".compare .member").count() == 5
            _save_screenshot(page, tmp_path, "report_group_compare.png")
            page.locator(".compare .member-head").nth(1).click()
            assert page.locator("#detail .step").count() == 1
        finally:
            browser.close()
    assert problems == []
    assert requests == [report.as_uri()], "the page fetched nothing but itself"
    assert shot.stat().st_size > 10_000


def test_a_finished_run_whose_report_cannot_be_written_logs_it_and_keeps_the_run(tmp_path, caplog):
    from agent_r1.report.html import write_finished_report

    missing = tmp_path / "not_a_run"  # no metrics.jsonl, no config: load_run raises
    with caplog.at_level("WARNING", logger="agent_r1.report.html"):
        assert write_finished_report(missing) is None
    assert f"could not write {missing}/report.html" in caplog.text


@pytest.mark.browser
def test_the_roles_of_one_episode_side_by_side_in_chromium(tmp_path, tiny_tokenizer):
    """Several roles (issue 50): each trajectory names its role, and the seats of one game open side by
    side from either of them."""
    from agent_r1.report.annotate import annotate
    from agent_r1.train.run_dir import RunDir  # noqa: F401 - the dump format is RunDir's
    from agent_r1.types import Step, Trajectory, TrajectoryGroup, write_jsonl

    sync_playwright = _playwright()
    run = tmp_path / "run"
    (run / "trajectories").mkdir(parents=True)
    (run / "config.yaml").write_text("model:\n  path: tiny\n")
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "time": 1.0, "reward/mean": 0.0}) + "\n")
    ids = tiny_tokenizer.encode("X wins", add_special_tokens=False)

    def seat(role: str, reward: float, game: str) -> Trajectory:
        step = Step(tuple(ids), tuple(ids), (-0.1,) * len(ids))
        return Trajectory(
            "ttt/s0",
            (step,),
            group_id=f"0:ttt@{role}",
            outcome_reward=reward,
            role=role,
            info={"episode": game},
        )

    groups = [
        TrajectoryGroup(
            "0:ttt@player_0",
            "ttt/s0",
            (seat("player_0", 1.0, "g/0"), seat("player_0", -1.0, "g/1")),
            role="player_0",
        ),
        TrajectoryGroup(
            "0:ttt@player_1",
            "ttt/s0",
            (seat("player_1", -1.0, "g/0"), seat("player_1", 1.0, "g/1")),
            role="player_1",
        ),
    ]
    write_jsonl(
        run / "trajectories" / "step_000001.jsonl",
        annotate(groups, tiny_tokenizer, lambda t: t.outcome_reward > 0),
    )
    report = write_report(run, tmp_path / "report.html")
    problems: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
            page.goto(report.as_uri())
            page.wait_for_selector(".traj-item")
            assert "role player_0" in page.locator(".traj-item").first.inner_text()
            page.locator(".traj-item").first.click()
            assert "role player_0" in page.locator(".traj-head h3").inner_text()
            page.click(".episode-btn")
            heads = page.locator(".compare .member-head").all_inner_texts()
            assert len(heads) == 2 and "role player_0" in heads[0] and "role player_1" in heads[1]
            assert "Episode g/0" in page.locator(".traj-head h3").inner_text()
        finally:
            browser.close()
    assert not problems, problems
