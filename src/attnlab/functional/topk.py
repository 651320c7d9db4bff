"""Exact top-k attention on tiles: each row attends its ``k_top`` largest logits, O(tile) memory.

Defined to equal `functional.reference.topk_attention`: with ``l_ij = q_i·k_j·scale`` and ``A_i``
the keys the mask lets row i attend, row i keeps ``T_i``, its ``k_top`` largest allowed logits
(ties broken by the lowest key index), and ``out_i = softmax(l_{i,T_i}) V_{T_i}``.

No L×S tensor is formed. Three tiled passes over (query block × key block) tiles, each tile's
logits computed by the same code (so the passes see bit-identical values):

1. **Threshold.** Per row, the running top-k values: ``topk([running ∪ tile])`` per tile. At the
   end ``τ_i`` is the k-th largest allowed logit (−inf when fewer than k keys are allowed) and
   ``quota_i = k − #{kept values > τ_i}`` how many logits equal to ``τ_i`` the row keeps.
2. **Forward.** Online softmax (flash attention's running max and sum) over the tiles in key
   order, each logit kept iff ``l_ij > τ_i``, or ``l_ij = τ_i`` and fewer than ``quota_i``
   equal logits came before it (a running count: the lowest indices win ties). It saves the
   log-sum-exp ``lse_i``.
3. **Backward** (recomputing): ``p = e^{l − lse} ⊙ kept``, ``dv += pᵀ·do``,
   ``ds = p ⊙ (do·vᵀ − δ)·scale`` with ``δ_i = do_i·o_i``, ``dq += ds·k``, ``dk += dsᵀ·q``. The
   gradient flows through the kept logits only; ``τ`` and the selection are constants.

The mask's block map (`Mask.block_map`) skips EMPTY tiles and evaluates PARTIAL ones on their
indices only (`masks.blocks.tile_eval`), as `functional.sigmoid` does. Both passes are
``torch.library`` custom operators (``attnlab::topk_attn_fwd`` / ``attnlab::topk_attn_bwd``) that
take the mask as its spec, so ``torch.compile(fullgraph=True)`` traces one opaque call. The NaN
rule: inputs are cleaned; when one holds a non-finite entry (a check inside the operator), the
attended keys' flags are counted per row over the mask's tiles and the output poisoned — "may
attend" is the mask (a non-finite logit cannot be ranked).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from .._shapes import Dims, check_broadcast, check_int, check_number, check_qkv, stat_dtype
from ..masks import Mask
from . import nan_rule
from .sigmoid import _check_mask, _mask_of, _op_spec, _operands, _Tile, _tile_keep, _tiles

BLOCK_Q = 128
"""Query rows per tile."""
BLOCK_K = 256
"""Keys per tile."""

_NEG_INF = float("-inf")


def _scores(qg: Tensor, kg: Tensor, t: _Tile, scale: float, keep: Tensor | None) -> Tensor:
    """Tile t's logits ``q_I·k_Jᵀ·scale``, −inf where the mask (``keep``; None: all) forbids:
    ``(B, H_kv, G, rows, keys)``."""
    s = (qg[..., t[0] : t[1], :] @ kg[..., t[2] : t[3], :].transpose(-1, -2)) * scale
    return s if keep is None else s.masked_fill(~keep, _NEG_INF)


class _Pass:
    """What every pass shares: the clean, widened operands, the tiles and their masks."""

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, mask: Mask | None, bq: int, bk: int):
        B, H, L, _ = q.shape
        self.H_kv, self.S = k.shape[1], k.shape[2]
        self.qg, self.kg, self.vg = _operands(q, k, v)
        self.mask, self.dims = mask, (B, H, L)
        self.tiles = _tiles(mask, B, H, L, self.S, bq, bk)

    def keep(self, t: _Tile) -> Tensor | None:
        """The mask on tile t (None when FULL)."""
        if t[4] or self.mask is None:
            return None
        B, H, L = self.dims
        return _tile_keep(self.mask, t, B, H, self.H_kv, L, self.S, self.qg.device)


def _threshold(ps: _Pass, k_top: int, scale: float) -> tuple[Tensor, Tensor]:
    """Pass 1: ``(τ, quota)`` per row, ``(B, H_kv, G, L)`` (stat dtype, int64).

    The running top ``k + 1`` values say also whether a row has more logits equal to ``τ`` than
    it keeps (the (k+1)-th equals τ): only those rows need the tie count (``quota >= 0``); the
    others keep every logit ``>= τ`` (``quota = −1``).
    """
    kk = min(k_top, ps.S)
    width = min(k_top + 1, ps.S)
    top = ps.qg.new_full((*ps.qg.shape[:-1], width), _NEG_INF)  # (B, H_kv, G, L, k + 1)
    for t in ps.tiles:
        s = _scores(ps.qg, ps.kg, t, scale, ps.keep(t))
        both = torch.cat([top[..., t[0] : t[1], :], s], dim=-1)  # (B, H_kv, G, rows, · + keys)
        top[..., t[0] : t[1], :] = both.topk(width, dim=-1).values
    tau = top[..., kk - 1]  # (B, H_kv, G, L): the k-th largest (−inf: fewer than k allowed)
    quota = kk - (top[..., :kk] > tau.unsqueeze(-1)).sum(-1)
    excess = (top[..., kk] == tau) & (tau > _NEG_INF) if width > kk else torch.zeros_like(tau)
    return tau, torch.where(excess.bool(), quota, -1)


def _kept(s: Tensor, tau: Tensor, quota: Tensor, seen: Tensor | None) -> Tensor:
    """The kept pairs of a tile's logits ``s``; τ, quota, seen: the tile's rows
    ``(B, H_kv, G, rows)``. ``seen`` (the ties before the tile, per row) is advanced in place;
    None when no row has excess ties (every ``quota < 0``): then kept = ``s >= τ``."""
    tau = tau.unsqueeze(-1)
    if seen is None:
        return (s >= tau) & (s > _NEG_INF)
    tie = (s == tau) & (s > _NEG_INF)
    ties = tie.to(torch.int32)  # int32: its cumsum is several times faster than bool's int64
    rank = seen.unsqueeze(-1) + ties.cumsum(-1)  # 1-based rank among the row's ties so far
    seen += ties.sum(-1, dtype=torch.int32)
    within = (quota < 0).unsqueeze(-1) | (rank <= quota.unsqueeze(-1))
    return (s > tau) | (tie & within)


def _tie_counts(quota: Tensor) -> Tensor | None:
    """The running tie count of `_kept` (zeros), or None when no row needs it — a host read
    inside the operators (never traced)."""
    return torch.zeros_like(quota, dtype=torch.int32) if bool((quota >= 0).any()) else None


def _forward_clean(ps: _Pass, tau: Tensor, quota: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Pass 2: ``(out (B, H_kv, G, L, Dv), lse (B, H_kv, G, L))`` of the clean inputs."""
    qg, vg = ps.qg, ps.vg
    m = qg.new_full(qg.shape[:-1], _NEG_INF)  # running max
    z = qg.new_zeros(qg.shape[:-1])  # running sum
    acc = qg.new_zeros(*qg.shape[:-1], vg.shape[-1])  # (B, H_kv, G, L, Dv)
    seen = _tie_counts(quota)
    for t in ps.tiles:
        r = slice(t[0], t[1])
        s = _scores(qg, ps.kg, t, scale, ps.keep(t))
        row_seen = None if seen is None else seen[..., r]
        s = s.masked_fill(~_kept(s, tau[..., r], quota[..., r], row_seen), _NEG_INF)
        m_new = torch.maximum(m[..., r], s.amax(-1))
        base = torch.where(m_new == _NEG_INF, 0.0, m_new)
        alpha = torch.exp(m[..., r] - base)  # 0 while a row had nothing
        p = torch.exp(s - base.unsqueeze(-1))
        z[..., r] = z[..., r] * alpha + p.sum(-1)
        acc[..., r, :] = acc[..., r, :] * alpha.unsqueeze(-1) + p @ vg[..., t[2] : t[3], :]
        m[..., r] = m_new
    out = acc / torch.where(z == 0, 1.0, z).unsqueeze(-1)
    lse = torch.where(z == 0, _NEG_INF, m + torch.log(torch.where(z == 0, 1.0, z)))
    return out, lse


