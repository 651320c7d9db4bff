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

Communication per forward: exactly ``W − 1`` key/value rotations. Before any payload, the ranks
exchange a small metadata record (shapes, dtype, layout, causal flag, scale, mask); any
disagreement raises ``ValueError`` on every rank naming the rank and the field, instead of
silently reinterpreting bytes. A dead or stalled peer raises `RingAttentionError` naming it.
"""

from __future__ import annotations

import datetime
import math
import zlib
from collections.abc import Callable
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
        rank: this rank. hop: the ring step (0-based). peer: the rank we were exchanging with.
    """

    def __init__(self, rank: int, hop: int, peer: int, cause: BaseException | str) -> None:
        super().__init__(
            f"ring attention on rank {rank}: exchange with peer rank {peer} failed at hop {hop}: "
            f"{cause}"
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
)
_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]


def _handshake(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool,
    layout: str,
    scale: float,
    mask: Mask | None,
    group,
    rank: int,
    world: int,
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
        zlib.crc32(repr(mask).encode()),
        k.shape[2],
    ]
    mine = torch.tensor(record, dtype=torch.int64)
    table = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(table, mine, group=group)
    rows = torch.stack(table)  # (W, fields)
    for f, name in enumerate(_FIELDS):
        column = rows[:, f]
        if bool((column == column[0]).all()):
            continue
        values, counts = column.unique(return_counts=True)
        majority = values[counts.argmax()] if counts.max() > 1 else column[0]
        bad = [r for r in range(world) if column[r] != majority]
        shown = [_DTYPES[int(x)] if name == "dtype" else int(x) for x in column]
        raise ValueError(
            f"ring attention: ranks disagree on {name}: rank {bad[0]} has "
            f"{shown[bad[0]]}, the others {shown[0] if bad[0] else shown[1]} "
            f"(all ranks: {shown})"
        )
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

    def start(self, tensors: list[Tensor]) -> Callable[[], list[Tensor]]:
        """Sends ``tensors`` to the next rank and receives the previous rank's, non-blocking.

        Returns a function that waits and returns the received tensors.
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
        n = len(tensors)

        def wait() -> list[Tensor]:
            for idx, work in enumerate(works):
                peer = self.send_to if idx < n else self.recv_from
                try:
                    ok = work.wait(self.timeout) if self.timeout is not None else work.wait()
                except RuntimeError as e:
                    raise RingAttentionError(self.rank, hop, peer, e) from e
                if ok is False:
                    raise RingAttentionError(self.rank, hop, peer, "timed out")
            return received

        return wait


# --------------------------------------------------------------------------- block math
def _tile_relation(
    mask: Mask | None, causal: bool, q_id: int, k_id: int, C: int, N: int, B: int, H: int, device
) -> tuple[str, Tensor | None]:
    """How queries of chunk q_id see keys of chunk k_id: skip, full, causal or masked (a tile)."""
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
    """``(out (B, H, C, Dv), lse (B, H, C) float32+)`` of q against one key/value chunk."""
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

    def ring(self) -> _Ring:
        return _Ring(self.group, self.rank, self.world, self.timeout)


def _pairs(cfg: _Config, q: Tensor, owner: int, C: int):
    """(query chunk a, key chunk b, kind, tile) for this rank's queries vs ``owner``'s block."""
    B, H, L, _ = q.shape
    N = L * cfg.world
    q_ids = chunk_ids(cfg.rank, cfg.world, cfg.layout)
    k_ids = chunk_ids(owner, cfg.world, cfg.layout)
    for a, qid in enumerate(q_ids):
        for b, kid in enumerate(k_ids):
            kind, tile = _tile_relation(cfg.mask, cfg.causal, qid, kid, C, N, B, H, q.device)
            if kind != "skip":
                yield a, b, kind, tile


def _stat_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _forward_block(
    cfg: _Config, q: Tensor, q_chunks, k: Tensor, v: Tensor, owner: int, C: int, acc: list
) -> None:
    """Merges this rank's queries against ``owner``'s block into ``acc`` (float32 or wider)."""
    stat = _stat_dtype(q.dtype)
    ks, vs = k.split(C, dim=2), v.split(C, dim=2)
    for a, b, kind, tile in _pairs(cfg, q, owner, C):
        o, lse = _block_fwd(q_chunks[a], ks[b], vs[b], kind, tile, cfg.scale)
        o, lse = o.to(stat), lse.to(stat)
        acc[a] = (o, lse) if acc[a] is None else merge_partials([acc[a][0], o], [acc[a][1], lse])


def _backward_block(
    cfg: _Config, q: Tensor, local: tuple, block: tuple, owner: int, C: int
) -> None:
    """Adds the gradients of this rank's queries against ``owner``'s block (in place)."""
    dos, qs, os_, ls, dqs = local
    k, v, dk, dv = block
    ks, vs = k.split(C, dim=2), v.split(C, dim=2)
    dks, dvs = dk.split(C, dim=2), dv.split(C, dim=2)
    for a, b, kind, tile in _pairs(cfg, q, owner, C):
        g_q, g_k, g_v = _block_bwd(
            dos[a], qs[a], ks[b], vs[b], os_[a], ls[a], kind, tile, cfg.scale
        )
        dqs[a].add_(g_q)
        dks[b].add_(g_k)
        dvs[b].add_(g_v)


def _ring_forward(q: Tensor, k: Tensor, v: Tensor, cfg: _Config) -> tuple[Tensor, Tensor]:
    B, H, L, _ = q.shape
    n_local = len(chunk_ids(0, cfg.world, cfg.layout))
    C = L // n_local
    stat = _stat_dtype(q.dtype)
    q_chunks = q.split(C, dim=2)
    acc: list[tuple[Tensor, Tensor] | None] = [None] * n_local
    ring = cfg.ring()
    k_cur, v_cur, owner = k, v, cfg.rank
    for step in range(cfg.world):
        pending = ring.start([k_cur, v_cur]) if step < cfg.world - 1 else None  # overlap
        _forward_block(cfg, q, q_chunks, k_cur, v_cur, owner, C, acc)
        if pending is not None:
            k_cur, v_cur = pending()
            owner = (owner - 1) % cfg.world
    outs, lses = [], []
    for part in acc:
        if part is None:  # these queries attend to nothing at all
            outs.append(q.new_zeros(B, H, C, v.shape[-1], dtype=stat))
            lses.append(q.new_full((B, H, C), _NEG_INF, dtype=stat))
        else:
            outs.append(part[0])
            lses.append(part[1])
    return torch.cat(outs, dim=2).to(q.dtype), torch.cat(lses, dim=2)


def _ring_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cfg: _Config
) -> tuple[Tensor, Tensor, Tensor]:
    L = q.shape[2]
    n_local = len(chunk_ids(0, cfg.world, cfg.layout))
    C = L // n_local
    stat = _stat_dtype(q.dtype)
    qs, dos, os_, ls = (t.split(C, dim=2) for t in (q, dout, out, lse))
    dq = torch.zeros(q.shape, dtype=stat, device=q.device)
    dqs = dq.split(C, dim=2)
    ring = cfg.ring()
    k_cur, v_cur, owner = k, v, cfg.rank
    dk_cur = torch.zeros(k.shape, dtype=stat, device=k.device)
    dv_cur = torch.zeros(v.shape, dtype=stat, device=v.device)
    for step in range(cfg.world):
        pending_kv = ring.start([k_cur, v_cur]) if step < cfg.world - 1 else None
        _backward_block(cfg, q, (dos, qs, os_, ls, dqs), (k_cur, v_cur, dk_cur, dv_cur), owner, C)
        if pending_kv is not None:  # first let the previous block go, then move its gradients
            k_cur, v_cur = pending_kv()
            owner = (owner - 1) % cfg.world
        if cfg.world > 1:  # the block's gradients travel with it; the last hop takes them home
            dk_cur, dv_cur = ring.start([dk_cur, dv_cur])()
    return dq.to(q.dtype), dk_cur.to(k.dtype), dv_cur.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, cfg: _Config):  # type: ignore[override]
        out, lse = _ring_forward(q, k, v, cfg)
        ctx.save_for_backward(q, k, v, out, lse)
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
        dq, dk, dv = _ring_backward(dout, q, k, v, out, lse, ctx.cfg)
        return dq, dk, dv, None


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
    timeout: float | None = None,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Exact attention over a sequence sharded across the ranks of ``group``.

    ``out = softmax(q kᵀ · scale + mask) v`` over the *global* sequence, each rank computing its own
    queries' rows; equal to `attnlab.attention` on the unsharded tensors (then sharded).

    Args:
        q: this rank's queries ``(B, H, L_local, D)``.
        k: this rank's keys ``(B, H_kv, L_local, D)`` (``H % H_kv == 0``).
        v: this rank's values ``(B, H_kv, L_local, Dv)``.
        group: the process group (default: the world).
        causal: causal over global positions (keys at positions <= the query's).
        mask: an `attnlab.masks.Mask` over global positions (combined with ``causal``).
        scale: default ``1/√D``.
        layout: ``"contiguous"`` or ``"zigzag"`` (see the module docstring and `shard`).
        timeout: seconds to wait for a peer at each hop (default: the process group's timeout).
        return_lse: also return the log-sum-exp ``(B, H, L_local)`` (float32 or wider).

    Returns:
        ``out (B, H, L_local, Dv)`` in q's dtype, or ``(out, lse)``.

    Raises:
        RuntimeError: no initialised process group, or a backend that cannot carry these tensors.
        ValueError: bad shapes, or ranks that disagree on shapes, dtype or configuration.
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
    scale = 1.0 / math.sqrt(dims.D) if scale is None else check_number("scale", scale, nonzero=True)
    tmo = None
    if timeout is not None:
        tmo = datetime.timedelta(seconds=check_number("timeout", timeout, positive=True))
    _handshake(q, k, v, causal, layout, scale, mask, group, rank, world)
    cfg = _Config(group, rank, world, bool(causal), mask, scale, layout, tmo)
    # torch's CPU kernel reads the last dim with unit stride: copy only inputs where it is not so
    q, k, v = (t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out, lse = _RingAttention.apply(q, k, v, cfg)
    return (out, lse) if return_lse else out
