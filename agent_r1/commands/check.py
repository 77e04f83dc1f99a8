"""``agent-r1 check CONFIG [key=value ...]``: everything about a run that can be checked without the
model's weights, in seconds (``agent_r1.train.preflight``). ``agent-r1 train`` and ``agent-r1 eval``
run the same checks first.

Exit codes: 0 every check passed (one line each); 2 a configuration, data, model or environment
error, printed once, naming the key, the file and the row."""

from __future__ import annotations

import argparse

HELP = "Check a config without loading weights (imports, model folder, tokenizer, data rows, env reset)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML config file (the one given to agent-r1 train)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides")


def run(args: argparse.Namespace) -> int:
    from agent_r1.train.config import load_config
    from agent_r1.train.preflight import PREFLIGHT_ERRORS, preflight

    try:
        report = preflight(load_config(args.config, list(args.overrides)))
    except (*PREFLIGHT_ERRORS, FileNotFoundError) as e:
        print(f"agent-r1 check: {e}")
        return 2
    for line in report:
        print(f"ok  {line}")
    print(f"agent-r1 check: {args.config} passed")
    return 0
