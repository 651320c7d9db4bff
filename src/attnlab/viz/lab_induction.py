"""The pictures of ``attnlab experiment induction-heads`` (`attnlab.lab.induction`), matplotlib.

- `loss_curves_figure`: the loss on the first occurrence and on the repeats over training, one
  panel per depth, one line per seed (the 2-layer repeats' loss drops suddenly: the phase
  change);
- `head_scores_figure`: prefix-matching, previous-token and copying score of every head;
- `stripes_figure`: the probe's attention, one panel per layer and head: an induction head
  draws a stripe ``n − 1`` below the diagonal (each token of the repeat attends to the token
  after its first occurrence), a previous-token head the sub-diagonal;
- `save_probe_view`: the same weights in attnlab's HTML attention viewer.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import Tensor

from .attention_view import save_attention_html
from .heatmap import PathLike, new_figure, save_figure, wrap_to_width

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure

__all__ = [
    "head_scores_figure",
    "loss_curves_figure",
    "plot_head_scores",
    "plot_loss_curves",
    "plot_stripes",
    "save_probe_view",
    "stripes_figure",
]


def _depth_label(depth: str) -> str:
    return f"{depth} layer" + ("" if depth == "1" else "s")


def loss_curves_figure(metrics: Mapping[str, Any]) -> Figure:
    """Loss on the first occurrence (dashed) and on the repeats (solid) against the training
    step; one panel per depth, one line per seed, ``ln V`` dotted."""
    models = metrics["models"]
    fig = new_figure(4.2 * len(models), 3.6)
    axes = fig.subplots(1, len(models), sharey=True, squeeze=False)[0]
    for ax, (depth, m) in zip(axes, models.items(), strict=True):
        for n, seed in enumerate(metrics["seeds"]):
            ax.plot(
                m["step"][n],
                m["repeat"][n],
                color="tab:blue",
                lw=1.2,
                label="repeats" if n == 0 else None,
            )
            ax.plot(
                m["step"][n],
                m["first"][n],
                color="tab:orange",
                lw=1.0,
                ls="--",
                label="first occurrence" if n == 0 else None,
            )
            del seed
        ax.axhline(metrics["uniform_loss"], color="gray", ls=":", lw=0.8, label="ln V")
        seeds = len(metrics["seeds"])
        ax.set_title(f"{_depth_label(depth)} ({seeds} seed{'s' if seeds > 1 else ''})", fontsize=10)
        ax.set_xlabel("training step")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("next-token loss (nats)")
    axes[0].legend(fontsize=8)
    fig.suptitle(
        wrap_to_width(
            "Attention-only models on repeated random tokens: the loss on the repeats",
            4.2 * len(models) - 0.3,
            11,
        ),
        fontsize=11,
    )
    return fig


def plot_loss_curves(path: PathLike, metrics: Mapping[str, Any], *, dpi: int = 120) -> Path:
    """Saves `loss_curves_figure` as a PNG; returns the path."""
    return save_figure(loss_curves_figure(metrics), path, dpi)


def head_scores_figure(metrics: Mapping[str, Any]) -> Figure:
    """Per head (``L<layer>.H<head>``, seed 0 and the other seeds as dots): prefix-matching,
    previous-token and copying score."""
    names = (
        ("prefix", "prefix matching"),
        ("previous", "previous token"),
        ("copying", "copying (Σλ/Σ|λ| of W_U W_O W_V W_E)"),
    )
    fig = new_figure(11.0, 3.6)
    axes = fig.subplots(1, len(names), squeeze=False)[0]
    for ax, (key, title) in zip(axes, names, strict=True):
        ticks: list[str] = []
        for depth, m in metrics["models"].items():
            for n, per_seed in enumerate(m[key]):
                xs, ys = [], []
                for layer, row in enumerate(per_seed):
                    for head, value in enumerate(row):
                        label = f"{depth}L: L{layer}.H{head}"
                        if label not in ticks:
                            ticks.append(label)
                        xs.append(ticks.index(label))
                        ys.append(value)
                color = "tab:orange" if depth == "1" else "tab:blue"
                ax.scatter(
                    xs,
                    ys,
                    s=18 if n == 0 else 8,
                    color=color,
                    alpha=1 if n == 0 else 0.5,
                    label=_depth_label(depth) if n == 0 and key == "prefix" else None,
                )
        ax.set_xticks(range(len(ticks)), ticks, rotation=90, fontsize=7)
        ax.set_title(title, fontsize=9)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    return fig


def plot_head_scores(path: PathLike, metrics: Mapping[str, Any], *, dpi: int = 120) -> Path:
    """Saves `head_scores_figure` as a PNG; returns the path."""
    return save_figure(head_scores_figure(metrics), path, dpi)


def stripes_figure(
    probes: Mapping[int, tuple[Tensor, Tensor]], metrics: Mapping[str, Any]
) -> Figure:
    """Every head's weights on the probe (a segment repeated twice), one row per layer of each
    model (seed 0); the prefix-matching score in each panel's title."""
    rows = [(depth, layer) for depth, (_, w) in probes.items() for layer in range(w.shape[0])]
    heads = max(w.shape[1] for _, w in probes.values())
    fig = new_figure(2.4 * heads + 0.6, 2.4 * len(rows) + 0.6)
    for r, (depth, layer) in enumerate(rows):
        tokens, weights = probes[depth]
        scores = metrics["models"][str(depth)]["prefix"][0][layer]
        for h in range(weights.shape[1]):
            ax = fig.add_subplot(len(rows), heads, r * heads + h + 1)
            ax.imshow(
                weights[layer, h].numpy(), cmap="viridis", vmin=0, vmax=1, interpolation="nearest"
            )
            ax.set_title(
                f"{_depth_label(str(depth))}, L{layer}.H{h}\nprefix {scores[h]:.2f}", fontsize=8
            )
            ax.set_xticks([])
            ax.set_yticks([])
            if h == 0:
                ax.set_ylabel("query i", fontsize=8)
            if r == len(rows) - 1:
                ax.set_xlabel("key j", fontsize=8)
        del tokens
    half = len(next(iter(probes.values()))[0]) // 2
    fig.suptitle(
        f"Attention on a segment of {half} random tokens repeated twice: the induction "
        f"stripe lies {half - 1} below the diagonal",
        fontsize=10,
    )
    return fig


def plot_stripes(
    path: PathLike,
    probes: Mapping[int, tuple[Tensor, Tensor]],
    metrics: Mapping[str, Any],
    *,
    dpi: int = 110,
) -> Path:
    """Saves `stripes_figure` as a PNG; returns the path."""
    return save_figure(stripes_figure(probes, metrics), path, dpi)


def save_probe_view(
    path: PathLike, probe: tuple[Tensor, Tensor], metrics: Mapping[str, Any]
) -> Path:
    """The 2-layer model's weights on the probe in the HTML attention viewer, opened on the
    head with the highest prefix-matching score (seed 0)."""
    tokens, weights = probe
    layer, head = metrics["models"]["2"]["best_head"][0]
    names = [f"{i}:t{int(t)}" for i, t in enumerate(tokens)]
    return save_attention_html(
        names,
        weights,
        path,
        title="Induction heads: a 2-layer attention-only model",
        subtitle=f"a segment of {len(tokens) // 2} random tokens, repeated",
        layer=layer,
        head=head,
    )
