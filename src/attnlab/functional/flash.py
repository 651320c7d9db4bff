"""Tiled exact attention ("flash"): block-sparse tiling, online softmax, recomputing backward.

Defined to equal `functional.reference.attention` (and `reference.logsumexp` for the returned
log-sum-exp): ``out = softmax(q·kᵀ·scale + bias, masked) · v``, computed without ever holding an
L×S tensor, in either pass.

How it runs:

1. A *plan* (`functional.tiling`) splits the (query, key) grid using the mask's block map: EMPTY
   tiles are skipped, FULL tiles run without evaluating the mask, PARTIAL tiles evaluate it (and a
   bias function) on the tile's indices only. Narrow bands (sliding windows) run all interior
   query blocks as one batched call over strided key windows with one shared mask; plain causal
   runs as one causal call. A *relative* bias function (``fn.relative = True``: ALiBi, T5) over
   a wide band (causal, none) cuts each query block's keys into windows at fixed offsets from
   the block: one batched call per offset, sharing ONE additive tile, merged by log-sum-exp.
2. Each call runs on a tile *engine* that returns the call's output and log-sum-exp:

   - ``"kernel"``: torch's fused CPU flash kernel
     (``aten._scaled_dot_product_flash_attention_for_cpu``) for float32, float16 and bfloat16
     (float16/bfloat16 plans with several calls run it in float32 and round once at the end);
   - ``"torch"``: a pure-PyTorch online-softmax loop over (row, key) chunks: float64 (the
     verification dtype, on wide 2048-tiles) and devices other than the CPU.

3. Calls over disjoint key sets are combined with `merge_partials` (log-sum-exp weights).
4. Backward recomputes every call from q, k, v and the GLOBAL out and lse: the kernel's backward
   over a subset of keys, given the global normaliser, returns exactly that subset's dK, dV and its
   share of dQ (ring attention's observation), so the per-call gradients sum to the exact gradient.
   Calls run in a fixed order, so gradients are bit-deterministic.

Not supported (the backend's ``supports`` says so and ``backend="auto"`` picks another): dropout,
returning the (B, H, L, S) weights, and gradients through bias *functions* whose values require
grad (a learned T5 table). Bias *tensors* that require grad get their gradient (dS summed over
broadcast dims); that backward runs on the pure-PyTorch engine, which exposes dS.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from ..masks import Mask, TensorMask
from . import nan_rule
from .merge import merge_into, merge_partials
from .request import BiasFn, Request, check_bias_output, is_relative_bias
from .scores import get_score
from .tiling import (
    CALL_CAUSAL,
    CALL_MASKED,
    BandCall,
    Call,
    Plan,
    band_of,
    build_plan,
)

_NEG_INF = float("-inf")
_POS_INF = float("inf")

# Default tile sizes (rows × keys) of the block map, and the query block of batched band calls.
BLOCK_Q = 128
BLOCK_K = 128
BAND_BLOCK = 64
# Forward query block of batched band calls when none is given: the forward kernel wastes fewer
# pairs on 32-row blocks (288 keys per block for a 256-window instead of 320), while the backward
# kernel is faster on 64-row blocks (measured at window 256, L=16384, benchmarks/RESULTS.md).
BAND_BLOCK_FWD = 32
# Tile size with a bias (measured: 256 beats 128 for ALiBi), and for float64 (see `flash_job`).
BLOCK_BIAS = 256
BLOCK_64 = 2048
# Key window of a relative bias over a wide band (causal, none): one shared tile per offset.
RELATIVE_WINDOW = 1024

_KERNEL_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_KERNEL_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# --------------------------------------------------------------------------- additive tiles
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
    bias_tensors: list[Tensor]
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
            i = rows + (self.S - self.L)
            val = check_bias_output(self.bias_fn, self.bias_fn(b, h, i, keys), b, h, i, keys)
            out = val.to(self.dtype)
        for t in self.bias_tensors:
            val = _gather4(t, b, h, rows, keys).to(self.dtype)
            out = val if out is None else out + val
        if with_mask and self.mask is not None:
            keep = self.mask._eval(b, h, rows, keys, self.L, self.S)
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
        keys = c.key_index(device).view(1, 1, 1, -1)
        add = self.additive(b, rows, keys, with_mask=with_mask)
        if add is not None and c.kind == CALL_CAUSAL:
            r = torch.arange(c.r1 - c.r0, device=add.device).view(-1, 1)
            kk = torch.arange(c.num_keys, device=add.device).view(1, -1)
            add = add.masked_fill(kk > r, _NEG_INF)
        return add


def _as4(t: Tensor) -> Tensor:
    return t.reshape((1,) * (4 - t.dim()) + tuple(t.shape))  # (B|1, H|1, L|1, S|1)


def _gather4(t: Tensor, b: Tensor, h: Tensor, rows: Tensor, keys: Tensor) -> Tensor:
    """``t[b, h, rows, keys]`` for a tensor broadcastable to (B, H, L, S), without expanding it."""
    t = t.reshape((1,) * (4 - t.dim()) + tuple(t.shape))  # (B|1, H|1, L|1, S|1)
    idx = []
    for size, ix in zip(t.shape, (b, h, rows, keys), strict=True):
        idx.append(
            ix if size > 1 else torch.zeros((1,) * ix.dim(), dtype=torch.long, device=ix.device)
        )
    return t[idx[0], idx[1], idx[2], idx[3]]


def _fix_dead_rows(out: Tensor, lse: Tensor, add: Tensor | None) -> tuple[Tensor, Tensor]:
    """Sets lse = −inf (and out = 0) on rows of a kernel call whose every pair is masked.

    The kernel reports such rows as out = 0, lse = 0, so only rows with lse exactly 0 are
    candidates; they are confirmed on the additive tile (a live row can have lse = 0 too).
    """
    if add is None:
        return out, lse
    dead = torch.isneginf(add).all(dim=-1) & (lse == 0)  # (nb, H, R)
    return out.masked_fill(dead.unsqueeze(-1), 0.0), lse.masked_fill(dead, _NEG_INF)


# --------------------------------------------------------------------------- engines
def _ready(t: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """The kernel reads the last dim with unit stride and wants the mask in the query dtype."""
    if t is None:
        return t
    if t.dtype != dtype:
        t = t.to(dtype)
    if t.shape[-1] <= 1 or t.stride(-1) == 1:
        return t
    return t.contiguous()


def _kernel_fwd(
    q: Tensor, k: Tensor, v: Tensor, add: Tensor | None, causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    out, lse = _KERNEL_FWD(q, k, v, 0.0, causal, attn_mask=_ready(add, q.dtype), scale=scale)
    return out, lse


def _kernel_bwd(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    add: Tensor | None,
    causal: bool,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = _KERNEL_BWD(
        dout, q, k, v, out, lse, 0.0, causal, attn_mask=_ready(add, q.dtype), scale=scale
    )
    return dq, dk, dv


@dataclass
class TorchEngine:
    """Pure-PyTorch online softmax over (row chunk × key chunk) tiles; any device, any dtype.

    Scores exist only per tile, ``(B, H, rows ≤ chunk_q, keys ≤ chunk_k)``, in float32 or wider.
    """

    chunk_q: int = 128
    chunk_k: int = 512

    def _scores(
        self,
        qg: Tensor,
        kc: Tensor,
        add: Tensor | None,
        causal: bool,
        r0: int,
        c0: int,
        scale: float,
        H_kv: int,
    ) -> Tensor:
        s = (qg @ kc.unsqueeze(2).transpose(-1, -2)) * scale  # (nb, H_kv, G, r, c)
        if add is not None:
            s = s + _group(add, H_kv).to(s.dtype)
        if causal:
            r = torch.arange(r0, r0 + s.shape[-2], device=s.device).view(-1, 1)
            c = torch.arange(c0, c0 + s.shape[-1], device=s.device).view(1, -1)
            s = s.masked_fill(c > r, _NEG_INF)
        return s

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, add: Tensor | None, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``(out (nb, H, R, Dv) in q's dtype, lse (nb, H, R) in float32+, lse_lo)`` of one call.

        ``lse_lo`` is the rounding error of ``lse = m + log(den)`` (exact two-sum): with large
        logits (ALiBi at long range) ``lse`` itself carries an error of ulp(|lse|), which
        backward's ``exp(s − lse − lse_lo)`` removes.
        """
        acc = _acc_dtype(q.dtype)
        H, R = q.shape[1], q.shape[2]
        H_kv, K = k.shape[1], k.shape[2]
        outs, lses, los = [], [], []
        for r0 in range(0, R, self.chunk_q):
            r1 = min(R, r0 + self.chunk_q)
            qg = q[:, :, r0:r1].to(acc).unflatten(1, (H_kv, H // H_kv))  # (nb, H_kv, G, r, D)
            m = torch.full(qg.shape[:-1], _NEG_INF, dtype=acc, device=q.device)
            den = torch.zeros_like(m)
            o = torch.zeros(*qg.shape[:-1], v.shape[-1], dtype=acc, device=q.device)
            kmax = min(K, r1) if causal else K
            for c0 in range(0, kmax, self.chunk_k):
                c1 = min(kmax, c0 + self.chunk_k)
                a = None if add is None else _slice_add(add, r0, r1, c0, c1)
                s = self._scores(qg, k[:, :, c0:c1].to(acc), a, causal, r0, c0, scale, H_kv)
                m_new = torch.maximum(m, s.amax(dim=-1))
                m_safe = torch.where(torch.isneginf(m_new), 0.0, m_new)
                p = torch.exp(s - m_safe.unsqueeze(-1))  # (nb, H_kv, G, r, c)
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
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        add: Tensor | None,
        causal: bool,
        scale: float,
        dlse: Tensor | None = None,
        on_ds: Callable[[int, int, int, int, Tensor], None] | None = None,
        lse_lo: Tensor | None = None,
        whole: bool = False,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Gradients of one call given the GLOBAL out and lse (+inf for rows with no key).

        ``lse_lo`` (optional, ``(nb, H, R)``) is the rounding error of lse from `forward`;
        ``whole``: this call holds every key of its rows; when it also fits one key chunk, δ is
        ``Σ_j P_ij dP_ij`` from the tile itself — equal to rowsum(dout ∘ out), but summed like
        softmax's own backward, so e.g. a row with a single key gets dS = 0 exactly.

        ``on_ds(r0, r1, c0, c1, dS)`` receives the logit gradient ``(nb, H, r, c)`` of each tile:
        the gradient of an additive bias (used for bias tensors that require grad).

        ``dS = P ∘ (dP − δ + dlse)`` with ``δ = rowsum(dout ∘ out)``: the lse gradient enters
        through the row constant.
        """
        acc = _acc_dtype(q.dtype)
        H, R = q.shape[1], q.shape[2]
        H_kv, K = k.shape[1], k.shape[2]
        G = H // H_kv
        delta = (dout.to(acc) * out.to(acc)).sum(dim=-1)  # (nb, H, R)
        if dlse is not None:
            delta = delta - dlse.to(acc)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc, device=q.device)
        dv = torch.zeros(v.shape, dtype=acc, device=q.device)
        for r0 in range(0, R, self.chunk_q):
            r1 = min(R, r0 + self.chunk_q)
            qg = q[:, :, r0:r1].to(acc).unflatten(1, (H_kv, G))  # (nb, H_kv, G, r, D)
            dog = dout[:, :, r0:r1].to(acc).unflatten(1, (H_kv, G))  # (nb, H_kv, G, r, Dv)
            lg = lse[:, :, r0:r1].to(acc).unflatten(1, (H_kv, G)).unsqueeze(-1)  # (…, r, 1)
            lo = None
            if lse_lo is not None:
                lo = lse_lo[:, :, r0:r1].to(acc).unflatten(1, (H_kv, G)).unsqueeze(-1)
            dg = delta[:, :, r0:r1].unflatten(1, (H_kv, G)).unsqueeze(-1)
            kmax = min(K, r1) if causal else K
            own = whole and kmax <= self.chunk_k  # δ from the tile: one chunk holds every key
            if own and dlse is not None:
                dl = dlse[:, :, r0:r1].to(acc).unflatten(1, (H_kv, G)).unsqueeze(-1)
            for c0 in range(0, kmax, self.chunk_k):
                c1 = min(kmax, c0 + self.chunk_k)
                kc = k[:, :, c0:c1].to(acc)
                vc = v[:, :, c0:c1].to(acc).unsqueeze(2)  # (nb, H_kv, 1, c, Dv)
                a = None if add is None else _slice_add(add, r0, r1, c0, c1)
                s = self._scores(qg, kc, a, causal, r0, c0, scale, H_kv)
                sl = s - lg if lo is None else (s - lg) - lo
                p = torch.exp(sl)  # (nb, H_kv, G, r, c); 0 for masked pairs and dead rows
                dv[:, :, c0:c1] += (p.transpose(-1, -2) @ dog).sum(dim=2)
                dp = dog @ vc.transpose(-1, -2)
                if own:
                    dg = (p * dp).sum(dim=-1, keepdim=True)  # (…, r, 1)
                    if dlse is not None:
                        dg = dg - dl
                ds = p * (dp - dg)
                if on_ds is not None:
                    on_ds(r0, r1, c0, c1, ds.flatten(1, 2))
                dq[:, :, r0:r1] += (ds @ kc.unsqueeze(2)).flatten(1, 2) * scale
                dk[:, :, c0:c1] += (ds.transpose(-1, -2) @ qg).sum(dim=2) * scale
        return dq, dk, dv


def _group(add: Tensor, H_kv: int) -> Tensor:
    """``(nb|1, H|1, r, c)`` → ``(nb|1, H_kv|1, G|1, r, c)`` for grouped-query heads."""
    if add.shape[1] == 1:
        return add.unsqueeze(2)
    return add.unflatten(1, (H_kv, add.shape[1] // H_kv))


def _slice_add(add: Tensor, r0: int, r1: int, c0: int, c1: int) -> Tensor:
    a = add if add.shape[-2] == 1 else add[..., r0:r1, :]
    return a if a.shape[-1] == 1 else a[..., c0:c1]


# --------------------------------------------------------------------------- the job
@dataclass
class FlashJob:
    """Everything that defines one tiled attention call except the tensors q, k, v."""

    plan: Plan
    source: TileSource
    scale: float
    engine: str  # "kernel" or "torch"
    torch_engine: TorchEngine
    grad_biases: tuple[int, ...] = ()  # indices into source.bias_tensors that need gradients
    out32: Tensor | None = None  # float32 output of a widened float16/bfloat16 forward
    lse_lo: Tensor | None = None  # rounding error of lse, rows of single torch-engine calls
    shared_tiles: dict[BandCall, Tensor] = field(default_factory=dict)  # relative bias tiles
    bwd_plan: Plan | None = None  # the plan backward runs, if not the forward's

    # ---------------------------------------------------------------- helpers
    def _call_tensors(self, q: Tensor, k: Tensor, v: Tensor, c: Call):
        """q, k, v of a call and its additive tile (inputs are finite: `nan_rule.clean`)."""
        qc = q[c.b0 : c.b1, :, c.r0 : c.r1]
        if isinstance(c.keys, tuple):
            kc = k[c.b0 : c.b1, :, c.keys[0] : c.keys[1]]
            vc = v[c.b0 : c.b1, :, c.keys[0] : c.keys[1]]
        else:
            idx = c.keys.to(k.device)
            kc = k[c.b0 : c.b1].index_select(2, idx)
            vc = v[c.b0 : c.b1].index_select(2, idx)
        return qc, kc, vc, self.source.for_call(c)

    def _widen(self, q: Tensor) -> bool:
        """float16/bfloat16 with several calls run the kernel in float32.

        Each kernel call rounds its partial output and gradients to the input dtype; summing
        several such partials (over query blocks for dK/dV, over key sets for the output) would
        add one rounding per call. In float32 the partials stay exact enough and only the final
        result is rounded once. Additive tiles are float32 too (`flash_job`): a bias keeps
        its float32 precision, where rounding ALiBi's −slope·|i − j| to bfloat16 would move
        distant logits by whole units.
        """
        return self.engine == "kernel" and q.dtype in (torch.float16, torch.bfloat16)

    def _run_fwd(self, qc, kc, vc, add, causal) -> tuple[Tensor, Tensor, Tensor | None]:
        if self.engine == "kernel":
            return (*_kernel_fwd(qc, kc, vc, add, causal, self.scale), None)
        return self.torch_engine.forward(qc, kc, vc, add, causal, self.scale)

    def _band_add(self, c: BandCall, b: int, device) -> Tensor:
        """The additive tile of a band call: ``(bq, W)`` for the mask alone, ``(1, H|1, bq, W)``
        for a relative bias (one tile shared by every block), else ``(nblk, H|1, bq, W)``."""
        r = torch.arange(c.bq, device=device).view(-1, 1)
        col = torch.arange(c.width, device=device).view(1, -1)
        d = col - r
        rel = (d >= c.c_lo) & (d <= c.c_lo + c.span)  # (bq, W)
        if not self.source.has_bias:
            zero = torch.zeros((), dtype=self.source.dtype, device=device)
            return torch.where(rel, zero, _NEG_INF)  # (bq, W)
        if self.source.relative:
            tile = self.shared_tiles.get(c)
            if tile is None:
                ta, tb = c.interior()
                t = ta if ta < tb else c.t0  # a block whose indices are all in range, if any
                rows = (t * c.bq + r).view(1, 1, -1, 1)
                keys = (c.window(t)[0] + col).view(1, 1, 1, -1)
                zero = torch.zeros((1, 1, 1, 1), dtype=torch.long, device=device)
                add = self.source.additive(zero, rows, keys, with_mask=False)
                assert add is not None
                tile = torch.where(rel, add, _NEG_INF)  # (1, H|1, bq, W)
                self.shared_tiles[c] = tile
            return tile
        nblk = c.t1 - c.t0
        t = torch.arange(nblk, device=device).view(-1, 1, 1, 1)
        rows = c.r0 + t * c.bq + r.view(1, 1, -1, 1)  # (nblk, 1, bq, 1)
        keys = c.k_start + t * c.bq + col.view(1, 1, 1, -1)  # (nblk, 1, 1, W)
        bidx = torch.full((1, 1, 1, 1), b, dtype=torch.long, device=device)
        add = self.source.additive(bidx, rows, keys, with_mask=False)
        assert add is not None
        return torch.where(rel, add, _NEG_INF)  # (nblk, H|1, bq, W)

    @staticmethod
    def _interior(c: BandCall, add: Tensor) -> tuple[BandCall | None, Tensor]:
        """The batched part of a band call (blocks whose window is in range) and its tile."""
        ta, tb = c.interior()
        if ta >= tb:
            return None, add
        if add.dim() == 4 and add.shape[0] > 1:
            add = add[ta - c.t0 : tb - c.t0]
        if (ta, tb) == (c.t0, c.t1):
            return c, add
        return replace(c, t0=ta, t1=tb, k_start=c.window(ta)[0]), add

    @staticmethod
    def _edges(c: BandCall, add: Tensor):
        """``(t, rows, (j0, j1), tile)`` of every block whose window leaves the keys."""
        ta, tb = c.interior()
        for t in (*range(c.t0, ta), *range(tb, c.t1)):
            k0, k1 = c.window(t)
            j0, j1 = max(0, k0), min(c.key_limit, k1)
            if j1 <= j0:
                continue
            tile = add[t - c.t0 : t - c.t0 + 1] if add.dim() == 4 and add.shape[0] > 1 else add
            yield t, slice(t * c.bq, (t + 1) * c.bq), (j0, j1), tile[..., j0 - k0 : j1 - k0]

    def _store(self, out: Tensor, lse: Tensor, o: Tensor, l: Tensor) -> None:
        """Writes a call's rows, or merges them in when the plan's groups overlap."""
        if self.plan.overlap:
            merge_into(out, lse, o, l)
        else:
            out.copy_(o)
            lse.copy_(l)

    @staticmethod
    def _blocks(t: Tensor, b: int, c: BandCall) -> Tensor:
        """``t[b, :, rows of c]`` viewed as ``(nblk, H, bq, ·)`` (works for lse's 3-D too)."""
        x = t[b, :, c.r0 : c.r1].unflatten(1, (c.t1 - c.t0, c.bq))  # (H, nblk, bq, ·)
        return x.transpose(0, 1)

    @staticmethod
    def _windows(t: Tensor, b: int, c: BandCall) -> Tensor:
        """Overlapping key windows ``(nblk, H_kv, W, ·)`` of ``t[b]``: a strided view, no copy."""
        nblk = c.t1 - c.t0
        sB, sH, sS, sD = t.stride()
        return t.as_strided(
            (nblk, t.shape[1], c.width, t.shape[3]),
            (c.bq * sS, sH, sS, sD),
            t.storage_offset() + b * sB + c.k_start * sS,
        )

    # ---------------------------------------------------------------- forward
    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """``(out (B, H, L, Dv), lse (B, H, L) float32+)``."""
        B, H, L, _ = q.shape
        S, Dv = k.shape[2], v.shape[-1]
        acc = _acc_dtype(q.dtype)
        plan = self.plan
        if self.engine == "kernel" and not self.source.has_bias and plan.is_single_call(B, L, S):
            c = plan.groups[0].calls[0]
            assert isinstance(c, Call)
            out, lse = _kernel_fwd(q, k, v, None, c.kind == CALL_CAUSAL, self.scale)
            return out, lse.contiguous()
        if self._widen(q):
            out, lse = self.forward(q.float(), k.float(), v.float())
            self.out32 = out  # backward's δ = rowsum(dout·out) uses the unrounded output
            return out.to(q.dtype), lse
        # rows in no group attend nothing: zeros; skip the memset when every row is covered
        alloc = torch.empty if plan.covers_all(B, L) and not plan.overlap else torch.zeros
        out = alloc(B, H, L, Dv, dtype=q.dtype, device=q.device)
        lse = torch.full((B, H, L), _NEG_INF, dtype=acc, device=q.device)
        self.lse_lo = None
        for g in plan.groups:
            parts: list[tuple[Tensor, Tensor, Tensor | None]] = []
            for c in g.calls:
                if isinstance(c, BandCall):
                    if self.engine == "kernel" and self._band_fwd(q, k, v, c, out, lse):
                        continue
                    for bc in c.block_calls():
                        o, l, lo = self._simple_fwd(q, k, v, bc)
                        rows = (slice(bc.b0, bc.b1), slice(None), slice(bc.r0, bc.r1))
                        self._keep_lo(lse, rows, lo)
                        self._store(out[rows], lse[rows], o, l)
                    continue
                parts.append(self._simple_fwd(q, k, v, c))
            if not parts:
                continue
            rows = (slice(g.b0, g.b1), slice(None), slice(g.r0, g.r1))
            if len(parts) == 1:
                o, l, lo = parts[0]
                self._keep_lo(lse, rows, lo)
            else:
                o, l = merge_partials([p[0] for p in parts], [p[1] for p in parts])
            self._store(out[rows], lse[rows], o, l)
        return out, lse

    def _simple_fwd(self, q, k, v, c: Call) -> tuple[Tensor, Tensor, Tensor | None]:
        qc, kc, vc, add = self._call_tensors(q, k, v, c)
        o, l, lo = self._run_fwd(qc, kc, vc, add, c.kind == CALL_CAUSAL)
        if self.engine == "kernel":
            o, l = _fix_dead_rows(o, l, add)
        return o, l, lo

    def _keep_lo(self, lse: Tensor, rows: tuple[slice, slice, slice], lo: Tensor | None) -> None:
        """Keeps lse's rounding error for rows computed by ONE call (merges drop it).

        Call it before the part is stored: in overlapping plans a row already reached by an
        earlier part (finite lse) is a merge, whose lse carries a rounding of its own.
        """
        if lo is None:
            return
        if self.lse_lo is None:
            self.lse_lo = torch.zeros_like(lse)  # (B, H, L)
        if self.plan.overlap:
            lo = torch.where(torch.isneginf(lse[rows]), lo, 0.0)
        self.lse_lo[rows] = lo

    def _band_fwd(self, q, k, v, c: BandCall, out: Tensor, lse: Tensor) -> bool:
        """Runs a batched band call (always possible: inputs are finite)."""
        for b in range(c.b0, c.b1):
            add = self._band_add(c, b, q.device)
            inner, add_in = self._interior(c, add)
            if inner is not None:
                o, l = _kernel_fwd(
                    self._blocks(q, b, inner),
                    self._windows(k, b, inner),
                    self._windows(v, b, inner),
                    add_in,
                    False,
                    self.scale,
                )
                if add.dim() == 4:  # a bias may mask whole rows
                    o, l = _fix_dead_rows(o, l, add_in)
                self._store(self._blocks(out, b, inner), self._blocks(lse, b, inner), o, l)
            for _, rows, (j0, j1), tile in self._edges(c, add):
                bs = slice(b, b + 1)
                o, l = _kernel_fwd(
                    q[bs, :, rows], k[bs, :, j0:j1], v[bs, :, j0:j1], tile, False, self.scale
                )
                o, l = _fix_dead_rows(o, l, tile)
                self._store(out[bs, :, rows], lse[bs, :, rows], o, l)
        return True

    # ---------------------------------------------------------------- backward
    def backward(
        self,
        dout: Tensor,
        dlse: Tensor | None,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``(dq, dk, dv)`` in the input dtype; every call recomputed from q, k, v, out, lse.

        Gradients of bias tensors (``grad_biases``) are accumulated into ``self.bias_grads``.
        """
        B, _, L, _ = q.shape
        plan = self.plan if self.bwd_plan is None else self.bwd_plan
        S = k.shape[2]
        acc = _acc_dtype(q.dtype)
        lse_b = torch.where(torch.isneginf(lse), _POS_INF, lse)  # rows with no key: P = 0
        # the kernel never exposes dS: bias gradients and lse gradients take the torch engine
        use_kernel = self.engine == "kernel" and dlse is None and not self.grad_biases
        self.bias_grads = [
            torch.zeros(_as4(self.source.bias_tensors[i]).shape, dtype=acc, device=q.device)
            for i in self.grad_biases
        ]
        if use_kernel and not self.source.has_bias and plan.is_single_call(B, L, S):
            c = plan.groups[0].calls[0]
            assert isinstance(c, Call)
            if q.dtype in (torch.float16, torch.bfloat16):
                # the kernel sums dK/dV over query blocks in the input dtype: do it in float32
                grads = _kernel_bwd(
                    dout.float(),
                    q.float(),
                    k.float(),
                    v.float(),
                    out.float(),
                    lse_b,
                    None,
                    c.kind == CALL_CAUSAL,
                    self.scale,
                )
                return grads[0].to(q.dtype), grads[1].to(k.dtype), grads[2].to(v.dtype)
            return _kernel_bwd(dout, q, k, v, out, lse_b, None, c.kind == CALL_CAUSAL, self.scale)
        if self._widen(q):
            out32 = self.out32 if self.out32 is not None else out.float()
            grads = self.backward(dout.float(), dlse, q.float(), k.float(), v.float(), out32, lse)
            return grads[0].to(q.dtype), grads[1].to(k.dtype), grads[2].to(v.dtype)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc, device=q.device)
        dv = torch.zeros(v.shape, dtype=acc, device=q.device)
        for g, alone in zip(plan.groups, plan.alone(), strict=True):
            whole = alone and len(g.calls) == 1  # the call holds every key of its rows
            for c in g.calls:
                grads = (dq, dk, dv)
                if isinstance(c, BandCall):
                    if use_kernel and self._band_bwd(dout, q, k, v, out, lse_b, c, *grads):
                        continue
                    for bc in c.block_calls():
                        self._simple_bwd(
                            dout, dlse, q, k, v, out, lse_b, bc, grads, use_kernel, whole
                        )
                    continue
                self._simple_bwd(dout, dlse, q, k, v, out, lse_b, c, grads, use_kernel, whole)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

    def _simple_bwd(
        self, dout, dlse, q, k, v, out, lse_b, c: Call, grads, use_kernel: bool, whole: bool
    ) -> None:
        """Adds one call's gradients into ``grads = (dq, dk, dv)``; ``whole``: the call holds
        every key of its rows (see `TorchEngine.backward`)."""
        dq, dk, dv = grads
        qc, kc, vc, add = self._call_tensors(q, k, v, c)
        rows = (slice(c.b0, c.b1), slice(None), slice(c.r0, c.r1))
        causal = c.kind == CALL_CAUSAL
        if use_kernel:
            gq, gk, gv = _kernel_bwd(
                dout[rows], qc, kc, vc, out[rows], lse_b[rows], add, causal, self.scale
            )
        else:
            gq, gk, gv = self.torch_engine.backward(
                dout[rows],
                qc,
                kc,
                vc,
                out[rows],
                lse_b[rows],
                add,
                causal,
                self.scale,
                None if dlse is None else dlse[rows],
                self._bias_grad_sink(c) if self.grad_biases else None,
                None if self.lse_lo is None else self.lse_lo[rows],
                whole,
            )
        dq[rows] += gq
        if isinstance(c.keys, tuple):
            dk[c.b0 : c.b1, :, c.keys[0] : c.keys[1]] += gk
            dv[c.b0 : c.b1, :, c.keys[0] : c.keys[1]] += gv
        else:
            idx = c.keys.to(dk.device)
            dk[c.b0 : c.b1].index_add_(2, idx, gk.to(dk.dtype))
            dv[c.b0 : c.b1].index_add_(2, idx, gv.to(dv.dtype))

    def _bias_grad_sink(self, c: Call) -> Callable[[int, int, int, int, Tensor], None]:
        """Adds a tile's dS into the gradient of each bias tensor (summed over broadcast dims)."""
        keys = c.key_index(self.bias_grads[0].device)

        def sink(r0: int, r1: int, c0: int, c1: int, ds: Tensor) -> None:
            for grad in self.bias_grads:
                g = ds  # (nb, H, r, c)
                for dim in range(4):
                    if grad.shape[dim] == 1 and g.shape[dim] != 1:
                        g = g.sum(dim=dim, keepdim=True)
                bsl = slice(c.b0, c.b1) if grad.shape[0] > 1 else slice(None)
                rsl = slice(c.r0 + r0, c.r0 + r1) if grad.shape[2] > 1 else slice(None)
                region = grad[bsl, :, rsl]
                if grad.shape[3] == 1:
                    region += g
                elif isinstance(c.keys, tuple):
                    region[..., c.keys[0] + c0 : c.keys[0] + c1] += g
                else:
                    region.index_add_(3, keys[c0:c1], g)

        return sink

    def _band_bwd(self, dout, q, k, v, out, lse_b, c: BandCall, dq, dk, dv) -> bool:
        for b in range(c.b0, c.b1):
            add = self._band_add(c, b, q.device)
            inner, add_in = self._interior(c, add)
            if inner is not None:
                self._band_bwd_inner(dout, q, k, v, out, lse_b, inner, add_in, b, dq, dk, dv)
            for _, rows, (j0, j1), tile in self._edges(c, add):
                bs = slice(b, b + 1)
                gq, gk, gv = _kernel_bwd(
                    dout[bs, :, rows],
                    q[bs, :, rows],
                    k[bs, :, j0:j1],
                    v[bs, :, j0:j1],
                    out[bs, :, rows],
                    lse_b[bs, :, rows],
                    tile,
                    False,
                    self.scale,
                )
                dq[bs, :, rows] += gq
                dk[bs, :, j0:j1] += gk
                dv[bs, :, j0:j1] += gv
        return True

    def _band_bwd_inner(self, dout, q, k, v, out, lse_b, c: BandCall, add, b, dq, dk, dv) -> None:
        """Backward of the batched blocks; overlapping windows' dK/dV are added piece by piece."""
        nblk, nc = c.t1 - c.t0, c.width // c.bq
        gq, gk, gv = _kernel_bwd(
            self._blocks(dout, b, c),
            self._blocks(q, b, c),
            self._windows(k, b, c),
            self._windows(v, b, c),
            self._blocks(out, b, c),
            self._blocks(lse_b, b, c),
            add,
            False,
            self.scale,
        )
        self._blocks(dq, b, c).add_(gq)
        # window t, piece j covers key block (t + j) of the region starting at k_start
        span = (nblk + nc - 1) * c.bq
        for grad, acc in ((gk, dk), (gv, dv)):
            region = acc[b, :, c.k_start : c.k_start + span].unflatten(1, (nblk + nc - 1, c.bq))
            for j in range(nc):
                piece = grad[:, :, j * c.bq : (j + 1) * c.bq]  # (nblk, H_kv, bq, ·)
                region[:, j : j + nblk] += piece.transpose(0, 1)


class _FlashFunction(torch.autograd.Function):
    """``(out, lse)`` of a job; its backward is `_FlashBackward` (so it can be vmapped)."""

    @staticmethod
    def forward(q: Tensor, k: Tensor, v: Tensor, job: FlashJob, *biases: Tensor):
        # biases: the bias tensors that need gradients (also held, in order, by job.source)
        return job.forward(q, k, v)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        q, k, v, job, *biases = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse, *biases)
        ctx.job = job
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, dout: Tensor | None, dlse: Tensor | None):
        q, k, v, out, lse, *biases = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        grads = _FlashBackward.apply(dout, dlse, q, k, v, out, lse, ctx.job, *biases)
        dq, dk, dv, *dbias = grads
        return (dq, dk, dv, None, *dbias)


_DOUBLE_BACKWARD = (
    "flash attention's backward is not differentiable: double backward (higher-order "
    "gradients, e.g. a gradient penalty) is not supported; use backend='reference'"
)


class _FlashBackward(torch.autograd.Function):
    """The recomputing backward of a job as a function of ``dout`` (and ``dlse``).

    Differentiating it raises (no double backward). Under `torch.vmap` — e.g.
    ``torch.autograd.grad(..., is_grads_batched=True)`` — it runs once per vmapped slice.
    """

    @staticmethod
    def forward(dout, dlse, q, k, v, out, lse, job: FlashJob, *biases):
        if torch._C._functorch.is_legacy_batchedtensor(dout):
            # autograd's is_grads_batched vmaps the backward graph with the legacy batching,
            # which bypasses `vmap` below: unwrap dout, run per slice, batch the results.
            level = torch._C._vmapmode_increment_nesting() - 1  # the innermost vmap level
            torch._C._vmapmode_decrement_nesting()
            plain = torch._remove_batch_dim(dout, level, 1, 0)  # (N, B, H, L, Dv)
            parts = [
                _FlashBackward.forward(plain[i], dlse, q, k, v, out, lse, job, *biases)
                for i in range(plain.shape[0])
            ]
            return tuple(
                torch._add_batch_dim(torch.stack(col), 0, level) for col in zip(*parts, strict=True)
            )
        with torch.no_grad():
            dq, dk, dv = job.backward(dout.contiguous(), dlse, q, k, v, out, lse)
            dbias = [
                g.to(job.source.bias_tensors[i].dtype).reshape(job.source.bias_tensors[i].shape)
                for g, i in zip(job.bias_grads, job.grad_biases, strict=True)
            ]
        return (dq, dk, dv, *dbias)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(_DOUBLE_BACKWARD)

    @staticmethod
    def vmap(info, in_dims, dout, dlse, q, k, v, out, lse, job, *biases):
        args = (dout, dlse, q, k, v, out, lse)

        def pick(x, dim, i):
            return x if dim is None or x is None else x.select(dim, i)

        parts = [
            _FlashBackward.forward(
                *(pick(x, d, i) for x, d in zip(args, in_dims[:7], strict=True)),
                job,
                *(pick(b, d, i) for b, d in zip(biases, in_dims[8:], strict=True)),
            )
            for i in range(info.batch_size)
        ]
        stacked = tuple(torch.stack(col) for col in zip(*parts, strict=True))
        return stacked, (0,) * len(stacked)


# --------------------------------------------------------------------------- entry points
def _split_mask_bias(
    mask: Mask | Tensor | None, bias: Tensor | BiasFn | None
) -> tuple[Mask | None, BiasFn | None, list[Tensor]]:
    tensors: list[Tensor] = []
    m: Mask | None = None
    if isinstance(mask, Mask):
        m = mask
    elif isinstance(mask, Tensor):
        if mask.dtype == torch.bool:
            m = TensorMask(mask)
        else:
            tensors.append(mask)
    fn: BiasFn | None = None
    if isinstance(bias, Tensor):
        tensors.append(bias)
    elif bias is not None:
        fn = bias
    return m, fn, tensors


def flash_job(
    req: Request,
    *,
    block_q: int | None = None,
    block_k: int | None = None,
    band_block: int | None = None,
    engine: str | None = None,
) -> FlashJob:
    """The plan and tile source for a validated request (no computation on q, k, v)."""
    d = req.dims
    mask, fn, tensors = _split_mask_bias(req.mask, req.bias)
    wide = req.q.dtype == torch.float64  # see below: float64 uses wide tiles
    # with a bias every tile carries an additive tile: larger tiles mean fewer, fuller calls
    biased = fn is not None or bool(tensors)
    bq = (BLOCK_64 if wide else BLOCK_BIAS if biased else BLOCK_Q) if block_q is None else block_q
    if block_k is not None:
        bk = block_k
    elif wide:
        bk = BLOCK_64
    elif fn is not None and is_relative_bias(fn) and not tensors:
        bk = RELATIVE_WINDOW
    else:
        bk = BLOCK_BIAS if biased else BLOCK_K
    bb = (BLOCK_64 if wide else BAND_BLOCK) if band_block is None else band_block
    bb_fwd = BAND_BLOCK_FWD if band_block is None and not wide else bb
    for name, val in (("block_q", bq), ("block_k", bk), ("band_block", bb)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ValueError(f"{name} must be a positive int, got {val!r}")
    if engine is None:
        # float64 is the verification dtype: its tolerance rule compares against the reference's
        # own summation order (float64 rounding), which a tiled sum over 128-row blocks misses by
        # a few ulp. So float64 runs the pure-PyTorch engine on wide tiles (BLOCK_64), i.e. one
        # tile up to 2048 × 2048 — still bounded memory for any length.
        on_cpu = req.q.device.type == "cpu"
        engine = "kernel" if on_cpu and req.q.dtype != torch.float64 else "torch"
    if engine not in ("kernel", "torch"):
        raise ValueError(f"engine must be 'kernel' or 'torch', got {engine!r}")
    bias_kind = "tensor" if tensors else ("fn" if fn is not None else None)
    relative = bias_kind == "fn" and is_relative_bias(fn)

    def plan_for(band_block: int) -> Plan:
        return build_plan(
            mask,
            B=d.B,
            H=d.H,
            L=d.L,
            S=d.S,
            block_q=bq,
            block_k=bk,
            band_block=band_block,
            bias=bias_kind,
            device=req.q.device,
            relative=relative,
        )

    plan = plan_for(bb_fwd)
    bwd_plan = plan_for(bb) if bb != bb_fwd and plan.kind == "band" else None
    tile_dtype = _acc_dtype(req.q.dtype)
    source = TileSource(
        mask, fn, tensors, d.B, d.H, d.L, d.S, tile_dtype, req.q.device, relative=relative
    )
    chunks = TorchEngine(max(bq, 128), max(bk, 512))
    return FlashJob(plan, source, req.scale / req.temperature, engine, chunks, bwd_plan=bwd_plan)


def _prepare_inputs(req: Request, engine: str) -> tuple[Tensor, Tensor, Tensor, int]:
    """Score preparation (cosine), unit-stride last dims, and zero-padding D ≠ Dv for the kernel."""
    q, k, v = req.q, req.k, req.v
    if req.score != "dot":
        s = get_score(req.score)
        q, k = s.prepare(q), s.prepare(k)
    q, k, v = (x if x.is_contiguous() else x.contiguous() for x in (q, k, v))
    Dv = v.shape[-1]
    D = q.shape[-1]
    if engine == "kernel" and Dv != D:
        # Zero columns change no dot product and add zero output columns: exact.
        width = max(D, Dv)
        if width > D:
            q = torch.nn.functional.pad(q, (0, width - D))
            k = torch.nn.functional.pad(k, (0, width - D))
        if Dv < width:
            v = torch.nn.functional.pad(v, (0, width - Dv))
    return q, k, v, Dv


def _attended_hits(
    plan: Plan, source: TileSource, ind: Tensor, B: int, H: int, L: int
) -> tuple[Tensor, Tensor]:
    """``any`` of the flags ``ind (B, H_kv, S, C)`` over each row's attended keys, tile by tile.

    Walks the plan's calls (EMPTY tiles are in none): calls without an additive tile reduce over
    their keys (FULL) or take the first flagged key (CAUSAL); the others multiply their keep tile
    (mask and bias −inf, from the ORIGINAL bias values) by the flags and also report rows with a
    NaN/+inf bias entry. Returns ``(hits (B, H, L, C), bias_bad (B, H, L))`` bool.
    """
    H_kv, C = ind.shape[1], ind.shape[-1]
    G = H // H_kv
    hits = torch.zeros(B, H, L, C, dtype=torch.bool, device=ind.device)
    bias_bad = torch.zeros(B, H, L, dtype=torch.bool, device=ind.device)
    for c in plan.simple_calls():
        keys = c.key_index(ind.device)
        sub = ind[c.b0 : c.b1].index_select(2, keys)  # (nb, H_kv, K, C)
        R = c.r1 - c.r0
        rows = (slice(c.b0, c.b1), slice(None), slice(c.r0, c.r1))
        add = source.for_call(c)
        if add is None and c.kind == CALL_CAUSAL:
            hi = torch.arange(1, R + 1, device=ind.device).view(1, 1, R)
            hit = nan_rule.any_in_interval(sub, None, hi).repeat_interleave(G, dim=1)
        elif add is None:
            hit = (sub.amax(dim=2) > 0).unsqueeze(2).repeat_interleave(G, dim=1)
        else:
            hit = nan_rule.any_dense(sub, ~torch.isneginf(add)).flatten(1, 2)
            hit = hit.repeat_interleave(H // hit.shape[1], dim=1)  # (nb, H, R|1, C)
            bias_bad[rows] |= (torch.isnan(add) | torch.isposinf(add)).any(dim=-1)
        hits[rows] |= hit
    return hits, bias_bad


def _poison_entries(
    req: Request, plan: Plan, source: TileSource, lse: Tensor
) -> tuple[Tensor, Tensor]:
    """Where the NaN rule puts NaN: ``(row_bad (B, H, L), bad (B, H, L, Dv))`` bool.

    ``req`` holds the ORIGINAL inputs and ``source`` evaluates the ORIGINAL additive terms. Which
    keys a row attends comes from the mask's `Mask.key_interval` when it has one, else from the
    plan's tiles. A bias *function* is not evaluated again: the clean run's lse is NaN/+inf
    exactly on rows where it returned NaN/+inf at an attended pair (the clean q, k, v are
    finite); its −inf entries are not removed from the attended keys of the k/v check.
    """
    d = req.dims
    tensor_bias = bool(source.bias_tensors)
    interval = None
    if isinstance(req.mask, Mask) and not tensor_bias:
        interval = req.mask.key_interval(d.L, d.S, device=req.q.device)
    if not tensor_bias and (req.mask is None or interval is not None):
        row_bad, bad = nan_rule.bad_entries(req.q, req.k, req.v, interval=interval)
    else:
        if not tensor_bias:
            source = replace(source, bias_fn=None)  # the mask alone decides the attended keys
        ones = torch.ones(d.B, d.H_kv, d.S, 1, device=req.q.device)
        k_bad = nan_rule.row_flags(req.k).unsqueeze(-1)
        ind = torch.cat([ones, k_bad, nan_rule.flags(req.v)], dim=-1)  # (B, H_kv, S, 2 + Dv)
        hits, bias_bad = _attended_hits(plan, source, ind, d.B, d.H, d.L)
        row_bad = hits[..., 0] & ((nan_rule.row_flags(req.q) > 0) | hits[..., 1] | bias_bad)
        bad = row_bad.unsqueeze(-1) | hits[..., 2:]
    if source.bias_fn is not None or (req.bias is not None and not tensor_bias):
        fn_bad = torch.isnan(lse) | torch.isposinf(lse)  # (B, H, L)
        row_bad = row_bad | fn_bad
        bad = bad | fn_bad.unsqueeze(-1)
    return row_bad, bad


def flash_run_lse(req: Request, **options: object) -> tuple[Tensor, Tensor]:
    """Runs a validated request on the tiled backend: ``(out (B, H, L, Dv), lse (B, H, L))``.

    The NaN rule (`functional.nan_rule`): the tiles run on inputs whose non-finite entries are 0,
    and NaN is added back where the rule puts it (lse is NaN on those rows).
    """
    if torch.compiler.is_compiling() or req.q.is_meta:
        from .flash_ops import compiled_flash  # the same computation as custom operators

        return compiled_flash(req)
    float_mask = isinstance(req.mask, Tensor) and req.mask.dtype != torch.bool
    clean_req = replace(
        req,
        q=nan_rule.clean(req.q),
        k=nan_rule.clean(req.k),
        v=nan_rule.clean(req.v),
        mask=nan_rule.clean_bias(req.mask) if float_mask else req.mask,  # type: ignore[arg-type]
        bias=nan_rule.clean_bias(req.bias) if isinstance(req.bias, Tensor) else req.bias,
    )
    job = flash_job(clean_req, **options)  # type: ignore[arg-type]
    out, lse = _run_clean(job, clean_req)
    if req.bias is None and not isinstance(req.mask, Tensor):
        d = req.dims
        if req.mask is None:
            hi = torch.full((1, 1, 1), d.S, dtype=torch.long, device=req.q.device)
            interval = (None, hi)
        else:
            interval = req.mask.key_interval(d.L, d.S, device=req.q.device)
        if interval is not None and interval[0] is None:  # prefixes: one pass over out
            return nan_rule.poison_prefix(
                out, req.q, req.k, req.v, interval[1], lse=lse, own_out=True
            )
    original = replace(job.source, bias_tensors=_split_mask_bias(req.mask, req.bias)[2])
    row_bad, bad = _poison_entries(req, job.plan, original, lse)
    return nan_rule.add_nan(out, bad), torch.where(row_bad, float("nan"), lse)


def _run_clean(job: FlashJob, req: Request) -> tuple[Tensor, Tensor]:
    q, k, v, Dv = _prepare_inputs(req, job.engine)
    if job.scale < 0:
        # scale·(q·k) = |scale|·((−q)·k): the kernel fills causal −inf before it scales, so a
        # negative scale would turn masked logits into +inf
        q, job.scale = -q, -job.scale
    biases = job.source.bias_tensors
    job.grad_biases = tuple(i for i, t in enumerate(biases) if _needs_grad(t))
    out, lse = _FlashFunction.apply(q, k, v, job, *(biases[i] for i in job.grad_biases))
    if out.shape[-1] != Dv:
        out = out[..., :Dv]
    return out, lse


def _compile_declines(req: Request) -> str | None:
    """What flash cannot run under torch.compile (see `functional.flash_ops`)."""
    if req.bias is not None and not isinstance(req.bias, Tensor):
        return "under torch.compile flash takes bias tensors, not bias functions"
    if isinstance(req.mask, Mask) and req.mask.spec() is None:
        return "under torch.compile flash needs a mask with a spec (not from_fn)"
    for t in (req.mask, req.bias):
        if isinstance(t, Tensor) and t.is_floating_point() and _needs_grad(t):
            return "under torch.compile flash computes no gradient for mask/bias tensors"
    return None


def flash_run(req: Request) -> tuple[Tensor, None]:
    """The registry's ``run``: output only."""
    return flash_run_lse(req)[0], None


def _needs_grad(x: Tensor) -> bool:
    return torch.is_grad_enabled() and x.requires_grad


def flash_supports(req: Request) -> str | None:
    """None if the tiled backend computes this request, else the reason it does not."""
    if req.return_weights:
        return (
            "flash never materialises the (B, H, L, S) weights (return_weights=True); use "
            "attention(..., return_lse=True) and attention_weights(q, k, lse, rows=...)"
        )
    if req.dropout_p > 0:
        return f"flash does not implement dropout (dropout_p={req.dropout_p})"
    if torch.compiler.is_compiling():
        why = _compile_declines(req)
        if why is not None:
            return why
    if callable(req.bias) and not isinstance(req.bias, Tensor) and torch.is_grad_enabled():
        d = req.dims
        one = torch.zeros((1, 1, 1, 1), dtype=torch.long, device=req.q.device)
        probe = req.bias(one, one, one + (d.S - d.L), one)
        if isinstance(probe, Tensor) and probe.requires_grad:
            return "flash computes no gradient for a bias function whose values require grad"
    return None


# Sizes at which auto prefers flash (see `flash_declines`), from benchmarks/bench_crossover.py
# (B=1, H=8, D=64, fp32; benchmarks/RESULTS.md): a sliding window is as fast on flash at L = 256
# and 1.7× faster at 384; causal document masks and ALiBi cross over near L = 512.
AUTO_BAND_MIN = 1 << 16  # L·S from which sliding windows (narrow bands, no bias) go to flash
AUTO_SPARSE_MIN = 1 << 18  # L·S from which other structured masks and bias functions go
AUTO_LONG_MIN = 1 << 24  # L·S from which every call goes to flash


def flash_declines(req: Request) -> str | None:
    """Auto's preference: None if flash should run this call, else why sdpa is the better pick."""
    d = req.dims
    n = d.L * d.S
    structured = isinstance(req.mask, Mask) and not isinstance(req.mask, TensorMask)
    if structured and req.is_plain_causal and req.bias is None:
        structured = False  # sdpa runs plain causal with the same kernel call
    fn_bias = req.bias is not None and not isinstance(req.bias, Tensor)
    if n >= AUTO_LONG_MIN:
        return None
    band = band_of(req.mask) if structured and req.bias is None else None
    narrow = band is not None and math.isfinite(band[0]) and math.isfinite(band[1])
    threshold = AUTO_BAND_MIN if narrow else AUTO_SPARSE_MIN
    if (structured or fn_bias) and n >= threshold:
        return None
    # (a compiled graph must not print a symbolic size: that would specialise it)
    size = "L·S" if torch.compiler.is_compiling() else f"L·S = {n}"
    if structured or fn_bias:
        return f"{size} < {threshold}: at this size sdpa with the rendered mask/bias beats tiling"
    return f"dense mask/bias and {size} < {AUTO_LONG_MIN}: sdpa's single fused call is as fast"


def flash_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Mask | Tensor | None = None,
    bias: Tensor | BiasFn | None = None,
    scale: float | None = None,
    temperature: float = 1.0,
    score: str = "dot",
    block_q: int | None = None,
    block_k: int | None = None,
    band_block: int | None = None,
    engine: str | None = None,
) -> tuple[Tensor, Tensor]:
    """Tiled exact attention with its log-sum-exp: ``softmax(q·kᵀ·scale/T + bias) v`` and ``lse``.

    Defined to equal `reference.attention` and `reference.logsumexp`; see `attnlab.attention` for
    the meaning of mask, bias, scale, temperature and score (bottom-right aligned masks, True =
    may attend, ``bias(b, h, i, j)`` with i the aligned query position).

    Args:
        q: ``(B, H, L, D)``. k: ``(B, H_kv, S, D)``. v: ``(B, H_kv, S, Dv)``.
        mask, bias, scale, temperature, score: as in `attnlab.attention`.
        block_q, block_k: tile size of the block map (default 128 × 128, 256 × 256 with a bias;
            2048 × 2048 in float64, where tiles favour the reference's summation order).
        band_block: query block of batched band (sliding-window) calls (default 32 in forward,
            64 in backward: each kernel's fastest).
        engine: ``"kernel"`` (torch's CPU flash kernel, the default on CPU below float64) or
            ``"torch"`` (pure-PyTorch online softmax: the default for float64 and off CPU).

    Returns:
        ``(out (B, H, L, Dv), lse (B, H, L))``; lse is float32 (float64 for float64 inputs) and
        −inf for a query row with no key to attend (whose output row is 0).

    Raises:
        ValueError/TypeError: as `attnlab.attention`, plus bad block sizes or engine; flash
            cannot run dropout, return weights, or differentiate a bias.
    """
    from .api import plain_request  # the entry point validates; imported late (api imports us)

    if q.dim() != 4:
        raise ValueError(f"flash_attention expects 4-D q (B, H, L, D), got shape {tuple(q.shape)}")
    req = plain_request(q, k, v, mask, bias, scale, temperature, score)
    why_not = flash_supports(req)
    if why_not is not None:
        raise ValueError(f"flash_attention cannot run this call: {why_not}")
    if req.is_empty:
        from . import reference
        from .request import request_dense

        dm, db = request_dense(req)
        out, _ = reference.attention(
            q, k, v, mask=dm, bias=db, scale=req.scale, temperature=req.temperature, score=req.score
        )
        lse = reference.logsumexp(
            q, k, mask=dm, bias=db, scale=req.scale, temperature=req.temperature, score=req.score
        )
        return out, lse
    return flash_run_lse(
        req, block_q=block_q, block_k=block_k, band_block=band_block, engine=engine
    )


def explain_plan(req: Request) -> str:
    """How flash would tile a request (for `explain`)."""
    return flash_job(req).plan.describe()


RunLse = Callable[[Request], tuple[Tensor, Tensor]]

__all__ = [
    "BAND_BLOCK",
    "BAND_BLOCK_FWD",
    "BLOCK_K",
    "BLOCK_Q",
    "FlashJob",
    "TileSource",
    "TorchEngine",
    "explain_plan",
    "flash_attention",
    "flash_declines",
    "flash_job",
    "flash_run",
    "flash_run_lse",
    "flash_supports",
]
