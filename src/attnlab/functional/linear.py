"""Linear attention ("Transformers are RNNs", Katharopoulos et al., 2020) in O(L) time and memory.

``out_i = φ(q_i)ᵀ Σ_j φ(k_j) v_jᵀ / (φ(q_i)ᵀ Σ_j φ(k_j) + eps)``: associating ``φ(K)ᵀ V`` first
never forms the ``(L, S)`` kernel matrix. Defined to equal `reference.linear_attention`.

Three forms of the causal case compute the same thing:

- parallel: `reference.linear_attention` with its explicit masked ``(L, S)`` matrix;
- chunked (`linear_attention`): exact attention inside chunks of C tokens plus the running state
  ``Σ φ(k_j) v_jᵀ`` of earlier chunks — O(L·C + L·F·Dv) work, no Python loop over tokens. The
  chunks are scanned in blocks of about `kernel_scan.BLOCK_BYTES` that carry one ``(F, Dv + 1)``
  state per head (and the NaN rule's running flags) from block to block, so nothing grows with L:
  the time stays linear where L-sized temporaries would fall out of cache and be page-faulted in
  afresh by the allocator on every call (issue #19: time(64K)/time(8K) was 11–13.5 with one
  prefix sum over all chunk states). With a built-in feature map the scan is one autograd node
  (`_CausalScan`) whose backward runs the blocks in reverse from a small tape (a state per block,
  a denominator per row), recomputing what it needs, so autograd keeps no block intermediates;
  a user's callable goes through autograd op by op;
- recurrent (`LinearAttentionState.step`): one token at a time, for decoding.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from .._shapes import Dims, check_int, check_number, check_qkv, stat_dtype
from ..masks import Mask
from ..masks.patterns import causal_and_padding, with_causal
from . import kernel_scan as _ks
from .linear_features import CleanFeature, clean_features, clean_with_ones, finite, fused_feature
from .nan_rule import clean, known_finite, nan_flags
from .reference import LINEAR_FEATURE_MAPS

FeatureMap = Callable[[Tensor], Tensor]
FEATURE_MAPS = LINEAR_FEATURE_MAPS
DEFAULT_CHUNK_SIZE = 64
__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "FEATURE_MAPS",
    "LinearAttentionState",
    "causal_kernel_attention",
    "kernel_attention",
    "linear_attention",
]


# ------------------------------------------------------------------------------------------ checks


def check_feature_map(feature_map: object) -> FeatureMap:
    """The callable φ for a name in `FEATURE_MAPS` or a user callable."""
    if isinstance(feature_map, str):
        if feature_map not in FEATURE_MAPS:
            raise ValueError(
                f"feature_map must be one of {sorted(FEATURE_MAPS)} or a callable, "
                f"got {feature_map!r}"
            )
        return FEATURE_MAPS[feature_map]
    if not callable(feature_map):
        raise TypeError(
            f"feature_map must be a name in {sorted(FEATURE_MAPS)} or a callable, "
            f"got {type(feature_map).__name__}"
        )
    return feature_map


def check_kernel_mask(
    mask: object, causal: object, dims: Dims, *, where: str, device: torch.device
) -> tuple[bool, Tensor | None]:
    """``(causal, key_mask)`` of a kernel-attention call's ``mask=`` (and deprecated ``causal=``).

    Raises:
        ValueError: a mask other than causal, padding and their ``&`` (before any work).
    """
    mask = with_causal(mask, causal, where=where, stacklevel=4)
    return causal_and_padding(mask, where=where, batch=dims.B, S=dims.S, device=device)


def as_4d(q: Tensor, k: Tensor, v: Tensor, dims: Dims) -> tuple[Tensor, Tensor, Tensor]:
    """``(B, L, D)`` inputs as one head ``(B, 1, L, D)``."""
    if dims.three_d:
        return q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)  # (B, 1, L|S, D|Dv)
    return q, k, v


# ----------------------------------------------------------------------------------------- NaN rule


def _bad_rows(x: Tensor) -> Tensor:
    """``(...,)`` bool: the last dim of ``x (..., n)`` holds a NaN or ±inf (one read pass)."""
    lo, hi = torch.aminmax(x, dim=-1) if x.shape[-1] else (x.sum(-1), x.sum(-1))
    return ~(torch.isfinite(lo) & torch.isfinite(hi))  # NaN propagates through min/max


def _poison(bad: Tensor, dtype: torch.dtype) -> Tensor:
    """NaN where ``bad``, −0.0 elsewhere (adding −0.0 keeps every value bit-exact)."""
    return torch.where(bad, float("nan"), -0.0).to(dtype)


@torch.no_grad()  # flags only: no graph (it would keep copies of q, k, v alive)
def nan_rule_poison(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool, key_mask: Tensor | None
) -> tuple[Tensor, Tensor]:
    """Row and column poison of the NaN rule for kernel attention: ``out + row + col``.

    Equals `reference.nan_rule_poison` (``row + col``) for the kernel-attention mask (causal
    bottom-right and/or key padding) without an ``(L, S)`` matrix: a non-finite q_i poisons row
    i if it may attend a key, a non-finite attended k_j poisons the row, a non-finite attended
    ``v_j[d]`` column d. Causal rows compare their last visible key with the first bad key
    (value column) of the head, so a key poisons only the rows at or after it.

    Args:
        q: ``(B, H, L, D)``. k: ``(B, H_kv, S, D)``. v: ``(B, H_kv, S, Dv)`` (raw inputs).
        causal: bottom-right causal. key_mask: bool ``(B|1, S)`` or None.

    Returns:
        ``(row (B, H_kv, G, L, 1), col (B, H_kv, 1, L|1, Dv))`` in v's dtype, NaN or −0.0.
    """
    B, H, L, _ = q.shape
    H_kv, S, Dv = k.shape[1], k.shape[2], v.shape[-1]
    G = H // H_kv if H_kv else 0
    if S == 0:  # no row has a key: nothing is poisoned
        return (
            torch.full((B, H_kv, G, L, 1), -0.0, dtype=v.dtype, device=v.device),
            torch.full((B, H_kv, 1, 1, Dv), -0.0, dtype=v.dtype, device=v.device),
        )
    q_bad = _bad_rows(q).unflatten(1, (H_kv, G))  # (B, H_kv, G, L)
    k_bad = _bad_rows(k) if causal or key_mask is not None else None  # (B, H_kv, S)
    if key_mask is not None:  # padded keys never reach a row
        assert k_bad is not None
        k_bad = k_bad & key_mask[:, None, :]
        v = torch.where(key_mask[:, None, :, None], v, 0.0)
    if causal:
        last = torch.arange(L, device=q.device) + (S - L)  # (L,): row i sees keys j <= last_i
        # prefix flags over keys (0, or NaN from the first bad entry on), aligned to the rows
        assert k_bad is not None
        k_seen = k_bad.to(torch.int32).cumsum(dim=-1) > 0  # (B, H_kv, S)
        v_seen = nan_flags(v).cumsum(dim=-2)  # (B, H_kv, S, Dv)
        if L <= S:
            k_row, v_col = k_seen[..., S - L :], torch.isnan(v_seen[..., S - L :, :])
        else:  # the first L − S rows see no key
            k_row = F.pad(k_seen, (L - S, 0))  # (B, H_kv, L)
            v_col = F.pad(torch.isnan(v_seen), (0, 0, L - S, 0))  # (B, H_kv, L, Dv)
        col = v_col.unsqueeze(2)  # (B, H_kv, 1, L, Dv)
        if key_mask is None:
            has_key = last >= 0  # (L,)
        else:
            n_live = F.pad(key_mask.long().cumsum(dim=-1), (1, 0))  # (B|1, S + 1): in [0, j)
            has_key = (n_live.index_select(-1, (last + 1).clamp(min=0)) > 0)[:, None, None, :]
        row = (q_bad & has_key) | k_row.unsqueeze(2)  # (B, H_kv, G, L)
    else:
        if key_mask is not None:  # a row with every key padded attends nothing
            q_bad = q_bad & key_mask.any(dim=-1)[:, None, None, None]
        k_any = _bad_rows(k.flatten(-2)) if k_bad is None else k_bad.any(dim=-1)  # (B, H_kv)
        row = q_bad | k_any[:, :, None, None]  # (B, H_kv, G, L)
        col = _bad_rows(v.transpose(-1, -2))[:, :, None, None, :]  # (B, H_kv, 1, 1, Dv)
    return _poison(row.unsqueeze(-1), v.dtype), _poison(col, v.dtype)


# ------------------------------------------------------------------------------------------ kernels


def kernel_attention(
    fq: Tensor, fk: Tensor, v: Tensor, *, eps: float, poison: Tensor | None = None
) -> Tensor:
    """Non-causal ``φQ (φKᵀ V) / (φQ (φKᵀ 1) + eps)`` without the ``(L, S)`` matrix.

    Inputs are taken as finite; the NaN rule enters through ``poison`` (`nan_rule_poison`).

    Args:
        fq: ``(B, H_kv, G, L, F)``. fk: ``(B, H_kv, S, F)``. v: ``(B, H_kv, S, Dv)``.
        eps: added to the denominator.
        poison: optional ``(B, H_kv, G|1, L, Dv)`` NaN/−0.0 added to the output in the same
            pass as the division (no gradient flows into it).

    Returns:
        ``(B, H_kv, G, L, Dv)``.
    """
    kv = (fk.transpose(-1, -2) @ v).unsqueeze(2)  # (B, H_kv, 1, F, Dv)
    z = fk.sum(dim=-2)[:, :, None, :, None]  # (B, H_kv, 1, F, 1)
    return _ks.normalise(fq @ kv, fq @ z, eps, poison)  # (B, H_kv, G, L, Dv)


def causal_kernel_attention(
    fq: Tensor,
    fk: Tensor,
    v: Tensor,
    *,
    eps: float,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    poison: Tensor | None = None,
) -> Tensor:
    """Causal (bottom-right) kernelised attention of given features by chunks, in blocks.

    ``out_i = Σ_{j ≤ i + S − L} (φq_i · φk_j) v_j / (Σ_{j ≤ i + S − L} φq_i · φk_j + eps)``, by
    `kernel_scan.scan_forward`: keys before the first query (S > L) form the initial state,
    queries before the first key (L > S) output zeros, and every intermediate stays a block's
    size. With autograd it is one node (`_CausalKernel`) whose backward runs the blocks in
    reverse from a tape (a state per block, a denominator per row).

    Args:
        fq: ``(B, H_kv, G, L, F)``. fk: ``(B, H_kv, S, F)``. v: ``(B, H_kv, S, Dv)``, all of one
            float dtype, finite.
        eps: added to the denominator. chunk_size: C.
        poison: optional ``(B, H_kv, G|1, L, Dv)`` NaN/−0.0 of the NaN rule added to the output
            (rows that see no key are never poisoned; no gradient flows into it).

    Returns:
        ``(B, H_kv, G, L, Dv)`` in fq's dtype.
    """
    if torch.is_grad_enabled() and any(x.requires_grad for x in (fq, fk, v)):
        return _CausalKernel.apply(fq, fk, v, poison, eps, chunk_size)
    return _kernel_scan(fq, fk, v, eps=eps, chunk_size=chunk_size, poison=poison)


class _GivenFeatures:
    """`kernel_scan.BlockSource` of features given whole: blocks are slices; gradients are
    written into ``dfq, dfk, dv``."""

    def __init__(self, fq: Tensor, fk: Tensor, v: Tensor) -> None:
        self.fq, self.fk, self.v = fq, fk, v
        self.grads: tuple[Tensor, Tensor, Tensor] | None = None

    def queries(self, a: int, m: int) -> Tensor:
        return self.fq[:, :, :, a : a + m]

    def keys(self, a: int, m: int) -> tuple[Tensor, Tensor]:
        return self.fk[:, :, a : a + m], _ks.with_ones(self.v[:, :, a : a + m])

    def start_backward(self, dead: int) -> None:
        dfq, dfk, dv = (torch.empty_like(x) for x in (self.fq, self.fk, self.v))
        dfq[:, :, :, :dead].zero_()  # rows that see no key
        self.grads = dfq, dfk, dv

    def query_grad(self, a: int, m: int, fq: Tensor, dfq: Tensor) -> None:  # noqa: ARG002 (the scan source's protocol)
        assert self.grads is not None
        self.grads[0][:, :, :, a : a + m] = dfq

    def key_grad(self, a: int, m: int, fk: Tensor, dfk: Tensor, dva: Tensor) -> None:  # noqa: ARG002 (the scan source's protocol)
        assert self.grads is not None
        self.grads[1][:, :, a : a + m] = dfk
        self.grads[2][:, :, a : a + m] = dva[..., :-1]


def _kernel_shape(fq: Tensor, fk: Tensor, v: Tensor, chunk_size: int) -> _ks.ScanShape:
    B, H_kv, G, L, Fd = fq.shape
    return _ks.ScanShape(B, H_kv, G, L, fk.shape[2], Fd, v.shape[-1], chunk_size)


def _kernel_scan(
    fq: Tensor,
    fk: Tensor,
    v: Tensor,
    *,
    eps: float,
    chunk_size: int,
    poison: Tensor | None,
    tape: _ks.Tape | None = None,
) -> Tensor:
    """`causal_kernel_attention` by `kernel_scan.scan_forward`."""

    def poisoned(a: int, m: int) -> Tensor | None:
        if poison is None:
            return None
        return poison[:, :, :, a : a + m] if poison.shape[3] > 1 else poison

    return _ks.scan_forward(
        _GivenFeatures(fq, fk, v),
        _kernel_shape(fq, fk, v, chunk_size),
        dtype=fq.dtype,
        out_dtype=fq.dtype,
        device=fq.device,
        eps=eps,
        poison=poisoned,
        tape=tape,
    )


class _CausalKernel(torch.autograd.Function):
    """`_kernel_scan` with a hand-written backward from a small tape: autograd keeps the
    features, the values, a state per block and a denominator per row; the chunk states and
    scores are recomputed block by block (`kernel_scan.scan_backward`)."""

    @staticmethod
    def forward(ctx, fq, fk, v, poison, eps, chunk_size):  # type: ignore[override]
        tape = _ks.Tape()
        out = _kernel_scan(fq, fk, v, eps=eps, chunk_size=chunk_size, poison=poison, tape=tape)
        ctx.save_for_backward(fq, fk, v)
        ctx.tape, ctx.eps, ctx.chunk_size = tape, eps, chunk_size
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        fq, fk, v = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: differentiate the block ops instead

            def run(fq: Tensor, fk: Tensor, v: Tensor) -> Tensor:  # the poison adds a constant
                return _kernel_scan(fq, fk, v, eps=ctx.eps, chunk_size=ctx.chunk_size, poison=None)

            return (*_ks.recomputed_grads(run, (fq, fk, v), grad_out), None, None, None)
        src = _GivenFeatures(fq, fk, v)
        shape = _kernel_shape(fq, fk, v, ctx.chunk_size)
        src.start_backward(shape.dead)
        _ks.scan_backward(src, shape, ctx.tape, grad_out)
        assert src.grads is not None
        return (*src.grads, None, None, None)


def _key_block(
    phi: FeatureMap, kb: Tensor, vb: Tensor, mb: Tensor | None, dtype: torch.dtype, Fd: int
) -> tuple[Tensor, Tensor]:
    """φ(clean(k)) of a block (zero at padded keys) and ``[clean(v) | 1]``.

    Returns:
        ``(fk (B, H_kv, n, F), va (B, H_kv, n, Dv + 1))`` in ``dtype``.
    """
    fk = _block_features(phi, kb, dtype, Fd, "key")  # (B, H_kv, n, F)
    if mb is not None:  # padded keys carry no kernel weight
        fk = torch.where(mb[:, None, :, None], fk, 0.0)
    return fk, clean_with_ones(vb, dtype)


def _key_flags(
    kb: Tensor, vb: Tensor, mb: Tensor | None, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """The NaN rule's flags of a key block: bad keys ``(B, H_kv, n)`` and value flags
    ``(B, H_kv, n, Dv)`` (0, NaN where non-finite); padded keys carry none."""
    vflag = nan_flags(vb.to(dtype))
    kbad = _bad_rows(kb)
    if mb is not None:
        vflag = torch.where(mb[:, None, :, None], vflag, 0.0)
        kbad = kbad & mb[:, None, :]
    return kbad, vflag


def _causal_scan(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    phi: FeatureMap,
    *,
    eps: float,
    chunk_size: int,
    key_mask: Tensor | None,
    groups: int,
    tape: _ks.Tape | None = None,
) -> Tensor:
    """The causal scan, everything per block of tokens.

    Cleaning, features, key padding and the NaN rule's flags are computed block by block
    alongside the scan (`kernel_scan.scan_block`), with running sums carried between blocks:
    the state ``Σ φ(k) [v, 1]ᵀ``, the count of non-finite attended keys (a row at or after one
    is NaN), the sum of value flags (0, or NaN from the first non-finite ``v[d]`` on: column d)
    and the count of real keys (a row with none attends nothing and stays zeros whatever its
    query). No intermediate is larger than a block, so the time is linear in L.

    Args:
        q: ``(B, H, L, D)``. k: ``(B, H_kv, S, D)``. v: ``(B, H_kv, S, Dv)`` (raw inputs).
        phi: the feature map. eps: added to the denominators. chunk_size: C.
        key_mask: bool ``(B|1, S)`` or None. groups: G = H / H_kv.
        tape: filled with what `kernel_scan.scan_backward` needs (by `_CausalScan`, without grad).

    Returns:
        ``(B, H, L, Dv)`` in q's dtype.
    """
    B, H, L, _ = q.shape
    H_kv, S, Dv = k.shape[1], k.shape[2], v.shape[-1]
    dtype = stat_dtype(q.dtype)
    P, dead = max(S - L, 0), max(L - S, 0)
    T = L - dead  # aligned tokens: query dead + t sees keys j <= P + t
    C = min(chunk_size, max(T, 1))
    # the feature size F, from the first query and key (or empty slices); every block is checked
    fq0, fk0 = phi(clean(q[:, :, :1].to(dtype))), phi(clean(k[:, :, :1].to(dtype)))
    _check_features(fq0, fk0, q[:, :, :1], k[:, :, :1])
    Fd = fq0.shape[-1]
    anchor = fq0[:, :, :0].sum()  # 0, joins all-zero outputs to the graph (backward runs)
    n = _ks.block_tokens(B * H, max(Fd, Dv + 1, C), torch.finfo(dtype).bits // 8, C)
    if tape is not None:
        tape.n, tape.Fd = n, Fd

    state = q.new_zeros(B, H_kv, 1, Fd, Dv + 1, dtype=dtype)  # Σ φ(k) [v | 1]ᵀ
    rule = _RuleCarry(B, H_kv, Dv, dtype, q.device)
    masks = key_mask.split([P, T], dim=1) if key_mask is not None else (None, None)
    # split only what has two parts: autograd's backward of a split concatenates the pieces'
    # gradients into a fresh L-sized tensor (page-faulted anew on every call at long L)
    if P:  # keys before the first query: the initial state and flags
        k_p, k = k.split([P, T], dim=2)
        v_p, v = v.split([P, T], dim=2)
        pieces = _ks.block_sizes(P, n)
        mps = masks[0].split(pieces, dim=1) if masks[0] is not None else [None] * len(pieces)
        for kb, vb, mb in zip(k_p.split(pieces, 2), v_p.split(pieces, 2), mps, strict=True):
            fk, va = _key_block(phi, kb, vb, mb, dtype, Fd)
            state = state + (fk.transpose(-1, -2) @ va).unsqueeze(2)
            fine = rule.keys(kb, vb, mb)
            if tape is not None:
                tape.finite.append(fine)
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    # without autograd each block is written into the output as it is done: no block outputs
    # pile up (the allocator would grow and trim the heap by L · Dv on every call)
    result = None if grad else q.new_empty(B, H, L, Dv)
    if dead:
        q = q.split([dead, T], dim=2)[1]
    outs = [q.new_zeros(B, H, dead, Dv) + anchor.to(q.dtype)] if dead else []  # see no key
    if result is not None:
        result[:, :, :dead].zero_()
    start = dead
    sizes = _ks.block_sizes(T, n)
    mbs = masks[1].split(sizes, dim=1) if masks[1] is not None else [None] * len(sizes)
    for qb, kb, vb, mb in zip(
        q.split(sizes, 2), k.split(sizes, 2), v.split(sizes, 2), mbs, strict=True
    ):
        fk, va = _key_block(phi, kb, vb, mb, dtype, Fd)
        fq = _block_features(phi, qb, dtype, Fd, "query").unflatten(1, (H_kv, groups))
        if tape is not None:
            tape.states.append(state)
        acc, state = _ks.scan_block(fq, fk, va, state, C)  # (B, H_kv, G, n, Dv + 1)
        poison, fine = rule.block(qb, kb, vb, mb, groups)
        if tape is not None:
            tape.finite.append(fine)
            tape.dens.append(acc[..., Dv:] + eps)
        out = _ks.normalise(acc[..., :Dv], acc[..., Dv:], eps, poison)
        if result is None:
            outs.append(out.flatten(1, 2).to(q.dtype))  # (B, H, n, Dv)
        else:
            result[:, :, start : start + out.shape[3]].copy_(out.flatten(1, 2))
            start += out.shape[3]
    if result is not None:
        return result
    if not outs:
        return q.new_zeros(B, H, L, Dv) + anchor.to(q.dtype)
    return torch.cat(outs, dim=2)  # (B, H, L, Dv)


class _RuleCarry:
    """The NaN rule of the causal scan, block by block, with its running sums.

    Carried from block to block: the count of non-finite attended keys (a row at or after one
    is NaN), the sum of value flags (0, or NaN from the first non-finite ``v[d]`` on: column d)
    and the count of real keys (a row with none attends nothing and stays zeros whatever its
    query). Blocks whose inputs are known finite (`nan_rule.known_finite`, one read each) skip
    the flags while no earlier key or value block may have held a non-finite entry.
    """

    def __init__(self, B: int, H_kv: int, Dv: int, dtype: torch.dtype, device) -> None:
        self.dtype = dtype
        self.k_count = torch.zeros(B, H_kv, 1, dtype=torch.long, device=device)
        self.v_sum = torch.zeros(B, H_kv, 1, Dv, dtype=dtype, device=device)
        self.n_live = torch.zeros(1, 1, dtype=torch.long, device=device)
        self.flagged = False  # an earlier key or value may be non-finite

    def _known_finite(self, kb: Tensor, vb: Tensor) -> tuple[bool, bool]:
        fine = (known_finite(kb), known_finite(vb))
        self.flagged = self.flagged or not all(fine)
        return fine

    def keys(self, kb: Tensor, vb: Tensor, mb: Tensor | None) -> tuple[bool, bool, bool]:
        """Adds a block of keys before the first query; returns ``(q, k, v)`` known finite."""
        fine = self._known_finite(kb, vb)
        if self.flagged:
            kbad, vflag = _key_flags(kb, vb, mb, self.dtype)
            self.k_count = self.k_count + kbad.sum(dim=-1, keepdim=True)
            self.v_sum = self.v_sum + vflag.sum(dim=-2, keepdim=True)
        if mb is not None:
            self.n_live = self.n_live + mb.sum(dim=-1, keepdim=True)
        return (True, *fine)

    def block(
        self, qb: Tensor, kb: Tensor, vb: Tensor, mb: Tensor | None, groups: int
    ) -> tuple[Tensor | None, tuple[bool, bool, bool]]:
        """The poison ``(B, H_kv, G, n, Dv)`` (NaN/−0.0) of an aligned block, None if nothing can
        be poisoned; and ``(q, k, v)`` known finite."""
        fine = (known_finite(qb), *self._known_finite(kb, vb))
        if not self.flagged and fine[0]:
            if mb is not None:
                self.n_live = self.n_live + mb.sum(dim=-1, keepdim=True)
            return None, fine
        kbad, vflag = _key_flags(kb, vb, mb, self.dtype)
        k_seen = kbad.cumsum(dim=-1) + self.k_count  # (B, H_kv, n)
        v_seen = vflag.cumsum(dim=-2) + self.v_sum  # (B, H_kv, n, Dv)
        self.k_count, self.v_sum = k_seen[..., -1:], v_seen[..., -1:, :]
        q_bad = _bad_rows(qb).unflatten(1, (k_seen.shape[1], groups))  # (B, H_kv, G, n)
        if mb is not None:  # a row with no real key yet attends nothing
            live_seen = mb.cumsum(dim=-1) + self.n_live  # (B|1, n)
            self.n_live = live_seen[:, -1:]
            q_bad = q_bad & (live_seen > 0)[:, None, None, :]
        row = q_bad | (k_seen > 0).unsqueeze(2)  # (B, H_kv, G, n)
        bad = row.unsqueeze(-1) | torch.isnan(v_seen).unsqueeze(2)  # (B, H_kv, G, n, Dv)
        return _poison(bad, self.dtype), fine


class _FusedSource:
    """`kernel_scan.BlockSource` of linear attention with a fused feature map, for the
    backward: each block's features are recomputed from q, k, v (one elementwise pass) and the
    gradients written into ``dq, dk, dv`` through the map's closed-form derivative, skipping the
    finite masks of blocks the forward knew to be finite."""

    def __init__(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        key_mask: Tensor | None,
        op: CleanFeature,
        phi: FeatureMap,
        tape: _ks.Tape,
        groups: int,
    ) -> None:
        self.q, self.k, self.v, self.key_mask, self.op, self.phi = q, k, v, key_mask, op, phi
        self.Fd = tape.Fd
        self.dtype = stat_dtype(q.dtype)
        self.groups, self.n = groups, tape.n
        self.finite = tape.finite  # per key block: prefix blocks first, then aligned ones
        self.P, self.dead = max(k.shape[2] - q.shape[2], 0), max(q.shape[2] - k.shape[2], 0)
        self.prefix = len(_ks.block_sizes(self.P, self.n))
        self.dq, self.dk, self.dv = (torch.empty_like(x) for x in (q, k, v))
        self.dq[:, :, : self.dead].zero_()  # rows that see no key

    def _block(self, a: int) -> int:
        """The tape's index of the key block starting at key ``a``."""
        return a // self.n if a < self.P else self.prefix + (a - self.P) // self.n

    def queries(self, a: int, m: int) -> Tensor:
        fq = self.op.forward(self.q[:, :, a : a + m], self.dtype)  # (B, H, m, F)
        return fq.unflatten(1, (self.k.shape[1], self.groups))

    def keys(self, a: int, m: int) -> tuple[Tensor, Tensor]:
        mb = self.key_mask[:, a : a + m] if self.key_mask is not None else None
        kb, vb = self.k[:, :, a : a + m], self.v[:, :, a : a + m]
        return _key_block(self.phi, kb, vb, mb, self.dtype, self.Fd)  # as the forward's

    def query_grad(self, a: int, m: int, fq: Tensor, dfq: Tensor) -> None:
        q_fine = self.finite[self._block(self.P + a - self.dead)][0]
        qb = self.q[:, :, a : a + m]
        self.dq[:, :, a : a + m] = self.op.backward(qb, fq.flatten(1, 2), dfq.flatten(1, 2), q_fine)

    def key_grad(self, a: int, m: int, fk: Tensor, dfk: Tensor, dva: Tensor) -> None:
        kb, vb = self.k[:, :, a : a + m], self.v[:, :, a : a + m]
        if self.key_mask is not None:  # padded keys: no gradient (their φ was replaced by 0)
            dfk = torch.where(self.key_mask[:, None, a : a + m, None], dfk, 0.0)
        _, k_fine, v_fine = self.finite[self._block(a)]
        self.dk[:, :, a : a + m] = self.op.backward(kb, fk, dfk, k_fine)
        dva = dva[..., :-1]
        self.dv[:, :, a : a + m] = dva if v_fine else torch.where(finite(vb), dva, 0.0)


