"""The PNGs of ``attnlab experiment associative-recall``: MQAR accuracy against model width, one
panel per sequence length (Zoology's Fig. 2), and a selective SSM's implicit mixing matrix
(matplotlib, imported inside the functions)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from .training import _save_png

__all__ = ["plot_recall", "plot_ssm_matrix"]

_STYLE = {"attention": "k", "window": "tab:gray"}


def plot_recall(path: Path, metrics: dict[str, Any]) -> Path:
    """Accuracy against width (log₂ axis), one line per mixer with the seed range as error
    bars, one panel per (length, pairs); fixed-state mixers dashed. Returns the path."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    tasks, widths = metrics["tasks"], sorted(metrics["widths"])
    fig = Figure(figsize=(4.6 * len(tasks) + 1.6, 4.0), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(tasks), squeeze=False)[0]
    for ax, (length, pairs) in zip(axes, tasks, strict=True):
        for mixer in metrics["mixers"]:
            runs = [metrics["accuracy"][mixer][str(length)][str(w)] for w in widths]
            mean = [statistics.fmean(r) for r in runs]
            err = [[m - min(r) for m, r in zip(mean, runs, strict=True)]]
            err.append([max(r) - m for m, r in zip(mean, runs, strict=True)])
            style = "--" if mixer in metrics.get("fixed_state", ()) else "-"
            ax.errorbar(
                widths,
                mean,
                yerr=err,
                fmt="o" + style,
                capsize=3,
                label=mixer,
                color=_STYLE.get(mixer),
                lw=2 if mixer == "attention" else 1.2,
            )
        ax.set_xscale("log", base=2)
        ax.set_xticks(widths, [str(w) for w in widths])
        ax.set(xlabel="model width", ylim=(-0.03, 1.03))
        ax.set_title(f"L = {length}, {pairs} pairs (window {metrics['window']})")
    axes[0].set_ylabel("MQAR accuracy (held out)")
    axes[-1].legend(loc="center left", bbox_to_anchor=(1.02, 0.5), fontsize=8)
    fig.suptitle("Multi-query associative recall against model width (Zoology, Fig. 2)")
    fig.tight_layout()
    _save_png(fig, Path(path))
    return Path(path)


def plot_ssm_matrix(path: Path, matrix: Any, tokens: list[str] | None = None) -> Path:
    """A selective SSM's implicit mixing matrix ``M (L, L)`` (``y_i = Σ_j M_ij u_j``, one
    channel) as a heatmap of ``|M_ij|``; ``tokens`` label the axes. Returns the path."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.2, 4.6), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    image = ax.imshow(abs(matrix), cmap="viridis")
    fig.colorbar(image, ax=ax, label="|M_ij|")
    ax.set(xlabel="input position j", ylabel="output position i")
    ax.set_title("selective SSM, one channel: y_i = Σ_j M_ij u_j", fontsize=10)
    if tokens is not None:
        ax.set_xticks(range(len(tokens)), tokens, rotation=90, fontsize=7)
        ax.set_yticks(range(len(tokens)), tokens, fontsize=7)
    fig.tight_layout()
    _save_png(fig, Path(path))
    return Path(path)
