"""Communication of ring attention: the point-to-point ring, and the metadata handshake.

`Ring.start` sends tensors to the next rank and receives the previous rank's, non-blocking; the
returned `Exchange` waits when called. Before any payload, `handshake` exchanges a small record
(shapes, dtype, layout, causal flag, scale, a fingerprint of the mask's contents, pieces) point to
point; any disagreement raises ``ValueError`` on every rank naming the rank and the field. A dead
or stalled peer raises `RingAttentionError` naming it, after at most ``timeout`` per exchange.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import time
import types
import zlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from ..masks import Mask
from ..masks.base import tensor_digest
from .ring_layout import LAYOUTS, chunk_ids


class RingAttentionError(RuntimeError):
    """A point-to-point exchange with a peer failed or timed out.

    Attributes:
        rank: this rank. hop: the exchange (0-based; one per piece and ring step; ``-1`` is the
        metadata handshake before the first hop). peer: the rank we were exchanging with.
    """

    def __init__(self, rank: int, hop: int, peer: int, cause: BaseException | str) -> None:
        where = "during the metadata handshake" if hop < 0 else f"at hop {hop}"
        super().__init__(
            f"ring attention on rank {rank}: exchange with peer rank {peer} failed {where}: {cause}"
        )
        self.rank, self.hop, self.peer = rank, hop, peer


@dataclass
class Ring:
    """This rank's place in the ring and the count of exchanges started (``hops``)."""

    group: dist.ProcessGroup | None
    rank: int
    world: int
    timeout: datetime.timedelta | None
    hops: int = 0

    @property
    def send_to(self) -> int:
        return (self.rank + 1) % self.world

    @property
    def recv_from(self) -> int:
        return (self.rank - 1) % self.world

    def _global(self, r: int) -> int:
        return r if self.group is None else dist.get_global_rank(self.group, r)

    def start(self, tensors: list[Tensor]) -> Exchange:
        """Sends ``tensors`` to the next rank and receives the previous rank's, non-blocking.

        Returns the exchange in flight; calling it waits and returns the received tensors.
        """
        hop = self.hops
        self.hops += 1
        received = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
        ops = [
            dist.P2POp(dist.isend, t.contiguous(), self._global(self.send_to), self.group)
            for t in tensors
        ]
        ops += [
            dist.P2POp(dist.irecv, r, self._global(self.recv_from), self.group) for r in received
        ]
        try:
            works = dist.batch_isend_irecv(ops)
        except RuntimeError as e:
            raise RingAttentionError(self.rank, hop, self.send_to, e) from e
        return Exchange(self, hop, works, len(tensors), received)


@dataclass
class Exchange:
    """One exchange in flight: ``works`` are its sends (the first ``sends``), then its receives.

    Calling it waits (only the first time) and returns the received tensors. Each finished
    operation is dropped at once, so a sent buffer is freed as soon as the caller lets go of it.
    """

    ring: Ring
    hop: int
    works: list
    sends: int
    received: list[Tensor]

    def __call__(self) -> list[Tensor]:
        timeout = self.ring.timeout
        while self.works:
            peer = self.ring.send_to if self.sends > 0 else self.ring.recv_from
            self.sends -= 1
            work = self.works.pop(0)
            try:
                ok = work.wait(timeout) if timeout is not None else work.wait()
            except RuntimeError as e:
                raise RingAttentionError(self.ring.rank, self.hop, peer, e) from e
            if ok is False:
                raise RingAttentionError(self.ring.rank, self.hop, peer, "timed out")
        return self.received


