"""Library names that a command module offers as its own attributes, imported on first use.

``attnlab --help`` imports every command module, and must not import torch, so a command imports
the library where it runs. A few library functions are also attributes of the command module
(``attnlab.cli.train.train``): the module's ``__getattr__`` imports them when first read, and the
command looks them up on the module when it runs, so a value set there (a test's stand-in) is
the one that runs.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable


def lazy_attributes(module: str, names: dict[str, str]) -> Callable[[str], object]:
    """A module ``__getattr__`` for ``module`` that imports each of ``names`` (name -> the
    module that defines it, relative to ``attnlab.cli``) on first use and keeps it."""

    def getattr_(name: str) -> object:
        if name not in names:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(names[name], "attnlab.cli"), name)
        setattr(sys.modules[module], name, value)
        return value

    return getattr_


__all__ = ["lazy_attributes"]
