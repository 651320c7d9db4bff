"""General heatmaps: one matrix, or a grid of matrices (e.g. one per head), saved as a PNG."""

from __future__ import annotations

import math
import os
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .._shapes import check_int
from ..utils.extras import require

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

PathLike = str | os.PathLike[str]


def new_figure(width: float, height: float) -> Figure:
    """A matplotlib Figure that is not registered with pyplot (no global state, no GUI backend)
    and that Jupyter displays as it is returned (`figure.InlineFigure`)."""
    require("matplotlib.figure", "viz", "attnlab.viz")  # the error naming the extra
    from .figure import InlineFigure

    return InlineFigure(figsize=(width, height), layout="constrained")


def figure_and_axes(ax: Axes | None, width: float, height: float) -> tuple[Figure, Axes]:
    """``(ax.figure, ax)`` for a caller's Axes, else a new `new_figure` with one Axes.

    A caller's figure without a layout engine gets matplotlib's constrained layout, which makes
    room for the colour bars and labels drawn here (without one, a panel's colour-bar label and
    the next panel's axis label overlap, and bottom labels are cut); a figure with an engine of
    its own keeps it."""
    if ax is not None:
        if ax.figure.get_layout_engine() is None:
            ax.figure.set_layout_engine("constrained")
        return ax.figure, ax
    fig = new_figure(width, height)
    return fig, fig.add_subplot()


def wrap_to_width(text: str, width: float, fontsize: float) -> str:
    """``text`` wrapped at spaces so that every line is at most ``width`` inches wide.

    Measured with matplotlib's Agg renderer at ``fontsize`` points (a word longer than the width
    is broken), so a figure title stays inside its figure instead of being clipped at the edges.

    Args:
        text: the title (may hold newlines). width: inches. fontsize: points.

    Returns:
        The wrapped text.
    """
    Figure = require("matplotlib.figure", "viz", "attnlab.viz").Figure
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    scratch = Figure(figsize=(1, 1), dpi=72)
    renderer = FigureCanvasAgg(scratch).get_renderer()
    probe = scratch.text(0, 0, "", fontsize=fontsize)

    def fits(candidate: str) -> bool:
        for line in candidate.split("\n"):
            probe.set_text(line)
            if probe.get_window_extent(renderer).width > width * 72:
                return False
        return True

    chars = max(len(line) for line in text.split("\n")) if text else 0
    wrapped = text
    while chars > 1 and not fits(wrapped):
        chars = max(1, int(chars * 0.9))
        wrapped = "\n".join(
            textwrap.fill(line, chars, break_long_words=True) for line in text.split("\n")
        )
    return wrapped


def save_figure(fig: Figure, path: PathLike, dpi: int) -> Path:
    """Writes the figure as a PNG (creating parent folders) and returns the path."""
    out = Path(path)
    if out.suffix.lower() != ".png":
        raise ValueError(f"path must end in .png, got {str(out)!r}")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=dpi)
    return out


def as_matrix(name: str, matrix: Tensor | Any) -> Any:
    """A 2-D float64 numpy array from a tensor or array-like (ValueError naming the shape)."""
    t = matrix.detach() if isinstance(matrix, Tensor) else torch.as_tensor(matrix)
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D (rows, cols), got shape {tuple(t.shape)}")
    return t.to("cpu", torch.float64).numpy()


