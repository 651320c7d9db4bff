"""Packed variable-length attention with paged KV, exact on any device: torch's `varlen_attn`.

``torch.nn.attention.varlen.varlen_attn`` (and flash-attn's ``flash_attn_varlen_func``) run only
on CUDA. `varlen_attn` takes the same arguments and means the same thing, on attnlab's backends:

- ``query (T_q, H, D)``, ``key``/``value (T_k, H_kv, D|Dv)`` hold N sequences back to back;
  sequence b owns query rows ``cu_seq_q[b] : cu_seq_q[b + 1]`` (``L_q`` of them) and key rows
  ``cu_seq_k[b] : cu_seq_k[b + 1]`` (``L_k``; only the first ``seqused_k[b]`` when given).
- With ``block_table``, key and value are a pool of pages ``(num_pages, page_size, H_kv, D)``
  and sequence b's key ``j`` is row ``j % page_size`` of page ``block_table[b, j // page_size]``
  (``seqused_k[b]`` keys; ``cu_seq_k`` is not read).
- Query ``i`` of a sequence sits at key position ``p = i + L_k − L_q`` (bottom-right, as
  flash-attn) and attends keys ``p − left <= j <= p + right`` of its own sequence,
  ``window_size = (left, right)``, −1 = unbounded: ``(-1, -1)`` full, ``(-1, 0)`` causal.

No sequence is padded to the longest, memory is O(T): the whole batch is ONE call of the
tiled backend (``flash``) over the packed grid. Self-attention packing (``cu_seq_q`` equal to
``cu_seq_k``) runs with ``masks.document.from_cu_seqlens(cu_seq_q) & masks.window(left,
right)`` — causal or full, batched segment calls (consecutive documents of one length in one
kernel call); other batches (cross-attention, ``seqused_k``, pages) with
``masks.IntervalMask``: each query row's run of keys ``[lo, hi)``, its sequence's window, so
the block map skips every tile between sequences.

The work runs inside the custom operators ``attnlab::varlen_attn`` / ``varlen_attn_backward``
(like torch's own ``torch_attn::_varlen_attn``): they read the sequence bounds on the host, so
``torch.compile(fullgraph=True)`` traces one opaque call. The backward is the tiled backend's
(every tile recomputed from the saved output and lse, exact) and gives gradients to query, key
and value — also through ``seqused_k`` and a ``block_table`` (into the pages, summed where
sequences share one), where torch's is inference-only.

Defined to equal `reference_varlen_attn` (float64-capable, one `reference.attention` per
sequence with the dense window mask).
"""

from __future__ import annotations

import itertools
import math
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .. import masks

__all__ = [
    "AuxRequest",
    "disable",
    "enable",
    "enabled",
    "reference_varlen_attn",
    "varlen_attn",
    "varlen_attn_out",
]


class AuxRequest(NamedTuple):
    """Which auxiliary outputs `varlen_attn` returns (torch's ``AuxRequest`` works too)."""

    lse: bool = False


class _Seq(NamedTuple):
    """One sequence: query rows ``[q0, q0 + m)``, key rows ``[k0, k0 + n)`` of the packed keys."""

    q0: int
    m: int
    k0: int
    n: int


