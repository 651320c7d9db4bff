"""``attnlab build``: compile attnlab's C++ kernels for this CPU and torch, ahead of first use."""

from __future__ import annotations

import argparse
import sys

from .. import _ext


def _cmd_build(args: argparse.Namespace) -> int:
    failures = _ext.build_kernels(args.kernel, force=args.force)
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
            "Compiles attnlab's C++ kernels (default: all of "
            f"{', '.join(_ext.KERNELS)}) for the CPU at hand (-march=native) and the installed "
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
        help=f"kernels to build (default: all; one of {', '.join(_ext.KERNELS)})",
    )
    build.add_argument("--force", action="store_true", help="rebuild kernels already built")
    build.set_defaults(func=_cmd_build)
