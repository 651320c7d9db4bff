"""Block math of ring attention: one query piece against one key/value piece, and the NaN rule.

Pieces are global: piece ``i`` holds positions ``[i·C, (i+1)·C)``. `tile_relation` says how a
query piece sees a key piece (skip, full, causal or masked); `block_forward` / `block_backward`
run the flash package's engines on it (the CPU kernel, or the pure-PyTorch engine elsewhere);
`reach` tells which rows attend a non-finite key or value entry.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..functional.flash import Logits, Residuals, TorchEngine, kernel_backward, kernel_forward
from ..functional.nan_rule import nan_flags
from ..masks import EMPTY, FULL, PARTIAL, Mask
from .ring_comm import RingConfig

_NEG_INF = float("-inf")


def piece_codes(mask: Mask, C: int, N: int, B: int, H: int) -> list[list[int]]:
    """The mask's block map over pieces (`Mask.block_map`, tiles of ``C × C``), united over the
    batch and heads: ``codes[q_id][k_id]`` is EMPTY / FULL only if so for every item and head.

    A host-side plan from the mask's structure (closed form for structured masks), computed once
    per call and shape.
    """
    codes = mask.block_map(N, N, C, C, batch=B, heads=H)  # (B|1, H|1, N/C, N/C)
    lo, hi = codes.amin(dim=(0, 1)), codes.amax(dim=(0, 1))
    return torch.where(lo == hi, lo, PARTIAL).tolist()


def tile_relation(
    q_id: int,
    k_id: int,
    *,
    cfg: RingConfig,
    C: int,
    N: int,
    B: int,
    H: int,
    device: torch.device,
) -> tuple[str, Tensor | None]:
    """How queries of piece q_id see keys of piece k_id: skip, full, causal or masked (a tile).

    Pieces are global: piece ``i`` holds positions ``[i·C, (i+1)·C)`` of the ``N`` positions.
    ``cfg.causal`` is the causal factor of the mask, ``cfg.mask`` the rest (None: nothing), read
    through its block map (`piece_codes`); only a PARTIAL piece pair evaluates the mask. The tile
    of a masked pair is bool ``(B|1, H|1, C, C)``, True = may attend.
    """
    causal, mask = cfg.causal, cfg.mask
    if causal and q_id < k_id:
        return "skip", None
    diagonal = "causal" if causal and q_id == k_id else "full"
    if mask is None:
        return diagonal, None
    key = (C, N, B, H)
    if key not in cfg.piece_codes:
        cfg.piece_codes[key] = piece_codes(mask, C, N, B, H)
    code = cfg.piece_codes[key][q_id][k_id]
    if code == EMPTY:
        return "skip", None
    if code == FULL:
        return diagonal, None
    b = torch.arange(B, device=device).view(-1, 1, 1, 1)
    h = torch.arange(H, device=device).view(1, -1, 1, 1)
    i = torch.arange(q_id * C, (q_id + 1) * C, device=device).view(1, 1, C, 1)
    j = torch.arange(k_id * C, (k_id + 1) * C, device=device).view(1, 1, 1, C)
    tile = mask.evaluate(b, h, i, j, N, N)
    if causal:
        tile = tile & (j <= i)
    if not bool(tile.any()):
        return "skip", None
    if bool(tile.all()):
        return "full", None
    return "masked", tile


def expand_kv(t: Tensor, H: int) -> Tensor:
    """``(B, H_kv, C, ·)`` → ``(B, H, C, ·)``: each key/value head repeated for its query group."""
    H_kv = t.shape[1]
    return t if H_kv == H else t.repeat_interleave(H // H_kv, dim=1)  # (B, H, C, ·)


def _reduce_kv(g: Tensor, H_kv: int) -> Tensor:
    B, H, C, D = g.shape
    if g.shape[1] == H_kv:
        return g
    return g.view(B, H_kv, H // H_kv, C, D).sum(2)  # (B, H_kv, C, D)


# Off the CPU (no fused CPU kernel) the blocks run on flash's pure-PyTorch engine, one chunk per
# piece side for typical pieces.
_TORCH_ENGINE = TorchEngine()


def _logits(q: Tensor, kind: str, tile: Tensor | None, scale: float) -> Logits:
    add = None
    if tile is not None:
        add = torch.zeros(tile.shape, dtype=q.dtype, device=q.device).masked_fill(~tile, _NEG_INF)
    return Logits(scale, add, kind == "causal")


def block_forward(
    q: Tensor, k: Tensor, v: Tensor, *, kind: str, tile: Tensor | None, scale: float
) -> tuple[Tensor, Tensor]:
    """``(out (B, H, C, Dv), lse (B, H, C) float32+)`` of q against one key/value piece."""
    H = q.shape[1]
    k, v = expand_kv(k, H), expand_kv(v, H)
    logits = _logits(q, kind, tile, scale)
    if q.device.type == "cpu":
        out, lse = kernel_forward(q, k, v, logits)
    else:
        out, lse, _ = _TORCH_ENGINE.forward(q, k, v, logits)
    if tile is not None:  # the kernel reports lse = 0 for rows with nothing to attend
        dead = ~tile.any(-1).expand(lse.shape)
        lse = lse.masked_fill(dead, _NEG_INF)
    return out, lse


def block_backward(
    res: Residuals, *, kind: str, tile: Tensor | None, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of one block given the GLOBAL out and lse (rows with lse = −inf contribute 0).

    ``res.k``, ``res.v`` have the key/value heads ``H_kv``; so do the returned dK, dV.
    """
    q = res.q
    H, H_kv = q.shape[1], res.k.shape[1]
    logits = _logits(q, kind, tile, scale)
    # A row that attends nothing anywhere has lse = −inf and a constant zero output: with lse
    # replaced by +inf its probabilities exp(s − lse) are exactly 0, so it contributes nothing.
    lse = res.lse.masked_fill(torch.isneginf(res.lse), math.inf)
    full = Residuals(
        dout=res.dout.contiguous(),
        q=q,
        k=expand_kv(res.k, H),
        v=expand_kv(res.v, H),
        out=res.out,
        lse=lse,
    )
    if q.device.type == "cpu":
        dq, dk, dv = kernel_backward(full, logits)
    else:
        dq, dk, dv = _TORCH_ENGINE.backward(full, logits)
    return dq, _reduce_kv(dk, H_kv), _reduce_kv(dv, H_kv)


