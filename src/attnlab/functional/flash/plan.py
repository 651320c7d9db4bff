"""The job for a validated request: tile sizes, engine, tiling plan and tile source.

Nothing here touches the values of q, k, v: `flash_job` reads shapes, dtypes and the mask
(its structure, and the values of the tensors it holds where the plan needs them: document ids,
lengths, a boolean mask). A cached plan is keyed on those values' digest (`cached_plan`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from ... import _settings
from ..._shapes import check_int, stat_dtype
from ...masks import Mask
from ..request import Request, is_relative_bias, logit_qk
from . import band_kernel
from .calls import BandCall, Plan, SegmentCall
from .engines import (
    LOW_PRECISION,
    LOW_PRECISION_ENV,
    LOW_PRECISION_SETTINGS,
    TileSource,
    TorchEngine,
    low_precision,
)
from .job import FlashJob
from .tiling import build_plan, key_mask_plan

# Default tile sizes (rows × keys) of the block map, and the query block of batched band calls.
BLOCK_Q = 128
BLOCK_K = 128
BAND_BLOCK = 64
# Forward query block of batched band calls when none is given: the forward kernel wastes fewer
# pairs on 32-row blocks (288 keys per block for a 256-window instead of 320), while the backward
# kernel is faster on 64-row blocks (measured at window 256, L=16384, docs/results).
BAND_BLOCK_FWD = 32
# Measured again for bfloat16 (issue 19, AMD EPYC without AMX, window 256, L=16384, one thread,
# best CPU time of 3): 16/32/64/128-row blocks take 0.186/0.166/0.184/0.216 s in bfloat16 and
# 0.179/0.168/0.183/0.215 s in float32, so 32 stays for both. CPUs whose low-precision matmul
# is much faster (AMX) may prefer larger blocks: ATTNLAB_FLASH_BAND_BLOCK overrides the default
# (measure with `attnlab bench --case window`). attnlab's C++ band kernel (`band_kernel`), when it
# runs the calls, prefers its own block per dtype (`band_kernel.BLOCKS`).
BAND_BLOCK_ENV = _settings.FLASH_BAND_BLOCK


def band_block_fwd(q: Tensor | None = None, setting: int | None = None) -> int:
    """The forward query block of batched band calls: ``setting``, else
    ``$ATTNLAB_FLASH_BAND_BLOCK`` (`FlashOptions.band_block_fwd`), else the C++ band kernel's
    block when it runs calls on ``q`` (`band_kernel.ready`), else 32.

    Raises:
        ValueError: the variable is set to something other than a positive int.
    """
    if setting is None:
        setting = flash_options().band_block_fwd
    if setting is not None:
        return setting
    return BAND_BLOCK_FWD if q is None else _kernel_facts(q)[0]


_KERNEL: dict[tuple, tuple[int, bool, bool]] = {}
"""Per (dtype, device, head dim): `_kernel_facts`, asked once per process
(`attnlab._settings.forget`)."""
_settings.on_refresh(_KERNEL.clear)


def _kernel_facts(q: Tensor) -> tuple[int, bool, bool]:
    """``(forward query block of band calls, C++ kernel may run, C++ band backward ready)`` for
    queries like ``q``: the C++ band kernel's block when it runs band calls on ``q``
    (`band_kernel.ready`), else `BAND_BLOCK_FWD`; whether it runs any call on them (forward or
    backward); `band_kernel.backward_ready`."""
    key = (q.dtype, q.device, q.shape[-1])
    facts = _KERNEL.get(key)
    if facts is None:
        block, forward = band_kernel.block(q), band_kernel.ready(q)
        # its backward runs in float32 (16-bit inputs widened): asked for the dtypes it takes
        backward = q.dtype in band_kernel.BLOCKS and band_kernel.backward_ready(q)
        facts = (
            block if band_kernel.ready(q, block) else BAND_BLOCK_FWD,
            forward or backward,
            backward,
        )
        if not torch.compiler.is_compiling():
            _KERNEL[key] = facts
    return facts


def _band_block_setting(raw: str | None) -> int | None:
    """``$ATTNLAB_FLASH_BAND_BLOCK``'s text as an int (None when unset).

    Raises:
        ValueError: the text is not a positive int.
    """
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{BAND_BLOCK_ENV} must be a positive int, got {raw!r}")
    return int(raw)


@dataclass(frozen=True)
class FlashOptions:
    """The tiled backend's knobs in one record: what the caller gave (`flash_attention`) and
    the settings (`attnlab._settings`, read once per process: `flash_options`), held by its
    job.

    Attributes:
        block_q, block_k: tile size of the block map, or None for `flash_job`'s default.
        band_block: query block of batched band calls, or None for the default.
        engine: the tile engine, ``"kernel"`` or ``"torch"``, or None for the default.
        band_block_fwd: ``$ATTNLAB_FLASH_BAND_BLOCK`` (forward query block of band calls), or
            None (the C++ band kernel's block, else `BAND_BLOCK_FWD`: `band_block_fwd`).
        low_precision: the low-precision policy (``$ATTNLAB_FLASH_LOWP``, else
            `engines.LOW_PRECISION`): ``"auto"``, ``"native"`` or ``"widen"``.
        plan_cache: plans go through the cache (`cached_plan`; ``$ATTNLAB_FLASH_PLAN_CACHE``
            off or `PLAN_CACHE_SIZE` 0 turns it off).
    """

    block_q: int | None = None
    block_k: int | None = None
    band_block: int | None = None
    engine: str | None = None
    band_block_fwd: int | None = None
    low_precision: str = LOW_PRECISION
    plan_cache: bool = True


_DEFAULTS: list[FlashOptions] = []
"""The settings as a `FlashOptions`, read once per process (`flash_options`)."""
_settings.on_refresh(_DEFAULTS.clear)


def flash_options(
    *,
    block_q: int | None = None,
    block_k: int | None = None,
    band_block: int | None = None,
    engine: str | None = None,
) -> FlashOptions:
    """The `FlashOptions` of a call: the knobs given plus the settings (read once per process,
    again after `attnlab._settings.refresh`).

    Raises:
        ValueError: a setting holds a value it does not take (`low_precision`,
            `band_block_fwd`).
    """
    if not _DEFAULTS:
        _DEFAULTS.append(
            FlashOptions(
                band_block_fwd=_band_block_setting(_settings.text("flash_band_block")),
                low_precision=low_precision(_settings.text("flash_lowp") or ""),
                plan_cache=not _settings.turned_off(_settings.text("flash_plan_cache")),
            )
        )
    defaults = _DEFAULTS[0]
    if block_q is block_k is band_block is engine is None:
        return defaults
    knobs = {"block_q": block_q, "block_k": block_k, "band_block": band_block, "engine": engine}
    return replace(defaults, **knobs)


# A mask made of blocks (BigBird) tiles by its own block size within this range: BigBird with
# blocks of 64 at L = 4096 (window 3, 2 global, 3 random; 2 threads, AMD EPYC, best of 3) ran fwd
# 0.161 -> 0.084 s and fwd+bwd 0.469 -> 0.314 s in fp32, 0.155 -> 0.050 / 0.437 -> 0.190 s in
# bf16 on 64-tiles instead of 128 (every tile full or empty: no mask inside a tile).
NATURAL_TILE = (32, 256)
# Tile size with a bias (measured: 256 beats 128 for ALiBi), and for float64 (see `flash_job`).
BLOCK_BIAS = 256
BLOCK_64 = 2048
# Key window of a relative bias over a wide band (causal, none): one shared tile per offset.
RELATIVE_WINDOW = 1024
# Plans cached per (shape, mask structure and contents): see `cached_plan`.
PLAN_CACHE_SIZE = 64
PLAN_CACHE_ENV = _settings.FLASH_PLAN_CACHE
_PLANS: OrderedDict[tuple, Plan] = OrderedDict()
_PLANS_LOCK = threading.Lock()


def cached_plan(mask: Mask | None, *, cache: bool | None = None, **kwargs: object) -> Plan:
    """`build_plan` through a bounded LRU cache keyed on shapes, mask structure and contents.

    The key is the mask's `Mask.cache_key` (its `Mask.spec` string, the shape, dtype, device
    and content digest of each tensor it holds), plus every argument of `build_plan`. The digest is
    read on every call (a plan reads the same values when it is built; a 4096 × 4096 boolean
    mask digests in about a third of its planning time), so an entry serves exactly the values
    it was built from and the cache never changes an answer. The least recently used entry goes
    once ``PLAN_CACHE_SIZE`` are held; `clear_plan_cache` empties it;
    ``ATTNLAB_FLASH_PLAN_CACHE=0`` turns it off. Masks without a spec (`from_fn`) are never
    cached. Plans hold only host data and index tensors that no one writes, so one plan may
    serve many calls. ``cache`` (`FlashOptions.plan_cache`) says whether the cache is on; None
    reads the setting.
    """
    if cache is None:
        cache = flash_options().plan_cache
    off = not cache
    key_m = None if off or PLAN_CACHE_SIZE <= 0 else ("",) if mask is None else mask.cache_key()
    if key_m is None:
        return build_plan(mask, **kwargs)  # type: ignore[arg-type]
    key = (key_m, tuple(sorted((k, str(v)) for k, v in kwargs.items())))
    with _PLANS_LOCK:
        hit = _PLANS.get(key)
        if hit is not None:
            _PLANS.move_to_end(key)
            return hit
    plan = build_plan(mask, **kwargs)  # type: ignore[arg-type]
    with _PLANS_LOCK:
        _PLANS[key] = plan
        _PLANS.move_to_end(key)
        while len(_PLANS) > PLAN_CACHE_SIZE:
            _PLANS.popitem(last=False)
    return plan


def clear_plan_cache() -> None:
    """Empties the plan cache (`cached_plan`)."""
    with _PLANS_LOCK:
        _PLANS.clear()


def natural_tile(mask: Mask | None) -> int | None:
    """The mask's own block size (`Mask.natural_block`) as the tile size, when it lies within
    ``NATURAL_TILE`` (inclusive): every tile is then fully attended or empty. None otherwise."""
    block = None if mask is None else mask.natural_block()
    lo, hi = NATURAL_TILE
    return block if block is not None and lo <= block <= hi else None


def flash_job(
    req: Request,
    *,
    options: FlashOptions | None = None,
    forward_only: bool | None = None,
    **knobs: int | str | None,
) -> FlashJob:
    """The plan and tile source for a validated request (no computation on q, k, v).

    Args:
        req: the validated request.
        options: the knobs and the settings as one record (`flash_options`).
        forward_only: no gradient will be asked of this job (a soft-capped request may then run
            on attnlab's C++ kernels, `softcap_on_kernel`); None reads it from ``req``'s inputs
            (inside an autograd Function they never require grad: the caller says).
        knobs: without ``options``, `flash_options`'s keyword arguments:
            ``block_q``, ``block_k``: tile size of the block map (default 128 × 128; a mask
            made of blocks, `Mask.natural_block` within `NATURAL_TILE`, its own block;
            256 × 256 with a bias, 1024 keys for a relative bias alone, 2048 × 2048 in
            float64); ``band_block``: query block of batched band calls (default 32 forward,
            64 backward; 64 both ways on the torch engine); ``engine``: ``"kernel"`` or
            ``"torch"`` (default: kernel on CPU below float64, and torch whenever the request
            soft-caps its logits: the kernel cannot apply tanh).

    Raises:
        ValueError: a block size that is not a positive int, an unknown engine, or
            ``engine="kernel"`` with ``req.softcap``.
    """
    d, terms = req.dims, req.terms
    opts = options or flash_options(**knobs)  # type: ignore[arg-type]
    if forward_only is None:
        forward_only = _forward_only(req)
    bq, bk, bb, bb_fwd, engine = _tile_sizes(req, opts, forward_only)
    bias_kind = "tensor" if terms.additive else ("fn" if terms.bias_fn is not None else None)
    relative = bias_kind == "fn" and is_relative_bias(terms.bias_fn)

    def plan_for(band_block: int) -> Plan:
        return cached_plan(
            terms.structured,
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
            cache=opts.plan_cache,
        )

    keyed = _key_mask_plan(req, bias_kind, bb_fwd) if engine == "kernel" else None
    plan, keys, rows = keyed if keyed is not None else (plan_for(bb_fwd), None, None)
    if req.softcap is not None and engine == "kernel" and not softcap_on_kernel(plan, req):
        bq, bk, bb, bb_fwd, engine = _tile_sizes(req, replace(opts, engine="torch"), False)
        plan, keys, rows = plan_for(bb_fwd), None, None
    # torch's backward kernel is faster on 64-row band blocks; attnlab's C++ band backward runs
    # the forward's blocks (window 256, L = 16384, fp32, Xeon with AMX: 16/32/64-row blocks
    # 0.095/0.097/0.099 s)
    _, kernel, backward = _kernel_facts(req.q)
    own = engine == "kernel" and backward
    bwd_plan = plan_for(bb) if bb != bb_fwd and plan.kind == "band" and not own else None
    return FlashJob(
        plan,
        _tile_source(req, relative),
        abs(req.logit_scale),  # the sign is folded into q (`prepare_inputs`)
        engine,
        TorchEngine(max(bq, 128), max(bk, 512)),
        bwd_plan=bwd_plan,
        softcap=req.softcap,
        policy=opts.low_precision,
        own_kernel=kernel,
        keys=keys,
        rows=rows,
    )


def _key_mask_plan(
    req: Request, bias: str | None, band_block: int
) -> tuple[Plan, Tensor, Tensor | None] | None:
    """`tiling.key_mask_plan` for a request whose calls attnlab's C++ kernels run
    (`band_kernel.segments_ready`, `band_kernel.ready`); its key mask unit-stride (the
    kernels read each item's row)."""
    d, mask, q = req.dims, req.terms.structured, req.q
    if mask is None or not any(m.over_keys or m.over_queries for m in mask.conjuncts()):
        return None  # (the warm path of other masks asks nothing more)
    kw = {"B": d.B, "H": d.H, "L": d.L, "S": d.S, "band_block": band_block, "bias": bias}
    found = key_mask_plan(mask, device=q.device, **kw)
    if found is None:
        return None
    plan, keys, rows = found
    for c in (c for g in plan.groups for c in g.calls):
        if isinstance(c, SegmentCall) and not band_kernel.segments_ready(q, c.n):
            return None
        if isinstance(c, BandCall) and not band_kernel.ready(q, c.bq):
            return None
    return plan, keys.contiguous(), rows


def _tile_source(req: Request, relative: bool) -> TileSource:
    """The additive tiles of a request's calls (mask, bias), in the accumulation dtype."""
    d, terms = req.dims, req.terms
    return TileSource(
        terms.structured,
        terms.bias_fn,
        terms.additive,
        B=d.B,
        H=d.H,
        L=d.L,
        S=d.S,
        dtype=stat_dtype(req.q.dtype),
        device=req.q.device,
        relative=relative,
    )


def _tile_sizes(
    req: Request, opts: FlashOptions, forward_only: bool
) -> tuple[int, int, int, int, str]:
    """``(block_q, block_k, band_block, forward band_block, engine)`` of a request
    (`flash_job`'s defaults for what is not given), checked (`_engine`).

    float64 takes wide tiles (`BLOCK_64`); a bias larger tiles (every tile carries an
    additive tile: fewer, fuller calls), a relative bias alone `RELATIVE_WINDOW` keys; a mask
    made of blocks its own block (`natural_tile`).
    """
    terms = req.terms
    fn, tensors = terms.bias_fn, terms.additive
    block_q, block_k, band_block = opts.block_q, opts.block_k, opts.band_block
    wide = req.q.dtype == torch.float64
    biased = fn is not None or bool(tensors)
    bq = (BLOCK_64 if wide else BLOCK_BIAS if biased else BLOCK_Q) if block_q is None else block_q
    natural = natural_tile(terms.structured) if not (wide or biased) else None
    if natural is not None and block_q is None:
        bq = natural
    if block_k is not None:
        bk = block_k
    elif natural is not None:
        bk = natural
    elif wide:
        bk = BLOCK_64
    elif fn is not None and is_relative_bias(fn) and not tensors:
        bk = RELATIVE_WINDOW
    else:
        bk = BLOCK_BIAS if biased else BLOCK_K
    bb = (BLOCK_64 if wide else BAND_BLOCK) if band_block is None else band_block
    bb_fwd = band_block_fwd(req.q, opts.band_block_fwd) if band_block is None and not wide else bb
    bq, bk, bb = (
        check_int("block_q", bq, minimum=1),
        check_int("block_k", bk, minimum=1),
        check_int("band_block", bb, minimum=1),
    )
    engine = _engine(req, opts.engine, forward_only)
    if engine == "torch" and band_block is None:
        # the 32-row forward block suits the kernel; the torch engine (soft-capped calls) pays
        # per call: its forward is faster on 64-row blocks (window 512, L = 4096, H = 8, fp32,
        # one thread, best CPU time of 7: 305 ms at 32 rows, 255 at 64, 251 at 128)
        bb_fwd = bb
    return bq, bk, bb, bb_fwd, engine


def _forward_only(req: Request) -> bool:
    """No input of the request needs a gradient."""
    return not (torch.is_grad_enabled() and any(x.requires_grad for x in (req.q, req.k, req.v)))


def softcap_on_kernel(plan: Plan, req: Request) -> bool:
    """Whether a soft-capped request without gradient runs on the kernel engine: attnlab's C++
    kernels soft-cap the logits in their forward (torch's fused kernel and the C++ backward
    cannot), so every call torch's kernel would take must be theirs — one whole segment
    (`Plan.whole`, a causal or full call with L = S) the segment kernel takes, or band and
    segment calls they take (`band_kernel.usable`, `segments_usable`); the plan's other
    tile calls (edges) then run on the pure-PyTorch engine (`FlashJob._simple_forward`)."""
    q, k, v = req.q, req.k, req.v
    if not plan.biased and plan.single_call:
        return plan.whole is not None and band_kernel.segments_usable(q, k, v, req.dims.L)
    for g in plan.groups:
        for c in g.calls:
            if isinstance(c, BandCall) and not band_kernel.usable(q, k, v, c.bq):
                return False
            if isinstance(c, SegmentCall) and not band_kernel.segments_usable(q, k, v, c.n):
                return False
    return True


def _engine(req: Request, engine: str | None, forward_only: bool) -> str:
    """The tile engine of a request: ``engine`` checked, or the default.

    float64 is the verification dtype: its tolerance rule compares against the reference's
    own summation order (float64 rounding), which a tiled sum over 128-row blocks misses by a
    few ulp. So float64 runs the pure-PyTorch engine on wide tiles (`BLOCK_64`), i.e. one tile
    up to 2048 × 2048 — still bounded memory for any length. Soft-capping applies tanh to
    every tile's logits, which torch's fused kernel cannot: such requests run the pure-PyTorch
    engine (the same tiles, plan and merging) — except without gradient, where attnlab's C++
    kernels soft-cap in their forward: the kernel engine then, if they run every call of the
    plan (`softcap_on_kernel`, decided by `flash_job`).
    """
    if engine is None:
        on_cpu = req.q.device.type == "cpu"
        capped = req.softcap is not None
        kernel = on_cpu and req.q.dtype != torch.float64 and (not capped or forward_only)
        engine = "kernel" if kernel else "torch"
        if capped and kernel:
            return engine  # (`flash_job` falls back to "torch" unless every call is attnlab's)
    if engine not in ("kernel", "torch"):
        raise ValueError(f"engine must be 'kernel' or 'torch', got {engine!r}")
    if engine == "kernel" and req.softcap is not None:
        raise ValueError(
            f"engine='kernel' cannot soft-cap logits (softcap={req.softcap}): torch's CPU flash "
            f"kernel has no tanh stage; use engine='torch' (the default with softcap)"
        )
    return engine


def prepare_inputs(req: Request, engine: str) -> tuple[Tensor, Tensor, Tensor, int]:
    """``(q, k, v, Dv)`` as the engine reads them: scored (cosine), the sign of the logit scale
    in q (`request.logit_qk`), unit-stride, padded.

    The kernel needs D = Dv: zero columns change no dot product and add zero output columns, so
    padding both to ``max(D, Dv)`` is exact (the caller slices the output back to ``Dv``).
    """
    q, k, _ = logit_qk(req)
    v = req.v
    q, k, v = (x if x.is_contiguous() else x.contiguous() for x in (q, k, v))
    Dv = v.shape[-1]
    D = q.shape[-1]
    if engine == "kernel" and Dv != D:
        width = max(D, Dv)
        if width > D:
            q = torch.nn.functional.pad(q, (0, width - D))
            k = torch.nn.functional.pad(k, (0, width - D))
        if Dv < width:
            v = torch.nn.functional.pad(v, (0, width - Dv))
    return q, k, v, Dv


__all__ = [
    "BAND_BLOCK",
    "BAND_BLOCK_ENV",
    "BAND_BLOCK_FWD",
    "BLOCK_64",
    "BLOCK_BIAS",
    "BLOCK_K",
    "BLOCK_Q",
    "LOW_PRECISION",
    "LOW_PRECISION_ENV",
    "LOW_PRECISION_SETTINGS",
    "NATURAL_TILE",
    "PLAN_CACHE_SIZE",
    "RELATIVE_WINDOW",
    "FlashOptions",
    "band_block_fwd",
    "cached_plan",
    "clear_plan_cache",
    "flash_job",
    "flash_options",
    "low_precision",
    "natural_tile",
    "prepare_inputs",
]
