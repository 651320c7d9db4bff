"""Closed-form block maps: tile codes EMPTY (0) / PARTIAL (1) / FULL (2) in O(tiles) work.

A block map classifies each ``bq × bk`` tile of the (query row, key) grid (`Mask.block_map`). The
helpers here compute it from a mask's structure instead of its dense rendering:

- `band_codes`: pairs with ``lo <= j − p <= hi`` (causal, sliding windows and their intersections);
- `diagonal_codes`: any mask of ``j − p`` alone (strided), by prefix sums over the L + S − 1
  diagonals;
- `interval_codes`: each row attends one interval of keys (`Mask.key_interval`: documents from
  lengths, and intersections with causal masks, windows and padding);
- `axis_codes`: a per-position flag along the rows or the keys (global tokens);
- `cell_codes`: a mask constant on a coarser grid of cells (BigBird's blocks);
- `combine_codes` and `refine`: ``&``/``|`` of code maps, and exact evaluation of the tiles a rule
  cannot decide;
- `dense_codes`: the fallback for masks given by a tensor or a function, from their rendering.

``p = r + S − L`` is the aligned position of query row ``r`` (`attnlab._index.align`). Tiles at the
ragged end cover only the positions that exist.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .._shapes import align, check_index_fn_output, index_grid

if TYPE_CHECKING:
    from .base import Mask

EMPTY, PARTIAL, FULL = 0, 1, 2


def tile_bounds(
    L: int, S: int, bq: int, bk: int, device: torch.device | str | None = None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Aligned position range ``[p0, p1)`` of each query tile and key range ``[k0, k1)`` of each
    key tile: four int64 tensors of shapes ``(nq,)``, ``(nq,)``, ``(nk,)``, ``(nk,)``."""
    r0 = torch.arange(-(-L // bq), device=device) * bq
    r1 = torch.clamp(r0 + bq, max=L)
    k0 = torch.arange(-(-S // bk), device=device) * bk
    k1 = torch.clamp(k0 + bk, max=S)
    return align(r0, L, S), align(r1, L, S), k0, k1


def codes_of(count: Tensor, area: Tensor) -> Tensor:
    """EMPTY where ``count == 0``, FULL where ``count == area``, else PARTIAL (int8)."""
    return torch.where(count == 0, EMPTY, torch.where(count == area, FULL, PARTIAL)).to(torch.int8)


def band_codes(
    L: int, S: int, bq: int, bk: int, lo: float, hi: float, device: torch.device | str | None = None
) -> Tensor:
    """Exact codes ``(1, 1, nq, nk)`` of the band ``lo <= j − p <= hi`` (±inf: no bound)."""
    p0, p1, k0, k1 = tile_bounds(L, S, bq, bk, device)
    dmin = (k0.view(1, -1) - (p1 - 1).view(-1, 1)).double()  # min of j − p over the tile
    dmax = ((k1 - 1).view(1, -1) - p0.view(-1, 1)).double()  # max of j − p
    empty = (dmax < lo) | (dmin > hi)
    full = (dmin >= lo) & (dmax <= hi)
    codes = torch.where(empty, EMPTY, torch.where(full, FULL, PARTIAL)).to(torch.int8)
    return codes.view(1, 1, *codes.shape)


def interval_codes(lo: Tensor | None, hi: Tensor, L: int, S: int, bq: int, bk: int) -> Tensor:
    """Exact codes ``(B|1, 1, nq, nk)`` of a mask whose row r attends the keys ``[lo_r, hi_r)``.

    Args:
        lo, hi: int64 broadcastable to ``(B|1, 1, L)`` (`Mask.key_interval`; lo None = 0).

    A tile is FULL iff every row's interval covers its keys (per query block: the largest lo and
    the smallest hi) and EMPTY iff no row's interval meets them: O(L · nk) comparisons, in chunks.
    """
    hi = hi.reshape(-1, hi.shape[-1]).expand(-1, L) if hi.shape[-1] == 1 else hi.reshape(-1, L)
    lo = torch.zeros_like(hi) if lo is None else lo.reshape(-1, lo.shape[-1]).expand_as(hi)
    nb = max(lo.shape[0], hi.shape[0])
    lo, hi = lo.expand(nb, L), hi.expand(nb, L)
    _, _, k0, k1 = tile_bounds(L, S, bq, bk, hi.device)
    nq, nk, pad_r = -(-L // bq), k0.numel(), -L % bq
    pad = torch.nn.functional.pad
    lo_max = pad(lo, (0, pad_r), value=0).view(nb, nq, bq).amax(-1, keepdim=True)
    hi_min = pad(hi, (0, pad_r), value=S).view(nb, nq, bq).amin(-1, keepdim=True)
    full = (lo_max <= k0) & (hi_min >= k1)  # (nb, nq, nk)
    lo_e = pad(lo, (0, pad_r), value=S).view(nb, nq, bq, 1)  # padded rows attend nothing
    hi_e = pad(hi, (0, pad_r), value=0).view(nb, nq, bq, 1)
    step = max(1, (1 << 22) // max(1, nb * bq * nk))
    hit = torch.cat(
        [
            ((a < k1) & (b > k0) & (a < b)).any(dim=2)
            for a, b in zip(lo_e.split(step, 1), hi_e.split(step, 1), strict=True)
        ],
        dim=1,
    )  # (nb, nq, nk)
    codes = torch.where(full, FULL, torch.where(hit, PARTIAL, EMPTY)).to(torch.int8)
    return codes.unsqueeze(1)


def _prefix(flags: Tensor) -> Tensor:
    """``c[n]`` = number of True among ``flags[..., :n]``, shape ``(..., n + 1)``."""
    c = flags.long().cumsum(-1)
    return torch.nn.functional.pad(c, (1, 0))


def diagonal_codes(
    L: int, S: int, bq: int, bk: int, keep: Tensor, device: torch.device | str | None = None
) -> Tensor:
    """Codes ``(1, 1, nq, nk)`` of a mask that depends only on ``d = j − p``.

    Args:
        keep: bool ``(L + S − 1,)``, whether ``d = −(S − 1) + n`` is attended (every diagonal of
            the grid, ``d ∈ [−(S − 1), L − 1]``).

    A rectangular tile meets every diagonal between its smallest and largest ``d``, so it is FULL
    iff all of them are kept and EMPTY iff none is.
    """
    p0, p1, k0, k1 = tile_bounds(L, S, bq, bk, device)
    c = _prefix(keep.to(device))
    a = k0.view(1, -1) - (p1 - 1).view(-1, 1) + (S - 1)  # index of the smallest d in the tile
    b = (k1 - 1).view(1, -1) - p0.view(-1, 1) + (S - 1)  # of the largest
    codes = codes_of(c[b + 1] - c[a], b - a + 1)
    return codes.view(1, 1, *codes.shape)


def axis_codes(flags: Tensor, starts: Tensor, ends: Tensor) -> Tensor:
    """Codes of tiles ``[starts, ends)`` along one axis from per-position flags ``(..., n)``.

    Positions outside ``[0, n)`` count as False. Returns int8 of shape ``(..., len(starts))``.
    """
    n = flags.shape[-1]
    c = _prefix(flags)
    lo, hi = starts.clamp(0, n), ends.clamp(0, n)
    count = c[..., hi] - c[..., lo]
    return codes_of(count, ends - starts)


def cell_codes(
    table: Tensor, q_cells: tuple[Tensor, Tensor], k_cells: tuple[Tensor, Tensor]
) -> Tensor:
    """Codes ``(nq, nk)`` of tiles over a mask constant on cells, by 2-D prefix sums.

    Args:
        table: bool ``(nQ, nK)``, whether each cell is attended.
        q_cells: first and last cell row ``(nq,)`` each query tile meets (inclusive).
        k_cells: first and last cell column ``(nk,)`` each key tile meets (inclusive).

    Every cell in a tile's cell range holds at least one of the tile's pairs, so the tile is FULL
    iff all those cells are attended and EMPTY iff none is.
    """
    c = _prefix(_prefix(table).transpose(0, 1)).transpose(0, 1)  # (nQ + 1, nK + 1)
    qa, qz = q_cells[0].view(-1, 1), q_cells[1].view(-1, 1) + 1
    ka, kz = k_cells[0].view(1, -1), k_cells[1].view(1, -1) + 1
    count = c[qz, kz] - c[qa, kz] - c[qz, ka] + c[qa, ka]
    return codes_of(count, (qz - qa) * (kz - ka))


def combine_codes(op: str, *maps: Tensor) -> tuple[Tensor, Tensor]:
    """The codes of ``&`` / ``|`` of masks from theirs, and the tiles left undecided.

    Returns:
        ``(codes, todo)``: int8 codes broadcast over the operands, and a bool ``(nq, nk)`` of the
        tiles where two or more operands are PARTIAL (their combination may be anything: `refine`
        evaluates them exactly).
    """
    maps = torch.broadcast_tensors(*maps)
    stacked = torch.stack(maps)
    partial = (stacked == PARTIAL).sum(0) >= 2
    if op == "&":
        codes = torch.where(
            (stacked == EMPTY).any(0), EMPTY, torch.where((stacked == FULL).all(0), FULL, PARTIAL)
        )
    else:
        codes = torch.where(
            (stacked == FULL).any(0), FULL, torch.where((stacked == EMPTY).all(0), EMPTY, PARTIAL)
        )
    undecided = partial & (codes == PARTIAL)
    return codes.to(torch.int8).contiguous(), undecided.flatten(0, -3).any(0)


def dense_codes(
    mask: Mask,
    L: int,
    S: int,
    bq: int,
    bk: int,
    nb: int,
    nh: int,
    device: torch.device | str | None,
    chunk: int,
) -> Tensor:
    """Codes ``(B|1, H|1, nq, nk)`` from the mask's rendering, in chunks of whole query tiles.

    ``chunk`` bounds the elements rendered at once; every other helper here avoids rendering.
    """
    nk = -(-S // bk)
    pad_s = nk * bk - S
    rows_per_chunk = max(bq, (chunk // max(S, 1)) // bq * bq)
    parts = []
    for lo in range(0, max(L, 1), rows_per_chunk):  # L = 0: one empty chunk
        hi = min(L, lo + rows_per_chunk)
        m = mask.eval_rows(torch.arange(lo, hi, device=device), L, S, nb, nh, device)
        anyv = m.to(torch.int8)
        allv = anyv
        pad_r = -(hi - lo) % bq
        if pad_r or pad_s:
            anyv = torch.nn.functional.pad(anyv, (0, pad_s, 0, pad_r), value=0)
            allv = torch.nn.functional.pad(allv, (0, pad_s, 0, pad_r), value=1)
        shp = (anyv.shape[0], anyv.shape[1], anyv.shape[2] // bq, bq, nk, bk)
        has = anyv.view(shp).amax(dim=(3, 5))  # (B|1, H|1, nq_chunk, nk)
        full = allv.view(shp).amin(dim=(3, 5))
        parts.append((has + full).to(torch.int8))
    nbo = max(p.shape[0] for p in parts)
    nho = max(p.shape[1] for p in parts)
    return torch.cat([p.expand(nbo, nho, -1, -1) for p in parts], dim=2)


def tensor_codes(t: Tensor, L: int, S: int, bq: int, bk: int) -> Tensor:
    """Codes ``(B|1, H|1, nq, nk)`` of a bool tensor ``t (B|1, H|1, L|1, S|1)`` read once:
    O(t.numel()), never the L×S grid a broadcast dim stands for (a key mask ``(B, 1, 1, S)``
    costs O(B·S) at any L). Tiles past the grid's edge count as their in-range part, as in
    `dense_codes`.
    """
    nq, nk = -(-L // bq), -(-S // bk)
    anyv = allv = t.to(torch.int8)
    if t.shape[-1] > 1:  # keys: (…, nk, bk) reduced over the tile's keys
        pad = nk * bk - S
        anyv = torch.nn.functional.pad(anyv, (0, pad), value=0).unflatten(-1, (nk, bk)).amax(-1)
        allv = torch.nn.functional.pad(allv, (0, pad), value=1).unflatten(-1, (nk, bk)).amin(-1)
    if t.shape[-2] > 1:  # queries: (…, nq, bq, nk|1) reduced over the tile's rows
        pad = nq * bq - L
        anyv = torch.nn.functional.pad(anyv, (0, 0, 0, pad), value=0)
        allv = torch.nn.functional.pad(allv, (0, 0, 0, pad), value=1)
        anyv = anyv.unflatten(-2, (nq, bq)).amax(-2)
        allv = allv.unflatten(-2, (nq, bq)).amin(-2)
    codes = (anyv + allv).to(torch.int8)  # EMPTY 0, PARTIAL 1, FULL 2
    return codes.expand(*codes.shape[:2], nq, nk).clone()


def tile_eval(
    mask: Mask, rows: Tensor, keys: Tensor, L: int, S: int, nb: int, nh: int, device
) -> Tensor:
    """The mask on raw rows × keys, shape ``(B|1, H|1, R, K)`` (bool)."""
    b, h, i, j = index_grid(nb, nh, L, S, rows=rows, keys=keys, aligned=False, device=device)
    out = mask.evaluate(b, h, i, j, L, S)
    out = check_index_fn_output("mask function", mask, out, (b, h, i, j), want_bool=True)
    return out.reshape((1,) * (4 - out.dim()) + tuple(out.shape))


def refine(
    mask: Mask,
    codes: Tensor,
    todo: Tensor,
    L: int,
    S: int,
    bq: int,
    bk: int,
    nb: int,
    nh: int,
    device: torch.device | str | None,
) -> Tensor:
    """Evaluates exactly the tiles where ``todo`` (nq, nk) is True and writes their codes.

    Plan building, not a forward path: the tile list is read on the host (eager calls; under
    `torch.compile` flash builds plans inside its custom op when the graph runs).
    """
    if codes.is_meta:  # meta tensors have shapes but no values: the codes' shape is the answer
        return codes
    codes = codes.clone()
    for qb in todo.any(dim=1).nonzero().flatten().tolist():
        tiles = todo[qb].nonzero().flatten()  # (nt,)
        nt = tiles.numel()
        r0, r1 = qb * bq, min(L, (qb + 1) * bq)
        keys = (tiles.view(-1, 1) * bk + torch.arange(bk, device=tiles.device)).flatten()
        valid = (keys < S).view(1, 1, 1, -1)  # (nt·bk,) keys, the ragged end masked out
        rows = torch.arange(r0, r1, device=device)
        m = tile_eval(mask, rows, keys.clamp(max=S - 1), L, S, nb, nh, device)  # (B|1, H|1, R, K)
        shp = (m.shape[0], m.shape[1], r1 - r0, nt, bk)
        anyv = (m & valid).reshape(shp).any(dim=4).any(dim=2)  # (B|1, H|1, nt)
        allv = (m | ~valid).reshape(shp).all(dim=4).all(dim=2)
        val = anyv.to(torch.int8) + allv.to(torch.int8)
        sub = codes[:, :, qb]  # (B|1, H|1, nk), a view
        sub[:, :, tiles] = val.expand(codes.shape[0], codes.shape[1], nt)
    return codes


__all__ = [
    "EMPTY",
    "FULL",
    "PARTIAL",
    "axis_codes",
    "band_codes",
    "cell_codes",
    "codes_of",
    "combine_codes",
    "dense_codes",
    "diagonal_codes",
    "interval_codes",
    "refine",
    "tile_bounds",
    "tile_eval",
]
