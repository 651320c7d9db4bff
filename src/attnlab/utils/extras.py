"""Optional dependencies: import one, or say in one line which ``attnlab`` extra brings it.

attnlab needs only torch; matplotlib (``viz``), tqdm (``cli``), safetensors and tokenizers
(``models``) are imported where a feature uses them, through `require`.

Example:
    >>> figure = require("matplotlib.figure", "viz", "attnlab.viz")  # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from types import ModuleType

# The extras declared in pyproject.toml's [project.optional-dependencies] that `require` names.
EXTRAS = ("cli", "viz", "models", "hf", "apps", "textbook", "all")


class MissingExtraError(ImportError):
    """An optional dependency of a feature is not installed (the message names the extra)."""


def require(module: str, extra: str, feature: str) -> ModuleType:
    """Imports ``module`` for ``feature``, or raises a one-line error naming the extra to install.

    Args:
        module: the dotted module name, e.g. ``"matplotlib.figure"``.
        extra: the attnlab extra that installs it, one of `EXTRAS`.
        feature: what needs it, for the message, e.g. ``"attnlab.viz.attention_png"``.

    Returns:
        The imported module.

    Raises:
        MissingExtraError: (an ImportError) the module cannot be imported; the message reads
            ``<feature> needs <module>, which is not installed: pip install "attnlab[<extra>]"``.
        ValueError: ``extra`` is not one of `EXTRAS`.
    """
    if extra not in EXTRAS:
        raise ValueError(f"extra must be one of {EXTRAS}, got {extra!r}")
    try:
        return importlib.import_module(module)
    except ImportError as err:
        missing = err.name or module.split(".")[0]
        raise MissingExtraError(
            f'{feature} needs {missing}, which is not installed: pip install "attnlab[{extra}]"',
            name=missing,
        ) from None
