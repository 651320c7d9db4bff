"""The structured mask patterns of the literature, each a small index function.

Each pattern states its closed form once, through the `Mask` protocol: causal masks, sliding
windows and strided patterns as progressions of ``d = j − p`` (`Mask.diagonals`; the index
function, band, key intervals, counts and block maps derive from it), the others as an index
function of the aligned query position ``p = i + S − L`` (bottom-right alignment, computed once in
`Mask.evaluate`) and the key position ``j``, plus the closed forms that exist: an interval of keys
per row (`Mask.key_interval`), a geometry for exact counts (`Mask.geometry`) and a block map
(`Mask.block_codes`) in O(tiles) work.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
from torch import Tensor

from .._shapes import check_bool, check_int, static_int
from .base import Mask, TensorMask, _describe
from .blocks import (
    EMPTY,
    FULL,
    PARTIAL,
    axis_codes,
    band_codes,
    cell_codes,
    combine_codes,
    refine,
    tile_bounds,
)
from .counts import COUNT_BUDGET, HUGE, Geometry, diagonal_pairs
from .routing import BlockTableMask


def _cap(n: int) -> int:
    """``n`` capped to `counts.HUGE`: `global_local(sys.maxsize)` cannot overflow int64."""
    return min(n, HUGE)


def _index_tensor(name: str, values: object, *, ndim: tuple[int, ...]) -> Tensor:
    t = values if isinstance(values, Tensor) else torch.as_tensor(values)
    if not isinstance(values, Tensor) and t.numel() == 0:
        t = t.long()  # an empty list has no dtype of its own (torch makes it float)
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise TypeError(f"{name} must hold integers, got dtype {t.dtype}")
    if t.dim() not in ndim:
        dims = " or ".join(map(str, ndim))
        raise ValueError(f"{name} must have {dims} dims, got shape {tuple(t.shape)}")
    return t.long()


def _short_list(t: Tensor, edge: int = 3) -> str:
    """``[1, 2, 3]``, or ``[1, 2, 3, ..., 98, 99] (100 values)`` above ``2·edge + 2`` values."""
    if t.numel() <= 2 * edge + 2:
        return str(t.tolist())
    head, tail = t[:edge].tolist(), t[-edge:].tolist()
    return f"[{', '.join(map(str, head))}, ..., {', '.join(map(str, tail))}] ({t.numel()} values)"


class CausalMask(Mask):
    """Bottom-right causal: key ``j`` is visible from position ``p`` iff ``j <= p``."""

    def diagonals(self):
        return [(None, 0, 1, 0)]  # j − p <= 0

    def __repr__(self) -> str:
        return "causal()"

    def spec(self):
        return "causal", []


class SlidingWindowMask(Mask):
    """A band of ``window`` keys (causal) or ``2·window − 1`` keys (non-causal) around a query."""

    def __init__(self, window: int, causal: bool = True) -> None:
        self.window = check_int("window", window, minimum=1)
        self.causal = bool(causal)

    def diagonals(self):
        # the one statement of the band: 1 − w <= j − p <= 0 (causal) or <= w − 1
        reach = static_int(self.window) - 1
        return [(-reach, 0 if self.causal else reach, 1, 0)]

    def __repr__(self) -> str:
        return f"sliding_window({self.window}, causal={self.causal})"

    def spec(self):
        return f"window:{static_int(self.window)}:{int(self.causal)}", []


class WindowMask(Mask):
    """flash-attn's ``window_size=(left, right)``: keys ``p − left <= j <= p + right``, −1 open."""

    def __init__(self, left: int, right: int) -> None:
        self.left = check_int("left", left, minimum=-1)
        self.right = check_int("right", right, minimum=-1)

    def diagonals(self):
        # the one statement of the window: −left <= j − p <= right, −1 leaving that side open
        lo = None if self.left < 0 else -static_int(self.left)
        hi = None if self.right < 0 else static_int(self.right)
        return [(lo, hi, 1, 0)]

    def __repr__(self) -> str:
        return f"window({self.left}, {self.right})"

    def spec(self):
        return f"wnd:{static_int(self.left)}:{static_int(self.right)}", []