@dataclass
class RingConfig:
    """The configuration every rank agrees on (checked by `handshake`) plus this rank's place.

    Attributes:
        group, rank, world: the process group, this rank and the world size.
        causal, mask, scale: the attention (over global positions).
        layout: ``"contiguous"`` or ``"zigzag"`` (`ring_layout`).
        timeout: the wait for a peer at each exchange (None: the group's).
        pieces: parts per layout chunk; divides the chunk length.
        piece_codes: the mask's block map over pieces, per ``(C, N, B, H)`` (filled on use by
            `ring_blocks.tile_relation`).
    """

    group: dist.ProcessGroup | None
    rank: int
    world: int
    causal: bool
    mask: Mask | None
    scale: float
    layout: str
    timeout: datetime.timedelta | None
    pieces: int
    piece_codes: dict = field(default_factory=dict)

    def ring(self) -> Ring:
        """A fresh ring (hop count 0) for one pass."""
        return Ring(self.group, self.rank, self.world, self.timeout)

    def piece_ids(self, rank: int) -> list[int]:
        """Global indices of the pieces ``rank`` holds, in local order (all of one length)."""
        chunks = chunk_ids(rank, self.world, self.layout)
        return [c * self.pieces + j for c in chunks for j in range(self.pieces)]

    def owner(self, step: int) -> int:
        """The rank whose key/value block this rank holds at ring step ``step``."""
        return (self.rank - step) % self.world


_FIELDS = (
    "local_len",
    "batch",
    "heads",
    "kv_heads",
    "head_dim",
    "value_dim",
    "dtype",
    "causal",
    "layout",
    "scale",
    "mask",
    "key_len",
    "pieces",
)
_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]


def _feed(h, obj: object, seen: set[int], depth: int = 0) -> None:
    """Feeds ``obj``'s structure and contents into the hash ``h`` (identical across processes).

    Tensors contribute dtype, shape and bytes; masks, functions (code, constants, defaults and
    closure cells), partials and plain objects their parts, recursively. Private attributes
    (``_name``: caches such as BigBird's random tables) are skipped; object identities and
    addresses never enter, so equal masks built independently on different ranks agree.
    """
    if depth > 32 or id(obj) in seen:
        h.update(b"<cycle>")
        return
    tag = f"{type(obj).__module__}.{type(obj).__qualname__}|".encode()
    h.update(tag)
    if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes)):
        h.update(repr(obj).encode())
        return
    if isinstance(obj, torch.dtype):
        h.update(str(obj).encode())
        return
    if isinstance(obj, torch.device):  # ranks may well hold the mask on different devices
        return
    if isinstance(obj, types.ModuleType | type | types.BuiltinFunctionType):
        name = getattr(obj, "__qualname__", obj.__name__)
        h.update(f"{getattr(obj, '__module__', None)}.{name}".encode())
        return
    seen = seen | {id(obj)}
    if isinstance(obj, Tensor):
        h.update(tensor_digest(obj))  # read every time: values may change behind torch
        return
    parts: list[object]
    if isinstance(obj, list | tuple):
        parts = list(obj)
    elif isinstance(obj, dict):
        parts = [x for kv in sorted(obj.items(), key=lambda kv: repr(kv[0])) for x in kv]
    elif isinstance(obj, types.CodeType):
        h.update(obj.co_code)
        parts = [obj.co_names, obj.co_consts]
    elif isinstance(obj, types.FunctionType):
        cells = [c.cell_contents for c in obj.__closure__ or () if _cell_filled(c)]
        parts = [obj.__module__, obj.__qualname__, obj.__code__, obj.__defaults__, cells]
        parts += [obj.__kwdefaults__, _data_globals(obj)]
    elif isinstance(obj, types.MethodType):
        parts = [obj.__func__, obj.__self__]
    elif isinstance(obj, functools.partial):
        parts = [obj.func, obj.args, obj.keywords]
    elif hasattr(obj, "__dict__"):
        parts = [x for k, x in sorted(vars(obj).items()) if not k.startswith("_") for x in (k, x)]
    else:  # a builtin or extension object: its qualified name is all that is stable
        parts = [getattr(obj, "__qualname__", getattr(obj, "__name__", ""))]
    h.update(f"[{len(parts)}]".encode())
    for x in parts:
        _feed(h, x, seen, depth + 1)


_DATA = (Tensor, bool, int, float, complex, str, bytes, list, tuple, dict)


def _data_globals(fn: types.FunctionType) -> list[object]:
    """The data (tensors, numbers, strings, containers) a function reads from its globals."""
    names = sorted({n for n in fn.__code__.co_names if n in fn.__globals__})
    values = [(n, fn.__globals__[n]) for n in names]
    return [x for n, value in values if isinstance(value, _DATA) for x in (n, value)]


