"""Runnable solutions of the texts' exercises (``attnlab textbook --exercise ID``).

Seed 002 §8.8 poses exercises 8.1–8.8; seed 004 announces hands-on exercises (forward,
optimisations, backward) that the file lacks — those are written here and marked
``from_text=False`` ("not from the text"). A solution is a function returning the worked answer
as text: the derivation in a few lines plus the numbers attnlab computes to check it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Exercise:
    """One exercise: ``id`` (``"8.2"``, ``"H1"``), title, source, and its solution."""

    id: str
    title: str
    source: str
    from_text: bool
    solve: Callable[[], str] = field(repr=False, compare=False)


_REGISTRY: dict[str, Exercise] = {}
_ID = re.compile(r"^[0-9A-Z][0-9A-Za-z.]*$")


def exercise(
    id: str, *, title: str, source: str, from_text: bool = True
) -> Callable[[Callable[[], str]], Callable[[], str]]:
    """Registers the decorated function as the solution of an `Exercise`."""
    if not _ID.match(id) or id in _REGISTRY:
        raise ValueError(f"exercise id must be new and look like '8.2' or 'H1', got {id!r}")

    def register(fn: Callable[[], str]) -> Callable[[], str]:
        _REGISTRY[id] = Exercise(id, title, source, from_text, fn)
        return fn

    return register


def all_exercises() -> list[Exercise]:
    """Every exercise, the texts' first (by number), then ours."""
    from .core import _load

    _load()
    return sorted(_REGISTRY.values(), key=lambda e: (not e.from_text, e.id))


def get_exercise(id: str) -> Exercise:
    """The exercise ``id``; ValueError listing the known ids otherwise."""
    known = {e.id: e for e in all_exercises()}
    if id not in known:
        raise ValueError(f"id: must be one of {sorted(known)}, got {id!r}")
    return known[id]


def render(e: Exercise) -> str:
    """The exercise's heading and worked answer."""
    origin = e.source if e.from_text else f"{e.source} (not from the text)"
    return f"Exercise {e.id}: {e.title}\n[{origin}]\n\n{e.solve().rstrip()}\n"


__all__ = ["Exercise", "all_exercises", "exercise", "get_exercise", "render"]