class IntervalMask(Mask):
    """Row ``i`` (raw query row, no alignment) attends keys ``lo[i] <= j < hi[i]``.

    Packed variable-length batches whose queries and keys are laid out differently
    (cross-attention, paged or partly used KV): each row's one run of keys, given as data.
    """

    pins_size = True

    def __init__(self, lo: Tensor, hi: Tensor, S: int) -> None:
        self.lo = _index_tensor("lo", lo, ndim=(1,))
        self.hi = _index_tensor("hi", hi, ndim=(1,))
        if self.lo.shape != self.hi.shape:
            raise ValueError(
                f"lo and hi must match, got {tuple(self.lo.shape)}, {tuple(self.hi.shape)}"
            )
        self.S = check_int("S", S, minimum=0)

    def _check(self, L: int, S: int) -> None:
        if (self.lo.numel(), self.S) != (L, S):
            raise ValueError(
                f"intervals cover L={self.lo.numel()} rows and S={self.S} keys, got L={L}, S={S}"
            )

    def evaluate(self, b, h, i, j, L, S):  # noqa: ARG002 (the Mask protocol's signature)
        self._check(L, S)
        lo, hi = self.lo.to(i.device), self.hi.to(i.device)
        ic = i.clamp(0, max(L - 1, 0))
        return (j >= lo[ic]) & (j < hi[ic])

    def key_interval(self, L, S, *, device=None):
        self._check(L, S)
        return self.lo.to(device).view(1, 1, L), self.hi.to(device).view(1, 1, L)

    def default_size(self) -> tuple[int, int]:
        return max(1, self.lo.numel()), max(1, self.S)

    def __repr__(self) -> str:
        return f"intervals(L={self.lo.numel()}, S={self.S})"

    def spec(self):
        return f"intervals:{static_int(self.S)}", [self.lo, self.hi]


