"""attnlab's C++ band kernel (``_ext/band_attn.cpp``): the forward of batched band calls and of
batched segments (packed documents, and one whole causal or full call when L = S).

A batched band call (`calls.BandCall`, a sliding window) holds every key of its rows in one
window, so its softmax needs one pass; attnlab's operator packs each head's keys once for all the
overlapping windows and runs both products on oneDNN's brgemm micro-kernel (float32 accumulation),
where torch's fused kernel repacks every window and keeps a running rescale. One call covers the
whole band, edge blocks included (their windows are clipped to the keys inside the kernel).
Measured (``attnlab bench --case window``): docs/results.

What made it fast on AMX (all in the C++ file, each measured there): 64-byte aligned scratch
(tile rows straddling cache lines slow the products), bfloat16 rows in whole 32-key
steps (a K remainder takes a slower micro-kernel), each product run on a group of blocks before
the other (one tile configuration per group), and the softmax in explicit AVX-512 (2^t as
2ⁿ·poly, one-instruction bfloat16 rounding) with 32-row blocks in bfloat16 (`BLOCKS`).

Segments (`calls.SegmentCall`: rows attend only their own segment, causally or fully) are
one-pass too: each query block holds every key of its rows (causal: only the keys up to them),
the keys of a head are packed once for all segments (measured against torch's batched
``is_causal`` call: docs/results). Segments longer than `SEGMENT_MAX`
positions stay on torch's kernel (the kernel holds a block's scores for a whole segment:
``SEGMENT_BLOCK × n`` floats per thread).

It runs a call when all of these hold, else torch's kernel does (same values within the
tolerance rule; both give out = 0, lse = −inf on a row with no key):

- the CPU, float32, bfloat16 or float16, unit stride in the last dim, not while
  `torch.compile` traces. bfloat16 multiplies in VNNI pairs (an even head dim and block) where
  the CPU's micro-kernel has them (AVX512-BF16 or AMX, `pairs`); float16, and bfloat16 on other
  CPUs, are widened to float32 as they are packed (exact: the float32 products run at the
  float16 matmul rate on CPUs with AVX512-FP16 but no AMX-FP16; on AVX2-only CPUs the
  softmax, exp and transposes run in 8-lane AVX2; measured against torch's kernel:
  docs/results, ``benchmarks/bench_engines.py``; ``ATTNLAB_FLASH_BAND_ENGINE=aten``
  picks torch's); outputs are rounded once;
- the extension is built (`attnlab._ext.load`: ``attnlab build``, or the first call that needs
  it builds it, once per machine) and the CPU runs oneDNN's float32 micro-kernel
  (``supported``, asked once);
- ``ATTNLAB_FLASH_BAND_ENGINE`` is unset, ``auto`` or ``widen`` (bfloat16 widened on any CPU);
  ``aten`` forces torch's kernel (the suite runs every one on any CPU).

Attention sinks: both forward operators take ``sinks (H,)`` float32 and add
head h's ``e^{s_h}`` to each of its rows' denominators where the row is finalised, so ``out`` and
``lse`` are those of attention with sinks (``lse = log(e^{s_h} + Σ_j e^{l_ij})``; a row with no
key: 0 and ``lse = s_h``; a NaN/+inf sink: the rows with a key NaN) at no extra pass; the
backward operators are exact on them unchanged (`functional.flash.sinks`).

The backward of band calls (`backward_into`: every product in float32, 16-bit inputs widened as
they are packed — the values of a widened run, without the widened copies) runs on the same
extension when `backward_usable`: per
query block and head it recomputes ``P = exp(q·kᵀ·scale + add − lse)`` from the forward's lse,
``dS = P ⊙ (dO·vᵀ − δ)`` with ``δ = Σ_j P_ij·dP_ij`` of each row when the call holds every key
of its rows (as softmax's own backward: dS sums to zero with the P and dP it multiplies), else
``δ = rowsum(dO ⊙ O)`` summed in double, adds ``dS·k`` into dq and keeps ``qᵀ·dS``
and ``dOᵀ·P`` for the window's keys in per-thread accumulators that add each key's gradient
into dk/dv once (five brgemm products per block; the keys and values packed as they advance,
as in the forward). It runs the forward plan's blocks (measured: docs/results).
Segments (and one whole causal or full call with L = S) have their backward on it too
(`segments_backward_into`: one work item per segment and key head, owning its keys' gradients)
in float32, and in 16-bit dtypes whose products the CPU does not run natively
(`segments_backward_usable`: widened as packed); bfloat16 pairs keep torch's kernel in bfloat16.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from contextvars import ContextVar

import torch
from torch import Tensor

from ... import _ext, _settings
from .calls import BandCall, Plan, SegmentCall

ENGINE_ENV = _settings.FLASH_BAND_ENGINE
ENGINES = ("auto", "aten", "widen")
EXT = "band_attn"
# Forward query block of band calls on this kernel, per dtype. float32: 16 rows (271 keys for a
# 256-window) beat 32 (287) — window 256, L = 16384, 2 threads, AMD EPYC: 0.069 vs 0.071 s; 8 and
# 24 rows were no faster; Xeon with AMX: 16/32/48/64 rows 44/49/52/49 ms. bfloat16 rows are
# padded to whole 32-key steps (16 and 32 rows both read 288 keys), so 32 rows halve the calls:
# Xeon with AMX, 16 → 32 rows 17.1 → 16.0 ms (48 rows 22, 64 rows 20). float16 runs the float32
# products (widened as packed): 16 rows, as float32 (same Xeon: 16 vs 32 rows 37–38 vs 39 ms).
# bfloat16 widened to float32 as it is packed (`pairs` is False) takes float32's block.
BLOCKS = {torch.float32: 16, torch.bfloat16: 32, torch.float16: 16}
BLOCK = BLOCKS[torch.float32]
# Query block of segment calls (8 × 2048 causal at L = 16384, best of 7: 32/64/96/128 rows took
# 0.202/0.208/0.212/0.208 s in float32 and 0.134/0.126/0.127/0.134 s in bfloat16), and the
# longest segment it takes (its scores: 64 × 32768 floats = 8 MiB per thread).
SEGMENT_BLOCK = 64
SEGMENT_MAX = 32768
# Set by `checking_inputs`: the list each band call appends its finding to.
_CHECKS: ContextVar[list[bool] | None] = ContextVar("attnlab_band_checks", default=None)
# Asked once per process (again after `attnlab._settings.forget`: a settings refresh, entering
# or leaving `attnlab._ext.reporting`): the band engine setting, whether the extension loaded,
# and `ready`'s answers per (dtype, device, D, bq).
_ANSWERS: dict[object, object] = {}
_settings.on_refresh(_ANSWERS.clear)


def _loaded() -> bool:
    """`attnlab._ext.load` of this kernel, asked once per process (`attnlab._ext.reporting`
    forgets the answer on entry and exit)."""
    answer = _ANSWERS.get("load")
    if answer is None:
        answer = _ANSWERS["load"] = _ext.load(EXT)
    return bool(answer)


def engine_setting() -> str:
    """``$ATTNLAB_FLASH_BAND_ENGINE`` (default ``auto``), read once per process: ``auto`` runs
    this kernel where it can, ``aten`` torch's kernel instead, ``widen`` this kernel with
    bfloat16 widened to float32 as it is packed even on CPUs whose micro-kernel multiplies
    bfloat16 (`pairs`).

    Raises:
        ValueError: the variable holds something else.
    """
    answer = _ANSWERS.get("engine")
    if answer is None:
        answer = (_settings.text("flash_band_engine") or "auto").lower()
        if answer not in ENGINES:
            raise ValueError(f"{ENGINE_ENV} must be one of {', '.join(ENGINES)}, got {answer!r}")
        _ANSWERS["engine"] = answer
    return str(answer)


@functools.cache
def _cpu_supports(dtype: torch.dtype) -> bool:
    """The operator's answer (a Python bool, no tensor), asked once per dtype."""
    answer: bool = torch.ops.attnlab_band.supported(dtype)
    return answer


