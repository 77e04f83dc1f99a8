"""Render a run as one self-contained HTML page: training curves, evaluation table, trajectory viewer
and the resolved config.

Self-contained means no network: the page's script and style are inlined from ``static/`` and the
data is embedded as JSON in a ``<script type="application/json">`` element, escaped so that no string
in it (a tool output holding ``</script>``, say) can end the element early. The plots are SVG drawn
by that script; the evaluation table and config are plain HTML, readable without script.
"""

from __future__ import annotations

import html
import json
import logging
import re
import time
from importlib import resources
from pathlib import Path
from typing import Any

from agent_r1.report.run import RunData, load_run, metric_series

logger = logging.getLogger(__name__)

__all__ = [
    "CHART_ORDER",
    "chart_groups",
    "embed_json",
    "headline",
    "metric_unit",
    "overlap_fraction",
    "phase_timeline",
    "render_html",
    "time_breakdown",
    "write_finished_report",
    "write_report",
]

CHART_ORDER: dict[str, str] = {
    "reward": "Reward",
    "success": "Success rate",
    "eval": "Held-out evaluation",
    "kl": "KL to reference",
    "entropy": "Entropy",
    "response_length": "Response length",
    "steps_per_trajectory": "Steps per trajectory",
    "tools": "Tool calls, errors and near misses",
    "throughput": "Throughput",
    "time": "Time per phase",
    "loss": "Loss",
    "grad_norm": "Gradient norm",
    "lr": "Learning rate",
    "clip_fraction": "Clip fraction",
}
"""Charts come in this order, one per metric prefix (the part before the first "/") and unit; metrics
with other prefixes follow alphabetically, titled by their prefix."""

_SUMMARY_KEYS = ("reward/mean", "success/mean", "eval/reward", "eval/success", "throughput/tokens_per_s")


_NOT_CHARTED = ("timeline",)  # wall-clock moments: drawn as the phase timeline, not as curves

_PHASES = ("rollout", "update")

ENGINE_PARTS = ("engine_prefill", "engine_decode", "engine_idle")
"""``time/*`` keys of the engine's bar in the per-step breakdown (its seconds since the previous step)."""
LEARNER_PARTS = ("learner_forward", "learner_backward", "optimizer")
"""``time/*`` keys of the learner's bar; the rest of the step fills it (``time_breakdown``)."""
_LEARNING_PHASES = ("batch", "old_logprobs", "reference", "values", "advantage", "teacher", "update")
_BREAKDOWN_KEYS = frozenset(f"time/{part}" for part in ENGINE_PARTS + LEARNER_PARTS)  # bars, not curves


def metric_unit(key: str) -> str:
    """The unit of a metric, from the naming conventions of the keys agent-r1 logs ("" when unknown).
    A chart holds one unit: a prefix whose keys have several (``throughput/sampled_tokens`` is a count,
    ``throughput/tokens_per_s`` a rate) is drawn as one chart per unit."""
    prefix, _, name = key.rpartition("/")
    first = key.split("/", 1)[0]
    if first == "time":
        return "s"
    if name.endswith("_per_s"):
        return "tokens/s" if "tokens" in name else "per s"
    if name.endswith("_per_step"):
        return "per step"
    if name.endswith("_fraction") or first in ("success", "clip_fraction") or key == "eval/success":
        return "fraction"
    if first == "reward" or key == "eval/reward":
        return "reward"
    if "tokens" in name or first == "response_length":
        return "tokens"
    if first == "steps_per_trajectory":
        return "steps"
    if name.startswith("staleness"):
        return "policy versions"
    if first == "eval" and name in ("tasks", "episodes", "trajectories"):
        return "count"
    if first == "filter":
        return "groups"
    if first in ("kl", "entropy", "approx_kl"):
        return "nats"
    return ""


