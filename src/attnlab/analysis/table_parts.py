"""A printed table as data: the lines above it, its header and rows of text cells, the lines
below it. The analysis objects' ``table()`` methods join them into plain text (`TableParts.text`);
the ``attnlab`` command lays the same parts out to the terminal's width instead."""

from __future__ import annotations

from dataclasses import dataclass

from ..utils import text_table


@dataclass(frozen=True)
class TableParts:
    """A table and the lines around it, every cell already formatted.

    Attributes:
        header: the column names.
        rows: one list of text cells per row, as many as ``header``.
        align: one character per column, ``<`` (left) or ``>`` (right).
        before: lines printed above the table (a title).
        after: lines printed below it (a verdict, counts, notes; ``""`` is an empty line).
    """

    header: list[str]
    rows: list[list[str]]
    align: str
    before: tuple[str, ...] = ()
    after: tuple[str, ...] = ()

    def text(self) -> str:
        """The parts as plain text: the table's columns padded to their widest cell."""
        body = text_table(self.header, self.rows, align=self.align)
        return "\n".join([*self.before, body, *self.after])


__all__ = ["TableParts"]
