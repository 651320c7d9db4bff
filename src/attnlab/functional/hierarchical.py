"""Two-level hierarchical attention: exact inside blocks, block summaries across blocks.

The sequence is cut into blocks of b tokens (the last one may be shorter). A query attends, in
one softmax, to

- the tokens of its own block (fine level; ``j <= i`` under a causal mask), and
- one summary per other block J (coarse level; earlier blocks only if causal): the mean key
  ``k̄_J`` and mean value ``v̄_J`` of its n_J tokens, with logit ``s·q·k̄_J + log n_J``.

The ``+ log n_J`` makes a summary count for the n_J tokens it stands for, so this equals full
softmax attention in which every key and value outside the query's block is replaced by its
block mean — the two-level H-matrix approximation of H-Transformer-1D (Zhu & Soricut, 2021),
with fine queries. Cost O(L·(b + L/b)) time and memory: O(L^1.5) at b = √L. Defined to equal
`reference.hierarchical_attention` (explicit masks over tokens and summaries); with ``b = 1`` or
``b >= L`` it is exact softmax attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .._shapes import check_int, check_number, check_qkv, stat_dtype
from ..masks import Mask
from .linear import as_4d, check_kernel_mask

__all__ = ["hierarchical_attention"]


def hierarchical_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    block_size: int,
    mask: Mask | None = None,
    scale: float | None = None,
) -> Tensor:
    """Hierarchical self-attention: fine within blocks of ``block_size``, block means across.

    ``out_i = Σ_{j ∈ block(i)} p_ij v_j + Σ_{J ≠ block(i)} p_iJ v̄_J`` with
    ``p = softmax([s·q_i·k_j]_j ∪ [s·q_i·k̄_J + log n_J]_J)`` (module docstring). A causal mask
    keeps ``j <= i`` in the own block and blocks ``J < block(i)``; a padding mask drops the keys
    ``j >= lengths[b]`` from both levels (a block's mean and ``n_J`` count its real keys only, a
    block without one is no summary; a row left with no key outputs zeros). Defined to equal
    `attnlab.functional.reference.hierarchical_attention`. Softmax in float32 or wider.

    Args:
        q: ``(B, H, L, D)`` or ``(B, L, D)``.
        k: ``(B, H_kv, L, D)`` (self-attention: S = L). v: ``(B, H_kv, L, Dv)``.
        block_size: b >= 1 tokens per block.
        mask: ``masks.causal()``, ``masks.padding(lengths)``, their ``&`` or None.
        scale: logit scale s, default 1/√D.

    Returns:
        ``(B, H, L, Dv)`` (3-D in, 3-D out) in q's dtype.

    Raises:
        TypeError: bad input types. ValueError: shape mismatches, S != L, block_size < 1,
            a zero or non-finite scale, a mask other than causal, padding and their ``&``.

    Example:
        >>> q = k = v = torch.randn(1, 4, 1024, 64)
        >>> hierarchical_attention(q, k, v, block_size=32, mask=masks.causal()).shape
        torch.Size([1, 4, 1024, 64])
    """
    dims = check_qkv(q, k, v)
    b = check_int("block_size", block_size, minimum=1)
    if dims.L != dims.S:
        raise ValueError(
            f"hierarchical attention is self-attention: query length L={dims.L} must equal key "
            f"length S={dims.S} (query {tuple(q.shape)}, key {tuple(k.shape)})"
        )
    causal, key_mask = check_kernel_mask(
        mask, None, dims, where="hierarchical_attention", device=q.device
    )
    s = dims.D**-0.5 if scale is None and dims.D else 1.0
    if scale is not None:
        s = check_number("scale", scale, nonzero=True)
    q, k, v = as_4d(q, k, v, dims)
    dtype = stat_dtype(q.dtype)
    L = dims.L
    b = min(b, max(L, 1))
    N = -(-L // b)
    pad = N * b - L
    qb = F.pad(q.to(dtype), (0, 0, 0, pad)).unflatten(1, (dims.H_kv, dims.groups))
    qb = qb.unflatten(-2, (N, b))  # (B, H_kv, G, N, b, D)
    kb = F.pad(k.to(dtype), (0, 0, 0, pad)).unflatten(-2, (N, b))  # (B, H_kv, N, b, D)
    vb = F.pad(v.to(dtype), (0, 0, 0, pad)).unflatten(-2, (N, b))  # (B, H_kv, N, b, Dv)
    blocks = torch.arange(N, device=q.device)
    pos = torch.arange(b, device=q.device)
    live = (blocks[:, None] * b + pos[None, :] < L)[None]  # (1, N, b): real positions
    if key_mask is not None:  # padded keys: no weight, no value, not in a block's mean
        live = live & F.pad(key_mask, (0, pad)).view(-1, N, b)  # (B|1, N, b)
        kb = torch.where(live[:, None, :, :, None], kb, 0.0)
        vb = torch.where(live[:, None, :, :, None], vb, 0.0)
    counts = live.sum(-1).to(dtype)  # (B|1, N) keys per block
    per = counts.clamp(min=1)[:, None, :, None]  # (B|1, 1, N, 1)
    k_bar = kb.sum(dim=-2) / per  # (B, H_kv, N, D), padding adds 0
    v_bar = vb.sum(dim=-2) / per  # (B, H_kv, N, Dv)
    fine = (qb @ kb.unsqueeze(2).transpose(-1, -2)) * s  # (B, H_kv, G, N, b, b)
    coarse = qb @ (k_bar.transpose(-1, -2) * s)[:, :, None, None]  # (B, H_kv, G, N, b, N)
    coarse = coarse + counts.log()[:, None, None, None, None, :]  # log 0 = −inf: no summary
    fine_keep = live[:, None, None, :, None, :]  # (B|1, 1, 1, N, 1, b)
    if causal:
        fine_keep = fine_keep & (pos[None, :] <= pos[:, None])  # (..., N, b, b)
        coarse_keep = (blocks[None, :] < blocks[:, None])[:, None, :]  # (N, 1, N)
    else:
        coarse_keep = (blocks[None, :] != blocks[:, None])[:, None, :]  # (N, 1, N)
    neg_inf = float("-inf")
    fine = fine.masked_fill(~fine_keep, neg_inf)
    coarse = coarse.masked_fill(~coarse_keep, neg_inf)
    logits = torch.cat([fine, coarse], dim=-1)  # (B, H_kv, G, N, b, b + N)
    if key_mask is None:  # every row keeps at least its own token
        p = torch.softmax(logits, dim=-1)
    else:  # a row may have no key left: zeros, not NaN
        dead = (logits == neg_inf).all(dim=-1, keepdim=True)
        p = torch.softmax(logits.masked_fill(dead, 0.0), dim=-1).masked_fill(dead, 0.0)
    out = p[..., :b] @ vb.unsqueeze(2) + p[..., b:] @ v_bar[:, :, None, None]
    out = out.flatten(3, 4)[:, :, :, :L].flatten(1, 2).to(q.dtype)  # (B, H, L, Dv)
    out = out.reshape(dims.B, dims.H, L, dims.Dv)
    return out.squeeze(1) if dims.three_d else out
