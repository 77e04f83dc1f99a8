"""What a benchmark's RL run measured, read back from its ``metrics.jsonl``: the per-step signals the
held-out watch reads (``agent_r1.train.watch``) and what it concludes from them, so that an arm that
does not rise above its start says why, from its own metrics (``benchmarks/ecosystem.py`` prints it).

``digest(run_dir)`` replays the run's rows through a ``HeldOutWatch`` (steps and evaluations, in
order) and returns the per-step series, ``moved``: each signal that moved since the best evaluation,
with what it saw, whether or not held-out success fell below the start, and ``standing``: a share of
trajectories cut short, or of groups with no learning signal, above 20% over the whole run.
"""

from __future__ import annotations

import json
from pathlib import Path

from agent_r1.train.watch import HeldOutWatch

SERIES = (
    "reward/mean",
    "success/mean",
    "entropy/mean",
    "grad_norm",
    "filter/zero_variance_groups",
    "filter/groups",
    "rollout/truncated_fraction",
    "response_length/mean",
    "clip_fraction",
)


def digest(run_dir: str | Path) -> dict:
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    watch = HeldOutWatch()
    evals = {}
    for row in rows:
        if "eval/success" in row:
            watch.observe_eval(row["step"], row)
            evals[row["step"]] = row["eval/success"]
        else:
            watch.observe_step(row["step"], row)
    steps = [row for row in rows if "eval/success" not in row]
    series = {key: [round(row[key], 4) for row in steps if key in row] for key in SERIES}
    return {
        "evals": evals,
        "series": series,
        "best_step": watch.best_step,
        "moved": dict(watch.causes()),
        "standing": standing(series),
    }


STANDING = (
    (
        "rollout/truncated_fraction",
        "of the trajectories were cut short (TRUNCATED: a prompt outgrew the limit)",
    ),
    ("zero_variance", "of the groups had rewards that all agree (no learning signal)"),
)
"""Problems a run can have from its first step on, which the watch (it compares before and since)
does not call a change: a share above 20% over the whole run is named."""


def standing(series: dict[str, list[float]]) -> dict[str, str]:
    shares = {"rollout/truncated_fraction": series["rollout/truncated_fraction"]}
    if series["filter/groups"]:
        pairs = zip(series["filter/zero_variance_groups"], series["filter/groups"], strict=True)
        shares["zero_variance"] = [zero / groups for zero, groups in pairs]
    found = {}
    for key, what in STANDING:
        values = shares.get(key) or []
        if values and sum(values) / len(values) > 0.2:
            found[key] = f"{sum(values) / len(values):.0%} {what} over the {len(values)} steps"
    return found


def cause_line(result: dict) -> str:
    """One line for an arm that did not rise above its start: the signals that moved, or that none did."""
    run = result.get("run") or {}
    moved = run.get("moved")
    if moved is None:
        return ""
    said = [f"{name}: {what}" for name, what in {**run.get("standing", {}), **moved}.items()]
    return "; ".join(said) or "no watched signal moved"
