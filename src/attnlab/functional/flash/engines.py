"""Tile engines: one attention call over a set of keys, and its backward given the GLOBAL stats.

A *call* is ``softmax(cap(q·kᵀ·scale) + add) v`` over the keys it holds (`Logits` says how the
logits are formed; ``cap`` is the optional soft-capping ``softcap·tanh(s / softcap)``). Its
forward returns the call's output and log-sum-exp; its backward, given the GLOBAL output and
log-sum-exp of the rows (`Residuals`), returns exactly this key set's dK, dV and its share of dQ,
so the gradients of calls over disjoint key sets sum to the exact gradient.

- `kernel_forward` / `kernel_backward`: torch's fused CPU flash kernel
  (``aten._scaled_dot_product_flash_attention_for_cpu``; float32, float16, bfloat16, float64);
- `TorchEngine`: a pure-PyTorch online softmax over (row chunk × key chunk) tiles, for any device
  and dtype; it also exposes the logit gradient dS (the gradient of an additive bias) and is the
  engine that applies logit soft-capping (the kernel cannot apply tanh to its logits).

Used by the tiled backend (`functional.flash`) and by ring attention (`attnlab.distributed`).

Additive tiles: the bias and the mask (as −inf) evaluated on the indices of one call only.

`TileSource` evaluates the additive term on any (batch, head, row, key) index grid; `BandTiles`
builds (and caches) the tiles of the batched band calls; `fix_dead_rows` repairs the kernel's
report of rows whose every pair is masked.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ... import _ext, _settings
from ..._shapes import align, stat_dtype
from ...masks import Mask
from ..request import BiasFn, check_bias_output
from .calls import CALL_CAUSAL, CALL_MASKED, BandCall, Call

_NEG_INF = float("-inf")

_KERNEL_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default  # noqa: SLF001 (aten's CPU flash kernel has no public name)
_KERNEL_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default  # noqa: SLF001 (aten's CPU flash kernel has no public name)

DsSink = Callable[[int, int, int, int, Tensor], None]
"""``sink(r0, r1, c0, c1, dS)``: receives the logit gradient ``(nb, H, r, c)`` of one tile."""


@dataclass(frozen=True)
class Logits:
    """How one call forms its logits: ``s = cap(q·kᵀ·scale) + add`` (causal: −inf above the
    diagonal), ``cap(x) = softcap·tanh(x / softcap)`` or the identity.

    Attributes:
        scale: the logit multiplier; positive for the kernel (it fills causal −inf before it
            scales, so a negative scale would turn masked logits into +inf).
        add: additive tile broadcastable to ``(nb, H, R, K)`` — bias plus the mask as −inf — or
            None.
        causal: key c is visible to row r only when ``c <= r`` (top-left, within the call).
        softcap: logit soft-capping (> 0), or None; only the `TorchEngine` applies it.
        policy: the job's low-precision policy (`low_precision`), or None to read the setting.
    """

    scale: float
    add: Tensor | None = None
    causal: bool = False
    softcap: float | None = None
    policy: str | None = None


@dataclass(frozen=True)
class Residuals:
    """What the backward of one call reads.

    Attributes:
        dout: ``(nb, H, R, Dv)`` gradient of the output rows.
        q: ``(nb, H, R, D)``. k: ``(nb, H_kv, K, D)``. v: ``(nb, H_kv, K, Dv)``.
        out: ``(nb, H, R, Dv)`` the GLOBAL output of the rows (every key, not only this call's).
        lse: ``(nb, H, R)`` the GLOBAL log-sum-exp, +inf on rows with no key (so P = 0 there).
        delta: ``(nb, H, R)`` float32 where attnlab's C++ backward writes each row's
            ``δ = dout · out`` (the sinks' gradient reads it: `flash.sinks`), or None.
    """

    dout: Tensor
    q: Tensor
    k: Tensor
    v: Tensor
    out: Tensor
    lse: Tensor
    delta: Tensor | None = None


# float16/bfloat16 on merge-free plans (`FlashJob._widen`): "native" runs the kernels in the
# input dtype (torch's kernel: its low-precision matmuls, float32 statistics; measured 1.3-2x
# faster than widening on CPUs with bfloat16 products; attnlab's C++ kernels read 16-bit inputs
# and widen them as they pack them where the CPU has no such products), "widen" runs the plan in
# float32 and rounds once at the end. "auto" (the default) is "native" except that torch's kernel
# gets a call widened to float32 (`kernel_widens`: its results rounded once, as native ones) in
# the passes of `SLOW_16_BIT` on a CPU without native products of the dtype
# (`_ext.native_products`: AVX512-BF16/AMX for bfloat16, AVX512-FP16/AMX-FP16 for float16).
# ATTNLAB_FLASH_LOWP overrides this module-level default (tests force every path on any CPU).
LOW_PRECISION = "auto"
LOW_PRECISION_ENV = _settings.FLASH_LOWP
LOW_PRECISION_SETTINGS = ("auto", "native", "widen")
# (dtype, backward) passes of torch's kernel that are slow in 16 bits without native products.
# BigBird 64/3/2/3 at L = 16384 (B=1, H=8, D=64, 2 threads) on an AVX2-only AMD EPYC, native /
# each call widened: float16 forward 0.87 / 0.38 s, fwd+bwd 8.3 / 1.9 s; bfloat16 fwd+bwd 4.7 /
# 1.7 s, while its forward is faster native (0.27-0.33 / 0.41-0.46 s) and stays so.
SLOW_16_BIT = frozenset({(torch.float16, False), (torch.float16, True), (torch.bfloat16, True)})


def low_precision(text: str | None = None) -> str:
    """The low-precision policy: ``text`` (the setting's text, `FlashOptions.low_precision`),
    else ``$ATTNLAB_FLASH_LOWP`` if set, else `LOW_PRECISION`.

    Raises:
        ValueError: the policy is none of `LOW_PRECISION_SETTINGS`.
    """
    if text is None:
        text = _settings.text("flash_lowp")
    raw = (text or LOW_PRECISION).lower()
    if raw not in LOW_PRECISION_SETTINGS:
        raise ValueError(f"{LOW_PRECISION_ENV} must be 'auto', 'native' or 'widen', got {raw!r}")
    return raw


def kernel_widens(dtype: torch.dtype, backward: bool, policy: str | None = None) -> bool:
    """Whether torch's kernel runs a ``dtype`` call of this pass in float32 (`kernel_forward`,
    `kernel_backward`): a pass of `SLOW_16_BIT` under the ``auto`` policy (``policy``, the
    job's; None reads the setting: `low_precision`) on a CPU without native products of
    ``dtype``."""
    if (dtype, backward) not in SLOW_16_BIT:
        return False
    policy = low_precision() if policy is None else policy
    return policy == "auto" and not _ext.native_products(dtype)


def _ready(t: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """The kernel reads the last dim with unit stride and wants the mask in the query dtype."""
    if t is None:
        return t
    if t.dtype != dtype:
        t = t.to(dtype)
    if t.shape[-1] <= 1 or t.stride(-1) == 1:
        return t
    return t.contiguous()


_NO_CAP = "torch's CPU flash kernel cannot soft-cap logits: run the call on the TorchEngine"


def kernel_forward(q: Tensor, k: Tensor, v: Tensor, logits: Logits) -> tuple[Tensor, Tensor]:
    """``(out (nb, H, R, Dv), lse (nb, H, R) float32+)`` of one call on torch's CPU flash kernel.

    Rows whose every pair is masked come back as out = 0, lse = 0 (see `fix_dead_rows`).
    """
    if logits.softcap is not None:
        raise ValueError(_NO_CAP)
    if kernel_widens(q.dtype, False, logits.policy):  # the additive tile is read in float32 too
        out, lse = kernel_forward(q.float(), k.float(), v.float(), logits)
        return out.to(q.dtype), lse
    add = _ready(logits.add, q.dtype)
    out, lse = _KERNEL_FWD(q, k, v, 0.0, logits.causal, attn_mask=add, scale=logits.scale)
    return out, lse


def kernel_backward(res: Residuals, logits: Logits) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of one call on torch's CPU flash kernel, in the input dtype."""
    if logits.softcap is not None:
        raise ValueError(_NO_CAP)
    if kernel_widens(res.q.dtype, True, logits.policy):
        wide = Residuals(*(x.float() for x in (res.dout, res.q, res.k, res.v, res.out)), res.lse)
        dq, dk, dv = kernel_backward(wide, logits)
        return dq.to(res.q.dtype), dk.to(res.k.dtype), dv.to(res.v.dtype)
    dq, dk, dv = _KERNEL_BWD(
        res.dout,
        res.q,
        res.k,
        res.v,
        res.out,
        res.lse,
        0.0,
        logits.causal,
        attn_mask=_ready(logits.add, res.q.dtype),
        scale=logits.scale,
    )
    return dq, dk, dv


def _group(add: Tensor, H_kv: int) -> Tensor:
    """``(nb|1, H|1, r, c)`` → ``(nb|1, H_kv|1, G|1, r, c)`` for grouped-query heads."""
    if add.shape[1] == 1:
        return add.unsqueeze(2)
    return add.unflatten(1, (H_kv, add.shape[1] // H_kv))


def _slice_add(add: Tensor, rows: slice, cols: slice) -> Tensor:
    a = add if add.shape[-2] == 1 else add[..., rows, :]
    return a if a.shape[-1] == 1 else a[..., cols]


@dataclass
class TorchEngine:
    """Pure-PyTorch online softmax over (row chunk × key chunk) tiles; any device, any dtype.

    Scores exist only per tile, ``(B, H, rows ≤ chunk_q, keys ≤ chunk_k)``, in float32 or wider.
    """

    chunk_q: int = 128
    chunk_k: int = 512

    @staticmethod
    def _scores(
        qg: Tensor, kc: Tensor, logits: Logits, rows: slice, cols: slice, *, keep_tanh: bool
    ) -> tuple[Tensor, Tensor | None]:
        """Logits ``(nb, H_kv, G, r, c)`` of the tile at ``rows``, ``cols`` of the call, and
        ``tanh(q·kᵀ·scale / softcap)`` if ``keep_tanh`` (backward's ``1 − tanh²``), else None.

        Each step runs in place on the fresh product (the same values as out-of-place ops).

        Grouped heads (G > 1) get one product per query head, ``(r, D) @ (D, c)``, as the
        per-head definition forms them — not one product over the G stacked heads
        (``(G·r, D) @ (D, c)``): for calls with few rows per head (decoding) the stacked product
        moves BLAS from its matrix–vector path, which sums each dot product in several partial
        sums, to its matrix–matrix kernel, which sums it in one chain — measured 1.5–4× the
        float32 logit error at D = 32–256, which large logits (soft-capping, ALiBi: errors of
        ``exp``'s argument) turned into 3× the output and 9× the dK error of the per-head
        formula (MQA, L = 1, issue #38). With more rows both run the matrix–matrix kernel."""
        H_kv, G = kc.shape[1], qg.shape[2]
        kg = kc.unsqueeze(2)  # (nb, H_kv, 1, c, D)
        if G > 1:
            kg = kg.expand(-1, -1, G, -1, -1).contiguous()  # (nb, H_kv, G, c, D)
        s = (qg @ kg.transpose(-1, -2)).mul_(logits.scale)  # (nb, H_kv, G, r, c)
        t = None
        if logits.softcap is not None:  # as `reference.softcap_logits`, before bias and mask
            if keep_tanh:
                t = s.div_(logits.softcap).tanh_()
                s = t * logits.softcap
            else:
                s = s.div_(logits.softcap).tanh_().mul_(logits.softcap)
        if logits.add is not None:
            s = s.add_(_group(_slice_add(logits.add, rows, cols), H_kv).to(s.dtype))
        # causal: key c is hidden from row r when c > r; a tile whose last key is at most its
        # first row has nothing to hide
        if logits.causal and cols.start + s.shape[-1] - 1 > rows.start:
            r = torch.arange(rows.start, rows.start + s.shape[-2], device=s.device).view(-1, 1)
            c = torch.arange(cols.start, cols.start + s.shape[-1], device=s.device).view(1, -1)
            s = s.masked_fill_(c > r, _NEG_INF)
        return s, t

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, logits: Logits
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``(out (nb, H, R, Dv) in q's dtype, lse (nb, H, R) in float32+, lse_lo)`` of one call.

        ``lse_lo`` is the rounding error of ``lse = m + log(den)`` (exact two-sum): with large
        logits (ALiBi at long range) ``lse`` itself carries an error of ulp(|lse|), which
        backward's ``exp(s − lse − lse_lo)`` removes.
        """
        acc = stat_dtype(q.dtype)
        H, R = q.shape[1], q.shape[2]
        H_kv, K = k.shape[1], k.shape[2]
        outs, lses, los = [], [], []
        for r0 in range(0, R, self.chunk_q):
            r1 = min(R, r0 + self.chunk_q)
            qg = q[:, :, r0:r1].to(acc).unflatten(1, (H_kv, H // H_kv))  # (nb, H_kv, G, r, D)
            m = torch.full(qg.shape[:-1], _NEG_INF, dtype=acc, device=q.device)
            den = torch.zeros_like(m)
            o = torch.zeros(*qg.shape[:-1], v.shape[-1], dtype=acc, device=q.device)
            kmax = min(K, r1) if logits.causal else K
            for c0 in range(0, kmax, self.chunk_k):
                c1 = min(kmax, c0 + self.chunk_k)
                kc = k[:, :, c0:c1].to(acc)
                s, _ = self._scores(qg, kc, logits, slice(r0, r1), slice(c0, c1), keep_tanh=False)
                m_new = torch.maximum(m, s.amax(dim=-1))
                m_safe = torch.where(torch.isneginf(m_new), 0.0, m_new)
                p = s.sub_(m_safe.unsqueeze(-1)).exp_()  # (nb, H_kv, G, r, c)
                alpha = torch.exp(m - m_safe)
                den = den * alpha + p.sum(dim=-1)
                o = o * alpha.unsqueeze(-1) + p @ v[:, :, c0:c1].to(acc).unsqueeze(2)
                m = m_new
            dead = den == 0
            o = o / torch.where(dead, 1.0, den).unsqueeze(-1)
            m = torch.where(dead, 0.0, m)
            log_den = torch.log(torch.where(dead, 1.0, den))
            hi = m + log_den
            back = hi - m
            lo = torch.where(dead, 0.0, (m - (hi - back)) + (log_den - back))  # two-sum error
            outs.append(o.flatten(1, 2))  # (nb, H, r, Dv)
            lses.append(torch.where(dead, _NEG_INF, hi).flatten(1, 2))  # (nb, H, r)
            los.append(lo.flatten(1, 2))
        return torch.cat(outs, dim=2).to(q.dtype), torch.cat(lses, dim=2), torch.cat(los, dim=2)

    def backward(
        self,
        res: Residuals,
        logits: Logits,
        *,
        dlse: Tensor | None = None,
        lse_lo: Tensor | None = None,
        on_ds: DsSink | None = None,
        whole: bool = False,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Gradients ``(dq, dk, dv)`` (float32+) of one call given the GLOBAL out and lse.

        ``dS = P ∘ (dP − δ + dlse)`` with ``δ = rowsum(dout ∘ out)``: the lse gradient enters
        through the row constant. With soft-capping, dS is the gradient of the capped logits
        (what ``on_ds`` receives: a bias's gradient) and q, k get ``dS ∘ (1 − tanh²)``.

        Args:
            res: the call's tensors and the global stats of its rows.
            logits: how the call forms its logits.
            dlse: ``(nb, H, R)`` gradient of the lse, or None.
            lse_lo: ``(nb, H, R)`` rounding error of lse from `forward`, or None.
            on_ds: receives the logit gradient of each tile (the gradient of an additive bias).
            whole: this call holds every key of its rows; when it also fits one key chunk, δ is
                ``Σ_j P_ij dP_ij`` from the tile itself — equal to rowsum(dout ∘ out), but summed
                like softmax's own backward, so e.g. a row with a single key gets dS = 0 exactly.
        """
        q, k, v = res.q, res.k, res.v
        acc = stat_dtype(q.dtype)
        H, R = q.shape[1], q.shape[2]
        H_kv, K = k.shape[1], k.shape[2]
        G = H // H_kv
        scale = logits.scale
        delta = (res.dout.to(acc) * res.out.to(acc)).sum(dim=-1)  # (nb, H, R)
        if dlse is not None:
            delta = delta - dlse.to(acc)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc, device=q.device)
        dv = torch.zeros(v.shape, dtype=acc, device=q.device)

        def rows_of(t: Tensor, r0: int, r1: int) -> Tensor:
            return t[:, :, r0:r1].to(acc).unflatten(1, (H_kv, G))  # (nb, H_kv, G, r, ·)

        for r0 in range(0, R, self.chunk_q):
            r1 = min(R, r0 + self.chunk_q)
            qg = rows_of(q, r0, r1)  # (nb, H_kv, G, r, D)
            dog = rows_of(res.dout, r0, r1)  # (nb, H_kv, G, r, Dv)
            lg = rows_of(res.lse, r0, r1).unsqueeze(-1)  # (…, r, 1)
            lo = None if lse_lo is None else rows_of(lse_lo, r0, r1).unsqueeze(-1)
            dg = delta[:, :, r0:r1].unflatten(1, (H_kv, G)).unsqueeze(-1)
            kmax = min(K, r1) if logits.causal else K
            own = whole and kmax <= self.chunk_k  # δ from the tile: one chunk holds every key
            if own and dlse is not None:
                dl = rows_of(dlse, r0, r1).unsqueeze(-1)
            for c0 in range(0, kmax, self.chunk_k):
                c1 = min(kmax, c0 + self.chunk_k)
                kc = k[:, :, c0:c1].to(acc)
                vc = v[:, :, c0:c1].to(acc).unsqueeze(2)  # (nb, H_kv, 1, c, Dv)
                s, t = self._scores(qg, kc, logits, slice(r0, r1), slice(c0, c1), keep_tanh=True)
                sl = s.sub_(lg) if lo is None else s.sub_(lg).sub_(lo)
                p = sl.exp_()  # (nb, H_kv, G, r, c); 0 for masked pairs and dead rows
                dv[:, :, c0:c1] += (p.transpose(-1, -2) @ dog).sum(dim=2)
                dp = dog @ vc.transpose(-1, -2)
                if own:
                    dg = (p * dp).sum(dim=-1, keepdim=True)  # (…, r, 1)
                    if dlse is not None:
                        dg = dg - dl
                ds = dp.sub_(dg).mul_(p)  # P ∘ (dP − δ)
                if on_ds is not None:
                    on_ds(r0, r1, c0, c1, ds.flatten(1, 2))  # the bias is added after the cap
                if t is not None:  # d/dx softcap·tanh(x / softcap) = 1 − tanh²(x / softcap)
                    ds = ds.mul_(t.mul_(t).neg_().add_(1))
                dq[:, :, r0:r1] += (ds @ kc.unsqueeze(2)).flatten(1, 2) * scale
                dk[:, :, c0:c1] += (ds.transpose(-1, -2) @ qg).sum(dim=2) * scale
        return dq, dk, dv


# ---------------------------------------------------------------- additive tiles


class OffsetTable:
    """A relative bias function read from its values per offset: ``bias(b, h, i, j) =
    table[h, j − i + S − 1]``, ``table (H, L + S − 1)`` over ``d = j − i ∈ [−(S − 1), L − 1]``
    (``i`` the query position aligned to the keys; `offset_table` makes it).

    Positions outside the grid (a tile's padding) read the nearest end of the table: they are
    masked or dropped by the tiled backend, which evaluates relative biases once per offset.
    """

    relative = True

    def __init__(self, table: Tensor, S: int) -> None:
        self.table, self.S = table, S

    def __call__(self, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:  # noqa: ARG002 (a bias function is fn(b, h, i, j))
        d = (j - i + (self.S - 1)).clamp(0, self.table.shape[-1] - 1)  # (…, Lt, St)
        return self.table[h, d]  # (1|B, H, Lt, St)


def offset_table(fn: BiasFn, H: int, L: int, S: int, device: torch.device) -> Tensor:
    """``(H, L + S − 1)``: a relative bias function (``fn.relative = True``) at every offset
    ``d = j − i`` of an ``L × S`` call, ``table[h, d + S − 1] = fn(0, h, 0, d)`` — one call of
    ``fn`` on O(H·(L + S)) indices, in the graph (gradients flow as through ``fn``)."""
    zero = torch.zeros((1, 1, 1, 1), dtype=torch.long, device=device)
    h = torch.arange(H, device=device).view(1, H, 1, 1)
    d = torch.arange(-(S - 1), L, device=device).view(1, 1, 1, -1)
    out = check_bias_output(fn, fn(zero, h, zero, d), zero, h, zero, d)
    return out.expand(1, H, 1, d.shape[-1]).reshape(H, d.shape[-1])


@dataclass
class TileSource:
    """Evaluates the additive term (bias + mask as −inf) on any set of (batch, row, key) indices.

    Attributes:
        mask: the `Mask`, or None.
        bias_fn: ``fn(b, h, i, j)`` with i the bottom-right aligned query position, or None.
        bias_tensors: additive tensors, each broadcastable to ``(B, H, L, S)``.
        B, H, L, S: sizes of the call.
        dtype: dtype of the tiles handed to the engine: the engines' compute dtype (float32 for
            float16/bfloat16 queries, else the query dtype), so a bias is never rounded to half
            precision (the naive formula rounds it; the float64 golden does not).
        device: where index tensors and tiles are built.
        relative: ``bias_fn`` depends only on ``(h, j − i)`` (`request.is_relative_bias`).
    """

    mask: Mask | None
    bias_fn: BiasFn | None
    bias_tensors: list[Tensor] = field(repr=False)
    B: int
    H: int
    L: int
    S: int
    dtype: torch.dtype
    device: torch.device
    relative: bool = False

    @property
    def has_bias(self) -> bool:
        """True when some additive term must be computed for every tile."""
        return self.bias_fn is not None or bool(self.bias_tensors)

    def additive(
        self, b: Tensor, rows: Tensor, keys: Tensor, *, with_mask: bool, h: Tensor | None = None
    ) -> Tensor | None:
        """The additive tile on broadcastable indices: ``(nb|1, H|1, R, K)`` or None if nothing.

        Args:
            b: batch indices, shape ``(nb, 1, 1, 1)`` (or broadcastable).
            rows: raw query rows, broadcastable as ``(…, R, 1)``.
            keys: key positions, broadcastable as ``(…, 1, K)``.
            with_mask: evaluate the mask too (masked pairs become −inf).
            h: head indices ``(1, nh, 1, 1)``; default all H heads.
        """
        device = rows.device
        if h is None:
            h = torch.arange(self.H, device=device).view(1, self.H, 1, 1)
        out: Tensor | None = None
        if self.bias_fn is not None:
            i = align(rows, self.L, self.S)
            val = check_bias_output(self.bias_fn, self.bias_fn(b, h, i, keys), b, h, i, keys)
            out = val.to(self.dtype)
        for t in self.bias_tensors:
            val = gather4(t, b, h, rows, keys).to(self.dtype)
            out = val if out is None else out + val
        if with_mask and self.mask is not None:
            keep = self.mask.evaluate(b, h, rows, keys, self.L, self.S)
            if not isinstance(keep, Tensor) or keep.dtype != torch.bool:
                raise TypeError("mask function must return a bool tensor")
            zero = torch.zeros((), dtype=self.dtype, device=device)
            out = torch.where(keep, zero if out is None else out, _NEG_INF)
        if out is None:
            return None
        out = out.reshape((1,) * (4 - out.dim()) + tuple(out.shape))  # (nb|1, H|1, R|1, K|1)
        if out.shape[-1] > 1 and out.stride(-1) != 1:
            out = out.contiguous()
        return out

    def for_call(self, c: Call) -> Tensor | None:
        """The additive tile of a plain call (None for FULL/CAUSAL calls without bias)."""
        with_mask = c.kind == CALL_MASKED
        if not with_mask and not self.has_bias:
            return None
        device = self.device
        b = torch.arange(c.b0, c.b1, device=device).view(-1, 1, 1, 1)
        rows = torch.arange(c.r0, c.r1, device=device).view(1, 1, -1, 1)
        keys = c.index.to(device).view(1, 1, 1, -1)
        add = self.additive(b, rows, keys, with_mask=with_mask)
        if add is not None and c.kind == CALL_CAUSAL:
            r = torch.arange(c.r1 - c.r0, device=add.device).view(-1, 1)
            kk = torch.arange(c.num_keys, device=add.device).view(1, -1)
            add = add.masked_fill(kk > r, _NEG_INF)
        return add


@dataclass
class BandTiles:
    """The additive tiles of batched band calls; a relative bias's tile is built once per call.

    Attributes:
        source: evaluates the bias (the band's own mask is the relative-position window).
        shared: one tile per band call whose bias is relative, shared by all its query blocks.
    """

    source: TileSource
    shared: dict[BandCall, Tensor] = field(default_factory=dict, repr=False)

    def tile(self, c: BandCall, b: int, device: torch.device) -> Tensor:
        """The additive tile of band call ``c`` for batch item ``b``.

        ``(bq, W)`` for the mask alone, ``(1, H|1, bq, W)`` for a relative bias (one tile shared
        by every block), else ``(nblk, H|1, bq, W)``.
        """
        src = self.source
        r = torch.arange(c.bq, device=device).view(-1, 1)
        col = torch.arange(c.width, device=device).view(1, -1)
        d = col - r
        rel = (d >= c.c_lo) & (d <= c.c_lo + c.span)  # (bq, W)
        if not src.has_bias:
            zero = torch.zeros((), dtype=src.dtype, device=device)
            return torch.where(rel, zero, _NEG_INF)  # (bq, W)
        if src.relative:
            tile = self.shared.get(c)
            if tile is None:
                ta, tb = c.inner_blocks
                t = ta if ta < tb else c.t0  # a block whose indices are all in range, if any
                rows = (t * c.bq + r).view(1, 1, -1, 1)
                keys = (c.window(t)[0] + col).view(1, 1, 1, -1)
                zero = torch.zeros((1, 1, 1, 1), dtype=torch.long, device=device)
                add = src.additive(zero, rows, keys, with_mask=False)
                assert add is not None
                tile = torch.where(rel, add, _NEG_INF)  # (1, H|1, bq, W)
                self.shared[c] = tile
            return tile
        nblk = c.t1 - c.t0
        t = torch.arange(nblk, device=device).view(-1, 1, 1, 1)
        rows = c.r0 + t * c.bq + r.view(1, 1, -1, 1)  # (nblk, 1, bq, 1)
        keys = c.k_start + t * c.bq + col.view(1, 1, 1, -1)  # (nblk, 1, 1, W)
        bidx = torch.full((1, 1, 1, 1), b, dtype=torch.long, device=device)
        add = src.additive(bidx, rows, keys, with_mask=False)
        assert add is not None
        return torch.where(rel, add, _NEG_INF)  # (nblk, H|1, bq, W)


def as4(t: Tensor) -> Tensor:
    """``t`` viewed with leading 1s up to 4 dims: ``(B|1, H|1, L|1, S|1)``."""
    return t.reshape((1,) * (4 - t.dim()) + tuple(t.shape))  # (B|1, H|1, L|1, S|1)


def gather4(t: Tensor, b: Tensor, h: Tensor, rows: Tensor, keys: Tensor) -> Tensor:
    """``t[b, h, rows, keys]`` for a tensor broadcastable to (B, H, L, S), without expanding it."""
    t = as4(t)
    idx = []
    for size, ix in zip(t.shape, (b, h, rows, keys), strict=True):
        idx.append(
            ix if size > 1 else torch.zeros((1,) * ix.dim(), dtype=torch.long, device=ix.device)
        )
    return t[idx[0], idx[1], idx[2], idx[3]]


def fix_dead_rows(out: Tensor, lse: Tensor, add: Tensor | None) -> tuple[Tensor, Tensor]:
    """Sets lse = −inf (and out = 0) on rows of a kernel call whose every pair is masked.

    The kernel reports such rows as out = 0, lse = 0, so only rows with lse exactly 0 are
    candidates; they are confirmed on the additive tile (a live row can have lse = 0 too).
    """
    if add is None:
        return out, lse
    dead = torch.isneginf(add).all(dim=-1) & (lse == 0)  # (nb, H, R)
    return out.masked_fill(dead.unsqueeze(-1), 0.0), lse.masked_fill(dead, _NEG_INF)


__all__ = [
    "LOW_PRECISION",
    "LOW_PRECISION_ENV",
    "LOW_PRECISION_SETTINGS",
    "SLOW_16_BIT",
    "BandTiles",
    "DsSink",
    "Logits",
    "OffsetTable",
    "Residuals",
    "TileSource",
    "TorchEngine",
    "as4",
    "fix_dead_rows",
    "gather4",
    "kernel_backward",
    "kernel_forward",
    "kernel_widens",
    "low_precision",
    "offset_table",
]
