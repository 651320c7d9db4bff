"""Feature maps of linear attention fused with the NaN rule's `clean`, with closed-form gradients.

``φ(clean(x))`` composed from torch ops keeps two copies of every input alive for the backward
(the cleaned copy, saved by `clean` and by ``elu``); the fused forms save only ``x`` (the caller's
tensor) and ``φ`` (needed by the products anyway). ``φ'`` is a function of ``φ`` for the built-in
maps: ``elu(x) + 1`` has ``φ' = min(φ, 1)``, ``relu`` has ``φ' = [φ > 0]``; both are 0 where
``x`` was non-finite (cleaned to 0). Values and gradients equal ``φ(clean(x))`` of
`reference.elu_feature_map` / `reference.relu_feature_map` (issue #19 item 4: the causal scan's
saved memory at L = 64K went from 1.2 GB to the features alone).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from .nan_rule import clean
from .reference import elu_feature_map, relu_feature_map

__all__ = ["CleanFeature", "clean_features", "clean_with_ones", "finite", "fused_feature"]


def finite(x: Tensor) -> Tensor:
    """bool: ``x`` is finite (`torch.isfinite`)."""
    return torch.isfinite(x)


class CleanFeature(NamedTuple):
    """A built-in ``φ`` fused with `clean`.

    Attributes:
        forward: ``(x (..., D), dtype) -> φ(clean(x)) (..., D)`` in ``dtype``.
        backward: ``(x, φ, dφ, x_finite) -> dx`` in x's dtype, from ``x`` and ``φ`` alone;
            ``x_finite`` says that ``x`` is known to hold no NaN/±inf (no mask is needed).
    """

    forward: Callable[[Tensor, torch.dtype], Tensor]
    backward: Callable[[Tensor, Tensor, Tensor, bool], Tensor]


def _elu_forward(x: Tensor, dtype: torch.dtype) -> Tensor:
    # elu(x) + 1 = exp(min(x, 0)) + max(x, 0): one exp, and no cancellation of expm1(x) + 1;
    # two block-sized allocations (each fresh one can cost a page fault per 4 KiB)
    c = torch.nan_to_num(x.to(dtype), 0.0, 0.0, 0.0)
    return c.clamp(max=0.0).exp_().add_(c.clamp_(min=0.0))


def _elu_backward(x: Tensor, y: Tensor, grad: Tensor, x_finite: bool) -> Tensor:
    # φ' = 1 above 0 and exp(x) = φ below: min(φ, 1); 0 where x was cleaned (φ(0) = 1 there)
    dx = y.clamp(max=1.0).mul_(grad)
    return (dx if x_finite else torch.where(finite(x), dx, 0.0)).to(x.dtype)


def _relu_forward(x: Tensor, dtype: torch.dtype) -> Tensor:
    return torch.nan_to_num(x.to(dtype), 0.0, 0.0, 0.0).relu()


def _relu_backward(x: Tensor, y: Tensor, grad: Tensor, x_finite: bool) -> Tensor:  # noqa: ARG001 (autograd's backward signature)
    return torch.where(y > 0, grad, 0.0).to(x.dtype)  # cleaned entries have φ = 0


#: φ (the reference's functions) -> its fused form.
FUSED_FEATURES: dict[Callable[[Tensor], Tensor], CleanFeature] = {
    elu_feature_map: CleanFeature(_elu_forward, _elu_backward),
    relu_feature_map: CleanFeature(_relu_forward, _relu_backward),
}


def fused_feature(phi: Callable[[Tensor], Tensor]) -> CleanFeature | None:
    """The fused form of a built-in ``φ``, or None for a user callable."""
    return FUSED_FEATURES.get(phi)


class _CleanFeatureFn(torch.autograd.Function):
    """``φ(clean(x))`` saving ``x`` and ``φ`` only."""

    @staticmethod
    def forward(x: Tensor, op: CleanFeature, dtype: torch.dtype) -> Tensor:
        return op.forward(x, dtype)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.op = inputs[1]
        ctx.save_for_backward(inputs[0], output)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        x, y = ctx.saved_tensors
        return ctx.op.backward(x, y, grad, False), None, None


def clean_features(phi: Callable[[Tensor], Tensor], x: Tensor, dtype: torch.dtype) -> Tensor:
    """``φ(clean(x))`` in ``dtype``: fused for the built-in maps, the composition otherwise.

    Args:
        phi: the feature map. x: ``(..., D)``. dtype: the compute dtype.

    Returns:
        ``(..., F)`` in ``dtype``.
    """
    op = fused_feature(phi)
    if op is None:
        return phi(clean(x.to(dtype)))
    if x.requires_grad and torch.is_grad_enabled():
        return _CleanFeatureFn.apply(x, op, dtype)
    return op.forward(x, dtype)


def _with_ones_forward(v: Tensor, dtype: torch.dtype) -> Tensor:
    cleaned = torch.nan_to_num(v.to(dtype), 0.0, 0.0, 0.0)
    return torch.cat([cleaned, cleaned.new_ones(*v.shape[:-1], 1)], dim=-1)


class _CleanWithOnes(torch.autograd.Function):
    """``[clean(v) | 1]`` saving only ``v`` (no cleaned copy kept for the backward)."""

    @staticmethod
    def forward(v: Tensor, dtype: torch.dtype) -> Tensor:
        return _with_ones_forward(v, dtype)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:  # noqa: ARG004 (autograd's backward signature)
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        (v,) = ctx.saved_tensors
        return torch.where(finite(v), grad[..., :-1], 0.0).to(v.dtype), None


def clean_with_ones(v: Tensor, dtype: torch.dtype) -> Tensor:
    """``[clean(v) | 1]``: one product with it carries ``Σ φ(k) vᵀ`` and ``Σ φ(k)``.

    Args:
        v: ``(..., n, Dv)``. dtype: the compute dtype.

    Returns:
        ``(..., n, Dv + 1)`` in ``dtype``.
    """
    if v.requires_grad and torch.is_grad_enabled():
        return _CleanWithOnes.apply(v, dtype)
    return _with_ones_forward(v, dtype)
