"""Exact attended-pair counts: closed forms on Python ints, and a bounded fallback.

`Mask.attended_pairs` asks each mask for its *geometry* (`Mask.geometry`, one `Geometry`
record): a set of diagonals ``d = j − p`` (p the bottom-right aligned query position
``i + S − L``), a per-batch key limit (padding lengths), per-batch runs of keys (documents built
from lengths), or the exact counts a mask reads from the data it holds (``pairs``: Longformer by
inclusion-exclusion over the globals, BigBird by block cells, raw document ids by bincount,
tensor masks by a sum; unions and complements of closed counts by inclusion-exclusion). Every
``&`` of diagonals, key limits and runs is counted by `geometry_pairs` in O(pieces) Python-int
arithmetic, exact for any size (``L = S = 10**12`` takes microseconds, no tensor is built).
Masks without a geometry are counted by diagonals, key intervals or rows, up to `COUNT_BUDGET`
evaluated elements; above it `attended_pairs` raises a ValueError naming the lengths and the
limit.
"""

from __future__ import annotations

from dataclasses import dataclass

# Evaluated elements (diagonals, rows, or query × key pairs) the fallback may spend on one count.
COUNT_BUDGET = 1 << 30

# One arithmetic progression of diagonals: d ≡ anchor (mod step), lo <= d <= hi (None: unbounded).
Piece = tuple[int | None, int | None, int, int]

# Any size at least this large acts as "unbounded" on int64 positions: sizes are capped to it
# before they meet an index tensor (exact on every grid smaller than 2^62, no int64 overflow).
HUGE = 1 << 62


def _ap_stats(x: int, y: int, step: int, anchor: int) -> tuple[int, int]:
    """Count and sum of the integers ``e ≡ anchor (mod step)`` with ``x <= e <= y``."""
    if x > y:
        return 0, 0
    first = x + (anchor - x) % step
    if first > y:
        return 0, 0
    k = (y - first) // step + 1
    return k, k * first + step * k * (k - 1) // 2


def diagonal_pairs(
    L: int, N: int, lo: int | None, hi: int | None, step: int = 1, anchor: int = 0
) -> int:
    """Pairs ``(i, j)`` of the ``L × N`` rectangle with ``e = j − i`` in a progression of diagonals.

    Counts ``Σ_e n(e)`` over ``e ≡ anchor (mod step)``, ``lo <= e <= hi``, where diagonal ``e``
    holds ``n(e) = min(L, N − e) + min(0, e)`` pairs for ``−L < e < N`` (and none outside): a
    piecewise-linear sum, so a few closed-form progression sums.

    Args:
        L, N: rows and columns of the rectangle.
        lo, hi: the first and last diagonal ``e`` counted (None: unbounded).
        step, anchor: count only ``e ≡ anchor (mod step)``.

    Returns:
        The exact count, a Python int (no overflow at any size).
    """
    if L <= 0 or N <= 0:
        return 0
    lo = -(L - 1) if lo is None else max(lo, -(L - 1))
    hi = N - 1 if hi is None else min(hi, N - 1)
    if lo > hi:
        return 0
    c1, _ = _ap_stats(lo, min(hi, N - L), step, anchor)  # min(L, N − e) = L
    c2, s2 = _ap_stats(max(lo, N - L + 1), hi, step, anchor)  # min(L, N − e) = N − e
    _, s3 = _ap_stats(lo, min(hi, -1), step, anchor)  # min(0, e) = e
    return L * c1 + N * c2 - s2 + s3


def _intersect_pieces(a: list[Piece] | None, b: list[Piece] | None) -> list[Piece] | None:
    """The diagonals in both sets, or raise `_NoClosedFormError` (two progressions of step > 1)."""
    if a is None or b is None:
        return b if a is None else a
    if all(p[2] == 1 for p in b):
        a, b = b, a
    if not all(p[2] == 1 for p in a) or len(a) != 1:
        raise _NoClosedFormError
    lo, hi = a[0][0], a[0][1]  # one interval of step 1, clipped onto every piece of b
    out = []
    for plo, phi, step, anchor in b:
        nlo = plo if lo is None else lo if plo is None else max(lo, plo)
        nhi = phi if hi is None else hi if phi is None else min(hi, phi)
        if nlo is None or nhi is None or nlo <= nhi:
            out.append((nlo, nhi, step, anchor))
    return out


