"""The ``agent-r1`` command. Each subcommand lives in ``agent_r1/commands/<name>.py`` and exposes
``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``; they are imported lazily so
that ``agent-r1 --help`` is instant."""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = ("quickstart", "check", "train", "eval", "serve", "report", "view")


def _load(name: str):
    return importlib.import_module(f"agent_r1.commands.{name}")


def build_parser(commands: tuple[str, ...] = COMMANDS) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="agent-r1", description="Train LLM agents with reinforcement learning (step-level MDP)."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in commands:
        try:
            module = _load(name)
        except ModuleNotFoundError as e:
            if e.name == f"agent_r1.commands.{name}":
                continue
            raise
        p = sub.add_parser(
            name, help=module.HELP, description=module.HELP, epilog=getattr(module, "EPILOG", None)
        )
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """``parse_args``, except that ``key=value`` overrides may also follow the options
    (``agent-r1 train cfg.yaml --resume trainer.steps=60``): argparse gives a ``nargs="*"`` positional
    only the words before the first option, and ``parse_intermixed_args`` does not take subcommands."""
    args, extra = parser.parse_known_args(argv)
    if not extra:
        return args
    if hasattr(args, "overrides") and all("=" in a and not a.startswith("-") for a in extra):
        args.overrides = [*args.overrides, *extra]
        return args
    return parser.parse_args(argv)  # argparse's own error for the words it does not know (exit 2)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Build only the parser we need (imports of heavy modules stay lazy for --help).
    wanted = tuple(c for c in COMMANDS if argv and argv[0] == c) or COMMANDS
    parser = build_parser(wanted if argv and argv[0] in COMMANDS else COMMANDS)
    args = _parse(parser, argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
