"""The mask of a self-attention layer: its own causal flag ANDed with the caller's mask."""

from __future__ import annotations

from torch import Tensor

from ..masks import Mask, causal, from_tensor


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
