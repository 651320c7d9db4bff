"""Tiled sigmoid attention: ``out = (sigmoid(q·kᵀ·scale + b) ⊙ keep) @ v``, O(tile) memory.

Defined to equal `functional.reference.sigmoid_attention` (Ramapuram et al. 2024, "Theory,
Analysis, and Best Practices for Sigmoid Self-Attention"; ``b = −log S`` by default).

Every weight stands alone — no row max, no normaliser — so the (query block × key block) tiles
add up independently: ``out_I = Σ_J sigmoid(q_I·k_Jᵀ·scale + b) ⊙ keep_IJ @ v_J``. The mask's
block map (`Mask.block_map`) decides each tile: EMPTY tiles are skipped, FULL tiles run without
evaluating the mask, PARTIAL tiles evaluate it on the tile's indices only
(`masks.blocks.tile_eval`). The backward recomputes each tile from q, k, v:

    p = sigmoid(s) ⊙ keep,  dv += pᵀ·do,  ds = (do·vᵀ) ⊙ p ⊙ (1 − p),
    dq += ds·k·scale,  dk += dsᵀ·q·scale.

Both passes are ``torch.library`` custom operators (``attnlab::sigmoid_attn_fwd`` and its
gradient ``attnlab::sigmoid_attn_bwd``) that receive the mask as its structure string and tensors
(`Mask.spec`), so ``torch.compile(fullgraph=True)`` traces one opaque call and the block map is
read when the graph runs. The NaN rule (`functional.nan_rule`): inputs are cleaned, and when
they hold a non-finite entry (a check inside the operator, never traced) each tile also counts,
per row, the attended keys and the attended non-finite k rows and v entries, and the output is
poisoned from those counts.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._shapes import check_broadcast, check_int, check_number, check_qkv, stat_dtype
from ..masks import Mask, from_spec, from_tensor
from ..masks.blocks import EMPTY, FULL, tile_eval
from . import nan_rule
from .reference import sigmoid_bias

BLOCK_Q = 128
"""Query rows per tile."""
BLOCK_K = 256
"""Keys per tile."""

_Tile = tuple[int, int, int, int, bool]  # (row start, row end, key start, key end, full)


def _tiles(mask: Mask | None, B: int, H: int, L: int, S: int, bq: int, bk: int) -> list[_Tile]:
    """The non-empty tiles of the (L, S) grid, and whether each is FULL for every batch/head."""
    nq, nk = -(-L // bq), -(-S // bk)
    if mask is None:
        return [
            (i * bq, min(L, (i + 1) * bq), j * bk, min(S, (j + 1) * bk), True)
            for i in range(nq)
            for j in range(nk)
        ]
    codes = mask.block_map(L, S, bq, bk, batch=B, heads=H)  # (B|1, H|1, nq, nk)
    hi, lo = codes.amax(dim=(0, 1)).tolist(), codes.amin(dim=(0, 1)).tolist()
    return [
        (i * bq, min(L, (i + 1) * bq), j * bk, min(S, (j + 1) * bk), lo[i][j] == FULL)
        for i in range(nq)
        for j in range(nk)
        if hi[i][j] != EMPTY
    ]


def _tile_keep(
    mask: Mask, t: _Tile, B: int, H: int, H_kv: int, L: int, S: int, device: torch.device
) -> Tensor:
    """The mask on tile ``t`` as float 0/1, grouped ``(B|1, H_kv|1, G|1, rows, keys)``."""
    nb, nh = mask.batch_heads(B, H)
    rows = torch.arange(t[0], t[1], device=device)
    keys = torch.arange(t[2], t[3], device=device)
    keep = tile_eval(mask, rows, keys, L, S, nb, nh, device)  # (B|1, H|1, rows, keys)
    return keep.unsqueeze(2) if keep.shape[1] == 1 else keep.unflatten(1, (H_kv, -1))


def _operands(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Clean (NaN rule) and widened: q ``(B, H_kv, G, L, D)``, k/v ``(B, H_kv, 1, S, ·)``."""
    dtype = stat_dtype(q.dtype)
    H_kv = k.shape[1]
    qg = nan_rule.clean(q).to(dtype).unflatten(1, (H_kv, -1))  # (B, H_kv, G, L, D)
    kg = nan_rule.clean(k).to(dtype).unsqueeze(2)  # (B, H_kv, 1, S, D)
    vg = nan_rule.clean(v).to(dtype).unsqueeze(2)  # (B, H_kv, 1, S, Dv)
    return qg, kg, vg


def _weights(
    qg: Tensor, kg: Tensor, t: _Tile, scale: float, b: float, keep: Tensor | None
) -> Tensor:
    """``sigmoid(q_I·k_Jᵀ·scale + b) ⊙ keep`` of tile t: ``(B, H_kv, G, rows, keys)``."""
    s = qg[..., t[0] : t[1], :] @ kg[..., t[2] : t[3], :].transpose(-1, -2)
    p = torch.sigmoid(s * scale + b)
    return p if keep is None else torch.where(keep, p, 0.0)


