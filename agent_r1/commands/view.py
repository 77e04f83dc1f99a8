"""``agent-r1 view RUN_DIR``: serve the run's report on localhost, rebuilt on every reload."""

from __future__ import annotations

import argparse
import sys

from agent_r1.commands.report import add_trajectory_caps

HELP = "Serve a run's report and trajectory viewer on 127.0.0.1 (reload the page for fresh data)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="the run directory (holds metrics.jsonl, trajectories/, config.yaml)")
    parser.add_argument(
        "--port", type=int, default=8000, help="port to listen on (0: any free port; default 8000)"
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)"
    )
    add_trajectory_caps(parser)


def run(args: argparse.Namespace) -> int:
    from agent_r1.report import serve

    def announce(url: str) -> None:
        print(f"serving the report of {args.run_dir} at {url} (Ctrl-C to stop)", flush=True)

    try:
        serve(
            args.run_dir,
            host=args.host,
            port=args.port,
            last_steps=args.last_steps,
            per_step=args.per_step,
            on_ready=announce,
        )
    except (OSError, ValueError) as e:
        print(f"agent-r1 view: {e}", file=sys.stderr)
        return 1
    return 0
