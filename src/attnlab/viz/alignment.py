"""Cross-attention alignment heatmaps (source tokens on x, target tokens on y) and a loss curve,
drawn with matplotlib (Agg, imported inside the functions).

Example:
    >>> plot_alignments("alignment.png", [("23 -> de", src_tokens, tgt_tokens, weights)])
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from torch import Tensor


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _show(token: str) -> str:
    return {" ": "␣", "<eos>": "</s>"}.get(token, token)


def plot_alignments(
    path: str | os.PathLike,
    items: Sequence[tuple[str, Sequence[str], Sequence[str], Tensor]],
    *,
    dpi: int = 110,
) -> Path:
    """One heatmap per item ``(title, source tokens (S), target tokens (T), weights (T, S))``,
    stacked vertically; each panel is T×S (non-square), sized by its token counts.

    Returns:
        The PNG path.

    Raises:
        ValueError: a weights matrix whose shape is not (len(target), len(source)).
    """
    for title, src, tgt, w in items:
        if tuple(w.shape) != (len(tgt), len(src)):
            raise ValueError(
                f"{title}: weights must be (T={len(tgt)}, S={len(src)}), got {tuple(w.shape)}"
            )
    plt = _plt()
    cell = 0.16
    widths = [len(src) * cell + 1.5 for _, src, _, _ in items]
    heights = [len(tgt) * cell + 1.2 for _, _, tgt, _ in items]
    fig, axes = plt.subplots(
        len(items),
        1,
        figsize=(max(widths), sum(heights)),
        gridspec_kw={"height_ratios": heights},
        squeeze=False,
    )
    for ax, (title, src, tgt, w) in zip(axes[:, 0], items, strict=True):
        ax.imshow(w.float().cpu().numpy(), cmap="Blues", vmin=0, aspect="equal")
        ax.set_xticks(range(len(src)), [_show(t) for t in src], fontsize=7)
        ax.set_yticks(range(len(tgt)), [_show(t) for t in tgt], fontsize=7)
        ax.tick_params(length=0)
        ax.set_xlabel("source (English characters)", fontsize=8)
        ax.set_ylabel("output characters", fontsize=8)
        ax.set_title(f"cross-attention {title}", fontsize=9)
    fig.tight_layout()
    path = Path(os.fspath(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def plot_loss(
    path: str | os.PathLike, losses: Sequence[float], *, title: str = "", dpi: int = 110
) -> Path:
    """The training loss per step (log scale) as a PNG."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(losses) + 1), losses, lw=0.8)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (label-smoothed CE)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(os.fspath(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


__all__ = ["plot_alignments", "plot_loss"]