class _CausalScan(torch.autograd.Function):
    """`_causal_scan` with a fused feature map and a hand-written backward.

    Saves the inputs, the state before each block and each row's denominator (``(F, Dv + 1)``
    per block and one number per row): the chunk states, scores and features are recomputed
    block by block in the backward (two extra products per chunk) instead of being kept, so the
    memory autograd holds is O(L · H) numbers rather than ~600 per token and head, and the
    gradients go straight into ``dq, dk, dv`` (no concatenation of block gradients).
    """

    @staticmethod
    def forward(ctx, q, k, v, key_mask, op, phi, eps, chunk_size, groups):  # type: ignore[override]
        tape = _ks.Tape()
        out = _causal_scan(
            q,
            k,
            v,
            phi,
            eps=eps,
            chunk_size=chunk_size,
            key_mask=key_mask,
            groups=groups,
            tape=tape,
        )
        ctx.save_for_backward(q, k, v, key_mask)
        ctx.tape, ctx.op, ctx.phi, ctx.eps = tape, op, phi, eps
        ctx.chunk_size, ctx.groups = chunk_size, groups
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        q, k, v, key_mask = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: differentiate the block ops instead

            def run(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
                return _causal_scan(
                    q,
                    k,
                    v,
                    ctx.phi,
                    eps=ctx.eps,
                    chunk_size=ctx.chunk_size,
                    key_mask=key_mask,
                    groups=ctx.groups,
                )

            return (*_ks.recomputed_grads(run, (q, k, v), grad_out), *[None] * 6)
        B, L = q.shape[0], q.shape[2]
        H_kv, S, Dv = k.shape[1], k.shape[2], v.shape[-1]
        shape = _ks.ScanShape(B, H_kv, ctx.groups, L, S, ctx.tape.Fd, Dv, ctx.chunk_size)
        src = _FusedSource(q, k, v, key_mask, ctx.op, ctx.phi, ctx.tape, ctx.groups)
        _ks.scan_backward(src, shape, ctx.tape, grad_out.unflatten(1, (H_kv, ctx.groups)))
        return src.dq, src.dk, src.dv, None, None, None, None, None, None


# ------------------------------------------------------------------------------------------ public


def linear_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    feature_map: str | FeatureMap = "elu",
    mask: Mask | None = None,
    eps: float = 1e-6,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    causal: bool | None = None,
) -> Tensor:
    """Linear attention: ``out_i = Σ_j φ(q_i)·φ(k_j) v_j / (Σ_j φ(q_i)·φ(k_j) + eps)``.

    Defined to equal `attnlab.functional.reference.linear_attention` (explicit ``(L, S)`` kernel
    matrix); computed in O(L) memory: non-causal as ``φ(Q) (φ(K)ᵀ V)``, causal by chunks of
    ``chunk_size`` tokens whose running state is carried through blocks of
    `kernel_scan.BLOCK_BYTES` (time linear in L, every intermediate a block's size). Causal
    alignment is
    bottom-right, as everywhere in attnlab (L=2, S=4: the last query sees every key)::

        ■ ■ ■ ⬚
        ■ ■ ■ ■

    Computes in float32 (float64 for float64 inputs) and returns q's dtype. A row with no key
    weight (S = 0, every key padded, or all-zero features) or whose ``den + eps`` underflows
    below the dtype's smallest normal number outputs zeros and passes no gradient. For
    token-by-token decoding use `LinearAttentionState`. The NaN rule: a non-finite q_i (of a
    row with a key) or attended k_j makes row i NaN, a non-finite attended ``v_j[d]``
    makes ``out_i[d]`` NaN, and padded or causally later keys never reach row i; for finite
    output gradients, the gradients are those of the inputs with non-finite entries read as 0.

    Args:
        q: ``(B, H, L, D)`` or ``(B, L, D)``.
        k: ``(B, H_kv, S, D)``; ``H % H_kv == 0`` (grouped-query: k/v shared, not copied).
        v: ``(B, H_kv, S, Dv)``.
        feature_map: ``"elu"`` (φ(x) = elu(x) + 1), ``"relu"``, or a callable mapping
            ``(..., D) -> (..., F)`` with non-negative values.
        mask: ``masks.causal()`` (query i sees keys ``j <= i + S − L``),
            ``masks.padding(lengths)`` (keys ``j >= lengths[b]`` are padding), their ``&``, or
            None; the sums over j run over the keys the mask keeps.
        eps: added to each denominator (>= 0).
        chunk_size: C, tokens per chunk of the causal form (>= 1); does not change the result.
        causal: deprecated, use ``mask=masks.causal()``.

    Returns:
        ``(B, H, L, Dv)`` (3-D in, 3-D out), in q's dtype.

    Raises:
        TypeError: non-tensor or mixed-dtype inputs, a bad feature_map/causal type.
        ValueError: shape mismatches, unknown feature_map name, eps < 0, chunk_size < 1, a
            feature map whose query and key features differ in size, a mask other than
            causal, padding and their ``&``.

    Example:
        >>> q = k = v = torch.randn(2, 4, 1000, 32)
        >>> linear_attention(q, k, v, mask=masks.causal()).shape
        torch.Size([2, 4, 1000, 32])
    """
    dims = check_qkv(q, k, v)
    phi = check_feature_map(feature_map)
    eps = check_number("eps", eps, at_least=0)
    causal, key_mask = check_kernel_mask(
        mask, causal, dims, where="linear_attention", device=q.device
    )
    chunk_size = check_int("chunk_size", chunk_size, minimum=1)
    q, k, v = as_4d(q, k, v, dims)
    if causal:
        op = fused_feature(phi)
        grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
        if op is not None and grad:  # built-in φ: one autograd node, its own backward
            out = _CausalScan.apply(q, k, v, key_mask, op, phi, eps, chunk_size, dims.groups)
        else:  # no autograd, or a user's φ: autograd through the block ops
            out = _causal_scan(
                q, k, v, phi, eps=eps, chunk_size=chunk_size, key_mask=key_mask, groups=dims.groups
            )
        return out.squeeze(1) if dims.three_d else out
    dtype = stat_dtype(q.dtype)
    row, col = nan_rule_poison(q, k, v, causal=False, key_mask=key_mask)
    vc = clean(v.to(dtype))
    fq = clean_features(phi, q, dtype)  # (B, H, L, F): fused for the built-in maps
    fk = clean_features(phi, k, dtype)  # (B, H_kv, S, F)
    _check_features(fq, fk, q, k)
    if key_mask is not None:  # padded keys carry no kernel weight and no value
        live = key_mask[:, None, :, None]  # (B|1, 1, S, 1)
        fk, vc = torch.where(live, fk, 0.0), torch.where(live, vc, 0.0)
    fq = fq.unflatten(1, (dims.H_kv, dims.groups))  # (B, H_kv, G, L, F)
    poison = row + col  # (B, H_kv, G, L, Dv): NaN where the rule says, −0.0 elsewhere
    out = kernel_attention(fq, fk, vc, eps=eps, poison=poison)
    out = out.flatten(1, 2).to(q.dtype)  # (B, H, L, Dv)
    return out.squeeze(1) if dims.three_d else out