@functools.cache
def _cpu_native(dtype: torch.dtype) -> bool:
    answer: bool = torch.ops.attnlab_band.native(dtype)
    return answer


def pairs(dtype: torch.dtype) -> bool:
    """Whether this kernel's forward multiplies ``dtype`` in bfloat16 VNNI pairs (AVX512-BF16 or
    AMX; an even head dim, block and segment length), rather than in float32 with the inputs
    widened as they are packed (float16 always; bfloat16 on other CPUs, e.g. AVX2-only ones, or
    with ``ATTNLAB_FLASH_BAND_ENGINE=widen``)."""
    if dtype != torch.bfloat16 or engine_setting() == "widen":
        return False
    return _loaded() and _cpu_native(dtype)


def engine_name(dtype: torch.dtype) -> str:
    """This kernel in words, for `attnlab.explain`: its vector path on this CPU and how it
    multiplies ``dtype`` (e.g. ``"attnlab's C++ band kernel (AVX-512, float32 products)"``)."""
    if dtype == torch.bfloat16 and pairs(dtype):
        products = "bfloat16 products in VNNI pairs"
    elif dtype in (torch.bfloat16, torch.float16):
        products = f"{str(dtype).removeprefix('torch.')} widened to float32 as it is packed"
    else:
        products = "float32 products"
    return f"attnlab's C++ band kernel ({_ext.isa_path()}, {products})"


