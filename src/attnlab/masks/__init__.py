"""Composable attention masks (True = may attend), bottom-right aligned when L != S.

Example:
    >>> from attnlab import masks
    >>> m = masks.causal() & masks.padding([3, 4])
    >>> m.to_dense(4, 4).shape
    torch.Size([2, 1, 4, 4])
"""

from .base import EMPTY, FULL, PARTIAL, FnMask, Mask, TensorMask, from_fn, from_tensor
from .patterns import (
    BigBirdMask,
    CausalMask,
    DocumentMask,
    GlobalLocalMask,
    PaddingMask,
    SlidingWindowMask,
    StridedMask,
    bigbird,
    causal,
    document,
    from_spec,
    global_local,
    padding,
    sliding_window,
    strided,
)

__all__ = [
    "EMPTY",
    "FULL",
    "PARTIAL",
    "BigBirdMask",
    "CausalMask",
    "DocumentMask",
    "FnMask",
    "GlobalLocalMask",
    "Mask",
    "PaddingMask",
    "SlidingWindowMask",
    "StridedMask",
    "TensorMask",
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
]
