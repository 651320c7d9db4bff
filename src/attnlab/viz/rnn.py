"""The PNGs of the RNN baseline: the LM's loss curve and the RNN-vs-attention benchmark
(matplotlib, imported inside the functions)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from .training import _save_png, losses_figure


def plot_rnn_losses(
    path: Path,
    losses: list[float],
    val: list[tuple[int, float, float]],
    entropy: float,
    cell: str = "gru",
) -> bool:
    """Writes the RNN LM's loss curve (per-batch train loss, ``(step, train, val)`` evaluations,
    the unigram entropy) as a PNG; False if matplotlib is missing."""
    try:
        fig = losses_figure(losses, val, entropy)
    except ImportError:
        return False
    fig.axes[0].set_title(f"attnlab train rnn: character-level {cell.upper()} LM")
    fig.tight_layout()
    _save_png(fig, Path(path))
    return True


def plot_rnn_vs_attention(
    path: Path,
    lengths: Sequence[int],
    step_ms: Mapping[str, Sequence[float]],
    token_ms: Mapping[str, Sequence[float]],
    curves: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    entropy: float,
    budget: float,
    *,
    clock: str = "wall-clock",
) -> bool:
    """Three panels: ms per training step and ms per generated token against the sequence length
    (log–log, one line per model), and validation loss against wall-clock seconds within the
    same budget of ``clock`` seconds (``curves[name] = (seconds, val_loss)``); False if
    matplotlib is missing."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return False
    fig = Figure(figsize=(14, 4.2), dpi=100)
    FigureCanvasAgg(fig)
    a, b, c = fig.subplots(1, 3)
    for name, ys in step_ms.items():
        a.plot(lengths[: len(ys)], ys, "o-", label=name)
    a.set(xscale="log", yscale="log", xlabel="sequence length n", ylabel="ms per training step")
    a.set_title("training step (forward + backward + AdamW)")
    for name, ys in token_ms.items():
        b.plot(lengths[: len(ys)], ys, "o-", label=name)
    b.set(xscale="log", yscale="log", xlabel="context length n", ylabel="ms per generated token")
    b.set_title("generation (GPT: KV cache; RNN: carried state)")
    for name, (xs, ys) in curves.items():
        c.plot(xs, ys, "o-", label=name)
    c.axhline(entropy, color="gray", ls="--", label=f"unigram entropy {entropy:.2f}")
    c.set(xlabel=f"training seconds ({clock})", ylabel="validation loss (nats/char)")
    c.set_title(f"same {clock} budget ({budget:g} s each)")
    for ax in (a, b, c):
        ax.legend()
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    _save_png(fig, Path(path))
    return True


__all__ = ["plot_rnn_losses", "plot_rnn_vs_attention"]
