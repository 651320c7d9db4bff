"""``python -m attnlab._ext [NAME ...]``: build the C++ kernels now, as ``attnlab build`` does.

One progress line per kernel (default: all) with its time, then the total; exit code 0 when
every named kernel is ready, 1 when one failed, 2 for an unknown name (one line on stderr).
"""

from __future__ import annotations

import sys

from . import build_kernels


def main(argv: list[str] | None = None) -> int:
    """Builds the kernels named in ``argv`` (default: ``sys.argv[1:]``, else all)."""
    names = sys.argv[1:] if argv is None else argv
    try:
        failures = build_kernels(names)
    except ValueError as e:
        print(f"python -m attnlab._ext: error: {e}", file=sys.stderr)
        return 2
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
