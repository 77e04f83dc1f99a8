"""What a benchmark's RL run measured, read back from its ``metrics.jsonl``: the per-step signals the
held-out watch reads (``agent_r1.train.watch``) and what it concludes from them, so that an arm that
does not rise above its start says why, from its own metrics (``benchmarks/ecosystem.py`` prints it).

``digest(run_dir)`` replays the run's rows through a ``HeldOutWatch`` (steps and evaluations, in
order) and returns the per-step series and ``moved``: each signal that moved since the best
evaluation, with what it saw, whether or not held-out success fell below the start.
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
    return {
        "evals": evals,
        "series": {key: [round(row[key], 4) for row in steps if key in row] for key in SERIES},
        "best_step": watch.best_step,
        "moved": dict(watch.causes()),
    }


def cause_line(result: dict) -> str:
    """One line for an arm that did not rise above its start: the signals that moved, or that none did."""
    run = result.get("run") or {}
    moved = run.get("moved")
    if moved is None:
        return ""
    return "; ".join(f"{name}: {said}" for name, said in moved.items()) or "no watched signal moved"
