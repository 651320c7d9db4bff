"""Registers the built-in backends. Importing this module fills the registry."""

from __future__ import annotations

from torch import Tensor

from . import reference
from .registry import Backend, register_backend
from .request import Request, request_dense
from .sdpa import sdpa_run, sdpa_supports


def _reference_run(req: Request) -> tuple[Tensor, Tensor]:
    mask, bias = request_dense(req)
    return reference.attention(
        req.q,
        req.k,
        req.v,
        mask=mask,
        bias=bias,
        scale=req.scale,
        temperature=req.temperature,
        score=req.score,
        dropout_p=req.dropout_p,
    )


register_backend(
    Backend(
        "reference",
        _reference_run,
        lambda req: None,
        "the explicit definition in functional/reference.py (float64-capable, returns weights)",
    ),
    auto_rank=0,
)
register_backend(
    Backend("sdpa", sdpa_run, sdpa_supports, "torch.nn.functional.scaled_dot_product_attention"),
    auto_rank=0,
)
