"""Attention sinks (GPT-OSS): a learned logit per head in every row's softmax denominator.

``out_i = Σ_j e^{l_ij} v_j / (e^{s_h} + Σ_j e^{l_ij})`` with ``l_ij`` the scaled, capped, biased,
masked logits of `attnlab.attention` and ``s_h`` the sink of query head h (defined by
`attnlab.functional.reference.attention` with ``sinks=``). No new kernel pass: with the plain
output ``o_i`` and its log-sum-exp ``lse_i = log Σ_j e^{l_ij}``, which every lse backend returns,

    ``out_i = o_i · σ(lse_i − s_h)``, ``lse'_i = log(e^{s_h} + e^{lse_i}) = logaddexp(lse_i, s_h)``

and the gradients flow through ``o`` and ``lse`` (the backends' lse is differentiable) to q, k, v
and to the sinks. A row with no key keeps ``out_i = 0`` (``lse_i = −inf``: factor 0) and gets
``lse'_i = s_h``. The NaN rule: a NaN or +inf sink makes every row of its head that has a key NaN
(and its lse); gradients are those of the sink read as 0. A −inf sink is no sink.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import nan_rule

_NEG_INF = float("-inf")


def check_sinks(sinks: object, H: int, q: Tensor) -> Tensor:
    """``sinks`` checked against the query heads, before any work.

    Args:
        sinks: the per-head sink logits, expected a float tensor ``(H,)`` on q's device.
        H: the number of query heads (1 for 3-D and 2-D inputs).
        q: the queries (for the device).

    Returns:
        ``sinks`` unchanged.

    Raises:
        TypeError: not a tensor, or not a floating-point tensor.
        ValueError: a shape other than ``(H,)``, or another device than q's.
    """
    if not isinstance(sinks, Tensor):
        raise TypeError(f"sinks must be a float tensor of shape (H,), got {type(sinks).__name__}")
    if not sinks.is_floating_point():
        raise TypeError(f"sinks must be a float tensor of shape (H,), got dtype {sinks.dtype}")
    if tuple(sinks.shape) != (H,):
        raise ValueError(
            f"sinks must have shape (H,) = ({H},), one logit per query head, got "
            f"{tuple(sinks.shape)}"
        )
    if sinks.device != q.device:
        raise ValueError(f"sinks must be on q's device {q.device}, got {sinks.device}")
    return sinks


def sink_factor(lse: Tensor, sinks: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(factor, lse', bad)`` for ``lse (B, H, L)`` and ``sinks (H,)``: ``factor = σ(lse − s)``
    and ``lse' = logaddexp(lse, s)`` in lse's dtype, ``bad`` the rows the NaN rule poisons
    (``lse'`` is that of the sink read as 0 there: the caller poisons it).

    Rows with no key (``lse = −inf``) get factor 0 and ``lse' = s``; a −inf sink gives factor 1
    and ``lse' = lse``; a NaN lse gets factor 0 (its row, NaN already, passes no gradient); the
    selects keep every gradient finite at those edges.
    """
    H = lse.shape[1]
    s = sinks.to(lse.dtype)
    bad_head = torch.isnan(s) | torch.isposinf(s)  # (H,)
    s = torch.where(bad_head, 0.0, s).view(1, H, 1)  # (1, H, 1): the sink read as 0
    empty = torch.isneginf(lse)  # (B, H, L): rows with no key
    # a NaN lse (a row the NaN rule poisoned) gets factor 0: its row stays NaN (NaN · 0) and
    # passes no gradient, instead of a NaN one
    d = torch.where(empty | torch.isnan(lse), _NEG_INF, lse - s)  # (B, H, L)
    # σ(d) as exp(log σ(d)): the backward of logsigmoid gives 1 − σ(d) = σ(−d) to full relative
    # precision (sigmoid's own backward, σ·(1 − σ), loses it when the sink's share is small)
    log_factor = torch.nn.functional.logsigmoid(d)
    factor = torch.exp(log_factor)
    new_lse = torch.where(empty, s, lse - log_factor)
    bad = bad_head.view(1, H, 1) & ~empty  # (B, H, L)
    return factor, new_lse, bad


def sink_outputs(out: Tensor, lse: Tensor, sinks: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(out', lse', bad)``: `apply_sinks` without the NaN rule's poison (a NaN/+inf sink read
    as 0; ``bad`` the rows to poison). What flash's backward reads (`flash.sinks`)."""
    factor, new_lse, bad = sink_factor(lse, sinks)
    f = factor.unsqueeze(-1)  # (B, H, L, 1)
    scaled = out * f if out.dtype == f.dtype else (out.to(f.dtype) * f).to(out.dtype)
    return scaled, new_lse, bad


def apply_sinks(
    out: Tensor, lse: Tensor, sinks: Tensor, weights: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Attention with sinks from attention without: ``out · σ(lse − s)``, ``logaddexp(lse, s)``.

    Args:
        out: the plain output ``(B, H, L, Dv)``.
        lse: its log-sum-exp ``(B, H, L)`` (float32, float64 for float64 inputs).
        sinks: ``(H,)``, in logit units (after the scale).
        weights: the plain weights ``(B, H, L, S)``, or None.

    Returns:
        ``(out, lse, weights)`` with the sinks: the weights ``p_ij · σ(lse_i − s_h)`` (the sink
        takes the rest of each row), None if none were given.
    """
    factor, new_lse, bad = sink_factor(lse, sinks)
    new_lse = torch.where(bad, float("nan"), new_lse)
    f = factor.unsqueeze(-1)  # (B, H, L, 1)
    # one pass: poison + out · f, the poison NaN on the NaN rule's rows and −0.0 elsewhere (a
    # constant: gradients pass as for the sink read as 0)
    poison = torch.where(bad, float("nan"), -0.0).unsqueeze(-1).to(f.dtype)  # (B, H, L, 1)
    if out.dtype == f.dtype:
        scaled = torch.addcmul(poison, out, f)
    else:  # 16-bit: multiplied in float32, rounded once
        scaled = torch.addcmul(poison, out.to(f.dtype), f).to(out.dtype)
    if weights is not None:
        weights = nan_rule.add_nan((weights.to(f.dtype) * f).to(weights.dtype), bad.unsqueeze(-1))
    return scaled, new_lse, weights


__all__ = ["apply_sinks", "check_sinks", "sink_factor", "sink_outputs"]
