"""Ring attention: exact attention over a sequence sharded across processes (torch.distributed).

Each rank holds a shard of the sequence — queries, keys and values ``(B, H, L_local, D)``. Key/value
blocks travel around the ring with non-blocking point-to-point ops (``batch_isend_irecv``) while
the rank computes attention of its queries against the block it holds; partial results combine
by log-sum-exp (`attnlab.merge_partials`), kept in float32 or wider. The backward pass is exact too:
it sends the key/value blocks around again together with their accumulating gradients, and the
block-wise backward of each step uses the *global* output and log-sum-exp, so the per-block
gradients sum to the exact gradient.

Layouts (``W`` ranks, global length ``N``):

- ``"contiguous"``: rank r holds positions ``[r·N/W, (r+1)·N/W)``.
- ``"zigzag"``: the sequence is cut into ``2W`` chunks and rank r holds chunks ``r`` and
  ``2W−1−r`` (concatenated), so under a causal mask every rank does the same amount of work.

Streaming: each layout chunk is cut into ``pieces`` equal pieces, and a block moves one piece at a
time — a piece is sent on while it is being used, and the piece that arrives replaces it — so
besides the block a rank holds only one piece per tensor in flight, and every kernel call and
its buffers are piece-sized. Backward, the finished gradients of the previous block travel in the
same messages as the key/value pieces, overlapped with the compute as well.

Communication per forward: exactly ``W − 1`` key/value rotations (``W − 1`` hops of every piece).
Before any payload, the ranks exchange a small metadata record (shapes, dtype, layout, causal
flag, scale, a fingerprint of the mask's contents, pieces) point to point; any disagreement
raises ``ValueError`` on every rank naming the rank and the field, instead of silently
reinterpreting bytes. A dead or stalled peer — during the handshake or at any hop — raises
`RingAttentionError` naming it, after at most ``timeout`` per exchange.

Non-finite inputs (the library's NaN rule) are handled with tensor ops only — no host syncs, no
extra messages: key/value pieces travel as given, and each rank cleans the piece it computes with
(``nan_to_num``) while it derives 0-or-NaN indicators (``x · 0``) of the non-finite keys (per
key) and value entries (per key and column). These are summed into a per-row poison tensor over
exactly the (query, key) pairs each tile attends (a sum for full tiles, a cumulative sum for
causal diagonal tiles, a 0/1 matmul for masked tiles); at the end, the rows and columns the rule
makes non-finite are set to NaN by subtracting ``|poison|`` (+0 elsewhere: bit-exact). Gradients
are those of the cleaned computation.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import math
import time
import types
import weakref
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from ..functional.flash import _kernel_bwd, _kernel_fwd
from ..functional.merge import merge_partials
from ..masks import Mask

LAYOUTS = ("contiguous", "zigzag")
_NEG_INF = float("-inf")


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


# --------------------------------------------------------------------------- layouts
def _world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "ring attention needs an initialised torch.distributed process group "
            "(dist.init_process_group(backend='gloo' on CPU, 'nccl' on GPU))"
        )
    return dist.get_rank(group), dist.get_world_size(group)


def chunk_ids(rank: int, world_size: int, layout: str) -> list[int]:
    """Global chunk indices a rank holds, in local order (chunks of ``N/W`` or ``N/2W``)."""
    if layout == "contiguous":
        return [rank]
    if layout == "zigzag":
        return [rank, 2 * world_size - 1 - rank]
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def _num_chunks(world_size: int, layout: str) -> int:
    return world_size * len(chunk_ids(0, world_size, layout))


def shard(
    x: Tensor, group: dist.ProcessGroup | None = None, layout: str = "contiguous", dim: int = -2
) -> Tensor:
    """This rank's shard of a full sequence ``x`` (the sequence along ``dim``).

    Raises:
        ValueError: the sequence length is not divisible by the number of chunks (W or 2W).
    """
    rank, world = _world(group)
    n = _num_chunks(world, layout)
    N = x.shape[dim]
    if N % n:
        raise ValueError(
            f"sequence length {N} must be divisible by {n} chunks (world size {world}, "
            f"layout {layout!r})"
        )
    chunks = x.chunk(n, dim=dim)
    return torch.cat([chunks[c] for c in chunk_ids(rank, world, layout)], dim=dim)


def unshard(
    x: Tensor, group: dist.ProcessGroup | None = None, layout: str = "contiguous", dim: int = -2
) -> Tensor:
    """Reassembles the full sequence from every rank's shard (an all-gather)."""
    _, world = _world(group)
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    per_rank = len(chunk_ids(0, world, layout))
    ordered: dict[int, Tensor] = {}
    for r, part in enumerate(parts):
        for c, piece in zip(
            chunk_ids(r, world, layout), part.chunk(per_rank, dim=dim), strict=True
        ):
            ordered[c] = piece
    return torch.cat([ordered[c] for c in sorted(ordered)], dim=dim)


