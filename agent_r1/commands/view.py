"""``agent-r1 view RUN_DIR``: serve the run's report on localhost, rebuilt on every reload.

The page shows the run's trajectories, so the rule of ``agent-r1 serve`` applies: an address other
than loopback is refused without a key (``--api-key`` or ``AGENT_R1_API_KEY``; the browser then opens
``http://HOST:PORT/?key=KEY``) unless ``--allow-unauthenticated`` says the network is trusted.
"""

from __future__ import annotations

import argparse
import os
import sys

from agent_r1.commands.report import add_trajectory_caps
from agent_r1.commands.serve import API_KEY_ENV

HELP = "Serve a run's report and trajectory viewer on 127.0.0.1 (reload the page for fresh data)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="the run directory (holds metrics.jsonl, trajectories/, config.yaml)")
    parser.add_argument(
        "--port", type=int, default=8000, help="port to listen on (0: any free port; default 8000)"
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)"
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help=f"require the key (open the page as /?key=KEY) (default: ${API_KEY_ENV}; prefer the "
        "variable: a command line is visible to every user of the machine)",
    )
    parser.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="serve a non-loopback --host without a key (only on a network you trust)",
    )
    add_trajectory_caps(parser)


def run(args: argparse.Namespace) -> int:
    from agent_r1.report import serve
    from agent_r1.rollout.server import check_exposure

    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    try:
        check_exposure(
            args.host,
            api_key=api_key,
            allow_unauthenticated=args.allow_unauthenticated,
            exposes="read the run's trajectories",
        )
    except ValueError as e:
        print(f"agent-r1 view: {e}", file=sys.stderr)
        return 1

    def announce(url: str) -> None:
        how = " (open it with ?key=KEY)" if api_key else ""
        print(f"serving the report of {args.run_dir} at {url}{how} (Ctrl-C to stop)", flush=True)

    try:
        serve(
            args.run_dir,
            host=args.host,
            port=args.port,
            last_steps=args.last_steps,
            per_step=args.per_step,
            on_ready=announce,
            api_key=api_key,
        )
    except (OSError, ValueError) as e:
        print(f"agent-r1 view: {e}", file=sys.stderr)
        return 1
    return 0
