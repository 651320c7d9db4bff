"""A mask decided per (query cell, key block): the block selection of routed attention.

MoBA (Lu et al. 2025) and NSA's selection branch let each query cell — ``query_block``
consecutive aligned positions, or one row — attend a data-dependent set of key blocks of
``block`` keys. The selection arrives as a bool table ``(B|1, H|1, n_cells, n_blocks)`` (computed
on the device, `attnlab.functional.reference.routing_select`): this mask reads it, and gives the
tiled backend its block map from the table alone (2-D prefix sums over cells, O(tiles) work), so
the tiles no cell selects are skipped without an L×S tensor.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._shapes import check_int, static_int
from .base import Mask, _describe
from .blocks import codes_of, tile_bounds


class BlockTableMask(Mask):
    """True where query row i's cell selects key j's block: ``table[b, h, c_i, ⌊j / block⌋]``.

    ``c_i = ⌊p_i / query_block⌋ − ⌊(S − L) / query_block⌋`` with ``p_i = i + S − L`` the aligned
    position (bottom-right), so the table is made for one ``(L, S)``: a call with other lengths
    raises.

    Args:
        table: bool ``(n_cells, n_blocks)``, ``(B|1, n_cells, n_blocks)`` or
            ``(B|1, H|1, n_cells, n_blocks)``.
        block: keys per block (>= 1). query_block: aligned positions per cell (>= 1).
        L, S: the query and key lengths the table is for.
    """

    pins_size = True

    def __init__(self, table: Tensor, block: int, query_block: int, L: int, S: int) -> None:
        if not isinstance(table, Tensor) or table.dtype != torch.bool:
            raise TypeError(f"table must be a bool tensor, got {_describe(table)}")
        if table.dim() not in (2, 3, 4):
            raise ValueError(
                "table must have shape (n_cells, n_blocks), (B, n_cells, n_blocks) or "
                f"(B, H, n_cells, n_blocks), got {tuple(table.shape)}"
            )
        self.block = check_int("block", block, minimum=1)
        self.query_block = check_int("query_block", query_block, minimum=1)
        self.L, self.S = check_int("L", L, minimum=1), check_int("S", S, minimum=1)
        n_cells = (S - 1) // query_block - (S - L) // query_block + 1
        want = (n_cells, -(-S // block))
        if tuple(table.shape[-2:]) != want:
            raise ValueError(
                f"table must end in (n_cells, n_blocks) = {want} for L={L}, S={S}, "
                f"block={block}, query_block={query_block}, got {tuple(table.shape)}"
            )
        if table.dim() == 3:
            table = table.unsqueeze(1)
        self.table = table.reshape((1,) * (4 - table.dim()) + tuple(table.shape))
        self.batch_size = self.table.shape[0] if self.table.shape[0] > 1 else None
        self.num_heads = self.table.shape[1] if self.table.shape[1] > 1 else None

    def _check(self, L: int, S: int) -> None:
        if (L, S) != (self.L, self.S):
            raise ValueError(f"block table made for L={self.L}, S={self.S}, used with L={L}, S={S}")

    def mod(self, b, h, p, j, S):
        self._check(self.L, S)
        t = self.table.to(p.device)
        first = (S - self.L) // self.query_block
        cell = torch.div(p, self.query_block, rounding_mode="floor") - first
        bi = b if t.shape[0] > 1 else torch.zeros_like(b)
        hi = h if t.shape[1] > 1 else torch.zeros_like(h)
        return t[
            bi, hi, cell.clamp(0, t.shape[2] - 1), torch.div(j, self.block, rounding_mode="floor")
        ]

    def evaluate(self, b, h, i, j, L, S):
        self._check(L, S)
        return super().evaluate(b, h, i, j, L, S)

    def block_codes(self, L, S, bq, bk, nb, nh, device):  # noqa: ARG002 (the Mask protocol's signature)
        self._check(L, S)
        t = self.table.to(device)
        p0, p1, k0, k1 = tile_bounds(L, S, bq, bk, device)
        first = (S - L) // self.query_block
        qa = torch.div(p0, self.query_block, rounding_mode="floor").view(-1, 1) - first
        qz = torch.div(p1 - 1, self.query_block, rounding_mode="floor").view(-1, 1) - first + 1
        ka = torch.div(k0, self.block, rounding_mode="floor").view(1, -1)
        kz = torch.div(k1 - 1, self.block, rounding_mode="floor").view(1, -1) + 1
        c = torch.nn.functional.pad(t.long().cumsum(-1).cumsum(-2), (1, 0, 1, 0))
        count = c[..., qz, kz] - c[..., qa, kz] - c[..., qz, ka] + c[..., qa, ka]
        return codes_of(count, (qz - qa) * (kz - ka))  # (B|1, H|1, nq, nk)

    def default_size(self) -> tuple[int, int]:
        return self.L, self.S

    def spec(self):
        return (
            f"block_table:{static_int(self.block)}:{static_int(self.query_block)}:"
            f"{static_int(self.L)}:{static_int(self.S)}",
            [self.table],
        )

    def data_tensors(self) -> list[tuple[str, Tensor]]:
        return [(repr(self), self.table)]

    def __repr__(self) -> str:
        return (
            f"block_table(shape={tuple(self.table.shape)}, block={self.block}, "
            f"query_block={self.query_block}, L={self.L}, S={self.S})"
        )


__all__ = ["BlockTableMask"]
