"""Sinusoidal position encodings of the original Transformer (Vaswani et al., 2017, §3.5)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from .._shapes import check_int, check_number
from ._checks import check_even_dim, check_positions

DEFAULT_BASE = 10000.0


def _frequencies(dim: int, base: float, device: torch.device | None = None) -> Tensor:
    """``ω_i = base^(−2i/dim)`` for i in [0, dim/2), float64, shape ``(dim/2,)``."""
    two_i = torch.arange(0, dim, 2, dtype=torch.float64, device=device)  # (dim/2,)
    return base ** (-two_i / dim)


def _check_periods(periods: object, dim: int, base: float) -> tuple[float, ...] | None:
    """``periods`` as floats: None, or dim/2 finite wavelengths > 0 (then base must be default)."""
    if periods is None:
        return None
    if base != DEFAULT_BASE:
        raise ValueError(f"pass base or periods, not both (got base={base:g} and periods)")
    values = tuple(periods) if isinstance(periods, (list, tuple, Tensor)) else None
    if values is None or len(values) != dim // 2:
        got = len(values) if values is not None else type(periods).__name__
        raise ValueError(f"periods must be a sequence of dim/2 = {dim // 2} wavelengths, got {got}")
    return tuple(check_number(f"periods[{i}]", float(v), greater=0.0) for i, v in enumerate(values))


def _encode(
    positions: Tensor,
    dim: int,
    base: float,
    dtype: torch.dtype,
    amplitude: float = 1.0,
    periods: tuple[float, ...] | None = None,
) -> Tensor:
    """The encoding of integer ``positions`` (any shape), ``(*positions.shape, dim)``.

    Angles and sin/cos are computed in float64 and rounded once to ``dtype``, so the table is as
    accurate as ``dtype`` allows at any position.
    """
    if periods is None:
        omega = _frequencies(dim, base, positions.device)
    else:
        omega = 2 * math.pi / torch.tensor(periods, dtype=torch.float64, device=positions.device)
    angle = positions.to(torch.float64).unsqueeze(-1) * omega  # (..., dim/2)
    # (..., dim/2) -> interleave to (..., dim/2, 2) -> (..., dim): sin at 2i, cos at 2i+1.
    pe = torch.stack((angle.sin(), angle.cos()), dim=-1).flatten(-2)  # (..., dim)
    return (pe * amplitude if amplitude != 1.0 else pe).to(dtype)


def sinusoidal(
    length: int,
    dim: int,
    base: float = DEFAULT_BASE,
    *,
    amplitude: float = 1.0,
    periods: Sequence[float] | Tensor | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> Tensor:
    """The sinusoidal table ``PE[p, 2i] = A·sin(p·ω_i)``, ``PE[p, 2i+1] = A·cos(p·ω_i)``.

    With ``ω_i = base^(−2i/dim)``; sine and cosine are interleaved exactly as in the original
    Transformer, so for ``dim=8`` the row of position 1 reads
    0.84, 0.54, 0.10, 0.99, 0.01, 1.00, 0.00, 1.00.

    Args:
        length: number of positions P (rows), >= 0.
        dim: width E of the encoding, a positive even number.
        base: wavelength base (> 1); wavelengths run from 2π to 2π·base.
        amplitude: A, the scale of every entry (> 0). One frequency pair contributes
            ``p_iᵀp_j = A² cos(ω(i − j))`` to a logit, against content terms of spread
            ``σ²√d`` for embeddings with per-entry variance σ²: positions dominate once
            ``A² ≳ σ²√d`` (seed 004).
        periods: dim/2 wavelengths ``λ_i`` in positions (``ω_i = 2π/λ_i``) instead of the
            geometric series of ``base``. An integer period aliases: ``PE[p + λ] = PE[p]`` in
            that pair; coprime integer periods λ_1…λ_k tell ``λ_1·…·λ_k`` positions apart.
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
    base = check_number("base", base, greater=1.0)
    amplitude = check_number("amplitude", amplitude, greater=0.0)
    checked = _check_periods(periods, dim, base)
    positions = torch.arange(length, device=device)  # (P,)
    return _encode(positions, dim, base, dtype, amplitude, checked)


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
    base = check_number("base", base, greater=1.0)
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
        amplitude, periods: the scale and explicit wavelengths, as in `sinusoidal`.

    Example:
        >>> pe = SinusoidalEmbedding(64)
        >>> x = torch.randn(2, 10, 64)
        >>> (x + pe(10)).shape  # int L means positions 0..L-1
        torch.Size([2, 10, 64])
    """

    def __init__(
        self,
        dim: int,
        base: float = DEFAULT_BASE,
        dtype: torch.dtype = torch.float32,
        *,
        amplitude: float = 1.0,
        periods: Sequence[float] | Tensor | None = None,
    ) -> None:
        super().__init__()
        self.dim = check_even_dim("dim", dim)
        self.base = check_number("base", base, greater=1.0)
        self.dtype = dtype
        self.amplitude = check_number("amplitude", amplitude, greater=0.0)
        self.periods = _check_periods(periods, self.dim, self.base)

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
        return _encode(positions, self.dim, self.base, self.dtype, self.amplitude, self.periods)

    def extra_repr(self) -> str:
        extra = "" if self.amplitude == 1.0 else f", amplitude={self.amplitude:g}"
        if self.periods is not None:
            return f"dim={self.dim}, periods={list(self.periods)}" + extra
        return f"dim={self.dim}, base={self.base:g}" + extra