# ---------------------------------------------------------------- argument checks
def _check_args(q: Tensor, k: Tensor, v: Tensor, cu_q, cu_k, max_q, max_k, opts: dict) -> None:
    """Shape, dtype and device checks (no value read): raise naming argument and values."""
    paged = opts["block_table"] is not None
    if paged and opts["seqused_k"] is None:
        raise ValueError("varlen_attn: block_table requires seqused_k (the keys of each sequence)")
    for name, t in (("query", q), ("key", k), ("value", v), ("cu_seq_q", cu_q)):
        if not isinstance(t, Tensor):
            raise TypeError(f"varlen_attn: {name} must be a Tensor, got {type(t).__name__}")
    kdim = 4 if paged else 3
    if q.dim() != 3:
        raise ValueError(f"varlen_attn: query must be (T_q, H, D), got shape {tuple(q.shape)}")
    for name, t in (("key", k), ("value", v)):
        if t.dim() != kdim:
            want = "(num_pages, page_size, H_kv, D)" if paged else "(T_k, H_kv, D)"
            raise ValueError(f"varlen_attn: {name} must be {want}, got shape {tuple(t.shape)}")
    if k.shape[:-1] != v.shape[:-1] or k.shape[-1] != q.shape[-1]:
        raise ValueError(
            f"varlen_attn: key must match query's head dim and value's other dims, got query "
            f"{tuple(q.shape)}, key {tuple(k.shape)}, value {tuple(v.shape)}"
        )
    if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
        raise TypeError(
            f"varlen_attn: query, key and value must share one floating dtype, got "
            f"{q.dtype}, {k.dtype}, {v.dtype}"
        )
    H, H_kv = q.shape[1], k.shape[-2]
    if not opts["enable_gqa"] and H_kv != H:
        raise ValueError(
            f"varlen_attn: query has H={H} heads and key/value H_kv={H_kv}: pass "
            "enable_gqa=True for grouped-query attention"
        )
    if H_kv == 0 or H % H_kv:
        raise ValueError(f"varlen_attn: H={H} must be a multiple of H_kv={H_kv}")
    _check_index_args(q, cu_q, cu_k, max_q, max_k, opts)


def _check_index_args(q: Tensor, cu_q: Tensor, cu_k, max_q, max_k, opts: dict) -> None:
    used, table = opts["seqused_k"], opts["block_table"]
    if table is None and not isinstance(cu_k, Tensor):
        raise TypeError(f"varlen_attn: cu_seq_k must be a Tensor, got {type(cu_k).__name__}")
    named = [("cu_seq_q", cu_q), ("cu_seq_k", cu_k), ("seqused_k", used), ("block_table", table)]
    for name, t in named:
        if t is None:
            continue
        if t.dtype not in (torch.int32, torch.int64) or t.device != q.device:
            raise ValueError(
                f"varlen_attn: {name} must be int32 or int64 on {q.device}, got {t.dtype} on "
                f"{t.device}"
            )
    N = cu_q.numel() - 1
    want = {"cu_seq_q": (N + 1,), "cu_seq_k": (N + 1,), "seqused_k": (N,)}
    for name, t in named[:3]:
        if t is not None and (t.dim() != 1 or N < 0 or tuple(t.shape) != want[name]):
            raise ValueError(
                f"varlen_attn: {name} must have shape {want[name]} (N = {N} sequences from "
                f"cu_seq_q), got {tuple(t.shape)}"
            )
    if table is not None and (table.dim() != 2 or table.shape[0] != N):
        raise ValueError(
            f"varlen_attn: block_table must be (N, max_pages) with N={N}, got {tuple(table.shape)}"
        )
    for name, n in (("max_q", max_q), ("max_k", max_k)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"varlen_attn: {name} must be an int >= 0, got {n!r}")
    w = opts["window_size"]
    if (
        not isinstance(w, (tuple, list))
        or len(w) != 2
        or any(isinstance(x, bool) or not isinstance(x, int) or x < -1 for x in w)
    ):
        raise ValueError(f"varlen_attn: window_size must be (left, right) ints >= -1, got {w!r}")
    splits = opts["num_splits"]
    if splits is not None and (
        isinstance(splits, bool) or not isinstance(splits, int) or splits < 1
    ):
        raise ValueError(f"varlen_attn: num_splits must be None or an int >= 1, got {splits!r}")
    s = opts["scale"]
    if s is not None and (isinstance(s, bool) or not math.isfinite(float(s)) or s == 0):
        raise ValueError(f"varlen_attn: scale must be a finite non-zero float, got {s!r}")


