"""Batched band calls (sliding windows): all interior query blocks in one kernel call.

A `BandCall` covers query blocks ``t0..t1`` of ``bq`` rows; block t sees the key window
``[k_start + t·bq, … + W)``. The blocks whose window lies inside the keys run as ONE kernel call
over strided views (no copy) with one shared additive tile; the edge blocks run one by one on
their clipped windows. Only the kernel engine runs batched band calls (the torch engine runs
`BandCall.block_calls`); the batched forward runs on attnlab's C++ band kernel
(`band_kernel`) when it is available, else on torch's fused kernel. Batched segments (packed
documents, `SegmentCall`) run the same way: attnlab's C++ segment kernel, else one strided call
of torch's kernel per batch item.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from . import band_kernel
from .calls import BandCall, SegmentCall
from .engines import BandTiles, Logits, Residuals, fix_dead_rows, kernel_backward, kernel_forward

Store = Callable[[Tensor, Tensor, Tensor, Tensor], None]
"""``store(out_rows, lse_rows, o, l)``: writes (or merges) a call's result into the output."""


def _copy(out: Tensor, lse: Tensor, o: Tensor, l: Tensor) -> None:
    out.copy_(o)
    lse.copy_(l)


def interior(c: BandCall, add: Tensor) -> tuple[BandCall | None, Tensor]:
    """The batched part of a band call (blocks whose window is in range) and its tile."""
    if c.inner is None:
        return None, add
    ta, tb = c.inner_blocks
    if add.dim() == 4 and add.shape[0] > 1:
        add = add[ta - c.t0 : tb - c.t0]
    return c.inner, add


def edges(c: BandCall, add: Tensor) -> Iterator[tuple[int, slice, tuple[int, int], Tensor]]:
    """``(t, rows, (j0, j1), tile)`` of every block whose window leaves the keys."""
    for t, k0, k1 in c.edges:
        j0, j1 = max(0, k0), min(c.key_limit, k1)
        if j1 <= j0:
            continue
        tile = add[t - c.t0 : t - c.t0 + 1] if add.dim() == 4 and add.shape[0] > 1 else add
        yield t, slice(t * c.bq, (t + 1) * c.bq), (j0, j1), tile[..., j0 - k0 : j1 - k0]


def blocks(t: Tensor, b: int, c: BandCall) -> Tensor:
    """``t[b, :, rows of c]`` viewed as ``(nblk, H, bq, ·)`` (works for lse's 3-D too)."""
    x = t[b, :, c.r0 : c.r1].unflatten(1, (c.t1 - c.t0, c.bq))  # (H, nblk, bq, ·)
    return x.transpose(0, 1)


def windows(t: Tensor, b: int, c: BandCall) -> Tensor:
    """Overlapping key windows ``(nblk, H_kv, W, ·)`` of ``t[b]``: a strided view, no copy."""
    nblk = c.t1 - c.t0
    sB, sH, sS, sD = t.stride()
    return t.as_strided(
        (nblk, t.shape[1], c.width, t.shape[3]),
        (c.bq * sS, sH, sS, sD),
        t.storage_offset() + b * sB + c.k_start * sS,
    )


