"""Composable attention masks (True = may attend), bottom-right aligned when L != S.

A new structured mask subclasses `Mask` and states its closed form once (`Mask.diagonals`, or
`Mask.mod` plus `key_interval` / `geometry` / `block_codes`): it then gets dense rendering,
exact counts, the tiled backend's block map and FlexAttention's ``mask_mod`` (docs/masks.md).

Example:
    >>> from attnlab import masks
    >>> m = masks.causal() & masks.padding([3, 4])
    >>> m.to_dense(4, 4).shape
    torch.Size([2, 1, 4, 4])
"""

from .base import EMPTY, FULL, PARTIAL, FnMask, Mask, TensorMask, from_fn, from_tensor
from .counts import Geometry
from .patterns import (
    BigBirdMask,
    CausalMask,
    DocumentMask,
    GlobalLocalMask,
    IntervalMask,
    PaddingMask,
    SlidingWindowMask,
    StridedMask,
    WindowMask,
    bigbird,
    causal,
    document,
    from_spec,
    global_local,
    padding,
    sliding_window,
    strided,
    window,
)
from .routing import BlockTableMask

__all__ = [
    "EMPTY",
    "FULL",
    "PARTIAL",
    "BigBirdMask",
    "BlockTableMask",
    "CausalMask",
    "DocumentMask",
    "FnMask",
    "Geometry",
    "GlobalLocalMask",
    "IntervalMask",
    "Mask",
    "PaddingMask",
    "SlidingWindowMask",
    "StridedMask",
    "TensorMask",
    "WindowMask",
    "bigbird",
    "causal",
    "document",
    "from_fn",
    "from_spec",
    "from_tensor",
    "global_local",
    "padding",
    "sliding_window",
    "strided",
    "window",
]