def _bounds(name: str, cu: list[int], total: int, longest: int, what: str) -> None:
    if cu[0] != 0 or any(b < a for a, b in itertools.pairwise(cu)) or cu[-1] != total:
        raise ValueError(
            f"varlen_attn: {name} must start at 0, not decrease and end at {what}={total}, got "
            f"{_short(cu)}"
        )
    lengths = [b - a for a, b in itertools.pairwise(cu)]
    if lengths and max(lengths) > longest:
        raise ValueError(
            f"varlen_attn: a sequence of {max(lengths)} rows in {name} exceeds its max ({longest})"
        )


def _short(xs: list[int]) -> str:
    return str(xs) if len(xs) <= 8 else f"[{xs[0]}, {xs[1]}, {xs[2]}, ..., {xs[-1]}] ({len(xs)})"


# ---------------------------------------------------------------- the sequences
def _sequences(q, k, cu_q, cu_k, used, table, max_q, max_k) -> tuple[list[_Seq], Tensor | None]:
    """The sequences (host-read bounds, checked), and the key rows of the pages (paged KV)."""
    cq = cu_q.tolist()
    _bounds("cu_seq_q", cq, q.shape[0], max_q, "T_q")
    N = len(cq) - 1
    if table is None:
        ck = cu_k.tolist()
        _bounds("cu_seq_k", ck, k.shape[0], max_k, "T_k")
        n = [ck[b + 1] - ck[b] for b in range(N)]
        starts = ck[:-1]
    else:
        starts, n = [], []
    if used is not None:
        u = used.tolist()
        cap = n if table is None else [table.shape[1] * k.shape[1]] * N
        bad = [b for b in range(N) if not 0 <= u[b] <= min(cap[b], max_k)]
        if bad:
            b = bad[0]
            raise ValueError(
                f"varlen_attn: seqused_k[{b}] = {u[b]} must be in [0, {min(cap[b], max_k)}] "
                f"(its sequence's keys and max_k)"
            )
        n = u
    rows = None
    if table is not None:
        rows, starts = _page_rows(table, n, k.shape[1], k.shape[0])
    seqs = [_Seq(cq[b], cq[b + 1] - cq[b], starts[b], n[b]) for b in range(N)]
    return seqs, rows


def _page_rows(table: Tensor, n: list[int], page: int, pages: int) -> tuple[Tensor, list[int]]:
    """Rows of the flattened page pool ``(pages·page_size,)`` holding each sequence's keys, in
    sequence order, and where each sequence's keys start among them."""
    dev = table.device
    nb = torch.tensor(n, dtype=torch.long, device=dev)  # (N,)
    need = torch.arange(table.shape[1], device=dev) < (nb + page - 1).div(
        page, rounding_mode="floor"
    ).view(-1, 1)
    ids = table.long()
    bad = need & ((ids < 0) | (ids >= pages))
    if bool(bad.any()):
        b = int(bad.any(1).nonzero()[0])
        raise ValueError(
            f"varlen_attn: block_table[{b}] names pages {ids[b][need[b]].tolist()}, the pool has "
            f"{pages}"
        )
    slots = (ids.unsqueeze(-1) * page + torch.arange(page, device=dev)).flatten(1)  # (N, P·page)
    keep = torch.arange(slots.shape[1], device=dev) < nb.view(-1, 1)  # the first n[b] keys
    starts = [0, *itertools.accumulate(n)][:-1]
    return slots[keep], starts


def _packed_self(seqs: list[_Seq]) -> bool:
    """Self-attention packing: every sequence's keys are its own query rows."""
    return all(s.q0 == s.k0 and s.m == s.n for s in seqs)


class _Call(NamedTuple):
    """One tiled-backend call: query rows ``[q0, q0 + m)``, key rows ``[k0, k0 + n)``, a mask."""

    q0: int
    m: int
    k0: int
    n: int
    spec: str
    tensors: list[Tensor]


