"""ALiBi: attention with linear biases (Press et al., 2022, "Train Short, Test Long")."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .._shapes import check_bool, check_head_index, check_int
from ._grid import dense_bias


def alibi_slopes(num_heads: int) -> list[float]:
    """The per-head slopes of the ALiBi paper.

    For n a power of two the slopes are the geometric sequence ``2^(−8/n), 2^(−16/n), …, 2^(−8)``
    (8 heads: 1/2, 1/4, …, 1/256). Otherwise the paper takes the sequence of the largest power of
    two m < n and appends every other slope of the sequence for 2m, ``n − m`` of them.

    Args:
        num_heads: n >= 1.

    Returns:
        n floats, largest first.
    """
    num_heads = check_int("num_heads", num_heads, minimum=1)

    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)  # = 2^(−2^−(log2(n) − 3)) of the paper
        return [start * start**k for k in range(n)]

    m = 2 ** math.floor(math.log2(num_heads))
    slopes = power_of_two(m)
    if m < num_heads:
        slopes += power_of_two(2 * m)[0::2][: num_heads - m]
    return slopes


class ALiBi(nn.Module):
    """ALiBi as a function bias: ``bias[h, i, j] = −slope_h · (i − j)``, or ``−slope_h · |i − j|``.

    The first form is for causal attention, the second for bidirectional attention.

    Use it directly as ``attnlab.attention(q, k, v, bias=alibi)``: it is evaluated on the index
    tensors of the call (``i`` = query position aligned bottom-right to the keys, ``j`` = key
    position) and depends only on their values, so a tiled backend can evaluate it per tile and
    never materialise the full ``(H, L, S)`` matrix. With ``causal=True`` keys after the query get
    a positive bias; pass ``mask=attnlab.masks.causal()`` as well, as the paper does.

    Slopes are constants (not parameters or buffers): ``.to(bfloat16)`` cannot round them, and
    the bias is computed in ``dtype`` (float32 by default; use float64 for float64 work). The
    reference and sdpa backends cast it to the query dtype; the flash backend adds it in its float32
    compute dtype for float16/bfloat16 queries, where bfloat16 would round distant biases by
    whole units (−0.5 · 600 has a bfloat16 step of 2).

    Args:
        num_heads: H, the number of query heads of the attention call.
        causal: True for decoders (``−slope·(i−j)``), False for encoders (``−slope·|i−j|``).
        dtype: dtype the bias is computed and returned in.

    Attributes:
        relative: True: the bias depends only on the head and ``j − i`` (`is_relative_bias`), so
            the flash backend shares one bias tile across all query blocks of a window offset.

    Example:
        >>> alibi = ALiBi(8)
        >>> q = k = v = torch.randn(1, 8, 16, 32)
        >>> out = attnlab.attention(q, k, v, mask=attnlab.masks.causal(), bias=alibi)
    """

    relative = True

    def __init__(
        self, num_heads: int, causal: bool = True, dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        self.num_heads = check_int("num_heads", num_heads, minimum=1)
        check_bool("causal", causal)
        if not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating dtype, got {dtype}")
        self.causal = causal
        self.dtype = dtype
        self._slopes = torch.tensor(alibi_slopes(self.num_heads), dtype=torch.float64)  # (H,)

    @property
    def slopes(self) -> Tensor:
        """``(H,)`` float64 slopes, as in the paper (see `alibi_slopes`)."""
        return self._slopes.clone()

    def forward(self, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:  # noqa: ARG002 (a bias function is fn(b, h, i, j))
        """The bias on broadcastable Long index tensors.

        Args:
            b: batch index ``(B, 1, 1, 1)`` (unused: ALiBi is the same for every batch item).
            h: head index ``(1, H, 1, 1)``.
            i: query position aligned to key coordinates ``(1, 1, L, 1)``.
            j: key position ``(1, 1, 1, S)``.

        Returns:
            Float tensor broadcastable to ``(B, H, L, S)``; here ``(1, H, L, S)``.
        """
        check_head_index("ALiBi", self.num_heads, h)
        slope = self._slopes.to(device=h.device, dtype=self.dtype)[h]  # (1, H, 1, 1)
        distance = (i - j).to(self.dtype)  # (1, 1, L, S)
        if not self.causal:
            distance = distance.abs()
        return -slope * distance  # (1, H, L, S)

    def matrix(
        self, L: int, S: int | None = None, *, device: torch.device | str | None = None
    ) -> Tensor:
        """Dense bias ``(H, L, S)`` aligned bottom-right (``i = row + S − L``), for pictures."""
        return dense_bias(self, self.num_heads, L, S, device)

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, causal={self.causal}"