def _forward(
    q: Tensor, k: Tensor, v: Tensor, mask: Mask | None, scale: float, b: float, bq: int, bk: int
) -> Tensor:
    """The tiled forward with the NaN rule: ``(B, H, L, Dv)`` in q's dtype."""
    B, H, L, _ = q.shape
    H_kv, S, Dv = k.shape[1], k.shape[2], v.shape[-1]
    qg, kg, vg = _operands(q, k, v)
    out = qg.new_zeros(*qg.shape[:-1], Dv)  # (B, H_kv, G, L, Dv)
    # a host read inside the operator (never traced): flags are counted only when needed
    rule = not all(bool(torch.isfinite(x).all()) for x in (q, k, v))
    if rule:  # per key: [1, non-finite k row, non-finite v[d]]; per row: their attended sums
        ind = torch.cat(
            [kg.new_ones(B, H_kv, S, 1), nan_rule.row_flags(k).unsqueeze(-1), nan_rule.flags(v)],
            dim=-1,
        )
        ind = ind.unsqueeze(2).to(qg.dtype)  # (B, H_kv, 1, S, 2 + Dv)
        counts = qg.new_zeros(*qg.shape[:-1], 2 + Dv)  # (B, H_kv, G, L, 2 + Dv)
    for t in _tiles(mask, B, H, L, S, bq, bk):
        keep = None if t[4] or mask is None else _tile_keep(mask, t, B, H, H_kv, L, S, q.device)
        p = _weights(qg, kg, t, scale, b, keep)
        out[..., t[0] : t[1], :] += p @ vg[..., t[2] : t[3], :]
        if rule:
            on = torch.ones_like(p) if keep is None else keep.to(p.dtype).expand_as(p)
            counts[..., t[0] : t[1], :] += on @ ind[..., t[2] : t[3], :]
    out = out.flatten(1, 2).to(q.dtype)  # (B, H, L, Dv)
    if not rule:
        return out
    counts = counts.flatten(1, 2)  # (B, H, L, 2 + Dv)
    alive = counts[..., 0] > 0
    row_bad = alive & ((nan_rule.row_flags(q) > 0) | (counts[..., 1] > 0))  # (B, H, L)
    return nan_rule.add_nan(out, row_bad.unsqueeze(-1) | (counts[..., 2:] > 0))


def _backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Mask | None,
    scale: float,
    b: float,
    bq: int,
    bk: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """The recomputing backward of the clean computation: ``(dq, dk, dv)``."""
    B, H, L, _ = q.shape
    H_kv, S = k.shape[1], k.shape[2]
    qg, kg, vg = _operands(q, k, v)
    dog = dout.to(qg.dtype).unflatten(1, (H_kv, -1))  # (B, H_kv, G, L, Dv)
    dq, dk, dv = torch.zeros_like(qg), torch.zeros_like(kg), torch.zeros_like(vg)
    for t in _tiles(mask, B, H, L, S, bq, bk):
        keep = None if t[4] or mask is None else _tile_keep(mask, t, B, H, H_kv, L, S, q.device)
        p = _weights(qg, kg, t, scale, b, keep)  # (B, H_kv, G, rows, keys)
        do = dog[..., t[0] : t[1], :]
        dv[..., t[2] : t[3], :] += (p.transpose(-1, -2) @ do).sum(2, keepdim=True)
        ds = (do @ vg[..., t[2] : t[3], :].transpose(-1, -2)) * p * (1.0 - p) * scale
        dq[..., t[0] : t[1], :] += ds @ kg[..., t[2] : t[3], :]
        dk[..., t[2] : t[3], :] += (ds.transpose(-1, -2) @ qg[..., t[0] : t[1], :]).sum(2, True)
    # the gradient of `nan_rule.clean` is 0 at non-finite entries
    grads = (dq.flatten(1, 2), dk.squeeze(2), dv.squeeze(2))
    pairs = zip(grads, (q, k, v), strict=True)
    return tuple(torch.where(torch.isfinite(x), g, 0.0).to(x.dtype) for g, x in pairs)  # type: ignore[return-value]


def _mask_of(spec: str, tensors: list[Tensor]) -> Mask | None:
    return from_spec(spec, list(tensors)) if spec else None


@torch.library.custom_op("attnlab::sigmoid_attn_fwd", mutates_args=())
def sigmoid_attn_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask_tensors: list[Tensor],
    mask_spec: str,
    scale: float,
    bias: float,
    block_q: int,
    block_k: int,
) -> Tensor:
    """`_forward` as an operator: the mask travels as ``(mask_spec, mask_tensors)``."""
    mask = _mask_of(mask_spec, mask_tensors)
    return _forward(q, k, v, mask, scale, bias, block_q, block_k).contiguous()


@sigmoid_attn_fwd.register_fake
def _(q, k, v, *_rest):  # noqa: ARG001 (a fake kernel takes the op's arguments)
    return q.new_empty(*q.shape[:-1], v.shape[-1])