def _plan(q, k, cu_q, cu_k, used, table, max_q, max_k, left, right):
    """``(calls, rows)``: the backend calls, and the pool rows of paged keys (or None)."""
    seqs, rows = _sequences(q, k, cu_q, cu_k, used, table, max_q, max_k)
    window = masks.window(left, right)
    if table is None and used is None and _packed_self(seqs) and q.shape[0] > 0:
        # self-attention packing: ONE call, documents & window (segment calls when causal/full)
        spec, tensors = (masks.document.from_cu_seqlens(cu_q.long()) & window).spec()
        return [_Call(0, q.shape[0], 0, q.shape[0], spec, tensors)], rows
    # otherwise ONE call over the packed grid, each row's run of keys as an interval
    lo, hi = _intervals(seqs, q.shape[0], left, right, q.device)
    T_k = k.shape[0] if rows is None else rows.numel()
    spec, tensors = masks.IntervalMask(lo, hi, T_k).spec()
    return [_Call(0, q.shape[0], 0, T_k, spec, tensors)], rows


def _intervals(seqs: list[_Seq], T: int, left: int, right: int, device) -> tuple[Tensor, Tensor]:
    """Each query row's keys ``[lo, hi)`` in the packed keys: its sequence's window."""

    def as_t(xs: list[int]) -> Tensor:
        return torch.tensor(xs, dtype=torch.long, device=device)

    m, n = as_t([s.m for s in seqs]), as_t([s.n for s in seqs])
    b = torch.repeat_interleave(torch.arange(len(seqs), device=device), m)  # (T,) sequence of row
    q0, k0, nb = as_t([s.q0 for s in seqs])[b], as_t([s.k0 for s in seqs])[b], n[b]
    p = torch.arange(T, device=device) - q0 + (n - m)[b]  # aligned key position, bottom-right
    a = torch.zeros_like(p) if left < 0 else torch.minimum((p - left).clamp(min=0), nb)
    e = nb if right < 0 else torch.minimum((p + right + 1).clamp(min=0), nb)
    return k0 + a, k0 + torch.maximum(a, e)


def _heads_first(x: Tensor, r0: int, n: int) -> Tensor:
    return x[r0 : r0 + n].transpose(0, 1)[None].contiguous()  # (1, heads, n, dim)


def _forward(q, k, v, cu_q, cu_k, used, table, max_q, max_k, scale, left, right):
    """``(out (T_q, H, Dv), lse (H, T_q), touched)``: the flash operator on each call."""
    from .flash import ops

    calls, rows = _plan(q, k, cu_q, cu_k, used, table, max_q, max_k, left, right)
    if rows is not None:  # paged KV: the sequences' keys, gathered once (O(T_k))
        k = k.flatten(0, 1).index_select(0, rows)  # (T_k, H_kv, D)
        v = v.flatten(0, 1).index_select(0, rows)  # (T_k, H_kv, Dv)
    T, H = q.shape[0], q.shape[1]
    out = q.new_zeros(T, H, v.shape[-1])  # rows of no call: zeros, lse −inf
    lse = torch.full((H, T), -math.inf, dtype=_stat(q), device=q.device)
    touched = torch.zeros((), dtype=torch.bool, device=q.device)
    for c in calls:
        qc, kc, vc = (
            _heads_first(q, c.q0, c.m),
            _heads_first(k, c.k0, c.n),
            _heads_first(v, c.k0, c.n),
        )
        o, l, t = ops.flash_fwd(qc, kc, vc, c.tensors, None, None, c.spec, scale, None, None)
        out[c.q0 : c.q0 + c.m] = o[0].transpose(0, 1)
        lse[:, c.q0 : c.q0 + c.m] = l[0]
        touched |= t.to(q.device)
    return out, lse, touched


def _stat(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


# ---------------------------------------------------------------- the operators
@torch.library.custom_op("attnlab::varlen_attn", mutates_args=())
def _varlen_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_q: Tensor,
    cu_k: Tensor | None,
    used: Tensor | None,
    table: Tensor | None,
    max_q: int,
    max_k: int,
    scale: float,
    left: int,
    right: int,
) -> tuple[Tensor, Tensor, Tensor]:
    return _forward(q, k, v, cu_q, cu_k, used, table, max_q, max_k, scale, left, right)


@_varlen_op.register_fake
def _varlen_fake(q, k, v, *_rest):  # noqa: ARG001 (a fake kernel takes the op's arguments)
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    lse = q.new_empty(q.shape[1], q.shape[0], dtype=_stat(q))
    return out, lse, q.new_empty((), dtype=torch.bool)


