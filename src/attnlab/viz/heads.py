"""The head-pruning sweep of `attnlab.analysis.heads` as a PNG line plot (matplotlib)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..analysis.heads import PruningSweep
from .heatmap import PathLike, figure_and_axes, save_figure

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


def plot_pruning(path: PathLike, sweep: PruningSweep, *, dpi: int = 120) -> Path:
    """Embedding cosine to the unpruned model against the fraction of heads pruned.

    One line per order (importance, random mean), the individual random seeds as thin lines,
    and the threshold (e.g. 0.95) as a dashed line.

    Args:
        path: where to write the PNG (must end in .png).
        sweep: the result of `attnlab.analysis.pruning_sweep`.
        dpi: resolution.

    Returns:
        The path written.
    """
    if Path(path).suffix.lower() != ".png":  # before any drawing
        raise ValueError(f"path must end in .png, got {str(path)!r}")
    return save_figure(pruning_figure(sweep), path, dpi)


def pruning_figure(sweep: PruningSweep, *, ax: Axes | None = None) -> Figure:
    """The figure `plot_pruning` saves; ``ax``: draw into this Axes (its figure is returned)."""
    if not isinstance(sweep, PruningSweep):
        raise TypeError(f"sweep must be a PruningSweep, got {type(sweep).__name__}")
    fig, ax = figure_and_axes(ax, 6.0, 4.0)
    x = sweep.fractions
    for run in sweep.random_runs:
        ax.plot(x, run, color="tab:orange", lw=0.6, alpha=0.4)
    styles = {"importance": ("tab:blue", "o"), "random": ("tab:orange", "s")}
    for order, values in sweep.metric.items():
        color, marker = styles.get(order, (None, "^"))
        kept = sweep.kept_fraction(order)
        ax.plot(
            x,
            values,
            marker=marker,
            color=color,
            label=f"{order} order (≥ threshold to {kept:.0%})",
        )
    ax.axhline(sweep.threshold, color="gray", ls="--", lw=0.8, label=f"cosine {sweep.threshold}")
    ax.set_xlabel(f"fraction of the {sweep.heads} heads pruned")
    ax.set_ylabel("mean cosine to unpruned embeddings")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(
        f"all-MiniLM-L6-v2 head pruning: {sweep.eval_sentences} Alice sentences, "
        f"random = mean of {len(sweep.random_runs)} seeds",
        fontsize=9,
    )
    return fig


__all__ = ["plot_pruning", "pruning_figure"]
