"""Argument checks for the attention entry points: everything is validated before any work.

`build_request` turns the arguments of `attention` (and of the entry points that only need the
logits, `plain_request`) into a `Request`, raising ValueError/TypeError that name the argument,
the expected and the received value.
"""

from __future__ import annotations

import math
from typing import NamedTuple, TypeVar

import torch
from torch import Tensor

from .._shapes import (
    Dims,
    check_bool,
    check_logit_multiplier,
    check_mask_tensor,
    check_number,
    check_probability,
    check_qkv,
    check_same_device,
    stat_dtype,
)
from ..masks import Mask
from .registry import check_backend_name
from .request import BiasFn, Request, check_bias_heads
from .scores import get_score

_T = TypeVar("_T")


def _unit_stride_last(t: Tensor) -> Tensor:
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def _shape(t: Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def _check_extra(name: str, t: Tensor, target: tuple[int, ...]) -> None:
    """Raises ValueError, quoting both shapes, unless the mask or bias tensor ``t`` broadcasts
    to ``target = (*batch, H, L, S)`` (``(L, S)`` for 2-D inputs) by torch's rules: aligned at
    the right, every size 1 or equal, no more dims than the inputs."""
    if t.dim() > len(target) or not all(
        a in (1, b) for a, b in zip(reversed(t.shape), reversed(target), strict=False)
    ):
        letters = "(L, S)" if len(target) == 2 else "(..., H, L, S)"
        raise ValueError(
            f"{name} of shape {_shape(t)} is not broadcastable to {letters} = {target}"
        )


def _extra_to_4d(t: Tensor, target: tuple[int, ...], B: int) -> Tensor:
    """A mask or bias tensor that broadcasts to ``target`` (`_check_extra`) as one that
    broadcasts to ``(B, H, L, S)``, ``B = prod(batch)``: a view when its batch dims are all 1 or
    all full (and mergeable); one that broadcasts over some batch dims but not others is
    expanded over them and copied once."""
    r = len(target)
    t = t.reshape((1,) * (r - t.dim()) + _shape(t))  # (1|batch..., H|1, L|1, S|1)
    if r == 2:
        return t.reshape(1, 1, *t.shape)  # (1, 1, L|1, S|1)
    batch, tail = _shape(t)[:-3], _shape(t)[-3:]
    if all(n == 1 for n in batch):
        return t.reshape(1, *tail)  # (1, H|1, L|1, S|1)
    if batch != target[:-3]:
        t = t.expand(*target[:-3], *tail)  # broadcast over some batch dims only
    return t.reshape(B, *tail)  # (B, H|1, L|1, S|1)


class _Leading(NamedTuple):
    """What `leading_to_4d` made of SDPA-style inputs."""

    q: Tensor  # (B, H, L, D)
    k: Tensor  # (B, H_kv, S, D)
    v: Tensor  # (B, H_kv, S, Dv)
    batch_shape: tuple[int, ...]  # the caller's (*batch, H), or () for 2-D inputs
    target: tuple[int, ...]  # (*batch, H, L, S), or (L, S) for 2-D inputs
    B: int  # prod(batch)


def leading_to_4d(q: Tensor, k: Tensor, v: Tensor) -> _Leading | None:
    """SDPA's layouts beyond `attention`'s 3-D/4-D ones, as 4-D views (before any work).

    q ``(*batch, H, L, D)`` with ≥ 1 batch dims (rank ≥ 5), k ``(*batch, H_kv, S, D)`` and v
    ``(*batch, H_kv, S, Dv)`` become ``(B, H, L, D)``, ``(B, H_kv, S, D)``, ``(B, H_kv, S, Dv)``
    with ``B = prod(batch)``; 2-D inputs ``(L, D)``, ``(S, D)``, ``(S, Dv)`` become
    ``(1, 1, L, D)`` etc. Views, unless the batch dims of an input cannot be merged (then
    `Tensor.reshape` copies it once). The output is ``out.reshape(*batch_shape, L, Dv)``.

    Returns:
        None for 3-D/4-D inputs and non-tensors (`check_qkv` handles them).

    Raises:
        ValueError: a rank below 2, ranks that differ, or batch dims that differ between q, k and
            v (they are not broadcast: expand them, which is free), naming every shape.
    """
    if not (isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor)):
        return None
    ranks = (q.dim(), k.dim(), v.dim())
    if all(r in (3, 4) for r in ranks):
        return None
    for name, t in (("query", q), ("key", k), ("value", v)):
        if t.dim() < 2:
            raise ValueError(
                f"{name} must have rank 3 (B, L, D), 4 (B, H, L, D), 2 (L, D) or more "
                f"(..., H, L, D), got rank {t.dim()} with shape {_shape(t)}"
            )
    if len(set(ranks)) > 1:
        raise ValueError(
            f"query, key and value must have the same rank, got query {_shape(q)}, key "
            f"{_shape(k)}, value {_shape(v)}"
        )
    if q.dim() == 2:
        q4, k4, v4 = (t.reshape(1, 1, *t.shape) for t in (q, k, v))  # (1, 1, L|S, D|Dv)
        return _Leading(q4, k4, v4, (), (q.shape[0], k.shape[0]), 1)
    batch = _shape(q)[:-3]
    if _shape(k)[:-3] != batch or _shape(v)[:-3] != batch:
        raise ValueError(
            f"query, key and value must share the batch dims {batch} before (H, L|S, D), got "
            f"query {_shape(q)}, key {_shape(k)}, value {_shape(v)}"
        )
    B = math.prod(batch)
    q4 = q.reshape(B, *q.shape[-3:])  # (B, H, L, D)
    k4 = k.reshape(B, *k.shape[-3:])  # (B, H_kv, S, D)
    v4 = v.reshape(B, *v.shape[-3:])  # (B, H_kv, S, Dv)
    target = (*batch, q.shape[-3], q.shape[-2], k.shape[-2])
    return _Leading(q4, k4, v4, _shape(q)[:-2], target, B)


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
    cap = check_number("softcap", softcap, positive=True)
    if torch.compiler.is_compiling():
        return cap  # may be symbolic (torch.compile(dynamic=True)): checked in eager calls only
    compute = stat_dtype(dtype)
    info = torch.finfo(compute)
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
    leading: bool = False,
) -> Request:
    """Validates every argument (before any computation) and returns the 4-D request.

    With ``leading=True`` (the entry points that restore the caller's layout on their outputs:
    `attention`, `attention_weights`, `attention_stats`, `explain`) q/k/v may also be 2-D or
    have several leading batch dims (`leading_to_4d`); ``Request.batch_shape`` records the
    caller's ``(*batch, H)``. Otherwise only 3-D and 4-D inputs are accepted.
    """
    lead = leading_to_4d(q, k, v) if leading else None
    dims, q, k, v = _qkv_dims(q, k, v, lead, mask, bias)
    s = get_score(score)
    check_backend_name(backend)
    temperature = check_number("temperature", temperature, positive=True)
    cap = check_softcap(softcap, q.dtype)
    dropout_p = check_probability("dropout_p", dropout_p)
    scale = s.default_scale(dims.D) if scale is None else check_number("scale", scale, nonzero=True)
    check_logit_multiplier(scale, temperature, q.dtype)
    check_bool("return_weights", return_weights)
    if lead is not None:
        mask = _extra_to_4d(mask, lead.target, lead.B) if isinstance(mask, Tensor) else mask
        bias = _extra_to_4d(bias, lead.target, lead.B) if isinstance(bias, Tensor) else bias
    _check_mask_bias(mask, bias, q, dims)
    # A last dim that is not unit-stride (column-major, channels-last-like) is copied once, so
    # every backend reads rows the same way as for the contiguous call (bit-equal results, B5).
    q, k, v = _unit_stride_last(q), _unit_stride_last(k), _unit_stride_last(v)
    if dims.three_d:
        q, k, v = q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)  # (B, 1, L|S, D)
        mask, bias = _head_dim(mask), _head_dim(bias)
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
        batch_shape=None if lead is None else lead.batch_shape,
    )


