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

from .._shapes import check_bool, check_int, check_qkv, stat_dtype
from ..masks import Mask
from . import kernel_scan as _ks
from .linear import (
    DEFAULT_CHUNK_SIZE,
    as_4d,
    check_kernel_mask,
    clean,
    nan_rule_poison,
)
from .linear_features import finite

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
    M = check_int("num_features", num_features, minimum=1)
    D = check_int("head_dim", head_dim, minimum=1)
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
    dtype = stat_dtype(x.dtype)
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
    mask: Mask | None = None,
    orthogonal: bool = True,
    generator: torch.Generator | None = None,
    projection: Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> Tensor:
    """FAVOR+ attention ``φ(Q) (φ(K)ᵀ V) / φ(Q) (φ(K)ᵀ 1)`` ≈ ``softmax(Q Kᵀ / √D) V``.

    Defined to equal `attnlab.functional.reference.favor_attention` with the same projection
    (its explicit ``(L, S)`` kernel matrix ``φ(Q) φ(K)ᵀ``). Numerically stabilised: the log
    features of each query are shifted by their max over the M features, those of the keys by
    one max over all keys and features of a (batch, head); both shifts (and the queries'
    ``−‖q'‖²/2``) cancel between numerator
    and denominator, so only rounding changes. Computes in float32 (float64 for float64 inputs).
    A row whose kernel weights are all 0 (S = 0, every key padded) or underflow (a denominator
    below the dtype's smallest normal number, `kernel_scan.dead_rows`: a causal row whose few
    keys lie ~90 nats under the keys' shift in float32) outputs zeros and passes no gradient.
    Causal is bottom-right (query i sees keys ``j <= i + S − L``), by chunks as in
    `linear_attention`. Both forms make the features block by block from q, k, v (`_FavorSource`:
    no ``(L, M)`` tensor in either pass) and are one autograd node whose backward recomputes
    them from a tape (the states, a denominator per row); a projection that requires grad gets
    its gradient, and higher derivatives come from running the block ops again under autograd.
    The NaN rule as in `linear_attention`: a non-finite q_i or attended k_j makes row i NaN, an
    attended ``v_j[d]`` column d; padded or causally later keys never reach row i (the key
    stabiliser is taken over the cleaned keys).

    Args:
        q: ``(B, H, L, D)`` or ``(B, L, D)``. k: ``(B, H_kv, S, D)``. v: ``(B, H_kv, S, Dv)``.
        num_features: M >= 1, the number of random features (drawn on every call unless
            ``projection`` is given; it must then equal ``projection.shape[0]``).
        mask: ``masks.causal()``, ``masks.padding(lengths)``, their ``&`` or None: the keys
            each row's sums run over.
        orthogonal: orthogonal random feature blocks (used only when drawing).
        generator: RNG for the draw; cannot be combined with ``projection``.
        projection: a fixed W ``(M, D)`` from `favor_projection` (e.g. a module's buffer).
        chunk_size: tokens per chunk in the causal form; does not change the result.

    Returns:
        ``(B, H, L, Dv)`` (3-D in, 3-D out) in q's dtype.

    Raises:
        TypeError: bad input types (tensors, bools, generator).
        ValueError: shape mismatches, num_features < 1, a projection that does not fit, a mask
            other than causal, padding and their ``&``.

    Example:
        >>> q, k, v = (torch.randn(1, 4, 4096, 64) for _ in range(3))
        >>> g = torch.Generator().manual_seed(0)
        >>> favor_attention(q, k, v, num_features=256, generator=g).shape
        torch.Size([1, 4, 4096, 64])
    """
    dims = check_qkv(q, k, v)
    M = check_int("num_features", num_features, minimum=1)
    check_bool("orthogonal", orthogonal)
    causal, key_mask = check_kernel_mask(mask, None, dims, where="favor_attention", device=q.device)
    chunk_size = check_int("chunk_size", chunk_size, minimum=1)
    if projection is not None:
        if generator is not None:
            raise ValueError("generator draws a projection: pass generator or projection, not both")
        projection = _check_projection(projection, M, dims.D, q)
    q, k, v = as_4d(q, k, v, dims)
    dtype = stat_dtype(q.dtype)
    if projection is None:
        projection = favor_projection(
            M, max(dims.D, 1), orthogonal=orthogonal, generator=generator, dtype=dtype
        )[:, : dims.D].to(q.device)
    w = projection.to(dtype)
    row, col = nan_rule_poison(q, k, v, causal=causal, key_mask=key_mask)
    out = _favor_blocks(q, k, v, w, key_mask, row, col, causal, chunk_size, dims.groups)
    return out.squeeze(1) if dims.three_d else out


# --------------------------------------------------------------------------------------- blockwise


