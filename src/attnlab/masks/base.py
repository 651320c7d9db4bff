"""The `Mask` object: a small index function rendered to dense masks, counts and block maps.

A mask says which (query, key) pairs may attend (True = may attend). Every mask is defined by one
index function evaluated on broadcastable index tensors, in the spirit of FlexAttention's
``mask_mod``; everything else (dense tensors, pair counts, the ■/⬚ picture, tile maps for the tiled
backend) is derived from it, chunk by chunk, so no L×S tensor is needed unless one is asked for.

Alignment is bottom-right: when L != S, query row i sits at key position ``i + S - L`` (the last
query sees the last key), which is what KV-cache decoding needs. For causal with L=2, S=4::

    ■ ■ ■ ⬚
    ■ ■ ■ ■
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable

import torch
from torch import Tensor

from .._shapes import align, check_index_fn_output, check_int, index_grid, query_positions
from .blocks import (
    EMPTY,
    FULL,
    PARTIAL,
    band_codes,
    combine_codes,
    dense_codes,
    diagonal_codes,
    interval_codes,
    refine,
    tensor_codes,
)
from .counts import (
    COUNT_BUDGET,
    HUGE,
    Geometry,
    Piece,
    budget_error,
    combine_geometry,
    geometry_counts,
)

ATTEND = "■"
IGNORE = "⬚"

# `str(mask)` draws every cell up to this many rows and columns, a summary above it.
RENDER_LIMIT = 64
# Rows and columns shown at each end of a summarised picture.
EDGE_ITEMS = 3

# Elements evaluated per chunk when a mask is reduced without materialising L×S.
_CHUNK_ELEMENTS = 1 << 22


def _merge_dim(name: str, a: int | None, b: int | None) -> int | None:
    if a is None or a == 1:
        return b if b is not None else a
    if b is None or b == 1 or a == b:
        return a
    raise ValueError(f"cannot combine masks: one has {name}={a}, the other {name}={b}")


def diagonal_keep(pieces: list[Piece], d: Tensor) -> Tensor:
    """Whether each offset ``d = j − p`` lies in one of the progressions ``pieces`` (bool).

    ``keep(d) = ∨_(lo, hi, step, anchor) (lo <= d <= hi) ∧ (d ≡ anchor mod step)``: the index
    function of every mask given by its `Mask.diagonals`. Bounds and steps are capped to
    ``±HUGE``, so a huge window or stride neither overflows int64 nor changes the pattern.
    """
    keep = None
    for lo, hi, step, anchor in pieces:
        part = None
        if lo is not None:
            part = d >= max(-HUGE, min(lo, HUGE))
        if hi is not None:
            upper = d <= max(-HUGE, min(hi, HUGE))
            part = upper if part is None else part & upper
        if step != 1:
            s = min(step, HUGE)
            on = (d - anchor % s).remainder(s) == 0
            part = on if part is None else part & on
        if part is None:
            part = torch.ones_like(d, dtype=torch.bool)
        keep = part if keep is None else keep | part
    return torch.zeros_like(d, dtype=torch.bool) if keep is None else keep


# ---------------------------------------------------------------- content digests
# A tensor's identity, version counter and data pointer do not say its values are unchanged:
# memory written outside torch (a NumPy view, a data-loader buffer refilled in place, shared
# memory, DLPack) keeps all three. A cache whose entries depend on values keys them on
# `tensor_digest` instead, computed on every lookup: BLAKE2b over the dtype, the shape and the
# bytes in row-major order, so a permutation of the same values is a different digest.
DIGEST_SIZE = 16


def tensor_digest(tensors: Tensor | Iterable[Tensor]) -> bytes:
    """The BLAKE2b digest of one tensor's, or a sequence of tensors', dtype, shape and values.

    Reads the values on the host (a copy to the CPU for tensors elsewhere; a host sync there):
    call it where the values are read anyway. Costs about 1 ms per 1.5 MB on one core.

    Args:
        tensors: a tensor, or tensors digested in order.

    Returns:
        ``DIGEST_SIZE`` bytes; equal for equal dtypes, shapes and values, whatever the strides.
    """
    h = hashlib.blake2b(digest_size=DIGEST_SIZE)
    for t in (tensors,) if isinstance(tensors, Tensor) else tensors:
        t = t.detach().resolve_conj().resolve_neg()
        h.update(f"{t.dtype}{tuple(t.shape)};".encode())
        if t.numel():
            flat = t.cpu().contiguous().reshape(-1).view(torch.uint8)
            h.update(flat.numpy())
    return h.digest()


class Mask:
    """Base class of all masks, and the protocol a new structured mask implements.

    True = the query may attend to the key. A mask is an index function on *aligned* positions
    (``p = i + S − L``, bottom-right) plus, optionally, a closed form of its geometry; everything
    else (dense tensors, pair counts, the tiled backend's block maps, FlexAttention's
    ``mask_mod``) is derived from those. Masks combine with ``&``, ``|`` and ``~``.

    A subclass implements one of (each closed form stated once; the rest derives from it):

    - `diagonals`: the mask as progressions of ``d = j − p`` (bands, dilated and strided
      patterns). `mod`, `band`, `key_interval`, `geometry` and `block_codes` then derive from it.
    - `mod`: the index function itself; add `band`, `key_interval`, `natural_block`,
      `geometry` or `block_codes` when a closed form exists (each is optional: without one the
      mask is evaluated, chunk by chunk).

    `evaluate` (raw query rows) is what the library calls; override it only when the mask needs
    the raw rows (a tensor indexed by row).

    Example:
        >>> class Dilated(Mask):  # every r-th key among the last w (a causal dilated window)
        ...     def __init__(self, w, r): self.w, self.r = w, r
        ...     def diagonals(self): return [(-(self.w - 1), 0, self.r, 0)]
        >>> Dilated(4, 2).to_dense(4, 4)[0, 0].int().tolist()
        [[1, 0, 0, 0], [0, 1, 0, 0], [1, 0, 1, 0], [0, 1, 0, 1]]

    Attributes:
        batch_size: size of the batch dimension the mask depends on, or None if it does not.
        num_heads: size of the head dimension the mask depends on, or None if it does not.
    """

    batch_size: int | None = None
    num_heads: int | None = None

    # ----------------------------------------------------------------- definition
    def mod(self, b: Tensor, h: Tensor, p: Tensor, j: Tensor, S: int) -> Tensor:  # noqa: ARG002 (the Mask protocol's signature)
        """The index function on aligned positions: True where query ``p`` may attend key ``j``.

        The default evaluates `diagonals`: ``∨_pieces (lo <= j − p <= hi) ∧ (j − p ≡ anchor
        (mod step))``.

        Args:
            b, h: batch and head indices (int64, broadcastable).
            p: aligned query positions ``r + S − L`` (key coordinates; negative for the first
                ``L − S`` rows when L > S).
            j: key positions in [0, S).
            S: key length.

        Returns:
            Bool tensor broadcastable against the broadcast of the index tensors.
        """
        pieces = self._pieces()
        if pieces is None:
            raise NotImplementedError(f"{type(self).__name__} implements neither mod nor diagonals")
        return diagonal_keep(pieces, j - p)

    def evaluate(self, b: Tensor, h: Tensor, i: Tensor, j: Tensor, L: int, S: int) -> Tensor:
        """The mask on raw query rows ``i`` in [0, L) and keys ``j`` in [0, S).

        The one place where rows meet the alignment: `mod` receives ``p = i + S − L``.
        """
        return self.mod(b, h, align(i, L, S), j, S)

    def mask_mod(self, L: int, S: int) -> Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]:
        """The mask as FlexAttention's ``mask_mod(b, h, q_idx, kv_idx) -> bool`` for an L × S call.

        Pass it to ``torch.nn.attention.flex_attention.create_block_mask(mod, B, H, L, S)`` to
        run the same mask on FlexAttention (bottom-right alignment included). Tables a mask draws
        lazily (BigBird's random blocks) are drawn here, outside Flex's vmap.

        Example:
            >>> from torch.nn.attention.flex_attention import create_block_mask
            >>> m = masks.causal() & masks.document.from_lengths([300, 212])
            >>> block = create_block_mask(m.mask_mod(512, 512), None, None, 512, 512)
        """
        _check_lengths(L, S)
        zero = torch.zeros((), dtype=torch.long)
        try:  # Flex calls it on 0-d indices; this also builds lazily drawn tables now
            probe = self.evaluate(zero, zero, zero, zero, L, S)
        except ValueError as e:
            probe, why = None, str(e)
        if probe is None or probe.dim() != 0:
            shape = "an error" if probe is None else f"shape {tuple(probe.shape)}"
            raise ValueError(
                f"mask_mod: {self!r} cannot run on FlexAttention's 0-d indices: it gives "
                f"{shape} there, expected a 0-d bool tensor"
                + ("" if probe is not None else f" ({why})")
            )

        def mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return self.evaluate(b, h, q_idx, kv_idx, L, S)

        return mod

    @staticmethod
    def positions(L: int, S: int, *, device: torch.device | str | None = None) -> Tensor:
        """Aligned key position of every query row, ``p = r + S − L``: int64 ``(L,)``."""
        return query_positions(L, S, device=device)

    # ----------------------------------------------------------------- geometry
    def diagonals(self) -> list[Piece] | None:
        """The mask as disjoint progressions of ``d = j − p``, if it depends on ``d`` alone.

        Each piece ``(lo, hi, step, anchor)`` keeps ``lo <= d <= hi`` (None: unbounded) with
        ``d ≡ anchor (mod step)``: ``causal()`` is ``[(None, 0, 1, 0)]``, a causal window of w keys
        ``[(1 − w, 0, 1, 0)]``. A mask that states its diagonals gets `mod`, `band`,
        `key_interval`, `geometry` (exact counts at any size) and its block map from them.
        Other masks return None.
        """
        return None

    def band(self) -> tuple[float, float] | None:
        """``(lo, hi)`` with ``mask = {lo <= j − p <= hi}`` (±inf: no bound), if the mask is one.

        Derived from `diagonals` (one piece of step 1). Causal masks, sliding windows and their
        intersections are bands; the tiled backend batches narrow bands into shared-tile calls.
        Other masks return None.
        """
        pieces = self.diagonals()
        if pieces is None or len(pieces) != 1 or pieces[0][2] != 1:
            return None
        lo, hi = pieces[0][0], pieces[0][1]
        return (-math.inf if lo is None else float(lo), math.inf if hi is None else float(hi))

    def diagonal_map(self, L: int, S: int, device: torch.device | str | None) -> Tensor | None:
        """For a mask of ``d = j − p`` alone: bool ``(L + S − 1,)`` over ``d = −(S − 1) … L − 1``.

        Evaluated from `diagonals` (or `band`); combinations of such masks combine theirs.
        """
        pieces = self._pieces()
        if pieces is None:
            return None
        return diagonal_keep(pieces, torch.arange(-(S - 1), L, device=device))

    def _pieces(self) -> list[Piece] | None:
        """`diagonals`, or the one piece of `band` (a mask that states only its band)."""
        pieces = self.diagonals()
        if pieces is not None:
            return pieces
        band = self.band()
        if band is None:
            return None
        lo, hi = (None if math.isinf(x) else int(x) for x in band)
        return [(lo, hi, 1, 0)]

    def natural_block(self) -> int | None:
        """The block size the mask is made of (BigBird's blocks), or None.

        A mask constant on ``block × block`` cells of aligned positions says so here; the tiled
        backend then uses that tile size, so that every tile is either fully attended or empty
        (no mask evaluated inside a tile).
        """
        return None

    def key_interval(
        self, L: int, S: int, *, device: torch.device | str | None = None
    ) -> tuple[Tensor | None, Tensor] | None:
        """Each query row's keys as one half-open interval ``[lo, hi)``, if the mask is one.

        Masks whose rows attend a contiguous run of keys (causal, sliding windows, padding,
        documents and their intersections) return ``(lo, hi)``, int64 tensors broadcastable to
        ``(B, H, L)`` with ``0 <= lo`` and ``hi <= S`` (a row with ``hi <= lo`` attends nothing);
        ``lo`` is None when it is 0 for every row. Computed from the mask's structure in O(L)
        tensor ops, no host reads, so the NaN rule and other per-row reductions over the attended
        keys run as prefix sums instead of an L×S product. The default derives it from `band`:
        ``[p + lo, p + hi + 1) ∩ [0, S)``. Other masks return None.
        """
        band = self.band()
        if band is None:
            return None
        p = self.positions(L, S, device=device)
        reach = L + S  # |j − p| < L + S on the grid: wider bounds attend the same keys
        lo = None if band[0] == -math.inf else int(max(band[0], -reach))
        hi = int(min(band[1], reach))
        first = None if lo is None else (p + lo).clamp(0, S).view(1, 1, L)
        return first, (p + hi + 1).clamp(0, S).view(1, 1, L)

    def key_mask(
        self, L: int, S: int, *, device: torch.device | str | None = None
    ) -> Tensor | None:
        """The keys of an L × S call, when every query row and head attends the same ones.

        ``keep[b, j]`` says whether every row of batch item ``b`` may attend key ``j``: bool
        ``(B|1, S)``; None when rows or heads differ (or the mask cannot say). One query row
        (decoding) always has one when the mask has `key_interval`; a mask over keys alone
        (padding, a ``(B, 1, 1, S)`` tensor) has one at any L. A backend then reads only the
        attended keys. The default: for L == 1, the keys of `band` at the row's position
        ``p = S − 1`` (from Python ints), else ``lo <= j < hi`` of `key_interval`. O(B·S) tensor
        ops, no host reads.
        """
        if L != 1:
            return None
        band = self.band()
        if band is not None:
            p = S - 1
            first = 0 if math.isinf(band[0]) else min(S, max(0, p + int(band[0])))
            end = S if math.isinf(band[1]) else min(S, max(0, p + int(band[1]) + 1))
            keep = torch.zeros(1, S, dtype=torch.bool, device=device)
            keep[:, first:end] = True
            return keep
        interval = self.key_interval(L, S, device=device)
        if interval is None:
            return None
        lo, hi = interval  # broadcastable to (B|1, 1, 1)
        j = torch.arange(S, device=device)
        keep = j < hi.reshape(-1, 1)
        return keep if lo is None else keep & (j >= lo.reshape(-1, 1))

    def query_mask(
        self, L: int, S: int, *, device: torch.device | str | None = None
    ) -> Tensor | None:
        """The query rows that may attend at all, for a mask over query rows alone
        (`over_queries`): ``rows[b, i]`` bool ``(B|1, L)`` — row i of item b attends every key
        or none. None for other masks. O(B·L) tensor ops, no host reads."""
        del L, S, device  # (the Mask protocol's signature)
        return None

    def geometry(self, L: int, S: int) -> Geometry | None:  # noqa: ARG002 (the Mask protocol's signature)
        """The mask's structure for an exact pair count (`counts.Geometry`), or None.

        The one counting hook: diagonals, a per-batch key limit, per-batch runs of keys, or the
        exact per-``(b, h)`` counts a mask reads from the data it holds (``pairs``). The
        default is `diagonals` (or `band`). `attended_pairs` counts any ``&`` of geometries in
        closed form; without one it evaluates the mask (bounded by `counts.COUNT_BUDGET`).
        """
        pieces = self._pieces()
        return None if pieces is None else Geometry(diagonals=list(pieces))

    def spec(self) -> tuple[str, list[Tensor]] | None:
        """The mask as a string of its structure plus the tensors it holds, or None.

        `attnlab.masks.from_spec` rebuilds an equal mask from the pair; compiled code passes
        masks this way into custom operators (the string is a constant of the graph, the tensors
        are inputs). Masks given by an arbitrary function (`from_fn`) return None.
        Integer settings go through `static_int`, so the string is a constant under
        ``torch.compile(dynamic=True)`` too.
        """
        return None

    def cache_key(self) -> tuple | None:
        """A key for the mask's structure and contents, or None (not cacheable: no `spec`).

        The structure string of `spec` plus, for each tensor the mask holds, its shape, dtype,
        device and `tensor_digest` of its values, read now: what depends on the values
        (document ids, padding lengths, a boolean mask — the flash backend's plan cache) stays
        correct when memory changes without torch's version counter noticing (a NumPy view, a
        buffer refilled in place, shared memory, DLPack). Equal contents in another tensor give
        an equal key.
        """
        spec = self.spec()
        if spec is None:
            return None
        parts: list[object] = [spec[0]]
        for t in spec[1]:
            parts.append((tuple(t.shape), t.dtype, str(t.device), tensor_digest(t)))
        return tuple(parts)

    def conjuncts(self) -> tuple[Mask, ...]:
        """The masks whose ``&`` this mask is, flattened (a mask that is no ``&``: itself)."""
        return (self,)

    def data_tensors(self) -> list[tuple[str, Tensor]]:
        """``(description, tensor)`` of the data tensors the mask holds (from_tensor masks).

        `attnlab.attention` checks they live on the query's device. Small index tensors
        (padding lengths, document ids, global positions) are not data: they move with the call.
        """
        return []

    # ----------------------------------------------------------------- rendering
    def batch_heads(self, batch: int | None, heads: int | None) -> tuple[int, int]:
        """The ``(B|1, H|1)`` sizes the mask is evaluated on, checked against a call's B and H.

        Raises:
            ValueError: the mask depends on a batch (heads) of another size than ``batch``
                (``heads``).
        """
        nb = self.batch_size if self.batch_size is not None else 1
        nh = self.num_heads if self.num_heads is not None else 1
        if batch is not None and self.batch_size not in (None, 1) and batch != self.batch_size:
            raise ValueError(
                f"mask: expected a batch of {self.batch_size} (the mask's batch size), "
                f"got batch={batch}"
            )
        if heads is not None and self.num_heads not in (None, 1) and heads != self.num_heads:
            raise ValueError(
                f"mask: expected {self.num_heads} heads (the mask's head count), got heads={heads}"
            )
        return nb, nh

    def eval_rows(
        self, rows: Tensor, L: int, S: int, nb: int, nh: int, device: torch.device | None
    ) -> Tensor:
        b, h, i, j = index_grid(nb, nh, L, S, rows=rows, aligned=False, device=device)
        out = self.evaluate(b, h, i, j, L, S)
        # Custom subclasses too: a wrong shape is named here, not in torch's expand message.
        out = check_index_fn_output("mask function", self, out, (b, h, i, j), want_bool=True)
        out = out.reshape((1,) * (4 - out.dim()) + tuple(out.shape))
        return out.expand(out.shape[0], out.shape[1], rows.numel(), S)  # (B|1, H|1, rows, S)

    def to_dense(
        self,
        L: int,
        S: int,
        *,
        batch: int | None = None,
        heads: int | None = None,
        device: torch.device | str | None = None,
    ) -> Tensor:
        """Renders the mask as a bool tensor of shape ``(B|1, H|1, L, S)``.

        Args:
            L: query length. S: key length.
            batch, heads: the B and H of the attention call, used to check and evaluate masks
                that depend on the batch or head index.
            device: where to build the tensor.

        Returns:
            Bool tensor broadcastable to ``(B, H, L, S)``; True = may attend.
        """
        _check_lengths(L, S)
        nb, nh = self.batch_heads(batch, heads)
        rows = torch.arange(L, device=device)
        return self.eval_rows(rows, L, S, nb, nh, device)

    def _row_chunks(self, L: int, S: int):
        step = max(1, _CHUNK_ELEMENTS // max(S, 1))
        # L = 0 still evaluates one empty chunk, so the (B|1, H|1) dims match `to_dense`.
        for start in range(0, max(L, 1), step):
            yield start, min(L, start + step)

    def row_counts(
        self,
        L: int,
        S: int,
        *,
        batch: int | None = None,
        heads: int | None = None,
        device: torch.device | str | None = None,
    ) -> Tensor:
        """Number of keys each query attends to, shape ``(B|1, H|1, L)`` (int64).

        ``hi − lo`` of `key_interval` when the mask has one (O(L)); otherwise evaluated in row
        chunks, so memory stays O(chunk · S) whatever L is.
        """
        _check_lengths(L, S)
        nb, nh = self.batch_heads(batch, heads)
        interval = self.key_interval(L, S, device=device)
        if interval is not None:
            lo, hi = interval
            width = (hi if lo is None else hi - lo).clamp(min=0)
            return width.expand(*width.shape[:-1], L)  # (B|1, H|1, L)
        parts = []
        for lo, hi in self._row_chunks(L, S):
            rows = torch.arange(lo, hi, device=device)
            parts.append(self.eval_rows(rows, L, S, nb, nh, device).sum(-1))
        nbo = max(p.shape[0] for p in parts)
        nho = max(p.shape[1] for p in parts)
        return torch.cat([p.expand(nbo, nho, -1) for p in parts], dim=-1)

    def attended_pairs(
        self, L: int, S: int, *, batch: int | None = None, heads: int | None = None
    ) -> int:
        """Exact number of attended (query, key) pairs over the whole ``(B, H)`` grid.

        ``batch``/``heads`` default to the sizes the mask depends on (1 if it does not), so for a
        batch-independent mask ``attended_pairs(L, S)`` counts one ``L × S`` slice. Causal,
        sliding-window, strided, padding and document-from-lengths masks and their ``&``
        combinations are counted in closed form on Python ints (exact for any size, no tensor);
        Longformer, BigBird, raw document ids and tensor masks from the data they hold; ``a | b``
        as ``a + b − (a & b)`` and ``~a`` as ``L·S − a`` when those are closed (prefix-LM is
        ``causal() | padding([n])``); other masks by diagonals, key intervals or rows, up to
        `counts.COUNT_BUDGET` elements.

        Raises:
            ValueError: a mask without a closed form whose count would exceed the budget.
        """
        _check_lengths(L, S)
        self.batch_heads(batch, heads)
        counts = self._pair_counts(L, S)  # (B|1) × (H|1) Python ints
        nb = batch if batch is not None else (self.batch_size or 1)
        nh = heads if heads is not None else (self.num_heads or 1)
        total = sum(sum(row) * (nh if len(row) == 1 else 1) for row in counts)
        return total * (nb if len(counts) == 1 else 1)

    def closed_counts(self, L: int, S: int) -> list[list[int]] | None:
        """`_pair_counts` from `geometry` alone (no L×S work), or None."""
        geometry = self.geometry(L, S)
        return None if geometry is None else geometry_counts(geometry, L, S)

    def _pair_counts(self, L: int, S: int) -> list[list[int]]:
        """Attended pairs per ``(batch item, head)`` of the sizes the mask depends on (or 1).

        The one counting implementation: the closed form when the mask has a geometry, else
        the cheapest bounded evaluation (diagonals, key intervals, rows).
        """
        exact = self.closed_counts(L, S)
        if exact is not None:
            return exact
        nb, nh = self.batch_heads(None, None)
        if L == 0 or S == 0:
            return [[0]]
        if L + S <= COUNT_BUDGET:
            keep = self.diagonal_map(L, S, None)  # over d = j − p = −(S − 1) … L − 1
            if keep is not None:
                d = torch.arange(-(S - 1), L)
                rows = (torch.clamp(L - d, max=L) - torch.clamp(L - S - d, min=0)).clamp(min=0)
                return [[int(rows[keep].sum())]]
        if nb * L <= COUNT_BUDGET:
            interval = self.key_interval(L, S)
            if interval is not None:
                lo, hi = interval
                width = (hi if lo is None else hi - lo).clamp(min=0).sum(-1)  # (B|1, H|1)
                return width.tolist()
        cost = nb * nh * L * S
        if cost > COUNT_BUDGET:
            raise budget_error(self, L, S, cost)
        return self.row_counts(L, S).sum(-1).tolist()

    def density(
        self, L: int, S: int, *, batch: int | None = None, heads: int | None = None
    ) -> float:
        """Fraction of the ``B·H·L·S`` pairs that are attended."""
        nb = batch if batch is not None else (self.batch_size or 1)
        nh = heads if heads is not None else (self.num_heads or 1)
        total = nb * nh * L * S
        return self.attended_pairs(L, S, batch=batch, heads=heads) / total if total else 0.0

    def block_map(
        self,
        L: int,
        S: int,
        block_q: int,
        block_k: int,
        *,
        batch: int | None = None,
        heads: int | None = None,
        device: torch.device | str | None = None,
    ) -> Tensor:
        """Classifies each ``block_q × block_k`` tile as EMPTY (0), PARTIAL (1) or FULL (2).

        Structured kinds compute it in closed form from their geometry (O(tiles) work, no L×S
        tensor); the others from their rendering, chunk by chunk. Both give the same codes.

        Returns:
            int8 tensor of shape ``(B|1, H|1, ceil(L/block_q), ceil(S/block_k))``. Tiles at the
            ragged end cover only the positions that exist.
        """
        _check_lengths(L, S)
        check_int("block_q", block_q, minimum=1)
        check_int("block_k", block_k, minimum=1)
        nb, nh = self.batch_heads(batch, heads)
        if L == 0 or S == 0:
            return self._dense_block_map(L, S, block_q, block_k, nb, nh, device)
        return self.block_codes(L, S, block_q, block_k, nb, nh, device)

    def block_codes(
        self, L: int, S: int, bq: int, bk: int, nb: int, nh: int, device: torch.device | str | None
    ) -> Tensor:
        """`block_map` for L, S >= 1 and checked arguments: what a closed form overrides.

        The default derives the codes from `band`, `diagonals` or `key_interval`
        (`masks.blocks`), else from the rendering. An override returns int8 codes
        ``(nb|1, nh|1, ceil(L/bq), ceil(S/bk))``; `masks.blocks.refine` evaluates exactly the
        tiles a rule leaves undecided.

        Args:
            L, S: query and key lengths. bq, bk: tile sizes.
            nb, nh: the ``(B|1, H|1)`` sizes to evaluate on (`batch_heads`). device: where.
        """
        codes = self._geometric_block_map(L, S, bq, bk, device)
        return self._dense_block_map(L, S, bq, bk, nb, nh, device) if codes is None else codes

    def _geometric_block_map(
        self, L: int, S: int, bq: int, bk: int, device: torch.device | str | None
    ) -> Tensor | None:
        """The block map from `band`, `diagonal_map` or `key_interval` if one applies, else None."""
        band = self.band()
        if band is not None:
            return band_codes(L, S, bq, bk, band[0], band[1], device)
        keep = self.diagonal_map(L, S, device)
        if keep is not None:
            return diagonal_codes(L, S, bq, bk, keep, device)
        interval = self.key_interval(L, S, device=device)
        if interval is not None:
            return interval_codes(interval[0], interval[1], L, S, bq, bk)
        return None

    def _dense_block_map(
        self, L: int, S: int, bq: int, bk: int, nb: int, nh: int, device: torch.device | str | None
    ) -> Tensor:
        """The block map from the rendering, evaluated in row chunks of whole query tiles."""
        return dense_codes(self, L, S, bq, bk, nb, nh, device, _CHUNK_ELEMENTS)

    def render(self, L: int, S: int, *, b: int = 0, h: int = 0) -> str:
        """Draws the mask for batch item ``b`` and head ``h`` as a ■ (attend) / ⬚ (masked) grid."""
        dense = self.to_dense(L, S)
        bi = b if dense.shape[0] > 1 else 0
        hi = h if dense.shape[1] > 1 else 0
        grid = dense[bi, hi]
        return "\n".join(" ".join(ATTEND if x else IGNORE for x in row.tolist()) for row in grid)

    def default_size(self) -> tuple[int, int]:
        return 8, 8

    # True when the mask only renders at its own `default_size` (it holds a tensor of fixed size).
    pins_size = False
    # True when the mask depends on the batch item and the key alone (padding, a (B, 1, 1, S)
    # tensor, their &, | and ~): `key_mask` then gives it at any L. Structure, never values.
    over_keys = False
    # True when the mask depends on the batch item and the query row alone (query padding, a
    # (B, 1, L, 1) tensor, their &, | and ~): `query_mask` gives it. Structure, never values.
    over_queries = False

    def __str__(self) -> str:
        """The ■/⬚ picture at the mask's default size; summarised above `RENDER_LIMIT` a side.

        A large mask (a 3000-token document mask) prints like torch prints a large tensor: a
        header with the shape and the attended count of batch item 0, head 0, then the first and
        last `EDGE_ITEMS` rows and columns with ``...`` between them (a few KB, whatever the size).
        """
        L, S = self.default_size()
        if L <= RENDER_LIMIT and S <= RENDER_LIMIT:
            return f"{self!r}  (L={L}, S={S})\n{self.render(L, S)}"
        return self._render_summary(L, S)

    def _render_summary(self, L: int, S: int) -> str:
        def edges(n: int) -> list[int]:
            return (
                list(range(n))
                if n <= 2 * EDGE_ITEMS
                else [*range(EDGE_ITEMS), *range(n - EDGE_ITEMS, n)]
            )

        rows, cols = edges(L), edges(S)
        idx = index_grid(
            1, 1, L, S, rows=torch.tensor(rows), keys=torch.tensor(cols), aligned=False
        )
        out = check_index_fn_output(
            "mask function", self, self.evaluate(*idx, L, S), idx, want_bool=True
        )
        grid = out.reshape((1,) * (4 - out.dim()) + tuple(out.shape))[0, 0]
        grid = grid.expand(len(rows), len(cols)).tolist()
        try:
            count = self._pair_counts(L, S)[0][0]
            attended = f"{count:,} of {L * S:,} pairs attended"
        except ValueError:  # no closed form and above the counting budget
            attended = f"{L * S:,} pairs (attended count above the counting budget)"
        lines = [f"{self!r}  (L={L}, S={S}; {attended} in batch item 0, head 0; summarised)"]
        for n, (r, flags) in enumerate(zip(rows, grid, strict=True)):
            if n and r != rows[n - 1] + 1:
                lines.append("...")
            cells = []
            for m, (c, x) in enumerate(zip(cols, flags, strict=True)):
                if m and c != cols[m - 1] + 1:
                    cells.append("...")
                cells.append(ATTEND if x else IGNORE)
            lines.append(" ".join(cells))
        return "\n".join(lines)

    # ----------------------------------------------------------------- algebra
    def __and__(self, other: Mask) -> Mask:
        return _Combined("&", self, _as_mask(other, "&"))

    def __rand__(self, other: Mask) -> Mask:
        return _Combined("&", _as_mask(other, "&"), self)

    def __or__(self, other: Mask) -> Mask:
        return _Combined("|", self, _as_mask(other, "|"))

    def __ror__(self, other: Mask) -> Mask:
        return _Combined("|", _as_mask(other, "|"), self)

    def __invert__(self) -> Mask:
        return _Not(self)


def _check_lengths(L: int, S: int) -> None:
    # a torch.SymInt is a symbolic length (dynamic shapes, torch.export with a Dim)
    ints = (int, torch.SymInt)
    if not (isinstance(L, ints) and isinstance(S, ints)) or L < 0 or S < 0:
        raise ValueError(f"mask lengths must be non-negative ints, got L={L!r}, S={S!r}")


def _add_counts(x: list[list[int]], y: list[list[int]], sign: int) -> list[list[int]]:
    """``x + sign·y`` on per-(batch, head) counts, a size-1 dimension broadcasting."""
    rows = max(len(x), len(y))
    out = []
    for r in range(rows):
        xr, yr = x[r if len(x) > 1 else 0], y[r if len(y) > 1 else 0]
        cols = max(len(xr), len(yr))
        out.append(
            [xr[c if len(xr) > 1 else 0] + sign * yr[c if len(yr) > 1 else 0] for c in range(cols)]
        )
    return out


def _describe(x: object) -> str:
    if isinstance(x, Tensor):
        return f"Tensor(dtype={x.dtype}, shape={tuple(x.shape)})"
    return type(x).__name__


def _as_mask(x: object, op: str) -> Mask:
    if isinstance(x, Mask):
        return x
    if isinstance(x, Tensor) and x.dtype == torch.bool:
        return from_tensor(x)
    raise TypeError(f"cannot combine a Mask with {_describe(x)} using '{op}'")


class _Combined(Mask):
    def __init__(self, op: str, a: Mask, b: Mask) -> None:
        self.op, self.a, self.b = op, a, b
        self.batch_size = _merge_dim("batch_size", a.batch_size, b.batch_size)
        self.num_heads = _merge_dim("num_heads", a.num_heads, b.num_heads)
        self.pins_size = a.pins_size or b.pins_size
        self.over_keys = a.over_keys and b.over_keys
        self.over_queries = a.over_queries and b.over_queries

    def evaluate(self, b, h, i, j, L, S):
        idx = (b, h, i, j)
        x = check_index_fn_output("mask function", self.a, self.a.evaluate(*idx, L, S), idx)
        y = check_index_fn_output("mask function", self.b, self.b.evaluate(*idx, L, S), idx)
        return x & y if self.op == "&" else x | y

    def to_dense(self, L, S, *, batch=None, heads=None, device=None):
        # each operand renders its own way (a tensor mask as a view, a band from its diagonals)
        # and one elementwise op joins them: no index grid gathered through a tensor operand
        self.batch_heads(batch, heads)
        a = self.a.to_dense(L, S, batch=batch, heads=heads, device=device)
        b = self.b.to_dense(L, S, batch=batch, heads=heads, device=device)
        return a & b if self.op == "&" else a | b

    def conjuncts(self):
        return (*self.a.conjuncts(), *self.b.conjuncts()) if self.op == "&" else (self,)

    def spec(self):
        a, b = self.a.spec(), self.b.spec()
        if a is None or b is None:
            return None
        return f"({a[0]}{self.op}{b[0]})", [*a[1], *b[1]]

    def natural_block(self):
        # one operand's blocks (the other's edges cut tiles wherever they fall), unless both
        # have blocks of different sizes
        a, b = self.a.natural_block(), self.b.natural_block()
        return a if b is None or b == a else b if a is None else None

    def band(self):
        if self.op != "&":
            return None
        a, b = self.a.band(), self.b.band()
        if a is None or b is None:
            return None
        return (max(a[0], b[0]), min(a[1], b[1]))

    def diagonal_map(self, L, S, device):
        a = self.a.diagonal_map(L, S, device)
        b = None if a is None else self.b.diagonal_map(L, S, device)
        if a is None or b is None:
            return None
        return a & b if self.op == "&" else a | b

    def block_codes(self, L, S, bq, bk, nb, nh, device):
        codes = self._geometric_block_map(L, S, bq, bk, device)
        if codes is not None:
            return codes
        # each operand on the (B, H) sizes it depends on itself
        a = self.a.block_codes(L, S, bq, bk, *self.a.batch_heads(None, None), device)
        b = self.b.block_codes(L, S, bq, bk, *self.b.batch_heads(None, None), device)
        codes, todo = combine_codes(self.op, a, b)
        return refine(self, codes, todo, L, S, bq, bk, nb, nh, device)

    def geometry(self, L, S):
        if self.op == "&":
            return combine_geometry(self.a.geometry(L, S), self.b.geometry(L, S))
        # a | b = a + b − (a & b), each in closed form (prefix-LM: causal() | padding([n]))
        a, b = self.a.closed_counts(L, S), self.b.closed_counts(L, S)
        both = None if a is None or b is None else (self.a & self.b).closed_counts(L, S)
        if both is None:
            return None
        return Geometry(pairs=_add_counts(_add_counts(a, b, 1), both, -1))

    def _joined(self, method: str, L: int, S: int, device) -> Tensor | None:
        """Both operands' ``method`` (`key_mask` or `query_mask`) joined by the op, or None."""
        a = getattr(self.a, method)(L, S, device=device)
        b = None if a is None else getattr(self.b, method)(L, S, device=device)
        if b is None:
            return None
        return a & b if self.op == "&" else a | b

    def key_mask(self, L, S, *, device=None):
        return self._joined("key_mask", L, S, device)

    def query_mask(self, L, S, *, device=None):
        return self._joined("query_mask", L, S, device)

    def key_interval(self, L, S, *, device=None):
        if self.op != "&":
            return None
        a = self.a.key_interval(L, S, device=device)
        b = self.b.key_interval(L, S, device=device)
        if a is None or b is None:
            return None
        lo = a[0] if b[0] is None else b[0] if a[0] is None else torch.maximum(a[0], b[0])
        return lo, torch.minimum(a[1], b[1])

    def data_tensors(self) -> list[tuple[str, Tensor]]:
        return self.a.data_tensors() + self.b.data_tensors()

    def default_size(self) -> tuple[int, int]:
        # A fixed-size operand (a tensor, document ids) decides; otherwise the larger picture.
        pinned = [m.default_size() for m in (self.a, self.b) if m.pins_size]
        return pinned[0] if pinned else max(self.a.default_size(), self.b.default_size())

    def __repr__(self) -> str:
        return f"({self.a!r} {self.op} {self.b!r})"


class _Not(Mask):
    def __init__(self, inner: Mask) -> None:
        self.inner = inner
        self.batch_size, self.num_heads = inner.batch_size, inner.num_heads
        self.pins_size = inner.pins_size
        self.over_keys = inner.over_keys
        self.over_queries = inner.over_queries

    def evaluate(self, b, h, i, j, L, S):
        idx = (b, h, i, j)
        return ~check_index_fn_output(
            "mask function", self.inner, self.inner.evaluate(*idx, L, S), idx
        )

    def geometry(self, L, S):
        inner = self.inner.closed_counts(L, S)
        return None if inner is None else Geometry(pairs=[[L * S - n for n in r] for r in inner])

    def diagonal_map(self, L, S, device):
        inner = self.inner.diagonal_map(L, S, device)
        return None if inner is None else ~inner

    def key_mask(self, L, S, *, device=None):
        inner = self.inner.key_mask(L, S, device=device)
        return None if inner is None else ~inner

    def query_mask(self, L, S, *, device=None):
        inner = self.inner.query_mask(L, S, device=device)
        return None if inner is None else ~inner

    def block_codes(self, L, S, bq, bk, nb, nh, device):
        inner = self.inner.block_codes(L, S, bq, bk, nb, nh, device)  # same (B, H) sizes
        return (FULL - inner).to(torch.int8)  # EMPTY <-> FULL, PARTIAL stays

    def data_tensors(self) -> list[tuple[str, Tensor]]:
        return self.inner.data_tensors()

    def spec(self):
        inner = self.inner.spec()
        return None if inner is None else (f"~{inner[0]}", inner[1])

    def default_size(self) -> tuple[int, int]:
        return self.inner.default_size()

    def __repr__(self) -> str:
        return f"~{self.inner!r}"


class TensorMask(Mask):
    """A mask given as a bool tensor broadcastable to ``(B, H, L, S)`` (True = may attend)."""

    pins_size = True

    def __init__(self, t: Tensor) -> None:
        if not isinstance(t, Tensor):
            raise TypeError(f"from_tensor: expected a bool Tensor, got {_describe(t)}")
        if t.dtype != torch.bool:
            raise TypeError(f"from_tensor: expected dtype torch.bool, got {t.dtype}")
        if t.dim() < 2 or t.dim() > 4:
            raise ValueError(
                "from_tensor: expected 2 to 4 dims broadcastable to (B, H, L, S), "
                f"got shape {tuple(t.shape)}"
            )
        self.t = t.reshape((1,) * (4 - t.dim()) + tuple(t.shape))  # (B|1, H|1, L|1, S|1)
        self.batch_size = self.t.shape[0] if self.t.shape[0] > 1 else None
        self.num_heads = self.t.shape[1] if self.t.shape[1] > 1 else None
        self.over_keys = self.t.shape[1] == 1 and self.t.shape[2] == 1
        self.over_queries = self.t.shape[1] == 1 and self.t.shape[3] == 1 and not self.over_keys

    def check_size(self, L: int, S: int) -> None:
        tl, ts = self.t.shape[-2:]
        if tl not in (1, L) or ts not in (1, S):
            raise ValueError(
                f"mask of shape {tuple(self.t.shape)} is not broadcastable to (B, H, L={L}, S={S})"
            )

    def evaluate(self, b, h, i, j, L, S):
        self.check_size(L, S)
        t = self.t.to(i.device)
        bi = b if t.shape[0] > 1 else torch.zeros_like(b)
        hi = h if t.shape[1] > 1 else torch.zeros_like(h)
        ii = i if t.shape[2] > 1 else torch.zeros_like(i)
        jj = j if t.shape[3] > 1 else torch.zeros_like(j)
        return t[bi, hi, ii, jj]

    def block_codes(self, L, S, bq, bk, nb, nh, device):  # noqa: ARG002 (the Mask protocol's signature)
        self.check_size(L, S)
        return tensor_codes(self.t.to(device), L, S, bq, bk)  # O(t.numel()): never the L×S grid

    def key_mask(self, L, S, *, device=None):
        self.check_size(L, S)
        if not self.over_keys:  # heads or rows differ
            return None
        t = self.t if device is None else self.t.to(device)
        return t[:, 0, 0, :].expand(t.shape[0], S)  # (B|1, S)

    def query_mask(self, L, S, *, device=None):
        self.check_size(L, S)
        if not self.over_queries:
            return None
        t = self.t if device is None else self.t.to(device)
        return t[:, 0, :, 0].expand(t.shape[0], L)  # (B|1, L)

    def geometry(self, L, S):
        self.check_size(L, S)
        t = self.t.sum((-2, -1), dtype=torch.int64)  # (B|1, H|1): counted once, then repeated
        repeat = (L if self.t.shape[-2] == 1 else 1) * (S if self.t.shape[-1] == 1 else 1)
        return Geometry(pairs=[[int(n) * repeat for n in row] for row in t.tolist()])

    def to_dense(self, L, S, *, batch=None, heads=None, device=None):
        _check_lengths(L, S)
        self.batch_heads(batch, heads)
        self.check_size(L, S)
        t = self.t if device is None else self.t.to(device)
        return t.expand(t.shape[0], t.shape[1], L, S)

    def default_size(self) -> tuple[int, int]:
        return int(self.t.shape[-2]), int(self.t.shape[-1])

    def spec(self):
        return "tensor", [self.t]

    def data_tensors(self) -> list[tuple[str, Tensor]]:
        return [(repr(self), self.t)]

    def __repr__(self) -> str:
        return f"from_tensor(shape={tuple(self.t.shape)})"


class FnMask(Mask):
    """A mask given by ``fn(b, h, i, j) -> bool tensor`` (FlexAttention's ``mask_mod``).

    ``i`` is the query's position in key coordinates (``row + S - L``, bottom-right aligned) and
    ``j`` the key position, so ``lambda b, h, i, j: i >= j`` is bottom-right causal.
    """

    def __init__(
        self,
        fn: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor],
        *,
        batch_size: int | None = None,
        num_heads: int | None = None,
        name: str | None = None,
    ) -> None:
        if not callable(fn):
            raise TypeError(f"from_fn: expected a callable fn(b, h, i, j), got {_describe(fn)}")
        self.fn = fn
        self.batch_size, self.num_heads = batch_size, num_heads
        self.name = name or getattr(fn, "__name__", "fn")

    def mod(self, b, h, p, j, S):  # noqa: ARG002 (the Mask protocol's signature)
        out = self.fn(b, h, p, j)
        # Checked here, not only on the final result: inside `&`/`|` a Python bool or an int
        # tensor would otherwise be silently absorbed (or fail with a torch-internal error), and
        # a wrong shape would broadcast into the other operand. The tiled backend evaluates
        # tiles through `evaluate`, so this check covers it as well.
        return check_index_fn_output("mask function", self.fn, out, (b, h, p, j), want_bool=True)

    def __repr__(self) -> str:
        return f"from_fn({self.name})"


def from_tensor(t: Tensor) -> Mask:
    """Wraps a bool tensor broadcastable to ``(B, H, L, S)`` as a `Mask` (True = may attend)."""
    return TensorMask(t)


def from_fn(
    fn: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor],
    *,
    batch_size: int | None = None,
    num_heads: int | None = None,
) -> Mask:
    """Builds a mask from ``fn(b, h, i, j) -> bool tensor`` on broadcastable index tensors.

    ``i`` is the query position bottom-right aligned to the keys (``row + S - L``), ``j`` the key
    position. Pass ``batch_size``/``num_heads`` if ``fn`` depends on ``b``/``h`` so that dense and
    counting renderings cover those dimensions.

    Example:
        >>> m = from_fn(lambda b, h, i, j: (i - j).abs() <= 1)
    """
    return FnMask(fn, batch_size=batch_size, num_heads=num_heads)


__all__ = [
    "DIGEST_SIZE",
    "EMPTY",
    "FULL",
    "PARTIAL",
    "FnMask",
    "Mask",
    "TensorMask",
    "from_fn",
    "from_tensor",
    "tensor_digest",
]
