"""Registers the built-in backends. Importing this module fills the registry.

``backend="auto"`` tries them in the order of `AUTO_PREFERENCE` and takes the first that supports
the call and does not decline it (`registry.select`).
"""

from __future__ import annotations

from torch import Tensor

from . import reference
from .decode import decode_declines, decode_run, decode_run_lse, decode_supports
from .flash import flash_declines, flash_run, flash_run_lse, flash_supports
from .reference_backend import reference_run
from .registry import Backend, register_backend, set_auto_order
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
        "decode",
        decode_run,
        decode_supports,
        "few query rows against many keys, no gradient (decoding): two matrix products over "
        "key prefixes, logits in float32+",
        run_lse=decode_run_lse,
        declines=decode_declines,
    )
)
register_backend(
    Backend(
        "reference",
        reference_run,
        lambda req: None,
        "the explicit definition in functional/reference.py (float64-capable, returns weights)",
        run_lse=_reference_run_lse,
        last_resort=True,
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
        declines=flash_declines,
    ),
)

AUTO_PREFERENCE = ("decode", "flash", "sdpa", "reference")
"""Auto's order, fastest first for the calls each one accepts: decode steps, then the tiled kernel
(which declines shapes where sdpa's single call is as fast), then torch's SDPA, then the
definition."""
set_auto_order(AUTO_PREFERENCE)
