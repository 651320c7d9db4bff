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
