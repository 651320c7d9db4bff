"""``attnlab build``: compile attnlab's C++ kernels for this CPU and torch, ahead of first use."""

from __future__ import annotations

import argparse
import sys


def _cmd_build(args: argparse.Namespace) -> int:
    from .. import _ext
    from ._output import WrappedLines

    failures = _ext.build_kernels(args.kernel, force=args.force, out=WrappedLines(indent="    "))
    if not failures:
        return 0
    names = ", ".join(name for name, _ in failures)
    print(
        f"attnlab build: error: {len(failures)} kernel(s) failed ({names}): {failures[0][1]}; "
        "attnlab runs its pure-PyTorch engines instead",
        file=sys.stderr,
    )
    return 1


def register(sub: argparse._SubParsersAction) -> None:
    """Adds ``attnlab build`` to the ``attnlab`` command's subparsers."""
    build = sub.add_parser(
        "build",
        help="compile attnlab's C++ kernels for this CPU (once per machine and torch version)",
        description=(
            "Compiles attnlab's C++ kernels (default: all; `attnlab info` lists them) for the "
            "CPU at hand (-march=native) and the installed "
            "torch into the cache directory, one line per kernel with its time, then the "
            "total. Kernels already built are only loaded (--force rebuilds them). A process "
            "that finds a kernel unbuilt builds it in the call that needs it (one stderr line); "
            "this step does it ahead. Exit code 1 when a build fails (the pure-PyTorch engines "
            "then run), 2 for an unknown kernel."
        ),
    )
    build.add_argument(
        "kernel",
        nargs="*",
        metavar="KERNEL",
        help="kernels to build (default: all; `attnlab info` lists them, an unknown name is "
        "refused with the list)",
    )
    build.add_argument("--force", action="store_true", help="rebuild kernels already built")
    build.set_defaults(func=_cmd_build)
