"""Registers the built-in backends. Importing this module fills the registry.

``backend="auto"`` tries them in the order of `AUTO_PREFERENCE` and takes the first that supports
the call and does not decline it (`registry.select`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from . import reference
from . import thresholds as _thresholds
from .decode import decode_declines, decode_run, decode_run_lse, decode_supports
from .flash import flash_run, flash_run_lse, flash_supports
from .flash.band_kernel import segments_ready
from .flash.tiling import band_of
from .reference_backend import reference_run
from .registry import Backend, register_backend, set_auto_order
from .request import Request, request_dense
from .sdpa import sdpa_run, sdpa_supports

# ------------------------------------------------------------------ auto's policy
# Sizes at which auto prefers flash (see `flash_declines`), from benchmarks/bench_crossover.py
# (B=1, H=8, D=64; docs/results): a sliding window is as fast on flash at L = 256
# and 1.7× faster at 384; causal document masks and ALiBi cross over near L = 512. These are the
# built-in defaults of every dtype; a machine can measure its own per dtype
# (`functional.thresholds`, `python -m attnlab.functional.calibrate`), which auto then uses.
AUTO_BAND_MIN = _thresholds.BUILTIN.band  # L·S from which sliding windows (no bias) go to flash
AUTO_SPARSE_MIN = _thresholds.BUILTIN.sparse  # ... other structured masks and bias functions
AUTO_LONG_MIN = _thresholds.BUILTIN.long  # L·S from which every call goes to flash


def one_segment(req: Request) -> bool:
    """A causal or unmasked call with L = S and no bias that flash runs as one segment on
    attnlab's C++ kernel (`flash.band_kernel.segments_ready`). Measured (B=1, H=8, D=64, AMD
    EPYC, 2 threads, best of 15; docs/results), flash against sdpa, forward: causal
    fp32 1.25× at L = 256 and 2.06× at 512, bf16 1.76× / 2.84×; unmasked fp32 0.92× / 1.19×,
    bf16 1.33× / 1.73×; forward + backward 1.05–1.33× at 256–1024. So auto sends such calls to
    flash from the ``sparse`` threshold on (L·S = 2^18 by default, L = 512)."""
    plain = req.mask is None or req.is_plain_causal
    no_bias = req.bias is None and req.softcap is None
    return plain and no_bias and req.dims.L == req.dims.S and segments_ready(req.q, req.dims.L)


def flash_declines(req: Request) -> str | None:
    """Auto's preference: None if flash should run this call, else why sdpa is the better pick.

    The thresholds are those of the query's dtype (`thresholds.for_dtype`: the built-in
    defaults, or this machine's cached measurement).
    """
    d = req.dims
    n = d.L * d.S
    limits = _thresholds.for_dtype(req.q.dtype)
    terms = req.terms
    structured = terms.given_mask is not None
    if structured and req.is_plain_causal and req.bias is None:
        structured = False  # sdpa runs plain causal with the same kernel call
    fn_bias = terms.bias_fn is not None
    if n >= limits.long:
        return None
    segment = one_segment(req)
    if segment and n >= limits.sparse:
        return None  # attnlab's one-pass segment kernel beats sdpa's call from L = 256-512
    band = band_of(terms.given_mask) if structured and req.bias is None else None
    narrow = band is not None and math.isfinite(band[0]) and math.isfinite(band[1])
    threshold = limits.band if narrow else limits.sparse
    if (structured or fn_bias) and n >= threshold:
        return None
    # (a compiled graph must not print a symbolic size: that would specialise it)
    size = "L·S" if torch.compiler.is_compiling() else f"L·S = {n}"
    if structured or fn_bias:
        return f"{size} < {threshold}: at this size sdpa with the rendered mask/bias beats tiling"
    if segment:
        return f"one causal or unmasked segment and {size} < {limits.sparse}: sdpa is as fast"
    return f"dense mask/bias and {size} < {limits.long}: sdpa's single fused call is as fast"


def _reference_run_lse(req: Request) -> tuple[Tensor, Tensor, Tensor]:
    """The reference output and weights plus `reference.logsumexp` of the same logits."""
    out, weights = reference_run(req)
    mask, bias = request_dense(req)
    lse = reference.logsumexp(
        req.q,
        req.k,
        mask=mask,
        bias=bias,
        scale=req.logit_scale,
        temperature=1.0,
        score=req.score,
        softcap=req.softcap,
    )
    return out, weights, lse


def _flash_traced() -> Backend:
    """Flash under ``torch.compile`` and on ``meta`` tensors: its custom operators (importing
    them registers them, on first use)."""
    from .flash.ops import TRACED

    return TRACED


def _flash_run_lse(req: Request) -> tuple[Tensor, None, Tensor]:
    out, lse = flash_run_lse(req)
    return out, None, lse


register_backend(
    Backend(
        "decode",
        decode_run,
        decode_supports,
        "few query rows against many keys, no gradient (decoding): two matrix products over "
        "key prefixes, logits in float32+",
        run_lse=decode_run_lse,
        declines=decode_declines,
        softcap=True,
    )
)
register_backend(
    Backend(
        "reference",
        reference_run,
        lambda _req: None,
        "the explicit definition in functional/reference.py (float64-capable, returns weights)",
        run_lse=_reference_run_lse,
        last_resort=True,
        softcap=True,
    ),
)
register_backend(
    Backend(
        "sdpa",
        sdpa_run,
        sdpa_supports,
        "torch.nn.functional.scaled_dot_product_attention (fused; CPU flash kernel)",
        tiled=True,
    ),
)
register_backend(
    Backend(
        "flash",
        flash_run,
        flash_supports,
        "tiled exact attention: block-sparse tiles on torch's CPU flash kernel, recomputing "
        "backward, O(L) memory",
        tiled=True,
        run_lse=_flash_run_lse,
        traced=_flash_traced,
        declines=flash_declines,
        softcap=True,
    ),
)

AUTO_PREFERENCE = ("decode", "flash", "sdpa", "reference")
"""Auto's order, fastest first for the calls each one accepts: decode steps, then the tiled kernel
(which declines shapes where sdpa's single call is as fast), then torch's SDPA, then the
definition."""
set_auto_order(AUTO_PREFERENCE)