def _chart_title(prefix: str, unit: str) -> str:
    title = CHART_ORDER.get(prefix, prefix)
    named = re.search(rf"\b{re.escape(unit)}\b", title, re.IGNORECASE) if unit else True
    return title if named else f"{title} ({unit})"  # no "Reward (reward)"


def _preferred_first(key: str) -> tuple[bool, str]:
    """Within a chart, success before reward: when two series repeat each other, the first is drawn."""
    return ("success" not in key, key)


def _constant(points: list[tuple[float, float]]) -> bool:
    return len(points) > 1 and all(v == points[0][1] for _, v in points)


def chart_groups(series: dict[str, list[tuple[float, float]]]) -> list[dict[str, Any]]:
    """Group metric series into charts: ``[{"title", "prefix", "unit", "series": [{"key", "points"}],
    "notes"}]``, one per prefix and unit. A series that never changes (``lr`` under a constant
    schedule, a sync run's ``async/*``), or that repeats another of its prefix point for point
    (``eval/reward`` when the reward is the success), is not drawn: it becomes a line of its
    chart's ``notes``. The engine's and learner's seconds are drawn as bars (``time_breakdown``). A prefix left with nothing to draw is one chart with no series and its notes."""
    groups: dict[str, list[str]] = {}
    for key in series:
        prefix = key.split("/", 1)[0]
        if prefix not in _NOT_CHARTED and key not in _BREAKDOWN_KEYS:
            groups.setdefault(prefix, []).append(key)
    ordered = [p for p in CHART_ORDER if p in groups] + sorted(p for p in groups if p not in CHART_ORDER)
    charts = []
    for prefix in ordered:
        drawn: dict[str, list[str]] = {}
        notes: list[str] = []
        seen: dict[tuple, str] = {}
        for key in sorted(groups[prefix], key=_preferred_first):
            points = series[key]
            if _constant(points):
                notes.append(f"{key} = {_fmt(points[0][1])} at every step")
                continue
            signature = tuple(map(tuple, points))
            if signature in seen:
                notes.append(f"{key}: the same values as {seen[signature]}")
                continue
            seen[signature] = key
            drawn.setdefault(metric_unit(key), []).append(key)
        if not drawn:
            charts.append(
                {
                    "title": _chart_title(prefix, ""),
                    "prefix": prefix,
                    "unit": "",
                    "series": [],
                    "notes": notes,
                }
            )
            continue
        for i, (unit, keys) in enumerate(drawn.items()):
            charts.append(
                {
                    "title": _chart_title(prefix, unit),
                    "prefix": prefix,
                    "unit": unit,
                    "series": [{"key": k, "points": series[k]} for k in keys],
                    "notes": notes if i == 0 else [],
                }
            )
    return charts