class PaddingMask(Mask):
    """Key positions ``j >= lengths[b]`` are masked for every query of batch item ``b``."""

    over_keys = True

    def __init__(self, lengths: Sequence[int] | Tensor) -> None:
        self.lengths = _index_tensor("lengths", lengths, ndim=(1,))
        # a value check reads the tensor on the host: eager only (a compiled graph skips it,
        # and meta lengths hold no value)
        readable = not torch.compiler.is_compiling() and not self.lengths.is_meta
        if readable and (self.lengths < 0).any():
            raise ValueError(f"lengths must be >= 0, got {self.lengths.tolist()}")
        self.batch_size = int(self.lengths.numel())
        # Lengths given as Python ints are structure: backends may slice keys by them (no mask
        # tensor, no data read). Lengths given as a tensor stay data.
        self.py_lengths: tuple[int, ...] | None = None
        if isinstance(lengths, (list, tuple)):
            self.py_lengths = tuple(int(n) for n in lengths)

    def mod(self, b, h, p, j, S):  # noqa: ARG002 (the Mask protocol's signature)
        n = self.lengths.to(j.device)
        # One length broadcasts over a batch of any size (batch_size 1 combines with any batch).
        return j < (n[b] if n.numel() != 1 else n.view(1, 1, 1, 1))

    def block_codes(self, L, S, bq, bk, nb, nh, device):  # noqa: ARG002 (the Mask protocol's signature)
        _, _, k0, k1 = tile_bounds(L, S, bq, bk, device)
        n = self.lengths.to(device).view(-1, 1)  # (B, 1)
        codes = torch.where(k1 <= n, FULL, torch.where(k0 >= n, EMPTY, PARTIAL)).to(torch.int8)
        nq, nk = -(-L // bq), k0.numel()
        return codes.view(-1, 1, 1, nk).expand(-1, 1, nq, nk).clone()

    def key_interval(self, L, S, *, device=None):  # noqa: ARG002 (the Mask protocol's signature)
        return None, self.lengths.to(device).clamp(max=S).view(-1, 1, 1)

    def key_mask(self, L, S, *, device=None):  # noqa: ARG002 (the Mask protocol's signature)
        return torch.arange(S, device=device) < self.lengths.to(device).view(-1, 1)  # (B, S)

    def geometry(self, L, S):  # noqa: ARG002 (the Mask protocol's signature)
        return Geometry(key_limit=[int(n) for n in self.lengths.tolist()])

    def default_size(self) -> tuple[int, int]:
        n = max(1, int(self.lengths.max())) if self.lengths.numel() else 1
        return n, n

    def __repr__(self) -> str:
        return f"padding({_short_list(self.lengths)})"

    def spec(self):
        if self.py_lengths is not None:
            return "padding:" + ",".join(str(static_int(n)) for n in self.py_lengths), []
        return "padding", [self.lengths]


class StridedMask(Mask):
    """Sparse-Transformer strided pattern: a local block of ``stride`` plus every stride-th key."""

    def __init__(self, stride: int, causal: bool = True) -> None:
        self.stride = check_int("stride", stride, minimum=1)
        self.causal = bool(causal)

    def diagonals(self):
        # d = j − p: the local block |d| < stride, then every multiple of stride beyond it
        s = self.stride
        pieces = [(-(s - 1), 0 if self.causal else s - 1, 1, 0), (None, -s, s, 0)]
        return pieces if self.causal else [*pieces, (s, None, s, 0)]

    def __repr__(self) -> str:
        return f"strided({self.stride}, causal={self.causal})"

    def spec(self):
        return f"strided:{static_int(self.stride)}:{int(self.causal)}", []


class GlobalLocalMask(Mask):
    """Longformer: a band ``|p − j| < window`` plus global tokens that see and are seen by all."""

    def __init__(self, window: int, global_tokens: int | Sequence[int] | Tensor) -> None:
        self.window = check_int("window", window, minimum=1)
        if isinstance(global_tokens, int) and not isinstance(global_tokens, bool):
            if global_tokens < 0:
                raise ValueError(f"global_tokens must be >= 0, got {global_tokens}")
            self.global_idx = torch.arange(global_tokens)
        else:
            self.global_idx = _index_tensor("global_tokens", global_tokens, ndim=(1,))
            if (self.global_idx < 0).any():
                raise ValueError(
                    f"global_tokens positions must be >= 0, got {self.global_idx.tolist()}"
                )

    def _is_global(self, pos: Tensor) -> Tensor:
        g = self.global_idx.to(pos.device)
        return torch.isin(pos, g)

    def mod(self, b, h, p, j, S):  # noqa: ARG002 (the Mask protocol's signature)
        return ((p - j).abs() < _cap(self.window)) | self._is_global(p) | self._is_global(j)

    def block_codes(self, L, S, bq, bk, nb, nh, device):
        # band | global query rows | global keys, each in closed form; tiles where two of them
        # are PARTIAL are evaluated exactly.
        reach = float(self.window - 1)
        band = band_codes(L, S, bq, bk, -reach, reach, device)
        p0, p1, k0, k1 = tile_bounds(L, S, bq, bk, device)
        flags = self._is_global(self.positions(L, S, device=device))  # (L,), by query row
        rows = axis_codes(flags, p0 - p0[0], p1 - p0[0]).view(1, 1, -1, 1)  # tiles by row
        keys = axis_codes(self._is_global(torch.arange(S, device=device)), k0, k1)
        codes, todo = combine_codes("|", band, rows, keys.view(1, 1, 1, -1))
        return refine(self, codes, todo, L, S, bq, bk, nb, nh, device)

    def geometry(self, L, S):
        # Inclusion-exclusion over the band |p − j| < w, global query rows and global keys:
        # pairs = L·S − #(outside the band, row and key not global). O(G log G) for G globals.
        if L == 0 or S == 0:
            return Geometry(pairs=[[0]])
        w = min(self.window, max(L, S) + 1)
        g = torch.unique(self.global_idx)
        keys = g[g < S]  # global key positions
        rows = keys[keys >= S - L]  # global query positions (aligned p = i + S − L)
        plain = (L - rows.numel()) * (S - keys.numel())
        band = diagonal_pairs(L, S, -(w - 1) + S - L, (w - 1) + S - L)
        # band pairs of the global rows, of the global keys, and of both
        band_rows = int(((rows + w - 1).clamp(max=S - 1) - (rows - w + 1).clamp(min=0) + 1).sum())
        lo_p = (keys - w + 1).clamp(min=S - L)
        band_keys = int(((keys + w - 1).clamp(max=S - 1) - lo_p + 1).clamp(min=0).sum())
        hi = torch.searchsorted(keys, rows + w - 1, right=True)
        band_both = int((hi - torch.searchsorted(keys, rows - w + 1)).sum())
        outside = plain - (band - band_rows - band_keys + band_both)
        return Geometry(pairs=[[L * S - outside]])

    def __repr__(self) -> str:
        return f"global_local({self.window}, global_tokens={_short_list(self.global_idx)})"

    def spec(self):
        return f"global_local:{static_int(self.window)}", [self.global_idx]


class BigBirdMask(Mask):
    """BigBird block sparsity: sliding window, global and random blocks of ``block_size`` positions.

    Block ``qb`` of queries attends key block ``kb`` when ``|qb − kb| <= window_blocks // 2``, when
    either block is one of the first ``global_blocks``, or when ``kb`` is one of the
    ``random_blocks`` blocks drawn for ``qb`` (from those not already attended; fixed by ``seed``).
    """

    def __init__(
        self, block_size: int, window_blocks: int, global_blocks: int, random_blocks: int, seed: int
    ) -> None:
        self.block_size = check_int("block_size", block_size, minimum=1)
        self.window_blocks = check_int("window_blocks", window_blocks, minimum=1)
        if self.window_blocks % 2 == 0:
            raise ValueError(f"window_blocks must be odd (a centred window), got {window_blocks}")
        self.global_blocks = check_int("global_blocks", global_blocks, minimum=0)
        self.random_blocks = check_int("random_blocks", random_blocks, minimum=0)
        self.seed = int(seed)
        self._tables: dict[int, Tensor] = {}
        self._moved: dict[tuple[int, torch.device], Tensor] = {}

    def random_table(self, num_blocks: int) -> Tensor:
        """Bool ``(num_blocks, num_blocks)``: True where query block attends key block at random.

        Drawn once per size on the host with a CPU generator seeded by ``seed`` (the same pattern
        on every device), like the data of other masks; `_block_keep` keeps one copy per device.
        """
        if num_blocks not in self._tables:
            gen = torch.Generator().manual_seed(self.seed)
            table = torch.zeros(num_blocks, num_blocks, dtype=torch.bool)
            blocks = torch.arange(num_blocks)
            radius = self.window_blocks // 2
            for qb in range(self.global_blocks, num_blocks):
                taken = ((blocks - qb).abs() <= radius) | (blocks < self.global_blocks)
                free = blocks[~taken]
                pick = free[torch.randperm(free.numel(), generator=gen)[: self.random_blocks]]
                table[qb, pick] = True
            self._tables[num_blocks] = table
        return self._tables[num_blocks]

    def _block_keep(self, qb: Tensor, kb: Tensor, S: int) -> Tensor:
        """Whether query block ``qb`` (negative before the keys) attends key block ``kb``."""
        radius, n_global = _cap(self.window_blocks // 2), _cap(self.global_blocks)
        window = (qb - kb).abs() <= radius
        global_q = (qb >= 0) & (qb < n_global)
        keep = window | global_q | (kb < n_global)
        if self.random_blocks:
            n = max(1, -(-S // self.block_size))
            key = (n, qb.device)
            if key not in self._moved:  # one host-to-device copy per size and device
                self._moved[key] = self.random_table(n).to(qb.device)
            table = self._moved[key]
            valid = qb >= 0
            keep = keep | (table[qb.clamp(min=0), kb] & valid)
        return keep

    def natural_block(self) -> int:
        return static_int(self.block_size)

    def mod(self, b, h, p, j, S):  # noqa: ARG002 (the Mask protocol's signature)
        block = _cap(self.block_size)
        qb = torch.div(p, block, rounding_mode="floor")
        return self._block_keep(qb, torch.div(j, block, rounding_mode="floor"), S)

    def block_codes(self, L, S, bq, bk, nb, nh, device):  # noqa: ARG002 (the Mask protocol's signature)
        # The mask is constant on (query block, key block) cells: tiles from the cell table.
        block = _cap(self.block_size)
        p0, p1, k0, k1 = tile_bounds(L, S, bq, bk, device)
        first = (S - L) // block  # the cell of row 0, aligned position S − L (negative if L > S)
        qcells = torch.arange(first, (S - 1) // block + 1, device=device)
        kcells = torch.arange(-(-S // block), device=device)
        table = self._block_keep(qcells.view(-1, 1), kcells.view(1, -1), S)
        q_range = (p0 // block - first, (p1 - 1) // block - first)
        codes = cell_codes(table, q_range, (k0 // block, (k1 - 1) // block))
        return codes.view(1, 1, *codes.shape)

    def geometry(self, L, S):
        # Constant on (query block, key block) cells: Σ cell · rows in it · keys in it.
        if L == 0 or S == 0:
            return Geometry(pairs=[[0]])
        block = _cap(self.block_size)
        first, last, nk = (S - L) // block, (S - 1) // block, -(-S // block)
        if (last - first + 1) * nk > COUNT_BUDGET:
            return None  # the row fallback (or its error) decides
        qc = torch.arange(first, last + 1)
        kc = torch.arange(nk)
        table = self._block_keep(qc.view(-1, 1), kc.view(1, -1), S)
        rows = (torch.clamp((qc + 1) * block, max=S) - torch.clamp(qc * block, min=S - L)).clamp(
            min=0
        )
        keys = torch.clamp((kc + 1) * block, max=S) - kc * block
        return Geometry(pairs=[[int((table.long() * rows.view(-1, 1) * keys.view(1, -1)).sum())]])

    def __repr__(self) -> str:
        return (
            f"bigbird(block_size={self.block_size}, window_blocks={self.window_blocks}, "
            f"global_blocks={self.global_blocks}, random_blocks={self.random_blocks}, "
            f"seed={self.seed})"
        )

    def spec(self):
        b = self
        return (
            f"bigbird:{static_int(b.block_size)}:{static_int(b.window_blocks)}:"
            f"{static_int(b.global_blocks)}:{static_int(b.random_blocks)}:{static_int(b.seed)}",
            [],
        )


class DocumentMask(Mask):
    """Block-diagonal mask for packed sequences: attend only within the same document id.

    ``ids`` has shape ``(S,)`` or ``(B, S)`` and labels every key position; the queries are the last
    ``L`` positions (bottom-right alignment). Combine with ``causal()`` for packed causal LMs.
    """

    pins_size = True

    def __init__(self, ids: Sequence[int] | Tensor) -> None:
        self.ids = _index_tensor("ids", ids, ndim=(1, 2))
        self.batch_size = int(self.ids.shape[0]) if self.ids.dim() == 2 else None
        # True when every id labels one contiguous run (built from lengths / cu_seqlens): then
        # each row's keys form one interval (`key_interval`). Raw ids may repeat in several runs.
        self.runs_distinct = False

    @classmethod
    def from_lengths(cls, lengths: Sequence[int] | Tensor) -> DocumentMask:
        """Builds the mask from per-document lengths, e.g. ``[3, 5, 2]`` for 10 packed tokens."""
        n = _index_tensor("lengths", lengths, ndim=(1,))
        if (n < 0).any():
            raise ValueError(f"lengths must be >= 0, got {n.tolist()}")
        mask = cls(torch.repeat_interleave(torch.arange(n.numel()), n))
        mask.runs_distinct = True
        return mask

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: Sequence[int] | Tensor) -> DocumentMask:
        """Builds the mask from cumulative lengths ``[0, n0, n0+n1, …]`` (flash-attn convention)."""
        cu = _index_tensor("cu_seqlens", cu_seqlens, ndim=(1,))
        if cu.numel() < 1 or int(cu[0]) != 0 or (cu.diff() < 0).any():
            raise ValueError(f"cu_seqlens must start at 0 and be non-decreasing, got {cu.tolist()}")
        return cls.from_lengths(cu.diff())

    def mod(self, b, h, p, j, S):  # noqa: ARG002 (the Mask protocol's signature)
        if self.ids.shape[-1] != S:
            raise ValueError(f"document ids cover {self.ids.shape[-1]} positions, but S={S}")
        if S == 0:  # no key positions: nothing to look up (ids[..., 0] would be out of range)
            return torch.zeros_like(j, dtype=torch.bool)
        ids = self.ids.to(p.device)
        ids = ids if ids.dim() == 2 else ids.view(1, S)  # (B|1, S); reshape(-1, 0) fails
        bi = b if ids.shape[0] > 1 else torch.zeros_like(b)
        valid = p >= 0
        q_ids = ids[bi, p.clamp(min=0)]
        return (q_ids == ids[bi, j]) & valid

    def key_interval(self, L, S, *, device=None):
        if not self.runs_distinct:
            return None
        if self.ids.shape[-1] != S:
            raise ValueError(f"document ids cover {self.ids.shape[-1]} positions, but S={S}")
        ids = self.ids.to(device)
        ids = ids if ids.dim() == 2 else ids.view(1, S)  # (B|1, S)
        if S == 0:
            z = torch.zeros(ids.shape[0], 1, L, dtype=torch.long, device=device)
            return z, z
        j = torch.arange(S, device=device).expand_as(ids)
        new = torch.ones_like(ids, dtype=torch.bool)
        new[:, 1:] = ids[:, 1:] != ids[:, :-1]
        # start of the run holding j; end (exclusive) of the run holding j
        start = torch.where(new, j, 0).cummax(dim=1).values  # (B|1, S)
        last = torch.ones_like(new)
        last[:, :-1] = new[:, 1:]
        end = torch.where(last, j + 1, S).flip(1).cummin(dim=1).values.flip(1)  # (B|1, S)
        p = self.positions(L, S, device=device)
        valid = p >= 0
        pc = p.clamp(min=0)
        lo, hi = start[:, pc], end[:, pc]  # (B|1, L)
        hi = torch.where(valid, hi, lo)  # rows before the keys attend nothing
        return lo.unsqueeze(1), hi.unsqueeze(1)

    def block_codes(self, L, S, bq, bk, nb, nh, device):
        if self.runs_distinct:  # one run of keys per row: exact from the intervals
            return super().block_codes(L, S, bq, bk, nb, nh, device)
        # Raw ids: conservative id-range rules per tile, then exact evaluation of the rest.
        if self.ids.shape[-1] != S:
            raise ValueError(f"document ids cover {self.ids.shape[-1]} positions, but S={S}")
        nq, nk = -(-L // bq), -(-S // bk)
        ids = self.ids.to(device)
        ids = ids if ids.dim() == 2 else ids.view(1, S)  # (B|1, S)
        big = torch.iinfo(torch.long).max
        pad = torch.nn.functional.pad
        # key tiles: min / max id over the positions that exist
        kmin = pad(ids, (0, nk * bk - S), value=big).view(-1, nk, bk).amin(-1)
        kmax = pad(ids, (0, nk * bk - S), value=-big).view(-1, nk, bk).amax(-1)
        # query tiles: ids at the aligned positions (invalid before the keys)
        p = self.positions(L, S, device=device)
        valid = p >= 0
        qids = ids[:, p.clamp(min=0)]  # (B|1, L)
        qmin = pad(torch.where(valid, qids, big), (0, nq * bq - L), value=big)
        qmax = pad(torch.where(valid, qids, -big), (0, nq * bq - L), value=-big)
        qmin = qmin.view(-1, nq, bq).amin(-1).unsqueeze(-1)  # (B|1, nq, 1)
        qmax = qmax.view(-1, nq, bq).amax(-1).unsqueeze(-1)
        p0, p1, _, _ = tile_bounds(L, S, bq, bk, device)
        nvalid = (p1.clamp(min=0) - p0.clamp(min=0)).view(1, nq, 1)
        allvalid, novalid = nvalid == (p1 - p0).view(1, nq, 1), nvalid == 0
        kmin, kmax = kmin.unsqueeze(1), kmax.unsqueeze(1)  # (B|1, 1, nk)
        empty = novalid | (qmax < kmin) | (qmin > kmax)
        full = allvalid & (qmin == qmax) & (kmin == kmax) & (qmin == kmin)
        codes = torch.where(empty, EMPTY, torch.where(full, FULL, PARTIAL)).to(torch.int8)
        todo = (~empty & ~full).any(dim=0)  # (nq, nk)
        return refine(self, codes.unsqueeze(1), todo, L, S, bq, bk, nb, nh, device)

    def _check_S(self, S: int) -> None:
        if self.ids.shape[-1] != S:
            raise ValueError(f"document ids cover {self.ids.shape[-1]} positions, but S={S}")

    def geometry(self, L, S):
        self._check_S(S)
        ids = self.ids if self.ids.dim() == 2 else self.ids.view(1, S)
        if not self.runs_distinct:  # raw ids: counted from the ids
            return Geometry(pairs=self._id_counts(ids, L, S))
        runs = []
        for row in ids:
            _, lengths = torch.unique_consecutive(row, return_counts=True)
            starts = [0, *torch.cumsum(lengths, 0).tolist()]
            runs.append([(a, n) for a, n in zip(starts, lengths.tolist(), strict=False)])
        return Geometry(runs=runs)

    @staticmethod
    def _id_counts(ids: Tensor, L: int, S: int) -> list[list[int]]:
        """Σ over ids of (queries with the id) × (keys with the id), by bincount, per row."""
        out = []
        for row in ids:
            if S == 0 or L == 0:
                out.append([0])
                continue
            _, codes = torch.unique(row, return_inverse=True)
            keys = torch.bincount(codes)
            queries = torch.bincount(codes[max(0, S - L) :], minlength=keys.numel())
            out.append([int((keys * queries).sum())])
        return out

    def default_size(self) -> tuple[int, int]:
        n = max(1, int(self.ids.shape[-1]))
        return n, n

    def __repr__(self) -> str:
        return f"document(ids of shape {tuple(self.ids.shape)})"

    def spec(self):
        return f"document:{int(self.runs_distinct)}", [self.ids]


# What linear, FAVOR+ and hierarchical attention accept (`causal_and_padding`).
KERNEL_MASKS = (
    "None, masks.causal(), masks.padding(lengths), a key mask masks.from_tensor(keep) with keep "
    "of shape (B|1, 1, 1, S), or an & of them"
)


def _key_only(m: Mask) -> bool:
    """``m`` is a bool tensor mask that depends on the batch item and the key only."""
    return isinstance(m, TensorMask) and m.t.shape[1] == 1 and m.t.shape[2] == 1


def causal_and_padding(
    mask: object, *, where: str, batch: int, S: int, device: torch.device | str | None = None
) -> tuple[bool, Tensor | None]:
    """Splits a mask made of `causal` and `padding` into ``(causal, key_mask)``.

    The forms whose attention needs no ``L × S`` matrix (linear, FAVOR+, hierarchical): the
    result keeps key j for row p iff ``(not causal or j <= p) and key_mask[b, j]``, with
    ``key_mask[b, j] = j < lengths[b]`` for every padding and ``keep[b, 0, 0, j]`` for every
    key mask (left padding and holes too). Tensor ops only, no host sync.

    Args:
        mask: None, ``masks.causal()``, ``masks.padding(lengths)``, ``masks.from_tensor(keep)``
            with ``keep`` bool ``(B|1, 1, 1, S)``, or an ``&`` of them.
        where: the calling function, named in errors. batch: B of the call. S: key length.
        device: where the key mask is built.

    Returns:
        ``(causal, key_mask)``: key_mask bool ``(B|1, S)`` (True = a real key) or None.

    Raises:
        ValueError: any other mask (naming what is supported and what was received), or
            padding lengths for another batch size.
    """
    if mask is None:
        return False, None
    parts = mask.conjuncts() if isinstance(mask, Mask) else ()
    if not parts or not all(
        isinstance(m, (CausalMask, PaddingMask)) or _key_only(m) for m in parts
    ):
        got = repr(mask) if isinstance(mask, Mask) else _describe(mask)
        raise ValueError(f"{where}: mask must be {KERNEL_MASKS}, got {got}")
    causal = any(isinstance(m, CausalMask) for m in parts)
    key_mask = None
    for m in parts:
        if isinstance(m, CausalMask):
            continue
        rows = m.lengths.numel() if isinstance(m, PaddingMask) else m.t.shape[0]
        if rows not in (1, batch):
            what = "lengths" if isinstance(m, PaddingMask) else "batch rows"
            raise ValueError(f"{where}: mask {m!r} has {rows} {what}, expected 1 or batch={batch}")
        if isinstance(m, PaddingMask):
            keep = torch.arange(S, device=device) < m.lengths.to(device).view(-1, 1)
        else:
            m.check_size(1, S)  # the key dim is S or broadcasts to it
            keep = m.t[:, 0, 0, :].to(device).expand(rows, S)
        key_mask = keep if key_mask is None else key_mask & keep  # (B|1, S)
    return causal, key_mask


def with_causal(
    mask: Mask | None, causal: object, *, where: str, stacklevel: int = 3
) -> Mask | None:
    """``mask`` with the former ``causal=`` flag folded in, warning that it is deprecated.

    Args:
        mask: the call's ``mask=``. causal: the call's ``causal=`` (None: not given).
        where: the calling function, named in the warning.
        stacklevel: the warning's frame: 3 is the caller of ``where`` when ``where`` calls this.

    Returns:
        ``causal() & mask`` for ``causal=True``, else ``mask``.

    Raises:
        TypeError: ``causal`` is not a bool.
    """
    if causal is None:
        return mask
    check_bool("causal", causal)
    warnings.warn(
        f"{where}(causal=...) is deprecated: pass mask=masks.causal() (combined with other "
        "masks by &)",
        DeprecationWarning,
        stacklevel=stacklevel,
    )
    if not causal:
        return mask
    return CausalMask() if mask is None else CausalMask() & mask


def causal() -> Mask:
    """Bottom-right causal mask: position ``p = i + S − L`` sees keys ``j <= p``.

    For L=2, S=4 the last query sees every key::

        ■ ■ ■ ⬚
        ■ ■ ■ ■
    """
    return CausalMask()


def sliding_window(window: int, causal: bool = True) -> Mask:
    """Sliding window of ``window`` keys.

    Causal keeps ``0 <= p − j < window`` (exactly ``window`` keys including itself); non-causal
    keeps ``|p − j| < window``. ``window >= S`` with ``causal=True`` equals `causal`.
    For window=2, causal, L=S=4::

        ■ ⬚ ⬚ ⬚
        ■ ■ ⬚ ⬚
        ⬚ ■ ■ ⬚
        ⬚ ⬚ ■ ■
    """
    return SlidingWindowMask(window, causal)


def window(left: int, right: int) -> Mask:
    """flash-attn's local window ``window_size=(left, right)`` (−1 = unbounded on that side).

    Query ``p`` (bottom-right aligned, ``p = i + S − L``) keeps keys ``p − left <= j <= p +
    right``: ``window(-1, 0)`` is `causal`, ``window(w − 1, 0)`` is ``sliding_window(w)``,
    ``window(-1, -1)`` keeps every key. For left=1, right=0, L=S=4::

        ■ ⬚ ⬚ ⬚
        ■ ■ ⬚ ⬚
        ⬚ ■ ■ ⬚
        ⬚ ⬚ ■ ■

    Args:
        left: keys before the query's position it may attend (>= 0), or −1 for all of them.
        right: keys after the query's position it may attend (>= 0), or −1 for all of them.

    Raises:
        ValueError: ``left`` or ``right`` below −1. TypeError: not an int.
    """
    return WindowMask(left, right)


def padding(lengths: Sequence[int] | Tensor) -> Mask:
    """Key-padding mask: keys at positions ``>= lengths[b]`` are masked for batch item ``b``."""
    return PaddingMask(lengths)


def strided(stride: int, causal: bool = True) -> Mask:
    """Sparse-Transformer strided pattern (Child et al., 2019).

    Keeps ``|p − j| < stride`` (the local block) or ``(p − j) mod stride == 0`` (the stride),
    restricted to ``j <= p`` when causal.
    """
    return StridedMask(stride, causal)


def global_local(window: int, global_tokens: int | Sequence[int] | Tensor) -> Mask:
    """Longformer global + local attention.

    Keeps ``|p − j| < window`` plus every pair where the query or the key is global.
    ``global_tokens`` is a count (the first n positions) or a list of key positions.
    """
    return GlobalLocalMask(window, global_tokens)


def bigbird(
    block_size: int, window_blocks: int, global_blocks: int, random_blocks: int, seed: int = 0
) -> Mask:
    """BigBird block-sparse attention: window, global and random blocks (see `BigBirdMask`)."""
    return BigBirdMask(block_size, window_blocks, global_blocks, random_blocks, seed)


def document(ids: Sequence[int] | Tensor) -> Mask:
    """Packed-sequence (document) mask from per-position ids ``(S,)`` or ``(B, S)``.

    Also ``document.from_lengths([3, 5])`` and ``document.from_cu_seqlens([0, 3, 8])``.
    """
    return DocumentMask(ids)


document.from_lengths = DocumentMask.from_lengths  # type: ignore[attr-defined]
document.from_cu_seqlens = DocumentMask.from_cu_seqlens  # type: ignore[attr-defined]


_STRUCTURAL = {
    "window": lambda a: SlidingWindowMask(int(a[0]), bool(int(a[1]))),
    "wnd": lambda a: WindowMask(int(a[0]), int(a[1])),
    "strided": lambda a: StridedMask(int(a[0]), bool(int(a[1]))),
    "bigbird": lambda a: BigBirdMask(*(int(x) for x in a)),
}


def from_spec(spec: str, tensors: list[Tensor]) -> Mask:
    """Rebuilds the mask described by `Mask.spec` (its structure string and its tensors)."""
    pos, k = 0, 0

    def parse() -> Mask:
        nonlocal pos, k
        if spec.startswith("~", pos):
            pos += 1
            return ~parse()
        if spec.startswith("(", pos):
            pos += 1
            a = parse()
            op = spec[pos]
            pos += 1
            b = parse()
            pos += 1  # ")"
            return a & b if op == "&" else a | b
        end = pos
        while end < len(spec) and spec[end] not in "&|)":
            end += 1
        name, *args = spec[pos:end].split(":")
        pos = end
        if name == "causal":
            return CausalMask()
        if name in _STRUCTURAL:  # masks that hold no tensor
            return _STRUCTURAL[name](args)
        if name == "padding" and args:
            return PaddingMask([int(n) for n in args[0].split(",")])
        k += 1
        t = tensors[k - 1]
        if name == "padding":
            return PaddingMask(t)
        if name == "intervals":
            k += 1
            return IntervalMask(t, tensors[k - 1], int(args[0]))
        if name == "global_local":
            return GlobalLocalMask(int(args[0]), t)
        if name == "document":
            m = DocumentMask(t)
            m.runs_distinct = bool(int(args[0]))
            return m
        if name == "tensor":
            return TensorMask(t)
        if name == "block_table":
            return BlockTableMask(t, *(int(a) for a in args))
        raise ValueError(f"from_spec: unknown mask {name!r} in {spec!r}")

    return parse()
