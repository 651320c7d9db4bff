"""`StreamLinear`: ``nn.Linear`` whose decode steps (a few rows, no autograd) stream its weight.

The same parameters, initialisation, ``state_dict`` and hooks as ``nn.Linear`` (it is one);
only `forward` differs: it calls `attnlab.functional.gemv.linear`, which runs attnlab's
streaming kernel for at most eight rows without autograd and ``torch.nn.functional.linear``
otherwise (training, prefill, long inputs, other dtypes and devices, ``torch.compile``).
"""

from __future__ import annotations

from torch import Tensor, nn

from ..functional import gemv


class StreamLinear(nn.Linear):
    """``y = x·Wᵀ + b``, ``(..., in_features) -> (..., out_features)``; see the module."""

    def forward(self, input: Tensor) -> Tensor:
        """``(..., in_features) -> (..., out_features)``."""
        return gemv.linear(input, self.weight, self.bias)


__all__ = ["StreamLinear"]