def phase_timeline(metrics: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per training step, when its rollout and its update ran: ``[{"step", "rollout": [start, end],
    "update": [start, end]}]`` in seconds since the first logged moment (``timeline/*`` metrics,
    ``time.time()`` values, so a resumed run's steps follow the earlier ones)."""
    rows = []
    for row in metrics:
        spans = {
            phase: [row[f"timeline/{phase}_start"], row[f"timeline/{phase}_end"]]
            for phase in _PHASES
            if row.get(f"timeline/{phase}_start") is not None and row.get(f"timeline/{phase}_end") is not None
        }
        if spans and row.get("step") is not None:
            rows.append({"step": row["step"], **spans})
    if not rows:
        return []
    origin = min(row[phase][0] for row in rows for phase in _PHASES if phase in row)
    for row in rows:
        for phase in _PHASES:
            if phase in row:
                row[phase] = [row[phase][0] - origin, row[phase][1] - origin]
    return rows


def time_breakdown(metrics: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per training step, where its seconds went, as two stacks: ``[{"step", "step_s", "engine":
    [[part, s], ...], "learner": [[part, s], ...]}]``.

    The engine's stack is its prefill, decode and idle seconds since the previous step (an
    evaluation between steps included). The learner's is the step itself, ``time/step`` in all:
    waiting for the rollout (the rollout, score and filter phases: in async mode the wait for the
    rollout in flight), the update's forward, backward and optimizer seconds, the other learning
    phases (batch, old log-probs, reference, values, advantages, teacher and the update's rest), then the
    weight sync. Rows without the engine's or learner's seconds (older runs) are left out."""
    rows = []
    for row in metrics:
        if row.get("step") is None or row.get("time/step") is None:
            continue
        seconds = {
            part: row[f"time/{part}"] for part in ENGINE_PARTS + LEARNER_PARTS if f"time/{part}" in row
        }
        if not seconds:
            continue
        learning = sum(row.get(f"time/{phase}", 0.0) for phase in _LEARNING_PHASES)
        measured = [[part, seconds[part]] for part in LEARNER_PARTS if part in seconds]
        sync = row.get("time/sync", 0.0)
        learner = [
            ["rollout_wait", max(row["time/step"] - learning - sync, 0.0)],
            *measured,
            ["other_learning", max(learning - sum(s for _, s in measured), 0.0)],
            ["sync", sync],
        ]
        rows.append(
            {
                "step": row["step"],
                "step_s": row["time/step"],
                "engine": [[part, seconds[part]] for part in ENGINE_PARTS if part in seconds],
                "learner": learner,
            }
        )
    return rows


def _breakdown_section(breakdown: list[dict[str, Any]]) -> str:
    if not breakdown:
        return ""
    engine = [dict(r["engine"]) for r in breakdown if r["engine"]]
    busy = sum(e.get("engine_prefill", 0.0) + e.get("engine_decode", 0.0) for e in engine)
    total = busy + sum(e.get("engine_idle", 0.0) for e in engine)
    said = f"; over the run the engine was busy {busy / total:.0%} of its time" if total > 0 else ""
    return (
        '<h3 id="breakdown-title">Where each step\'s time goes (s)</h3>'
        f'<p class="note">Left bar of each step: the rollout engine since the previous step (prefill, '
        f"decode, idle); right bar: the step itself, as the learner spent it{html.escape(said)}.</p>"
        '<div id="breakdown" class="timeline"></div>'
    )


def overlap_fraction(timeline: list[dict[str, Any]]) -> float | None:
    """The fraction of update time during which a rollout was sampling (0 in sync mode, where they
    alternate; async mode hides sampling behind the update)."""
    rollouts = [row["rollout"] for row in timeline if "rollout" in row]
    updates = [row["update"] for row in timeline if "update" in row]
    total = sum(end - start for start, end in updates)
    if not rollouts or total <= 0:
        return None
    covered = 0.0
    for start, end in updates:
        cuts = sorted((max(a, start), min(b, end)) for a, b in rollouts if a < end and b > start)
        reach = start
        for a, b in cuts:
            covered += max(0.0, b - max(a, reach))
            reach = max(reach, b)
    return covered / total


def _timeline_section(timeline: list[dict[str, Any]]) -> str:
    if not timeline:
        return '<p class="empty">No phase timeline (<code>timeline/*</code> metrics) in metrics.jsonl.</p>'
    overlap = overlap_fraction(timeline)
    said = (
        f"the update overlapped a rollout {overlap:.0%} of its time"
        if overlap is not None
        else "no overlap measured"
    )
    return (
        f'<p class="note">When each step\'s rollout and update ran (wall clock); {html.escape(said)}.</p>'
        '<div id="timeline" class="timeline"></div>'
    )


def embed_json(data: Any) -> str:
    """JSON safe to place inside a ``<script>`` element: ``<``, ``>`` and ``&`` become unicode
    escapes (so ``</script>`` and ``<!--`` cannot appear), as do the JS line separators U+2028/9."""
    text = json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    for raw, escaped in (
        ("<", "\\u003c"),
        (">", "\\u003e"),
        ("&", "\\u0026"),
        ("\u2028", "\\u2028"),
        ("\u2029", "\\u2029"),
    ):
        text = text.replace(raw, escaped)
    return text


def _fmt(value: float | None) -> str:
    if value is None:
        return "–"
    if isinstance(value, int) or float(value).is_integer() and abs(value) < 1e9:
        return str(int(value))
    if value != 0 and not 1e-3 <= abs(value) < 1e5:
        return f"{value:.3e}"
    return f"{value:.4g}"


def _eval_table(metrics: list[dict[str, Any]]) -> str:
    rows = [r for r in metrics if any(k.startswith("eval/") for k in r)]
    if not rows:
        return '<p class="empty">No evaluation rows (keys starting with <code>eval/</code>) in metrics.jsonl.</p>'
    keys = sorted({k for r in rows for k in r if k.startswith("eval/")})
    head = "".join(f"<th>{html.escape(k)}</th>" for k in ["step", *keys])
    body = "".join(
        "<tr>" + "".join(f"<td>{_fmt(r.get(k))}</td>" for k in ["step", *keys]) + "</tr>" for r in rows
    )
    return f'<table class="eval-table"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def headline(metrics: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The run's result in one line: held-out success (else reward) at the first evaluation, the
    baseline (step 0 is the model before any update), against the last one.

    ``{"metric", "baseline_step", "final_step", "before", "after", "text", "detail"}``, e.g. text
    "held-out success 37% → 66% (+28.5 pts, 100 tasks × 4)" (tasks × episodes per task; with several
    roles also the trajectories the mean is over: "3 tasks × 2, 12 trajectories"); None without
    evaluation rows."""
    evaluated = {
        k: [r for r in metrics if r.get(k) is not None and r.get("step") is not None]
        for k in ("eval/success", "eval/reward")
    }
    key = next((k for k, rows in evaluated.items() if rows), None)
    if key is None:
        return None
    rows, name = evaluated[key], key.removeprefix("eval/")
    first, last = rows[0], rows[-1]
    before, after = first[key], last[key]
    baseline = "before training" if first["step"] == 0 else "the first evaluation"
    tasks, episodes = last.get("eval/tasks"), last.get("eval/episodes")
    size = ""
    if tasks and episodes:
        per_task = episodes / tasks
        size = (
            f"{_fmt(tasks)} tasks × {_fmt(per_task)}"
            if per_task.is_integer()
            else f"{_fmt(episodes)} episodes"
        )
        trajectories = last.get("eval/trajectories")
        if trajectories and trajectories > episodes:  # episodes of several roles: one trajectory each
            size += f", {_fmt(trajectories)} trajectories"

    def shown(v: float) -> str:
        return f"{100 * v:.0f}%" if name == "success" else _fmt(v)

    if last is first:
        text = f"held-out {name} {shown(before)}" + (f" ({size})" if size else "")
        detail = f"step {_fmt(first['step'])} ({baseline}); no later evaluation yet"
    else:
        change = f"{100 * (after - before):+.1f} pts" if name == "success" else f"{after - before:+.3g}"
        text = f"held-out {name} {shown(before)} → {shown(after)} ({change}" + (f", {size})" if size else ")")
        detail = f"step {_fmt(first['step'])} ({baseline}) → step {_fmt(last['step'])}"
    return {
        "metric": key,
        "baseline_step": first["step"],
        "final_step": last["step"],
        "before": before,
        "after": after,
        "text": text,
        "detail": detail,
    }


def _headline_card(metrics: list[dict[str, Any]]) -> str:
    result = headline(metrics)
    if result is None:
        return ""
    return (
        f'<div class="card headline"><div class="card-key">result</div>'
        f'<div class="card-value">{html.escape(result["text"])}</div>'
        f'<div class="card-step">{html.escape(result["detail"])}</div></div>'
    )


def _summary(metrics: list[dict[str, Any]]) -> str:
    cards = []
    for key in _SUMMARY_KEYS:
        last = next((r for r in reversed(metrics) if r.get(key) is not None), None)
        if last is not None:
            cards.append(
                f'<div class="card"><div class="card-key">{html.escape(key)}</div>'
                f'<div class="card-value">{_fmt(last[key])}</div>'
                f'<div class="card-step">step {_fmt(last.get("step"))}</div></div>'
            )
    steps = [r["step"] for r in metrics if r.get("step") is not None]
    if steps:
        cards.insert(
            0,
            f'<div class="card"><div class="card-key">steps logged</div><div class="card-value">{_fmt(max(steps))}</div></div>',
        )
    return "".join(cards)


def _static(name: str) -> str:
    return resources.files("agent_r1.report").joinpath("static", name).read_text(encoding="utf-8")


def render_html(run: RunData, *, title: str | None = None) -> str:
    """The whole page for ``run``, as one string."""
    title = title or f"agent-r1 run: {run.run_dir.resolve().name}"
    timeline = phase_timeline(run.metrics)
    breakdown = time_breakdown(run.metrics)
    data = {
        "charts": chart_groups(metric_series(run.metrics)),
        "timeline": timeline,
        "breakdown": breakdown,
        "trajectories": run.trajectories,
        "dumped_steps": run.dumped_steps,
        "embedded_steps": run.embedded_steps,
    }
    config = (
        f'<pre class="config">{html.escape(run.config_text)}</pre>'
        if run.config_text is not None
        else '<p class="empty">No config.yaml in the run directory.</p>'
    )
    generated = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{html.escape(title)}</title>
<style>
{_static("report.css")}
</style>
</head>
<body>
<header>
  <h1>{html.escape(title)}</h1>
  <div class="meta">{html.escape(str(run.run_dir.resolve()))} · generated {html.escape(generated)}</div>
  <nav><a href="#curves">Training curves</a><a href="#timeline-section">Timeline</a><a href="#evaluation">Evaluation</a><a href="#trajectories">Trajectories</a><a href="#config">Config</a></nav>
</header>
<main>
<section class="summary">{_headline_card(run.metrics)}{_summary(run.metrics)}</section>
<section id="curves"><h2>Training curves</h2><div id="charts" class="charts"></div></section>
<section id="timeline-section"><h2>Rollout and update timeline</h2>{_timeline_section(timeline)}{_breakdown_section(breakdown)}</section>
<section id="evaluation"><h2>Evaluation</h2>{_eval_table(run.metrics)}</section>
<section id="trajectories"><h2>Trajectories</h2><div id="viewer"></div></section>
<section id="config"><h2>Resolved config</h2>{config}</section>
</main>
<script type="application/json" id="report-data">{embed_json(data)}</script>
<script>
{_static("report.js")}
</script>
</body>
</html>
"""


def write_report(
    run_dir: str | Path, out: str | Path | None = None, *, last_steps: int = 5, per_step: int = 32
) -> Path:
    """Write the report of ``run_dir`` to ``out`` (default ``RUN_DIR/report.html``) and return its path.
    ``last_steps`` / ``per_step`` cap the embedded trajectories (see ``load_run``)."""
    run = load_run(run_dir, last_steps=last_steps, per_step=per_step)
    out = Path(out) if out is not None else run.run_dir / "report.html"
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(render_html(run), encoding="utf-8")
    tmp.replace(out)
    return out


def write_finished_report(run_dir: str | Path) -> Path | None:
    """``write_report`` at the end of a training run: the run is complete on disk by then, so a report
    that cannot be written is logged, not raised (``agent-r1 report RUN_DIR`` retries it)."""
    try:
        return write_report(run_dir)
    except Exception as error:  # the trained run must not be lost to its report
        logger.warning("could not write %s/report.html: %s: %s", run_dir, type(error).__name__, error)
        return None
