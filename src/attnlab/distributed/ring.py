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

Modules: `ring_layout` (layouts, `shard`, `unshard`), `ring_comm` (the point-to-point ring and
the metadata handshake), `ring_blocks` (one piece against one piece, on the engines of
`functional.flash`, and the NaN rule's reach); this module drives the ring forward and backward.
"""

from __future__ import annotations

import datetime
import functools
import math
import operator
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from .._shapes import check_int, check_number, check_qkv, stat_dtype
from ..functional.flash import Residuals
from ..functional.merge import merge_partials
from ..masks import CausalMask, Mask
from ..masks.patterns import with_causal
from .ring_blocks import (
    add_reach,
    block_backward,
    block_forward,
    clean,
    nan_flags,
    reach,
    tile_relation,
)
from .ring_comm import Exchange, Ring, RingAttentionError, RingConfig, handshake
from .ring_layout import LAYOUTS, chunk_ids, rank_and_world, shard, unshard

_NEG_INF = float("-inf")


def split_causal(mask: Mask | None) -> tuple[bool, Mask | None]:
    """``(causal, rest)`` with ``mask = causal() & rest``: the causal factor runs as the kernels'
    own causal diagonal, the rest through its block map (None: nothing else)."""
    if mask is None:
        return False, None
    parts = mask.conjuncts()
    rest = [m for m in parts if not isinstance(m, CausalMask)]
    if len(rest) == len(parts):
        return False, mask
    return True, functools.reduce(operator.and_, rest) if rest else None


def _piece_count(chunk_len: int, pieces: int) -> int:
    """The largest divisor of ``chunk_len`` that is at most ``pieces`` (so pieces are equal)."""
    return max(p for p in range(1, min(pieces, max(chunk_len, 1)) + 1) if chunk_len % p == 0)


def _queries_seeing(
    cfg: RingConfig, q: Tensor, key_id: int, c: int
) -> Iterator[tuple[int, str, Tensor | None]]:
    """(local query piece a, kind, tile) for each query piece of this rank that sees ``key_id``."""
    B, H, L, _ = q.shape
    N = L * cfg.world
    for a, q_id in enumerate(cfg.piece_ids(cfg.rank)):
        kind, tile = tile_relation(q_id, key_id, cfg=cfg, C=c, N=N, B=B, H=H, device=q.device)
        if kind != "skip":
            yield a, kind, tile


def _kv_pieces(k: Tensor, v: Tensor, c: int) -> list[list[Tensor]]:
    """The block ``[[k_p (B, H_kv, c, D), v_p (B, H_kv, c, Dv)], ...]``: views, no copy."""
    return [[kp, vp] for kp, vp in zip(k.split(c, dim=2), v.split(c, dim=2), strict=True)]


_Pieces = tuple[Tensor, ...]  # per-piece views of a local tensor, split along the sequence


def _forward_piece(
    cfg: RingConfig, q: Tensor, kv: list[Tensor], key_id: int, acc: tuple[_Pieces, ...]
) -> None:
    """Merges this rank's queries against one key/value piece into ``acc`` (in place).

    ``acc = (q, out, lse, poison)`` as pieces: the (cleaned) queries, the running result (float32
    or wider), and per row 0 or NaN: whether it has attended a non-finite value entry (columns
    ``:Dv``, per column) or a non-finite key (column ``Dv``) so far, ``(B, H, c, Dv + 1)``. ``kv``
    is the piece as sent — possibly non-finite; it is cleaned here, so nothing non-finite reaches
    the kernels.
    """
    qs, outs, lses, poison = acc
    flags = [nan_flags(kv[1]), nan_flags(kv[0]).sum(-1, keepdim=True)]
    bad = torch.cat(flags, -1)  # (B, H_kv, c, Dv + 1)
    k, v = clean(kv[0]), clean(kv[1])
    H = qs[0].shape[1]
    for a, kind, tile in _queries_seeing(cfg, q, key_id, qs[0].shape[2]):
        o, lse = block_forward(qs[a], k, v, kind=kind, tile=tile, scale=cfg.scale)  # (B, H, c, ·)
        o, lse = merge_partials([outs[a], o], [lses[a], lse])
        outs[a].copy_(o)
        lses[a].copy_(lse)
        add_reach(poison[a], reach(bad, kind, tile, H))


def _ring_forward(q: Tensor, k: Tensor, v: Tensor, cfg: RingConfig) -> tuple[Tensor, ...]:
    """``(out, lse, clean_out, clean_lse)``: the results under the NaN rule, and on cleaned inputs.

    ``out (B, H, L, Dv)`` in q's dtype, ``lse (B, H, L)`` float32 or wider. Each key/value piece
    is sent on while it is used and replaced by the one that arrives, so besides the block only
    one piece per tensor is in flight. No host syncs: the non-finite handling is tensor ops.
    """
    B, H, L, _ = q.shape
    Dv = v.shape[-1]
    n = len(cfg.piece_ids(cfg.rank))
    c = L // n
    stat = stat_dtype(q.dtype)
    out = q.new_zeros((B, H, L, Dv), dtype=stat)  # merged so far: nothing (lse = −inf)
    lse = q.new_full((B, H, L), _NEG_INF, dtype=stat)
    # 0, or NaN once a non-finite value entry (columns :Dv) or key (column Dv) is attended
    poison = q.new_zeros((B, H, L, Dv + 1))
    acc = tuple(t.split(c, dim=2) for t in (clean(q), out, lse, poison))
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
    rows = (poison[..., Dv:] + nan_flags(q).sum(-1, keepdim=True)).masked_fill(
        torch.isneginf(lse).unsqueeze(-1), 0.0
    )  # (B, H, L, 1)
    nan_out = out - (poison[..., :Dv] + rows).abs()
    return nan_out, lse - rows.squeeze(-1).abs(), out, lse


def _backward_piece(
    cfg: RingConfig,
    *,
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
        res = Residuals(dout=dos[a], q=qs[a], k=kv[0], v=kv[1], out=os_[a], lse=ls[a])
        g = block_backward(res, kind=kind, tile=tile, scale=cfg.scale)
        dqs[a].add_(g[0])
        grads = incoming() if grads is None else grads
        grads[0].add_(g[1])
        grads[1].add_(g[2])
        del g  # freed before the next call allocates its own
    return incoming() if grads is None else grads


def _start_hop(ring: Ring, kv: list[Tensor], grads: list[Tensor]) -> Exchange | None:
    """Starts sending ``kv + grads`` on (and receiving their successors), if there are any."""
    outgoing = kv + grads
    return ring.start(outgoing) if outgoing else None


def _backward_hop(
    cfg: RingConfig,
    ring: Ring,
    *,
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
    stat = stat_dtype(q.dtype)

    def incoming() -> list[Tensor]:
        if not moves_grads:  # this rank is the first to see the block
            return [torch.zeros(t.shape, dtype=stat, device=t.device) for t in kv]
        assert exchange is not None
        return exchange()[-2:]

    if step < cfg.world:
        key_id = cfg.piece_ids(cfg.owner(step))[p]
        grads[p] = _backward_piece(cfg, q=q, local=local, kv=kv, key_id=key_id, incoming=incoming)
    else:  # the last hop: these are this rank's own keys' and values' gradients
        grads[p] = incoming()
    block[p] = exchange()[:2] if moves_kv and exchange is not None else []


def _ring_backward(res: Residuals, cfg: RingConfig) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of this rank's shard, in the inputs' dtypes (``res`` holds the shard's
    cleaned inputs and its GLOBAL clean out and lse)."""
    dout, q, k, v, out, lse = res.dout, res.q, res.k, res.v, res.out, res.lse
    n = len(cfg.piece_ids(cfg.rank))
    c = q.shape[2] // n
    dq = torch.zeros(q.shape, dtype=stat_dtype(q.dtype), device=q.device)
    local = tuple(t.split(c, dim=2) for t in (dout, q, out, lse, dq))
    block = _kv_pieces(k, v, c)
    grads: list[list[Tensor]] = [[] for _ in range(n)]
    ring = cfg.ring()
    hops = cfg.world + 1 if cfg.world > 1 else 1  # W blocks, then the gradients' hop home
    for step in range(hops):
        for p in range(n):
            _backward_hop(cfg, ring, step=step, p=p, q=q, local=local, state=(block, grads))
    dk = torch.cat([g.pop(0) for g in grads], dim=2).to(k.dtype)  # pop: pieces freed once joined
    dv = torch.cat([g.pop(0) for g in grads], dim=2).to(v.dtype)
    return dq.to(q.dtype), dk, dv


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, cfg: RingConfig):  # type: ignore[override]
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
        q, k, v = clean(q), clean(k), clean(v)
        res = Residuals(dout=dout, q=q, k=k, v=v, out=out, lse=lse)
        dq, dk, dv = _ring_backward(res, ctx.cfg)
        return dq, dk, dv, None


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    mask: Mask | None = None,
    scale: float | None = None,
    layout: str = "contiguous",
    pieces: int = 2,
    timeout: float | None = None,
    return_lse: bool = False,
    causal: bool | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Exact attention over a sequence sharded across the ranks of ``group``.

    ``out = softmax(q kᵀ · scale + mask) v`` over the *global* sequence, each rank computing its own
    queries' rows; equal to `attnlab.attention` on the unsharded tensors (then sharded).

    Non-finite inputs follow the library's NaN rule, exactly as one process would: row i depends
    only on q_i and the keys/values it may attend (by ``mask``, over global positions). A
    non-finite q_i or attended k_j makes the whole row NaN (and its lse NaN); a non-finite
    attended v_j[d] makes o_i[d] NaN and leaves the other columns exact; a non-finite
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
        mask: any `attnlab.masks.Mask` over global positions (``masks.causal()``: keys at
            positions <= the query's), or None. Its block map (`Mask.block_map`, tiles of one
            piece) decides which pieces meet: empty tiles are skipped, full ones run unmasked,
            a causal factor runs as the kernels' own causal diagonal.
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
        causal: deprecated, use ``mask=masks.causal()`` (combined with other masks by ``&``).

    Returns:
        ``out (B, H, L_local, Dv)`` in q's dtype, or ``(out, lse)``.

    Raises:
        RuntimeError: no initialised process group, or a backend that cannot carry these tensors.
        TypeError: ``pieces`` is not an int, ``mask`` is not a Mask.
        ValueError: bad shapes or ``pieces < 1``, or ranks that disagree on shapes, dtype or
            configuration (including the mask's contents, compared by a fingerprint of its
            structure, tensors and the closures of mask functions).
        RingAttentionError: a peer died or stalled past ``timeout``.
    """
    rank, world = rank_and_world(group)
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
    mask = with_causal(mask, causal, where="ring_attention")
    is_causal, rest = split_causal(mask)
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
    pieces = _piece_count(dims.L // n_local, check_int("pieces", pieces, minimum=1))
    scale = 1.0 / math.sqrt(dims.D) if scale is None else check_number("scale", scale, nonzero=True)
    tmo = None
    if timeout is not None:
        tmo = datetime.timedelta(seconds=check_number("timeout", timeout, positive=True))
    cfg = RingConfig(group, rank, world, is_causal, rest, scale, layout, tmo, pieces)
    handshake(q, k, v, cfg)
    # torch's CPU kernel reads the last dim with unit stride: copy only inputs where it is not so
    q, k, v = (t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out, lse = _RingAttention.apply(q, k, v, cfg)
    return (out, lse) if return_lse else out


__all__ = [
    "LAYOUTS",
    "Ring",
    "RingAttentionError",
    "chunk_ids",
    "ring_attention",
    "shard",
    "unshard",
]
