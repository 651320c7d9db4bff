"""Registers the built-in backends. Importing this module fills the registry."""

from __future__ import annotations

from torch import Tensor

from . import reference
from .flash import flash_run, flash_run_lse, flash_supports
from .reference_backend import reference_run
from .registry import Backend, register_backend
from .request import Request, request_dense
from .sdpa import sdpa_run, sdpa_supports


def _reference_run_lse(req: Request) -> tuple[Tensor, Tensor, Tensor]:
    """The reference output and weights plus `reference.logsumexp` of the same logits."""
    out, weights = reference_run(req)
    mask, bias = request_dense(req)
    lse = reference.logsumexp(
        req.q,
        req.k,
        mask=mask,
        bias=bias,
        scale=req.scale,
        temperature=req.temperature,
        score=req.score,
    )
    return out, weights, lse


def _flash_run_lse(req: Request) -> tuple[Tensor, None, Tensor]:
    out, lse = flash_run_lse(req)
    return out, None, lse


register_backend(
    Backend(
        "reference",
        reference_run,
        lambda req: None,
        "the explicit definition in functional/reference.py (float64-capable, returns weights)",
        run_lse=_reference_run_lse,
        last_resort=True,
    ),
    auto_rank=0,
)
register_backend(
    Backend(
        "sdpa",
        sdpa_run,
        sdpa_supports,
        "torch.nn.functional.scaled_dot_product_attention (fused; CPU flash kernel)",
        tiled=True,
    ),
    auto_rank=0,
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
        declines=lambda req: flash_declines(req),  # defined at the end of this module
    ),
    auto_rank=0,
)


# --------------------------------------------------------------------------- auto: flash or sdpa
# (issue 14: auto's size thresholds and flash's `declines` live here, with the dispatch policy)
import math  # noqa: E402

import torch  # noqa: E402

from ..masks import Mask, TensorMask  # noqa: E402
from .tiling import band_of  # noqa: E402

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
