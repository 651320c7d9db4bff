"""Argument checks for the attention entry points: everything is validated before any work.

`build_request` turns the arguments of `attention` (and of the entry points that only need the
logits, `plain_request`) into a `Request`, raising ValueError/TypeError that name the argument,
the expected and the received value.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .._shapes import (
    Dims,
    check_logit_multiplier,
    check_mask_tensor,
    check_number,
    check_probability,
    check_qkv,
    check_same_device,
)
from ..masks import Mask
from .registry import check_backend_name
from .request import BiasFn, Request, check_bias_heads
from .scores import get_score


def _unit_stride_last(t: Tensor) -> Tensor:
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def check_softcap(softcap: object, dtype: torch.dtype) -> float | None:
    """``softcap``: None, or a finite real number > 0 that stays a normal number in the logits'
    compute dtype (float32 for float32/float16/bfloat16 inputs, float64 for float64).

    ``softcap · tanh(s / softcap)`` with a cap that rounds to 0 (or a subnormal) in the compute
    dtype would divide by zero, and one that rounds to inf would give ``inf · 0``: both are
    refused before any work.

    Raises:
        TypeError: a bool, or anything but an int/float (e.g. a tensor), naming ``softcap``.
        ValueError: NaN, ±inf, a value <= 0, or outside the compute dtype's normal range.
    """
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(
            f"softcap must be None or a float > 0 (logits become softcap·tanh(s/softcap)), got "
            f"{type(softcap).__name__} {softcap!r}"
        )
    cap = float(softcap)
    if torch.compiler.is_compiling():
        return cap  # may be symbolic (torch.compile(dynamic=True)): checked in eager calls only
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    info = torch.finfo(compute)
    if not math.isfinite(cap) or cap <= 0:
        raise ValueError(f"softcap must be a finite float > 0 (or None), got {softcap!r}")
    if not info.tiny <= cap <= info.max:
        raise ValueError(
            f"softcap must lie in [{info.tiny:.3g}, {info.max:.3g}] for {dtype} inputs (a normal "
            f"{compute} number: the logits are capped in {compute}), got {softcap!r}"
        )
    return cap


def build_request(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Mask | Tensor | None,
    bias: Tensor | BiasFn | None,
    scale: float | None,
    temperature: float,
    score: str,
    dropout_p: float,
    backend: str,
    return_weights: bool,
    softcap: float | None = None,
) -> Request:
    """Validates every argument (before any computation) and returns the 4-D request."""
    dims = check_qkv(q, k, v)
    s = get_score(score)
    check_backend_name(backend)
    temperature = check_number("temperature", temperature, positive=True)
    cap = check_softcap(softcap, q.dtype)
    dropout_p = check_probability("dropout_p", dropout_p)
    scale = s.default_scale(dims.D) if scale is None else check_number("scale", scale, nonzero=True)
    check_logit_multiplier(scale, temperature, q.dtype)
    if not isinstance(return_weights, bool):
        raise TypeError(f"return_weights must be a bool, got {type(return_weights).__name__}")
    if isinstance(mask, Tensor):
        check_mask_tensor("mask", mask, q.dtype, dims)
        check_same_device("mask", mask, q)
    elif mask is not None and not isinstance(mask, Mask):
        raise TypeError(
            f"mask must be an attnlab Mask, a bool tensor or an additive float tensor, got "
            f"{type(mask).__name__}"
        )
    if isinstance(bias, Tensor):
        if not bias.is_floating_point():
            raise TypeError(
                f"bias must be a float tensor of the query dtype {q.dtype}, got {bias.dtype}"
            )
        check_mask_tensor("bias", bias, q.dtype, dims)
        check_same_device("bias", bias, q)
    elif bias is not None and not callable(bias):
        raise TypeError(
            f"bias must be a float tensor or a callable fn(b, h, i, j), got {type(bias).__name__}"
        )
    elif bias is not None:
        check_bias_heads(bias, dims.H)
    # A last dim that is not unit-stride (column-major, channels-last-like) is copied once, so
    # every backend reads rows the same way as for the contiguous call (bit-equal results, B5).
    q, k, v = _unit_stride_last(q), _unit_stride_last(k), _unit_stride_last(v)
    if dims.three_d:
        q, k, v = q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)  # (B, 1, L|S, D)
        if isinstance(mask, Tensor) and mask.dim() == 3:
            mask = mask.unsqueeze(1)  # (B|1, 1, L|1, S|1)
        if isinstance(bias, Tensor) and bias.dim() == 3:
            bias = bias.unsqueeze(1)  # (B|1, 1, L|1, S|1)
    if isinstance(mask, Mask):
        # Renders nothing; checks that a batch- or head-dependent mask fits this call.
        mask._batch_heads(dims.B, dims.H)
        for what, t in mask._data_tensors():
            check_same_device(f"mask {what}", t, q)
    return Request(
        q=q,
        k=k,
        v=v,
        dims=dims,
        mask=mask,
        bias=bias,
        scale=scale,
        temperature=temperature,
        score=score,
        dropout_p=dropout_p,
        return_weights=return_weights,
        softcap=cap,
    )


def trusted_request(q: Tensor, k: Tensor, v: Tensor, *, dropout_p: float = 0.0) -> Request:
    """The request of ``attention(q, k, v, dropout_p=dropout_p)`` (4-D, no mask, no bias, the
    default scale) WITHOUT its checks, for callers whose q ``(B, H, L, D)``, k ``(B, H_kv, S, D)``
    and v ``(B, H_kv, S, Dv)`` are consistent by construction — `MultiHeadAttention`'s own
    projections — and whose ``dropout_p`` is already validated. Anything else goes through
    `build_request`, which raises on bad arguments.
    """
    B, H, L, D = q.shape
    H_kv, S, Dv = k.shape[1], k.shape[2], v.shape[3]
    return Request(
        q=_unit_stride_last(q),
        k=_unit_stride_last(k),
        v=_unit_stride_last(v),
        dims=Dims(B=B, H=H, H_kv=H_kv, L=L, S=S, D=D, Dv=Dv, three_d=False),
        mask=None,
        bias=None,
        scale=get_score("dot").default_scale(D),
        temperature=1.0,
        score="dot",
        dropout_p=dropout_p,
        return_weights=False,
        softcap=None,
    )


def plain_request(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Mask | Tensor | None,
    bias: Tensor | BiasFn | None,
    scale: float | None,
    temperature: float,
    score: str,
    softcap: float | None = None,
) -> Request:
    """`build_request` without dropout or weights: the entry points that only need the logits."""
    return build_request(
        q,
        k,
        v,
        mask=mask,
        bias=bias,
        scale=scale,
        temperature=temperature,
        score=score,
        dropout_p=0.0,
        backend="auto",
        return_weights=False,
        softcap=softcap,
    )
