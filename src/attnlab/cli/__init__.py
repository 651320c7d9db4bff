"""The ``attnlab`` command: one module per subcommand, each with ``register(subparsers)``.

Every subcommand has ``--help``. The library never imports this package; the commands import the
library (heavy optional dependencies only inside the command that needs them).

Subcommands, in ``attnlab --help`` order: `check`, `estimate`, `experiment`, `bench`, `train`,
`generate`, `visualize`.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from .. import __version__
from . import bench, check, estimate, experiment, generate, train, visualize

COMMANDS = (check, estimate, experiment, bench, train, generate, visualize)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``attnlab`` command."""
    parser = argparse.ArgumentParser(
        prog="attnlab",
        description="attnlab: attention mechanisms — exact, fast, verified, easy to inspect.",
    )
    parser.add_argument("--version", action="version", version=f"attnlab {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        command.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``attnlab`` command; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    return int(args.func(args))


__all__ = ["COMMANDS", "build_parser", "main"]
