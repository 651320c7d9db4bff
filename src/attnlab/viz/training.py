"""The loss curve of ``attnlab train`` as a PNG (matplotlib, imported inside the function)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def plot_losses(
    path: Path, losses: list[float], val: list[tuple[int, float, float]], entropy: float
) -> bool:
    """Writes the loss curve PNG (matplotlib, imported here); False if matplotlib is missing."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return False
    fig = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(range(1, len(losses) + 1), losses, lw=0.8, alpha=0.6, label="train (batch)")
    if val:
        steps, _, v = zip(*val, strict=True)
        ax.plot(steps, v, "o-", label="validation")
    ax.axhline(entropy, color="gray", ls="--", label=f"unigram entropy {entropy:.2f}")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/char)")
    ax.set_title("attnlab train: character-level GPT")
    ax.legend()
    fig.tight_layout()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".png")
    os.close(fd)
    try:
        fig.savefig(tmp, format="png")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return True
