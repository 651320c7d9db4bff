"""The selective scan of Mamba (Gu & Dao, 2023): a diagonal linear recurrence whose step size,
input and output matrices depend on the input.

For every batch item and channel e (of E), with a state ``h_t`` of N numbers::

    Δ_t = softplus(delta_t + delta_bias)           (or delta_t without ``delta_softplus``)
    h_t = exp(Δ_t A) ⊙ h_{t−1} + Δ_t B_t u_t      (ZOH for A, Euler for B; h_0 = 0)
    y_t = C_t · h_t + D u_t,    out_t = y_t · silu(z_t)   (each term when given)

A ``(E, N)`` is real and negative (each state decays); B and C are fixed ``(E, N)`` or chosen
per position: ``(B, N, L)`` (shared by every channel) or ``(B, G, N, L)`` (one per group of
E / G channels). The argument names and shapes follow ``selective_scan_ref`` of the
``mamba_ssm`` package, whose documentation calls the channels D (here E, since D is the skip
weight). Defined to equal `attnlab.functional.reference.selective_scan` (the sequential loop).

The fast form here is a chunked scan in plain PyTorch: every chunk of T positions runs its
recurrence from a zero state at once (T small steps), a short loop carries the ``(B, E, N)``
state across chunks, and cumulative sums of the log-decays ``Δ A`` add the carried state's
share to every output — about 2√L small steps instead of L, and no ``(B, E, L, N)`` tensor of
states. No value is read on the host, so
``torch.compile(fullgraph=True)`` traces it; an output never depends on a later input (NaN
included). `implicit_matrix` writes the same map as ``y = M u``: the SSM's attention-like
matrix.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .._shapes import check_bool, check_int, stat_dtype

__all__ = [
    "DEFAULT_SCAN_CHUNK",
    "check_selective_scan",
    "implicit_matrix",
    "scan_matrix",
    "selective_scan",
]

DEFAULT_SCAN_CHUNK = None
"""Positions per chunk of the fast scan: None = ⌈√L⌉ (speed only; the result does not depend
on it)."""

_FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def _tensor(name: str, t: object, shape: str) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor {shape}, received {type(t).__name__}")
    if t.dtype not in _FLOATS:
        raise TypeError(f"{name}: expected a real floating dtype, received {t.dtype}")
    return t


def _matrix_shape(name: str, t: Tensor, batch: int, E: int, N: int, L: int) -> None:
    ok = (
        (t.dim() == 2 and tuple(t.shape) == (E, N))
        or (t.dim() == 3 and tuple(t.shape) == (batch, N, L))
        or (
            t.dim() == 4
            and (t.shape[0], t.shape[2], t.shape[3]) == (batch, N, L)
            and t.shape[1] >= 1
            and E % t.shape[1] == 0
        )
    )
    if not ok:
        raise ValueError(
            f"{name}: expected (E, N) = {(E, N)}, (B, N, L) = {(batch, N, L)} or (B, G, N, L) "
            f"with G dividing E = {E}, received {tuple(t.shape)}"
        )


def check_selective_scan(
    u: object,
    delta: object,
    A: object,
    B: object,
    C: object,
    D: object = None,
    z: object = None,
    delta_bias: object = None,
) -> tuple[int, int, int, int]:
    """Checks the arguments of `selective_scan` before any work.

    Returns:
        ``(batch, E, L, N)``.

    Raises:
        TypeError: a non-tensor or a non-float dtype. ValueError: a shape that does not fit,
        an empty sequence, or tensors on different devices.
    """
    u = _tensor("u", u, "(B, E, L)")
    if u.dim() != 3 or u.shape[2] < 1:
        raise ValueError(f"u: expected (B, E, L) with L >= 1, received {tuple(u.shape)}")
    batch, E, L = u.shape
    delta = _tensor("delta", delta, "(B, E, L)")
    if delta.shape != u.shape:
        raise ValueError(
            f"delta: expected u's shape {tuple(u.shape)}, received {tuple(delta.shape)}"
        )
    A = _tensor("A", A, "(E, N)")
    if A.dim() != 2 or A.shape[0] != E:
        raise ValueError(f"A: expected (E, N) with E = {E}, received {tuple(A.shape)}")
    N = A.shape[1]
    tensors = [("u", u), ("delta", delta), ("A", A)]
    for name, t in (("B", B), ("C", C)):
        _matrix_shape(name, _tensor(name, t, "(E, N), (B, N, L) or (B, G, N, L)"), batch, E, N, L)
        tensors.append((name, t))
    for name, t, shape in (
        ("D", D, (E,)),
        ("z", z, (batch, E, L)),
        ("delta_bias", delta_bias, (E,)),
    ):
        if t is None:
            continue
        t = _tensor(name, t, str(shape))
        if tuple(t.shape) != shape:
            raise ValueError(f"{name}: expected shape {shape}, received {tuple(t.shape)}")
        tensors.append((name, t))
    for name, t in tensors:
        if t.device != u.device:
            raise ValueError(
                f"{name}: expected a tensor on u's device {u.device}, received {t.device}"
            )
    return batch, E, L, N


def scan_matrix(X: Tensor, E: int, dtype: torch.dtype) -> Tensor:
    """B or C as ``(B|1, E|1, N, L|1)`` in ``dtype``: a fixed ``(E, N)`` matrix, one ``(B, N,
    L)`` shared by every channel, or ``(B, G, N, L)`` repeated over the E / G channels of each
    group (channel e belongs to group ``e // (E / G)``)."""
    X = X.to(dtype)
    if X.dim() == 2:
        return X[None, :, :, None]  # (1, E, N, 1)
    if X.dim() == 3:
        return X[:, None]  # (B, 1, N, L)
    return X.repeat_interleave(E // X.shape[1], dim=1)  # (B, E, N, L)


def _step_sizes(delta: Tensor, delta_bias: Tensor | None, softplus: bool, dtype) -> Tensor:
    dt = delta.to(dtype)
    if delta_bias is not None:
        dt = dt + delta_bias.to(dtype)[:, None]
    return F.softplus(dt) if softplus else dt  # (B, E, L)


def _chunk_scan(
    dt: Tensor, du: Tensor, A: Tensor, Bt: Tensor, Ct: Tensor, chunk: int | None
) -> tuple[Tensor, Tensor]:
    """The scan ``h_t = exp(Δ_t A) ⊙ h_{t−1} + Δ_t u_t B_t`` (h_0 = 0), ``y_t = C_t · h_t``.

    Args: dt, du: Δ and Δ·u ``(B, E, L)``. A: ``(E, N)``. Bt, Ct: ``(B|1, E|1, L|1, N)``.

    Chunks of T positions (default ⌈√L⌉): (1) inside every chunk at once, the recurrence from a
    zero state, T small steps; (2) across chunks, the carried state, one small step per chunk;
    (3) the carried state's share of each output, ``C_t · exp(A Σ_{s≤t in chunk} Δ_s) ⊙ H_in``,
    from cumulative sums of the log-decays. Position t reads positions ≤ t only. Returns
    y ``(B, E, L)`` and ``h_L (B, E, N)``.
    """
    batch, E, L = dt.shape
    T = min(chunk or math.isqrt(L - 1) + 1, L)
    nc = -(-L // T)
    pad = nc * T - L  # padded positions: Δ = 0, input 0 (the state passes unchanged)

    def chunks(x: Tensor) -> Tensor:  # (B, E, L[, N]) -> (T, B, E, nc[, N])
        if x.dim() == 4 and x.shape[2] == 1:
            return x[:, :, None].movedim(3, 0)
        x = F.pad(x, (0, 0, 0, pad) if x.dim() == 4 else (0, pad))
        x = x.reshape(x.shape[0], x.shape[1], nc, T, *x.shape[3:])
        return x.movedim(3, 0).contiguous()

    dtc, duc, Bc, Cc = chunks(dt), chunks(du), chunks(Bt), chunks(Ct)
    An = A[:, None, :]  # (E, 1, N)
    h = du.new_zeros(batch, E, nc, A.shape[1])
    local = []
    for t in range(T):  # (1) every chunk at once, from a zero state
        h = torch.exp(dtc[t][..., None] * An) * h + duc[t][..., None] * Bc[min(t, len(Bc) - 1)]
        local.append((h * Cc[min(t, len(Cc) - 1)]).sum(-1))  # (B, E, nc)
    decay = torch.exp(torch.cumsum(dtc, dim=0)[..., None] * An)  # (T, B, E, nc, N)
    state, entering = du.new_zeros(batch, E, A.shape[1]), []
    for k in range(nc):  # (2) the state entering each chunk
        entering.append(state)
        state = decay[-1, :, :, k] * state + h[:, :, k]
    carried = (Cc * decay * torch.stack(entering, dim=2)).sum(-1)  # (3) (T, B, E, nc)
    y = (torch.stack(local) + carried).movedim(0, 3).reshape(batch, E, nc * T)
    return y[:, :, :L], state


def selective_scan(
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    z: Tensor | None = None,
    delta_bias: Tensor | None = None,
    delta_softplus: bool = False,
    return_last_state: bool = False,
    *,
    chunk_size: int | None = DEFAULT_SCAN_CHUNK,
) -> Tensor | tuple[Tensor, Tensor]:
    """Mamba's selective scan, as a chunked parallel scan (module docstring).

    ``h_t = exp(Δ_t A) ⊙ h_{t−1} + Δ_t B_t u_t``, ``y_t = C_t · h_t + D u_t``, times
    ``silu(z_t)``; defined to equal `attnlab.functional.reference.selective_scan`. Computed in
    float32 or wider, returned in u's dtype.

    Args:
        u: the input ``(B, E, L)``. delta: Δ before ``delta_bias`` / softplus, ``(B, E, L)``.
        A: ``(E, N)``, real (negative for a decaying state).
        B: ``(E, N)``, ``(B, N, L)`` or ``(B, G, N, L)``. C: the same choices as B.
        D: the skip weight ``(E,)`` or None. z: the gate ``(B, E, L)`` or None.
        delta_bias: ``(E,)`` added to delta, or None. delta_softplus: apply softplus to Δ.
        return_last_state: also return ``h_L`` ``(B, E, N)`` (float32 or wider).
        chunk_size: positions per chunk, None = ⌈√L⌉ (speed only).

    Returns:
        ``out (B, E, L)`` in u's dtype, and ``h_L`` with ``return_last_state``.

    Raises:
        TypeError / ValueError: bad arguments, before any work (`check_selective_scan`).
    """
    _, E, _, _ = check_selective_scan(u, delta, A, B, C, D, z, delta_bias)
    check_bool("delta_softplus", delta_softplus)
    check_bool("return_last_state", return_last_state)
    if chunk_size is not None:
        check_int("chunk_size", chunk_size, minimum=1)
    dtype = stat_dtype(u.dtype)
    dt = _step_sizes(delta, delta_bias, delta_softplus, dtype)  # (B, E, L)
    Bt = scan_matrix(B, E, dtype).transpose(-1, -2)  # (B|1, E|1, L|1, N)
    Ct = scan_matrix(C, E, dtype).transpose(-1, -2)
    du = dt * u.to(dtype)  # (B, E, L)
    y, last = _chunk_scan(dt, du, A.to(dtype), Bt, Ct, chunk_size)  # (B, E, L), (B, E, N)
    if D is not None:
        y = y + u.to(dtype) * D.to(dtype)[:, None]
    if z is not None:
        y = y * F.silu(z.to(dtype))
    out = y.to(u.dtype)
    return (out, last) if return_last_state else out


def implicit_matrix(
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    delta_bias: Tensor | None = None,
    delta_softplus: bool = False,
) -> Tensor:
    """The selective scan as a matrix: ``y_i = Σ_j M_ij u_j`` (before the z gate).

    ``M_ij = C_i · (Π_{k=j+1..i} exp(Δ_k A)) ⊙ Δ_j B_j`` for ``j <= i`` (plus D on the
    diagonal), 0 for ``j > i``: a causal, input-dependent mixing matrix per channel — the
    attention-like matrix of a selective SSM (each channel has its own). Quadratic in L: for
    pictures and checks.

    Args:
        delta, A, B, C, D, delta_bias, delta_softplus: as in `selective_scan`.

    Returns:
        ``M (B, E, L, L)`` in float32 or wider.
    """
    u = torch.zeros_like(delta)
    _, E, L, _ = check_selective_scan(u, delta, A, B, C, D, None, delta_bias)
    dtype = stat_dtype(delta.dtype)
    dt = _step_sizes(delta, delta_bias, delta_softplus, dtype)  # (B, E, L)
    log_decay = torch.cumsum(dt[..., None] * A.to(dtype)[:, None, :], dim=2)  # (B, E, L, N)
    diff = log_decay[:, :, :, None] - log_decay[:, :, None]  # (B, E, L_i, L_j, N)
    lower = torch.ones(L, L, dtype=torch.bool, device=delta.device).tril()
    decay = torch.exp(diff.masked_fill(~lower[:, :, None], float("-inf")))
    Bt = scan_matrix(B, E, dtype).transpose(-1, -2) * dt[..., None]  # (B, E, L_j, N)
    Ct = scan_matrix(C, E, dtype).transpose(-1, -2)  # (B|1, E, L_i|1, N)
    M = (Ct[:, :, :, None] * decay * Bt[:, :, None]).sum(-1)  # (B, E, L, L)
    if D is not None:
        M = M + torch.diag_embed(D.to(dtype)[:, None].expand(E, L))
    return M
