"""FNet Fourier token mixing as an `nn.Module` (no parameters)."""

from __future__ import annotations

from torch import Tensor, nn

from ..functional.fnet import fnet_mixing

__all__ = ["FNetMixing"]


class FNetMixing(nn.Module):
    """FNet's replacement for the self-attention sublayer: ``Re(FFT_L(FFT_E(x)))``.

    Computes exactly `attnlab.functional.fnet.fnet_mixing` (the real part of the 2-D DFT over
    the sequence and hidden dims). No parameters; the surrounding block adds the residual,
    layer norm and feed-forward as usual.

    Example:
        >>> mix = FNetMixing()
        >>> mix(torch.randn(2, 128, 64)).shape  # (B, L, E)
        torch.Size([2, 128, 64])
    """

    def forward(self, x: Tensor) -> Tensor:
        """x ``(..., L, E)`` → ``(..., L, E)``."""
        return fnet_mixing(x)
