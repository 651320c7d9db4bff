"""What a self-attention layer attends with: its causal flag ANDed with the caller's mask, and
its rotated queries and keys — through a KV cache when one is given."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..masks import Mask, causal, from_tensor
from .kv_cache import KVCache, check_cache_positions


def layer_mask(is_causal: bool, mask: Mask | Tensor | None) -> Mask | None:
    """``causal() & mask`` for a causal layer, else ``mask``; a bool tensor (True = may attend,
    broadcastable to ``(B, H, L, S)``) becomes `masks.from_tensor` first.

    Args:
        is_causal: whether the layer is causal. mask: the caller's extra mask, or None.

    Returns:
        The mask to attend with (None: every key).
    """
    extra = from_tensor(mask) if isinstance(mask, Tensor) else mask
    if not is_causal:
        return extra
    return causal() if extra is None else causal() & extra


def rotated_through_cache(
    rope: nn.Module,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    positions: Tensor | int | None,
    cache: KVCache | None,
    mask: Mask | None,
) -> tuple[Tensor, Tensor, Tensor, Mask | None]:
    """RoPE on a layer's new queries and keys, with the keys and values appended to ``cache``.

    Without a cache: ``rope(q, positions), rope(k, positions), v, mask``. With one, the new
    ``(k, v)`` are appended (before RoPE, or rotated once at their positions for a
    ``rotate_at_insert`` cache), the queries attend to every cached key (bottom-right aligned:
    the new queries are the last ``L`` positions) and the cache's eviction mask is ANDed with
    ``mask``.

    Args:
        rope: the layer's `attnlab.positional.RoPE`.
        q: new queries ``(B, H, L, D)`` before RoPE. k, v: new keys/values ``(B, H_kv, L, ·)``.
        positions: None (the cache's next positions, or ``0..L−1``), an int start, or integer
            positions ``(L,)`` / ``(B, L)`` (a tensor must be integer with a cache).
        cache: a `KVCache` (or `SlidingWindowCache`, `SinkCache`), or None.
        mask: the layer's mask (`layer_mask`).

    Returns:
        ``(q, k, v, mask)``: rotated ``(B, H, L, D)``, ``(B, H_kv, S, D)`` rotated keys of
        everything cached, ``(B, H_kv, S, ·)`` and the mask to attend with.
    """
    if cache is None:
        return rope(q, positions), rope(k, positions), v, mask
    L = q.shape[2]
    if isinstance(positions, int) and not isinstance(positions, bool):
        positions = torch.arange(positions, positions + L, device=q.device)
    check_cache_positions(positions)
    rotated = getattr(cache, "rotate_at_insert", False) is True
    if rotated:  # rotated once, at the new keys' own positions
        k = rope(k, cache.seen if positions is None else positions)
    view = cache.update(k, v, positions)
    q = rope(q, view.q_positions)
    keys = view.k if rotated else rope(view.k, view.k_positions)
    if view.mask is not None:
        mask = view.mask if mask is None else view.mask & mask
    return q, keys, view.v, mask
