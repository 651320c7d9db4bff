"""The ``attnlab`` command: one module per subcommand, each with ``register(subparsers)``.

Every subcommand has ``--help``. The library never imports this package; the commands import the
library (heavy optional dependencies only inside the command that needs them).

Subcommands, in ``attnlab --help`` order: `check`, `build`, `info`, `estimate`, `advise`,
`experiment`, `heads`, `bench`, `train`, `generate`, `translate`, `visualize`, `textbook`.

Errors: a bad argument or input (a parser error, or a ValueError/TypeError/OSError/ImportError
raised by a command, e.g. the library's CheckpointError) prints ONE line on stderr,
``attnlab COMMAND: error: ...``, and exits with code 2; any other exception prints one line and
exits with 1. ``--debug`` (before or after the command name) re-raises it with its traceback.
``--help`` of the command and of every subcommand imports neither torch nor the library: each
subcommand module registers its parser with the standard library only and imports the library
inside the function that runs the command.

Writing into a closed pipe (``attnlab check | head -3``) ends quietly with code 141 (128 + SIGPIPE).
SIGTERM (``kill``, a batch scheduler, torchrun stopping its workers) is turned into an exception
while a command runs, so its ``finally`` blocks remove the temp files it was writing; the command
prints ``attnlab COMMAND: terminated`` and exits with 143 (128 + SIGTERM), like Ctrl-C with 130.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from importlib.metadata import PackageNotFoundError, version

from . import (
    advise,
    bench,
    build,
    check,
    estimate,
    experiment,
    generate,
    heads,
    info,
    textbook,
    train,
    translate,
    visualize,
)

COMMANDS = (
    check,
    build,
    info,
    estimate,
    advise,
    experiment,
    heads,
    bench,
    train,
    generate,
    translate,
    visualize,
    textbook,
)

#: Exceptions that mean "bad argument or input": one line on stderr, exit code 2.
INPUT_ERRORS = (ValueError, TypeError, OSError, ImportError)

EXIT_USAGE = 2
EXIT_BROKEN_PIPE = 141
EXIT_TERMINATED = 128 + signal.SIGTERM


class Terminated(BaseException):
    """SIGTERM arrived while a command ran (a BaseException: ``except Exception`` lets it pass,
    ``finally`` blocks run)."""


def _raise_terminated(signum: int, _frame: object) -> None:  # a signal handler's signature
    raise Terminated(signum)


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """SIGTERM raises `Terminated` inside the block (main thread only; the previous handler is
    put back after it)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    try:
        previous = signal.signal(signal.SIGTERM, _raise_terminated)
    except (ValueError, OSError):  # no signals here (e.g. an embedded interpreter)
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class Parser(argparse.ArgumentParser):
    """An `argparse.ArgumentParser` whose errors are one line: ``PROG: error: MESSAGE``."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {_one_line(message)}\n")


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def _message(e: BaseException) -> str:
    """One line describing ``e``: an OSError as "STRERROR: FILENAME" (without "[Errno N]")."""
    if isinstance(e, OSError) and e.strerror:
        text = e.strerror
        if e.filename is not None and str(e.filename) not in text:
            text += f": {e.filename}"
        return _one_line(text)
    return _one_line(e) or type(e).__name__


def _version() -> str:
    """attnlab's installed version (the distribution's metadata: importing attnlab would load
    torch), as ``attnlab.__version__`` reads it."""
    try:
        return version("attnlab")
    except PackageNotFoundError:  # pragma: no cover - running from a source tree
        return "0.0.0+unknown"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``attnlab`` command."""
    parser = Parser(
        prog="attnlab",
        description="attnlab: attention mechanisms — exact, fast, verified, easy to inspect.",
    )
    parser.add_argument("--version", action="version", version=f"attnlab {_version()}")
    parser.add_argument(
        "--debug", action="store_true", help="show the traceback of an error (any position)"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for command in COMMANDS:
        command.register(sub)
    for subparser in sub.choices.values():
        subparser.add_argument(
            "--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks"
        )
    parser.set_defaults(subparsers=sub.choices)
    return parser


def _quiet_stdout() -> None:
    """Points stdout at /dev/null so the interpreter's final flush does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # no real file descriptor (e.g. captured)
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``attnlab`` command; returns the exit code.

    Parser errors exit through `SystemExit` (code 2) like argparse; errors raised by a command are
    turned into one stderr line and the returned code (2 for bad input, 1 otherwise).
    """
    try:
        return _main(argv)
    except BrokenPipeError:
        _quiet_stdout()
        return EXIT_BROKEN_PIPE


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    command = getattr(args, "command", None)
    if extras:
        owner = args.subparsers[command] if command else parser
        owner.error(f"unrecognized arguments: {' '.join(extras)}")
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    task = getattr(args, "task", None)
    prog = f"attnlab {command}" + (f" {task}" if task else "")
    try:
        with _sigterm_raises():
            code = int(args.func(args))
            sys.stdout.flush()  # a closed pipe fails here, inside the handler, not at exit
        return code
    except BrokenPipeError:
        raise
    except KeyboardInterrupt:
        if args.debug:
            raise
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Terminated:
        if args.debug:
            raise
        print(f"{prog}: terminated", file=sys.stderr)
        return EXIT_TERMINATED
    except INPUT_ERRORS as e:
        if args.debug:
            raise
        print(f"{prog}: error: {_message(e)}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as e:
        if args.debug:
            raise
        print(
            f"{prog}: internal error: {type(e).__name__}: {_message(e)} "
            "(run again with --debug for the traceback)",
            file=sys.stderr,
        )
        return 1


__all__ = ["COMMANDS", "INPUT_ERRORS", "Parser", "Terminated", "build_parser", "main"]
