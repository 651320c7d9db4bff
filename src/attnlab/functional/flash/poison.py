"""Where the NaN rule puts NaN in the tiled backend's output (`functional.nan_rule`).

The tiles run on cleaned (finite) inputs; `poison_entries` finds, from the ORIGINAL inputs, the
rows and columns the rule makes non-finite: a row whose query, an attended key or an attended
bias entry is non-finite, and the columns of attended non-finite values.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from ...masks import Mask
from .. import nan_rule
from ..request import Request
from ..tiling import CALL_CAUSAL, Plan
from .tiles import TileSource


def attended_hits(plan: Plan, source: TileSource, ind: Tensor) -> tuple[Tensor, Tensor]:
    """``any`` of the flags ``ind (B, H_kv, S, C)`` over each row's attended keys, tile by tile.

    Walks the plan's calls (EMPTY tiles are in none): calls without an additive tile reduce over
    their keys (FULL) or take the first flagged key (CAUSAL); the others multiply their keep tile
    (mask and bias −inf, from the ORIGINAL bias values) by the flags and also report rows with a
    NaN/+inf bias entry. Returns ``(hits (B, H, L, C), bias_bad (B, H, L))`` bool.
    """
    B, H, L = source.B, source.H, source.L
    H_kv, C = ind.shape[1], ind.shape[-1]
    G = H // H_kv
    hits = torch.zeros(B, H, L, C, dtype=torch.bool, device=ind.device)
    bias_bad = torch.zeros(B, H, L, dtype=torch.bool, device=ind.device)
    for c in plan.simple_calls():
        keys = c.key_index(ind.device)
        sub = ind[c.b0 : c.b1].index_select(2, keys)  # (nb, H_kv, K, C)
        R = c.r1 - c.r0
        rows = (slice(c.b0, c.b1), slice(None), slice(c.r0, c.r1))
        add = source.for_call(c)
        if add is None and c.kind == CALL_CAUSAL:
            hi = torch.arange(1, R + 1, device=ind.device).view(1, 1, R)
            hit = nan_rule.any_in_interval(sub, None, hi).repeat_interleave(G, dim=1)
        elif add is None:
            hit = (sub.amax(dim=2) > 0).unsqueeze(2).repeat_interleave(G, dim=1)
        else:
            hit = nan_rule.any_dense(sub, ~torch.isneginf(add)).flatten(1, 2)
            hit = hit.repeat_interleave(H // hit.shape[1], dim=1)  # (nb, H, R|1, C)
            bias_bad[rows] |= (torch.isnan(add) | torch.isposinf(add)).any(dim=-1)
        hits[rows] |= hit
    return hits, bias_bad


def poison_entries(
    req: Request, plan: Plan, source: TileSource, lse: Tensor
) -> tuple[Tensor, Tensor]:
    """Where the NaN rule puts NaN: ``(row_bad (B, H, L), bad (B, H, L, Dv))`` bool.

    ``req`` holds the ORIGINAL inputs and ``source`` evaluates the ORIGINAL additive terms. Which
    keys a row attends comes from the mask's `Mask.key_interval` when it has one, else from the
    plan's tiles. A bias *function* is not evaluated again: the clean run's lse is NaN/+inf
    exactly on rows where it returned NaN/+inf at an attended pair (the clean q, k, v are
    finite); its −inf entries are not removed from the attended keys of the k/v check.
    """
    d = req.dims
    tensor_bias = bool(source.bias_tensors)
    interval = None
    if isinstance(req.mask, Mask) and not tensor_bias:
        interval = req.mask.key_interval(d.L, d.S, device=req.q.device)
    if not tensor_bias and (req.mask is None or interval is not None):
        row_bad, bad = nan_rule.bad_entries(req.q, req.k, req.v, interval=interval)
    else:
        if not tensor_bias:
            source = replace(source, bias_fn=None)  # the mask alone decides the attended keys
        ones = torch.ones(d.B, d.H_kv, d.S, 1, device=req.q.device)
        k_bad = nan_rule.row_flags(req.k).unsqueeze(-1)
        ind = torch.cat([ones, k_bad, nan_rule.flags(req.v)], dim=-1)  # (B, H_kv, S, 2 + Dv)
        hits, bias_bad = attended_hits(plan, source, ind)
        row_bad = hits[..., 0] & ((nan_rule.row_flags(req.q) > 0) | hits[..., 1] | bias_bad)
        bad = row_bad.unsqueeze(-1) | hits[..., 2:]
    if source.bias_fn is not None or (req.bias is not None and not tensor_bias):
        fn_bad = torch.isnan(lse) | torch.isposinf(lse)  # (B, H, L)
        row_bad = row_bad | fn_bad
        bad = bad | fn_bad.unsqueeze(-1)
    return row_bad, bad


__all__ = ["attended_hits", "poison_entries"]
