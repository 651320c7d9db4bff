"""torch's fused ``scaled_dot_product_attention`` kernel as an attnlab backend.

Defined to equal `reference.attention` (see that function for the meaning of every argument and
for the NaN rule).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from . import nan_rule
from .reference import keep_mask
from .request import Request, request_dense, request_interval
from .scores import get_score


def sdpa_supports(req: Request) -> str | None:
    """SDPA computes everything but the weights."""
    if req.return_weights:
        return "torch's fused kernel does not return the attention weights (return_weights=True)"
    return None


def _needs_grad(*xs: Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in xs)


def _kernel(req: Request, q: Tensor, k: Tensor, v: Tensor, attn_mask, is_causal: bool) -> Tensor:
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=attn_mask,
        dropout_p=req.dropout_p,
        is_causal=is_causal,
        scale=req.scale / req.temperature,
        enable_gqa=req.dims.H_kv != req.dims.H,
    )


def _unmasked(req: Request) -> Tensor:
    """No mask, no bias, no gradient (e.g. decoding): the kernel on the inputs as they are.

    Every row attends every key, so nothing can leak between rows; the kernel itself propagates
    a non-finite ``v_j[d]`` into column d. It hides two cases that the rule makes non-finite —
    a row whose logits are all NaN (non-finite ``q_i``, or every key non-finite) comes back as 0,
    and a key whose logit is −inf is dropped — so rows with a non-finite ``q_i`` or any non-finite
    key of their head group are set to NaN: an O(L·D + S·D) check, no copy of k or v.
    """
    d = req.dims
    out = _kernel(req, req.q, req.k, req.v, None, False)
    # float64 sums cannot overflow for finite float32/16 inputs: NaN/inf iff one is present
    k_bad = ~torch.isfinite(req.k.sum(dim=(2, 3), dtype=torch.float64))  # (B, H_kv)
    k_bad = k_bad.repeat_interleave(d.H // d.H_kv, dim=1) if d.H_kv != d.H else k_bad
    row_bad = (nan_rule.row_flags(req.q) > 0) | k_bad.unsqueeze(-1)  # (B, H, L)
    nan = torch.tensor(float("nan"), dtype=out.dtype, device=out.device)
    zero = torch.zeros((), dtype=out.dtype, device=out.device).neg()
    return out + torch.where(row_bad.unsqueeze(-1), nan, zero)


def sdpa_run(req: Request) -> tuple[Tensor, Tensor | None]:
    """Runs torch SDPA: bottom-right masks become dense masks, except plain causal with L == S.

    The NaN rule (`functional.nan_rule`): the kernel runs on inputs whose non-finite entries are
    0 — torch's kernel would zero a row whose logits are all NaN and spread ``0 · NaN`` from
    masked pairs — and NaN is added back exactly where the rule puts it. Calls without mask,
    bias or gradient (decoding) skip the copies (`_unmasked`). No host synchronisation.
    """
    s = get_score(req.score)
    # torch's is_causal path masks after scaling with -inf, so a negative scale turns the masked
    # logits into +inf (NaN output): use the dense mask then.
    is_causal = req.is_plain_causal and req.bias is None and req.scale > 0
    plain = req.mask is None and req.bias is None and req.score == "dot"
    if plain and not _needs_grad(req.q, req.k, req.v):
        return _unmasked(req), None
    allowed, additive = (None, None) if is_causal else request_dense(req)
    q, k, v = nan_rule.clean(req.q), nan_rule.clean(req.k), nan_rule.clean(req.v)
    if req.score != "dot":
        q, k = s.prepare(q), s.prepare(k)
    attn_mask = allowed
    if additive is not None:
        clean_add = nan_rule.clean_bias(additive)
        attn_mask = clean_add if allowed is None else clean_add.masked_fill(~allowed, float("-inf"))
    out = _kernel(req, q, k, v, attn_mask, is_causal)
    interval = request_interval(req)
    keep = None if interval is not None else keep_mask(allowed, additive)
    out, _ = nan_rule.poison(out, req.q, req.k, req.v, keep=keep, interval=interval, bias=additive)
    return out, None
