"""Sinusoidal position encodings of the original Transformer (Vaswani et al., 2017, §3.5)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ._checks import check_even_dim, check_int, check_positions, check_real


def _frequencies(dim: int, base: float, device: torch.device | None = None) -> Tensor:
    """``ω_i = base^(−2i/dim)`` for i in [0, dim/2), float64, shape ``(dim/2,)``."""
    two_i = torch.arange(0, dim, 2, dtype=torch.float64, device=device)  # (dim/2,)
    return base ** (-two_i / dim)


def _encode(positions: Tensor, dim: int, base: float, dtype: torch.dtype) -> Tensor:
    """The encoding of integer ``positions`` (any shape), ``(*positions.shape, dim)``.

    Angles and sin/cos are computed in float64 and rounded once to ``dtype``, so the table is as
    accurate as ``dtype`` allows at any position.
    """
    angle = positions.to(torch.float64).unsqueeze(-1) * _frequencies(dim, base, positions.device)
    # (..., dim/2) -> interleave to (..., dim/2, 2) -> (..., dim): sin at 2i, cos at 2i+1.
    pe = torch.stack((angle.sin(), angle.cos()), dim=-1).flatten(-2)  # (..., dim)
    return pe.to(dtype)


def sinusoidal(
    length: int,
    dim: int,
    base: float = 10000.0,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> Tensor:
    """The sinusoidal table ``PE[p, 2i] = sin(p·ω_i)``, ``PE[p, 2i+1] = cos(p·ω_i)``.

    With ``ω_i = base^(−2i/dim)``; sine and cosine are interleaved exactly as in the original
    Transformer, so for ``dim=8`` the row of position 1 reads
    0.84, 0.54, 0.10, 0.99, 0.01, 1.00, 0.00, 1.00.

    Args:
        length: number of positions P (rows), >= 0.
        dim: width E of the encoding, a positive even number.
        base: wavelength base (> 1); wavelengths run from 2π to 2π·base.
        dtype: dtype of the result (computed in float64 and rounded once).
        device: device of the result.

    Returns:
        ``(P, E)`` tensor.

    Raises:
        ValueError: odd or non-positive ``dim``, negative ``length``, ``base <= 1``.

    Example:
        >>> sinusoidal(2, 8)[1]
        tensor([0.8415, 0.5403, 0.0998, 0.9950, 0.0100, 0.9999, 0.0010, 1.0000])
    """
    length = check_int("length", length, minimum=0)
    dim = check_even_dim("dim", dim)
    base = check_real("base", base, greater=1.0)
    positions = torch.arange(length, device=device)  # (P,)
    return _encode(positions, dim, base, dtype)


def sinusoidal_shift(offset: int, dim: int, base: float = 10000.0) -> Tensor:
    """The fixed linear map ``M_k`` with ``PE[p + k] = M_k · PE[p]`` for every position p.

    Block diagonal with one 2×2 rotation per frequency ω_i::

        [sin((p+k)ω)]   [ cos kω   sin kω] [sin pω]
        [cos((p+k)ω)] = [−sin kω   cos kω] [cos pω]

    Args:
        offset: the shift k (any integer).
        dim: width E of the encoding (even).
        base: the base used for the table.

    Returns:
        ``(E, E)`` float64 matrix.
    """
    offset = check_int("offset", offset)
    dim = check_even_dim("dim", dim)
    base = check_real("base", base, greater=1.0)
    angle = offset * _frequencies(dim, base)  # (E/2,)
    c, s = angle.cos(), angle.sin()
    blocks = torch.stack((torch.stack((c, s), -1), torch.stack((-s, c), -1)), -2)  # (E/2, 2, 2)
    return torch.block_diag(*blocks)  # (E, E)


class SinusoidalEmbedding(nn.Module):
    """Fixed sinusoidal position encodings as a module: ``forward(positions) -> PE[positions]``.

    Has no parameters and no buffers; encodings are computed on demand in float64 and returned
    in ``dtype``, so any integer position works (no maximum length) and ``.to(bfloat16)`` cannot
    degrade the table.

    Args:
        dim: width E of the encoding (even; an odd value raises ValueError).
        base: wavelength base (> 1).
        dtype: dtype of the returned encodings.

    Example:
        >>> pe = SinusoidalEmbedding(64)
        >>> x = torch.randn(2, 10, 64)
        >>> (x + pe(10)).shape  # int L means positions 0..L-1
        torch.Size([2, 10, 64])
    """

    def __init__(self, dim: int, base: float = 10000.0, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.dim = check_even_dim("dim", dim)
        self.base = check_real("base", base, greater=1.0)
        self.dtype = dtype

    def forward(
        self, positions: Tensor | int, *, device: torch.device | str | None = None
    ) -> Tensor:
        """Encodes positions.

        Args:
            positions: integer tensor of any shape, or an int L meaning positions ``0..L−1``.
            device: where to build the encoding of an int L (the module holds no tensors to
                follow; default cpu). A tensor's encoding is on that tensor's device.

        Returns:
            ``(*positions.shape, E)``, or ``(L, E)`` for an int.
        """
        if isinstance(positions, int) and not isinstance(positions, bool):
            length = check_int("positions", positions, minimum=0)
            positions = torch.arange(length, device=device)  # (L,)
        elif device is not None:
            raise ValueError(
                "device is for an int L; a positions tensor's encoding is on its own device "
                f"({positions.device}), got device={device!r}"
            )
        positions = check_positions("positions", positions)
        return _encode(positions, self.dim, self.base, self.dtype)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, base={self.base:g}"
