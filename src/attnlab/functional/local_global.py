"""Concat(local, global) attention: some heads attend within a sliding window, the others to
every key, and the heads' outputs are concatenated (the text's ``HierarchicalAttention(Q, K, V) =
Concat(LocalAttention(Q, K, V), GlobalAttention(Q, K, V))``, seed 003 §4.3).

With ``H_l`` local heads out of H (a multiple of ``G = H / H_kv``, so a key/value head serves
only local or only global heads), query head h attends::

    o_h = softmax_j(s · q_h,i · k_g(h),j  masked by  M ∧ band(i, j)) v_g(h)     h <  H_l
    o_h = softmax_j(s · q_h,i · k_g(h),j  masked by  M)              v_g(h)     h >= H_l

    band(i, j) = 0 <= p − j < W  (causal window)   or   |p − j| < W,   p = i + S − L

M is the caller's mask (causal, padding, documents …). The local heads run as one
`attnlab.attention` call with ``masks.sliding_window(W) & M`` (the tiled backend's band kernel
once the sizes make it worth it), the global heads as one call with M. Defined to equal
`attnlab.functional.reference.local_global_attention`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._shapes import check_bool, check_int, check_qkv
from ..masks import Mask, from_tensor, sliding_window
from .api import attention

__all__ = ["local_global_attention", "split_heads"]


def split_heads(local_heads: object, H: int, H_kv: int) -> int:
    """Checks ``local_heads`` for H query and H_kv key/value heads; returns it.

    Raises:
        TypeError: not an int. ValueError: outside ``[0, H]`` or not a multiple of ``H / H_kv``.
    """
    G = H // H_kv
    local_heads = check_int("local_heads", local_heads, minimum=0)
    if local_heads > H or local_heads % G:
        raise ValueError(
            f"local_heads must be a multiple of H / H_kv = {G} in [0, H={H}] (a key/value head "
            f"serves local or global heads, not both), got {local_heads}"
        )
    return local_heads


def _head_slice(mask: Mask | Tensor | None, H: int, lo: int, hi: int) -> Mask | None:
    """The caller's mask for query heads ``lo:hi``; a bool tensor becomes a `Mask`."""
    if mask is None or isinstance(mask, Mask):
        return mask
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        got = f"{mask.dtype} tensor" if isinstance(mask, Tensor) else type(mask).__name__
        raise TypeError(
            f"mask must be an attnlab Mask, a bool tensor (True = may attend) or None, got {got}"
        )
    if mask.dim() == 4 and mask.shape[1] == H and H > 1:
        mask = mask[:, lo:hi]  # (B|1, hi − lo, L|1, S)
    return from_tensor(mask)


def local_global_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    local_heads: int,
    window: int,
    mask: Mask | Tensor | None = None,
    causal_window: bool = True,
    scale: float | None = None,
    dropout_p: float = 0.0,
    backend: str = "auto",
    return_weights: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Heads ``0 … H_l − 1`` attend within a window of W keys, the others to every key.

    ``out = concat_h o_h`` over heads, with ``o_h`` as in the module docstring: local heads
    keep ``band(i, j) ∧ M``, global heads ``M``; each row's softmax is over its own head's keys,
    statistics in float32 or wider, a row with no key is zeros. Defined to equal
    `attnlab.functional.reference.local_global_attention`.

    Args:
        q: ``(B, H, L, D)``. k: ``(B, H_kv, S, D)``. v: ``(B, H_kv, S, Dv)``.
        local_heads: H_l, a multiple of ``H / H_kv`` in ``[0, H]``.
        window: W >= 1, the local heads' keys (the query's own position included when causal).
        mask: the caller's mask M (a `Mask` that does not depend on the head, or a bool tensor
            broadcastable to ``(B, H, L, S)``, True = may attend), or None.
        causal_window: True: keys ``p − W < j <= p``; False: ``|p − j| < W``.
        scale: logit scale s, default 1/√D.
        dropout_p: dropout on the weights (training).
        backend: the `attnlab.attention` backend of both calls.
        return_weights: also return the weights ``(B, H, L, S)``.

    Returns:
        ``(B, H, L, Dv)`` in q's dtype, or ``(out, weights)``.

    Raises:
        TypeError / ValueError: q/k/v shapes or dtypes (as `attnlab.attention`), a bad
            ``local_heads`` or ``window``, a mask that is neither a `Mask` nor a bool tensor.
    """
    check_qkv(q, k, v)
    if q.dim() != 4:
        raise ValueError(f"query must be (B, H, L, D), got shape {tuple(q.shape)}")
    H, H_kv = q.shape[1], k.shape[1]
    Hl = split_heads(local_heads, H, H_kv)
    W = check_int("window", window, minimum=1)
    check_bool("causal_window", causal_window)
    check_bool("return_weights", return_weights)
    kl = Hl // (H // H_kv)  # key/value heads of the local heads
    kw = {"scale": scale, "dropout_p": dropout_p, "backend": backend}
    parts = []
    if Hl:
        band = sliding_window(W, causal=causal_window)
        user = _head_slice(mask, H, 0, Hl)
        m_local = band if user is None else band & user
        parts.append(
            attention(
                q[:, :Hl], k[:, :kl], v[:, :kl], mask=m_local, return_weights=return_weights, **kw
            )
        )
    if Hl < H:
        m_global = _head_slice(mask, H, Hl, H)
        parts.append(
            attention(
                q[:, Hl:], k[:, kl:], v[:, kl:], mask=m_global, return_weights=return_weights, **kw
            )
        )
    if not return_weights:
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)  # (B, H, L, Dv)
    out = torch.cat([p[0] for p in parts], dim=1)  # (B, H, L, Dv)
    weights = torch.cat([p[1] for p in parts], dim=1)  # (B, H, L, S)
    return out, weights
