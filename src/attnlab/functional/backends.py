"""Registers the built-in backends. Importing this module fills the registry."""

from __future__ import annotations

from torch import Tensor

from . import reference
from .flash import flash_declines, flash_run, flash_run_lse, flash_supports
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
        declines=flash_declines,
    ),
    auto_rank=0,
)
