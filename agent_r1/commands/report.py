"""``agent-r1 report RUN_DIR``: write the run's self-contained HTML report."""

from __future__ import annotations

import argparse
import sys

HELP = "Write a self-contained HTML report of a run: curves, evaluation, trajectories, config."


def add_trajectory_caps(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--last-steps",
        type=int,
        default=5,
        help="embed the trajectories of the last N dumped training steps (0: all; default 5)",
    )
    parser.add_argument(
        "--per-step",
        type=int,
        default=32,
        help="embed at most N trajectories of each step, whole groups kept (0: all; default 32)",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="the run directory (holds metrics.jsonl, trajectories/, config.yaml)")
    parser.add_argument("-o", "--output", help="where to write the page (default RUN_DIR/report.html)")
    add_trajectory_caps(parser)


def run(args: argparse.Namespace) -> int:
    from agent_r1.report import write_report

    try:
        out = write_report(args.run_dir, args.output, last_steps=args.last_steps, per_step=args.per_step)
    except (OSError, ValueError) as e:
        print(f"agent-r1 report: {e}", file=sys.stderr)
        return 1
    print(out)
    return 0