def clean(x: Tensor) -> Tensor:
    """``x`` with every non-finite entry replaced by 0 (finite entries kept bit-exact)."""
    return torch.nan_to_num(x, 0.0, 0.0, 0.0)


def reach(bad: Tensor, kind: str, tile: Tensor | None, H: int) -> Tensor:
    """Whether each query row attends a non-finite entry of ``bad``'s columns: NaN if so, else 0.

    Args:
        bad: ``(B, H_kv, c, X)``, 0 or NaN per key and column, over one key piece.
        kind, tile: how the query piece sees the key piece (not "skip").
        H: query heads.

    Returns:
        ``(B, H_kv or H, c | 1, X)``: ``reach[i, x] = NaN`` iff some key j that row i attends
        has ``bad[j, x] = NaN`` (H heads only when the tile depends on the head).
    """
    if kind == "full":
        return bad.sum(-2, keepdim=True)  # NaN propagates through the sum
    if kind == "causal":  # the diagonal piece: row i attends keys 0..i of the piece
        return bad.cumsum(-2)
    assert tile is not None
    # Counts of attended non-finite entries, as a matmul of 0/1 matrices. bfloat16 is exact
    # enough: a sum of non-negative terms is > 0 iff one of them is, whatever the rounding.
    ind = torch.isnan(bad).to(torch.bfloat16)  # (B, H_kv, c, X)
    if tile.shape[0] == tile.shape[1] == 1:  # one (c, c) tile for every batch item and head
        B, H_kv, c, X = ind.shape
        cols = ind.permute(2, 0, 1, 3).reshape(c, B * H_kv * X)
        hits = (tile[0, 0].to(torch.bfloat16) @ cols).view(c, B, H_kv, X).permute(1, 2, 0, 3)
    else:
        if tile.shape[1] > 1:  # the tile depends on the head: compare per query head
            ind = expand_kv(ind, H)
        hits = tile.to(torch.bfloat16) @ ind
    return torch.zeros(hits.shape, dtype=bad.dtype, device=bad.device).masked_fill(
        hits > 0, math.nan
    )


def add_reach(acc: Tensor, reach: Tensor) -> None:
    """``acc (B, H, c, X) += reach`` with reach's ``H_kv`` heads broadcast over their groups."""
    H, H_r = acc.shape[1], reach.shape[1]
    if H_r == H:
        acc.add_(reach)
    else:
        acc.unflatten(1, (H_r, H // H_r)).add_(reach.unsqueeze(2))


__all__ = [
    "add_reach",
    "block_backward",
    "block_forward",
    "clean",
    "expand_kv",
    "nan_flags",
    "piece_codes",
    "reach",
    "tile_relation",
]
