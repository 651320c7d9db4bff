"""One aligned plain-text table, used by the estimator, the experiments and the commands."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def text_table(
    header: Sequence[object],
    rows: Iterable[Sequence[object] | None],
    *,
    align: str | None = None,
    rule: bool = True,
    gap: str = "  ",
) -> str:
    """Columns padded to their widest cell, a dashed rule under the header, no trailing spaces.

    Args:
        header: the column names.
        rows: the rows (cells are printed with ``str``); a None row is an empty line.
        align: one character per column, ``<`` (left) or ``>`` (right); default all left.
        rule: draw a line of dashes under the header.
        gap: text between columns.

    Returns:
        The table, lines joined by ``\\n``.

    Raises:
        ValueError: a row or ``align`` whose length differs from the header's.
    """
    cols = len(header)
    align = "<" * cols if align is None else align
    if len(align) != cols or set(align) - {"<", ">"}:
        raise ValueError(f"align must be {cols} characters of '<' or '>', got {align!r}")
    body = [None if r is None else [str(c) for c in r] for r in rows]
    for r in body:
        if r is not None and len(r) != cols:
            raise ValueError(f"every row must have {cols} cells like the header, got {r!r}")
    cells = [[str(c) for c in header]] + [r for r in body if r is not None]
    widths = [max(len(r[c]) for r in cells) for c in range(cols)]

    def line(r: list[str]) -> str:
        return gap.join(
            c.ljust(w) if a == "<" else c.rjust(w) for c, w, a in zip(r, widths, align, strict=True)
        ).rstrip()

    out = [line(cells[0])]
    if rule:
        out.append(gap.join("-" * w for w in widths))
    out += ["" if r is None else line(r) for r in body]
    return "\n".join(out)