@torch.library.custom_op("attnlab::varlen_attn_backward", mutates_args=())
def _varlen_backward_op(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    touched: Tensor,
    cu_q: Tensor,
    cu_k: Tensor | None,
    used: Tensor | None,
    table: Tensor | None,
    max_q: int,
    max_k: int,
    scale: float,
    left: int,
    right: int,
) -> tuple[Tensor, Tensor, Tensor]:
    from .flash import ops

    calls, rows = _plan(q, k, cu_q, cu_k, used, table, max_q, max_k, left, right)
    kk, vv = k, v
    if rows is not None:
        kk, vv = k.flatten(0, 1).index_select(0, rows), v.flatten(0, 1).index_select(0, rows)
    acc = _stat(q)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(kk.shape, dtype=acc, device=q.device)
    dv = torch.zeros(vv.shape, dtype=acc, device=q.device)
    for c in calls:
        qc, kc, vc = (
            _heads_first(q, c.q0, c.m),
            _heads_first(kk, c.k0, c.n),
            _heads_first(vv, c.k0, c.n),
        )
        oc, doc = _heads_first(out, c.q0, c.m), _heads_first(dout, c.q0, c.m)
        lc = lse[None, :, c.q0 : c.q0 + c.m].contiguous()
        rest = (c.tensors, None, None, c.spec, scale, None, None)
        g = ops.flash_bwd(doc, None, qc, kc, vc, oc, lc, touched, *rest)
        dq[c.q0 : c.q0 + c.m] += g[0][0].transpose(0, 1)
        dk[c.k0 : c.k0 + c.n] += g[1][0].transpose(0, 1)
        dv[c.k0 : c.k0 + c.n] += g[2][0].transpose(0, 1)
    if rows is not None:  # back into the pages (a page shared by sequences sums)
        pool_k = torch.zeros(k.flatten(0, 1).shape, dtype=acc, device=q.device)
        pool_v = torch.zeros(v.flatten(0, 1).shape, dtype=acc, device=q.device)
        dk = pool_k.index_add_(0, rows, dk).view(k.shape)
        dv = pool_v.index_add_(0, rows, dv).view(v.shape)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@_varlen_backward_op.register_fake
def _varlen_backward_fake(dout, q, k, v, *_rest):  # noqa: ARG001 (the op's arguments)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, cu_q, cu_k, used, table, *ints = inputs
    out, lse, touched = output
    ctx.save_for_backward(q, k, v, out, lse, touched, cu_q, cu_k, used, table)
    ctx.ints = ints
    ctx.mark_non_differentiable(lse, touched)


def _backward(ctx: Any, dout: Tensor, _dlse: Tensor, _dt: Tensor) -> tuple:
    saved = ctx.saved_tensors
    grads = _varlen_backward_op(dout.contiguous(), *saved, *ctx.ints)
    return (*grads, *([None] * 9))


_varlen_op.register_autograd(_backward, setup_context=_setup)


