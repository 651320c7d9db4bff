"""Argument checks of the positional encodings beyond the library's kit (`attnlab._shapes`:
`check_int`, `check_number`); every error names the argument."""

from __future__ import annotations

import torch
from torch import Tensor

from .._shapes import check_int


def check_even_dim(name: str, value: object) -> int:
    """A positive even int (a rotary or sinusoidal width pairs its dimensions)."""
    value = check_int(name, value, minimum=1)
    if value % 2:
        raise ValueError(f"{name} must be even (dimensions come in sin/cos pairs), got {value}")
    return value


def check_positions(name: str, positions: object) -> Tensor:
    """An integer tensor of positions."""
    if not isinstance(positions, Tensor):
        raise TypeError(f"{name} must be an integer tensor, got {type(positions).__name__}")
    if positions.is_floating_point() or positions.is_complex() or positions.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got dtype {positions.dtype}")
    return positions


def check_head_index(owner: str, num_heads: int, h: Tensor) -> None:
    """Raises if a function bias is evaluated on more heads than it was built for.

    Reads ``max(h)`` back to the host, so it runs in eager mode only: skipped under
    `torch.compile`/`torch.export` and for ``meta`` tensors (the head lookup then fails instead).
    """
    if torch.compiler.is_compiling() or h.is_meta:
        return
    if h.numel() and int(h.max()) >= num_heads:
        raise ValueError(
            f"{owner} was built with num_heads={num_heads}, but the attention call has "
            f"H={int(h.max()) + 1} query heads"
        )
