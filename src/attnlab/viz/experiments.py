"""Line plots of the scaling and temperature experiments (`attnlab.analysis.experiments`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..analysis.experiments import ExperimentResult
from .heatmap import PathLike, new_figure, save_figure

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure


def plot_experiment(
    path: PathLike, result: ExperimentResult, panels: list[list[str]], *, dpi: int = 120
) -> Path:
    """Saves `experiment_figure` ``(result, panels)`` as a PNG; returns the path written."""
    return save_figure(experiment_figure(result, panels), path, dpi)


def experiment_figure(result: ExperimentResult, panels: list[list[str]]) -> Figure:
    """One panel per group of columns, each plotted against the first column (log x axis).

    Args:
        result: an experiment's table.
        panels: column names per panel, e.g. ``[["var q·k", "var q·k/√d_k"], ["entropy", ...]]``.
    """
    for group in panels:
        for name in group:
            if name not in result.columns:
                raise ValueError(f"no column {name!r}; known: {result.columns}")
    fig = new_figure(4.2 * len(panels), 3.4)
    x = result.column(result.columns[0])
    for idx, group in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), idx + 1)
        for name in group:
            ax.plot(x, result.column(name), marker="o", label=name)
        ax.set_xscale("log")
        if all(v > 0 for name in group for v in result.column(name)):
            spread = max(max(result.column(n)) for n in group) / min(
                min(result.column(n)) for n in group
            )
            if spread > 100:
                ax.set_yscale("log")
        ax.set_xlabel(result.columns[0])
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(result.title, fontsize=9)
    return fig


SCALING_PANELS = [
    ["var q·k", "var q·k/√d_k"],
    ["entropy", "entropy scaled"],
    ["grad norm", "grad norm scaled"],
]
KERNEL_REGRESSION_PANELS = [["fit error", "leave-one-out error"], ["pieces averaged"]]
TEMPERATURE_PANELS = [["entropy"], ["max weight", "grad norm"], ["energy U", "free energy F"]]
