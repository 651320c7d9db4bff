"""The results of ``attnlab bench`` as a bar chart (matplotlib, imported inside the function)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..utils.extras import require


def plot_bench(rows: Sequence[Any], path: str | os.PathLike) -> Path:
    """One panel per case: each contender's seconds as a horizontal bar, log scale.

    Args:
        rows: benchmark results with attributes ``case`` (str), ``name`` (str) and ``seconds``
            (float, or None for a contender that did not run, which is left out).
        path: the PNG to write.

    Returns:
        ``path`` as a `Path`.
    """
    Figure = require("matplotlib.figure", "viz", "attnlab.viz.plot_bench").Figure
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    cases = list(dict.fromkeys(r.case for r in rows))
    if not cases:
        raise ValueError("rows must hold at least one benchmark result, got none")
    fig = Figure(figsize=(8, 2.2 * len(cases)))
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(cases), 1, squeeze=False)
    for ax, case in zip(axes[:, 0], cases, strict=True):
        timed = [r for r in rows if r.case == case and r.seconds]
        ax.barh([r.name for r in timed], [r.seconds for r in timed], color="tab:blue")
        ax.set_xscale("log")
        ax.set_title(case, fontsize=9)
        ax.set_xlabel("seconds (log)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return Path(path)


__all__ = ["plot_bench"]
