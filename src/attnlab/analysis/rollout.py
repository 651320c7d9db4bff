"""Attention rollout (Abnar & Zuidema, 2020) and the [CLS] row of every head.

Raw attention weights of one layer say how a token mixes the *previous layer's* states; after a
few layers those states are already mixtures, so a single layer's map understates where the
information came from. Rollout follows the mixing through the stack. Each block adds its
attention output to the residual stream, so a layer's token-to-token flow is modelled as half
the (head-averaged) attention and half the identity, re-normalised so rows sum to 1, and the
layers are multiplied, the last layer on the left::

    Â_l = 0.5·A_l + 0.5·I          (rows re-normalised: Â_l / Â_l.sum(-1))
    R   = Â_{N−1} · … · Â_1 · Â_0   (T, T); R[i, j] = share of input token j in output token i

``R[0, 1:]`` is the [CLS] token's rollout over the image patches. The ``0.5·(A + I)`` weighting
is the paper's residual convention (``residual=0.5``); ``residual=0`` multiplies the raw
attention maps.

Example:
    >>> logits, weights = vit(images, need_weights=True)      # n_layers × (B, H, T, T)
    >>> r = attention_rollout(weights)                         # (B, T, T), rows sum to 1
    >>> heat = r[:, 0, 1:].reshape(-1, 4, 4)                    # [CLS] over a 4 × 4 patch grid
    >>> per_head = cls_attention(weights, layer=-1)             # (B, H, N)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .._shapes import check_int, check_number

#: How `attention_rollout` fuses the heads of one layer.
HEAD_FUSIONS = ("mean", "max", "min")


def _stack(attentions: Sequence[Tensor] | Tensor, name: str = "attentions") -> Tensor:
    """``attentions`` as one ``(layers, B, H, T, T)`` tensor, or an error naming the shapes."""
    if isinstance(attentions, Tensor):
        if attentions.dim() != 5:
            raise ValueError(
                f"{name} must be (layers, B, H, T, T) or a sequence of (B, H, T, T) tensors, "
                f"got shape {tuple(attentions.shape)}"
            )
        stacked = attentions
    else:
        if isinstance(attentions, (str, bytes)) or not isinstance(attentions, Sequence):
            raise TypeError(
                f"{name} must be a sequence of (B, H, T, T) tensors, got "
                f"{type(attentions).__name__}"
            )
        if len(attentions) == 0:
            raise ValueError(f"{name} must hold at least one layer, got none")
        for n, a in enumerate(attentions):
            if not isinstance(a, Tensor):
                raise TypeError(f"{name}[{n}] must be a tensor, got {type(a).__name__}")
            if a.dim() != 4 or a.shape != attentions[0].shape:
                raise ValueError(
                    f"{name}[{n}] must be (B, H, T, T) like {name}[0] "
                    f"{tuple(attentions[0].shape)}, got {tuple(a.shape)}"
                )
        stacked = torch.stack(tuple(attentions))  # (layers, B, H, T, T)
    if not stacked.is_floating_point():
        raise TypeError(f"{name} must be floating point, got dtype {stacked.dtype}")
    if stacked.shape[-1] != stacked.shape[-2]:
        raise ValueError(
            f"{name} must be square self-attention maps (T, T), got (T, S) = "
            f"{tuple(stacked.shape[-2:])}"
        )
    if stacked.shape[0] == 0:
        raise ValueError(f"{name} must hold at least one layer, got none")
    return stacked


def attention_rollout(
    attentions: Sequence[Tensor] | Tensor,
    *,
    residual: float = 0.5,
    head_fusion: str = "mean",
    start_layer: int = 0,
) -> Tensor:
    """Attention rollout: ``R = Â_{N−1} ··· Â_0`` with ``Â_l = norm((1 − r)·A_l + r·I)``.

    ``A_l`` is layer l's weights fused over heads (the mean by default, as in the paper),
    ``r = residual`` (0.5 in the paper: the residual connection carries as much as the
    attention), and ``norm`` divides each row by its sum (a no-op for softmax rows; it only
    matters for ``head_fusion`` "max"/"min" and for rows that attend nothing). Computed in
    float64 and returned in the input dtype.

    Args:
        attentions: one ``(B, H, T, T)`` tensor per layer (first layer first), e.g. the
            weights returned by ``VisionTransformer(..., need_weights=True)``, or their stack
            ``(layers, B, H, T, T)``.
        residual: r in [0, 1]: the identity's share. 0 multiplies the raw maps.
        head_fusion: "mean", "max" or "min" over the H heads.
        start_layer: roll out from this layer on (earlier layers are skipped).

    Returns:
        ``(B, T, T)``; row i is how much each input token contributes to output token i.
        Each row sums to 1 (when each fused ``A_l`` row has a positive sum or r > 0).

    Raises:
        TypeError, ValueError: attentions not shaped as above (naming the shapes), residual
            outside [0, 1], an unknown head_fusion, start_layer out of range.
    """
    a = _stack(attentions)
    if check_number("residual", residual, at_least=0.0) > 1.0:
        raise ValueError(f"residual must be in [0, 1], got {residual}")
    if head_fusion not in HEAD_FUSIONS:
        raise ValueError(f"head_fusion must be one of {list(HEAD_FUSIONS)}, got {head_fusion!r}")
    n_layers = a.shape[0]
    check_int("start_layer", start_layer, minimum=0, maximum=n_layers - 1)
    x = a[start_layer:].detach().to(torch.float64)  # (layers, B, H, T, T)
    if head_fusion == "mean":
        fused = x.mean(dim=2)
    elif head_fusion == "max":
        fused = x.amax(dim=2)
    else:
        fused = x.amin(dim=2)  # (layers, B, T, T)
    T = fused.shape[-1]
    eye = torch.eye(T, dtype=fused.dtype, device=fused.device)
    flow = (1.0 - residual) * fused + residual * eye  # (layers, B, T, T)
    total = flow.sum(-1, keepdim=True)  # (layers, B, T, 1)
    flow = flow / torch.where(total > 0, total, torch.ones_like(total))  # rows sum to 1 (or 0)
    rollout = flow[0]  # (B, T, T)
    for layer in flow[1:]:
        rollout = layer @ rollout  # later layers on the left
    return rollout.to(a.dtype)


def cls_attention(
    attentions: Sequence[Tensor] | Tensor, *, layer: int = -1, cls_index: int = 0
) -> Tensor:
    """Each head's attention from the [CLS] token to the other tokens in one layer.

    ``out[b, h, j] = A_layer[b, h, cls, j']`` for the keys ``j'`` other than ``cls`` (in order),
    i.e. the [CLS] row without its own column: for a ViT, the map over the N patches.

    Args:
        attentions: one ``(B, H, T, T)`` tensor per layer, or their stack.
        layer: the layer (negative counts from the end).
        cls_index: the [CLS] token's position.

    Returns:
        ``(B, H, T − 1)``.

    Raises:
        TypeError, ValueError: bad shapes, or layer / cls_index out of range.
    """
    a = _stack(attentions)
    n_layers, T = a.shape[0], a.shape[-1]
    check_int("layer", layer, minimum=-n_layers, maximum=n_layers - 1)
    check_int("cls_index", cls_index, minimum=-T, maximum=T - 1)
    row = a[layer, :, :, cls_index % T].detach()  # (B, H, T)
    keep = [j for j in range(T) if j != cls_index % T]
    return row[..., keep]  # (B, H, T − 1)


__all__ = ["HEAD_FUSIONS", "attention_rollout", "cls_attention"]
