"""Environments from the ecosystem, trained unchanged: held-out success (or win rate) before and after
RL for each adapter of docs/ecosystem.md, one command.

Each arm is its own script beside this one (``eco_<name>.py``, runnable alone, its setup in its
docstring) exposing ``run(seed, quick) -> dict`` with ``env``, ``metric``, ``before``, ``after``,
``tasks``, ``rl_steps`` and ``seconds``. This script runs the chosen arms one after another, each in
a fresh interpreter (no heap, thread or process-wide setting carried from one arm into the next), and
prints one table; under an arm that did not rise above its start, the signals its run's metrics show
moving (``run_digest``: the held-out watch's, ``agent_r1.train.watch``).

    python benchmarks/ecosystem.py                    # every arm (about 40 min on 2 idle cores)
    python benchmarks/ecosystem.py --arms gymnasium trl --seeds 0 1
    python benchmarks/ecosystem.py --quick            # a smoke run of every arm

The verifiers arm needs its own virtual environment (``bash scripts/install_verifiers.sh``): without
it the arm is reported as skipped, with the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

from run_digest import cause_line

ARMS = ("gymnasium", "textarena", "openenv", "verifiers", "trl")
HERE = Path(__file__).resolve().parent


def run_arm(name: str, seed: int, quick: bool) -> dict:
    """``benchmarks/eco_<name>.py``'s ``run(seed, quick)`` in a fresh interpreter; its dict, or
    ``{"env": name, "error": ...}`` when it failed."""
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import importlib; "
        "arm = importlib.import_module('eco_' + sys.argv[2]); "
        "print('RESULT ' + json.dumps(arm.run(int(sys.argv[3]), sys.argv[4] == '1')))"
    )
    completed = subprocess.run(
        [sys.executable, "-c", code, str(HERE), name, str(seed), "1" if quick else "0"],
        capture_output=True,
        text=True,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join(p for p in (str(HERE.parent), os.environ.get("PYTHONPATH")) if p),
        },
    )
    for line in completed.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line.removeprefix("RESULT "))
    tail = (completed.stderr or completed.stdout).strip().splitlines()[-3:]
    return {"env": name, "error": " | ".join(tail) or f"exit {completed.returncode}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    print(
        f"machine: {platform.machine()} {os.cpu_count()} cpus, load {os.getloadavg()[0]:.2f}, "
        f"python {platform.python_version()}"
    )
    rows = [run_arm(name, seed, args.quick) | {"seed": seed} for name in args.arms for seed in args.seeds]
    print(f"\n{'arm':<11}{'seed':>5}  {'metric':<34}{'before':>8}{'after':>8}{'RL steps':>10}{'seconds':>9}")
    for row in rows:
        if "error" in row or "skipped" in row:
            print(f"{row['env']:<11}{row['seed']:>5}  {row.get('skipped') or 'error: ' + row['error']}")
            continue
        print(
            f"{row['env']:<11}{row['seed']:>5}  {row['metric']:<34}{row['before']:>8.3f}{row['after']:>8.3f}"
            f"{row['rl_steps']:>10}{row['seconds']:>9.0f}"
        )
        if row["after"] <= row["before"]:  # not above its start: what its own metrics say
            print(f"{'':<18}why, from the run's metrics: {cause_line(row)}")
    if any("error" in row for row in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