def _poisoned(out: Tensor, ps: _Pass, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """The NaN rule on ``out (B, H, L, Dv)``: per row, the attended keys and the attended
    non-finite k rows and v entries, counted over the mask's tiles."""
    B, H_kv, S = k.shape[0], k.shape[1], k.shape[2]
    ind = torch.cat(
        [k.new_ones(B, H_kv, S, 1), nan_rule.row_flags(k).unsqueeze(-1), nan_rule.flags(v)],
        dim=-1,
    )
    ind = ind.unsqueeze(2).to(ps.qg.dtype)  # (B, H_kv, 1, S, 2 + Dv)
    counts = ps.qg.new_zeros(*ps.qg.shape[:-1], ind.shape[-1])  # (B, H_kv, G, L, 2 + Dv)
    for t in ps.tiles:
        keep = ps.keep(t)
        rows = t[1] - t[0]
        on = (
            ps.qg.new_ones(1, 1, 1, rows, t[3] - t[2])
            if keep is None
            else keep.to(ps.qg.dtype).expand(*ps.qg.shape[:3], rows, t[3] - t[2])
        )
        counts[..., t[0] : t[1], :] += on @ ind[..., t[2] : t[3], :]
    counts = counts.flatten(1, 2)  # (B, H, L, 2 + Dv)
    alive = counts[..., 0] > 0
    row_bad = alive & ((nan_rule.row_flags(q) > 0) | (counts[..., 1] > 0))  # (B, H, L)
    return nan_rule.add_nan(out, row_bad.unsqueeze(-1) | (counts[..., 2:] > 0))


def _forward(
    q: Tensor, k: Tensor, v: Tensor, mask: Mask | None, k_top: int, scale: float, bq: int, bk: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(out (B, H, L, Dv), lse, τ, quota (B, H, L))``: out in q's dtype with the NaN rule,
    the rest of the clean computation."""
    ps = _Pass(q, k, v, mask, bq, bk)
    tau, quota = _threshold(ps, k_top, scale)
    out, lse = _forward_clean(ps, tau, quota, scale)
    out = out.flatten(1, 2).to(q.dtype)  # (B, H, L, Dv)
    # a host read inside the operator (never traced): the flags are counted only when needed
    if not all(bool(torch.isfinite(x).all()) for x in (q, k, v)):
        out = _poisoned(out, ps, q, k, v)
    flat = (x.flatten(1, 2).contiguous() for x in (lse, tau, quota))
    return (out.contiguous(), *flat)  # type: ignore[return-value]


def _backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    tau: Tensor,
    quota: Tensor,
    mask: Mask | None,
    scale: float,
    bq: int,
    bk: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Pass 3, recomputing: ``(dq, dk, dv)`` of the clean computation."""
    ps = _Pass(q, k, v, mask, bq, bk)
    H_kv = ps.H_kv
    lse, tau, quota = (x.unflatten(1, (H_kv, -1)) for x in (lse, tau, quota))
    dog = dout.to(ps.qg.dtype).unflatten(1, (H_kv, -1))  # (B, H_kv, G, L, Dv)
    if bool(torch.isfinite(out).all()):  # a host read inside the operator (never traced)
        out = out.to(ps.qg.dtype).unflatten(1, (H_kv, -1))
    else:  # the NaN rule poisoned it: δ from the clean output
        out = _forward_clean(ps, tau, quota, scale)[0]
    delta = (dog * out).sum(-1)  # (B, H_kv, G, L)
    qg, kg, vg = ps.qg, ps.kg, ps.vg
    dq, dk, dv = torch.zeros_like(qg), torch.zeros_like(kg), torch.zeros_like(vg)
    seen = _tie_counts(quota)
    base = torch.where(lse == _NEG_INF, 0.0, lse)
    for t in ps.tiles:
        r, c = slice(t[0], t[1]), slice(t[2], t[3])
        s = _scores(qg, kg, t, scale, ps.keep(t))
        kept = _kept(s, tau[..., r], quota[..., r], None if seen is None else seen[..., r])
        p = torch.where(kept, torch.exp(s - base[..., r].unsqueeze(-1)), 0.0)
        do = dog[..., r, :]
        dv[..., c, :] += (p.transpose(-1, -2) @ do).sum(2, keepdim=True)
        ds = p * (do @ vg[..., c, :].transpose(-1, -2) - delta[..., r].unsqueeze(-1)) * scale
        dq[..., r, :] += ds @ kg[..., c, :]
        dk[..., c, :] += (ds.transpose(-1, -2) @ qg[..., r, :]).sum(2, keepdim=True)
    # the gradient of `nan_rule.clean` is 0 at non-finite entries
    grads = (dq.flatten(1, 2), dk.squeeze(2), dv.squeeze(2))
    pairs = zip(grads, (q, k, v), strict=True)
    return tuple(torch.where(torch.isfinite(x), g, 0.0).to(x.dtype) for g, x in pairs)  # type: ignore[return-value]


@torch.library.custom_op("attnlab::topk_attn_fwd", mutates_args=())
def topk_attn_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask_tensors: list[Tensor],
    mask_spec: str,
    k_top: int,
    scale: float,
    block_q: int,
    block_k: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`_forward` as an operator: ``(out, lse, τ, quota)``; the mask travels as its spec."""
    mask = _mask_of(mask_spec, mask_tensors)
    return _forward(q, k, v, mask, k_top, scale, block_q, block_k)


@topk_attn_fwd.register_fake
def _(q, k, v, *_rest):  # noqa: ARG001 (a fake kernel takes the op's arguments)
    rows = q.shape[:-1]  # (B, H, L)
    stat = stat_dtype(q.dtype)
    return (
        q.new_empty(*rows, v.shape[-1]),
        q.new_empty(rows, dtype=stat),
        q.new_empty(rows, dtype=stat),
        q.new_empty(rows, dtype=torch.int64),
    )


@torch.library.custom_op("attnlab::topk_attn_bwd", mutates_args=())
def topk_attn_bwd(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    tau: Tensor,
    quota: Tensor,
    mask_tensors: list[Tensor],
    mask_spec: str,
    scale: float,
    block_q: int,
    block_k: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """`_backward` as an operator (the gradient of `topk_attn_fwd`'s output)."""
    mask = _mask_of(mask_spec, mask_tensors)
    return _backward(dout, q, k, v, out, lse, tau, quota, mask, scale, block_q, block_k)


@topk_attn_bwd.register_fake
def _(dout, q, k, v, *_rest):  # noqa: ARG001 (a fake kernel takes the op's arguments)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, tensors, spec, _k_top, scale, bq, bk = inputs
    ctx.save_for_backward(q, k, v, *output, *tensors)
    ctx.rest = (spec, scale, bq, bk)


def _backward_op(ctx, dout: Tensor, *_stats):
    q, k, v, out, lse, tau, quota, *tensors = ctx.saved_tensors
    spec, scale, bq, bk = ctx.rest
    dq, dk, dv = topk_attn_bwd(
        dout.contiguous(), q, k, v, out, lse, tau, quota, tensors, spec, scale, bq, bk
    )
    return dq, dk, dv, [None] * len(tensors), None, None, None, None, None


topk_attn_fwd.register_autograd(_backward_op, setup_context=_setup_context)


def check_mask_4d(mask: object, dims: Dims) -> Mask | None:
    """``mask`` checked (`sigmoid._check_mask`) as a `Mask` over ``(B, H, L, S)``; for 3-D
    inputs a bool tensor ``(B|1, L|1, S|1)`` gets its head dim."""
    if dims.three_d and isinstance(mask, Tensor) and mask.dtype == torch.bool:
        check_broadcast("mask", mask, dims)
        mask = mask.unsqueeze(-3) if mask.dim() == 3 else mask  # (B|1, 1, L|1, S|1)
        dims = replace(dims, three_d=False)
    return _check_mask(mask, dims)


def topk_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    k_top: int,
    mask: Mask | Tensor | None = None,
    scale: float | None = None,
    block_q: int = BLOCK_Q,
    block_k: int = BLOCK_K,
) -> Tensor:
    """Exact top-k attention on tiles: row i attends its ``k_top`` largest allowed logits.

    ``out_i = Σ_{j ∈ T_i} e^{l_ij} v_j / Σ_{j ∈ T_i} e^{l_ij}``, ``l_ij = q_i·k_j·scale``, ``T_i``
    the ``k_top`` largest of row i's allowed logits, equal logits ranked by the lowest key index.
    Defined to equal `attnlab.functional.reference.topk_attention`. Never forms the L×S matrix:
    a tiled threshold pass, a tiled online-softmax pass and a recomputing backward (module doc).
    ``k_top >= S`` is ordinary attention; a row that may attend nothing outputs zeros; the NaN
    rule holds with "may attend" = the mask. The gradient flows through the kept logits only.

    Args:
        q: ``(B, H, L, D)`` or ``(B, L, D)``. k: ``(B, H_kv, S, D)`` or ``(B, S, D)``.
            v: ``(B, H_kv, S, Dv)`` or ``(B, S, Dv)``; ``H % H_kv == 0`` (GQA).
        k_top: keys kept per row (an int >= 1).
        mask: an `attnlab.masks.Mask` with a spec (every built-in mask, not `from_fn`), a bool
            tensor broadcastable to ``(B, H, L, S)`` (True = may attend), or None.
        scale: logit scale (finite); None means ``1/√D``.
        block_q: query rows per tile (>= 1). block_k: keys per tile (>= 1).

    Returns:
        ``(B, H, L, Dv)`` (``(B, L, Dv)`` for 3-D inputs) in q's dtype.

    Raises:
        TypeError / ValueError: bad tensors, ``k_top``, mask, scale or tile sizes, naming the
            argument, what was expected and what was received — before any work.

    Example:
        >>> q, k, v = (torch.randn(1, 2, 64, 16) for _ in range(3))
        >>> out = topk_attention(q, k, v, k_top=8, mask=attnlab.masks.causal())  # (1, 2, 64, 16)
    """
    dims = check_qkv(q, k, v)
    check_int("k_top", k_top, minimum=1)
    m = check_mask_4d(mask, dims)
    if dims.three_d:  # (B, L, D): one head
        q, k, v = q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)
    scale = dims.D**-0.5 if scale is None else check_number("scale", scale)
    check_int("block_q", block_q, minimum=1)
    check_int("block_k", block_k, minimum=1)
    spec, tensors = _op_spec(m, q)
    out = topk_attn_fwd(q, k, v, tensors, spec, k_top, scale, block_q, block_k)[0]
    return out.squeeze(1) if dims.three_d else out


__all__ = [
    "BLOCK_K",
    "BLOCK_Q",
    "check_mask_4d",
    "topk_attention",
    "topk_attn_bwd",
    "topk_attn_fwd",
]