def band_forward(
    c: BandCall,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    tiles: BandTiles,
    scale: float,
    out: Tensor,
    lse: Tensor,
    store: Store | None = None,
    own: bool = True,
    softcap: float | None = None,
    keys: Tensor | None = None,
    sinks: Tensor | None = None,
) -> None:
    """Runs a batched band call on the kernel into ``out (B, H, L, Dv)`` and ``lse (B, H, L)``.

    ``store`` merges a call's rows into the output (overlapping plans); None writes them (the
    C++ band kernel then writes straight into ``out``). ``own``: attnlab's C++ band kernel may
    run (`FlashJob.own_kernel`: False when it never does on this dtype and CPU). Inputs are
    finite (`nan_rule.clean`), so the batched call is always possible. ``softcap``: soft-capped
    logits, which only attnlab's C++ kernel applies (the job takes this path for them only when
    it runs every call: `plan.softcap_on_kernel`); so does a key mask ``keys (B|1, S)`` bool
    (`BandCall.keyed`), and attention sinks ``sinks (H,)`` float32 folded into each row's
    denominator (`band_kernel`; rows written in place: ``store`` None).
    """
    put = store or _copy
    folded = {} if sinks is None else {"sinks": sinks}  # (the operator's signature without)
    native = own and band_kernel.usable(q, k, v, c.bq)  # every block, edges too, in one C++ call
    assert native or softcap is None, "soft-capped logits need attnlab's C++ band kernel"
    assert native or keys is None, "a key mask needs attnlab's C++ band kernel"
    assert sinks is None or (native and store is None), "sinks need the C++ kernel, in place"
    for b in range(c.b0, c.b1):
        add = tiles.tile(c, b, q.device)
        if native:
            o_rows, l_rows = blocks(out, b, c), blocks(lse, b, c)
            o, l = (
                (o_rows, l_rows)
                if store is None
                else (torch.empty_like(o_rows), torch.empty_like(l_rows))
            )
            kb = None if keys is None else keys[b if keys.shape[0] > 1 else 0]
            band_kernel.forward_into(o, l, q[b], k[b], v[b], add, c, scale, softcap, kb, **folded)
            if store is not None:
                store(o_rows, l_rows, o, l)
            continue
        inner, add_in = interior(c, add)
        if inner is not None:
            o, l = kernel_forward(
                blocks(q, b, inner),
                windows(k, b, inner),
                windows(v, b, inner),
                Logits(scale, add_in),
            )
            if add.dim() == 4:  # a bias may mask whole rows
                o, l = fix_dead_rows(o, l, add_in)
            put(blocks(out, b, inner), blocks(lse, b, inner), o, l)
        for _, rows, (j0, j1), tile in edges(c, add):
            bs = slice(b, b + 1)
            o, l = kernel_forward(
                q[bs, :, rows], k[bs, :, j0:j1], v[bs, :, j0:j1], Logits(scale, tile)
            )
            o, l = fix_dead_rows(o, l, tile)
            put(out[bs, :, rows], lse[bs, :, rows], o, l)


def band_backward(
    c: BandCall,
    res: Residuals,
    *,
    tiles: BandTiles,
    scale: float,
    grads: tuple[Tensor, Tensor, Tensor],
    whole: bool = False,
    own: bool = True,
    keys: Tensor | None = None,
) -> None:
    """Adds the gradients of a batched band call into ``grads = (dq, dk, dv)`` (kernel engine).

    ``res`` holds the whole tensors ``(B, …)``; its lse is +inf on rows with no key. ``whole``:
    the call holds every key of its rows, so attnlab's C++ backward forms δ from each row's own
    ``Σ P·dP`` (`band_kernel.backward_into`); torch's kernel always reads ``rowsum(dout ⊙ out)``
    (and cannot read a key mask ``keys``: a keyed call needs the C++ backward).
    """
    dq, dk, dv = grads
    native = own and band_kernel.backward_usable(res.q, res.k, res.v, res.out, res.dout)
    assert native or keys is None, "a key mask needs attnlab's C++ band backward"
    for b in range(c.b0, c.b1):
        add = tiles.tile(c, b, res.q.device)
        if native:  # every block, edges too, in one C++ call
            parts = (res.q[b], res.k[b], res.v[b], res.out[b], res.dout[b], res.lse[b])
            kb = None if keys is None else keys[b if keys.shape[0] > 1 else 0]
            grads_b = (dq[b], dk[b], dv[b])
            delta = None if res.delta is None else res.delta[b]
            kw = {"whole": whole, "keys": kb} | ({} if delta is None else {"delta": delta})
            band_kernel.backward_into(grads_b, parts, add, c, scale, **kw)
            continue
        inner, add_in = interior(c, add)
        if inner is not None:
            _interior_backward(inner, res, b, Logits(scale, add_in), grads)
        for _, rows, (j0, j1), tile in edges(c, add):
            bs = slice(b, b + 1)
            part = Residuals(
                dout=res.dout[bs, :, rows],
                q=res.q[bs, :, rows],
                k=res.k[bs, :, j0:j1],
                v=res.v[bs, :, j0:j1],
                out=res.out[bs, :, rows],
                lse=res.lse[bs, :, rows],
            )
            gq, gk, gv = kernel_backward(part, Logits(scale, tile))
            dq[bs, :, rows] += gq
            dk[bs, :, j0:j1] += gk
            dv[bs, :, j0:j1] += gv