def ready(q: Tensor, bq: int | None = None) -> bool:
    """Whether band calls on ``q`` (query block ``bq``) run on attnlab's C++ kernel (asked once
    per process for each dtype, device, head dim and block)."""
    return _answer(q.dtype, q.device, q.shape[-1], bq)


def _answer(dtype: torch.dtype, device: torch.device, D: int, bq: int | None) -> bool:
    """`_ready`, asked once per process for each key; False while `torch.compile` traces."""
    if torch.compiler.is_compiling():
        return False
    key = (dtype, device, D, bq)
    answer = _ANSWERS.get(key)
    if answer is None:
        answer = _ANSWERS[key] = _ready(*key)
    return bool(answer)


def _ready(dtype: torch.dtype, device: torch.device, D: int, bq: int | None) -> bool:
    if engine_setting() == "aten" or device.type != "cpu" or dtype not in BLOCKS:
        return False
    if not (_loaded() and _cpu_supports(dtype)):
        return False
    return not (pairs(dtype) and (D % 2 or (bq is not None and bq % 2)))


def block(q: Tensor) -> int:
    """This kernel's forward query block of band calls on ``q``'s dtype (`BLOCKS`; bfloat16
    widened to float32 takes float32's)."""
    if q.dtype == torch.bfloat16 and not pairs(q.dtype):
        return BLOCK
    return BLOCKS.get(q.dtype, BLOCK)


def usable(q: Tensor, k: Tensor, v: Tensor, bq: int) -> bool:
    """`ready` for these tensors: also unit stride in the last dim of q, k and v."""
    return all(x.stride(-1) == 1 or x.shape[-1] == 1 for x in (q, k, v)) and ready(q, bq)


def _band_calls(plan: Plan) -> list[BandCall] | None:
    """The plan's calls when it has some and every one is a batched band call, else None."""
    calls = [c for g in plan.groups for c in g.calls]
    bands = [c for c in calls if isinstance(c, BandCall)]
    return bands if bands and len(bands) == len(calls) else None