# --------------------------------------------------------------------------- metadata handshake
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
        h.update(_tensor_digest(obj))
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


# Digests of mask tensors by id, recomputed only when the tensor changes in place (its _version);
# an entry goes when its tensor does. (Tensors cannot be dict keys: == is elementwise.)
_DIGESTS: dict[int, tuple[weakref.ref, int, bytes]] = {}


def _tensor_digest(x: Tensor) -> bytes:
    """A digest of a tensor's dtype, shape and contents (wherever it lives)."""
    cached = _DIGESTS.get(id(x))
    if cached is not None and cached[0]() is x and cached[1] == x._version:
        return cached[2]
    t = x.detach().reshape(-1).cpu().contiguous()
    h = hashlib.blake2b(f"{t.dtype}{tuple(x.shape)}".encode(), digest_size=16)
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    key = id(x)
    _DIGESTS[key] = (
        weakref.ref(x, lambda _, key=key: _DIGESTS.pop(key, None)),
        x._version,
        h.digest(),
    )
    return h.digest()


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


def _handshake(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool,
    layout: str,
    scale: float,
    mask: Mask | None,
    pieces: int,
    group,
    rank: int,
    world: int,
    timeout: datetime.timedelta | None,
) -> None:
    """All ranks agree on shapes and configuration before any payload moves, or all raise."""
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
    rows = _exchange_records(mine, group, rank, world, timeout)  # (W, fields)
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


# --------------------------------------------------------------------------- communication
@dataclass
class _Ring:
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

    def start(self, tensors: list[Tensor]) -> _Exchange:
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
        return _Exchange(self, hop, works, len(tensors), received)


@dataclass
class _Exchange:
    """One exchange in flight: ``works`` are its sends (the first ``sends``), then its receives.

    Calling it waits (only the first time) and returns the received tensors. Each finished
    operation is dropped at once, so a sent buffer is freed as soon as the caller lets go of it.
    """

    ring: _Ring
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


# --------------------------------------------------------------------------- block math
def _tile_relation(
    mask: Mask | None, causal: bool, q_id: int, k_id: int, C: int, N: int, B: int, H: int, device
) -> tuple[str, Tensor | None]:
    """How queries of piece q_id see keys of piece k_id: skip, full, causal or masked (a tile).

    Pieces are global: piece ``i`` holds positions ``[i·C, (i+1)·C)``.
    """
    if causal and q_id < k_id:
        return "skip", None
    if mask is None:
        return ("causal", None) if causal and q_id == k_id else ("full", None)
    b = torch.arange(B, device=device).view(-1, 1, 1, 1)
    h = torch.arange(H, device=device).view(1, -1, 1, 1)
    i = torch.arange(q_id * C, (q_id + 1) * C, device=device).view(1, 1, C, 1)
    j = torch.arange(k_id * C, (k_id + 1) * C, device=device).view(1, 1, 1, C)
    tile = mask._eval(b, h, i, j, N, N)
    if causal:
        tile = tile & (j <= i)
    if not bool(tile.any()):
        return "skip", None
    if bool(tile.all()):
        return "full", None
    return "masked", tile


