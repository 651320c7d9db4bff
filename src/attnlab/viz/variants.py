"""Pictures of today's attention variants from their weights (matplotlib, the ``viz`` extra).

- `sinks_figure` / `plot_sinks`: attention sinks (GPT-OSS): the sink's mean share per head, each
  row's share (``p_sink,i = e^{s_h} / (e^{s_h} + Σ_j e^{l_ij}) = 1 − Σ_j p_ij``) per head, and
  the ordinary weights of one head beside them.
- `differential_figure` / `plot_differential`: differential attention: for each head pair the
  two maps ``softmax(Q₁K₁ᵀ/√D)``, ``softmax(Q₂K₂ᵀ/√D)`` and ``first − λ·second``.

The weights come from a real module or model: `attnlab.analysis.module_attentions` on a model
with `MultiHeadAttention(sinks=True)` or `DifferentialAttention`, or transformers'
``output_attentions`` of GPT-OSS run through the bridge.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from torch import Tensor

from ..analysis.weights import differential_maps, head_sink_share, sink_share
from .heatmap import PathLike, draw_heatmap, new_figure, save_figure

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure


def _heads_weights(name: str, weights: object) -> Tensor:
    """``weights`` as ``(H, L, S)`` (batch item or layer 0 of a 4-D tensor is not guessed)."""
    if not isinstance(weights, Tensor) or not weights.is_floating_point():
        got = f"dtype {weights.dtype}" if isinstance(weights, Tensor) else type(weights).__name__
        raise TypeError(f"{name} must be a float tensor (H, L, S), got {got}")
    if weights.dim() != 3:
        raise ValueError(
            f"{name} must be (H, L, S): one sequence's weights of one layer, got shape "
            f"{tuple(weights.shape)} (index the batch / layer first, e.g. weights[0])"
        )
    return weights.detach().to("cpu")


def _integer_ticks(*axes: object) -> None:
    """Whole-number ticks (positions and heads) on the axes of heatmaps and bars."""
    from matplotlib.ticker import MaxNLocator

    for ax in axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # type: ignore[attr-defined]
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # type: ignore[attr-defined]


def sinks_figure(
    weights: Tensor,
    *,
    head: int | None = None,
    tokens: Sequence[str] | None = None,
    title: str | None = None,
) -> Figure:
    """The sink's share of attention per head and per row, with one head's weights beside it.

    Three panels: the mean share of each head over its rows with a key (`head_sink_share`);
    the share of every row (`sink_share`, heads × query rows, 0 … 1); and the ordinary weights
    ``p_ij`` of ``head``, whose rows sum to ``1 − p_sink,i``.

    Args:
        weights: ``(H, L, S)`` weights without the sink column (`MultiHeadAttention(sinks=True)`
            with ``need_weights=True``, `attnlab.analysis.module_attentions` ``[layer]``, or
            transformers' ``output_attentions[layer][b]`` of GPT-OSS).
        head: the head whose weights are drawn; default the head with the largest mean share.
        tokens: optional labels of the L query rows (= keys when L = S).
        title: the figure's title.

    Returns:
        A matplotlib Figure (not registered with pyplot).
    """
    w = _heads_weights("weights", weights)
    H, L, S = w.shape
    per_row = sink_share(w)  # (H, L), NaN for rows with no key
    per_head = head_sink_share(w)  # (H,)
    if head is None:
        head = int(per_head.nan_to_num(-1.0).argmax())
    if not isinstance(head, int) or not 0 <= head < H:
        raise ValueError(f"head must be an int in [0, {H}), got {head!r}")
    fig = new_figure(13.0, 4.0)
    if title:
        fig.suptitle(title, fontsize=12)
    bars, rows, one = fig.subplots(1, 3, width_ratios=[1.0, 1.6, 1.4])
    bars.bar(range(H), per_head.to(float).numpy(), color="tab:purple")
    bars.set_xticks(range(H))
    bars.set_ylim(0.0, 1.0)
    bars.set_xlabel("head h")
    bars.set_ylabel("mean sink share")
    bars.set_title("sink share per head", fontsize=10)
    bars.grid(True, axis="y", alpha=0.3)
    draw_heatmap(
        fig,
        rows,
        per_row,
        title=r"sink share of each row  $e^{s_h} / (e^{s_h} + \Sigma_j e^{l_{ij}})$",
        xlabel="query position i",
        ylabel="head h",
        cmap="magma",
        vmin=0.0,
        vmax=1.0,
        colorbar_label=r"$p_{sink}$",
        name="sink share",
    )
    draw_heatmap(
        fig,
        one,
        w[head],
        title=rf"head {head}: weights $p_{{ij}}$ (rows sum to $1 - p_{{sink}}$)",
        xlabel="key position j",
        ylabel="query position i",
        cmap="viridis",
        vmin=0.0,
        colorbar_label=r"$p_{ij}$",
        name="weights",
    )
    _integer_ticks(rows, one)
    if tokens is not None:
        if len(tokens) != L:
            raise ValueError(f"tokens must have one label per query row ({L}), got {len(tokens)}")
        rows.set_xticks(range(L), list(tokens), rotation=90, fontsize=7)
        one.set_yticks(range(L), list(tokens), fontsize=7)
        if S == L:
            one.set_xticks(range(S), list(tokens), rotation=90, fontsize=7)
    return fig


def plot_sinks(path: PathLike, weights: Tensor, *, dpi: int = 110, **kwargs: object) -> Path:
    """Saves `sinks_figure` ``(weights, **kwargs)`` as a PNG; returns the path written."""
    if Path(path).suffix.lower() != ".png":  # before any drawing
        raise ValueError(f"path must end in .png, got {str(path)!r}")
    return save_figure(sinks_figure(weights, **kwargs), path, dpi)  # type: ignore[arg-type]


def differential_figure(
    weights: Tensor,
    lam: float | Tensor,
    *,
    pairs: Sequence[int] | None = None,
    title: str | None = None,
    panel_size: float = 3.0,
) -> Figure:
    """The two maps of differential attention and their difference, one row per head pair.

    Columns: ``softmax(Q₁K₁ᵀ/√D)`` (head h), ``softmax(Q₂K₂ᵀ/√D)`` (head h + H/2), and
    ``first − λ·second`` (a diverging colour scale centred on 0): the map that weighs the values
    before the head norm.

    Args:
        weights: ``(H, L, S)`` from `DifferentialAttention` with ``need_weights=True`` (or
            `attnlab.analysis.module_attentions` ``[layer]``): first maps, then second maps.
        lam: λ of the layer (`DifferentialAttention.lam()`).
        pairs: the head pairs drawn (default all H/2).
        title: the figure's title.
        panel_size: inches per panel.

    Returns:
        A matplotlib Figure (not registered with pyplot).
    """
    w = _heads_weights("weights", weights)
    lam = lam.detach().to("cpu") if isinstance(lam, Tensor) else lam
    first, second, diff = differential_maps(w, lam)  # (H/2, L, S) each
    n = first.shape[0]
    chosen = list(range(n)) if pairs is None else list(pairs)
    if not chosen or any(not isinstance(p, int) or not 0 <= p < n for p in chosen):
        raise ValueError(f"pairs must be ints in [0, {n}) (H/2 pairs), got {pairs!r}")
    lam_value = float(lam)
    fig = new_figure(3 * panel_size + 1.2, panel_size * len(chosen) + (0.5 if title else 0.0))
    if title:
        fig.suptitle(title, fontsize=12)
    axes = fig.subplots(len(chosen), 3, squeeze=False)
    H = w.shape[0]
    for r, p in enumerate(chosen):
        bound = float(diff[p].abs().max()) or 1.0
        last = r == len(chosen) - 1
        panels = (
            (first[p], f"pair {p}: softmax(Q₁K₁ᵀ/√D) (head {p})", "viridis", 0.0, None),
            (second[p], f"softmax(Q₂K₂ᵀ/√D) (head {p + H // 2})", "viridis", 0.0, None),
            (diff[p], f"first − λ·second (λ = {lam_value:.3f})", "RdBu_r", -bound, bound),
        )
        for c, (m, text, cmap, lo, hi) in enumerate(panels):
            draw_heatmap(
                fig,
                axes[r][c],
                m,
                title=text,
                xlabel="key position j" if last else None,
                ylabel="query position i" if c == 0 else None,
                cmap=cmap,
                vmin=lo,
                vmax=hi,
                name="map",
            )
    _integer_ticks(*fig.axes)
    return fig


def plot_differential(
    path: PathLike, weights: Tensor, lam: float | Tensor, *, dpi: int = 110, **kwargs: object
) -> Path:
    """Saves `differential_figure` ``(weights, lam, **kwargs)`` as a PNG; returns the path."""
    if Path(path).suffix.lower() != ".png":  # before any drawing
        raise ValueError(f"path must end in .png, got {str(path)!r}")
    return save_figure(differential_figure(weights, lam, **kwargs), path, dpi)  # type: ignore[arg-type]


__all__ = ["differential_figure", "plot_differential", "plot_sinks", "sinks_figure"]