def runs_every_call(plan: Plan, q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether the plan has calls and every one is a batched band call this kernel runs."""
    calls = _band_calls(plan)
    return calls is not None and all(usable(q, k, v, c.bq) for c in calls)


def backward_runs_every_call(
    plan: Plan, q: Tensor, k: Tensor, v: Tensor, out: Tensor, dout: Tensor
) -> bool:
    """Whether the plan has calls, every one a batched band call whose backward runs on this
    kernel with these tensors (`backward_usable`)."""
    return _band_calls(plan) is not None and backward_usable(q, k, v, out, dout)


def segments_ready(q: Tensor, n: int) -> bool:
    """Whether segments of ``n`` positions of queries like ``q`` run on attnlab's C++ kernel
    (unit-stride inputs given): `ready`, ``n <= SEGMENT_MAX`` and, in bfloat16 `pairs`, ``n``
    even."""
    if n > SEGMENT_MAX or not ready(q, SEGMENT_BLOCK):
        return False
    return not (n % 2 and pairs(q.dtype))


def segments_usable(q: Tensor, k: Tensor, v: Tensor, n: int) -> bool:
    """`segments_ready` for these tensors: also unit stride in the last dim of q, k and v."""
    return all(x.stride(-1) == 1 or x.shape[-1] == 1 for x in (q, k, v)) and segments_ready(q, n)


def segments_into(
    out: Tensor,
    lse: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    c: SegmentCall,
    scale: float,
    softcap: float | None = None,
    keys: Tensor | None = None,
    sinks: Tensor | None = None,
) -> None:
    """Writes the rows of segment call ``c`` into ``out`` and ``lse`` for one batch item.

    Args:
        out: ``(H, L, Dv)`` destination (rows outside the segments are not touched).
        lse: ``(H, L)`` float32 destination.
        q: ``(H, L, D)``; k: ``(H_kv, S, D)``; v: ``(H_kv, S, Dv)``: one batch item.
        c: ``c.count`` segments of ``c.n`` positions from ``c.start``; causal or full.
        scale: logit multiplier.
        softcap: None, or logit soft-capping ``softcap·tanh(s / softcap)`` (forward only).
        keys: None, or the item's key mask ``(S,)`` bool (unit stride) of a keyed call: rows
            attend only the keys it keeps (none left: out 0, lse −inf); the kernel computes
            only the columns from each segment's first kept key to its last.
        sinks: None, or attention sinks ``(H,)`` float32: each head's logit joins its rows'
            denominators (the module's note on attention sinks).

    ``out = softmax(q·kᵀ·scale) v`` per row over its segment's keys (causal: up to the row).
    """
    torch.ops.attnlab_band.segments_into(
        out,
        lse,
        q,
        k,
        v,
        c.start,
        c.n,
        c.count,
        c.causal,
        SEGMENT_BLOCK,
        float(scale),
        not pairs(q.dtype),
        0.0 if softcap is None else float(softcap),
        keys,
        sinks,
    )


def backward_ready(q: Tensor) -> bool:
    """Whether the backward of band calls on queries like ``q`` will run on attnlab's C++
    kernel (in float32: 16-bit inputs are widened for it): `ready` for float32 on q's device."""
    return _answer(torch.float32, q.device, q.shape[-1], None)


def backward_usable(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, dout: Tensor, *, out_like_q: bool = False
) -> bool:
    """Whether the backward of band calls on these tensors runs on attnlab's C++ kernel:
    `ready` for q, k, v and dout in q's dtype (16-bit ones are widened as they are packed), out
    float32 (or, with ``out_like_q``, in q's dtype: δ then reads the rounded output widened),
    every tensor with unit stride in the last dim."""
    xs = (q, k, v, out, dout)
    if any(x.stride(-1) != 1 and x.shape[-1] > 1 for x in xs):
        return False
    if out.dtype != torch.float32 and not (out_like_q and out.dtype == q.dtype):
        return False
    return all(x.dtype == q.dtype for x in (k, v, dout)) and ready(q)


def segments_backward_usable(
    res_q: Tensor, k: Tensor, v: Tensor, out: Tensor, dout: Tensor, n: int
) -> bool:
    """`backward_usable` for segments of ``n <= SEGMENT_MAX`` positions: float32, and 16-bit
    inputs (widened as they are packed) whose products this CPU's micro-kernel does not run
    natively (not `pairs`: float16 always, bfloat16 without AVX512-BF16/AMX or with
    ``ATTNLAB_FLASH_BAND_ENGINE=widen``). There torch's kernel would multiply them at its 16-bit
    GEMM rate, far below its float32 rate on CPUs without native 16-bit products (measured:
    docs/results); where they are native it runs them itself."""
    if pairs(res_q.dtype) or n > SEGMENT_MAX:
        return False
    return backward_usable(res_q, k, v, out, dout, out_like_q=True)


def backward_into(
    grads: tuple[Tensor, Tensor, Tensor],
    parts: tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor],
    add: Tensor,
    c: BandCall,
    scale: float,
    *,
    whole: bool = False,
    keys: Tensor | None = None,
    delta: Tensor | None = None,
) -> None:
    """Adds band call ``c``'s gradients for one batch item into ``grads = (dq, dk, dv)``.

    Args:
        grads: float32 ``(H, L, D)``, ``(H_kv, S, D)``, ``(H_kv, S, Dv)`` accumulators.
        parts: ``(q, k, v, out, dout, lse)``: the call's inputs as for `forward_into`, the
            whole forward output (float32) and its gradient (q's dtype) ``(H, L, Dv)``, and the
            whole forward's log-sum-exp ``(H, L)``, +inf on rows without a key.
        add: additive tile, as for `forward_into`.
        c: the call. scale: logit multiplier.
        whole: the call holds every key of its rows (no other call of the plan adds to them):
            δ is then ``Σ_j P_ij·dP_ij`` of each row, as softmax's own backward forms it, so dS
            sums to zero with the very P and dP it multiplies (a row with one key gets dS = 0).
        keys: None, or the item's key mask, as for `forward_into`.
        delta: None, or ``(H, L)`` float32: the call's rows get their δ (0 without a key).

    Per block, with ``P = exp(q·kᵀ·scale + add − lse)`` and ``δ = rowsum(dout ⊙ out)`` (or the
    row's own ``Σ P·dP``): ``dS = P ⊙ (dout·vᵀ − δ)``, ``dq += dS·k·scale``,
    ``dk += dSᵀ·q·scale``, ``dv += Pᵀ·dout``.
    """
    add4 = add.reshape((1,) * (4 - add.dim()) + tuple(add.shape)).float()
    if add4.stride(-1) != 1:
        add4 = add4.contiguous()
    limit = c.key_limit if c.key_limit > 0 else parts[1].shape[1]
    torch.ops.attnlab_band.backward_into(
        *grads,
        *parts,
        add4,
        c.r0,
        c.t1 - c.t0,
        c.bq,
        c.k_start,
        c.width,
        limit,
        float(scale),
        bool(whole),
        keys=keys,
        delta=delta,
    )


def segments_backward_into(
    grads: tuple[Tensor, Tensor, Tensor],
    parts: tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor],
    c: SegmentCall,
    scale: float,
    keys: Tensor | None = None,
    delta: Tensor | None = None,
) -> None:
    """Adds segment call ``c``'s gradients for one batch item into ``grads = (dq, dk, dv)``
    (``grads``, ``parts`` as for `backward_into`; its formulas over each row's keys in its
    segment, causal or full, that ``keys`` keeps, as `segments_into`). Each (segment, key
    head) is one work item that owns its keys' dk/dv rows: nothing is shared between threads.
    ``delta``: as for `backward_into`."""
    torch.ops.attnlab_band.segments_backward_into(
        *grads, *parts, c.start, c.n, c.count, c.causal, SEGMENT_BLOCK, float(scale), keys, delta
    )


