"""``python -m attnlab._ext [NAME ...]``: build (or load) extensions now and say whether they work.

Used by `attnlab._ext.load` to build in a separate session (so a build finishes even when the
process that started it exits first), and by users who want the build done ahead of time.
Exit code 0 when every named extension (default: all) is ready, 1 otherwise.
"""

from __future__ import annotations

import sys

from . import _HERE, _load_now


def main(argv: list[str] | None = None) -> int:
    names = (sys.argv[1:] if argv is None else argv) or sorted(p.stem for p in _HERE.glob("*.cpp"))
    code = 0
    for name in names:
        result = _load_now(name)
        print(f"{name}: {'ready' if result is True else result}")
        code |= result is not True
    return code


if __name__ == "__main__":
    sys.exit(main())