def _cell_filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:  # an empty cell (a closure variable not yet assigned)
        return False
    return True


def _mask_fingerprint(mask: Mask | None) -> int:
    """A 63-bit hash of the mask's structure *and* contents (document ids, tensors, closures)."""
    h = hashlib.blake2b(digest_size=8)
    _feed(h, mask, set())
    return int.from_bytes(h.digest(), "little") >> 1


def _exchange_records(
    mine: Tensor, group, rank: int, world: int, timeout: datetime.timedelta | None
) -> Tensor:
    """Every rank's record ``(W, fields)``, exchanged point to point within ``timeout``.

    Point to point (not an all-gather) so that every wait has this call's deadline rather than
    the process group's, and a missing record names the peer that did not send it.
    """
    table = [mine if r == rank else torch.empty_like(mine) for r in range(world)]
    peers = [r for r in range(world) if r != rank]
    if not peers:
        return torch.stack(table)

    def glob(r: int) -> int:
        return r if group is None else dist.get_global_rank(group, r)

    ops = [dist.P2POp(dist.isend, mine, glob(p), group) for p in peers]
    ops += [dist.P2POp(dist.irecv, table[p], glob(p), group) for p in peers]
    try:
        works = dist.batch_isend_irecv(ops)
    except RuntimeError as e:
        raise RingAttentionError(rank, -1, peers[0], e) from e
    deadline = None if timeout is None else time.monotonic() + timeout.total_seconds()
    n = len(peers)
    for peer, work in [*zip(peers, works[n:], strict=True), *zip(peers, works[:n], strict=True)]:
        try:
            if deadline is None:
                ok = work.wait()
            else:
                left = max(deadline - time.monotonic(), 1e-3)
                ok = work.wait(datetime.timedelta(seconds=left))
        except RuntimeError as e:
            raise RingAttentionError(rank, -1, peer, e) from e
        if ok is False:
            raise RingAttentionError(rank, -1, peer, "timed out")
    return torch.stack(table)


def handshake(q: Tensor, k: Tensor, v: Tensor, cfg: RingConfig) -> None:
    """All ranks agree on shapes and configuration before any payload moves, or all raise."""
    causal, layout, scale, mask, pieces = cfg.causal, cfg.layout, cfg.scale, cfg.mask, cfg.pieces
    group, rank, world = cfg.group, cfg.rank, cfg.world
    record = [
        q.shape[2],
        q.shape[0],
        q.shape[1],
        k.shape[1],
        q.shape[3],
        v.shape[3],
        _DTYPES.index(q.dtype),
        int(causal),
        LAYOUTS.index(layout),
        zlib.crc32(repr(float(scale)).encode()),
        _mask_fingerprint(mask),
        k.shape[2],
        pieces,
    ]
    mine = torch.tensor(record, dtype=torch.int64)
    rows = _exchange_records(mine, group, rank, world, cfg.timeout)  # (W, fields)
    for f, name in enumerate(_FIELDS):
        column = rows[:, f]
        if bool((column == column[0]).all()):
            continue
        values, counts = column.unique(return_counts=True)
        majority = values[counts.argmax()] if counts.max() > 1 else column[0]
        bad = [r for r in range(world) if column[r] != majority]
        shown = [_DTYPES[int(x)] if name == "dtype" else int(x) for x in column]
        other = shown[0] if bad[0] else shown[1]
        detail = f"rank {bad[0]} has {shown[bad[0]]}, the others {other} (all ranks: {shown})"
        if name == "mask":  # the values are fingerprints of the masks' structure and contents
            detail = (
                f"rank {bad[0]} has a different mask (content fingerprints {shown}); "
                f"this rank ({rank}) has {mask!r}"
            )
        raise ValueError(f"ring attention: ranks disagree on {name}: {detail}")
    if k.shape[2] != q.shape[2]:
        raise ValueError(
            f"ring attention: local key length {k.shape[2]} must equal local query length "
            f"{q.shape[2]} (self-attention over one sharded sequence)"
        )


__all__ = ["Exchange", "Ring", "RingAttentionError", "RingConfig", "handshake"]
