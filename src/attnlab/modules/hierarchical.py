"""Two-level hierarchical attention as an `nn.Module` (no parameters)."""

from __future__ import annotations

from torch import Tensor, nn

from .._shapes import check_int, check_number
from ..functional.hierarchical import hierarchical_attention
from ..masks import Mask

__all__ = ["HierarchicalAttention"]


class HierarchicalAttention(nn.Module):
    """Exact attention inside blocks of ``block_size`` tokens, block means across blocks.

    Computes exactly `attnlab.functional.hierarchical.hierarchical_attention` (see its module
    docstring for the definition): O(L·(b + L/b)) time and memory.

    Args:
        block_size: b >= 1 tokens per block (b ≈ √L minimises the cost).
        scale: logit scale, default 1/√D.

    Example:
        >>> attn = HierarchicalAttention(block_size=32)
        >>> q = k = v = torch.randn(1, 4, 1024, 64)
        >>> attn(q, k, v, mask=masks.causal()).shape
        torch.Size([1, 4, 1024, 64])
    """

    def __init__(self, block_size: int, *, scale: float | None = None):
        super().__init__()
        self.block_size = check_int("block_size", block_size, minimum=1)
        self.scale = None if scale is None else check_number("scale", scale, nonzero=True)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, mask: Mask | None = None) -> Tensor:
        """q ``(B, H, L, D)``, k ``(B, H_kv, L, D)``, v ``(B, H_kv, L, Dv)`` → ``(B, H, L, Dv)``.

        mask: ``masks.causal()`` (own block ``j <= i``, earlier blocks only),
        ``masks.padding(lengths)``, their ``&`` or None.
        """
        return hierarchical_attention(
            q, k, v, block_size=self.block_size, mask=mask, scale=self.scale
        )

    def extra_repr(self) -> str:
        return f"block_size={self.block_size}, scale={self.scale}"
