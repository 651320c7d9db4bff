"""Where a Vision Transformer looks: attention maps over the patches drawn on the image.

`vit_maps_figure` draws one row per image: the image itself, then its attention rollout (the
[CLS] row of `attnlab.analysis.rollout.attention_rollout` over the patches), then the [CLS] row of
every head of one layer, each map a heat picture with one cell per patch and the digit's
outline drawn over it. `patch_tokens` names the patches for the HTML viewer (`attnlab.viz.show`).

Example:
    >>> logits, weights = vit(images, need_weights=True)
    >>> plot_vit_maps("vit_attention.png", images, weights, grid=4, labels=labels)
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..analysis.rollout import attention_rollout, cls_attention
from .heatmap import PathLike, new_figure, save_figure

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure


def patch_tokens(grid: int) -> list[str]:
    """Token names of a ViT sequence: ``["[CLS]", "r0c0", "r0c1", …]`` (row-major patches)."""
    return ["[CLS]"] + [f"r{r}c{c}" for r in range(grid) for c in range(grid)]


def patch_map(values: Tensor, grid: int, size: int) -> Tensor:
    """``(N,)`` per-patch values as a ``(size, size)`` picture: each patch a ``p × p`` block.

    Args:
        values: ``(N,)`` with ``N = grid²`` (row-major patches). grid: patches per side.
        size: the image side in pixels (a multiple of grid).

    Returns:
        ``(size, size)`` float64 (nearest-neighbour upsampling; nothing is smoothed).
    """
    if values.dim() != 1 or values.shape[0] != grid * grid:
        raise ValueError(
            f"values must be ({grid * grid},) for a {grid}×{grid} grid, got {tuple(values.shape)}"
        )
    if size % grid:
        raise ValueError(f"size must be a multiple of grid={grid}, got {size}")
    p = size // grid
    m = values.detach().to("cpu", torch.float64).reshape(grid, grid)  # (G, G)
    return m.repeat_interleave(p, 0).repeat_interleave(p, 1)  # (size, size)


def vit_maps_figure(
    images: Tensor,
    attentions: Sequence[Tensor] | Tensor,
    *,
    grid: int,
    layer: int = -1,
    labels: Sequence[str] | None = None,
    title: str | None = None,
    panel_size: float = 1.3,
    outline_width: float = 0.8,
) -> Figure:
    """One row per image: the image, its rollout, and the [CLS] map of each head of ``layer``.

    Each map is scaled to its own maximum (the colour shows where a head looks, not how much
    of its weight the patches get; the maximum is printed in the panel title). The [CLS] token's
    weight on itself is left out of the head maps (it is not a patch).

    Args:
        images: ``(B, C, H, W)`` (drawn as grey from channel 0; or ``(B, H, W)``).
        attentions: one ``(B, H, T, T)`` tensor per layer, T = 1 + grid² (token 0 = [CLS]).
        grid: patches per side.
        layer: the layer whose heads are drawn.
        labels: B row labels (e.g. "true 3 · pred 3").
        title: the figure title.
        panel_size: inches per panel. outline_width: line width of the digit's outline.

    Returns:
        A matplotlib Figure (not registered with pyplot).
    """
    pics = images.detach().to("cpu", torch.float64)
    pics = pics[:, 0] if pics.dim() == 4 else pics  # (B, H, W)
    if pics.dim() != 3 or pics.shape[-1] != pics.shape[-2]:
        raise ValueError(f"images must be (B, C, H, W) with H = W, got {tuple(images.shape)}")
    B, size = pics.shape[0], pics.shape[-1]
    rollout = attention_rollout(attentions)[:, 0, 1:]  # (B, N): [CLS] over the patches
    heads = cls_attention(attentions, layer=layer)  # (B, H, N)
    if rollout.shape[0] != B or rollout.shape[-1] != grid * grid:
        raise ValueError(
            f"attentions must be (B={B}, H, {1 + grid * grid}, {1 + grid * grid}) per layer, "
            f"got T = {rollout.shape[-1] + 1} for batch {rollout.shape[0]}"
        )
    if labels is not None and len(labels) != B:
        raise ValueError(f"labels must hold B={B} strings, got {len(labels)}")
    H = heads.shape[1]
    n_layers = len(attentions) if not isinstance(attentions, Tensor) else attentions.shape[0]
    shown = layer % n_layers
    cols = 2 + H
    fig = new_figure(panel_size * cols, panel_size * B + (0.4 if title else 0.0))
    axes = fig.subplots(B, cols, squeeze=False)
    for b in range(B):
        panels = [("image", None), ("rollout", rollout[b])] + [
            (f"L{shown} head {h}", heads[b, h]) for h in range(H)
        ]
        for c, (name, values) in enumerate(panels):
            ax = axes[b][c]
            ax.set_xticks([])
            ax.set_yticks([])
            if values is None:
                ax.imshow(pics[b].numpy(), cmap="gray_r", interpolation="nearest")
                label = labels[b] if labels is not None else ""
                ax.set_title(f"{name}\n{label}" if b == 0 else label, fontsize=7)
                continue
            heat = patch_map(values, grid, size)
            top = float(heat.max())
            ax.imshow(
                (heat / top if top > 0 else heat).numpy(),
                cmap="inferno",
                vmin=0.0,
                vmax=1.0,
                interpolation="nearest",
            )
            # The digit's outline (half the brightest pixel) over the heat.
            if float(pics[b].max()) > float(pics[b].min()):
                level = 0.5 * (float(pics[b].max()) + float(pics[b].min()))
                ax.contour(pics[b].numpy(), levels=[level], colors="cyan", linewidths=outline_width)
            ax.set_title(f"{name}\nmax {top:.2f}" if b == 0 else f"max {top:.2f}", fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    return fig


def plot_vit_maps(
    path: PathLike,
    images: Tensor,
    attentions: Sequence[Tensor] | Tensor,
    *,
    grid: int,
    dpi: int = 110,
    **options: object,
) -> Path:
    """Writes `vit_maps_figure` ``(images, attentions, grid=grid, **options)`` as a PNG."""
    return save_figure(vit_maps_figure(images, attentions, grid=grid, **options), path, dpi)


__all__ = ["patch_map", "patch_tokens", "plot_vit_maps", "vit_maps_figure"]
