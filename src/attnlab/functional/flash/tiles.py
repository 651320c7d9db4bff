"""Additive tiles: the bias and the mask (as −inf) evaluated on the indices of one call only.

`TileSource` evaluates the additive term on any (batch, head, row, key) index grid; `BandTiles`
builds (and caches) the tiles of the batched band calls; `fix_dead_rows` repairs the kernel's
report of rows whose every pair is masked.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..._index import align
from ...masks import Mask
from ..request import BiasFn, check_bias_output
from ..tiling import CALL_CAUSAL, CALL_MASKED, BandCall, Call

_NEG_INF = float("-inf")


@dataclass
class TileSource:
    """Evaluates the additive term (bias + mask as −inf) on any set of (batch, row, key) indices.

    Attributes:
        mask: the `Mask`, or None.
        bias_fn: ``fn(b, h, i, j)`` with i the bottom-right aligned query position, or None.
        bias_tensors: additive tensors, each broadcastable to ``(B, H, L, S)``.
        B, H, L, S: sizes of the call.
        dtype: dtype of the tiles handed to the engine: the engines' compute dtype (float32 for
            float16/bfloat16 queries, else the query dtype), so a bias is never rounded to half
            precision (the naive formula rounds it; the float64 golden does not).
        device: where index tensors and tiles are built.
        relative: ``bias_fn`` depends only on ``(h, j − i)`` (`request.is_relative_bias`).
    """

    mask: Mask | None
    bias_fn: BiasFn | None
    bias_tensors: list[Tensor]
    B: int
    H: int
    L: int
    S: int
    dtype: torch.dtype
    device: torch.device
    relative: bool = False

    @property
    def has_bias(self) -> bool:
        """True when some additive term must be computed for every tile."""
        return self.bias_fn is not None or bool(self.bias_tensors)

    def additive(
        self, b: Tensor, rows: Tensor, keys: Tensor, *, with_mask: bool, h: Tensor | None = None
    ) -> Tensor | None:
        """The additive tile on broadcastable indices: ``(nb|1, H|1, R, K)`` or None if nothing.

        Args:
            b: batch indices, shape ``(nb, 1, 1, 1)`` (or broadcastable).
            rows: raw query rows, broadcastable as ``(…, R, 1)``.
            keys: key positions, broadcastable as ``(…, 1, K)``.
            with_mask: evaluate the mask too (masked pairs become −inf).
            h: head indices ``(1, nh, 1, 1)``; default all H heads.
        """
        device = rows.device
        if h is None:
            h = torch.arange(self.H, device=device).view(1, self.H, 1, 1)
        out: Tensor | None = None
        if self.bias_fn is not None:
            i = align(rows, self.L, self.S)
            val = check_bias_output(self.bias_fn, self.bias_fn(b, h, i, keys), b, h, i, keys)
            out = val.to(self.dtype)
        for t in self.bias_tensors:
            val = gather4(t, b, h, rows, keys).to(self.dtype)
            out = val if out is None else out + val
        if with_mask and self.mask is not None:
            keep = self.mask._eval(b, h, rows, keys, self.L, self.S)
            if not isinstance(keep, Tensor) or keep.dtype != torch.bool:
                raise TypeError("mask function must return a bool tensor")
            zero = torch.zeros((), dtype=self.dtype, device=device)
            out = torch.where(keep, zero if out is None else out, _NEG_INF)
        if out is None:
            return None
        out = out.reshape((1,) * (4 - out.dim()) + tuple(out.shape))  # (nb|1, H|1, R|1, K|1)
        if out.shape[-1] > 1 and out.stride(-1) != 1:
            out = out.contiguous()
        return out

    def for_call(self, c: Call) -> Tensor | None:
        """The additive tile of a plain call (None for FULL/CAUSAL calls without bias)."""
        with_mask = c.kind == CALL_MASKED
        if not with_mask and not self.has_bias:
            return None
        device = self.device
        b = torch.arange(c.b0, c.b1, device=device).view(-1, 1, 1, 1)
        rows = torch.arange(c.r0, c.r1, device=device).view(1, 1, -1, 1)
        keys = c.key_index(device).view(1, 1, 1, -1)
        add = self.additive(b, rows, keys, with_mask=with_mask)
        if add is not None and c.kind == CALL_CAUSAL:
            r = torch.arange(c.r1 - c.r0, device=add.device).view(-1, 1)
            kk = torch.arange(c.num_keys, device=add.device).view(1, -1)
            add = add.masked_fill(kk > r, _NEG_INF)
        return add


@dataclass
class BandTiles:
    """The additive tiles of batched band calls; a relative bias's tile is built once per call.

    Attributes:
        source: evaluates the bias (the band's own mask is the relative-position window).
        shared: one tile per band call whose bias is relative, shared by all its query blocks.
    """

    source: TileSource
    shared: dict[BandCall, Tensor] = field(default_factory=dict)

    def tile(self, c: BandCall, b: int, device: torch.device) -> Tensor:
        """The additive tile of band call ``c`` for batch item ``b``.

        ``(bq, W)`` for the mask alone, ``(1, H|1, bq, W)`` for a relative bias (one tile shared
        by every block), else ``(nblk, H|1, bq, W)``.
        """
        src = self.source
        r = torch.arange(c.bq, device=device).view(-1, 1)
        col = torch.arange(c.width, device=device).view(1, -1)
        d = col - r
        rel = (d >= c.c_lo) & (d <= c.c_lo + c.span)  # (bq, W)
        if not src.has_bias:
            zero = torch.zeros((), dtype=src.dtype, device=device)
            return torch.where(rel, zero, _NEG_INF)  # (bq, W)
        if src.relative:
            tile = self.shared.get(c)
            if tile is None:
                ta, tb = c.interior()
                t = ta if ta < tb else c.t0  # a block whose indices are all in range, if any
                rows = (t * c.bq + r).view(1, 1, -1, 1)
                keys = (c.window(t)[0] + col).view(1, 1, 1, -1)
                zero = torch.zeros((1, 1, 1, 1), dtype=torch.long, device=device)
                add = src.additive(zero, rows, keys, with_mask=False)
                assert add is not None
                tile = torch.where(rel, add, _NEG_INF)  # (1, H|1, bq, W)
                self.shared[c] = tile
            return tile
        nblk = c.t1 - c.t0
        t = torch.arange(nblk, device=device).view(-1, 1, 1, 1)
        rows = c.r0 + t * c.bq + r.view(1, 1, -1, 1)  # (nblk, 1, bq, 1)
        keys = c.k_start + t * c.bq + col.view(1, 1, 1, -1)  # (nblk, 1, 1, W)
        bidx = torch.full((1, 1, 1, 1), b, dtype=torch.long, device=device)
        add = src.additive(bidx, rows, keys, with_mask=False)
        assert add is not None
        return torch.where(rel, add, _NEG_INF)  # (nblk, H|1, bq, W)


def as4(t: Tensor) -> Tensor:
    """``t`` viewed with leading 1s up to 4 dims: ``(B|1, H|1, L|1, S|1)``."""
    return t.reshape((1,) * (4 - t.dim()) + tuple(t.shape))  # (B|1, H|1, L|1, S|1)


def gather4(t: Tensor, b: Tensor, h: Tensor, rows: Tensor, keys: Tensor) -> Tensor:
    """``t[b, h, rows, keys]`` for a tensor broadcastable to (B, H, L, S), without expanding it."""
    t = as4(t)
    idx = []
    for size, ix in zip(t.shape, (b, h, rows, keys), strict=True):
        idx.append(
            ix if size > 1 else torch.zeros((1,) * ix.dim(), dtype=torch.long, device=ix.device)
        )
    return t[idx[0], idx[1], idx[2], idx[3]]


def fix_dead_rows(out: Tensor, lse: Tensor, add: Tensor | None) -> tuple[Tensor, Tensor]:
    """Sets lse = −inf (and out = 0) on rows of a kernel call whose every pair is masked.

    The kernel reports such rows as out = 0, lse = 0, so only rows with lse exactly 0 are
    candidates; they are confirmed on the additive tile (a live row can have lse = 0 too).
    """
    if add is None:
        return out, lse
    dead = torch.isneginf(add).all(dim=-1) & (lse == 0)  # (nb, H, R)
    return out.masked_fill(dead.unsqueeze(-1), 0.0), lse.masked_fill(dead, _NEG_INF)


__all__ = ["BandTiles", "TileSource", "as4", "fix_dead_rows", "gather4"]
