"""Read a run directory (the layout in ``agent_r1.train.run_dir`` and docs/training.md) into plain,
JSON-ready data for the report page.

Everything is lenient about *content*: any metric key may be missing, unknown keys are kept, a
trajectory dump without the viewer's extra ``Step.info`` fields ("prompt_text", "response_tokens",
"advantage") still shows what it has. It is strict about *form*: a metrics line that is not a JSON
object, or an unreadable trajectory file, raises an error naming the file and line. The one exception
is the last line of ``metrics.jsonl``, which a running trainer may be writing right now: a truncated
last line is skipped.
"""

from __future__ import annotations

import difflib
import json
import math
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from agent_r1.types import Step, StopReason, Trajectory, TrajectoryGroup, TrajectoryStatus, read_jsonl

__all__ = [
    "ContextChange",
    "RunData",
    "load_run",
    "metric_series",
    "outcome_reason",
    "prompt_segments",
    "read_metrics",
    "trajectory_files",
    "trajectory_view",
]

_STEP_FILE = re.compile(r"step_(\d+)\.jsonl$")
_MAX_INFO_CHARS = 2000  # a Trajectory.info value longer than this (as JSON) is shown shortened


class ContextChange(str, Enum):
    """How a step's prompt relates to the previous step's prompt + response (the env chooses
    the context: docs/environments.md, "Context policies")."""

    INITIAL = "initial"  # the first step of the trajectory
    EXTENDS = "extends"  # the prompt starts with the previous prompt + response (the "append" case)
    REWRITTEN = "rewritten"  # the context policy dropped, summarised or rewrote something
    SUMMARY = "summary"  # a summary step: its prompt is the summarisation request, not the episode's


SUMMARY_STEP_KEY = "summary"
"""The Step.info key of a summary step (``agent_r1.envs.context.SUMMARY_STEP_KEY``)."""


