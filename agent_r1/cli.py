"""The ``agent-r1`` command. Each subcommand lives in ``agent_r1/commands/<name>.py`` and exposes
``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``; they are imported lazily so
that ``agent-r1 --help`` is instant."""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = ("quickstart", "train", "eval", "serve", "report", "view")


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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Build only the parser we need (imports of heavy modules stay lazy for --help).
    wanted = tuple(c for c in COMMANDS if argv and argv[0] == c) or COMMANDS
    parser = build_parser(wanted if argv and argv[0] in COMMANDS else COMMANDS)
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