class _FavorSource:
    """`kernel_scan.BlockSource` of FAVOR+ features made block by block from q, k, v and W, so
    no ``(L, M)`` feature tensor exists in either pass; the backward recomputes each block's
    features and takes their gradients back through ``exp`` and ``W x'`` to q, k, v and W.

    Query features ``exp(W q' − max_m (W q')_m)``, key features ``exp(W k' − ‖k'‖²/2 − c)`` with
    ``c`` the max over all (live) keys and features of a (batch, key head), found by a first
    pass over the key blocks (`key_shift`): the same stabilisers as the non-causal form, which
    cancel in num / den (constants for the gradients).
    """

    def __init__(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        w: Tensor,
        key_mask: Tensor | None,
        groups: int,
        shift: Tensor | None = None,
    ) -> None:
        self.q, self.k, self.v, self.w, self.key_mask = q, k, v, w, key_mask
        self.groups = groups
        D = q.shape[-1]
        self.scale = D**-0.25 if D else 1.0
        self.shift = shift
        self.grads: list[Tensor | None] = []

    # features
    def _queries(self, a: int, m: int) -> Tensor:
        return clean(self.q[:, :, a : a + m].to(self.w.dtype)) * self.scale  # q' (B, H, m, D)

    def _live(self, a: int, m: int) -> Tensor | None:
        if self.key_mask is None:
            return None
        return self.key_mask[:, None, a : a + m, None]  # (B|1, 1, m, 1)

    def _key_inputs(self, a: int, m: int) -> Tensor:
        """``k'`` of keys ``[a, a + m)``, zero at padded keys: ``(B, H_kv, m, D)``."""
        xs = clean(self.k[:, :, a : a + m].to(self.w.dtype))
        live = self._live(a, m)
        return (xs if live is None else torch.where(live, xs, 0.0)).mul_(self.scale)

    def _log_keys(self, a: int, m: int) -> Tensor:
        """``W k' − ‖k'‖²/2`` of keys ``[a, a + m)``, −inf at padded keys: ``(B, H_kv, m, M)``."""
        xs = self._key_inputs(a, m)
        lk = (xs @ self.w.T).sub_((xs * xs).sum(dim=-1, keepdim=True).mul_(0.5))
        live = self._live(a, m)
        return lk if live is None else lk.masked_fill_(~live, float("-inf"))

    def key_shift(self, n: int) -> Tensor:
        """``c`` ``(B, H_kv, 1, 1)``: the max of ``W k' − ‖k'‖²/2`` over live keys (0 if none)."""
        B, H_kv, S, _ = self.k.shape
        c = self.w.new_full((B, H_kv, 1, 1), float("-inf"))
        with torch.no_grad():
            for a in range(0, S, n):
                top = self._log_keys(a, min(n, S - a)).amax(dim=(-2, -1), keepdim=True)
                c = torch.maximum(c, top)
        return torch.where(torch.isneginf(c), 0.0, c)

    def queries(self, a: int, m: int) -> Tensor:
        lq = self._queries(a, m) @ self.w.T  # (B, H, m, M)
        with torch.no_grad():  # the row's shift: a constant for the gradients
            top = lq.amax(dim=-1, keepdim=True)
        fq = lq.sub_(top).exp_()  # in place: one block-sized tensor, not three
        return fq.unflatten(1, (self.k.shape[1], self.groups))  # (B, H_kv, G, m, M)

    def keys(self, a: int, m: int) -> tuple[Tensor, Tensor]:
        assert self.shift is not None
        fk = self._log_keys(a, m).sub_(self.shift).exp_()  # (B, H_kv, m, M)
        vb = clean(self.v[:, :, a : a + m].to(self.w.dtype))
        live = self._live(a, m)
        if live is not None:
            vb = torch.where(live, vb, 0.0)
        return fk, _ks.with_ones(vb)

    # gradients
    def start_backward(self, dead: int, want_w: bool) -> None:
        dq, dk, dv = (torch.empty_like(x) for x in (self.q, self.k, self.v))
        dq[:, :, :dead].zero_()  # rows that see no key
        self.grads = [dq, dk, dv, torch.zeros_like(self.w) if want_w else None]

    def _into_w(self, dl: Tensor, xs: Tensor) -> None:
        dw = self.grads[3]
        if dw is not None:  # Σ over rows of dlog φ ⊗ x'
            dw.addmm_(dl.flatten(0, -2).T, xs.flatten(0, -2))

    def query_grad(self, a: int, m: int, fq: Tensor, dfq: Tensor) -> None:
        dl = dfq.mul_(fq).flatten(1, 2)  # (B, H, m, M): through exp (the row max: a constant)
        xs = self._queries(a, m)
        qb = self.q[:, :, a : a + m]
        dq = (dl @ self.w).mul_(self.scale)  # (B, H, m, D)
        self.grads[0][:, :, a : a + m] = torch.where(finite(qb), dq, 0.0)  # type: ignore[index]
        self._into_w(dl, xs)

    def key_grad(self, a: int, m: int, fk: Tensor, dfk: Tensor, dva: Tensor) -> None:
        dl = dfk.mul_(fk)  # (B, H_kv, m, M); 0 at padded keys (φ = 0 there)
        xs = self._key_inputs(a, m)
        dxs = (dl @ self.w).sub_(xs * dl.sum(dim=-1, keepdim=True))  # d/dk' of W k' − ‖k'‖²/2
        kb, vb = self.k[:, :, a : a + m], self.v[:, :, a : a + m]
        self.grads[1][:, :, a : a + m] = torch.where(finite(kb), dxs.mul_(self.scale), 0.0)  # type: ignore[index]
        ok = finite(vb)
        live = self._live(a, m)
        if live is not None:
            ok = ok & live
        self.grads[2][:, :, a : a + m] = torch.where(ok, dva[..., :-1], 0.0)  # type: ignore[index]
        self._into_w(dl, xs)


