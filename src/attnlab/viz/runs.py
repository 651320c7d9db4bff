"""Several runs of the same training drawn together: their loss curves and how far each one
strays from the first (e.g. one process against 2 data-parallel or context-parallel ranks),
with matplotlib (imported inside the functions).

Example:
    >>> plot_same_run("same_run.png", [("one process", a), ("2 ranks, data", b)])
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path


def _check(curves: object) -> list[tuple[str, list[float]]]:
    if not isinstance(curves, Sequence) or len(curves) < 2:
        n = len(curves) if isinstance(curves, Sequence) else type(curves).__name__
        raise ValueError(f"curves must hold at least 2 (name, losses) pairs, got {n}")
    out = []
    for name, losses in curves:
        values = [float(x) for x in losses]
        if not values or not all(math.isfinite(x) for x in values):
            raise ValueError(f"curves[{name!r}] must be a non-empty list of finite losses")
        out.append((str(name), values))
    steps = len(out[0][1])
    for name, values in out[1:]:
        if len(values) != steps:
            raise ValueError(
                f"every curve must have the same number of steps: {out[0][0]!r} has {steps}, "
                f"{name!r} has {len(values)}"
            )
    return out


def same_run_figure(curves: Sequence[tuple[str, Sequence[float]]], *, dpi: int = 80) -> object:
    """Left: each run's per-step training loss; right: ``|loss_run(t) − loss_first(t)|`` per
    step for every run after the first (log scale; an exact 0 is drawn at the axis floor; a
    run has the same colour in both panels).

    Args:
        curves: ``(name, losses)`` pairs, the reference first, all with the same step count.
        dpi: the figure's resolution.

    Returns:
        A matplotlib ``Figure`` (not registered with pyplot); ``fig.axes == [loss, delta]``.

    Raises:
        ValueError: fewer than 2 curves, an empty or non-finite curve, or unequal lengths.
    """
    runs = _check(curves)
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from .figure import InlineFigure

    fig = InlineFigure(figsize=(9, 3.4), dpi=dpi)
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    steps = range(1, len(runs[0][1]) + 1)
    styles = ["-", "--", ":", "-."]
    for i, (name, values) in enumerate(runs):
        left.plot(steps, values, styles[i % 4], color=f"C{i}", lw=1.6 - 0.3 * (i % 4), label=name)
    left.set_xlabel("step")
    left.set_ylabel("training loss (nats/char)")
    left.set_title("training loss per step", fontsize=9)
    left.legend(fontsize=8)
    left.grid(alpha=0.3)
    ref = runs[0][1]
    floor = 1e-9
    for i, (name, values) in enumerate(runs[1:], start=1):
        delta = [max(abs(a - b), floor) for a, b in zip(values, ref, strict=True)]
        right.plot(steps, delta, "o-", color=f"C{i}", ms=2.5, lw=0.8, label=name)
    right.set_yscale("log")
    right.set_ylim(floor / 2, None)
    right.set_xlabel("step")
    right.set_ylabel(f"|loss − {runs[0][0]}|")
    right.set_title(f"per step; {floor:g} = exactly equal", fontsize=9)
    right.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def plot_same_run(
    path: str | os.PathLike, curves: Sequence[tuple[str, Sequence[float]]], *, dpi: int = 80
) -> Path:
    """Writes `same_run_figure` as a PNG; returns the path."""
    fig = same_run_figure(curves, dpi=dpi)
    out = Path(os.fspath(path))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=dpi)
    return out


__all__ = ["plot_same_run", "same_run_figure"]
