"""Data shipped with attnlab: a small public-domain text for character-level training demos.

``alice.txt`` is Lewis Carroll's *Alice's Adventures in Wonderland* (1865, public domain); see
README.md in this folder for its source and how the file was produced.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path


def default_text_path() -> Path:
    """Path of the shipped training text (``alice.txt``, 148 481 ASCII characters)."""
    return Path(str(files(__package__) / "alice.txt"))


__all__ = ["default_text_path"]
