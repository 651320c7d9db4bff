"""The reference definition run as a backend on a validated request."""

from __future__ import annotations

from torch import Tensor

from . import reference
from .request import Request, request_dense


def reference_run(req: Request) -> tuple[Tensor, Tensor]:
    """`reference.attention` on the request's dense mask and bias: ``(out, weights)``."""
    mask, bias = request_dense(req)
    return reference.attention(
        req.q,
        req.k,
        req.v,
        mask=mask,
        bias=bias,
        scale=req.logit_scale,
        temperature=1.0,
        score=req.score,
        dropout_p=req.dropout_p,
        softcap=req.softcap,
    )
