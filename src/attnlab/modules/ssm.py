"""A Mamba-style selective state-space layer: the mixer of a Mamba block (Gu & Dao, 2023)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._shapes import check_int, check_number
from ..functional.selective_scan import DEFAULT_SCAN_CHUNK, implicit_matrix, selective_scan

__all__ = ["SelectiveSSM"]


class SelectiveSSM(nn.Module):
    """Mamba's mixer: projection, causal depthwise conv, selective scan, SiLU gate, projection.

    For x ``(B, L, E_model)``, with ``E = expand · E_model`` inner channels and N states each::

        u, z = split(x W_in)                             # (B, L, E) each
        u = silu(causal_depthwise_conv(u))               # kernel d_conv
        Δ, B, C = u W_Δ (rank R → E, softplus), u W_B, u W_C   # input-dependent
        y_t = selective_scan(u, Δ, A, B, C, D, z)        # h_t = exp(Δ_t A) h_{t−1} + Δ_t B_t u_t
        out = y W_out                                    # (B, L, E_model)

    ``A = −exp(A_log)`` is diagonal, real and negative (S4D-real init ``A[e, n] = −(n + 1)``);
    ``Δ`` is initialised in ``[dt_min, dt_max]`` log-uniformly through the bias of its
    projection, as in Mamba. The state of the whole layer is ``E × N`` numbers per sequence,
    whatever L: a fixed-size memory. Causal: out_t depends on ``x_{≤t}`` only.

    Args:
        d_model: E_model, the width of x.
        d_state: N states per channel.
        d_conv: kernel of the causal depthwise convolution.
        expand: E = expand · d_model.
        dt_rank: R, the rank of Δ's projection; None = ⌈d_model / 16⌉.
        dt_min, dt_max: the range of the initial Δ.
        chunk_size: positions per chunk of the scan, None = ⌈√L⌉ (speed only).

    Example:
        >>> ssm = SelectiveSSM(d_model=32, d_state=8)
        >>> ssm(torch.randn(2, 50, 32)).shape
        torch.Size([2, 50, 32])
    """

    def __init__(
        self,
        d_model: int,
        d_state: int = 16,
        d_conv: int = 4,
        expand: int = 2,
        *,
        dt_rank: int | None = None,
        dt_min: float = 1e-3,
        dt_max: float = 0.1,
        chunk_size: int | None = DEFAULT_SCAN_CHUNK,
    ) -> None:
        super().__init__()
        self.d_model = check_int("d_model", d_model, minimum=1)
        self.d_state = check_int("d_state", d_state, minimum=1)
        self.d_conv = check_int("d_conv", d_conv, minimum=1)
        self.expand = check_int("expand", expand, minimum=1)
        rank = math.ceil(d_model / 16) if dt_rank is None else dt_rank
        self.dt_rank = check_int("dt_rank", rank, minimum=1)
        lo = check_number("dt_min", dt_min, positive=True)
        hi = check_number("dt_max", dt_max, at_least=lo)
        if chunk_size is not None:
            check_int("chunk_size", chunk_size, minimum=1)
        self.chunk_size = chunk_size
        E, N = expand * d_model, d_state
        self.d_inner = E
        self.in_proj = nn.Linear(d_model, 2 * E, bias=False)
        self.conv1d = nn.Conv1d(E, E, d_conv, groups=E, padding=d_conv - 1)
        self.x_proj = nn.Linear(E, self.dt_rank + 2 * N, bias=False)
        self.dt_proj = nn.Linear(self.dt_rank, E, bias=True)
        self.out_proj = nn.Linear(E, d_model, bias=False)
        with torch.no_grad():
            dt = torch.exp(torch.rand(E) * (math.log(hi) - math.log(lo)) + math.log(lo))
            self.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus⁻¹(dt)
        a = torch.arange(1, N + 1, dtype=torch.float32).repeat(E, 1)  # (E, N)
        self.A_log = nn.Parameter(torch.log(a))
        self.D = nn.Parameter(torch.ones(E))

    def _scan_inputs(self, x: Tensor) -> tuple[Tensor, ...]:
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != self.d_model:
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"x: expected (B, L, {self.d_model}), received {shape}")
        L, N, R = x.shape[1], self.d_state, self.dt_rank
        u, z = self.in_proj(x).transpose(1, 2).chunk(2, dim=1)  # (B, E, L) each
        u = F.silu(self.conv1d(u)[..., :L])  # causal: the conv's left padding only
        dt, Bm, Cm = self.x_proj(u.transpose(1, 2)).split([R, N, N], dim=-1)  # (B, L, ·)
        delta = (dt @ self.dt_proj.weight.T).transpose(1, 2)  # (B, E, L), bias added in scan
        A = -torch.exp(self.A_log.float())  # (E, N)
        return u, delta, A, Bm.transpose(1, 2), Cm.transpose(1, 2), z  # B, C: (B, N, L)

    def forward(self, x: Tensor) -> Tensor:
        """x ``(B, L, d_model)`` → ``(B, L, d_model)``."""
        u, delta, A, Bm, Cm, z = self._scan_inputs(x)
        y = selective_scan(
            u,
            delta,
            A,
            Bm,
            Cm,
            self.D.float(),
            z,
            delta_bias=self.dt_proj.bias.float(),
            delta_softplus=True,
            chunk_size=self.chunk_size,
        )
        return self.out_proj(y.transpose(1, 2))  # (B, L, d_model)

    @torch.no_grad()
    def implicit_matrix(self, x: Tensor, *, skip: bool = True) -> Tensor:
        """The scan's mixing matrix for input x: ``y_i = Σ_j M_ij u_j`` per inner channel, before
        the gate (``implicit_matrix`` of ``attnlab/functional/selective_scan.py``), shape
        ``(B, E, L, L)``; ``skip=False`` leaves out the D term on the diagonal."""
        _, delta, A, Bm, Cm, _ = self._scan_inputs(x)
        D = self.D.float() if skip else None
        return implicit_matrix(delta, A, Bm, Cm, D, self.dt_proj.bias.float(), True)

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, d_state={self.d_state}, d_conv={self.d_conv}, "
            f"expand={self.expand}, dt_rank={self.dt_rank}"
        )
