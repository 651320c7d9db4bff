"""Tiling plans for the tiled ("flash") backend: which query rows meet which keys, and how.

A mask is turned into a *plan*: a list of groups, each covering a range of query rows with one or
more *calls*. A call is one invocation of the tile engine on (a batch range, a row range, a key set)
with one of three treatments:

- ``FULL``: every (row, key) pair of the call is attended; the mask is not evaluated (an additive
  bias, if any, is still computed for the call's tile only).
- ``MASKED``: the mask (and bias) is evaluated on the call's rows × keys only.
- ``CAUSAL``: rows and keys form a square aligned top-left; the engine applies causality itself.

The calls of one group cover disjoint key sets, so their partial results merge exactly by their
log-sum-exp (`functional.merge.merge_partials`). Empty tiles are in no call at all.

The mask's geometry comes from its own public methods, in O(tiles) instead of O(L·S):

- `Mask.band` — ``causal()``, ``sliding_window(w)`` and their intersections keep the pairs with
  ``lo <= j − p <= hi`` (``p = i + S − L`` the aligned query position). Interior query blocks of a
  narrow band all see the same relative key window, so they run as ONE batched call
  (`BandCall`) over strided windows of the keys with one shared (block × window) mask.
- `Mask.block_map` — closed form for every structured kind (padding, documents, strided,
  global/local, BigBird, ``&``, ``|``, ``~``; see `attnlab.masks.blocks`), from the rendering for
  masks given by a tensor or a function.
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
from dataclasses import replace

import torch
from torch import Tensor

from ...masks import FULL, PARTIAL, Mask, TensorMask
from ...masks.blocks import band_codes
from .calls import CALL_CAUSAL, CALL_FULL, CALL_MASKED, BandCall, Call, Group, Plan, SegmentCall

# Elements of an additive (bias/mask) tile built for one call: keeps every tile tensor small.
TILE_BUDGET = 1 << 22
# A relative bias gets shared tiles once L·S holds this many (block_q × block_k) tiles: measured,
# ALiBi causal at L = 512 and 724 is faster per tile, at L = 1024 and above faster shared.
RELATIVE_MIN_REUSE = 4


def _binding(mask: Mask | None) -> Mask | None:
    """``mask`` without the conjuncts that keep every pair: a mask tensor that is all True (the
    2-D all-ones ``attention_mask`` transformers passes becomes ``causal() & from_tensor(ones)``)
    plans as the rest of the ``&`` — the same attention, now on the rest's fast plan (one causal
    call). Reads the tensor's values, as the plan does anyway (`Mask.cache_key`)."""
    if mask is None:
        return None
    parts = mask.conjuncts()
    kept = [m for m in parts if not (isinstance(m, TensorMask) and bool(m.t.all()))]
    if len(kept) == len(parts):
        return mask
    return functools.reduce(operator.and_, kept) if kept else None


def band_of(mask: Mask | None) -> tuple[float, float] | None:
    """``(lo, hi)`` with ``mask = {lo <= j − p <= hi}``, ±inf for no bound; None if not a band.

    `Mask.band`, with no mask the unbounded band.
    """
    return (-math.inf, math.inf) if mask is None else mask.band()


def _clip_band(band: tuple[float, float], L: int, S: int) -> tuple[float, float]:
    """Drops bounds that never bind: ``j − p`` always lies in ``[−(S−1), L−1]``."""
    lo, hi = band
    if lo <= -(S - 1):
        lo = -math.inf
    if hi >= L - 1:
        hi = math.inf
    return lo, hi


# --------------------------------------------------------------------------- plan builders
def _runs(tiles: list[int]) -> list[tuple[int, int]]:
    """Consecutive runs ``[(first, last), …]`` of a sorted tile list."""
    runs: list[tuple[int, int]] = []
    for t in tiles:
        if runs and runs[-1][1] == t - 1:
            runs[-1] = (runs[-1][0], t)
        else:
            runs.append((t, t))
    return runs


