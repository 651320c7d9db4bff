"""Static attention heatmaps: one PNG, a grid of layers × heads (matplotlib, ``viz`` extra)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import Tensor

from ..utils.extras import require
from .attention_view import _display, check_attention, entropies
from .heatmap import PathLike, save_figure


def attention_png(
    tokens: Sequence[str],
    weights: Tensor | Any,
    path: PathLike,
    *,
    title: str | None = None,
    mask: Sequence[bool] | Tensor | None = None,
    panel_size: float = 1.5,
    max_labels: int = 24,
    cmap: str = "viridis",
    gamma: float = 0.5,
    dpi: int = 100,
) -> Path:
    """Saves every head's ``(T, T)`` attention matrix as one PNG: rows are layers, columns heads.

    Each panel shows query tokens down and key tokens across (row 0 at the top), titled
    ``L<layer> H<head> · <entropy>`` with the head's mask-aware entropy in nats (`entropies`).
    All panels share one colour scale on ``[0, 1]`` with a power norm (``gamma`` < 1 brightens
    small weights) and one colour bar. Token labels are drawn when ``T <= max_labels``. The
    panels are one mosaic image, so even 6 × 12 heads draw in about a second.

    Args:
        tokens: T strings. weights: ``(layers, heads, T, T)`` (or ``(heads, T, T)``) in [0, 1].
        path: where to write the PNG (must end in ``.png``).
        title: the figure title.
        mask: None or T bools (True = real token), used for the entropies.
        panel_size: inches per panel.
        max_labels: the longest input that gets token tick labels.
        cmap: matplotlib colormap name.
        gamma: exponent of the colour norm (1 = linear).
        dpi: pixels per inch.

    Returns:
        The path written.
    """
    matplotlib = require("matplotlib", "viz", "attnlab.viz.attention_png")
    np = require("numpy", "viz", "attnlab.viz.attention_png")
    tokens, w, m = check_attention(tokens, weights, mask)
    if not isinstance(gamma, (int, float)) or isinstance(gamma, bool) or not 0 < gamma <= 1:
        raise ValueError(f"gamma must be a number in (0, 1], got {gamma!r}")
    from matplotlib.colors import PowerNorm
    from matplotlib.figure import Figure

    Ly, H, T, _ = w.shape
    _, entropy = entropies(w, m)  # (layers, heads)
    labels = len(tokens) <= max_labels
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
    height = panel_size * Ly * step_y / T + bottom + (0.6 if title else 0.25)
    fig = Figure(figsize=(width, height))
    ax = fig.add_axes(
        (
            left / width,
            bottom / height,
            1 - (left + 1.0) / width,
            1 - (bottom + (0.6 if title else 0.25)) / height,
        )
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
    ax.tick_params(length=0, labelsize=5)
    if labels:
        shown = [_display(t)[:10] for t in tokens]
        ax.set_yticks(
            [layer * step_y + top + i for layer in range(Ly) for i in range(T)], shown * Ly
        )
        ax.set_xticks(
            [head * step_x + j for head in range(H) for j in range(T)], shown * H, rotation=90
        )
    else:
        ax.set_xticks([])
        ax.set_yticks([])
    ax.set_xlabel("key tokens, one block per head", fontsize=8)
    ax.set_ylabel("query tokens, one block per layer", fontsize=8)
    if title:
        fig.suptitle(title, fontsize=11)
    bar = fig.colorbar(image, ax=ax, shrink=0.6, fraction=0.02, pad=0.01)
    bar.set_label("attention weight (panel titles: entropy, nats)", fontsize=8)
    bar.ax.tick_params(labelsize=7)
    return save_figure(fig, path, dpi)


__all__ = ["attention_png"]
