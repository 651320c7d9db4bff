"""Pictures of ``attnlab train classify``: confusion matrices and the head-ablation heatmaps."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import Tensor

from .heatmap import PathLike, new_figure, save_figure

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure

_TITLES = {
    "ngram": "char n-grams + logistic regression",
    "char": "char Transformer (from scratch)",
    "minilm": "MiniLM + head",
}


def _check_png(path: PathLike) -> None:
    if Path(path).suffix.lower() != ".png":  # before any drawing
        raise ValueError(f"path must end in .png, got {str(path)!r}")


def confusions_figure(
    matrices: Mapping[str, Tensor],
    labels: Sequence[str],
    accuracy: Mapping[str, float] | None = None,
) -> Figure:
    """One panel per classifier: row-normalised confusion (true language × predicted), with
    the held-out accuracy in the title.

    Args:
        matrices: ``{name: (C, C) counts}``, row = true label, column = predicted.
        labels: the C class names.
        accuracy: ``{name: accuracy}`` for the titles.
    """
    if not matrices:
        raise ValueError("matrices must not be empty")
    C = len(labels)
    for name, m in matrices.items():
        if not isinstance(m, Tensor) or tuple(m.shape) != (C, C):
            got = tuple(m.shape) if isinstance(m, Tensor) else type(m).__name__
            raise ValueError(f"matrices[{name!r}] must be ({C}, {C}), got {got}")
    n = len(matrices)
    fig = new_figure(4.2 * n + 0.8, 4.4)
    axes = fig.subplots(1, n, squeeze=False)[0]
    image = None
    for ax, (name, m) in zip(axes, matrices.items(), strict=True):
        rows = m.double().cpu()
        share = rows / rows.sum(1, keepdim=True).clamp_min(1)
        image = ax.imshow(share.numpy(), vmin=0.0, vmax=1.0, cmap="Blues")
        for i in range(C):
            for j in range(C):
                v = float(share[i, j])
                if v >= 0.005:
                    ax.text(
                        j,
                        i,
                        f"{100 * v:.0f}",
                        ha="center",
                        va="center",
                        fontsize=6,
                        color="white" if v > 0.5 else "black",
                    )
        ax.set_xticks(range(C), labels, fontsize=7)
        ax.set_yticks(range(C), labels, fontsize=7)
        ax.set_xlabel("predicted")
        ax.set_ylabel("true language")
        title = _TITLES.get(name, name)
        if accuracy is not None and name in accuracy:
            title += f"\nheld-out accuracy {100 * accuracy[name]:.1f} %"
        ax.set_title(title, fontsize=9)
    fig.colorbar(image, ax=list(axes), shrink=0.8, label="share of the true language's words")
    return fig


def plot_confusions(
    path: PathLike,
    matrices: Mapping[str, Tensor],
    labels: Sequence[str],
    accuracy: Mapping[str, float] | None = None,
    *,
    dpi: int = 120,
) -> Path:
    """Writes `confusions_figure` as a PNG; returns the path."""
    _check_png(path)
    return save_figure(confusions_figure(matrices, labels, accuracy), path, dpi)


def head_ablation_figure(ablations: Mapping[str, Any]) -> Figure:
    """One heatmap per model: the held-out accuracy drop (percentage points) when each head
    (layer × head) is removed, with the values written in the cells.

    Args:
        ablations: ``{name: attnlab.apps.classify.HeadAblation}``.
    """
    if not ablations:
        raise ValueError("ablations must not be empty")
    n = len(ablations)
    widths = [max(3.0, 0.55 * a.accuracy.shape[1] + 1.5) for a in ablations.values()]
    fig = new_figure(sum(widths) + 0.5, 4.2)
    axes = fig.subplots(1, n, squeeze=False, gridspec_kw={"width_ratios": widths})[0]
    for ax, (name, a) in zip(axes, ablations.items(), strict=True):
        drop = 100 * a.drop.double().cpu()  # (L, H), points
        L, H = drop.shape
        bound = max(0.5, float(drop.abs().nan_to_num(0.0).max()))
        image = ax.imshow(drop.numpy(), cmap="RdBu_r", vmin=-bound, vmax=bound, aspect="auto")
        for i in range(L):
            for j in range(H):
                v = float(drop[i, j])
                ax.text(j, i, f"{v:.1f}", ha="center", va="center", fontsize=6)
        ax.set_xticks(range(H))
        ax.set_yticks(range(L))
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_title(
            f"{_TITLES.get(name, name)}: accuracy drop (pts)\nwhen one head is removed "
            f"({a.words} held-out words, base {100 * a.base_accuracy:.1f} %)",
            fontsize=8,
        )
        fig.colorbar(image, ax=ax, shrink=0.8)
    return fig


def plot_head_ablation(path: PathLike, ablations: Mapping[str, Any], *, dpi: int = 120) -> Path:
    """Writes `head_ablation_figure` as a PNG; returns the path."""
    _check_png(path)
    return save_figure(head_ablation_figure(ablations), path, dpi)


__all__ = [
    "confusions_figure",
    "head_ablation_figure",
    "plot_confusions",
    "plot_head_ablation",
]