def _expand_kv(t: Tensor, H: int) -> Tensor:
    H_kv = t.shape[1]
    return t if H_kv == H else t.repeat_interleave(H // H_kv, dim=1)  # (B, H, C, ·)


def _reduce_kv(g: Tensor, H_kv: int) -> Tensor:
    B, H, C, D = g.shape
    if g.shape[1] == H_kv:
        return g
    return g.view(B, H_kv, H // H_kv, C, D).sum(2)  # (B, H_kv, C, D)


def _use_kernel(q: Tensor) -> bool:
    return q.device.type == "cpu"


def _block_fwd(
    q: Tensor, k: Tensor, v: Tensor, kind: str, tile: Tensor | None, scale: float
) -> tuple[Tensor, Tensor]:
    """``(out (B, H, C, Dv), lse (B, H, C) float32+)`` of q against one key/value piece."""
    H = q.shape[1]
    k, v = _expand_kv(k, H), _expand_kv(v, H)
    add = None
    if tile is not None:
        add = torch.zeros(tile.shape, dtype=q.dtype, device=q.device).masked_fill(~tile, _NEG_INF)
    if _use_kernel(q):
        out, lse = _kernel_fwd(q, k, v, add, kind == "causal", scale)
    else:
        out, lse = _math_fwd(q, k, v, kind, add, scale)
    if tile is not None:  # the kernel reports lse = 0 for rows with nothing to attend
        dead = ~tile.any(-1).expand(lse.shape)
        lse = lse.masked_fill(dead, _NEG_INF)
    return out, lse


def _math_fwd(q, k, v, kind, add, scale):
    stat = torch.float64 if q.dtype == torch.float64 else torch.float32
    s = (q.to(stat) @ k.to(stat).transpose(-1, -2)) * scale  # (B, H, C, C)
    if kind == "causal":
        C = s.shape[-1]
        s = s.masked_fill(~torch.ones(C, C, dtype=torch.bool, device=s.device).tril(), _NEG_INF)
    if add is not None:
        s = s + add.to(stat)
    lse = torch.logsumexp(s, dim=-1)  # (B, H, C)
    p = torch.exp(s - lse.unsqueeze(-1).masked_fill(torch.isneginf(lse.unsqueeze(-1)), 0.0))
    return (p @ v.to(stat)).to(q.dtype), lse


def _block_bwd(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    kind: str,
    tile: Tensor | None,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of one block given the GLOBAL out and lse (rows with lse = −inf contribute 0)."""
    H, H_kv = q.shape[1], k.shape[1]
    ke, ve = _expand_kv(k, H), _expand_kv(v, H)
    add = None
    if tile is not None:
        add = torch.zeros(tile.shape, dtype=q.dtype, device=q.device).masked_fill(~tile, _NEG_INF)
    # A row that attends nothing anywhere has lse = −inf and a constant zero output: with lse
    # replaced by +inf its probabilities exp(s − lse) are exactly 0, so it contributes nothing.
    lse = lse.masked_fill(torch.isneginf(lse), math.inf)
    if _use_kernel(q):
        dq, dk, dv = _kernel_bwd(
            dout.contiguous(), q, ke, ve, out, lse, add, kind == "causal", scale
        )
    else:
        dq, dk, dv = _math_bwd(dout, q, ke, ve, out, lse, kind, add, scale)
    return dq, _reduce_kv(dk, H_kv), _reduce_kv(dv, H_kv)


def _math_bwd(dout, q, k, v, out, lse, kind, add, scale):
    stat = torch.float64 if q.dtype == torch.float64 else torch.float32
    s = (q.to(stat) @ k.to(stat).transpose(-1, -2)) * scale
    if kind == "causal":
        C = s.shape[-1]
        s = s.masked_fill(~torch.ones(C, C, dtype=torch.bool, device=s.device).tril(), _NEG_INF)
    if add is not None:
        s = s + add.to(stat)
    p = torch.exp(s - lse.to(stat).unsqueeze(-1))  # (B, H, C, C)
    do = dout.to(stat)
    dv = p.transpose(-1, -2) @ do
    dp = do @ v.to(stat).transpose(-1, -2)
    delta = (do * out.to(stat)).sum(-1, keepdim=True)
    ds = p * (dp - delta) * scale
    return (
        (ds @ k.to(stat)).to(q.dtype),
        (ds.transpose(-1, -2) @ q.to(stat)).to(q.dtype),
        dv.to(q.dtype),
    )


# --------------------------------------------------------------------------- the ring
@dataclass
class _Config:
    group: dist.ProcessGroup | None
    rank: int
    world: int
    causal: bool
    mask: Mask | None
    scale: float
    layout: str
    timeout: datetime.timedelta | None
    pieces: int  # parts per layout chunk; divides the chunk length

    def ring(self) -> _Ring:
        return _Ring(self.group, self.rank, self.world, self.timeout)

    def piece_ids(self, rank: int) -> list[int]:
        """Global indices of the pieces ``rank`` holds, in local order (all of one length)."""
        chunks = chunk_ids(rank, self.world, self.layout)
        return [c * self.pieces + j for c in chunks for j in range(self.pieces)]

    def owner(self, step: int) -> int:
        """The rank whose key/value block this rank holds at ring step ``step``."""
        return (self.rank - step) % self.world


def _piece_count(chunk_len: int, pieces: int) -> int:
    """The largest divisor of ``chunk_len`` that is at most ``pieces`` (so pieces are equal)."""
    return max(p for p in range(1, min(pieces, max(chunk_len, 1)) + 1) if chunk_len % p == 0)


def _queries_seeing(
    cfg: _Config, q: Tensor, key_id: int, c: int
) -> Iterator[tuple[int, str, Tensor | None]]:
    """(local query piece a, kind, tile) for each query piece of this rank that sees ``key_id``."""
    B, H, L, _ = q.shape
    N = L * cfg.world
    for a, q_id in enumerate(cfg.piece_ids(cfg.rank)):
        kind, tile = _tile_relation(cfg.mask, cfg.causal, q_id, key_id, c, N, B, H, q.device)
        if kind != "skip":
            yield a, kind, tile


def _stat_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _kv_pieces(k: Tensor, v: Tensor, c: int) -> list[list[Tensor]]:
    """The block ``[[k_p (B, H_kv, c, D), v_p (B, H_kv, c, Dv)], ...]``: views, no copy."""
    return [[kp, vp] for kp, vp in zip(k.split(c, dim=2), v.split(c, dim=2), strict=True)]


_Pieces = tuple[Tensor, ...]  # per-piece views of a local tensor, split along the sequence


def _clean(x: Tensor) -> Tensor:
    """``x`` with every non-finite entry replaced by 0 (finite entries kept bit-exact)."""
    return torch.nan_to_num(x, 0.0, 0.0, 0.0)


def _bad(x: Tensor) -> Tensor:
    """``x · 0``: 0 where ``x`` is finite, NaN where it is not (a float op: cheap, sync-free)."""
    return x * 0


def _reach(bad: Tensor, kind: str, tile: Tensor | None, H: int) -> Tensor:
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
            ind = _expand_kv(ind, H)
        hits = tile.to(torch.bfloat16) @ ind
    return torch.zeros(hits.shape, dtype=bad.dtype, device=bad.device).masked_fill(
        hits > 0, math.nan
    )


def _add_reach(acc: Tensor, reach: Tensor) -> None:
    """``acc (B, H, c, X) += reach`` with reach's ``H_kv`` heads broadcast over their groups."""
    H, H_r = acc.shape[1], reach.shape[1]
    if H_r == H:
        acc.add_(reach)
    else:
        acc.unflatten(1, (H_r, H // H_r)).add_(reach.unsqueeze(2))


def _forward_piece(
    cfg: _Config, q: Tensor, kv: list[Tensor], key_id: int, acc: tuple[_Pieces, ...]
) -> None:
    """Merges this rank's queries against one key/value piece into ``acc`` (in place).

    ``acc = (q, out, lse, poison)`` as pieces: the (cleaned) queries, the running result (float32
    or wider), and per row 0 or NaN: whether it has attended a non-finite value entry (columns
    ``:Dv``, per column) or a non-finite key (column ``Dv``) so far, ``(B, H, c, Dv + 1)``. ``kv``
    is the piece as sent — possibly non-finite; it is cleaned here, so nothing non-finite reaches
    the kernels.
    """
    qs, outs, lses, poison = acc
    bad = torch.cat([_bad(kv[1]), _bad(kv[0]).sum(-1, keepdim=True)], -1)  # (B, H_kv, c, Dv+1)
    k, v = _clean(kv[0]), _clean(kv[1])
    H = qs[0].shape[1]
    for a, kind, tile in _queries_seeing(cfg, q, key_id, qs[0].shape[2]):
        o, lse = _block_fwd(qs[a], k, v, kind, tile, cfg.scale)  # (B, H, c, Dv), (B, H, c)
        o, lse = merge_partials([outs[a], o], [lses[a], lse])
        outs[a].copy_(o)
        lses[a].copy_(lse)
        _add_reach(poison[a], _reach(bad, kind, tile, H))


def _ring_forward(q: Tensor, k: Tensor, v: Tensor, cfg: _Config) -> tuple[Tensor, ...]:
    """``(out, lse, clean_out, clean_lse)``: the results under the NaN rule, and on cleaned inputs.

    ``out (B, H, L, Dv)`` in q's dtype, ``lse (B, H, L)`` float32 or wider. Each key/value piece
    is sent on while it is used and replaced by the one that arrives, so besides the block only
    one piece per tensor is in flight. No host syncs: the non-finite handling is tensor ops.
    """
    B, H, L, _ = q.shape
    Dv = v.shape[-1]
    n = len(cfg.piece_ids(cfg.rank))
    c = L // n
    stat = _stat_dtype(q.dtype)
    out = q.new_zeros((B, H, L, Dv), dtype=stat)  # merged so far: nothing (lse = −inf)
    lse = q.new_full((B, H, L), _NEG_INF, dtype=stat)
    # 0, or NaN once a non-finite value entry (columns :Dv) or key (column Dv) is attended
    poison = q.new_zeros((B, H, L, Dv + 1))
    acc = tuple(t.split(c, dim=2) for t in (_clean(q), out, lse, poison))
    block = _kv_pieces(k, v, c)
    ring = cfg.ring()
    for step in range(cfg.world):
        ids = cfg.piece_ids(cfg.owner(step))
        for p in range(n):
            pending = ring.start(block[p]) if step < cfg.world - 1 else None  # overlap
            _forward_piece(cfg, q, block[p], ids[p], acc)
            block[p] = pending() if pending is not None else []
    out = out.to(q.dtype)
    # The NaN rule: a row that attends anything is NaN if its query or an attended key is not
    # finite; column d is NaN where an attended value is not finite there; dead rows stay zero.
    # Poison is 0 or NaN; subtracting |poison| (+0 or NaN) keeps every other value bit-exact.
    rows = (poison[..., Dv:] + _bad(q).sum(-1, keepdim=True)).masked_fill(
        torch.isneginf(lse).unsqueeze(-1), 0.0
    )  # (B, H, L, 1)
    nan_out = out - (poison[..., :Dv] + rows).abs()
    return nan_out, lse - rows.squeeze(-1).abs(), out, lse


def _backward_piece(
    cfg: _Config,
    q: Tensor,
    local: tuple[_Pieces, ...],
    kv: list[Tensor],
    key_id: int,
    incoming: Callable[[], list[Tensor]],
) -> list[Tensor]:
    """This rank's gradients against one key/value piece.

    ``local = (dout, q, out, lse, dq)`` as pieces; dQ is added into its pieces in place. Returns
    the piece's ``[dK, dV]`` (float32 or wider): ``incoming()`` — what earlier ranks accumulated,
    waited for only when there is something to add — plus this rank's share.
    """
    dos, qs, os_, ls, dqs = local
    grads = None
    for a, kind, tile in _queries_seeing(cfg, q, key_id, qs[0].shape[2]):
        g = _block_bwd(dos[a], qs[a], kv[0], kv[1], os_[a], ls[a], kind, tile, cfg.scale)
        dqs[a].add_(g[0])
        grads = incoming() if grads is None else grads
        grads[0].add_(g[1])
        grads[1].add_(g[2])
        del g  # freed before the next call allocates its own
    return incoming() if grads is None else grads


def _start_hop(ring: _Ring, kv: list[Tensor], grads: list[Tensor]) -> _Exchange | None:
    """Starts sending ``kv + grads`` on (and receiving their successors), if there are any."""
    outgoing = kv + grads
    return ring.start(outgoing) if outgoing else None


def _backward_hop(
    cfg: _Config,
    ring: _Ring,
    step: int,
    p: int,
    q: Tensor,
    local: tuple[_Pieces, ...],
    state: tuple[list[list[Tensor]], list[list[Tensor]]],
) -> None:
    """Piece ``p`` at ring step ``step`` of the backward pass; updates ``state`` in place.

    ``state = (block, grads)``: the key/value pieces held and the finished ``[dK, dV]`` pieces of
    the previous block. The key/value piece is sent on (W − 1 hops) together with the previous
    block's gradient piece (W hops, the last one home); this rank's share of the piece's gradients
    is computed while they travel.
    """
    block, grads = state
    moves_kv, moves_grads = step < cfg.world - 1, step > 0
    kv = block[p]
    exchange = _start_hop(ring, kv if moves_kv else [], grads[p] if moves_grads else [])
    grads[p] = []  # being sent: freed as soon as the send completes
    stat = _stat_dtype(q.dtype)

    def incoming() -> list[Tensor]:
        if not moves_grads:  # this rank is the first to see the block
            return [torch.zeros(t.shape, dtype=stat, device=t.device) for t in kv]
        assert exchange is not None
        return exchange()[-2:]

    if step < cfg.world:
        grads[p] = _backward_piece(cfg, q, local, kv, cfg.piece_ids(cfg.owner(step))[p], incoming)
    else:  # the last hop: these are this rank's own keys' and values' gradients
        grads[p] = incoming()
    block[p] = exchange()[:2] if moves_kv and exchange is not None else []


def _ring_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cfg: _Config
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of this rank's shard, in the inputs' dtypes."""
    n = len(cfg.piece_ids(cfg.rank))
    c = q.shape[2] // n
    dq = torch.zeros(q.shape, dtype=_stat_dtype(q.dtype), device=q.device)
    local = tuple(t.split(c, dim=2) for t in (dout, q, out, lse, dq))
    block = _kv_pieces(k, v, c)
    grads: list[list[Tensor]] = [[] for _ in range(n)]
    ring = cfg.ring()
    hops = cfg.world + 1 if cfg.world > 1 else 1  # W blocks, then the gradients' hop home
    for step in range(hops):
        for p in range(n):
            _backward_hop(cfg, ring, step, p, q, local, (block, grads))
    dk = torch.cat([g.pop(0) for g in grads], dim=2).to(k.dtype)  # pop: pieces freed once joined
    dv = torch.cat([g.pop(0) for g in grads], dim=2).to(v.dtype)
    return dq.to(q.dtype), dk, dv


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, cfg: _Config):  # type: ignore[override]
        out, lse, clean_out, clean_lse = _ring_forward(q, k, v, cfg)
        # The inputs are saved as given (no copies kept) and cleaned again in backward.
        ctx.save_for_backward(q, k, v, clean_out, clean_lse)
        ctx.cfg = cfg
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout: Tensor, _dlse: Tensor):  # type: ignore[override]
        if torch.is_grad_enabled():
            raise RuntimeError(
                "ring attention does not support double backward (create_graph=True)"
            )
        q, k, v, out, lse = ctx.saved_tensors
        # The NaN rule: gradients are those of the computation on the cleaned inputs.
        q, k, v = _clean(q), _clean(k), _clean(v)
        dq, dk, dv = _ring_backward(dout, q, k, v, out, lse, ctx.cfg)
        return dq, dk, dv, None


def _check_pieces(pieces: object) -> int:
    if isinstance(pieces, bool) or not isinstance(pieces, int):
        raise TypeError(f"pieces must be an int, got {type(pieces).__name__}")
    if pieces < 1:
        raise ValueError(f"pieces must be >= 1, got {pieces}")
    return pieces


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    causal: bool = False,
    mask: Mask | None = None,
    scale: float | None = None,
    layout: str = "contiguous",
    pieces: int = 2,
    timeout: float | None = None,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Exact attention over a sequence sharded across the ranks of ``group``.

    ``out = softmax(q kᵀ · scale + mask) v`` over the *global* sequence, each rank computing its own
    queries' rows; equal to `attnlab.attention` on the unsharded tensors (then sharded).

    Non-finite inputs follow the library's NaN rule, exactly as one process would: row i depends
    only on q_i and the keys/values it may attend (by ``causal`` and ``mask``, over global
    positions). A non-finite q_i or attended k_j makes the whole row NaN (and its lse NaN); a
    non-finite attended v_j[d] makes o_i[d] NaN and leaves the other columns exact; a non-finite
    entry anywhere else — another document, a later causal position, another rank's keys the
    row does not attend — never reaches row i, and a row that attends nothing is zeros (lse −inf)
    even when q_i is NaN. For a finite ``dout`` the gradients are those of the computation on
    the cleaned inputs (non-finite entries replaced by 0), so they are finite. This is done with
    tensor ops on every rank — no host syncs, no extra messages.

    Args:
        q: this rank's queries ``(B, H, L_local, D)``.
        k: this rank's keys ``(B, H_kv, L_local, D)`` (``H % H_kv == 0``).
        v: this rank's values ``(B, H_kv, L_local, Dv)``.
        group: the process group (default: the world).
        causal: causal over global positions (keys at positions <= the query's).
        mask: an `attnlab.masks.Mask` over global positions (combined with ``causal``).
        scale: default ``1/√D``.
        layout: ``"contiguous"`` or ``"zigzag"`` (see the module docstring and `shard`).
        pieces: how many equal pieces each of the rank's layout chunks (one for
            ``"contiguous"``, two for ``"zigzag"``) is cut into; a block travels and is computed
            one piece at a time. Memory beyond the shards, the travelling key/value block and its
            gradient accumulators — the one piece per tensor in flight and the buffers of each
            kernel call — shrinks as ``1/pieces``; the cost is more, smaller messages and calls.
            Lowered to the largest divisor of the chunk length when it does not divide it; every
            rank must pass the same value. The result depends on it only through floating-point
            rounding (partials merge in a different order).
        timeout: seconds to wait for a peer at each exchange — the metadata handshake before
            the first hop included (default: the process group's timeout).
        return_lse: also return the log-sum-exp ``(B, H, L_local)`` (float32 or wider).

    Returns:
        ``out (B, H, L_local, Dv)`` in q's dtype, or ``(out, lse)``.

    Raises:
        RuntimeError: no initialised process group, or a backend that cannot carry these tensors.
        TypeError: ``pieces`` is not an int.
        ValueError: bad shapes or ``pieces < 1``, or ranks that disagree on shapes, dtype or
            configuration (including the mask's contents, compared by a fingerprint of its
            structure, tensors and the closures of mask functions).
        RingAttentionError: a peer died or stalled past ``timeout``.
    """
    from .._shapes import check_number, check_qkv

    rank, world = _world(group)
    dims = check_qkv(q, k, v)
    if dims.three_d:
        raise ValueError(
            f"ring_attention expects 4-D (B, H, L_local, D) inputs, got {tuple(q.shape)}"
        )
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if mask is not None and not isinstance(mask, Mask):
        raise TypeError(
            f"mask must be an attnlab Mask (over global positions), got {type(mask).__name__}"
        )
    backend = dist.get_backend(group)
    if q.device.type == "cpu" and backend not in ("gloo", "mpi"):
        raise RuntimeError(
            f"CPU tensors need the gloo (or mpi) backend, but the group uses {backend!r}"
        )
    n_local = len(chunk_ids(0, world, layout))
    if dims.L % n_local:
        raise ValueError(
            f"local length {dims.L} must be divisible by {n_local} (layout {layout!r} holds "
            f"{n_local} chunks per rank)"
        )
    pieces = _piece_count(dims.L // n_local, _check_pieces(pieces))
    scale = 1.0 / math.sqrt(dims.D) if scale is None else check_number("scale", scale, nonzero=True)
    tmo = None
    if timeout is not None:
        tmo = datetime.timedelta(seconds=check_number("timeout", timeout, positive=True))
    _handshake(q, k, v, causal, layout, scale, mask, pieces, group, rank, world, tmo)
    cfg = _Config(group, rank, world, bool(causal), mask, scale, layout, tmo, pieces)
    # torch's CPU kernel reads the last dim with unit stride: copy only inputs where it is not so
    q, k, v = (t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out, lse = _RingAttention.apply(q, k, v, cfg)
    return (out, lse) if return_lse else out