def _block_features(phi: FeatureMap, x: Tensor, dtype: torch.dtype, Fd: int, name: str) -> Tensor:
    """``φ(clean(x))`` of one block ``(B, H, n, D)``, checked to be ``(B, H, n, F)``."""
    fx = clean_features(phi, x, dtype)
    if fx.shape[:-1] != x.shape[:-1] or fx.shape[-1] != Fd:
        raise ValueError(
            "feature_map must map (..., D) to (..., F) with one F for queries and keys, got "
            f"{name} features {tuple(fx.shape)} from {tuple(x.shape)} (F = {Fd} for the first "
            "query and key)"
        )
    return fx


def _check_features(fq: Tensor, fk: Tensor, q: Tensor, k: Tensor) -> None:
    same_f = fq.shape[-1] == fk.shape[-1]
    if fq.shape[:-1] != q.shape[:-1] or fk.shape[:-1] != k.shape[:-1] or not same_f:
        raise ValueError(
            "feature_map must map (..., D) to (..., F) with one F for queries and keys, got "
            f"query features {tuple(fq.shape)} from {tuple(q.shape)} and key features "
            f"{tuple(fk.shape)} from {tuple(k.shape)}"
        )


class LinearAttentionState:
    """The recurrent form of causal linear attention, for decoding one token at a time.

    Holds ``kv = Σ_j φ(k_j) v_jᵀ`` ``(B, H_kv, F, Dv)`` and ``z = Σ_j φ(k_j)`` ``(B, H_kv, F)``
    in float32 (float64 for float64 inputs), so memory is constant in the sequence length.
    ``step(q_t, k_t, v_t)`` appends a token and returns
    ``φ(q_t)ᵀ kv / (φ(q_t)ᵀ z + eps)``; a prefill with `append` followed by steps equals
    ``linear_attention(q, k, v, mask=masks.causal())`` on the whole sequence (bottom-right
    alignment), NaN rule included: a non-finite key appended makes every later read's row NaN, a
    non-finite ``v[d]`` their column d, a non-finite query its own row (the state itself stays
    finite).

    Args:
        feature_map: as in `linear_attention`.
        eps: added to each denominator (>= 0).

    Example:
        >>> state = LinearAttentionState()
        >>> outs = [state.step(q[:, :, t], k[:, :, t], v[:, :, t]) for t in range(L)]
        >>> torch.stack(outs, dim=2)  # equals linear_attention(q, k, v, mask=masks.causal())
    """

    def __init__(self, feature_map: str | FeatureMap = "elu", eps: float = 1e-6) -> None:
        self.phi = check_feature_map(feature_map)
        self.eps = check_number("eps", eps, at_least=0)
        self.kv: Tensor | None = None
        self.z: Tensor | None = None
        # The NaN rule: 0, or NaN once a non-finite key (any column) / value (per column) is in.
        self.k_flag: Tensor | None = None  # (B, H_kv)
        self.v_flag: Tensor | None = None  # (B, H_kv, Dv)
        self.length = 0

    def _check_token(self, name: str, t: object, rank: int = 3) -> Tensor:
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != rank:
            letters = "(B, H_kv, S, ·)" if rank == 4 else "(B, H, ·)"
            raise ValueError(f"{name} must have rank {rank} {letters}, got shape {tuple(t.shape)}")
        return t

    def _features(self, x: Tensor) -> Tensor:
        fx = self.phi(x.to(stat_dtype(x.dtype)))
        if fx.shape[:-1] != x.shape[:-1]:
            raise ValueError(
                f"feature_map must map (..., D) to (..., F), got {tuple(fx.shape)} "
                f"from {tuple(x.shape)}"
            )
        return fx

    def append(self, k: Tensor, v: Tensor) -> None:
        """Adds keys ``(B, H_kv, S, D)`` and values ``(B, H_kv, S, Dv)`` to the state (prefill)."""
        k = self._check_token("k", k, rank=4)
        v = self._check_token("v", v, rank=4)
        if k.shape[:3] != v.shape[:3]:
            raise ValueError(
                f"k {tuple(k.shape)} and v {tuple(v.shape)} must agree on (B, H_kv, S)"
            )
        if k.dtype != v.dtype:
            raise TypeError(f"k and v must share one dtype, got k {k.dtype}, v {v.dtype}")
        fk = self._features(clean(k))  # (B, H_kv, S, F)
        kv = fk.transpose(-1, -2) @ clean(v.to(fk.dtype))  # (B, H_kv, F, Dv)
        z = fk.sum(dim=-2)  # (B, H_kv, F)
        k_flag = nan_flags(k).sum(dim=(-2, -1)).to(fk.dtype)  # (B, H_kv)
        v_flag = nan_flags(v).sum(dim=-2).to(fk.dtype)  # (B, H_kv, Dv)
        if self.kv is None:
            self.kv, self.z, self.k_flag, self.v_flag = kv, z, k_flag, v_flag
        else:
            assert self.z is not None and self.k_flag is not None and self.v_flag is not None
            if kv.shape != self.kv.shape:
                raise ValueError(
                    f"the new keys/values give a state of shape (B, H_kv, F, Dv) = "
                    f"{tuple(kv.shape)}, but the state holds {tuple(self.kv.shape)}"
                )
            self.kv, self.z = self.kv + kv, self.z + z
            self.k_flag, self.v_flag = self.k_flag + k_flag, self.v_flag + v_flag
        self.length += k.shape[2]

    def read(self, q: Tensor) -> Tensor:
        """Attends queries ``(B, H, L, D)`` to everything appended so far: ``(B, H, L, Dv)``."""
        q = self._check_token("q", q, rank=4)
        if self.kv is None or self.z is None:
            raise ValueError("the state is empty: append keys/values (or step) before reading")
        B, H_kv, Fdim, _ = self.kv.shape
        if q.shape[0] != B or H_kv == 0 or q.shape[1] % H_kv:
            raise ValueError(
                f"q of shape {tuple(q.shape)} does not fit the state (B, H_kv) = ({B}, {H_kv}): "
                "q must be (B, H, L, D) with H a multiple of H_kv"
            )
        fq = self._features(clean(q))  # (B, H, L, F)
        if fq.shape[-1] != Fdim:
            raise ValueError(f"query features have F={fq.shape[-1]}, the state has F={Fdim}")
        fq = fq.unflatten(1, (H_kv, q.shape[1] // H_kv))  # (B, H_kv, G, L, F)
        num = fq @ self.kv.unsqueeze(2)  # (B, H_kv, G, L, Dv)
        den = fq @ self.z[:, :, None, :, None]  # (B, H_kv, G, L, 1)
        out = _ks.normalise(num, den, self.eps)  # (B, H_kv, G, L, Dv)
        if self.length:  # the NaN rule; with no key appended every row is zeros
            assert self.k_flag is not None and self.v_flag is not None
            q_flag = nan_flags(q).sum(dim=-1).unflatten(1, (H_kv, -1)).to(out.dtype)  # (B,H_kv,G,L)
            flag = (q_flag + self.k_flag[:, :, None, None]).unsqueeze(-1)  # (B, H_kv, G, L, 1)
            flag = flag + self.v_flag[:, :, None, None, :]  # (B, H_kv, G, L, Dv)
            out = out + torch.where(torch.isnan(flag), float("nan"), -0.0).to(out.dtype)
        return out.flatten(1, 2).to(q.dtype)  # (B, H, L, Dv)

    def step(self, q_t: Tensor, k_t: Tensor, v_t: Tensor) -> Tensor:
        """Appends one token and attends its query to all tokens so far.

        Args:
            q_t: ``(B, H, D)``. k_t: ``(B, H_kv, D)``. v_t: ``(B, H_kv, Dv)``.

        Returns:
            ``(B, H, Dv)`` in q_t's dtype.
        """
        for name, t in (("q_t", q_t), ("k_t", k_t), ("v_t", v_t)):
            self._check_token(name, t)
        if not (q_t.dtype == k_t.dtype == v_t.dtype):
            raise TypeError(
                f"q_t, k_t and v_t must share one dtype, got {q_t.dtype}, {k_t.dtype}, {v_t.dtype}"
            )
        if q_t.shape[-1] != k_t.shape[-1]:
            raise ValueError(
                f"q_t head_dim {q_t.shape[-1]} ≠ k_t head_dim {k_t.shape[-1]} "
                f"(q_t {tuple(q_t.shape)}, k_t {tuple(k_t.shape)})"
            )
        (B, H), (B_k, H_kv), Dv = q_t.shape[:2], k_t.shape[:2], v_t.shape[-1]
        fits = B_k == B and k_t.shape[:2] == v_t.shape[:2] and H_kv > 0 and H % H_kv == 0
        if self.kv is not None:
            fits = fits and (B, H_kv, Dv) == (self.kv.shape[0], self.kv.shape[1], self.kv.shape[3])
        if not fits:
            held = ""
            if self.kv is not None:
                held = f"; the state holds (B, H_kv, F, Dv) = {tuple(self.kv.shape)}"
            raise ValueError(
                f"q_t (B, H, D) = {tuple(q_t.shape)}, k_t (B, H_kv, D) = {tuple(k_t.shape)} and "
                f"v_t (B, H_kv, Dv) = {tuple(v_t.shape)} must agree on B and H_kv with H a "
                f"multiple of H_kv{held}"
            )
        self.append(k_t.unsqueeze(2), v_t.unsqueeze(2))  # (B, H_kv, 1, ·)
        return self.read(q_t.unsqueeze(2)).squeeze(2)  # (B, H, Dv)
