"""Concatenated position encoding: ``x' = [x; p]`` instead of ``x + p`` (seed 003 §3.2)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .._shapes import check_int
from .sinusoidal import SinusoidalEmbedding


class ConcatPositionalEncoding(nn.Module):
    """Appends a position encoding to each embedding: ``x'_i = [x_i; p_i]``, width ``E + E_p``.

    Seed 003 §3.2 ("编码位置信息 ... concat 到输入序列中") names concatenation as the alternative to
    adding. Because the two parts occupy separate coordinates, a dot product splits exactly::

        x'_i · x'_j = x_i · x_j + p_i · p_j

    so with identity projections the logits are a content term plus a position term, with no
    cross terms (adding, ``(x_i + p_i)·(x_j + p_j)``, has the two cross terms too). With learned
    projections ``W = [W_x; W_p]`` the logit is ``x_iᵀ W_x^Q W_x^Kᵀ x_j + p_iᵀ W_p^Q W_p^Kᵀ p_j``
    plus the cross terms through the mixed blocks; the price is a wider model (E + E_p).

    Args:
        encoding: a module mapping positions to ``(..., E_p)`` vectors:
            `SinusoidalEmbedding` or `LearnedPositionalEmbedding` (or any ``fn(positions)``
            module accepting an int L or an integer tensor).
        pos_dim: E_p, the width ``encoding`` returns (``encoding.dim`` when it has one).

    Attributes:
        pos_dim: E_p.

    Example:
        >>> cat = ConcatPositionalEncoding(SinusoidalEmbedding(16))
        >>> cat(torch.randn(2, 10, 64)).shape
        torch.Size([2, 10, 80])
    """

    def __init__(self, encoding: nn.Module, pos_dim: int | None = None) -> None:
        super().__init__()
        if not isinstance(encoding, nn.Module):
            raise TypeError(
                f"encoding must be an nn.Module mapping positions to vectors, got "
                f"{type(encoding).__name__}"
            )
        if pos_dim is None:
            pos_dim = getattr(encoding, "dim", None)
            if pos_dim is None:
                raise ValueError(
                    f"pos_dim is required: encoding {type(encoding).__name__} has no .dim"
                )
        self.pos_dim = check_int("pos_dim", pos_dim, minimum=1)
        self.encoding = encoding

    def forward(self, x: Tensor, positions: Tensor | None = None) -> Tensor:
        """``[x; p]`` along the last dim.

        Args:
            x: ``(B, L, E)`` embeddings.
            positions: integer positions ``(L,)`` or ``(B, L)``; default ``0..L−1``.

        Returns:
            ``(B, L, E + E_p)`` in x's dtype.
        """
        if not isinstance(x, Tensor) or x.dim() != 3:
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"x must be (B, L, E), got {got}")
        B, L, _ = x.shape
        if positions is None:
            if isinstance(self.encoding, SinusoidalEmbedding):  # holds no tensors: say where
                p = self.encoding(L, device=x.device)  # (L, E_p)
            else:
                p = self.encoding(L)  # (L, E_p)
        else:
            if not isinstance(positions, Tensor) or positions.shape[-1] != L or positions.dim() > 2:
                got = tuple(positions.shape) if isinstance(positions, Tensor) else positions
                raise ValueError(f"positions must be (L,) or (B, L) with L={L}, got {got}")
            p = self.encoding(positions)  # (L, E_p) or (B, L, E_p)
        if p.shape[-1] != self.pos_dim:
            raise ValueError(
                f"encoding returned width {p.shape[-1]}, expected pos_dim={self.pos_dim}"
            )
        p = p.to(device=x.device, dtype=x.dtype).expand(B, L, self.pos_dim)  # (B, L, E_p)
        return torch.cat([x, p], dim=-1)  # (B, L, E + E_p)

    def extra_repr(self) -> str:
        return f"pos_dim={self.pos_dim}"
