"""The PNGs of ``attnlab train``: loss curve, per-layer gradient norms and the LR / warmup sweep
(matplotlib, imported inside the functions)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def plot_losses(
    path: Path, losses: list[float], val: list[tuple[int, float, float]], entropy: float
) -> bool:
    """Writes the loss curve PNG (matplotlib, imported here); False if matplotlib is missing."""
    try:
        fig = losses_figure(losses, val, entropy)
    except ImportError:
        return False
    fig.tight_layout()
    _save_png(fig, path)
    return True


def losses_figure(
    losses: list[float],
    val: list[tuple[int, float, float]],
    entropy: float,
    *,
    ax: object | None = None,
) -> object:
    """The loss-curve Figure: per-batch train loss, validation points ``(step, val, train)``
    and the unigram entropy; ``ax``: draw into this Axes (its figure is returned)."""
    if ax is None:
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        from .figure import InlineFigure

        fig = InlineFigure(figsize=(7, 4), dpi=100)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
    else:
        fig = ax.figure  # type: ignore[attr-defined]
    ax.plot(range(1, len(losses) + 1), losses, lw=0.8, alpha=0.6, label="train (batch)")
    if val:
        steps, _, v = zip(*val, strict=True)
        ax.plot(steps, v, "o-", label="validation")
    ax.axhline(entropy, color="gray", ls="--", label=f"unigram entropy {entropy:.2f}")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/char)")
    ax.set_title("attnlab train: character-level GPT")
    ax.legend()
    return fig


def _save_png(fig: object, path: Path) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".png")
    os.close(fd)
    try:
        fig.savefig(tmp, format="png")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def plot_grad_norms(
    path: Path, layers: list[str], norms: list[list[float]], totals: list[float]
) -> bool:
    """Writes the per-layer gradient-norm curves of a run (log scale); False without matplotlib.

    Args:
        path: the PNG to write (atomically).
        layers: the layer names, one per column of ``norms``.
        norms: per step, the L2 gradient norm of each layer (before clipping).
        totals: per step, the global norm ``sqrt(Σ_l norm_l²)``.
    Non-finite entries (fp16 steps the loss scaler skipped, steps before a log existed) are
    left out of the curves.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return False
    import math

    fig = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()

    def curve(values: list[float], **kw: object) -> None:
        pts = [(i, v) for i, v in enumerate(values, 1) if math.isfinite(v) and v > 0]
        if pts:
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, **kw)

    curve(totals, color="black", lw=1.2, label="total")
    for j, name in enumerate(layers):
        curve([row[j] for row in norms], lw=0.8, alpha=0.8, label=name)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("gradient L2 norm (before clipping)")
    ax.set_title("attnlab train: per-layer gradient norms")
    if ax.lines:
        ax.legend(fontsize="small", ncol=2)
    fig.tight_layout()
    _save_png(fig, path)
    return True


def plot_sweep(path: Path, result: object) -> bool:
    """Writes the ablation PNG of a `attnlab.apps.gpt.SweepResult`; False without matplotlib.

    Left: final validation loss against the first swept axis (log x for ``lr``), one line per
    value of the second axis. Right: every run's batch-loss curve (moving mean of 10 steps).
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return False
    import math

    runs = result.runs
    keys = list(result.grid)
    x_key = keys[0]
    other = keys[1:]
    fig = Figure(figsize=(11, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax, ax2 = fig.subplots(1, 2)
    series: dict[tuple, list] = {}
    for r in runs:
        series.setdefault(tuple(r.point[k] for k in other), []).append(r)
    for label, group in series.items():
        xs = [r.point[x_key] for r in group]
        ys = [r.final_val if math.isfinite(r.final_val) else math.nan for r in group]
        name = ", ".join(f"{k}={v:g}" for k, v in zip(other, label, strict=True)) or "val"
        ax.plot(xs, ys, "o-", label=name)
    if x_key == "lr":
        ax.set_xscale("log")
    ax.axhline(result.unigram_entropy, color="gray", ls="--", label="unigram entropy")
    ax.set_xlabel(x_key)
    ax.set_ylabel("final validation loss (nats/char)")
    ax.set_title(f"ablation: {' × '.join(keys)} ({result.base.schedule})")
    ax.legend(fontsize="small")
    for r in runs:
        losses = r.train_losses
        k = min(10, len(losses))
        smooth = [sum(losses[max(0, i - k + 1) : i + 1]) / len(losses[max(0, i - k + 1) : i + 1])
                  for i in range(len(losses))]  # fmt: skip
        ax2.plot(range(1, len(smooth) + 1), smooth, lw=0.9,
                 label=", ".join(f"{k_}={v:g}" for k_, v in r.point.items()))  # fmt: skip
    ax2.set_xlabel("step")
    ax2.set_ylabel("batch loss, moving mean of 10 (nats/char)")
    ax2.legend(fontsize="x-small")
    fig.tight_layout()
    _save_png(fig, path)
    return True