def _key_sets(
    tiles: list[int], bk: int, S: int, chunk: int | None
) -> list[tuple[int, int] | Tensor]:
    """Key sets covering ``tiles``: ranges when the tiles form at most two runs, else gathered.

    ``chunk`` (keys) splits the sets so that a call's additive tile stays within the budget.
    """
    runs = [(a * bk, min(S, (b + 1) * bk)) for a, b in _runs(tiles)]
    if chunk is not None:
        pieces: list[tuple[int, int]] = []
        for k0, k1 in runs:
            pieces.extend((s, min(k1, s + chunk)) for s in range(k0, k1, chunk))
        runs = pieces
        if len(runs) <= 2:
            return list(runs)
        # gather runs into index sets of at most `chunk` keys
        sets: list[tuple[int, int] | Tensor] = []
        cur: list[tuple[int, int]] = []
        size = 0
        for k0, k1 in runs:
            if cur and size + (k1 - k0) > chunk:
                sets.append(_gather(cur))
                cur, size = [], 0
            cur.append((k0, k1))
            size += k1 - k0
        if cur:
            sets.append(_gather(cur))
        return sets
    if len(runs) <= 2:
        return list(runs)
    return [_gather(runs)]


def _gather(runs: list[tuple[int, int]]) -> tuple[int, int] | Tensor:
    if len(runs) == 1:
        return runs[0]
    return torch.cat([torch.arange(a, b) for a, b in runs])


