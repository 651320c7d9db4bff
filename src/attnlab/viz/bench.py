"""The results of ``attnlab bench`` as a bar chart (matplotlib, imported inside the function)."""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..utils.extras import require


def plot_bench(rows: Sequence[Any], path: str | os.PathLike) -> Path:
    """One panel per case: each contender's seconds as a horizontal bar on a linear axis from 0;
    a memory case (rows with a ``peak_bytes`` value) draws each contender's peak memory in MiB.

    The axis starts at zero, so bar lengths are proportional to the times (a log axis with an
    automatic left edge drew a 6 % gap as a 20x longer bar); each bar carries its time in text.
    Panels grow with their number of bars and tick labels are thinned until none overlap.

    Args:
        rows: benchmark results with attributes ``case`` (str), ``name`` (str) and ``seconds``
            (float, or None for a contender that did not run, which is left out), and
            optionally ``peak_bytes`` (int or None: a memory row's peak RSS growth).
        path: the PNG to write.

    Returns:
        ``path`` as a `Path`.
    """
    fig = bench_figure(rows)
    fig.savefig(path, dpi=120)
    return Path(path)


def bench_figure(rows: Sequence[Any]) -> Any:
    """The matplotlib Figure `plot_bench` writes (an Agg canvas, not registered with pyplot)."""
    require("matplotlib.figure", "viz", "attnlab.viz.plot_bench")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.ticker import MaxNLocator

    from .figure import InlineFigure

    cases = list(dict.fromkeys(r.case for r in rows))
    if not cases:
        raise ValueError("rows must hold at least one benchmark result, got none")
    memory = {c for c in cases if any(_peak(r) is not None for r in rows if r.case == c)}
    timed = {
        c: [r for r in rows if r.case == c and (_peak(r) is not None if c in memory else r.seconds)]
        for c in cases
    }
    heights = [1.2 + 0.3 * max(1, len(t)) for t in timed.values()]
    fig = InlineFigure(figsize=(8, sum(heights) + 0.3), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(cases), 1, squeeze=False, height_ratios=heights)
    for ax, case in zip(axes[:, 0], cases, strict=True):
        bars = timed[case]
        in_memory = case in memory
        values = [_peak(r) / 2**20 if in_memory else r.seconds for r in bars]
        ax.barh(range(len(bars)), values, color="tab:orange" if in_memory else "tab:blue")
        ax.set_yticks(range(len(bars)), [r.name for r in bars], fontsize=8)
        ax.invert_yaxis()  # the first contender at the top
        ax.set_xlim(0, 1.25 * max(values, default=1.0) or 1.0)  # room for the value labels
        ax.xaxis.set_major_locator(MaxNLocator(nbins=6))
        ax.tick_params(axis="x", labelsize=8)
        for n, x in enumerate(values):
            label = f"{x:,.3g} MiB" if in_memory else _seconds(x)
            ax.text(x, n, " " + label, va="center", fontsize=7)
        ax.set_title(case, fontsize=9)
        ax.set_xlabel("peak RSS growth (MiB)" if in_memory else "seconds", fontsize=8)
    _thin_tick_labels(fig)
    return fig


def _peak(row: Any) -> int | None:
    """A row's peak memory in bytes, or None (a timing row)."""
    return getattr(row, "peak_bytes", None)


def _seconds(t: float) -> str:
    """A time with 3 significant digits: ``"184 ms"``, ``"2.29 s"``."""
    return f"{t * 1e3:.3g} ms" if t < 1 else f"{t:.3g} s"


def _thin_tick_labels(fig: Any) -> None:
    """Hides every other x tick label of an axis until its visible labels do not overlap."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        for _ in range(4):
            labels = [t for t in ax.get_xticklabels() if t.get_visible() and t.get_text()]
            boxes = [t.get_window_extent(renderer) for t in labels]
            if not any(a.overlaps(b) for a, b in itertools.pairwise(boxes)):
                break
            ax.set_xticks(ax.get_xticks()[::2])
            fig.canvas.draw()


__all__ = ["bench_figure", "plot_bench"]
