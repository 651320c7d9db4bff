"""One progress bar for the library and the command: tqdm on stderr when installed.

tqdm is the optional ``cli`` extra and is imported only when a bar is created, so importing this
module costs nothing. Without tqdm (or with ``enabled=False``) `Progress` keeps the same interface
and only counts; ``echo=True`` then prints one ``[n/total] what`` line per step instead.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import Any


class Progress:
    """A progress bar over ``items`` (iterate it) or over ``total`` steps (call `step`).

    Attributes:
        active: True when a tqdm bar is shown (then `write` prints above the bar).
        n: steps counted so far (through `step`; iteration is counted by the bar itself).
    """

    def __init__(
        self,
        items: Iterable[Any] | None = None,
        *,
        desc: str | None = None,
        total: int | None = None,
        initial: int = 0,
        unit: str = "it",
        leave: bool = True,
        enabled: bool = True,
        tty_only: bool = False,
        echo: bool = False,
    ) -> None:
        self.items = items
        self.total = total
        self.n = initial
        self.echo = echo and enabled
        self._bar: Any = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:  # pragma: no cover - tqdm is part of the cli/dev extras
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(
                    items,
                    desc=desc,
                    total=total,
                    initial=initial,
                    unit=unit,
                    leave=leave,
                    file=sys.stderr,
                    disable=None if tty_only else False,  # None: only on a terminal
                )
                self.echo = False

    @property
    def total(self) -> int | None:
        """The number of steps expected (None: unknown); setting it updates a shown bar."""
        return self._total

    @total.setter
    def total(self, value: int | None) -> None:
        self._total = value
        bar = getattr(self, "_bar", None)
        if bar is not None:
            bar.total = value
            bar.refresh()

    @property
    def active(self) -> bool:
        """True when a tqdm bar is shown."""
        return self._bar is not None and not getattr(self._bar, "disable", False)

    def __iter__(self) -> Iterator[Any]:
        if self._bar is not None:
            return iter(self._bar)
        if self.items is None:
            raise TypeError("this Progress was made without items; call step() instead")
        return iter(self.items)

    def step(self, what: str | None = None) -> None:
        """Counts one step; ``what`` becomes the bar's description (or the echoed line)."""
        self.n += 1
        if self._bar is not None:
            if what is not None:
                self._bar.set_description(what[:60])
            self._bar.update(1)
        elif self.echo:
            total = "?" if self.total is None else self.total
            print(f"[{self.n}/{total}] {what or ''}".rstrip(), file=sys.stderr, flush=True)

    def set_postfix(self, **values: object) -> None:
        """Shows ``key=value`` pairs after the bar (nothing without a bar)."""
        if self._bar is not None:
            self._bar.set_postfix(**values)

    def write(self, line: str) -> None:
        """Prints a line on stdout without breaking the bar."""
        if self._bar is not None:
            self._bar.write(line)
        else:
            print(line)

    def close(self) -> None:
        """Removes or finishes the bar."""
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def progress(items: Iterable[Any] | None = None, **kwargs: Any) -> Progress:
    """A `Progress` over ``items`` (keyword arguments as `Progress`)."""
    return Progress(items, **kwargs)
