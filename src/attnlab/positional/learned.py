"""Learned absolute position embeddings (BERT, GPT-2): one trainable vector per position."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .._shapes import check_int
from ._checks import check_positions


class LearnedPositionalEmbedding(nn.Module):
    """A table of ``max_len`` trainable vectors: ``forward(positions) = W[positions]``.

    Positions outside ``[0, max_len)`` raise instead of wrapping or reading garbage.

    Args:
        max_len: number of positions the table holds (P).
        dim: width E of each vector.
        init_std: standard deviation of the normal initialisation (BERT and GPT-2 use 0.02).

    Attributes:
        weight: ``(P, E)`` parameter.

    Example:
        >>> emb = LearnedPositionalEmbedding(512, 64)
        >>> emb(torch.arange(10)).shape
        torch.Size([10, 64])
    """

    def __init__(self, max_len: int, dim: int, init_std: float = 0.02) -> None:
        super().__init__()
        self.max_len = check_int("max_len", max_len, minimum=1)
        self.dim = check_int("dim", dim, minimum=1)
        self.weight = nn.Parameter(torch.empty(self.max_len, self.dim))
        nn.init.normal_(self.weight, std=init_std)

    def forward(self, positions: Tensor | int) -> Tensor:
        """Looks up position vectors.

        Args:
            positions: integer tensor of any shape with values in ``[0, max_len)``, or an int L
                meaning positions ``0..L−1``.

        Returns:
            ``(*positions.shape, E)`` in the parameter dtype.

        Raises:
            ValueError: a position >= max_len or < 0 (the message names both numbers). The range
                check reads the positions back to the host, so it runs in eager mode only (skipped
                under `torch.compile`/`torch.export` and for ``meta`` tensors).
        """
        if isinstance(positions, int) and not isinstance(positions, bool):
            length = check_int("positions", positions, minimum=0)
            if length > self.max_len:
                raise ValueError(
                    f"position {length - 1} is out of range for LearnedPositionalEmbedding with "
                    f"max_len={self.max_len} (positions must be < {self.max_len})"
                )
            positions = torch.arange(length, device=self.weight.device)  # (L,): checked above
            return self.weight[positions]  # (L, E)
        positions = check_positions("positions", positions)
        if positions.numel() and not (torch.compiler.is_compiling() or positions.is_meta):
            hi, lo = int(positions.max()), int(positions.min())
            if hi >= self.max_len:
                raise ValueError(
                    f"position {hi} is out of range for LearnedPositionalEmbedding with "
                    f"max_len={self.max_len} (positions must be < {self.max_len})"
                )
            if lo < 0:
                raise ValueError(f"positions must be >= 0, got {lo}")
        return self.weight[positions.to(device=self.weight.device, dtype=torch.long)]  # (..., E)

    def extra_repr(self) -> str:
        return f"max_len={self.max_len}, dim={self.dim}"
