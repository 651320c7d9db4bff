"""Static attention heatmaps: one PNG, a grid of layers × heads (matplotlib, ``viz`` extra)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import Tensor

from .._shapes import check_int, check_number
from ..utils.extras import require
from .attention_view import _display, check_attention, entropies
from .heatmap import PathLike, save_figure, wrap_to_width

# Font size of the token tick labels, and the spacing they need (points per label).
LABEL_FONTSIZE = 6
_LABEL_PITCH = 1.5 * LABEL_FONTSIZE


def attention_png(
    tokens: Sequence[str],
    weights: Tensor | Any,
    path: PathLike,
    *,
    title: str | None = None,
    mask: Sequence[bool] | Tensor | None = None,
    panel_size: float = 1.5,
    max_labels: int | None = None,
    cmap: str = "viridis",
    gamma: float = 0.5,
    dpi: int = 100,
) -> Path:
    """Saves every head's ``(T, T)`` attention matrix as one PNG: rows are layers, columns heads.

    Each panel shows query tokens down and key tokens across (row 0 at the top), titled
    ``L<layer> H<head> · <entropy>`` with the head's mask-aware entropy in nats (`entropies`).
    All panels share one colour scale on ``[0, 1]`` with a power norm (``gamma`` < 1 brightens
    small weights) and one colour bar. Every token is labelled while the labels fit the panel at
    a readable size; a longer input labels every k-th token as ``index:token`` (never none, never
    overlapping). The title is wrapped to the figure's width. The panels are one mosaic image,
    so even 6 × 12 heads draw in about a second.

    Args:
        tokens: T strings. weights: ``(layers, heads, T, T)`` (or ``(heads, T, T)``) in [0, 1].
        path: where to write the PNG (must end in ``.png``).
        title: the figure title.
        mask: None or T bools (True = real token), used for the entropies.
        panel_size: inches per panel.
        max_labels: at most this many token labels per panel side (default: as many as fit;
            0: none).
        cmap: matplotlib colormap name.
        gamma: exponent of the colour norm (1 = linear).
        dpi: pixels per inch.

    Returns:
        The path written.
    """
    fig = attention_figure(
        tokens,
        weights,
        title=title,
        mask=mask,
        panel_size=panel_size,
        max_labels=max_labels,
        cmap=cmap,
        gamma=gamma,
    )
    return save_figure(fig, path, dpi)


def label_step(T: int, panel_size: float, max_labels: int | None = None) -> int:
    """Label every k-th of T tokens: the smallest k whose labels are ``_LABEL_PITCH`` apart."""
    k = max(1, math.ceil(_LABEL_PITCH * T / (72 * panel_size)))
    if max_labels is not None and max_labels > 0:
        k = max(k, math.ceil(T / max_labels))
    return k


def attention_figure(
    tokens: Sequence[str],
    weights: Tensor | Any,
    *,
    title: str | None = None,
    mask: Sequence[bool] | Tensor | None = None,
    panel_size: float = 1.5,
    max_labels: int | None = None,
    cmap: str = "viridis",
    gamma: float = 0.5,
) -> Any:
    """The matplotlib Figure `attention_png` saves (same arguments, without path and dpi)."""
    matplotlib = require("matplotlib", "viz", "attnlab.viz.attention_png")
    np = require("numpy", "viz", "attnlab.viz.attention_png")
    tokens, w, m = check_attention(tokens, weights, mask)
    if check_number("gamma", gamma, positive=True) > 1:
        raise ValueError(f"gamma must be in (0, 1], got {gamma!r}")
    if max_labels is not None:
        check_int("max_labels", max_labels, minimum=0)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import PowerNorm

    from .figure import InlineFigure

    Ly, H, T, _ = w.shape
    _, entropy = entropies(w, m)  # (layers, heads)
    labels = max_labels != 0
    step = label_step(T, panel_size, max_labels)
    # One mosaic image (a single imshow is ~10x faster than layers × heads axes): panels of
    # T × T cells separated by NaN gaps, drawn white; a taller gap above holds the panel title.
    gap = max(1, round(0.06 * T / panel_size))
    top = max(2, round(0.16 * T / panel_size))
    step_x, step_y = T + gap, T + top
    mosaic = np.full((Ly * step_y, H * step_x - gap), np.nan)
    data = w.numpy()
    for layer in range(Ly):
        for head in range(H):
            y0, x0 = layer * step_y + top, head * step_x
            mosaic[y0 : y0 + T, x0 : x0 + T] = data[layer, head]
    left = 0.9 if labels else 0.35
    bottom = 0.8 if labels else 0.2
    width = panel_size * H * step_x / T + left + 1.0
    if title:
        title = wrap_to_width(title, width - 0.3, 11)
    head_room = 0.45 + 0.2 * title.count("\n") if title else 0.25
    height = panel_size * Ly * step_y / T + bottom + head_room
    fig = InlineFigure(figsize=(width, height))
    FigureCanvasAgg(fig)
    ax = fig.add_axes(
        (left / width, bottom / height, 1 - (left + 1.0) / width, 1 - (bottom + head_room) / height)
    )
    cm = matplotlib.colormaps[cmap].with_extremes(bad="white")
    norm = PowerNorm(gamma=gamma, vmin=0.0, vmax=1.0)
    image = ax.imshow(mosaic, cmap=cm, norm=norm, aspect="auto", interpolation="nearest")
    for side in ax.spines.values():
        side.set_visible(False)
    for layer in range(Ly):
        for head in range(H):
            ax.text(
                head * step_x + T / 2 - 0.5,
                layer * step_y + top - 0.7,
                f"L{layer} H{head} · {entropy[layer, head]:.2f}",
                ha="center",
                va="bottom",
                fontsize=7,
            )
    ax.tick_params(length=0, labelsize=LABEL_FONTSIZE)
    if labels:
        shown_idx = list(range(0, T, step))
        if step == 1:
            shown = [_display(tokens[i])[:10] for i in shown_idx]
        else:
            shown = [f"{i}:{_display(tokens[i])[:8]}" for i in shown_idx]
        ax.set_yticks(
            [layer * step_y + top + i for layer in range(Ly) for i in shown_idx], shown * Ly
        )
        ax.set_xticks(
            [head * step_x + j for head in range(H) for j in shown_idx], shown * H, rotation=90
        )
    else:
        ax.set_xticks([])
        ax.set_yticks([])
    ax.set_xlabel("key tokens, one block per head", fontsize=8)
    ax.set_ylabel("query tokens, one block per layer", fontsize=8)
    if title:
        fig.suptitle(title, fontsize=11, y=1 - 0.08 / height, va="top")
    bar = fig.colorbar(image, ax=ax, shrink=0.6, fraction=0.02, pad=0.01)
    bar.set_label("attention weight (panel titles: entropy, nats)", fontsize=8)
    bar.ax.tick_params(labelsize=7)
    return fig


__all__ = ["attention_figure", "attention_png", "label_step"]
