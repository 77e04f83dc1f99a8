"""``agent-r1 check CONFIG [key=value ...]``: everything about a run that can be checked without the
model's weights, in seconds (``agent_r1.train.preflight``). ``agent-r1 train`` and ``agent-r1 eval``
run the same checks first.

Prints what the config chose for you (``ok  chose ...``: what ``trainer.mode: async`` needs, where you
left it unset), then one ``ok`` line per check passed.

Exit codes: 0 every check passed; 2 configuration, data, model or environment errors, every one that
can be found in one run, one per line, each naming the key, the file and the row."""

from __future__ import annotations

import argparse

HELP = "Check a config without loading weights (imports, model folder, tokenizer, data rows, env reset)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML config file (the one given to agent-r1 train)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides")


def run(args: argparse.Namespace) -> int:
    from agent_r1.train.config import load_config_with_choices
    from agent_r1.train.preflight import PREFLIGHT_ERRORS, preflight

    try:
        config, choices = load_config_with_choices(args.config, list(args.overrides))
        for choice in choices:
            print(f"ok  chose {choice}")
        report = preflight(config)
    except (*PREFLIGHT_ERRORS, FileNotFoundError) as e:
        print(f"agent-r1 check: {e}")
        return 2
    for line in report:
        print(f"ok  {line}")
    print(f"agent-r1 check: {args.config} passed")
    return 0
