"""What the ``attnlab`` command prints: tables and text that fit the terminal, JSON, progress.

Tables are laid out by rich (the ``cli`` extra, imported when a table is printed): every column
wraps (long words fold), so no cell is ever cut, and the table is as wide as the terminal at most
(`width`: ``COLUMNS``, else the terminal's width); written to a file or a pipe, each row stays
on one line. The text is plain, without ANSI codes, wherever it goes. ``--json`` prints the
same rows with every field whole (`print_json`). The analysis objects' tables
(`attnlab.analysis.table_parts.TableParts`: ``est.table_parts()``, ``advice.table_parts()``,
...) print through `fitted`, their lines above and below wrapped like any text (`wrap`).

Progress goes to stderr, only on a terminal and never with ``--quiet``: `steps` for work that
counts its steps (a tqdm bar, `attnlab.utils.Progress`), `working` for one long library call
that does not (a line that shows the elapsed time until the call returns).

This module imports only the standard library at import time: ``attnlab --help`` loads it.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TextIO


def _need_rich() -> None:
    """rich (the ``cli`` extra) is importable, or a one-line error naming the extra."""
    from ..utils.extras import require

    require("rich", "cli", "the attnlab command's tables and progress")


def width() -> int | None:
    """The width output must fit: ``COLUMNS`` if set, else the columns of the terminal stdout
    is, else None — output to a file or a pipe keeps one line per table row."""
    if os.environ.get("COLUMNS", "").isdigit() or sys.stdout.isatty():
        return max(20, shutil.get_terminal_size((80, 24)).columns)
    return None


@dataclass(frozen=True)
class Col:
    """A table column: its header, whether its cells are right-aligned (numbers), and whether
    it is the wide one (notes, reasons) that wraps first when the table is too wide."""

    name: str
    right: bool = False
    wide: bool = False


def table(
    columns: Sequence[Col | str],
    rows: Iterable[Sequence[object] | None],
    *,
    max_width: int | None = None,
) -> str:
    """The rows as a plain-text table at most ``max_width`` columns wide (default `width`;
    None there: as wide as the rows).

    Every column keeps its natural width while the table fits; when it does not, the wide
    columns (`Col.wide`) wrap first, then the others. A header wraps between its words, a cell
    between words too: nothing is ever cut. When the words themselves do not fit, the columns
    move closer (3 spaces apart, else 2, else 1), then headers fold their long words before any
    cell does (``normalised_entropy`` over a column of numbers), and only then do cells fold.

    Args:
        columns: the columns (a str is a left-aligned `Col`).
        rows: the rows, one cell per column (printed with ``str``); None draws an empty line
            between groups of rows.
        max_width: the widest line allowed.

    Returns:
        The table, lines joined by ``\\n``, no trailing spaces.

    Raises:
        ValueError: a row whose length differs from the number of columns.
        MissingExtraError: rich is not installed (the ``cli`` extra).
    """
    _need_rich()
    from rich import box
    from rich.cells import cell_len
    from rich.table import Table
    from rich.text import Text

    cols = [c if isinstance(c, Col) else Col(c) for c in columns]
    body = [None if r is None else [str(cell) for cell in r] for r in rows]
    for r in body:
        if r is not None and len(r) != len(cols):
            raise ValueError(f"every row must have {len(cols)} cells like the columns, got {r!r}")
    natural = [
        max([cell_len(c.name), *(cell_len(r[i]) for r in body if r is not None)])
        for i, c in enumerate(cols)
    ]
    # the width below which a column's words would fold: its longest word (at most 20 in a
    # wide column, whose text is long anyway); ``inner``: the same without the header's words
    least, inner = [], []
    for i, c in enumerate(cols):
        cells = [w for r in body if r is not None for w in r[i].split()]
        longest = max(map(cell_len, [*c.name.split(), *cells]), default=1)
        least.append(min(natural[i], 20 if c.wide else natural[i], longest))
        inner.append(min(least[i], max(map(cell_len, cells), default=1)))
    limit = max_width or width()
    gap = 3 if limit is None else _gap(sum(least), len(cols), limit)
    if limit is None:
        widths = natural
    else:
        widths = _fit(natural, least, inner, [c.wide for c in cols], limit - gap * (len(cols) - 1))
    padding = {3: (0, 1), 2: (0, 1, 0, 0), 1: (0, 0)}[gap]  # around rich's 1-space divider
    t = Table(
        box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="", padding=padding
    )
    for i, c in enumerate(cols):
        t.add_column(
            Text(c.name),
            justify="right" if c.right else "left",
            overflow="fold",
            width=widths[i],
        )
    for r in body:
        if r is None:
            t.add_section()
        else:
            t.add_row(*(Text(cell) for cell in r))
    return render(t, sum(widths) + gap * (len(cols) - 1))


def _gap(words: int, columns: int, limit: int) -> int:
    """Spaces between columns: 3, or 2, or 1 — the widest gap at which ``columns`` columns whose
    longest words sum to ``words`` fit in ``limit``, else 1 (closer columns before folded words)."""
    return next((g for g in (3, 2) if words + g * (columns - 1) <= limit), 1)


def _fit(
    natural: list[int], least: list[int], inner: list[int], wide: list[bool], budget: int
) -> list[int]:
    """Column widths that sum to at most ``budget``: the natural widths, then narrower in turn —
    the wide columns down to 20, the others down to their longest word (``least``), the wide
    ones down to theirs, every column down to its cells' longest word (``inner``: a header's
    longer word folds), and at last any column down to 4 (its long words fold). Within a turn
    the widest column gives up a column first, so the narrowed ones end up alike."""
    widths = list(natural)
    turns = (
        [max(least[i], min(20, natural[i])) if wide[i] else natural[i] for i in range(len(wide))],
        [natural[i] if wide[i] else least[i] for i in range(len(wide))],
        least,
        inner,
        [min(4, n) for n in natural],
    )
    for floors in turns:
        while sum(widths) > budget:
            above = [i for i, w in enumerate(widths) if w > floors[i]]
            if not above:
                break
            widths[max(above, key=lambda i: widths[i])] -= 1
    return widths


def render(renderable: Any, max_width: int) -> str:
    """A rich renderable as plain text at most ``max_width`` columns wide, no trailing spaces."""
    from rich.console import Console

    buf = io.StringIO()
    console = Console(
        file=buf,
        width=max_width,
        color_system=None,
        force_terminal=False,
        highlight=False,
        markup=False,
        emoji=False,
    )
    console.print(renderable, crop=False)
    return "\n".join(line.rstrip() for line in buf.getvalue().rstrip("\n").split("\n"))


def wrap(text: str, *, indent: str = "", max_width: int | None = None) -> str:
    """``text`` wrapped at word boundaries (a word longer than a line folds), each line of it
    on its own: the lines a line wraps into after its first are indented by ``indent``;
    terminal cells are counted (a CJK character takes two)."""
    limit = max_width or width()
    if limit is None:
        return text
    _need_rich()
    from rich.cells import cell_len
    from rich.text import Text

    def one(line: str) -> str:
        if cell_len(line) <= limit:
            return line
        out = render(Text(line, overflow="fold"), limit - len(indent))
        return ("\n" + indent).join(out.split("\n"))

    return "\n".join(one(line) for line in text.split("\n"))


def fitted(table_parts: Any, *, indent: str = "  ", max_width: int | None = None) -> str:
    """A library table (`attnlab.analysis.table_parts.TableParts`: ``header``, ``rows``,
    ``align``, ``before``, ``after``) that fits: the lines above and below it wrapped (`wrap`,
    later lines of one indented by ``indent``), the table laid out by `table` (a column whose
    ``align`` is ``>`` right-aligned)."""
    t = table_parts
    columns = [Col(name, right=a == ">") for name, a in zip(t.header, t.align, strict=True)]

    def lines(texts: Sequence[str]) -> list[str]:
        return [wrap(text, indent=indent, max_width=max_width) if text else "" for text in texts]

    body = table(columns, t.rows, max_width=max_width)
    return "\n".join([*lines(t.before), body, *lines(t.after)])


class WrappedLines(io.TextIOBase):
    """A text stream for the lines a library prints as it goes (``out=`` of
    `attnlab._ext.build_kernels`): each line goes to ``out`` (default stdout) wrapped like
    `wrap`, its later lines indented by ``indent``. The start of a line flushed before its end
    (``print(name, end="", flush=True)`` while a kernel builds) is shown at once; the rest
    wraps after it when the line ends."""

    def __init__(self, out: TextIO | None = None, *, indent: str = "  ") -> None:
        self._out = out or sys.stdout
        self._indent = indent
        self._line = ""  # the current line so far
        self._shown = 0  # how much of it is written already

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        *ended, rest = text.split("\n")
        for piece in ended:
            self._end_line(self._line + piece)
        self._line += rest
        return len(text)

    def _end_line(self, line: str) -> None:
        shown = line[: self._shown]
        wrapped = wrap(line, indent=self._indent)
        if wrapped.startswith(shown):
            self._out.write(wrapped[len(shown) :] + "\n")
        else:  # the start shown would have wrapped: the rest goes on a new line
            rest = wrap(self._indent + line[self._shown :].lstrip(), indent=self._indent)
            self._out.write(f"\n{rest}\n")
        self._line, self._shown = "", 0

    def flush(self) -> None:
        self._out.write(self._line[self._shown :])
        self._shown = len(self._line)
        self._out.flush()


def print_json(data: object, out: TextIO | None = None) -> None:
    """``data`` as indented JSON on stdout (UTF-8 text kept readable)."""
    print(json.dumps(data, ensure_ascii=False, indent=1), file=out or sys.stdout)


def steps(
    items: Iterable[Any] | None = None, *, total: int | None = None, desc: str, quiet: bool
) -> Any:
    """A progress bar on stderr over ``items`` or ``total`` steps (`attnlab.utils.Progress`):
    shown on a terminal only, never with ``quiet``."""
    from ..utils.progress import Progress

    return Progress(items, desc=desc, total=total, enabled=not quiet, tty_only=True, leave=False)


@contextlib.contextmanager
def working(what: str, *, quiet: bool) -> Iterator[None]:
    """A spinner, ``what`` and the time elapsed on stderr while the block runs (on a terminal
    only, not with ``quiet``); the line is removed when the block ends."""
    if quiet or not sys.stderr.isatty():
        yield
        return
    _need_rich()
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        bar.add_task(what, total=None)
        yield


__all__ = [
    "Col",
    "WrappedLines",
    "fitted",
    "print_json",
    "render",
    "steps",
    "table",
    "width",
    "working",
    "wrap",
]
