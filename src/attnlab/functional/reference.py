"""THE definitions. Every fast path in attnlab is defined to equal a function in this file.

The code here is explicit, unfused plain PyTorch that runs in float64 (and, with ``compute_dtype``,
in any precision). It favours clarity over speed and never changes meaning for performance.

Conventions: q ``(B, H, L, D)``, k ``(B, H_kv, S, D)``, v ``(B, H_kv, S, Dv)``, ``H % H_kv == 0``;
``mask`` is bool, True = may attend, broadcastable to ``(B, H, L, S)``; ``bias`` is additive float,
broadcastable to ``(B, H, L, S)`` (−inf entries count as masked). A query row with no attendable key
outputs zeros and gets zero weights and zero gradients.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .scores import get_score

_NEG_INF = float("-inf")


def compute_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """Softmax statistics are kept in float32 or wider, whatever the input dtype."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _as4(t: Tensor) -> Tensor:
    return t.reshape((1,) * (4 - t.dim()) + tuple(t.shape))  # (B|1, H|1, L|1, S|1)


def group_heads(t: Tensor, H_kv: int) -> Tensor:
    """Views ``(B|1, H|1, L|1, S|1)`` as ``(B|1, H_kv|1, G|1, L|1, S|1)`` without copying."""
    t = _as4(t)
    if t.shape[1] == 1:
        return t.unsqueeze(2)  # (B|1, 1, 1, L|1, S|1)
    return t.unflatten(1, (H_kv, t.shape[1] // H_kv if H_kv else 0))  # (B|1, H_kv, G, L|1, S|1)


def keep_mask(mask: Tensor | None, bias: Tensor | None) -> Tensor | None:
    """Where attention is allowed: the bool mask, minus positions whose additive bias is −inf."""
    keep = None if mask is None else _as4(mask)
    if bias is not None:
        finite = ~torch.isneginf(_as4(bias))
        keep = finite if keep is None else keep & finite
    return keep


def zero_dead_keys(k: Tensor, v: Tensor, keep: Tensor | None) -> tuple[Tensor, Tensor]:
    """Zeroes key/value positions that no query may attend (``where``, not arithmetic).

    A NaN or inf stored at a fully masked key position (padding, evicted cache slots) therefore
    cannot reach the output or the gradients: the result is bit-equal to storing zeros there.

    Args:
        k: ``(B, H_kv, S, D)``. v: ``(B, H_kv, S, Dv)``.
        keep: bool broadcastable to ``(B, H, L, S)``, or None.
    """
    if keep is None:
        return k, v
    H_kv = k.shape[1]
    live = group_heads(keep, H_kv).any(dim=(2, 3))  # (B|1, H_kv|1, S|1)
    if bool(live.all()):
        return k, v
    live = live.unsqueeze(-1)  # (B|1, H_kv|1, S|1, 1)
    return torch.where(live, k, 0), torch.where(live, v, 0)


def _logits(
    q: Tensor,
    k: Tensor,
    *,
    scale: float,
    temperature: float,
    score: str,
    dtype: torch.dtype,
    reorder: bool = False,
) -> Tensor:
    s = get_score(score)
    H_kv = k.shape[1]
    qg = s.prepare(q.to(dtype)).unflatten(1, (H_kv, q.shape[1] // H_kv if H_kv else 0))
    kg = s.prepare(k.to(dtype)).unsqueeze(2)  # (B, H_kv, 1, S, D)
    # qg: (B, H_kv, G, L, D)
    if reorder:  # the same value with the scale folded into k first (a different rounding)
        return qg @ (kg * (scale / temperature)).transpose(-1, -2)  # (B, H_kv, G, L, S)
    return (qg @ kg.transpose(-1, -2)) * (scale / temperature)  # (B, H_kv, G, L, S)


def _unnormalized_softmax(logits: Tensor, keep: Tensor | None) -> tuple[Tensor, Tensor]:
    """``(e, z)`` with ``softmax = e / z``; masked entries of e are exactly 0, all-masked rows z = 1."""
    if logits.shape[-1] == 0:
        return logits, logits.new_ones(*logits.shape[:-1], 1)
    if keep is not None:
        logits = logits.masked_fill(~keep, _NEG_INF)
    m = logits.amax(dim=-1, keepdim=True).detach()  # NaN propagates through amax
    dead = m == _NEG_INF
    e = torch.exp(logits - torch.where(dead, 0.0, m))
    return e, torch.where(dead, 1.0, e.sum(dim=-1, keepdim=True))


def _masked_softmax(logits: Tensor, keep: Tensor | None) -> Tensor:
    """softmax over the last dim with masked entries at exactly 0 and all-masked rows at 0."""
    e, z = _unnormalized_softmax(logits, keep)
    return e / z


def _dropout(p: Tensor, dropout_p: float, generator: torch.Generator | None) -> Tensor:
    if dropout_p == 0.0:
        return p
    kept = torch.empty_like(p).bernoulli_(1.0 - dropout_p, generator=generator)
    return p * kept / (1.0 - dropout_p)


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None = None,
    bias: Tensor | None = None,
    scale: float | None = None,
    temperature: float = 1.0,
    score: str = "dot",
    dropout_p: float = 0.0,
    generator: torch.Generator | None = None,
    compute_dtype: torch.dtype | None = None,
    reorder: bool = False,
) -> tuple[Tensor, Tensor]:
    """Reference attention: ``softmax(score(q, k) · scale / temperature + bias, masked) @ v``.

    Args:
        q: ``(B, H, L, D)``. k: ``(B, H_kv, S, D)``. v: ``(B, H_kv, S, Dv)``.
        mask: bool, True = may attend, broadcastable to ``(B, H, L, S)``.
        bias: additive float, broadcastable to ``(B, H, L, S)``; −inf entries are masked.
        scale: logit scale; None means the score's default (1/√D for "dot", 1 for "cosine").
        temperature: logits are divided by it.
        score: a name from ``functional.scores.SCORES``.
        dropout_p: probability of zeroing a weight (kept weights are scaled by 1/(1−p)).
        generator: RNG for dropout.
        compute_dtype: precision of logits and softmax; default float32 or wider.
        reorder: fold the scale into k before the product and normalise after the weighted sum.
            Same definition, different rounding: the tolerance rule runs it in the input dtype to
            measure the naive formula's error.

    Returns:
        ``(out (B, H, L, Dv), weights (B, H, L, S))`` in q's dtype. ``weights`` are those that
        multiplied v, i.e. after dropout.
    """
    B, H, L, _ = q.shape
    H_kv, S, Dv = k.shape[1], k.shape[2], v.shape[-1]
    dtype = compute_dtype or compute_dtype_for(q.dtype)
    if scale is None:
        scale = get_score(score).default_scale(q.shape[-1])
    keep = keep_mask(mask, bias)
    k, v = zero_dead_keys(k, v, keep)
    logits = _logits(
        q, k, scale=scale, temperature=temperature, score=score, dtype=dtype, reorder=reorder
    )
    if bias is not None:
        logits = logits + group_heads(bias, H_kv).to(dtype)
    e, z = _unnormalized_softmax(logits, None if keep is None else group_heads(keep, H_kv))
    vg = v.to(dtype).unsqueeze(2)  # (B, H_kv, 1, S, Dv)
    if reorder:  # normalise after the weighted sum: same value, different rounding
        p = _dropout(e, dropout_p, generator)
        out = (p @ vg) / z  # (B, H_kv, G, L, Dv)
        p = p / z
    else:
        p = _dropout(e / z, dropout_p, generator)
        out = p @ vg  # (B, H_kv, G, L, Dv)
    out = out.flatten(1, 2).to(q.dtype)  # (B, H, L, Dv)
    weights = p.flatten(1, 2).to(q.dtype)  # (B, H, L, S)
    return out.reshape(B, H, L, Dv), weights.reshape(B, H, L, S)


def logsumexp(
    q: Tensor,
    k: Tensor,
    *,
    mask: Tensor | None = None,
    bias: Tensor | None = None,
    scale: float | None = None,
    temperature: float = 1.0,
    score: str = "dot",
) -> Tensor:
    """Reference log-sum-exp of the masked logits ``(B, H, L)``, float32+, −inf if empty."""
    B, H, L, _ = q.shape
    H_kv = k.shape[1]
    dtype = compute_dtype_for(q.dtype)
    if scale is None:
        scale = get_score(score).default_scale(q.shape[-1])
    keep = keep_mask(mask, bias)
    k, _ = zero_dead_keys(k, k[..., :0], keep)
    logits = _logits(q, k, scale=scale, temperature=temperature, score=score, dtype=dtype)
    if bias is not None:
        logits = logits + group_heads(bias, H_kv).to(dtype)
    if keep is not None:
        logits = logits.masked_fill(~group_heads(keep, H_kv), _NEG_INF)
    if logits.shape[-1] == 0:
        return logits.new_full((B, H, L), _NEG_INF)
    return torch.logsumexp(logits, dim=-1).flatten(1, 2).reshape(B, H, L)


def additive_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    w_q: Tensor,
    w_k: Tensor,
    b_k: Tensor | None,
    w_v: Tensor,
    mask: Tensor | None = None,
    bias: Tensor | None = None,
    dropout_p: float = 0.0,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """Reference additive (Bahdanau) attention: ``e_ij = w_vᵀ tanh(W_q q_i + W_k k_j + b_k)``.

    Args:
        query: ``(B, L, Dq)``. key: ``(B, S, Dk)``. value: ``(B, S, Dv)``.
        w_q: ``(Hd, Dq)``. w_k: ``(Hd, Dk)``. b_k: ``(Hd,)`` or None. w_v: ``(Hd,)``.
        mask: bool (True = may attend), broadcastable to ``(B, L, S)``.
        bias: additive float, broadcastable to ``(B, L, S)``.

    Returns:
        ``(out (B, L, Dv), weights (B, L, S))``, masked and fully-masked rows as in `attention`.
    """
    dtype = compute_dtype_for(query.dtype)
    mask4 = None if mask is None else _as4(mask.unsqueeze(-3) if mask.dim() == 3 else mask)
    bias4 = None if bias is None else _as4(bias.unsqueeze(-3) if bias.dim() == 3 else bias)
    keep = keep_mask(mask4, bias4)  # (B|1, 1, L|1, S|1)
    key4, value4 = zero_dead_keys(key.unsqueeze(1), value.unsqueeze(1), keep)  # (B, 1, S, ·)
    wq, wk, wv = w_q.to(dtype), w_k.to(dtype), w_v.to(dtype)
    pq = query.to(dtype) @ wq.T  # (B, L, Hd)
    pk = key4.squeeze(1).to(dtype) @ wk.T  # (B, S, Hd)
    if b_k is not None:
        pk = pk + b_k.to(dtype)
    logits = torch.tanh(pq.unsqueeze(2) + pk.unsqueeze(1)) @ wv  # (B, L, S)
    if bias4 is not None:
        logits = logits + bias4.squeeze(1).to(dtype)
    p = _masked_softmax(logits, None if keep is None else keep.squeeze(1))
    p = _dropout(p, dropout_p, generator)
    out = p @ value4.squeeze(1).to(dtype)  # (B, L, Dv)
    return out.to(query.dtype), p.to(query.dtype)
