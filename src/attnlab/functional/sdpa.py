"""torch's fused ``scaled_dot_product_attention`` kernel as an attnlab backend.

Defined to equal `reference.attention` (see that function for the meaning of every argument).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .reference import keep_mask, zero_dead_keys
from .reference_backend import reference_run
from .request import Request, request_dense
from .scores import get_score


def sdpa_supports(req: Request) -> str | None:
    """SDPA computes everything but the weights."""
    if req.return_weights:
        return "torch's fused kernel does not return the attention weights (return_weights=True)"
    return None


def _all_finite(*xs: Tensor) -> bool:
    # One reduction per tensor, no temporaries: NaN/inf anywhere makes the sum non-finite
    # (an overflowing sum only sends a finite input down the exact reference path).
    return all(bool(torch.isfinite(x.sum(dtype=torch.float32))) for x in xs)


def sdpa_run(req: Request) -> tuple[Tensor, Tensor | None]:
    """Runs torch SDPA: bottom-right masks become dense masks, except plain causal with L == S.

    torch's kernel returns zeros for a query row whose logits are NaN (it treats the row as fully
    masked); attnlab propagates NaN instead. So queries or (attended) keys holding NaN/inf are
    computed by the reference definition, and NaN/inf stored at fully masked key positions is
    replaced by zeros first (bit-equal to storing zeros there). Finite inputs — the common case —
    cost two or three reductions and no copies.
    """
    d = req.dims
    s = get_score(req.score)
    q, k, v = req.q, req.k, req.v
    if req.score != "dot":
        q, k = s.prepare(q), s.prepare(k)
    # torch's is_causal path masks after scaling with -inf, so a negative scale turns the masked
    # logits into +inf (NaN output): use the dense mask then.
    is_causal = req.is_plain_causal and req.bias is None and req.scale > 0
    allowed, additive = (None, None) if is_causal else request_dense(req)
    if not _all_finite(q):
        return reference_run(req)[0], None
    masked = allowed is not None or additive is not None
    # NaN in v propagates through the kernel's matmul as in the reference; v only matters where a
    # mask leaves key positions that nobody attends.
    if not _all_finite(k) or (masked and not _all_finite(v)):
        if masked:
            k, v = zero_dead_keys(k, v, keep_mask(allowed, additive))
        if not _all_finite(k):
            return reference_run(req)[0], None
    attn_mask = allowed
    if additive is not None:
        attn_mask = additive if allowed is None else additive.masked_fill(~allowed, float("-inf"))
    return (
        F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=attn_mask,
            dropout_p=req.dropout_p,
            is_causal=is_causal,
            scale=req.scale / req.temperature,
            enable_gqa=d.H_kv != d.H,
        ),
        None,
    )
