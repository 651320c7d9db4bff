"""Pictures of positional encodings: the sinusoidal table, RoPE's spectrum, ALiBi/T5 biases."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .._shapes import check_int
from ..masks import Mask, causal
from ..positional import RoPE, dense_bias, sinusoidal
from .heatmap import (
    PathLike,
    draw_heatmap,
    figure_and_axes,
    heatmaps_figure,
    new_figure,
    save_figure,
)

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


def plot_sinusoidal(
    path: PathLike,
    length: int = 128,
    dim: int = 64,
    base: float = 10000.0,
    *,
    dpi: int = 100,
) -> Path:
    """Saves `sinusoidal_figure` as a PNG; returns the path written."""
    return save_figure(sinusoidal_figure(length, dim, base), path, dpi)


def sinusoidal_figure(
    length: int = 128, dim: int = 64, base: float = 10000.0, *, ax: Axes | None = None
) -> Figure:
    """The sinusoidal table ``PE (length, dim)`` as a heatmap: positions down, dims across.

    Fast sin/cos pairs on the left vary from row to row; slow pairs on the right barely change.

    Args:
        length, dim, base: the table (`attnlab.positional.sinusoidal`).
        ax: draw into this Axes (its figure is returned); default a new Figure.
    """
    table = sinusoidal(length, dim, base, dtype=torch.float64)  # (P, E)
    fig, ax = figure_and_axes(ax, 7.0, 5.0)
    draw_heatmap(
        fig,
        ax,
        table,
        title=f"sinusoidal PE (dim={dim}, base={base:g})",
        xlabel="dimension (even: sin, odd: cos)",
        ylabel="position p",
        cmap="RdBu_r",
        vmin=-1.0,
        vmax=1.0,
        colorbar_label="PE[p, d]",
    )
    return fig


def plot_rope_spectrum(
    path: PathLike,
    rope: RoPE | Mapping[str, RoPE],
    length: int = 256,
    *,
    dpi: int = 100,
) -> Path:
    """Saves `rope_spectrum_figure` as a PNG; returns the path written."""
    return save_figure(rope_spectrum_figure(rope, length), path, dpi)


def rope_spectrum_figure(
    rope: RoPE | Mapping[str, RoPE],
    length: int = 256,
    *,
    axes: tuple[Axes, Axes] | None = None,
) -> Figure:
    """RoPE's frequency spectrum: ``cos(p·θ_i)`` as a heatmap, and wavelengths per pair.

    Left: the rotation angle of every pair i (rows) at positions ``0..length−1`` (columns) for the
    first RoPE. Right: the wavelength ``2π/θ_i`` of every pair on a log axis, one line per RoPE,
    which shows how a scaling (linear, ntk, yarn, llama3, …) stretches the slow frequencies.

    Args:
        rope: a `RoPE`, or ``{label: RoPE}`` to compare several.
        length: positions shown in the heatmap.
        axes: ``(left, right)`` Axes to draw into (their figure is returned); default a new
            Figure with both.
    """
    ropes = {"rope": rope} if isinstance(rope, RoPE) else dict(rope)
    if not ropes or not all(isinstance(r, RoPE) for r in ropes.values()):
        raise ValueError(f"rope must be a RoPE or a non-empty {{label: RoPE}} dict, got {rope!r}")
    label, first = next(iter(ropes.items()))
    cos, _ = first.cos_sin(torch.arange(length), dtype=torch.float64)  # (P, R/2)
    if axes is None:
        fig = new_figure(12.0, 4.8)
        left, right = fig.subplots(1, 2, width_ratios=(3, 2))
    else:
        left, right = axes
        fig = left.figure
    draw_heatmap(
        fig,
        left,
        cos.T / first.attention_scaling,
        title=f"cos(p·θ_i), {label}",
        xlabel="position p",
        ylabel="pair i (fast → slow)",
        cmap="RdBu_r",
        vmin=-1.0,
        vmax=1.0,
    )
    originals = set()
    for name, r in ropes.items():
        wavelength = 2 * math.pi / r.inv_freq  # (R/2,)
        right.plot(wavelength.numpy(), marker=".", label=name)
        original = (r.scaling or {}).get("original_max_position_embeddings")
        if isinstance(original, int) and original not in originals:
            originals.add(original)
            right.axhline(original, color="grey", linestyle=":", linewidth=1)
    right.set_yscale("log")
    right.set_xlabel("pair i")
    right.set_ylabel("wavelength 2π/θ_i (positions)")
    right.set_title("RoPE spectrum" + (" (dotted: original length)" if originals else ""))
    right.grid(True, which="both", alpha=0.3)
    right.legend(fontsize=8)
    return fig


def plot_bias(
    path: PathLike,
    bias: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor],
    L: int,
    S: int | None = None,
    *,
    dpi: int = 100,
    **kwargs: object,
) -> Path:
    """Saves `bias_figure` ``(bias, L, S, **kwargs)`` as a PNG; returns the path written."""
    return save_figure(bias_figure(bias, L, S, **kwargs), path, dpi)  # type: ignore[arg-type]


def bias_figure(
    bias: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor],
    L: int,
    S: int | None = None,
    *,
    num_heads: int | None = None,
    heads: list[int] | None = None,
    title: str | None = None,
    ncols: int = 4,
    mask: Mask | str | None = "auto",
) -> Figure:
    """A function bias (ALiBi, T5RelativeBias, …) as one ``(L, S)`` heatmap per head.

    Cells the mask removes are drawn blank (NaN), not coloured by a bias that never applies: a
    causal ALiBi's biases on future keys (positive, brighter than any real one) are hidden.

    A grid (one Axes per head) has a figure of its own, so there is no ``ax=``.

    Args:
        bias: a function bias ``fn(b, h, i, j)``; ALiBi and T5RelativeBias know their head count.
        L: query length. S: key length (default L); rows are aligned bottom-right.
        num_heads: H, for biases that do not carry ``num_heads``.
        heads: which heads to draw (default all, up to 8).
        title: figure title (default: the bias's repr).
        ncols: panels per row.
        mask: the mask the bias is used with (batch item 0 is drawn): ``"auto"`` (default) is
            ``masks.causal()`` for a bias with ``causal=True`` (ALiBi's decoder form) and no mask
            otherwise; None draws every cell.
    """
    H = num_heads if num_heads is not None else getattr(bias, "num_heads", None)
    if H is None:
        raise ValueError("num_heads must be given for this bias (a positive int), got None")
    check_int("num_heads", H, minimum=1)
    if isinstance(mask, str) and mask != "auto":
        raise ValueError(f"mask must be a Mask, None or 'auto', got {mask!r}")
    if mask == "auto":
        mask = causal() if getattr(bias, "causal", False) is True else None
    if mask is not None and not isinstance(mask, Mask):
        raise TypeError(f"mask must be a Mask, None or 'auto', got {type(mask).__name__}")
    with torch.no_grad():
        dense = dense_bias(bias, H, L, S).double()  # (H, L, S)
        if mask is not None:
            keep = mask.to_dense(L, dense.shape[-1], heads=H)[0]  # (H|1, L, S), batch item 0
            dense = dense.masked_fill(~keep, math.nan)  # drawn blank
    chosen = list(range(min(H, 8))) if heads is None else list(heads)
    bad = [h for h in chosen if not 0 <= h < H]
    if bad or not chosen:
        raise ValueError(f"heads must be a non-empty list of indices in [0, {H}), got {heads!r}")
    slopes = getattr(bias, "slopes", None)  # ALiBi: show each head's slope
    if isinstance(slopes, Tensor) and slopes.numel() == H:
        titles = [f"head {h}, slope {float(slopes[h]):.3g}" for h in chosen]
    else:
        titles = [f"head {h}" for h in chosen]
    return heatmaps_figure(
        [dense[h] for h in chosen],
        titles=titles,
        suptitle=(title if title is not None else repr(bias))
        + ("" if mask is None else f"; blank: masked by {mask!r}"),
        ncols=ncols,
        colorbar_label="bias",
    )
