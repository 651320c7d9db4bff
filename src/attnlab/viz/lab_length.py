"""The picture of ``attnlab experiment train-short-test-long`` (matplotlib, imported inside).

Like the paper's Fig. 1: held-out loss against the evaluation length, one curve per positional
encoding (mean over seeds, the band spans the smallest to the largest seed), a dashed line at
the training length; beside it the same curves minus each encoding's loss at the training length.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from .heatmap import PathLike, new_figure, save_figure

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure

__all__ = ["draw", "length_figure"]

_STYLE = {
    "sinusoidal": ("tab:orange", "o"),
    "learned": ("tab:brown", "D"),
    "rope": ("tab:green", "s"),
    "t5": ("tab:purple", "^"),
    "alibi": ("tab:blue", "*"),
    "nope": ("tab:gray", "v"),
}


def _curve(rows: list[list[float | None]], k: int) -> tuple[float, float, float] | None:
    values = [r[k] for r in rows]
    if any(v is None for v in values):
        return None
    return sum(values) / len(values), min(values), max(values)  # type: ignore[arg-type]


def length_figure(metrics: dict[str, Any]) -> Figure:
    """Loss (nats/byte) against evaluation length, and its change from the training length.

    Args:
        metrics: the experiment's metrics (``lengths``, ``encodings``, ``loss[name]`` = seeds ×
            lengths, None where undefined, ``scale.train_len``).
    """
    fig = new_figure(10.0, 3.8)
    left, right = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    lengths = metrics["lengths"]
    for name in metrics["encodings"]:
        color, marker = _STYLE.get(name, ("black", "."))
        points = [(n, _curve(metrics["loss"][name], k)) for k, n in enumerate(lengths)]
        points = [(n, c) for n, c in points if c is not None]
        xs = [n for n, _ in points]
        base = points[0][1][0]
        for ax, shift in ((left, 0.0), (right, base)):
            mean = [c[0] - shift for _, c in points]
            ax.plot(xs, mean, marker=marker, color=color, label=name)
            ax.fill_between(
                xs,
                [c[1] - shift for _, c in points],
                [c[2] - shift for _, c in points],
                color=color,
                alpha=0.2,
                lw=0,
            )
    train_len = metrics["scale"]["train_len"]
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.axvline(train_len, color="black", ls="--", lw=0.8)
        ax.set_xlabel("evaluation length (bytes; non-overlapping windows)")
        ax.grid(True, alpha=0.3)
    left.set_ylabel("held-out loss (nats/byte)")
    right.set_ylabel("loss − loss at the training length")
    right.axhline(0.0, color="black", lw=0.6)
    left.legend(fontsize=8)
    left.set_title(f"trained at L = {train_len} (dashed), evaluated at 1×–16× L", fontsize=9)
    right.set_title("learned: undefined beyond L (no trained rows)", fontsize=9)
    return fig


def draw(path: PathLike, metrics: dict[str, Any], *, dpi: int = 120) -> Path:
    """Saves `length_figure` as a PNG; returns the path written."""
    return save_figure(length_figure(metrics), path, dpi)