def draw_heatmap(
    fig: Figure,
    ax: Axes,
    matrix: Tensor | Any,
    *,
    title: str | None = None,
    xlabel: str | None = None,
    ylabel: str | None = None,
    cmap: str = "viridis",
    vmin: float | None = None,
    vmax: float | None = None,
    colorbar_label: str | None = None,
    name: str = "matrix",
) -> None:
    """Draws one matrix on ``ax``: row 0 at the top, one cell per entry, with a colorbar."""
    data = as_matrix(name, matrix)
    image = ax.imshow(data, cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto", interpolation="nearest")
    if title:
        ax.set_title(title, fontsize=10)
    if xlabel:
        ax.set_xlabel(xlabel)
    if ylabel:
        ax.set_ylabel(ylabel)
    bar = fig.colorbar(image, ax=ax, shrink=0.9)
    if colorbar_label:
        bar.set_label(colorbar_label)


def heatmap_figure(
    matrix: Tensor | Any,
    *,
    ax: Axes | None = None,
    title: str | None = None,
    xlabel: str | None = "key position j",
    ylabel: str | None = "query position i",
    cmap: str = "viridis",
    vmin: float | None = None,
    vmax: float | None = None,
    colorbar_label: str | None = None,
    size: tuple[float, float] = (6.0, 5.0),
) -> Figure:
    """One ``(rows, cols)`` matrix as a heatmap (row 0 at the top); returns the Figure.

    Args:
        matrix: 2-D tensor or array, e.g. attention weights ``(L, S)`` of one head.
        ax: draw into this matplotlib Axes (its figure gets the colour bar and is returned);
            default a new Figure of ``size`` inches, not registered with pyplot.
        title, xlabel, ylabel, cmap, vmin, vmax, colorbar_label: as in `heatmap`.
        size: figure size in inches when ``ax`` is None.
    """
    fig, ax = figure_and_axes(ax, *size)
    draw_heatmap(
        fig,
        ax,
        matrix,
        title=title,
        xlabel=xlabel,
        ylabel=ylabel,
        cmap=cmap,
        vmin=vmin,
        vmax=vmax,
        colorbar_label=colorbar_label,
    )
    return fig


def heatmap(
    matrix: Tensor | Any,
    path: PathLike,
    *,
    title: str | None = None,
    xlabel: str | None = "key position j",
    ylabel: str | None = "query position i",
    cmap: str = "viridis",
    vmin: float | None = None,
    vmax: float | None = None,
    colorbar_label: str | None = None,
    size: tuple[float, float] = (6.0, 5.0),
    dpi: int = 100,
) -> Path:
    """Saves one ``(rows, cols)`` matrix as a PNG heatmap (row 0 at the top); see
    `heatmap_figure` for the Figure itself (and ``ax=``).

    Args:
        matrix: 2-D tensor or array, e.g. attention weights ``(L, S)`` of one head.
        path: where to write the PNG.
        title, xlabel, ylabel: text; the default labels suit ``(L, S)`` attention matrices.
        cmap: matplotlib colormap name.
        vmin, vmax: colour range (default: the data range).
        colorbar_label: label of the colour bar.
        size: figure size in inches.
        dpi: pixels per inch.

    Returns:
        The path written.
    """
    if Path(path).suffix.lower() != ".png":  # before any drawing
        raise ValueError(f"path must end in .png, got {str(path)!r}")
    fig = heatmap_figure(
        matrix,
        title=title,
        xlabel=xlabel,
        ylabel=ylabel,
        cmap=cmap,
        vmin=vmin,
        vmax=vmax,
        colorbar_label=colorbar_label,
        size=size,
    )
    return save_figure(fig, path, dpi)


def heatmaps(
    matrices: Tensor | Sequence[Tensor | Any],
    path: PathLike,
    *,
    dpi: int = 100,
    **kwargs: Any,
) -> Path:
    """Saves `heatmaps_figure` ``(matrices, **kwargs)`` as a PNG (grid of heatmaps, e.g. one
    panel per head of an ``(H, L, S)`` tensor); returns the path written."""
    return save_figure(heatmaps_figure(matrices, **kwargs), path, dpi)


def heatmaps_figure(
    matrices: Tensor | Sequence[Tensor | Any],
    *,
    titles: Sequence[str] | None = None,
    suptitle: str | None = None,
    ncols: int = 4,
    xlabel: str | None = "key position j",
    ylabel: str | None = "query position i",
    cmap: str = "viridis",
    shared_scale: bool = False,
    colorbar_label: str | None = None,
    panel_size: float = 3.0,
) -> Figure:
    """A grid of heatmaps, e.g. one panel per head of an ``(H, L, S)`` tensor, as a Figure.

    A grid needs a figure of its own (one Axes per panel), so there is no ``ax=``; draw one
    panel into your own Axes with `heatmap_figure`.

    Args:
        matrices: ``(N, rows, cols)`` tensor or a sequence of N 2-D matrices.
        titles: one title per panel (default "head 0", "head 1", …).
        suptitle: title of the whole figure.
        ncols: panels per row.
        xlabel, ylabel: axis labels of every panel.
        cmap: matplotlib colormap name.
        shared_scale: one colour range for all panels (default: each panel its own, which suits
            heads whose scales differ, like ALiBi's slopes).
        colorbar_label: label of the colour bars.
        panel_size: inches per panel.
    """
    panels = list(matrices.unbind(0)) if isinstance(matrices, Tensor) else list(matrices)
    if not panels:
        raise ValueError("matrices must hold at least one matrix, got none")
    if titles is not None and len(titles) != len(panels):
        raise ValueError(
            f"titles must have one entry per matrix ({len(panels)}), got {len(titles)}"
        )
    check_int("ncols", ncols, minimum=1)
    numpy = require("numpy", "viz", "attnlab.viz")
    data = [as_matrix(f"matrices[{n}]", m) for n, m in enumerate(panels)]
    vmin = vmax = None
    if shared_scale:
        # NaN cells are blank (masked): the range is over the drawn cells
        drawn = [d[~numpy.isnan(d)] for d in data]
        drawn = [d for d in drawn if d.size]
        vmin = min(float(d.min()) for d in drawn) if drawn else None
        vmax = max(float(d.max()) for d in drawn) if drawn else None
    cols = min(ncols, len(data))
    rows = math.ceil(len(data) / cols)
    width = panel_size * cols + 0.8
    if suptitle:
        suptitle = wrap_to_width(suptitle, width - 0.3, 12)
    height = panel_size * rows + (0.3 + 0.25 * suptitle.count("\n") + 0.2 if suptitle else 0.0)
    fig = new_figure(width, height)
    if suptitle:
        fig.suptitle(suptitle, fontsize=12)
    for n, d in enumerate(data):
        ax = fig.add_subplot(rows, cols, n + 1)
        draw_heatmap(
            fig,
            ax,
            d,
            title=titles[n] if titles is not None else f"head {n}",
            xlabel=xlabel if n // cols == rows - 1 else None,
            ylabel=ylabel if n % cols == 0 else None,
            cmap=cmap,
            vmin=vmin,
            vmax=vmax,
            colorbar_label=colorbar_label,
        )
    return fig
