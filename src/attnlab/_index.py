"""Bottom-right alignment and the (b, h, i, j) index grid, in one place.

Every index function of the library — a `Mask`, a bias function ``fn(b, h, i, j)``, the dense
pictures of a bias — is evaluated on broadcastable Long index tensors. When L != S the queries are
aligned bottom-right: query row ``r`` sits at key position ``p = r + S − L`` (the last query sees
the last key), which is what KV-cache decoding needs.
"""

from __future__ import annotations

import torch
from torch import Tensor


def align(rows: Tensor, L: int, S: int) -> Tensor:
    """Key positions of raw query rows: ``p = rows + S − L`` (bottom-right alignment).

    Args:
        rows: raw query rows in ``[0, L)``, any shape (Long).
        L, S: query and key lengths.

    Returns:
        Tensor of the shape of ``rows``.
    """
    return rows + (S - L)


def query_positions(L: int, S: int, *, device: torch.device | str | None = None) -> Tensor:
    """The aligned positions ``p = r + S − L`` of all L query rows, shape ``(L,)`` (int64)."""
    return align(torch.arange(L, device=device), L, S)


def index_grid(
    B: int,
    H: int,
    L: int,
    S: int,
    *,
    rows: Tensor | None = None,
    keys: Tensor | None = None,
    aligned: bool = True,
    device: torch.device | str | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Index tensors ``b (B,1,1,1)``, ``h (1,H,1,1)``, ``i (1,1,R,1)``, ``j (1,1,1,K)``.

    The one grid for masks, bias functions and dense bias pictures.

    Args:
        B, H: batch and head counts (``arange`` of each).
        L, S: query and key lengths of the call (they fix the alignment).
        rows: the raw query rows to cover (default all L rows).
        keys: the key positions to cover (default all S keys).
        aligned: give ``i`` as aligned positions ``r + S − L`` (what bias functions and
            `attnlab.masks.from_fn` receive); False gives the raw rows (what `Mask.evaluate` takes).
        device: where to build the tensors (default: the device of ``rows``/``keys`` if given).

    Returns:
        ``(b, h, i, j)``, Long tensors broadcasting to ``(B, H, R, K)``.
    """
    if device is None:
        given = rows if rows is not None else keys
        device = given.device if given is not None else None
    b = torch.arange(B, device=device).view(B, 1, 1, 1)
    h = torch.arange(H, device=device).view(1, H, 1, 1)
    r = torch.arange(L, device=device) if rows is None else rows.to(device)
    i = (align(r, L, S) if aligned else r).reshape(1, 1, -1, 1)
    k = torch.arange(S, device=device) if keys is None else keys.to(device)
    j = k.reshape(1, 1, 1, -1)
    return b, h, i, j


__all__ = ["align", "index_grid", "query_positions"]
