"""`FlashJob`: walks a tiling plan, forward (merging partials) and backward (recomputing calls).

A job is everything that defines one tiled attention call except the tensors q, k, v: the plan,
the tile source, the scale and the engine. Forward runs every call of the plan and combines calls
over disjoint key sets by log-sum-exp; backward recomputes every call from q, k, v and the GLOBAL
out and lse (`engines.Residuals`), in a fixed order, so gradients are bit-deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from ..._shapes import stat_dtype
from .. import nan_rule
from ..merge import merge_compensated, merge_into, merge_partials
from ..request import Request
from ..sinks import apply_sinks
from . import band_kernel
from .band import band_backward, band_forward, segment_backward, segment_forward
from .calls import CALL_CAUSAL, BandCall, Call, Plan, SegmentCall
from .engines import (
    BandTiles,
    DsSink,
    Logits,
    Residuals,
    TileSource,
    TorchEngine,
    as4,
    fix_dead_rows,
    kernel_backward,
    kernel_forward,
    kernel_widens,
)

_NEG_INF = float("-inf")
_POS_INF = float("inf")
_Grads = tuple[Tensor, Tensor, Tensor]
_Rows = tuple[slice, slice, slice]


def _rows(c: Call) -> _Rows:
    return (slice(c.b0, c.b1), slice(None), slice(c.r0, c.r1))


@dataclass
class FlashJob:
    """Everything that defines one tiled attention call except the tensors q, k, v.

    Attributes:
        plan: the tiling of the (query, key) grid (`flash.tiling.build_plan`).
        source: evaluates additive tiles (mask, bias) on a call's indices.
        scale: the logit multiplier ``|scale / temperature| > 0`` (a negative one's sign is
            folded into q: `request.logit_qk`).
        engine: ``"kernel"`` or ``"torch"`` (`functional.flash.engines`).
        torch_engine: chunk sizes of the torch engine.
        grad_biases: indices into ``source.bias_tensors`` that need gradients.
        out32: float32 output of a widened float16/bfloat16 forward (backward's δ reads it).
        lse_lo: rounding error of lse on the torch engine (``lse + lse_lo`` is the log-sum-exp
            to about float64 precision, merged rows included); None on the kernel engine.
        band_tiles: the tiles of batched band calls (relative-bias tiles cached per call).
        bwd_plan: the plan backward runs, if not the forward's.
        bias_grads: gradients of the ``grad_biases`` tensors, filled by `backward`.
        softcap: logit soft-capping ``softcap·tanh(s / softcap)`` (> 0) applied per tile before
            the additive tile, or None; only the ``"torch"`` engine runs it (`flash_job`).
        policy: the low-precision policy (`engines.low_precision`, `FlashOptions`): other than
            ``"widen"``, float16/bfloat16 merge-free plans run the kernels in the input dtype
            (`_widen`); under ``"auto"`` torch's kernel widens each call where the CPU has no
            native products (`kernel_widens`).
        own_kernel: attnlab's C++ band kernel may run band and segment calls of this job (False
            when it never does for its dtype and CPU: no call then asks it).
        keys: the key mask ``(B|1, S)`` bool that keyed calls read (`tiling.key_mask_plan`).
        rows: the query rows ``(B|1, L)`` bool that may attend at all (`tiling.key_mask_plan`):
            `forward` gives the others 0 and lse −inf (backward's P is 0 there); None: all.
        sinks: ``(H,)`` float32 sinks the kernel calls fold into their rows (`run.folds_sinks`).
    """

    plan: Plan
    source: TileSource
    scale: float
    engine: str
    torch_engine: TorchEngine
    grad_biases: tuple[int, ...] = ()
    out32: Tensor | None = field(default=None, repr=False)
    lse_lo: Tensor | None = field(default=None, repr=False)
    band_tiles: BandTiles | None = field(default=None, repr=False)
    bwd_plan: Plan | None = None
    bias_grads: list[Tensor] = field(default_factory=list, repr=False)
    softcap: float | None = None
    policy: str = "widen"
    own_kernel: bool = True
    keys: Tensor | None = field(default=None, repr=False)
    rows: Tensor | None = field(default=None, repr=False)
    sinks: Tensor | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.band_tiles is None:
            self.band_tiles = BandTiles(self.source)
        if self.softcap is not None and self.engine != "torch" and not self.own_kernel:
            raise ValueError(
                f"softcap={self.softcap} needs engine='torch' or attnlab's C++ kernels (torch's "
                f"CPU flash kernel cannot apply tanh to its logits), got engine={self.engine!r}"
            )

    @property
    def shared_tiles(self) -> dict[BandCall, Tensor]:
        """The relative-bias tiles of band calls, built once per call (see `BandTiles`)."""
        assert self.band_tiles is not None
        return self.band_tiles.shared

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

    def _widen(self, q: Tensor, plan: Plan | None = None, *, backward: bool = False) -> bool:
        """float16/bfloat16 with several calls run the kernel (or the torch engine) in float32.

        Except the forward on the kernel engine without a bias when every output row comes from
        ONE call of the plan (`Plan.merge_free`: bands, causal, packed documents) and the
        low-precision policy is not ``"widen"`` (`engines.low_precision`): each row's output is
        then rounded once either way, so the kernel runs in the input dtype (its
        bfloat16/float16 matmuls, float32 statistics). The ``backward`` is always widened: torch's
        kernel would sum dK/dV over its query blocks and a group's heads in the input dtype.

        Each kernel call rounds its partial output and gradients to the input dtype; summing
        several such partials (over query blocks for dK/dV, over key sets for the output) would
        add one rounding per call. In float32 the partials stay exact enough and only the final
        result is rounded once. Additive tiles are float32 too (`flash_job`): a bias keeps
        its float32 precision, where rounding ALiBi's −slope·|i − j| to bfloat16 would move
        distant logits by whole units. The torch engine rounds each call's output to the input
        dtype as well, so it is widened the same way (soft-capped float16/bfloat16 calls run it).
        """
        if q.dtype not in (torch.float16, torch.bfloat16):
            return False
        plan = self.plan if plan is None else plan
        if backward:
            # torch's kernel backpropagates 16-bit inputs in their dtype: it sums dK/dV over its
            # blocks of query rows (and over the G query heads of a key head) in 16-bit tensors,
            # so a key many rows attend gathers one rounding per block — dV 2.4× torch's own
            # error for bfloat16 GQA at L = 256 (issue #38), over the tolerance rule for
            # global tokens at L = 767. Widened, every sum stays float32 and each gradient is
            # rounded once (attnlab's C++ band backward reads the 16-bit inputs and widens them
            # as it packs them). Batched band calls were measured faster in float32 anyway
            # (bfloat16, window 256, L=16384, AMD EPYC without AMX, fwd+bwd 1.34 s native vs
            # 1.13 s widened).
            return True
        # the kernel reads an additive tile in the query dtype: a bias (ALiBi's −slope·|i − j|)
        # must not be rounded to half precision, so only mask-only plans run native
        native = self.engine == "kernel" and self.policy != "widen" and not plan.biased
        return not (native and plan.merge_free)

    def _store(self, out: Tensor, lse: Tensor, o: Tensor, l: Tensor) -> None:
        """Writes a call's rows, or merges them in when the plan's groups overlap."""
        if self.plan.overlap:
            merge_into(out, lse, o, l)
        else:
            out.copy_(o)
            lse.copy_(l)

    def _single_call(self, plan: Plan) -> Call | None:
        """The plan's only call when it covers the whole grid without a bias (one kernel call)."""
        if plan.biased or not plan.single_call:
            return None
        c = plan.groups[0].calls[0]
        assert isinstance(c, Call)
        return c

    # ---------------------------------------------------------------- forward
    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """``(out (B, H, L, Dv), lse (B, H, L) float32+)`` (with `sinks`, theirs)."""
        out, lse = self._forward(q, k, v)
        if self.rows is None:
            return out, lse
        keep = self.rows[:, None, :]  # (B|1, 1, L): rows outside attend nothing
        return out.masked_fill(~keep[..., None], 0.0), lse.masked_fill(~keep, _NEG_INF)

    def _forward(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        B, H, L, _ = q.shape
        Dv = v.shape[-1]
        plan = self.plan
        single = self._single_call(plan) if self.engine == "kernel" else None
        if single is not None:
            causal = single.kind == CALL_CAUSAL
            whole = plan.whole
            if whole is not None and self.own_kernel and band_kernel.segments_usable(q, k, v, L):
                # one segment of L positions: attnlab's one-pass kernel (faster than torch's)
                out = torch.empty(B, H, L, Dv, dtype=q.dtype, device=q.device)
                lse = torch.empty(B, H, L, dtype=torch.float32, device=q.device)
                kw = {"softcap": self.softcap, "sinks": self.sinks}
                segment_forward(whole, q, k, v, scale=self.scale, out=out, lse=lse, **kw)
                return out, lse
            assert self.softcap is None, "soft-capped logits need attnlab's C++ kernels"
            out, lse = kernel_forward(
                q, k, v, Logits(self.scale, causal=causal, policy=self.policy)
            )
            return out, lse.contiguous()
        if self._widen(q):
            if self._float_partials(q, k, v):
                out, lse = self._run_groups(q, k, v, torch.float32)
            else:
                out, lse = self._forward(q.float(), k.float(), v.float())
            self.out32 = out  # backward's δ = rowsum(dout·out) uses the unrounded output
            return out.to(q.dtype), lse
        return self._run_groups(q, k, v, q.dtype)

    def _float_partials(self, q: Tensor, k: Tensor, v: Tensor) -> bool:
        """Whether a bfloat16/float16 forward that `_widen` widens can keep its inputs: every
        call of the plan is a band call on attnlab's C++ band kernel, which multiplies bfloat16
        inputs with float32 accumulation (float16 ones widened as it packs them), reads the
        float32 additive tiles (a bias keeps its precision) and writes float32 partial outputs,
        so the merges and the one final rounding are those of the widened run while bfloat16
        products run on the bfloat16 units (ALiBi on a causal mask: band calls per offset,
        merged)."""
        if self.engine != "kernel" or self.policy == "widen":
            return False  # (``ATTNLAB_FLASH_LOWP=widen`` runs every product in float32)
        return self.own_kernel and band_kernel.runs_every_call(self.plan, q, k, v)

    def _run_groups(
        self, q: Tensor, k: Tensor, v: Tensor, out_dtype: torch.dtype
    ) -> tuple[Tensor, Tensor]:
        """The plan's calls group by group: ``(out (B, H, L, Dv) in out_dtype, lse (B, H, L))``."""
        B, H, L, _ = q.shape
        Dv = v.shape[-1]
        plan = self.plan
        # rows in no group attend nothing: zeros; skip the memset when every row is covered
        alloc = torch.empty if plan.covers_all and not plan.overlap else torch.zeros
        out = alloc(B, H, L, Dv, dtype=out_dtype, device=q.device)
        lse = torch.full((B, H, L), _NEG_INF, dtype=stat_dtype(q.dtype), device=q.device)
        # the torch engine returns lse's rounding error with each call; merges keep it too
        self.lse_lo = torch.zeros_like(lse) if self.engine == "torch" else None  # (B, H, L)
        for g in plan.groups:
            parts: list[tuple[Tensor, Tensor, Tensor | None]] = []
            for c in g.calls:
                if isinstance(c, SegmentCall) and self._segments_run(c, q, k, v):
                    own, cap, keys = self.own_kernel, self.softcap, self._keys(c)
                    kw = {"own": own, "softcap": cap, "keys": keys, "sinks": self.sinks}
                    segment_forward(c, q, k, v, scale=self.scale, out=out, lse=lse, **kw)
                elif isinstance(c, BandCall | SegmentCall):
                    self._band_forward(q, k, v, c, out=out, lse=lse)
                else:
                    parts.append(self._simple_forward(q, k, v, c))
            if not parts:
                continue
            rows = (slice(g.b0, g.b1), slice(None), slice(g.r0, g.r1))
            if len(parts) == 1:
                o, l, lo = parts[0]
            elif self.lse_lo is not None:  # the torch engine: keep lse's rounding error
                o, l, lo = merge_compensated(parts)
            else:
                o, l = merge_partials([p[0] for p in parts], [p[1] for p in parts])
                lo = None
            self._put(out, lse, rows, o, l, lo)
        return out, lse

    def _segments_run(self, c: SegmentCall, q: Tensor, k: Tensor, v: Tensor) -> bool:
        """Whether segment call ``c`` runs as one call on the kernel engine (torch's kernel
        takes an unkeyed one attnlab's does not); else its `SegmentCall.block_calls` run."""
        if self.engine != "kernel":
            return False
        return not c.keyed or (self.own_kernel and band_kernel.segments_usable(q, k, v, c.n))

    def _bands_run(self, c: BandCall, q: Tensor, k: Tensor, v: Tensor) -> bool:
        """`_segments_run` for a band call (kernel engine)."""
        return not c.keyed or (self.own_kernel and band_kernel.usable(q, k, v, c.bq))

    def _keys(self, c: BandCall | SegmentCall) -> Tensor | None:
        """The key mask a keyed call reads (None: unkeyed)."""
        assert not c.keyed or self.keys is not None, "a keyed call needs the job's keys"
        return self.keys if c.keyed else None

    def _band_forward(
        self, q, k, v, c: BandCall | SegmentCall, *, out: Tensor, lse: Tensor
    ) -> None:
        if self.engine == "kernel" and isinstance(c, BandCall) and self._bands_run(c, q, k, v):
            assert self.band_tiles is not None
            tiles, scale = self.band_tiles, self.scale
            store = self._store if self.plan.overlap else None  # None: written in place
            kw = {"out": out, "lse": lse, "store": store, "own": self.own_kernel}
            kw["keys"], kw["sinks"] = self._keys(c), self.sinks
            band_forward(c, q, k, v, tiles=tiles, scale=scale, softcap=self.softcap, **kw)
            return
        for bc in c.block_calls():
            o, l, lo = self._simple_forward(q, k, v, bc)
            self._put(out, lse, _rows(bc), o, l, lo)

    def _simple_forward(self, q, k, v, c: Call) -> tuple[Tensor, Tensor, Tensor | None]:
        qc, kc, vc, add = self._call_tensors(q, k, v, c)
        logits = Logits(self.scale, add, c.kind == CALL_CAUSAL, self.softcap, self.policy)
        if self.engine == "kernel" and self.softcap is None:
            o, l = fix_dead_rows(*kernel_forward(qc, kc, vc, logits), add)
            return (o, l, None) if self.sinks is None else apply_sinks(o, l, self.sinks)  # lo None
        # the torch engine; on the kernel engine, a soft-capped job's edge tiles (torch's fused
        # kernel cannot apply tanh; such jobs have no backward, so lse needs no compensation)
        return self.torch_engine.forward(qc, kc, vc, logits)

    def _put(
        self, out: Tensor, lse: Tensor, rows: _Rows, o: Tensor, l: Tensor, lo: Tensor | None
    ) -> None:
        """Writes one part's rows into ``out``/``lse`` (merges them in when the plan's groups
        overlap), and on the torch engine its lse's rounding error ``lo`` into `lse_lo`.

        A merged row's lse is ``hi + lo`` of the compensated merge (`merge_compensated`), so
        backward's ``exp(s − lse − lse_lo)`` stays exact to float32 however many calls a row
        took: soft-capped or biased logits near ±30 or −500 put ulp(lse) at 2e-6 to 3e-5.
        """
        if self.lse_lo is None:
            self._store(out[rows], lse[rows], o, l)
            return
        lo = torch.zeros_like(l) if lo is None else lo
        if self.plan.overlap:
            prev = (out[rows], lse[rows], self.lse_lo[rows])
            o, l, lo = merge_compensated([prev, (o, l, lo)])
        out[rows].copy_(o)
        lse[rows].copy_(l)
        self.lse_lo[rows] = lo

    # ---------------------------------------------------------------- explain
    def engines(self, q: Tensor, k: Tensor, v: Tensor, *, grad: bool) -> list[str]:
        """Which engine runs each part of this job on ``q``, ``k``, ``v`` (as `forward` and,
        with ``grad``, `backward` decide; for `attnlab.explain`): phrases such as ``"forward: 1
        band call on attnlab's C++ band kernel"``. Reads only dtypes, shapes and strides."""

        def like(x: Tensor, dtype: torch.dtype) -> Tensor:  # dtype, device, head dim: no copy
            return torch.empty((1, 1, 1, x.shape[-1]), dtype=dtype, device=x.device)

        torch_kernel = "torch's CPU flash kernel"
        if self.engine == "torch":
            return ["forward and backward: the pure-PyTorch tile engine (online softmax)"]
        parts: list[str] = []
        L = q.shape[2]
        single = self._single_call(self.plan)
        if single is not None:
            if k.shape[2] == L and band_kernel.segments_usable(q, k, v, L):
                on = f"{band_kernel.engine_name(q.dtype)}, as one segment"
            else:
                wide = kernel_widens(q.dtype, False, self.policy)
                on = torch_kernel + (" (widened to float32)" if wide else "")
            parts.append(f"forward: one call on {on}")
        else:
            dtype = q.dtype
            if self._widen(q) and not self._float_partials(q, k, v):
                dtype = torch.float32
            ours = band_kernel.engine_name(dtype)
            qq, kk, vv = like(q, dtype), like(k, dtype), like(v, dtype)
            counts: dict[str, int] = {}
            for c in (c for g in self.plan.groups for c in g.calls):
                if isinstance(c, BandCall):
                    key = ("band call", band_kernel.usable(qq, kk, vv, c.bq))
                elif isinstance(c, SegmentCall):
                    key = ("segment call", band_kernel.segments_usable(qq, kk, vv, c.n))
                else:
                    key = ("call", False)
                other = "the pure-PyTorch tile engine" if self.softcap is not None else torch_kernel
                name = f"{key[0]}(s) on {ours if key[1] else other}"
                counts[name] = counts.get(name, 0) + 1
            wide = " (in float32)" if dtype != q.dtype else ""
            parts += [f"forward{wide}: {n} {name}" for name, n in counts.items()]
        if grad:
            parts.append(f"backward: {self._backward_engine(q, k, v, single)}")
        return parts

    def _backward_engine(self, q: Tensor, k: Tensor, v: Tensor, single: Call | None) -> str:
        """The engine of `backward` in words (for `engines`)."""
        if self.grad_biases:
            return "the pure-PyTorch tile engine (a bias gradient needs its dS)"
        calls = [c for g in (self.bwd_plan or self.plan).groups for c in g.calls]
        out = torch.empty((1, 1, 1, v.shape[-1]), dtype=torch.float32, device=q.device)
        dout = torch.empty((1, 1, 1, v.shape[-1]), dtype=q.dtype, device=q.device)
        if single is not None:
            n = q.shape[2] if k.shape[2] == q.shape[2] else band_kernel.SEGMENT_MAX + 1
            own = band_kernel.segments_backward_usable(q, k, v, out, dout, n)
        elif any(isinstance(c, BandCall) for c in calls):
            own = band_kernel.backward_usable(q, k, v, out, dout)
        else:
            segs = [c.n for c in calls if isinstance(c, SegmentCall)]
            own = bool(segs) and band_kernel.segments_backward_usable(q, k, v, out, dout, max(segs))
        if not own:
            return "torch's CPU flash kernel"
        rest = any(not isinstance(c, BandCall | SegmentCall) for c in calls)
        return band_kernel.engine_name(torch.float32) + (
            "; other calls on torch's CPU flash kernel" if rest else ""
        )

    # ---------------------------------------------------------------- backward
    def backward(self, res: Residuals, dlse: Tensor | None = None) -> _Grads:
        """``(dq, dk, dv)`` in the input dtype; every call recomputed from ``res``.

        ``res`` holds the whole tensors with the GLOBAL out and lse (−inf on rows with no key).
        Gradients of bias tensors (``grad_biases``) are accumulated into ``self.bias_grads``.
        """
        q, k, v = res.q, res.k, res.v
        plan = self.plan if self.bwd_plan is None else self.bwd_plan
        acc = stat_dtype(q.dtype)
        lse_b = torch.where(torch.isneginf(res.lse), _POS_INF, res.lse)  # no key: P = 0
        res = replace(res, lse=lse_b)
        # the kernel never exposes dS: bias gradients and lse gradients take the torch engine
        use_kernel = self.engine == "kernel" and dlse is None and not self.grad_biases
        self.bias_grads = [
            torch.zeros(as4(self.source.bias_tensors[i]).shape, dtype=acc, device=q.device)
            for i in self.grad_biases
        ]
        single = self._single_call(plan) if use_kernel else None
        if single is not None:
            causal = single.kind == CALL_CAUSAL
            L = q.shape[2]
            xs = (q, k, v, res.out, res.dout)
            whole = plan.whole
            own = self.own_kernel
            if whole is not None and own and band_kernel.segments_backward_usable(*xs, L):
                # one segment of L positions: attnlab's C++ backward (float32 products)
                grads = tuple(torch.zeros(x.shape, dtype=acc, device=q.device) for x in (q, k, v))
                assert len(grads) == 3
                segment_backward(whole, res, scale=self.scale, grads=grads)
                return grads
            if not self._widen(q, plan, backward=True):
                return kernel_backward(res, Logits(self.scale, causal=causal, policy=self.policy))
            # the kernel sums dK/dV over query blocks in the input dtype: do it in float32 (where
            # attnlab's C++ segment backward takes the float32 call, it runs it)
            out32 = self.out32 if self.out32 is not None else res.out.float()
            wide = Residuals(*(x.float() for x in (res.dout, q, k, v)), out32, lse_b)
            return self._narrow(self.backward(wide, dlse), q, k, v)
        if self._widen(q, plan, backward=True):
            out32 = self.out32 if self.out32 is not None else res.out.float()
            own = use_kernel and self.own_kernel
            if own and band_kernel.backward_runs_every_call(plan, q, k, v, out32, res.dout):
                # attnlab's C++ band backward widens 16-bit inputs as it packs them: the
                # widened run's values without the widened copies
                res = Residuals(res.dout, q, k, v, out32, lse_b)
            else:
                wide = Residuals(*(x.float() for x in (res.dout, q, k, v)), out32, lse_b)
                return self._narrow(self.backward(wide, dlse), q, k, v)
        grads = tuple(torch.zeros(x.shape, dtype=acc, device=q.device) for x in (q, k, v))
        assert len(grads) == 3
        for g, alone in zip(plan.groups, plan.alone, strict=True):
            whole = alone and len(g.calls) == 1  # the call holds every key of its rows
            for c in g.calls:
                if isinstance(c, BandCall) and use_kernel and self._bands_back(c, res):
                    kw = {"whole": whole, "own": self.own_kernel, "keys": self._keys(c)}
                    kw |= {"grads": grads, "tiles": self.band_tiles, "scale": self.scale}
                    band_backward(c, res, **kw)
                    continue
                if isinstance(c, SegmentCall) and use_kernel and self._segments_back(c, res):
                    own, keys = self.own_kernel, self._keys(c)
                    segment_backward(c, res, scale=self.scale, grads=grads, own=own, keys=keys)
                    continue
                calls = c.block_calls() if isinstance(c, BandCall | SegmentCall) else (c,)
                for bc in calls:
                    self._simple_backward(res, bc, grads, dlse=dlse, kernel=use_kernel, whole=whole)
        return self._narrow(grads, q, k, v)

    def _segments_back(self, c: SegmentCall, res: Residuals) -> bool:
        """Whether segment call ``c``'s backward runs as one call (kernel engine): a keyed one
        only on attnlab's C++ kernel (else its `SegmentCall.block_calls` run)."""
        if not c.keyed:
            return True
        xs = (res.q, res.k, res.v, res.out, res.dout)
        return self.own_kernel and band_kernel.segments_backward_usable(*xs, c.n)

    def _bands_back(self, c: BandCall, res: Residuals) -> bool:
        """`_segments_back` for a band call."""
        xs = (res.q, res.k, res.v, res.out, res.dout)
        return not c.keyed or (self.own_kernel and band_kernel.backward_usable(*xs))

    @staticmethod
    def _narrow(grads: _Grads, q: Tensor, k: Tensor, v: Tensor) -> _Grads:
        return grads[0].to(q.dtype), grads[1].to(k.dtype), grads[2].to(v.dtype)

    def _simple_backward(
        self, res: Residuals, c: Call, grads: _Grads, *, dlse, kernel: bool, whole: bool
    ) -> None:
        """Adds one call's gradients into ``grads = (dq, dk, dv)``; ``whole``: the call holds
        every key of its rows (see `TorchEngine.backward`)."""
        dq, dk, dv = grads
        qc, kc, vc, add = self._call_tensors(res.q, res.k, res.v, c)
        rows = _rows(c)
        part = Residuals(res.dout[rows], qc, kc, vc, res.out[rows], res.lse[rows])
        logits = Logits(self.scale, add, c.kind == CALL_CAUSAL, self.softcap, self.policy)
        if kernel:
            gq, gk, gv = kernel_backward(part, logits)
        else:
            gq, gk, gv = self.torch_engine.backward(
                part,
                logits,
                dlse=None if dlse is None else dlse[rows],
                lse_lo=None if self.lse_lo is None else self.lse_lo[rows],
                on_ds=self._bias_grad_sink(c) if self.grad_biases else None,
                whole=whole,
            )
        dq[rows] += gq
        if isinstance(c.keys, tuple):
            dk[c.b0 : c.b1, :, c.keys[0] : c.keys[1]] += gk
            dv[c.b0 : c.b1, :, c.keys[0] : c.keys[1]] += gv
        else:
            idx = c.keys.to(dk.device)
            dk[c.b0 : c.b1].index_add_(2, idx, gk.to(dk.dtype))
            dv[c.b0 : c.b1].index_add_(2, idx, gv.to(dv.dtype))

    def _bias_grad_sink(self, c: Call) -> DsSink:
        """Adds a tile's dS into the gradient of each bias tensor (summed over broadcast dims)."""
        keys = c.index.to(self.bias_grads[0].device)

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


# ---------------------------------------------------------------- where the NaN rule puts NaN
def attended_hits(plan: Plan, source: TileSource, ind: Tensor) -> tuple[Tensor, Tensor]:
    """``any`` of the flags ``ind (B, H_kv, S, C)`` over each row's attended keys, tile by tile.

    Walks the plan's calls (EMPTY tiles are in none): calls without an additive tile reduce over
    their keys (FULL) or take the first flagged key (CAUSAL); the others multiply their keep tile
    (mask and bias −inf, from the ORIGINAL bias values) by the flags and also report rows with a
    NaN/+inf bias entry. Returns ``(hits (B, H, L, C), bias_bad (B, H, L))`` bool.
    """
    B, H, L = source.B, source.H, source.L
    H_kv, C = ind.shape[1], ind.shape[-1]
    G = H // H_kv
    hits = torch.zeros(B, H, L, C, dtype=torch.bool, device=ind.device)
    bias_bad = torch.zeros(B, H, L, dtype=torch.bool, device=ind.device)
    for c in plan.simple_calls:
        keys = c.index.to(ind.device)
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


def poison_entries(
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
    mask = req.terms.given_mask
    if mask is not None and not tensor_bias:
        interval = mask.key_interval(d.L, d.S, device=req.q.device)
    if not tensor_bias and (req.mask is None or interval is not None):
        row_bad, bad = nan_rule.bad_entries(req.q, req.k, req.v, interval=interval)
    else:
        if not tensor_bias:
            source = replace(source, bias_fn=None)  # the mask alone decides the attended keys
        ones = torch.ones(d.B, d.H_kv, d.S, 1, device=req.q.device)
        k_bad = nan_rule.row_flags(req.k).unsqueeze(-1)
        ind = torch.cat([ones, k_bad, nan_rule.flags(req.v)], dim=-1)  # (B, H_kv, S, 2 + Dv)
        hits, bias_bad = attended_hits(plan, source, ind)
        row_bad = hits[..., 0] & ((nan_rule.row_flags(req.q) > 0) | hits[..., 1] | bias_bad)
        bad = row_bad.unsqueeze(-1) | hits[..., 2:]
    if source.bias_fn is not None or (req.bias is not None and not tensor_bias):
        fn_bad = torch.isnan(lse) | torch.isposinf(lse)  # (B, H, L)
        row_bad = row_bad | fn_bad
        bad = bad | fn_bad.unsqueeze(-1)
    return row_bad, bad


__all__ = ["FlashJob", "attended_hits", "poison_entries"]