# ---------------------------------------------------------------- the public function
def varlen_attn(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    cu_seq_q: Tensor,
    cu_seq_k: Tensor | None,
    max_q: int,
    max_k: int,
    *,
    return_aux: Any = None,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    enable_gqa: bool = False,
    seqused_k: Tensor | None = None,
    block_table: Tensor | None = None,
    num_splits: int | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    r"""Variable-length attention over packed sequences, torch's ``varlen_attn`` on any device.

    For sequence b with query rows ``Q_b (L_q, H, D)`` and keys ``K_b, V_b (L_k, H_kv, D|Dv)``::

        out[rows of b] = softmax(Q_b · K_bᵀ · scale + M_b) · V_b     (per head; K, V of head h // G)
        M_b[i, j] = 0 if p − left <= j <= p + right else −inf,  p = i + L_k − L_q

    (−1 drops that bound). A row with no key gets zeros (and lse −inf). Sequences never see each
    other, and NaN in one never reaches another (the NaN rule).

    Args:
        query: ``(T_q, H, D)``, the N sequences' queries back to back.
        key: ``(T_k, H_kv, D)``, or a page pool ``(num_pages, page_size, H_kv, D)`` with
            ``block_table``.
        value: like ``key`` with head dim ``Dv``.
        cu_seq_q: ``(N + 1,)`` int32/int64, ``[0, L_q0, L_q0 + L_q1, …, T_q]``.
        cu_seq_k: ``(N + 1,)`` likewise for the keys (``T_k``); ignored (may be None) with
            ``block_table``.
        max_q, max_k: the longest query / key sequence (checked against the bounds).
        return_aux: ``AuxRequest(lse=True)`` (torch's or attnlab's) also returns the
            log-sum-exp ``(H, T_q)``, float32 (float64 for float64 inputs), −inf on rows with no
            key — torch's kernel's layout (its docstring says ``(T_q, H)``; its fake says
            ``(H, T_q)``). Not differentiable, as in torch.
        scale: logit multiplier; default ``1/√D``.
        window_size: ``(left, right)``, each >= 0 or −1 (unbounded).
        enable_gqa: allow ``H_kv < H`` (``H % H_kv == 0``; query head h reads key head
            ``h // (H / H_kv)``).
        seqused_k: ``(N,)``: sequence b uses only its first ``seqused_k[b]`` keys (its
            ``L_k``). Required with ``block_table``.
        block_table: ``(N, max_pages)`` int: sequence b's key ``j`` is row ``j % page_size`` of
            page ``block_table[b, j // page_size]``.
        num_splits: torch's split-KV knob; accepted and ignored (attnlab's result does not
            depend on the batch's other sequences).

    Returns:
        ``out (T_q, H, Dv)`` in the input dtype, or ``(out, lse)`` when ``return_aux.lse``.

    Raises:
        ValueError/TypeError: a bad argument, naming it with the expected and received value
            (cu_seq bounds, lengths above max_q/max_k, seqused_k, pages are read and checked
            on every call, before any work).

    Example:
        >>> import torch, attnlab
        >>> from attnlab.functional.varlen import varlen_attn
        >>> cu = torch.tensor([0, 3, 8])
        >>> q, k, v = torch.randn(3, 8, 2, 16).unbind(0)
        >>> varlen_attn(q, k, v, cu, cu, 5, 5, window_size=(-1, 0)).shape
        torch.Size([8, 2, 16])
    """
    opts = {
        "enable_gqa": enable_gqa,
        "seqused_k": seqused_k,
        "block_table": block_table,
        "window_size": window_size,
        "scale": scale,
        "num_splits": num_splits,
    }
    _check_args(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, opts)
    s = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    left, right = window_size
    out, lse, _ = _varlen_op(
        query,
        key,
        value,
        cu_seq_q,
        cu_seq_k if block_table is None else None,
        seqused_k,
        block_table,
        max_q,
        max_k,
        s,
        left,
        right,
    )
    if return_aux is not None and getattr(return_aux, "lse", False):
        return out, lse
    return out


def varlen_attn_out(out: Tensor, *args: Any, **kwargs: Any) -> Tensor | tuple[Tensor, Tensor]:
    """`varlen_attn` written into ``out`` ``(T_q, H, Dv)`` (torch's ``varlen_attn_out``)."""
    res = varlen_attn(*args, **kwargs)
    o = res[0] if isinstance(res, tuple) else res
    if out.shape != o.shape:
        raise ValueError(
            f"varlen_attn_out: out must have shape {tuple(o.shape)}, got {tuple(out.shape)}"
        )
    out.copy_(o)
    return (out, res[1]) if isinstance(res, tuple) else out


# ---------------------------------------------------------------- the reference
def reference_varlen_attn(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    cu_seq_q: Tensor,
    cu_seq_k: Tensor | None,
    *,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    seqused_k: Tensor | None = None,
    block_table: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The definition of `varlen_attn`: `reference.attention` per sequence, dense window mask.

    Runs in the inputs' dtype (float64 for verification). Returns ``(out (T_q, H, Dv), lse
    (H, T_q))``; sequences with no key give zero rows and lse −inf.
    """
    from . import reference

    T, H = query.shape[:2]
    out = query.new_zeros(T, H, value.shape[-1])
    lse = torch.full((H, T), -math.inf, dtype=query.dtype, device=query.device)
    cq = cu_seq_q.tolist()
    page = key.shape[1] if block_table is not None else 0
    for b in range(len(cq) - 1):
        q0, m = cq[b], cq[b + 1] - cq[b]
        if block_table is not None:
            n = int(seqused_k[b])
            pages = block_table[b, : -(-n // page)].long()
            kb, vb = (x[pages].flatten(0, 1)[:n] for x in (key, value))
        else:
            k0 = int(cu_seq_k[b])
            n = int(cu_seq_k[b + 1]) - k0 if seqused_k is None else int(seqused_k[b])
            kb, vb = key[k0 : k0 + n], value[k0 : k0 + n]
        if m == 0 or n == 0:
            continue
        dense = masks.window(*window_size).to_dense(m, n)[0, 0]  # (L_q, L_k)
        qb = query[q0 : q0 + m].transpose(0, 1)[None]  # (1, H, L_q, D)
        kb, vb = kb.transpose(0, 1)[None], vb.transpose(0, 1)[None]  # (1, H_kv, L_k, D)
        o, _ = reference.attention(qb, kb, vb, mask=dense, scale=scale)
        out[q0 : q0 + m] = o[0].transpose(0, 1)
        lse[:, q0 : q0 + m] = reference.logsumexp(qb, kb, mask=dense, scale=scale)[0]
    return out, lse


# ---------------------------------------------------------------- torch's function on CPU
_SAVED: dict[str, Any] = {}


class _Enabled:
    """`enable`'s handle: ``with attnlab.functional.varlen.enable(): …`` undoes it on exit."""

    def __enter__(self) -> _Enabled:
        return self

    def __exit__(self, *exc: object) -> None:
        disable()


def enable() -> _Enabled:
    """Makes ``torch.nn.attention.varlen.varlen_attn`` (and ``varlen_attn_out``) run attnlab on
    CPU tensors; tensors on other devices still go to torch's kernels. Reversible: `disable`, or
    use the returned handle as a context manager. Idempotent.

    Code that imported the function by name before (``from torch.nn.attention.varlen import
    varlen_attn``) keeps torch's: look it up through the module, or enable first.
    """
    import torch.nn.attention.varlen as tv

    if _SAVED:
        return _Enabled()
    _SAVED.update(varlen_attn=tv.varlen_attn, varlen_attn_out=tv.varlen_attn_out)

    def patched(query: Tensor, *args: Any, **kwargs: Any):
        if query.device.type == "cpu":
            return varlen_attn(query, *args, **kwargs)
        return _SAVED["varlen_attn"](query, *args, **kwargs)

    def patched_out(out: Tensor, query: Tensor, *args: Any, **kwargs: Any):
        if query.device.type == "cpu":
            return varlen_attn_out(out, query, *args, **kwargs)
        return _SAVED["varlen_attn_out"](out, query, *args, **kwargs)

    patched.__wrapped__ = _SAVED["varlen_attn"]  # type: ignore[attr-defined]
    patched_out.__wrapped__ = _SAVED["varlen_attn_out"]  # type: ignore[attr-defined]
    tv.varlen_attn, tv.varlen_attn_out = patched, patched_out
    return _Enabled()


def disable() -> None:
    """Restores torch's own ``varlen_attn`` / ``varlen_attn_out`` (no-op if not enabled)."""
    import torch.nn.attention.varlen as tv

    if _SAVED:
        tv.varlen_attn, tv.varlen_attn_out = (
            _SAVED.pop("varlen_attn"),
            _SAVED.pop("varlen_attn_out"),
        )


def enabled() -> bool:
    """Whether `enable` is in effect."""
    return bool(_SAVED)
