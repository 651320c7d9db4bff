"""Cross-attention alignment heatmaps (source tokens on x, target tokens on y) and a loss curve,
drawn with matplotlib (Agg, imported inside the functions).

- `plot_alignments`: one model's alignments, one panel per item, stacked.
- `plot_alignment_comparison` / `alignment_comparison_figure`: several models' alignments for
  the same inputs side by side (one column per model, one row per input), e.g. the Transformer's
  cross-attention beside the RNN encoder–decoder's additive attention.

Example:
    >>> plot_alignments("alignment.png", [("23 -> de", src_tokens, tgt_tokens, weights)])
    >>> plot_alignment_comparison(
    ...     "compare.png", [("transformer", [item_t]), ("rnn", [item_r])]
    ... )
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


#: ``(title, source tokens (S), target tokens (T), weights (T, S))``: one alignment panel.
Item = tuple[str, Sequence[str], Sequence[str], Tensor]


def _check_item(where: str, item: object) -> None:
    if not isinstance(item, tuple) or len(item) != 4:
        raise TypeError(
            f"{where} must be a (title, source tokens, target tokens, weights) tuple, "
            f"got {type(item).__name__}"
        )
    title, src, tgt, w = item
    if not isinstance(w, Tensor) or w.dim() != 2:
        got = tuple(w.shape) if isinstance(w, Tensor) else type(w).__name__
        raise TypeError(f"{where} ({title}): weights must be a 2-D tensor (T, S), got {got}")
    if tuple(w.shape) != (len(tgt), len(src)):
        raise ValueError(
            f"{where} ({title}): weights must be (T={len(tgt)}, S={len(src)}), got {tuple(w.shape)}"
        )


def alignment_comparison_figure(
    columns: Sequence[tuple[str, Sequence[Item]]], *, cell: float = 0.16, dpi: int = 80
) -> object:
    """Several models' alignments for the same inputs side by side, as a matplotlib ``Figure``
    (not registered with pyplot).

    Column c is model ``columns[c][0]``; row r is its item r, ``(title, source tokens (S),
    target tokens (T_c), weights (T_c, S))`` with ``weights[t, s]`` the attention of the step
    that wrote output token t on source token s (each model decodes its own output, so T may
    differ between columns). Panels are drawn on one colour scale per panel, 0 … max(weights).

    Args:
        columns: ``(model name, items)`` per column; every column has the same number of items.
        cell: inches per token.
        dpi: the figure's resolution.

    Returns:
        The Figure; ``fig.axes[r * len(columns) + c]`` is row r, column c.

    Raises:
        ValueError: no columns, columns with different item counts, no items, or a weights
            matrix whose shape is not (len(target), len(source)).
        TypeError: an item that is not a 4-tuple with a 2-D weights tensor.
    """
    if not columns:
        raise ValueError("columns must name at least one model, got none")
    rows = len(columns[0][1])
    if rows == 0:
        raise ValueError(f"columns must hold at least one item each, got 0 for {columns[0][0]!r}")
    for name, items in columns:
        if len(items) != rows:
            raise ValueError(
                f"every column must hold the same number of items: {columns[0][0]!r} has "
                f"{rows}, {name!r} has {len(items)}"
            )
        for r, item in enumerate(items):
            _check_item(f"columns[{name!r}][{r}]", item)
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from .figure import InlineFigure

    widths = [max(len(it[1]) for it in items) * cell + 1.4 for _, items in columns]
    heights = [max(len(items[r][2]) for _, items in columns) * cell + 1.3 for r in range(rows)]
    fig = InlineFigure(figsize=(sum(widths), sum(heights)), dpi=dpi)
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(rows, len(columns), width_ratios=widths, height_ratios=heights)
    for r in range(rows):
        for c, (name, items) in enumerate(columns):
            title, src, tgt, w = items[r]
            ax = fig.add_subplot(grid[r, c])
            ax.imshow(w.detach().float().to("cpu").numpy(), cmap="Blues", vmin=0, aspect="equal")
            ax.set_xticks(range(len(src)), [_show(t) for t in src], fontsize=7)
            ax.set_yticks(range(len(tgt)), [_show(t) for t in tgt], fontsize=7)
            ax.tick_params(length=0)
            ax.set_xlabel("source characters", fontsize=8)
            if c == 0:
                ax.set_ylabel("output characters", fontsize=8)
            ax.set_title(f"{name}: {title}", fontsize=9)
    fig.tight_layout()
    return fig


def plot_alignment_comparison(
    path: str | os.PathLike,
    columns: Sequence[tuple[str, Sequence[Item]]],
    *,
    dpi: int = 80,
) -> Path:
    """Writes `alignment_comparison_figure` (models side by side, one row per input) as a PNG.

    Returns:
        The PNG path.
    """
    fig = alignment_comparison_figure(columns, dpi=dpi)
    path = Path(os.fspath(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
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


__all__ = [
    "alignment_comparison_figure",
    "plot_alignment_comparison",
    "plot_alignments",
    "plot_loss",
]
