"""`attention`: one entry point that validates, picks a backend and runs it."""

from __future__ import annotations

from torch import Tensor

from .._shapes import check_mask_tensor, check_number, check_probability, check_qkv
from ..masks import Mask
from . import backends as _backends  # noqa: F401  (fills the registry)
from .registry import check_backend_name, select
from .request import BiasFn, Request
from .scores import get_score


def _build_request(
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
) -> Request:
    """Validates every argument (before any computation) and returns the 4-D request."""
    dims = check_qkv(q, k, v)
    s = get_score(score)
    check_backend_name(backend)
    temperature = check_number("temperature", temperature, positive=True)
    dropout_p = check_probability("dropout_p", dropout_p)
    scale = s.default_scale(dims.D) if scale is None else check_number("scale", scale, nonzero=True)
    if not isinstance(return_weights, bool):
        raise TypeError(f"return_weights must be a bool, got {type(return_weights).__name__}")
    if isinstance(mask, Tensor):
        check_mask_tensor("mask", mask, q.dtype, dims)
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
    elif bias is not None and not callable(bias):
        raise TypeError(
            f"bias must be a float tensor or a callable fn(b, h, i, j), got {type(bias).__name__}"
        )
    if dims.three_d:
        q, k, v = q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)  # (B, 1, L|S, D)
        if isinstance(mask, Tensor) and mask.dim() == 3:
            mask = mask.unsqueeze(1)  # (B|1, 1, L|1, S|1)
        if isinstance(bias, Tensor) and bias.dim() == 3:
            bias = bias.unsqueeze(1)  # (B|1, 1, L|1, S|1)
    if isinstance(mask, Mask):
        # Renders nothing; checks that a batch- or head-dependent mask fits this call.
        mask._batch_heads(dims.B, dims.H)
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
    )


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Mask | Tensor | None = None,
    bias: Tensor | BiasFn | None = None,
    scale: float | None = None,
    temperature: float = 1.0,
    score: str = "dot",
    dropout_p: float = 0.0,
    backend: str = "auto",
    return_weights: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention as the textbooks define it: ``softmax(score(Q, K) · scale / T + bias) V``.

    Defined to equal `attnlab.functional.reference.attention`; every backend agrees with it under
    the tolerance rule.

    Args:
        q: queries ``(B, H, L, D)``, or ``(B, L, D)`` for a single head.
        k: keys ``(B, H_kv, S, D)``; ``H % H_kv == 0`` gives grouped-query / multi-query attention
            (k and v are shared by ``G = H / H_kv`` consecutive query heads, not copied).
        v: values ``(B, H_kv, S, Dv)``.
        mask: an `attnlab.masks.Mask`, a bool tensor (True = may attend) or an additive float
            tensor, broadcastable to ``(B, H, L, S)``. Masks align bottom-right when L != S.
        bias: additive float tensor broadcastable to ``(B, H, L, S)``, or ``fn(b, h, i, j)``.
        scale: logit scale; default ``1/√D`` for ``score="dot"`` and 1 for ``"cosine"``.
        temperature: divides the logits (T → ∞: uniform weights; T → 0: one-hot).
        score: ``"dot"`` (q·k) or ``"cosine"`` (cos(q, k)); see `functional.scores`.
        dropout_p: dropout on the weights, in [0, 1).
        backend: ``"auto"``, ``"sdpa"``, ``"reference"`` or another name in `attnlab.backends()`.
        return_weights: also return the weights ``(B, H, L, S)`` (computed by the reference).

    Returns:
        ``out (B, H, L, Dv)`` (3-D in, 3-D out), or ``(out, weights)``. A query row with no key to
        attend outputs zeros, with zero weights and zero gradients.

    Raises:
        TypeError: non-tensor inputs, mixed or non-float dtypes, bad mask/bias dtype.
        ValueError: shape mismatches, bad scale/temperature/dropout_p, unknown score or backend.

    Example:
        >>> import torch, attnlab
        >>> q = k = v = torch.randn(2, 4, 16, 8)
        >>> attnlab.attention(q, k, v, mask=attnlab.masks.causal()).shape
        torch.Size([2, 4, 16, 8])
    """
    req = _build_request(
        q,
        k,
        v,
        mask=mask,
        bias=bias,
        scale=scale,
        temperature=temperature,
        score=score,
        dropout_p=dropout_p,
        backend=backend,
        return_weights=return_weights,
    )
    chosen, _ = select(backend, req)
    out, weights = chosen.run(req)
    if req.dims.three_d:
        out = out.squeeze(1)  # (B, L, Dv)
        weights = None if weights is None else weights.squeeze(1)  # (B, L, S)
    if return_weights:
        assert weights is not None
        return out, weights
    return out


def explain(q: Tensor, k: Tensor, v: Tensor, **kwargs: object) -> str:
    """Which backend ``attention(q, k, v, **kwargs)`` would run, and why (one short string)."""
    backend = kwargs.pop("backend", "auto")
    defaults = {
        "mask": None,
        "bias": None,
        "scale": None,
        "temperature": 1.0,
        "score": "dot",
        "dropout_p": 0.0,
        "return_weights": False,
    }
    unknown = set(kwargs) - set(defaults)
    if unknown:
        raise TypeError(f"explain() got unexpected keyword arguments {sorted(unknown)}")
    req = _build_request(q, k, v, backend=backend, **{**defaults, **kwargs})  # type: ignore[arg-type]
    chosen, why = select(backend, req)  # type: ignore[arg-type]
    return f"{chosen.name}: {why}"