def _favor_shape(q: Tensor, k: Tensor, v: Tensor, M: int, chunk: int, groups: int) -> _ks.ScanShape:
    B, _, L, _ = q.shape
    return _ks.ScanShape(B, k.shape[1], groups, L, k.shape[2], M, v.shape[-1], chunk)


#: causal -> the forward and the backward of the blockwise form
_PASSES = {
    True: (_ks.scan_forward, _ks.scan_backward),
    False: (_ks.full_forward, _ks.full_backward),
}


def _favor_pass(
    src: _FavorSource,
    shape: _ks.ScanShape,
    causal: bool,
    row: Tensor | None,
    col: Tensor | None,
    tape: _ks.Tape | None = None,
) -> Tensor:
    """FAVOR+ of ``src``'s block features, causal (`kernel_scan.scan_forward`) or not
    (`kernel_scan.full_forward`): ``(B, H, L, Dv)`` in q's dtype."""
    if src.shift is None:
        src.shift = src.key_shift(shape.block(src.w.dtype))

    def poison(a: int, m: int) -> Tensor | None:
        if row is None or col is None:
            return None
        r = row[:, :, :, a : a + m]  # (B, H_kv, G, m, 1)
        return r + (col[:, :, :, a : a + m] if col.shape[3] > 1 else col)

    out = _PASSES[causal][0](
        src,
        shape,
        dtype=src.w.dtype,
        out_dtype=src.q.dtype,
        device=src.q.device,
        eps=0.0,
        poison=poison,
        tape=tape,
    )
    return out.flatten(1, 2)  # (B, H, L, Dv)


class _FavorBlocks(torch.autograd.Function):
    """FAVOR+ as one autograd node: keeps q, k, v, W, the key shift, the states (one per block
    causal, one in all otherwise) and a denominator per row; the backward recomputes each
    block's features."""

    @staticmethod
    def forward(ctx, q, k, v, w, key_mask, row, col, causal, chunk_size, groups):  # type: ignore[override]
        src = _FavorSource(q, k, v, w, key_mask, groups)
        shape = _favor_shape(q, k, v, w.shape[0], chunk_size, groups)
        tape = _ks.Tape()
        out = _favor_pass(src, shape, causal, row, col, tape)
        ctx.save_for_backward(q, k, v, w, key_mask, src.shift)
        ctx.tape, ctx.shape, ctx.causal, ctx.groups = tape, shape, causal, groups
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        q, k, v, w, key_mask, shift = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: differentiate the block ops instead

            def run(q: Tensor, k: Tensor, v: Tensor, w: Tensor) -> Tensor:  # poison: a constant
                src = _FavorSource(q, k, v, w, key_mask, ctx.groups, shift)
                return _favor_pass(src, ctx.shape, ctx.causal, None, None)

            return (*_ks.recomputed_grads(run, (q, k, v, w), grad_out), *[None] * 6)
        src = _FavorSource(q, k, v, w, key_mask, ctx.groups, shift)
        src.start_backward(ctx.shape.dead if ctx.causal else 0, ctx.needs_input_grad[3])
        grad = grad_out.unflatten(1, (ctx.shape.H_kv, ctx.groups))  # (B, H_kv, G, L, Dv)
        _PASSES[ctx.causal][1](src, ctx.shape, ctx.tape, grad)
        return (*src.grads, *[None] * 6)


def _favor_blocks(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    w: Tensor,
    key_mask: Tensor | None,
    row: Tensor,
    col: Tensor,
    causal: bool,
    chunk_size: int,
    groups: int,
) -> Tensor:
    """FAVOR+ ``(B, H, L, Dv)`` block by block: one autograd node (`_FavorBlocks`) when a
    gradient is wanted, the blockwise pass alone otherwise."""
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, w)):
        return _FavorBlocks.apply(q, k, v, w, key_mask, row, col, causal, chunk_size, groups)
    src = _FavorSource(q, k, v, w, key_mask, groups)
    shape = _favor_shape(q, k, v, w.shape[0], chunk_size, groups)
    return _favor_pass(src, shape, causal, row, col)
