"""``attnlab train TASK``: one module per task, found by name in this package.

A task module defines ``HELP`` (one line for ``attnlab train --help``), ``DESCRIPTION``,
``add_arguments(parser)`` and ``run(args) -> int``. It imports only the standard library and
argparse helpers at module level (every heavy import inside ``run``), because ``attnlab --help``
imports every task module. ``attnlab train`` without a task trains the character-level GPT.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType


def discover() -> list[ModuleType]:
    """The task modules of this package, sorted by name."""
    names = sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))
    return [importlib.import_module(f"{__name__}.{name}") for name in names]


__all__ = ["discover"]