def _generic_plan(
    codes: Tensor, B: int, H: int, L: int, S: int, bq: int, bk: int, with_bias: bool, kind: str
) -> Plan:
    """One group per query block (per batch item if the map depends on it).

    FULL tiles of a block form calls without mask evaluation, PARTIAL tiles calls with it; calls
    that carry an additive tile (a mask, a bias) are split so the tile stays within TILE_BUDGET.
    """
    chunk = max(bk, TILE_BUDGET // max(1, H * bq))
    codes = codes.to("cpu")  # a plan is host data: Python loops read the codes tile by tile
    if codes.shape[1] > 1:  # union over heads: EMPTY/FULL only if so for every head
        lo, hi = codes.amin(dim=1, keepdim=True), codes.amax(dim=1, keepdim=True)
        codes = torch.where(lo == hi, lo, PARTIAL).to(torch.int8)
    per_batch = codes.shape[0] > 1
    groups: list[Group] = []
    for bi in range(codes.shape[0]):
        b0, b1 = (bi, bi + 1) if per_batch else (0, B)
        table = codes[bi, 0].tolist()
        for qb, row in enumerate(table):
            r0, r1 = qb * bq, min(L, (qb + 1) * bq)
            full = [t for t, c in enumerate(row) if c == FULL]
            part = [t for t, c in enumerate(row) if c == PARTIAL]
            calls: list[Call | BandCall] = []
            for tiles, treat in ((full, CALL_FULL), (part, CALL_MASKED)):
                if not tiles:
                    continue
                limit = chunk if (treat == CALL_MASKED or with_bias) else None
                for keys in _key_sets(tiles, bk, S, limit):
                    calls.append(Call(b0, b1, r0, r1, keys, treat))
            if calls:
                groups.append(Group(b0, b1, r0, r1, calls))
    return Plan(groups, kind, bq, bk)


def _causal_plan(B: int, L: int, S: int) -> Plan:
    """Bottom-right causal without bias: at most two calls over all rows."""
    if L == S:
        return Plan([Group(0, B, 0, L, [Call(0, B, 0, L, (0, S), CALL_CAUSAL)])], "causal", L, S)
    if L < S:
        off = S - L
        calls: list[Call | BandCall] = [
            Call(0, B, 0, L, (0, off), CALL_FULL),
            Call(0, B, 0, L, (off, S), CALL_CAUSAL),
        ]
        return Plan([Group(0, B, 0, L, calls)], "causal", L, S)
    # L > S: the first L − S rows see no key
    return Plan(
        [Group(0, B, L - S, L, [Call(0, B, L - S, L, (0, S), CALL_CAUSAL)])], "causal", L, S
    )


def _band_plan(
    B: int, H: int, L: int, S: int, lo: int, hi: int, bq: int, with_bias: bool
) -> Plan | None:
    """Every full query block whose window holds a key, batched (windows reaching outside the
    keys are clipped: ``key_limit``), plus one masked call for a last partial block; None if
    not worthwhile."""
    off, span = S - L, hi - lo
    width = -(-(bq + span) // bq) * bq  # keys per window, a multiple of bq
    if width >= S:
        return None
    block_budget = max(1, TILE_BUDGET // (H * bq * width)) if with_bias else None
    nq = -(-L // bq)
    # block t's window is [t·bq + off + lo, … + width): batch the full blocks where it meets [0, S)
    t_a = max(0, -((off + lo + width - 1) // bq))  # first block whose window ends past key 0
    t_b = min(L // bq, -(-(S - off - lo) // bq))  # past the last block whose window starts < S
    groups: list[Group] = []
    if t_b - t_a < 2:
        t_a = t_b = 0
    for t in range(nq):
        if t_a <= t < t_b:
            if t == t_a:
                step = t_b - t_a if block_budget is None else max(1, block_budget)
                for s in range(t_a, t_b, step):
                    e = min(t_b, s + step)
                    ks = s * bq + off + lo
                    band = BandCall(0, B, s, e, bq, width, ks, span, key_limit=S)
                    groups.append(Group(0, B, s * bq, e * bq, [band]))
            continue
        r0, r1 = t * bq, min(L, (t + 1) * bq)
        k0 = max(0, r0 + off + lo)
        k1 = min(S, r1 - 1 + off + hi + 1)
        if k1 > k0:
            groups.append(Group(0, B, r0, r1, [Call(0, B, r0, r1, (k0, k1), CALL_MASKED)]))
    return Plan(groups, "band", bq, bq)


def _relative_plan(B: int, L: int, S: int, lo: float, hi: float, bq: int, wc: int) -> Plan:
    """Plan for a bias that depends only on ``(h, j − p)``, inside the band ``lo <= j − p <= hi``.

    Each query block of ``bq`` rows meets the keys ``j − p0 ∈ [lo, hi + bq − 1]`` (``p0`` = its
    first aligned position). That range is cut into windows of ``wc`` keys at fixed offsets from
    ``p0``, counted back from the diagonal; all blocks share the additive tile of one offset, so
    each offset is ONE batched call (`BandCall` with windows clipped to the keys). Offsets meet a
    row over disjoint keys, so their results merge by log-sum-exp (``overlap``). A last partial
    block runs as plain masked calls.
    """
    off = S - L
    lo_i, hi_i = int(max(lo, -(S - 1))), int(min(hi, L - 1))
    wc = -(-max(wc, bq) // bq) * bq  # a multiple of bq
    nfull = L // bq
    top = hi_i + bq  # windows end here, relative to p0, and step back by wc
    groups: list[Group] = []
    a = top - wc
    while a + wc > lo_i:
        # blocks whose window [t·bq + off + a, … + wc) meets [0, S)
        t_first = max(0, (-wc - off - a) // bq + 1)
        t_last = min(nfull - 1, -((off + a - S) // bq) - 1)
        if t_first <= t_last:
            band = BandCall(
                0,
                B,
                t_first,
                t_last + 1,
                bq,
                wc,
                t_first * bq + off + a,
                hi_i - lo_i,
                c_lo=lo_i - a,
                key_limit=S,
            )
            groups.append(Group(0, B, t_first * bq, (t_last + 1) * bq, [band]))
        a -= wc
    if nfull * bq < L:
        r0 = nfull * bq
        k0 = max(0, r0 + off + lo_i)
        k1 = min(S, L - 1 + off + hi_i + 1)
        calls: list[Call | BandCall] = [
            Call(0, B, r0, L, (c0, min(k1, c0 + wc)), CALL_MASKED) for c0 in range(k0, k1, wc)
        ]
        if calls:
            groups.append(Group(0, B, r0, L, calls))
    return Plan(groups, "relative", bq, wc, overlap=True)


# Packed documents run as batched segment calls while a batch item needs at most this many
# (one per run of consecutive equal-length documents); beyond it, the block-sparse plan.
SEGMENT_MAX_CALLS = 64


def _documents(mask: Mask | None) -> tuple[Mask, bool] | None:
    """``(document mask, causal)`` for ``document(ids)`` or ``document(ids) & causal()``."""
    from ...masks import DocumentMask

    if mask is None:
        return None
    parts = mask.conjuncts()
    docs = [m for m in parts if isinstance(m, DocumentMask)]
    if len(docs) != 1 or any(m.band() != (-math.inf, 0) for m in parts if m is not docs[0]):
        return None
    return docs[0], len(parts) > 1


def segment_plan(mask: Mask | None, *, B: int, L: int, S: int, bias: str | None) -> Plan | None:
    """Packed documents (causal or not) as batched `SegmentCall` s, or None if not applicable.

    Applies to ``document(ids)`` and ``document(ids) & causal()`` without bias, with ``L == S``
    and every id labelling ONE run of positions (block-diagonal). The runs are read from the
    mask's ids on the host, like any block map (mask structure, never q/k/v values).
    """
    found = _documents(mask)
    if found is None or bias is not None or L != S or L == 0:
        return None
    doc, causal = found
    ids = doc.ids.to("cpu")  # type: ignore[attr-defined]
    if ids.shape[-1] != S:
        return None  # the generic path raises the mask's own error
    per_batch = ids.dim() == 2 and ids.shape[0] > 1
    table = ids if ids.dim() == 2 else ids.view(1, S)
    groups: list[Group] = []
    for bi in range(table.shape[0]):
        row = table[bi]
        new = torch.ones(S, dtype=torch.bool)
        new[1:] = row[1:] != row[:-1]
        starts = new.nonzero().flatten()
        if torch.unique(row).numel() != starts.numel():
            return None  # an id in several runs: not block-diagonal
        bounds = [*starts.tolist(), S]
        b0, b1 = (bi, bi + 1) if per_batch else (0, B)
        calls: list[SegmentCall] = []
        for a, e in itertools.pairwise(bounds):
            last = calls[-1] if calls else None
            if last is not None and last.n == e - a and last.r1 == a:
                calls[-1] = SegmentCall(b0, b1, last.start, last.n, last.count + 1, causal)
            else:
                calls.append(SegmentCall(b0, b1, a, e - a, 1, causal))
        if len(calls) > SEGMENT_MAX_CALLS:
            return None
        groups.extend(Group(b0, b1, c.r0, c.r1, [c]) for c in calls)
    return Plan(groups, "documents", 0, 0)


def key_mask_plan(
    mask: Mask | None,
    *,
    B: int,
    H: int,
    L: int,
    S: int,
    band_block: int,
    bias: str | None,
    device: torch.device,
) -> tuple[Plan, Tensor, Tensor | None] | None:
    """``(plan, keys, rows)`` for a band ``&`` masks over keys or query rows alone, whose
    kernels read the key mask ``keys (B|1, S)`` bool (all ones without one) and whose output
    rows outside ``rows (B|1, L)`` bool (None: every row) the job sets to 0 (lse −inf); None if
    not applicable.

    Applies without a bias when every conjunct of the mask is a band, over keys alone
    (`Mask.over_keys`, its `Mask.key_mask`: padding, a ``(B, 1, 1, S)`` tensor, their
    ``&``/``|``/``~``) or over query rows alone (`Mask.over_queries`, `Mask.query_mask`: a
    ``(B, 1, L, 1)`` tensor), and one is over keys or rows. With ``L == S`` and no band or a
    causal one: ONE keyed `SegmentCall`; with a sliding window: the window's batched band plan
    with keyed `BandCall` s (any L, S; a last partial block as a masked call, which evaluates
    the whole mask). Keyed calls run as simple calls (the NaN rule, the torch engine) evaluate
    the whole mask, query rows included. transformers' 2-D ``attention_mask`` (all ones or not) with
    a causal, sliding-window or encoder mask is such a mask. Nothing is read from the mask's
    values: the plan is its structure, the key and row masks tensor expressions (O(B·(L + S))
    on the device); the kernels find each item's first and last kept key.
    """
    if mask is None or bias is not None or L == 0 or S == 0:
        return None
    band: tuple[float, float] = (-math.inf, math.inf)
    keys: Tensor | None = None
    rows: Tensor | None = None
    for part in mask.conjuncts():
        over_keys = part.key_mask(L, S, device=device) if part.over_keys else None
        if over_keys is not None:
            keys = over_keys if keys is None else keys & over_keys
            continue
        over_rows = part.query_mask(L, S, device=device) if part.over_queries else None
        if over_rows is not None:
            rows = over_rows if rows is None else rows & over_rows
            continue
        found = part.band()
        if found is None:
            return None
        band = (max(band[0], found[0]), min(band[1], found[1]))
    lo, hi = _clip_band(band, L, S)
    if keys is None and rows is None:
        return None
    if keys is None:  # keyed calls all the same: run as simple calls, they evaluate the mask
        keys = torch.ones(1, S, dtype=torch.bool, device=device)
    kind = "key mask" if rows is None else "key/row mask"
    if lo == -math.inf and hi in (0, math.inf):
        if L != S:
            return None
        call = SegmentCall(0, B, 0, L, 1, hi == 0, keyed=True)
        plan = Plan([Group(0, B, 0, L, [call])], kind, 0, 0)
    elif lo != -math.inf and hi != math.inf:
        plan = _band_plan(B, H, L, S, int(lo), int(hi), band_block, False)
        if plan is None:
            return None
        for g in plan.groups:
            g.calls = [replace(c, keyed=True) if isinstance(c, BandCall) else c for c in g.calls]
        plan.kind = f"band, {kind}"
    else:
        return None
    return plan.settle(B, L, S, biased=False), keys, rows


def build_plan(
    mask: Mask | None,
    *,
    B: int,
    H: int,
    L: int,
    S: int,
    block_q: int,
    block_k: int,
    band_block: int,
    bias: str | None,
    device: torch.device | str | None = None,
    relative: bool = False,
) -> Plan:
    """Chooses the tiling for one attention call.

    Args:
        mask: the `Mask` (None = attend everything).
        B, H, L, S: sizes of the call.
        block_q, block_k: tile sizes of the block map for general masks.
        band_block: query block size of batched band calls.
        bias: None, ``"fn"`` (a bias function, evaluated per call) or ``"tensor"`` (sliced).
        device: where index tensors for mask evaluation live.
        relative: the bias function depends only on ``(h, j − p)`` (see
            `request.is_relative_bias`): band masks then share one additive tile per window
            offset (`BandCall`), with ``block_k`` as the window of wide bands — once the grid
            holds ``RELATIVE_MIN_REUSE`` tiles of ``block_q × block_k`` (below that a shared tile
            is barely reused and per-tile evaluation is faster).
    """
    with_bias = bias is not None

    def done(plan: Plan) -> Plan:  # the whole-plan facts, settled once
        return plan.settle(B, L, S, biased=with_bias)

    mask = _binding(mask)
    band = band_of(mask)
    if band is not None:
        lo, hi = _clip_band(band, L, S)
        tiles = L * S / (block_q * block_k)
        if relative and bias == "fn" and tiles >= RELATIVE_MIN_REUSE:
            if lo != -math.inf and hi != math.inf:
                # one shared tile: no need to split the batched call to bound tile memory
                plan = _band_plan(B, H, L, S, int(lo), int(hi), band_block, False)
                if plan is not None:
                    return done(plan)
            return done(_relative_plan(B, L, S, lo, hi, block_q, block_k))
        if lo == -math.inf and hi == math.inf:
            if bias is None:
                whole = Group(0, B, 0, L, [Call(0, B, 0, L, (0, S), CALL_FULL)])
                return done(Plan([whole], "dense", L, S))
            codes = torch.full((1, 1, -(-L // block_q), -(-S // block_k)), FULL, dtype=torch.int8)
            return done(_generic_plan(codes, B, H, L, S, block_q, block_k, True, "dense+bias"))
        if lo == -math.inf and hi == 0 and bias is None:
            return done(_causal_plan(B, L, S))
        if lo != -math.inf and hi != math.inf and bias != "tensor":
            plan = _band_plan(B, H, L, S, int(lo), int(hi), band_block, bias is not None)
            if plan is not None:
                return done(plan)
        codes = band_codes(L, S, block_q, block_k, lo, hi, device)
        return done(_generic_plan(codes, B, H, L, S, block_q, block_k, with_bias, "band (tiled)"))
    assert mask is not None
    plan = segment_plan(mask, B=B, L=L, S=S, bias=bias)
    if plan is not None:
        return done(plan)
    codes = mask.block_map(L, S, block_q, block_k, batch=B, heads=H, device=device)
    return done(_generic_plan(codes, B, H, L, S, block_q, block_k, with_bias, "block-sparse"))


__all__ = [
    "band_of",
    "build_plan",
    "key_mask_plan",
    "segment_plan",
]