def _interior_backward(
    c: BandCall, res: Residuals, b: int, logits: Logits, grads: tuple[Tensor, Tensor, Tensor]
) -> None:
    """Backward of the batched blocks; overlapping windows' dK/dV are added piece by piece."""
    dq, dk, dv = grads
    nblk, nc = c.t1 - c.t0, c.width // c.bq
    part = Residuals(
        dout=blocks(res.dout, b, c),
        q=blocks(res.q, b, c),
        k=windows(res.k, b, c),
        v=windows(res.v, b, c),
        out=blocks(res.out, b, c),
        lse=blocks(res.lse, b, c),
    )
    gq, gk, gv = kernel_backward(part, logits)
    blocks(dq, b, c).add_(gq)
    # window t, piece j covers key block (t + j) of the region starting at k_start
    span = (nblk + nc - 1) * c.bq
    for grad, acc in ((gk, dk), (gv, dv)):
        region = acc[b, :, c.k_start : c.k_start + span].unflatten(1, (nblk + nc - 1, c.bq))
        for j in range(nc):
            piece = grad[:, :, j * c.bq : (j + 1) * c.bq]  # (nblk, H_kv, bq, ·)
            region[:, j : j + nblk] += piece.transpose(0, 1)


def segments(t: Tensor, b: int, c: SegmentCall) -> Tensor:
    """``t[b]``'s positions of ``c`` viewed as ``(count, H, n, ·)`` (3-D lse too): no copy."""
    st = t.stride()
    size = (c.count, t.shape[1], c.n, *t.shape[3:])
    stride = (c.n * st[2], st[1], st[2], *st[3:])
    return t.as_strided(size, stride, t.storage_offset() + b * st[0] + c.start * st[2])


def segment_forward(
    c: SegmentCall,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float,
    out: Tensor,
    lse: Tensor,
    own: bool = True,
    softcap: float | None = None,
    keys: Tensor | None = None,
    sinks: Tensor | None = None,
) -> None:
    """Runs batched segments (packed documents) on the kernel, one call per batch item: attnlab's
    C++ kernel when it takes them (``own`` and `band_kernel.segments_usable`), else torch's
    (which cannot soft-cap: ``softcap`` needs the C++ kernel, and cannot read a key mask:
    ``keys (B|1, S)`` bool of a keyed call needs it too, nor fold attention sinks ``sinks (H,)``
    float32 into the rows' denominators)."""
    if own and band_kernel.segments_usable(q, k, v, c.n):
        for b in range(c.b0, c.b1):
            kb = None if keys is None else keys[b if keys.shape[0] > 1 else 0]
            args = (out[b], lse[b], q[b], k[b], v[b], c, scale, softcap, kb)
            band_kernel.segments_into(*args, **({} if sinks is None else {"sinks": sinks}))
        return
    assert softcap is None, "soft-capped logits need attnlab's C++ segment kernel"
    assert sinks is None, "sinks need attnlab's C++ segment kernel"
    assert keys is None, "a key mask needs attnlab's C++ segment kernel"
    logits = Logits(scale, causal=c.causal)
    for b in range(c.b0, c.b1):
        o, l = kernel_forward(segments(q, b, c), segments(k, b, c), segments(v, b, c), logits)
        segments(out, b, c).copy_(o)
        segments(lse, b, c).copy_(l)


def segment_backward(
    c: SegmentCall,
    res: Residuals,
    *,
    scale: float,
    grads: tuple[Tensor, Tensor, Tensor],
    own: bool = True,
    keys: Tensor | None = None,
) -> None:
    """Adds the gradients of batched segments into ``grads = (dq, dk, dv)`` (kernel engine):
    attnlab's C++ kernel (`band_kernel.segments_backward_into`) where ``own`` and
    `band_kernel.segments_backward_usable`, else torch's (not with a key mask ``keys``)."""
    dq, dk, dv = grads
    xs = (res.q, res.k, res.v, res.out, res.dout)
    if own and band_kernel.segments_backward_usable(*xs, c.n):
        for b in range(c.b0, c.b1):
            parts = (res.q[b], res.k[b], res.v[b], res.out[b], res.dout[b], res.lse[b])
            kb = None if keys is None else keys[b if keys.shape[0] > 1 else 0]
            delta = {} if res.delta is None else {"delta": res.delta[b]}
            band_kernel.segments_backward_into((dq[b], dk[b], dv[b]), parts, c, scale, kb, **delta)
        return
    assert keys is None, "a key mask needs attnlab's C++ segment kernel"
    logits = Logits(scale, causal=c.causal)
    for b in range(c.b0, c.b1):
        part = Residuals(
            *(segments(x, b, c) for x in (res.dout, res.q, res.k, res.v, res.out)),
            lse=segments(res.lse, b, c),
        )
        for grad, g in zip(grads, kernel_backward(part, logits), strict=True):
            segments(grad, b, c).add_(g)


__all__ = [
    "band_backward",
    "band_forward",
    "blocks",
    "edges",
    "interior",
    "segment_backward",
    "segment_forward",
    "segments",
    "windows",
]