@contextlib.contextmanager
def checking_inputs() -> Iterator[list[bool]]:
    """Within it, each `forward_into` call also tests every q, k and v entry it reads (the query
    rows of its blocks, the keys and values of its windows) for NaN/±inf, while packing them,
    and appends to the yielded list whether it found one (that call's out and lse are then not
    meaningful). The answer comes from the operator's result shape: no tensor value is read.
    """
    found: list[bool] = []
    token = _CHECKS.set(found)
    try:
        yield found
    finally:
        _CHECKS.reset(token)


def forward_into(
    out: Tensor,
    lse: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    add: Tensor,
    c: BandCall,
    scale: float,
    softcap: float | None = None,
    keys: Tensor | None = None,
    sinks: Tensor | None = None,
) -> None:
    """Writes band call ``c``'s output and log-sum-exp for one batch item (no allocation).

    Args:
        out: ``(nblk, H, bq, Dv)`` destination (a view of the whole output is fine).
        lse: ``(nblk, H, bq)`` float32 destination.
        q: ``(H, L, D)``; k: ``(H_kv, S, D)``; v: ``(H_kv, S, Dv)``: one batch item.
        add: additive tile ``(bq, W)`` or ``(1|nblk, H|1, bq, W)`` (mask as −inf, plus bias).
        c: the call, all its blocks: windows reaching outside ``[0, c.key_limit)`` (or the
            keys) are clipped to it.
        scale: logit multiplier.
        softcap: None, or logit soft-capping ``softcap·tanh(s / softcap)`` of the scaled logits
            before ``add`` (forward only: the backward operator has no tanh stage).
        keys: None, or the item's key mask ``(S,)`` bool (unit stride) of a keyed call
            (`BandCall.keyed`): windows keep only its kept keys; blocks whose window holds
            none of the run from its first kept key to its last skip both products.
        sinks: None, or attention sinks ``(H,)`` float32: each head's logit joins its rows'
            denominators (the module's note on attention sinks).

    ``out = softmax(q·kᵀ·scale + add) v`` per block over the keys of its window; a row with
    no key gets 0 and lse = −inf.
    """
    add4 = add.reshape((1,) * (4 - add.dim()) + tuple(add.shape)).float()
    if add4.stride(-1) != 1:
        add4 = add4.contiguous()
    nblk = c.t1 - c.t0
    limit = c.key_limit if c.key_limit > 0 else k.shape[1]
    checks = _CHECKS.get()
    seen = torch.ops.attnlab_band.forward_into(
        out,
        lse,
        q,
        k,
        v,
        add4,
        c.r0,
        nblk,
        c.bq,
        c.k_start,
        c.width,
        limit,
        float(scale),
        checks is not None,
        not pairs(q.dtype),
        0.0 if softcap is None else float(softcap),
        keys,
        sinks,
    )
    if checks is not None:
        checks.append(seen.numel() > 0)


__all__ = [
    "BLOCK",
    "BLOCKS",
    "ENGINES",
    "ENGINE_ENV",
    "SEGMENT_BLOCK",
    "SEGMENT_MAX",
    "backward_into",
    "backward_ready",
    "backward_runs_every_call",
    "backward_usable",
    "block",
    "checking_inputs",
    "engine_setting",
    "forward_into",
    "pairs",
    "ready",
    "runs_every_call",
    "segments_backward_into",
    "segments_backward_usable",
    "segments_into",
    "segments_ready",
    "segments_usable",
    "usable",
]
