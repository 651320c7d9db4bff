"""The objects of a tiling plan (`tiling.build_plan` makes them): calls, groups, the plan.

A call is one invocation of the tile engine on (a batch range, a row range, a key set) with one
of three treatments — ``FULL`` (every pair attended: the mask is not evaluated), ``MASKED`` (the
mask and bias evaluated on the call's rows × keys only) and ``CAUSAL`` (rows and keys form a
square aligned top-left; the engine applies causality itself) — or a batched form of many such
calls: `BandCall` (the query blocks of a narrow band, one shared relative mask) and
`SegmentCall` (equal-length segments, packed documents). The calls of one `Group` cover
disjoint key sets and merge by their log-sum-exp. What the engines need to know about the plan
as a whole is settled when it is built (`Plan.settle`), so a cached plan answers by reading
fields.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

# Call treatments.
CALL_FULL, CALL_MASKED, CALL_CAUSAL = "full", "masked", "causal"
# Rows per call when a keyed segment call runs as simple calls (`SegmentCall.block_calls`): each
# evaluates its mask tile of KEYED_ROWS × keys (2 MiB of float32 per batch item at 8192 keys).
KEYED_ROWS = 64


@dataclass(frozen=True)
class Call:
    """One engine call: batch items [b0, b1), query rows [r0, r1), a key set and a treatment.

    ``keys`` is a contiguous range ``(k0, k1)`` or a sorted int64 tensor of key indices;
    ``index`` holds them as an int64 tensor either way (made once, with the plan).
    """

    b0: int
    b1: int
    r0: int
    r1: int
    keys: tuple[int, int] | Tensor
    kind: str
    index: Tensor = field(init=False, compare=False, repr=False)  # the keys as int64 (CPU)

    def __post_init__(self) -> None:
        keys = self.keys
        index = torch.arange(keys[0], keys[1]) if isinstance(keys, tuple) else keys
        object.__setattr__(self, "index", index)

    @property
    def num_keys(self) -> int:
        """Number of keys in the call."""
        return self.keys[1] - self.keys[0] if isinstance(self.keys, tuple) else self.keys.numel()

    def __repr__(self) -> str:
        keys = self.keys if isinstance(self.keys, tuple) else f"<{self.num_keys} indices>"
        rows = f"b0={self.b0}, b1={self.b1}, r0={self.r0}, r1={self.r1}"
        return f"Call({rows}, keys={keys}, kind={self.kind!r})"


@dataclass(frozen=True)
class BandCall:
    """Query blocks ``t0 <= t < t1`` of size ``bq`` batched into one call per batch item.

    Block t covers rows ``[t·bq, (t+1)·bq)`` and the key window
    ``[k_start + (t − t0)·bq, … + width)``; inside the window, row ``r`` (0-based in its block) may
    attend window column ``c`` iff ``c_lo <= c − r <= c_lo + span`` — the same relative mask for
    every block. With ``key_limit`` > 0 windows may reach outside ``[0, key_limit)``: the blocks
    whose window does (edge blocks) run on the window's in-range part. ``keyed``: rows attend
    only the keys their batch item's key mask keeps (as `SegmentCall.keyed`).
    """

    b0: int
    b1: int
    t0: int
    t1: int
    bq: int
    width: int
    k_start: int
    span: int
    c_lo: int = 0
    key_limit: int = 0
    keyed: bool = False
    r0: int = field(init=False, compare=False)  # first query row
    r1: int = field(init=False, compare=False)  # one past the last query row
    # blocks [ta, tb) whose window lies inside [0, key_limit) (all without a limit), that part
    # as one call (None if empty, the call itself if it is all), and the other blocks' windows
    # (t, k0, k1) before clipping
    inner_blocks: tuple[int, int] = field(init=False, compare=False)
    inner: BandCall | None = field(init=False, compare=False, repr=False)
    edges: tuple[tuple[int, int, int], ...] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        put = object.__setattr__
        put(self, "r0", self.t0 * self.bq)
        put(self, "r1", self.t1 * self.bq)
        ta, tb = self._interior()
        put(self, "inner_blocks", (ta, tb))
        outer = (*range(self.t0, ta), *range(tb, self.t1))
        put(self, "edges", tuple((t, *self.window(t)) for t in outer))
        if ta >= tb:
            put(self, "inner", None)
        elif (ta, tb) == (self.t0, self.t1):
            put(self, "inner", self)
        else:
            put(self, "inner", replace(self, t0=ta, t1=tb, k_start=self.window(ta)[0]))

    def window(self, t: int) -> tuple[int, int]:
        """Key range ``[k0, k1)`` of block t's window, before clipping."""
        k0 = self.k_start + (t - self.t0) * self.bq
        return k0, k0 + self.width

    def _interior(self) -> tuple[int, int]:
        """Blocks ``[ta, tb)`` whose window lies inside ``[0, key_limit)`` (all without a limit)."""
        if self.key_limit <= 0:
            return self.t0, self.t1
        first = self.t0 - (self.k_start // self.bq)  # window start >= 0
        last = self.t0 + (self.key_limit - self.width - self.k_start) // self.bq  # end <= limit
        ta = min(self.t1, max(self.t0, first))
        tb = max(ta, min(self.t1, last + 1))
        return ta, tb

    def block_calls(self) -> list[Call]:
        """The same work as one `Call` per query block (for the pure-PyTorch engine and stats)."""
        out = []
        for t in range(self.t0, self.t1):
            k0, k1 = self.window(t)
            if self.key_limit > 0:
                k0, k1 = max(0, k0), min(self.key_limit, k1)
            rows = (t * self.bq, (t + 1) * self.bq)
            out.append(Call(self.b0, self.b1, *rows, (k0, k1), CALL_MASKED))
        return out


@dataclass(frozen=True)
class SegmentCall:
    """``count`` consecutive segments of ``n`` positions from ``start``, as ONE call per batch item.

    Segment ``s`` covers rows and keys ``[start + s·n, start + (s+1)·n)``: its rows attend only
    its own keys, every one of them or causally (top-left within the segment). Packed documents
    of equal length are such segments; the kernel runs them batched over strided views.
    ``keyed``: of those keys, a row attends only the ones its batch item's key mask keeps (the
    job's ``keys``, `Mask.key_mask`: padding), which the kernel reads — the plan never does.
    """

    b0: int
    b1: int
    start: int
    n: int
    count: int
    causal: bool
    keyed: bool = False
    r0: int = field(init=False, compare=False)  # first query row
    r1: int = field(init=False, compare=False)  # one past the last query row

    def __post_init__(self) -> None:
        object.__setattr__(self, "r0", self.start)
        object.__setattr__(self, "r1", self.start + self.count * self.n)

    def block_calls(self) -> list[Call]:
        """The same work as one `Call` per segment (for the pure-PyTorch engine and stats); a
        keyed call as one ``MASKED`` call per `KEYED_ROWS` rows of a segment over the keys they
        may reach (the mask evaluated on that tile: no row's keys are split between calls)."""
        kind = CALL_CAUSAL if self.causal else CALL_FULL
        out = []
        for s in range(self.count):
            a, e = self.start + s * self.n, self.start + (s + 1) * self.n
            if not self.keyed:
                out.append(Call(self.b0, self.b1, a, e, (a, e), kind))
                continue
            for r0 in range(a, e, KEYED_ROWS):
                r1 = min(e, r0 + KEYED_ROWS)
                out.append(
                    Call(self.b0, self.b1, r0, r1, (a, r1 if self.causal else e), CALL_MASKED)
                )
        return out


@dataclass
class Group:
    """Calls over disjoint key sets that together cover batch [b0, b1) × rows [r0, r1)."""

    b0: int
    b1: int
    r0: int
    r1: int
    calls: list[Call | BandCall | SegmentCall] = field(default_factory=list)

    def __repr__(self) -> str:
        rows = f"b0={self.b0}, b1={self.b1}, r0={self.r0}, r1={self.r1}"
        return f"Group({rows}, {len(self.calls)} call(s))"


@dataclass
class Plan:
    """The whole tiling of one attention call. Rows in no group attend nothing (output 0).

    What the calls need to know about the plan as a whole is settled once, when `build_plan`
    makes it for a call of ``B × L`` rows and ``S`` keys (`settle`): ``covers_all`` (every
    (batch, row) lies in some group), ``merge_free`` (every output row comes from exactly one
    engine call), ``single_call`` (one unmasked call covers every row and key) and
    ``band_rows_once`` (every row lies in exactly one batched band call), ``alone`` (per group:
    no other group shares a row), ``whole`` (the single call as one `SegmentCall`, L = S) and
    ``biased`` (the plan was built for a bias).
    """

    groups: list[Group]
    kind: str
    block_q: int
    block_k: int
    overlap: bool = False  # groups may share rows (over disjoint keys): results merge by lse
    covers_all: bool = False
    merge_free: bool = False
    single_call: bool = False
    band_rows_once: bool = False
    alone: list[bool] = field(default_factory=list)  # per group: no other group shares a row
    whole: SegmentCall | None = None  # the single call as one segment (L = S)
    biased: bool = False  # every call carries a bias (its tiles are computed)

    def settle(self, B: int, L: int, S: int, *, biased: bool) -> Plan:
        """Sets the whole-plan facts (see the class) for ``B × L`` rows and ``S`` keys, with a
        bias (``biased``) or without."""
        self.biased = biased
        calls = [c for g in self.groups for c in g.calls]
        spans: dict[int, list[tuple[int, int]]] = {}
        for g in self.groups:
            for b in range(g.b0, g.b1):
                spans.setdefault(b, []).append((g.r0, g.r1))
        self.covers_all = all(_covered(spans.get(b, []), L) for b in range(B))
        self.merge_free = not self.overlap and all(len(g.calls) == 1 for g in self.groups)
        one = calls[0] if len(calls) == 1 else None
        self.single_call = (
            isinstance(one, Call)
            and one.kind != CALL_MASKED
            and isinstance(one.keys, tuple)
            and (one.b0, one.b1, one.r0, one.r1, one.keys) == (0, B, 0, L, (0, S))
        )
        if self.single_call and L == S:
            assert isinstance(one, Call)
            self.whole = SegmentCall(0, B, 0, L, 1, one.kind == CALL_CAUSAL)
        rows = sum((c.b1 - c.b0) * (c.r1 - c.r0) for c in calls if isinstance(c, BandCall))
        bands = bool(calls) and all(isinstance(c, BandCall) and c.r1 <= L for c in calls)
        self.band_rows_once = bands and not self.overlap and rows == B * L
        self.alone = [
            not self.overlap or not any(_meet(g, h) for h in self.groups if h is not g)
            for g in self.groups
        ]
        return self

    @functools.cached_property
    def simple_calls(self) -> list[Call]:
        """Every call, with batched band calls expanded into one call per query block (made on
        first use, kept with the plan)."""
        out: list[Call] = []
        for g in self.groups:
            for c in g.calls:
                out.extend(c.block_calls() if isinstance(c, BandCall | SegmentCall) else [c])
        return out

    @property
    def num_calls(self) -> int:
        """Number of engine calls (a batched band call counts once per batch range)."""
        return sum(len(g.calls) for g in self.groups)

    def __repr__(self) -> str:
        """``Plan(kind='band', calls=1, groups=1, block_q=16, block_k=16, band_calls=1)``: what
        the plan is, not each call (``plan.groups`` holds them)."""
        calls = [c for g in self.groups for c in g.calls]
        fields = [f"kind={self.kind!r}", f"calls={len(calls)}", f"groups={len(self.groups)}"]
        if self.block_q or self.block_k:  # 0: the plan has no block map (segments)
            fields += [f"block_q={self.block_q}", f"block_k={self.block_k}"]
        for name, cls in (("band_calls", BandCall), ("segment_calls", SegmentCall)):
            n = sum(isinstance(c, cls) for c in calls)
            fields += [f"{name}={n}"] if n else []
        fields += [f"{flag}=True" for flag in ("overlap", "biased") if getattr(self, flag)]
        return f"Plan({', '.join(fields)})"

    def describe(self) -> str:
        """One line for `explain`."""
        n_band = sum(isinstance(c, BandCall) for g in self.groups for c in g.calls)
        text = f"{self.kind} plan, {self.num_calls} engine call(s)"
        if n_band:
            text += f" ({n_band} batched band call(s) of {self.block_q}-row blocks)"
        segs = [c for g in self.groups for c in g.calls if isinstance(c, SegmentCall)]
        keyed = [c for g in self.groups for c in g.calls if getattr(c, "keyed", False)]
        if any(isinstance(c, BandCall) for c in keyed):
            text += " (the kernel reads the key mask)"
        elif keyed:
            text += " (one segment per batch item; the kernel reads the key mask)"
        if self.kind.endswith("row mask"):
            text += " (the masked query rows are zeros)"
        elif segs:
            n = sum(c.count for c in segs)
            text += f" ({n} document(s) in {len(segs)} batched segment call(s))"
        return text


def _covered(spans: list[tuple[int, int]], L: int) -> bool:
    """Whether row spans ``[(r0, r1), …]`` cover ``[0, L)``."""
    end = 0
    for r0, r1 in sorted(spans):
        if r0 > end:
            return False
        end = max(end, r1)
    return end >= L


def _meet(a: Group, b: Group) -> bool:
    """Whether two groups share a (batch, row)."""
    return a.b0 < b.b1 and b.b0 < a.b1 and a.r0 < b.r1 and b.r0 < a.r1


__all__ = [
    "CALL_CAUSAL",
    "CALL_FULL",
    "CALL_MASKED",
    "KEYED_ROWS",
    "BandCall",
    "Call",
    "Group",
    "Plan",
    "SegmentCall",
]