@torch.library.custom_op("attnlab::sigmoid_attn_bwd", mutates_args=())
def sigmoid_attn_bwd(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask_tensors: list[Tensor],
    mask_spec: str,
    scale: float,
    bias: float,
    block_q: int,
    block_k: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """`_backward` as an operator (the gradient of `sigmoid_attn_fwd`)."""
    mask = _mask_of(mask_spec, mask_tensors)
    return _backward(dout, q, k, v, mask, scale, bias, block_q, block_k)


@sigmoid_attn_bwd.register_fake
def _(dout, q, k, v, *_rest):  # noqa: ARG001 (a fake kernel takes the op's arguments)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output) -> None:  # noqa: ARG001 (torch's signature)
    q, k, v, tensors, spec, scale, bias, bq, bk = inputs
    ctx.save_for_backward(q, k, v, *tensors)
    ctx.rest = (spec, scale, bias, bq, bk)


def _backward_op(ctx, dout: Tensor):
    q, k, v, *tensors = ctx.saved_tensors
    dq, dk, dv = sigmoid_attn_bwd(dout.contiguous(), q, k, v, tensors, *ctx.rest)
    return dq, dk, dv, [None] * len(tensors), None, None, None, None, None


sigmoid_attn_fwd.register_autograd(_backward_op, setup_context=_setup_context)


def _op_spec(m: Mask | None, q: Tensor) -> tuple[str, list[Tensor]]:
    """A mask as a custom operator's arguments: its structure spec and its tensors (one empty
    placeholder when it has none: AOTInductor passes an empty Tensor[] as None).

    Raises:
        ValueError: a mask without a spec (a ``from_fn`` mask).
    """
    spec = ("", []) if m is None else m.spec()
    if spec is None:
        raise ValueError(
            f"mask must have a structure spec (a built-in mask or a bool tensor), got {m!r}: "
            "render a from_fn mask with mask.to_dense(L, S) first"
        )
    return spec[0], spec[1] or [q.new_empty(0)]


def _check_mask(mask: object, dims) -> Mask | None:
    """The mask as a `Mask` with a spec, or a ValueError/TypeError naming what was received."""
    if mask is None:
        return None
    if isinstance(mask, Tensor):
        if mask.dtype != torch.bool:
            raise TypeError(f"mask must be a bool tensor (True = may attend), got {mask.dtype}")
        check_broadcast("mask", mask, dims)
        mask = from_tensor(mask)
    if not isinstance(mask, Mask):
        raise TypeError(f"mask must be an attnlab Mask, a bool tensor or None, got {mask!r}")
    mask.batch_heads(dims.B, dims.H)  # raises naming a batch/head mismatch
    return mask


def sigmoid_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Mask | Tensor | None = None,
    scale: float | None = None,
    bias: float | None = None,
    block_q: int = BLOCK_Q,
    block_k: int = BLOCK_K,
) -> Tensor:
    """Sigmoid attention on tiles: ``out = (sigmoid(q·kᵀ·scale + b) ⊙ keep) @ v``.

    Defined to equal `attnlab.functional.reference.sigmoid_attention`. Memory is O(tile) in
    both passes (the backward recomputes each tile); EMPTY tiles of the mask's block map are
    skipped. A row that may attend nothing outputs zeros; the NaN rule holds.

    Args:
        q: ``(B, H, L, D)``. k: ``(B, H_kv, S, D)``. v: ``(B, H_kv, S, Dv)``; ``H % H_kv == 0``.
        mask: an `attnlab.masks.Mask` with a spec (every built-in mask, not `from_fn`), a bool
            tensor broadcastable to ``(B, H, L, S)`` (True = may attend), or None.
        scale: logit scale (finite); None means ``1/√D``.
        bias: the scalar logit bias b (finite); None means ``−log S`` (`reference.sigmoid_bias`).
        block_q: query rows per tile (>= 1). block_k: keys per tile (>= 1).

    Returns:
        ``(B, H, L, Dv)`` in q's dtype.

    Raises:
        TypeError / ValueError: bad tensors, mask, scale, bias or tile sizes, naming the argument,
            what was expected and what was received — before any work.

    Example:
        >>> q, k, v = (torch.randn(1, 2, 17, 8) for _ in range(3))
        >>> out = sigmoid_attention(q, k, v, mask=attnlab.masks.causal())  # (1, 2, 17, 8)
    """
    dims = check_qkv(q, k, v)
    if dims.three_d:
        raise ValueError(
            f"query, key and value must be 4-D (B, H, L, D), got query {tuple(q.shape)}"
        )
    m = _check_mask(mask, dims)
    scale = dims.D**-0.5 if scale is None else check_number("scale", scale)
    b = sigmoid_bias(dims.S) if bias is None else check_number("bias", bias)
    check_int("block_q", block_q, minimum=1)
    check_int("block_k", block_k, minimum=1)
    spec, tensors = _op_spec(m, q)
    return sigmoid_attn_fwd(q, k, v, tensors, spec, scale, b, block_q, block_k)


__all__ = ["BLOCK_K", "BLOCK_Q", "sigmoid_attention", "sigmoid_attn_bwd", "sigmoid_attn_fwd"]