def _broadcast(name: str, a: list | None, b: list | None, combine) -> list | None:
    if a is None or b is None:
        return b if a is None else a
    if len(a) == 1 or len(b) == 1 or len(a) == len(b):
        n = max(len(a), len(b))
        return [combine(a[k if len(a) > 1 else 0], b[k if len(b) > 1 else 0]) for k in range(n)]
    raise ValueError(f"cannot combine masks: one has {name} for {len(a)}, the other {len(b)}")


class _NoClosedFormError(Exception):
    """Raised while combining geometries that have no closed-form count together."""


@dataclass
class Geometry:
    """A mask's structure, counted exactly by `geometry_counts` (each part None: no limit).

    Attributes:
        diagonals: disjoint progressions of ``d = j − p`` that may attend (`Piece`).
        key_limit: per batch item (or one for all), keys ``j < key_limit`` may attend.
        runs: per batch item (or one for all), the ``(start, length)`` runs of keys; a query
            attends only keys of its own run, and a query before the keys (p < 0) nothing.
        pairs: the exact counts per ``(batch item, head)`` of the sizes the mask depends on
            (``[[n]]`` if neither), for a mask that counts from the data it holds; it excludes
            the other parts and does not combine with ``&``.
    """

    diagonals: list[Piece] | None = None
    key_limit: list[int] | None = None
    runs: list[list[tuple[int, int]]] | None = None
    pairs: list[list[int]] | None = None

    def __and__(self, other: Geometry) -> Geometry:
        if self.runs is not None and other.runs is not None:
            raise _NoClosedFormError
        if self.pairs is not None or other.pairs is not None:
            raise _NoClosedFormError
        return Geometry(
            _intersect_pieces(self.diagonals, other.diagonals),
            _broadcast("key limits", self.key_limit, other.key_limit, min),
            self.runs if other.runs is None else other.runs,
        )


def combine_geometry(a: Geometry | None, b: Geometry | None) -> Geometry | None:
    """``a & b``, or None when either has no geometry or the pair has no closed form."""
    if a is None or b is None:
        return None
    try:
        return a & b
    except _NoClosedFormError:
        return None


def geometry_pairs(g: Geometry, L: int, S: int) -> list[int]:
    """Attended pairs of an ``L × S`` grid per batch item (one entry if batch-independent).

    Args:
        g: the mask's geometry. L, S: query and key lengths (bottom-right aligned).

    Returns:
        Python ints, one per batch item the geometry depends on (else one).
    """
    limits = g.key_limit if g.key_limit is not None else [S]
    runs = g.runs if g.runs is not None else [None]
    n = max(len(limits), len(runs))
    pieces = g.diagonals if g.diagonals is not None else [(None, None, 1, 0)]
    out = []
    for k in range(n):
        limit = min(S, max(0, limits[k if len(limits) > 1 else 0]))
        item_runs = runs[k if len(runs) > 1 else 0]
        # segments: (first aligned query position p0, rows, first key a, keys)
        if item_runs is None:
            segments = [(S - L, L, 0, limit)]
        else:
            segments = []
            for a, length in item_runs:
                p0 = max(a, S - L)
                segments.append((p0, a + length - p0, a, min(a + length, limit) - a))
        total = 0
        for p0, rows, a, keys in segments:
            if rows <= 0 or keys <= 0:
                continue
            shift = p0 - a  # local e = j' − i' = d + p0 − a
            for lo, hi, step, anchor in pieces:
                total += diagonal_pairs(
                    rows,
                    keys,
                    None if lo is None else lo + shift,
                    None if hi is None else hi + shift,
                    step,
                    anchor + shift,
                )
        out.append(total)
    return out


def geometry_counts(g: Geometry, L: int, S: int) -> list[list[int]]:
    """Attended pairs per ``(batch item, head)`` (``[[n]]`` when the mask depends on neither)."""
    return g.pairs if g.pairs is not None else [[n] for n in geometry_pairs(g, L, S)]


def budget_error(mask: object, L: int, S: int, cost: int) -> ValueError:
    """The error of a count above `COUNT_BUDGET`, naming the lengths and the limit."""
    return ValueError(
        f"attended_pairs: {mask!r} has no closed-form pair count; counting it at L={L}, S={S} "
        f"would evaluate {cost:,} elements, above the limit of {COUNT_BUDGET:,} "
        "(use smaller L and S)"
    )


__all__ = [
    "COUNT_BUDGET",
    "HUGE",
    "Geometry",
    "Piece",
    "budget_error",
    "combine_geometry",
    "diagonal_pairs",
    "geometry_counts",
    "geometry_pairs",
]
