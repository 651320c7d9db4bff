"""Rendering a function bias ``fn(b, h, i, j)`` on a full grid (for pictures and tests)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .._shapes import check_int, index_grid


def dense_bias(
    fn: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor],
    H: int,
    L: int,
    S: int | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """Evaluates ``fn`` on the full grid, aligned bottom-right like `attnlab.attention`.

    Args:
        fn: a function bias on broadcastable Long index tensors b, h, i, j.
        H: number of heads.
        L: query length; query row r sits at key position ``r + S − L``.
        S: key length (default L).
        device: device of the index tensors.

    Returns:
        ``(H, L, S)`` float tensor.
    """
    L = check_int("L", L, minimum=0)
    S = L if S is None else check_int("S", S, minimum=0)
    b, h, i, j = index_grid(1, H, L, S, device=device)  # batch item 0; i aligned
    return fn(b, h, i, j).expand(1, H, L, S)[0]  # (H, L, S)