@dataclass(frozen=True)
class RunData:
    """What the report shows about one run."""

    run_dir: Path
    config_text: str | None  # config.yaml as written (the resolved config), or None when absent
    metrics: list[dict[str, Any]]  # metrics.jsonl rows, non-numeric values dropped, NaN/inf -> None
    trajectories: list[dict[str, Any]]  # trajectory_view() records of the embedded dumps
    dumped_steps: list[int]  # every training step that has a trajectory dump
    embedded_steps: list[int]  # the ones whose trajectories are embedded (see load_run's caps)


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _jsonable(x: Any) -> Any:
    """``x`` with every non-finite float replaced by None (JSON has no NaN; browsers reject it)."""
    if isinstance(x, float):
        return _finite_or_none(x)
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    return x


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The rows of ``metrics.jsonl``, keeping only numeric values (bools count as 0/1).

    A missing file gives no rows. A line that is not a JSON object raises ValueError naming the file
    and line, except a truncated last line (a trainer may be writing it), which is skipped.
    """
    path = Path(path)
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    rows: list[dict[str, Any]] = []
    for line_no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if line_no == len(lines):
                break
            raise ValueError(f"{path}:{line_no}: not valid JSON ({e.msg}): {line[:80]!r}") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{line_no}: expected a JSON object, got {type(record).__name__}")
        row: dict[str, Any] = {}
        for key, value in record.items():
            if isinstance(value, bool):
                row[key] = float(value)
            elif isinstance(value, int | float):
                row[key] = _finite_or_none(float(value)) if isinstance(value, float) else value
        rows.append(row)
    return rows


def metric_series(rows: Sequence[dict[str, Any]]) -> dict[str, list[tuple[float, float]]]:
    """``{key: [(step, value), ...]}`` for every metric key; x is ``row["step"]`` (else the row index).
    ``step`` and ``time`` are axes, not metrics; missing and non-finite values leave gaps."""
    series: dict[str, list[tuple[float, float]]] = {}
    for index, row in enumerate(rows):
        x = row.get("step", index)
        if x is None:
            continue
        for key, value in row.items():
            if key in ("step", "time") or value is None:
                continue
            series.setdefault(key, []).append((x, value))
    return series


def trajectory_files(run_dir: str | Path) -> dict[int, Path]:
    """``{training step: path}`` of ``trajectories/step_*.jsonl``, in step order."""
    folder = Path(run_dir) / "trajectories"
    if not folder.is_dir():
        return {}
    found = {}
    for path in folder.iterdir():
        match = _STEP_FILE.search(path.name)
        if match:
            found[int(match.group(1))] = path
    return dict(sorted(found.items()))


def prompt_segments(previous_context: str, prompt: str, change: ContextChange) -> list[list[Any]]:
    """The prompt of one step as segments ``[kind, payload]`` relative to ``previous_context`` (the
    previous step's prompt text + response text).

    - ``["ctx", n]``: the first ``n`` characters of ``previous_context``, unchanged (EXTENDS; the page
      rebuilds the text from the previous step, so the dump stays O(steps), not O(steps^2));
    - ``["same", text]``, ``["new", text]``, ``["drop", text]``: a diff for REWRITTEN steps (see
      ``_TurnDiff``) — what was kept, what the environment added, and what the context policy dropped
      or replaced;
    - INITIAL: one ``["new", prompt]`` segment.
    """
    if change is ContextChange.INITIAL:
        return [["new", prompt]]
    if change is ContextChange.EXTENDS:
        # Token-level extension; the decoded texts may still differ at the seam (e.g. the response text
        # was decoded without its end-of-turn token), so share exactly the common character prefix.
        n = 0
        limit = min(len(previous_context), len(prompt))
        while n < limit and previous_context[n] == prompt[n]:
            n += 1
        return [["ctx", n], ["new", prompt[n:]]]
    return _TurnDiff().run(previous_context, prompt)


class _TurnDiff:
    """A two-level diff that reads the way a context policy works: first whole chat turns are matched
    (split before each turn marker such as ``<|im_start|>``; lines when the text has none), so that a
    dropped turn shows as dropped rather than as scattered line edits; then each kept-but-changed turn
    is paired with its most similar old turn and diffed word by word."""

    def __init__(self) -> None:
        self.segments: list[list[Any]] = []

    def add(self, kind: str, parts: Sequence[str]) -> None:
        text = "".join(parts)
        if not text:
            return
        if self.segments and self.segments[-1][0] == kind:
            self.segments[-1][1] += text
        else:
            self.segments.append([kind, text])

    def run(self, old: str, new: str) -> list[list[Any]]:
        old_turns, new_turns = _split_turns(old), _split_turns(new)
        matcher = difflib.SequenceMatcher(a=old_turns, b=new_turns, autojunk=False)
        for tag, i1, i2, j1, j2 in matcher.get_opcodes():
            if tag == "equal":
                self.add("same", new_turns[j1:j2])
            else:
                self.pair_up(old_turns[i1:i2], new_turns[j1:j2])
        return self.segments

    def pair_up(self, old_turns: list[str], new_turns: list[str]) -> None:
        i = 0
        for turn in new_turns:
            scores = [_similarity(candidate, turn) for candidate in old_turns[i:]]
            best = max(range(len(scores)), key=scores.__getitem__, default=None)
            if best is None or scores[best] < _PAIR_SIMILARITY:
                self.add("new", [turn])
                continue
            self.add("drop", old_turns[i : i + best])
            self.words(old_turns[i + best], turn)
            i += best + 1
        self.add("drop", old_turns[i:])

    def words(self, old: str, new: str) -> None:
        old_words, new_words = _WORD.findall(old), _WORD.findall(new)
        matcher = difflib.SequenceMatcher(a=old_words, b=new_words, autojunk=False)
        for tag, i1, i2, j1, j2 in matcher.get_opcodes():
            if tag == "equal":
                self.add("same", new_words[j1:j2])
            else:
                self.add("drop", old_words[i1:i2])
                self.add("new", new_words[j1:j2])


_TURN_START = re.compile(r"(?=<\|im_start\|>|<\|start_header_id\|>|<start_of_turn>|\[INST\])")
_WORD = re.compile(r"\w+|\s+|[^\w\s]")
_PAIR_SIMILARITY = (
    0.6  # a new turn at least this similar (difflib ratio over words) to an old one is "changed"
)


def _split_turns(text: str) -> list[str]:
    turns = [t for t in _TURN_START.split(text) if t]
    return turns if len(turns) > 1 else text.splitlines(keepends=True)


def _similarity(a: str, b: str) -> float:
    if a and b.startswith(a):
        # The last turn of the previous context is the response, which usually lacks the end-of-turn
        # marker that the new prompt renders after it: that is the same turn, not a look-alike.
        return 1.0
    return difflib.SequenceMatcher(a=_WORD.findall(a), b=_WORD.findall(b), autojunk=False).ratio()


def _context_change(previous: Step | None, step: Step) -> ContextChange:
    if previous is None:
        return ContextChange.INITIAL
    context = previous.prompt_ids + previous.response_ids
    if step.prompt_ids[: len(context)] == context:
        return ContextChange.EXTENDS
    return ContextChange.REWRITTEN


def _outcome_tags(trajectory: Trajectory) -> tuple[bool | None, list[str]]:
    success = trajectory.info.get("success")
    success = bool(success) if isinstance(success, bool | int | float) else None
    tags = [] if success is None else ["success" if success else "failure"]
    if trajectory.status is not TrajectoryStatus.OK:
        tags.append(trajectory.status.value)
    return success, tags


def _one_line(text: str, limit: int = 160) -> str:
    """A message's line to show: for a traceback its exception line (the last unindented one)."""
    lines = [line for line in text.strip().splitlines() if line.strip() and not line[0].isspace()]
    line = lines[-1] if lines else ""
    return line if len(line) <= limit else line[: limit - 1] + "…"


def outcome_reason(trajectory: Trajectory) -> str:
    """One line saying why the episode ended as it did, for the viewer's list and header.

    Read from what the flow and the environment recorded: the trajectory's status and error, the
    flow's ``info["truncated"]`` (``max_steps``) and ``info["ended_at_reset"]`` (an episode over
    before the first action), the last step's stop reason, ``truncated`` flag and ``info`` (ToolEnv's
    ``answer`` / ``expected`` / ``truncated`` and per-step ``tool_counts``; ``answer_value`` where the
    answer names a value, as the arithmetic task's ``ans`` does; an env's own ``reason`` for the end,
    as TextArena's games give). Order: an env or engine error, a cut-short episode, an episode over
    before the first action, success, a turn limit (the env's ``max_turns`` or the flow's
    ``max_steps``: a ``truncated`` reason recorded), a truncation the env made without one (its own
    step limit), a wrong answer, a token cutoff (the last response hit ``max_tokens`` and no limit
    cut the episode), a missing answer, then the env's reason. A last response that hit
    ``max_tokens`` is noted after a turn limit, a truncation or a wrong answer too; parse errors are
    appended whenever there were any.
    """
    steps = trajectory.steps
    last = steps[-1].info if steps else {}
    parse_errors = sum(
        int(s.info["tool_counts"].get("parse_errors", 0))
        for s in steps
        if isinstance(s.info.get("tool_counts"), dict)
    )
    expected = last.get("expected")
    given = last.get("answer")
    if given is not None and last.get("answer_value") not in (None, given):
        given = f"{given} = {last['answer_value']}"  # e.g. the arithmetic task's "ans" resolved
    expect = f", expected {expected}" if expected is not None else ""
    at_reset = trajectory.info.get("ended_at_reset")
    env_reason = (at_reset if isinstance(at_reset, dict) else last).get("reason")
    because = f": {_one_line(str(env_reason))}" if env_reason else ""
    limit = trajectory.info.get("truncated") or last.get("truncated")
    cutoff = (
        f"step {len(steps)}'s response hit max_tokens"
        if steps and steps[-1].stop_reason is StopReason.LENGTH
        else None
    )
    also_cut = f" · {cutoff}" if cutoff else ""
    if trajectory.status is TrajectoryStatus.ERROR:
        reason = f"env error: {_one_line(trajectory.error or 'no error text recorded')}"
    elif trajectory.status is TrajectoryStatus.TRUNCATED:
        why = limit or "a time or context limit"
        reason = f"cut short: {_one_line(str(why))}"
    elif isinstance(at_reset, dict):
        reason = f"ended before the first action{because}"
    elif trajectory.info.get("success") is True:
        reason = "solved" + (f": answered {given}" if given is not None else because)
    elif limit:
        shown = _one_line(str(limit)).removesuffix(" reached")
        reason = f"turn limit reached without an answer ({shown}){expect}{also_cut}"
    elif steps and steps[-1].truncated:
        reason = f"truncated by the environment{because}{expect}{also_cut}"
    elif steps and steps[-1].terminated and given is not None:
        reason = f"wrong answer: gave {given}{expect}{also_cut}"
    elif cutoff:
        reason = f"token cutoff: {cutoff}{expect}" + (
            f" · {_one_line(str(env_reason))}" if env_reason else ""
        )
    elif steps and steps[-1].terminated and "answer" in last:
        reason = f"no answer found in the final response{expect}"
    elif not steps:
        reason = "no steps"
    else:
        reason = ("failed" if trajectory.info.get("success") is False else "ended") + because
    if parse_errors:
        reason += f" · {parse_errors} parse error{'s' if parse_errors > 1 else ''}"
    return reason


def _short_info(info: dict[str, Any]) -> dict[str, Any]:
    shown = {}
    for key, value in info.items():
        text = json.dumps(_jsonable(value), ensure_ascii=False)
        shown[key] = (
            _jsonable(value)
            if len(text) <= _MAX_INFO_CHARS
            else f"{text[:_MAX_INFO_CHARS]}… ({len(text)} chars)"
        )
    return shown


def _step_view(index: int, step: Step, previous: Step | None) -> dict[str, Any]:
    info = step.info
    summary = info.get(SUMMARY_STEP_KEY) if isinstance(info.get(SUMMARY_STEP_KEY), dict) else None
    change = ContextChange.SUMMARY if summary is not None else _context_change(previous, step)
    prompt_text = info.get("prompt_text")
    previous_text = None
    if previous is not None and isinstance(previous.info.get("prompt_text"), str):
        previous_text = previous.info["prompt_text"] + previous.response_text
    segments = None
    if isinstance(prompt_text, str) and change is ContextChange.SUMMARY:
        segments = [["new", prompt_text]]
    elif isinstance(prompt_text, str) and (change is ContextChange.INITIAL or previous_text is not None):
        segments = prompt_segments(previous_text or "", prompt_text, change)
    tokens = info.get("response_tokens")
    token_view = None
    if isinstance(tokens, list) and len(tokens) == len(step.logprobs):
        token_view = [
            [str(t), round(lp, 4) if math.isfinite(lp) else None]
            for t, lp in zip(tokens, step.logprobs, strict=True)
        ]
    finite = [lp for lp in step.logprobs if math.isfinite(lp)]
    advantage = info.get("advantage")
    return {
        "index": index,
        "context": change.value,
        # An env's step info describes the transition to the NEXT prompt (ToolEnv reports how its
        # context policy built it there), so this prompt's note is on the previous step.
        "context_note": _jsonable(previous.info.get("context")) if previous and summary is None else None,
        "summary": _jsonable(summary),
        "prompt": segments,
        "prompt_tokens": len(step.prompt_ids),
        "response": step.response_text,
        "tokens": token_view,
        "response_tokens": len(step.response_ids),
        "untrained_tokens": len(step.response_mask) - sum(step.response_mask),
        "min_logprob": round(min(finite), 4) if finite else None,
        "mean_logprob": round(sum(finite) / len(finite), 4) if finite else None,
        "reward": _finite_or_none(step.reward),
        "advantage": _jsonable(advantage) if isinstance(advantage, int | float) else None,
        "stop_reason": step.stop_reason.value,
        "terminated": step.terminated,
        "truncated": step.truncated,
        "policy_version": step.policy_version,
        "tool_calls": _jsonable(info.get("tool_calls") or []),
        "tool_results": _jsonable(info.get("tool_results") or []),
        "tool_errors": _jsonable(info.get("tool_errors") or []),
        # ToolEnv's per-step counts ({"calls", "parse_errors", "tool_errors", "near_misses"}), and the
        # near-miss message, which the model read only if it is also among tool_errors ("hint" mode).
        "tool_counts": _jsonable(info["tool_counts"]) if isinstance(info.get("tool_counts"), dict) else None,
        "near_miss": info["near_miss"] if isinstance(info.get("near_miss"), str) else None,
        "timings": _jsonable(step.timings),
    }


def trajectory_view(trajectory: Trajectory, train_step: int, index: int) -> dict[str, Any]:
    """One trajectory as the viewer shows it: outcome, rewards and its steps (see ``_step_view``)."""
    success, tags = _outcome_tags(trajectory)
    steps = []
    previous = None
    for i, step in enumerate(trajectory.steps):
        steps.append(_step_view(i, step, previous))
        if SUMMARY_STEP_KEY not in step.info:  # the step after a summary continues the episode's context
            previous = step
    # An env's labels for the whole episode (Step.info["episode"], e.g. a game's name and the seat
    # played: agent_r1.envs.ecosystem.textarena) are shown with the trajectory's own info.
    episode = next(
        (s.info["episode"] for s in trajectory.steps if isinstance(s.info.get("episode"), dict)), {}
    )
    info = {**episode, **{k: v for k, v in trajectory.info.items() if k != "success"}}
    if steps:
        # The outcome reward is earned where the episode ends, so the viewer shows it on that step.
        steps[-1]["outcome_reward"] = _finite_or_none(trajectory.outcome_reward)
    return {
        "id": f"{train_step}:{index}",
        "train_step": train_step,
        "task_id": trajectory.task_id,
        "group_id": trajectory.group_id,
        "role": trajectory.role,
        "episode": trajectory.info.get("episode")
        if isinstance(trajectory.info.get("episode"), str)
        else None,
        "status": trajectory.status.value,
        "error": trajectory.error,
        "success": success,
        "tags": tags,
        "reason": outcome_reason(trajectory),
        "outcome_reward": _finite_or_none(trajectory.outcome_reward),
        "total_reward": _finite_or_none(trajectory.total_reward),
        "num_response_tokens": trajectory.num_response_tokens,
        "info": _short_info(info),
        "steps": steps,
    }


def _read_trajectories(path: Path) -> Iterator[Trajectory]:
    """The trajectories of one dump (Trajectory records, or the members of TrajectoryGroup records)."""
    records_read = 0
    try:
        for record in read_jsonl(path):
            records_read += 1
            if isinstance(record, Trajectory):
                yield record
            elif isinstance(record, TrajectoryGroup):
                yield from (t if t.group_id else t.with_group(record.group_id) for t in record.trajectories)
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(f"cannot read trajectory dump {path}, record {records_read + 1}: {e}") from e


def _first_whole_groups(trajectories: Iterable[Trajectory], limit: int) -> list[Trajectory]:
    """The first ``limit`` trajectories (0: all), rounded up to whole groups so that groups stay
    comparable; reading stops there, so a huge dump costs only what is embedded."""
    taken: list[Trajectory] = []
    for t in trajectories:
        if limit and len(taken) >= limit and (not t.group_id or t.group_id != taken[-1].group_id):
            break
        taken.append(t)
    return taken


def load_run(run_dir: str | Path, *, last_steps: int = 5, per_step: int = 32) -> RunData:
    """Read ``run_dir``. Only the trajectories of the last ``last_steps`` dumped training steps (0: all)
    are embedded, at most ``per_step`` of each step (0: all; whole groups are kept together)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory {run_dir} does not exist (or is not a directory)")
    if last_steps < 0 or per_step < 0:
        raise ValueError(f"last_steps and per_step must be >= 0 (0 = all), got {last_steps}, {per_step}")
    config_path = run_dir / "config.yaml"
    config_text = config_path.read_text(encoding="utf-8") if config_path.exists() else None
    metrics = read_metrics(run_dir / "metrics.jsonl")
    files = trajectory_files(run_dir)
    chosen = list(files)[-last_steps:] if last_steps else list(files)
    trajectories = []
    for train_step in chosen:
        loaded = _first_whole_groups(_read_trajectories(files[train_step]), per_step)
        trajectories += [trajectory_view(t, train_step, i) for i, t in enumerate(loaded)]
    return RunData(
        run_dir=run_dir,
        config_text=config_text,
        metrics=metrics,
        trajectories=trajectories,
        dumped_steps=list(files),
        embedded_steps=chosen,
    )
