"""Performer FAVOR+ (Choromanski et al., 2021): softmax attention through positive random features.

``φ(x) = exp(W x' − ‖x'‖²/2) / √M`` with ``x' = x / D^¼`` and the M rows of W marginally
N(0, I) gives the unbiased estimate ``E[φ(q)·φ(k)] = exp(q·k / √D)`` of the softmax kernel; the
attention ``φ(Q) (φ(K)ᵀ V) / φ(Q) (φ(K)ᵀ 1)`` then costs O(L·M·D) instead of O(L·S·D).
Orthogonal blocks (rows orthogonal within each block of D, norms chi-distributed) keep the
estimate unbiased and lower its variance. Defined to equal `reference.favor_attention` for the
same projection W.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .._shapes import check_qkv
from .linear import (
    DEFAULT_CHUNK_SIZE,
    as_4d,
    causal_kernel_attention,
    check_bool,
    check_key_mask,
    check_positive_int,
    clean,
    kernel_attention,
    nan_rule_poison,
    zero_padded_keys,
)
from .reference import compute_dtype_for

__all__ = ["favor_attention", "favor_features", "favor_projection"]


def favor_projection(
    num_features: int,
    head_dim: int,
    *,
    orthogonal: bool = True,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> Tensor:
    """Draws the random feature matrix W ``(M, D)``, each row marginally N(0, I_D).

    Orthogonal: ⌈M/D⌉ independent blocks, each the D rows of a Haar-random orthogonal matrix
    (QR of a Gaussian matrix with the signs of R's diagonal fixed), every row rescaled to the
    norm of an independent N(0, I_D) vector; the first M rows are kept. Otherwise i.i.d.
    Gaussian. Drawn in float64 on the CPU generator, then cast, so a seed gives the same W in
    every dtype.

    Args:
        num_features: M >= 1.
        head_dim: D >= 1.
        orthogonal: orthogonal blocks (FAVOR+) or i.i.d. rows.
        generator: a CPU `torch.Generator`; None uses the global RNG.
        dtype: dtype of the result. device: where to put it.

    Returns:
        ``(M, D)``.
    """
    M = check_positive_int("num_features", num_features)
    D = check_positive_int("head_dim", head_dim)
    check_bool("orthogonal", orthogonal)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator)}")
    f64 = torch.float64
    if not orthogonal:
        w = torch.randn(M, D, generator=generator, dtype=f64)  # (M, D)
    else:
        n_blocks = -(-M // D)
        gauss = torch.randn(n_blocks, D, D, generator=generator, dtype=f64)  # (n, D, D)
        Q, R = torch.linalg.qr(gauss)  # (n, D, D) each
        signs = torch.sign(torch.diagonal(R, dim1=-2, dim2=-1))  # (n, D)
        Q = Q * torch.where(signs == 0, 1.0, signs)[:, None, :]  # Haar: columns of Q
        rows = Q.transpose(-1, -2)  # (n, D, D): orthonormal rows
        norms = torch.randn(n_blocks, D, D, generator=generator, dtype=f64).norm(dim=-1)  # (n, D)
        w = (rows * norms[..., None]).reshape(n_blocks * D, D)[:M]  # (M, D)
    return w.to(dtype=dtype, device=device)


def _scaled(x: Tensor) -> Tensor:
    D = x.shape[-1]
    return x * (D**-0.25 if D else 1.0)  # x' = x / D^¼, (..., D)


def _log_features(x: Tensor, projection: Tensor) -> Tensor:
    """``log(√M·φ(x)) = W x' − ‖x'‖²/2``, ``(..., D) -> (..., M)``."""
    xs = _scaled(x)  # (..., D)
    return xs @ projection.T - (xs * xs).sum(dim=-1, keepdim=True) / 2  # (..., M)


def favor_features(x: Tensor, projection: Tensor) -> Tensor:
    """The positive random features ``φ(x) = exp(W x' − ‖x'‖²/2) / √M``, ``x' = x / D^¼``.

    Unstabilised (the definition): ``φ(q)·φ(k)`` is an unbiased estimate of ``exp(q·k / √D)``.

    Args:
        x: ``(..., D)``. projection: W ``(M, D)`` from `favor_projection`.

    Returns:
        ``(..., M)``, computed in float32 or wider, in x's dtype.
    """
    dtype = compute_dtype_for(x.dtype)
    log_phi = _log_features(x.to(dtype), projection.to(dtype)) - 0.5 * math.log(projection.shape[0])
    return torch.exp(log_phi).to(x.dtype)  # (..., M)


def _check_projection(projection: object, num_features: int, D: int, q: Tensor) -> Tensor:
    if not isinstance(projection, Tensor):
        raise TypeError(f"projection must be a tensor (M, D) or None, got {type(projection)}")
    if not projection.is_floating_point():
        raise TypeError(f"projection must be a float tensor, got {projection.dtype}")
    if projection.dim() != 2 or projection.shape[1] != D:
        raise ValueError(
            f"projection must have shape (M, D) with D = head_dim {D}, got "
            f"{tuple(projection.shape)}"
        )
    if projection.shape[0] != num_features:
        raise ValueError(
            f"num_features={num_features} but projection has {projection.shape[0]} rows "
            f"(shape {tuple(projection.shape)}); pass num_features=projection.shape[0]"
        )
    if projection.device != q.device:
        raise ValueError(f"projection is on {projection.device}, query on {q.device}")
    return projection


def favor_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    num_features: int = 256,
    causal: bool = False,
    orthogonal: bool = True,
    generator: torch.Generator | None = None,
    projection: Tensor | None = None,
    key_mask: Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> Tensor:
    """FAVOR+ attention ``φ(Q) (φ(K)ᵀ V) / φ(Q) (φ(K)ᵀ 1)`` ≈ ``softmax(Q Kᵀ / √D) V``.

    Defined to equal `attnlab.functional.reference.favor_attention` with the same projection
    (its explicit ``(L, S)`` kernel matrix ``φ(Q) φ(K)ᵀ``). Numerically stabilised: the log
    features of each query are shifted by their max over the M features, those of the keys by
    one max over all keys and features of a (batch, head); both shifts (and the queries'
    ``−‖q'‖²/2``) cancel between numerator
    and denominator, so only rounding changes. Computes in float32 (float64 for float64 inputs).
    A row whose kernel weights are all 0 (S = 0, every key padded, underflow) outputs zeros.
    Causal is bottom-right (query i sees keys ``j <= i + S − L``), by chunks as in
    `linear_attention`. The NaN rule as in `linear_attention`: a non-finite q_i or attended k_j
    makes row i NaN, an attended ``v_j[d]`` column d; padded or causally later keys never reach
    row i (the key stabiliser is taken over the cleaned keys).

    Args:
        q: ``(B, H, L, D)`` or ``(B, L, D)``. k: ``(B, H_kv, S, D)``. v: ``(B, H_kv, S, Dv)``.
        num_features: M >= 1, the number of random features (drawn on every call unless
            ``projection`` is given; it must then equal ``projection.shape[0]``).
        causal: causal attention.
        orthogonal: orthogonal random feature blocks (used only when drawing).
        generator: RNG for the draw; cannot be combined with ``projection``.
        projection: a fixed W ``(M, D)`` from `favor_projection` (e.g. a module's buffer).
        key_mask: bool ``(B, S)`` or ``(1, S)``, True = a real key, False = padding.
        chunk_size: tokens per chunk in the causal form; does not change the result.

    Returns:
        ``(B, H, L, Dv)`` (3-D in, 3-D out) in q's dtype.

    Raises:
        TypeError: bad input types (tensors, bools, generator, key_mask).
        ValueError: shape mismatches, num_features < 1, a projection that does not fit.

    Example:
        >>> q, k, v = (torch.randn(1, 4, 4096, 64) for _ in range(3))
        >>> g = torch.Generator().manual_seed(0)
        >>> favor_attention(q, k, v, num_features=256, generator=g).shape
        torch.Size([1, 4, 4096, 64])
    """
    dims = check_qkv(q, k, v)
    M = check_positive_int("num_features", num_features)
    check_bool("causal", causal)
    check_bool("orthogonal", orthogonal)
    key_mask = check_key_mask(key_mask, dims)
    chunk_size = check_positive_int("chunk_size", chunk_size)
    if projection is not None:
        if generator is not None:
            raise ValueError("generator draws a projection: pass generator or projection, not both")
        projection = _check_projection(projection, M, dims.D, q)
    q, k, v = as_4d(q, k, v, dims)
    dtype = compute_dtype_for(q.dtype)
    if projection is None:
        projection = favor_projection(
            M, max(dims.D, 1), orthogonal=orthogonal, generator=generator, dtype=dtype
        )[:, : dims.D].to(q.device)
    w = projection.to(dtype)
    row, col = nan_rule_poison(q, k, v, causal=causal, key_mask=key_mask)
    kc, vc, live = zero_padded_keys(clean(k.to(dtype)), clean(v.to(dtype)), key_mask)
    # Stabilisers (constants for the autograd graph) cancel in num / den. A query's −‖q'‖²/2
    # is such a per-query constant too, so it is dropped rather than rounded against W q'.
    lq = _scaled(clean(q.to(dtype))) @ w.T  # (B, H, L, M)
    fq = torch.exp(lq - lq.amax(dim=-1, keepdim=True).detach())  # (B, H, L, M)
    lk = _log_features(kc, w)  # (B, H_kv, S, M)
    if live is not None:
        lk = torch.where(live, lk, float("-inf"))  # padded keys: φ = 0
    if lk.shape[-2] > 0:
        ck = lk.detach().amax(dim=(-2, -1), keepdim=True)  # (B, H_kv, 1, 1)
        ck = torch.where(torch.isneginf(ck), 0.0, ck)
        lk = lk - ck
    fk = torch.exp(lk)  # (B, H_kv, S, M)
    fq = fq.unflatten(1, (dims.H_kv, dims.groups))  # (B, H_kv, G, L, M)
    poison = row + col  # (B, H_kv, G, L, Dv): NaN where the rule says, −0.0 elsewhere
    if causal:
        out = causal_kernel_attention(fq, fk, vc, eps=0.0, chunk_size=chunk_size, poison=poison)
    else:
        out = kernel_attention(fq, fk, vc, eps=0.0, poison=poison)
    out = out.flatten(1, 2).to(q.dtype)  # (B, H, L, Dv)
    return out.squeeze(1) if dims.three_d else out
