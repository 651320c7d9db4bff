"""FNet token mixing (Lee-Thorp et al., 2022): the real part of a 2-D DFT over sequence and hidden.

``fnet_mixing(X) = Re(F_L X F_E)``, computed with ``torch.fft.fft2`` in O(L·E·log(L·E)).
Defined to equal `reference.fnet_mixing` (explicit DFT matrices). No parameters: FNet replaces
the self-attention sublayer of an encoder block with this mixing.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._shapes import stat_dtype

__all__ = ["fnet_mixing"]

_FLOAT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def fnet_mixing(x: Tensor) -> Tensor:
    """Fourier token mixing ``Re(FFT_L(FFT_E(x)))`` over the last two dims.

    Equals ``C_L X C_E − S_L X S_E`` with ``C_n, S_n`` the cos/sin DFT matrices
    (`attnlab.functional.reference.fnet_mixing`). Computed in float32 (float64 for float64
    inputs) and returned in x's dtype. Not normalised, as in FNet: entries grow like √(L·E).

    Args:
        x: real ``(..., L, E)`` (e.g. ``(B, L, E)`` hidden states), rank >= 2.

    Returns:
        ``(..., L, E)`` in x's dtype.

    Raises:
        TypeError: x is not a real floating tensor.
        ValueError: x has rank < 2.

    Example:
        >>> fnet_mixing(torch.randn(2, 128, 64)).shape
        torch.Size([2, 128, 64])
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(
            f"x dtype must be one of float64, float32, float16, bfloat16, got {x.dtype}"
        )
    if x.dim() < 2:
        raise ValueError(f"x must have rank >= 2 (..., L, E), got shape {tuple(x.shape)}")
    if x.numel() == 0:
        return x * 0.0  # (..., L, E), keeps the autograd graph
    xc = x.to(stat_dtype(x.dtype))
    return torch.fft.fft2(xc, dim=(-2, -1)).real.to(x.dtype)  # (..., L, E)