def _qkv_dims(
    q: Tensor, k: Tensor, v: Tensor, lead: _Leading | None, mask: object, bias: object
) -> tuple[Dims, Tensor, Tensor, Tensor]:
    """``(dims, q, k, v)``: the checked sizes of a call, with q ``(B, H, L, D)``, k
    ``(B, H_kv, S, D)``, v ``(B, H_kv, S, Dv)`` taken from ``lead`` (`leading_to_4d`'s result
    for SDPA's other layouts, whose mask/bias tensors are checked against its target shape)
    when it is not None. A shape error then names the caller's shapes."""
    if lead is None:
        return check_qkv(q, k, v), q, k, v
    for name, t in (("mask", mask), ("bias", bias)):
        if isinstance(t, Tensor):
            _check_extra(name, t, lead.target)
    try:
        return check_qkv(lead.q, lead.k, lead.v), lead.q, lead.k, lead.v
    except ValueError as e:
        shapes = ", ".join(str(_shape(t)) for t in (q, k, v))
        raise ValueError(f"{e} (inputs of shapes {shapes} read as (B, H, L|S, D))") from None


def _check_mask_bias(
    mask: Mask | Tensor | None, bias: Tensor | BiasFn | None, q: Tensor, dims: Dims
) -> None:
    """Raises unless ``mask`` is None, a `Mask` or a bool/float tensor and ``bias`` None, a
    float tensor or a callable, the tensors broadcastable to ``(B, H, L, S)`` on q's device and
    a bias function built for ``dims.H`` heads (`check_bias_heads`)."""
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
    if isinstance(mask, Mask):
        # Renders nothing; checks that a batch- or head-dependent mask fits this call.
        mask.batch_heads(dims.B, dims.H)
        for what, t in mask.data_tensors():
            check_same_device(f"mask {what}", t, q)


def _head_dim(t: _T) -> _T:
    """A 3-D mask/bias tensor ``(B|1, L|1, S|1)`` of a 3-D call as ``(B|1, 1, L|1, S|1)``; any
    other argument unchanged."""
    if isinstance(t, Tensor) and t.dim() == 3:
        return t.unsqueeze(1)  # type: ignore[return-value]
    return t


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
    leading: bool = False,
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
        leading=leading,
    )
