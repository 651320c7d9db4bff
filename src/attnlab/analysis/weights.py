"""Statistics of attention weights: entropy, head diversity, each row's top-k weights, the
sink's share of each row (attention sinks) and the two maps of differential attention.

Every function takes the weights explicitly — ``(B, H, L, S)``, or ``(layers, H, L, S)`` for one
input through a model — and never reads state hidden on modules. For inputs too long for an
``L × S`` matrix, `attnlab.attention_stats` gives the same per-query entropy from the tiled
backend's loop.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._shapes import stat_dtype


def _check_weights(weights: object) -> Tensor:
    if not isinstance(weights, Tensor) or not weights.is_floating_point():
        got = f"dtype {weights.dtype}" if isinstance(weights, Tensor) else type(weights).__name__
        raise TypeError(f"weights must be a float tensor, got {got}")
    if weights.dim() < 3:
        raise ValueError(
            f"weights must be (…, H, L, S) with at least 3 dims, got shape {tuple(weights.shape)}"
        )
    return weights


def row_is_attended(weights: Tensor) -> Tensor:
    """True for query rows that attend to something (a fully masked row has all-zero weights)."""
    return _check_weights(weights).sum(-1) > 0


def entropy(weights: Tensor) -> Tensor:
    """Per-query entropy ``H_i = −Σ_j p_ij log p_ij`` in nats, ``(…, H, L)``.

    Zero weights contribute 0 (``0 log 0 = 0``). Fully masked rows (all-zero weights) are
    excluded: their entry is NaN, which `head_entropy` skips.

    Args:
        weights: ``(B, H, L, S)`` or ``(layers, H, L, S)`` attention probabilities.
    """
    w = _check_weights(weights).to(torch.float64)
    plogp = torch.where(w > 0, w * w.clamp_min(1e-300).log(), 0.0)
    h = -plogp.sum(-1)  # (…, H, L)
    return torch.where(row_is_attended(weights), h, torch.nan).to(stat_dtype(weights.dtype))


def head_entropy(weights: Tensor) -> Tensor:
    """Mean per-query entropy of each head over its attended rows, ``(…, H)`` in nats."""
    return entropy(weights).nanmean(dim=-1)


def head_diversity(weights: Tensor) -> Tensor:
    """``1 − mean pairwise cosine similarity`` of the heads' attention maps, ``(…,)``.

    Each head's ``(L, S)`` map is flattened to a vector; 0 means every head attends identically,
    values near 1 mean the heads' maps are nearly orthogonal.

    Args:
        weights: ``(B, H, L, S)`` or ``(layers, H, L, S)`` with H >= 2.
    """
    w = _check_weights(weights)
    H = w.shape[-3]
    if H < 2:
        raise ValueError(f"head_diversity needs at least 2 heads, got H={H}")
    flat = w.flatten(-2).to(torch.float64)  # (…, H, L·S)
    unit = flat / flat.norm(dim=-1, keepdim=True).clamp_min(1e-300)
    cos = unit @ unit.transpose(-1, -2)  # (…, H, H)
    off = ~torch.eye(H, dtype=torch.bool, device=w.device)
    mean_cos = cos[..., off].mean(-1)  # (…,)
    return (1.0 - mean_cos).to(stat_dtype(w.dtype))


def top_weights(weights: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The ``k`` largest weights of every row, largest first; ties keep the lower key index.

    Exactly the first ``k`` of a stable descending sort, without sorting whole rows:
    `torch.topk` picks k per row (memory ``(..., T, k)``), the k are ordered by
    ``(−value, index)``, and only rows where the k-th value ties with a value left out are
    sorted whole to choose the lower indices.

    Args:
        weights: ``(..., T, S)``, no NaN. k: how many (at most S).

    Returns:
        ``(values, indices)``, each ``(..., T, k)``.
    """
    *lead, S = weights.shape
    flat = weights.reshape(-1, S)  # (rows, S)
    values, indices = torch.topk(flat, k, dim=-1)  # (rows, k), ties in any order
    order = torch.argsort(indices, dim=-1)  # by index, then stably by value: (−value, index)
    values, indices = values.gather(-1, order), indices.gather(-1, order)
    order = torch.sort(values, dim=-1, descending=True, stable=True).indices
    values, indices = values.gather(-1, order), indices.gather(-1, order)
    tied = (flat >= values[:, -1:]).sum(dim=-1) > k  # (rows,) a value equal to the k-th is out
    rows = tied.nonzero().squeeze(1)
    if rows.numel():  # e.g. a causal row with fewer than k keys: its zeros tie
        v, i = torch.sort(flat[rows], dim=-1, descending=True, stable=True)
        values[rows], indices[rows] = v[:, :k], i[:, :k]
    return values.reshape(*lead, k), indices.reshape(*lead, k)


def sink_share(weights: Tensor) -> Tensor:
    """The share of each row that goes to the attention sink, ``(…, H, L)``.

    With a sink logit ``s_h`` per head (GPT-OSS, `attnlab.attention(..., sinks=)`) row i's
    weights ``p_ij = e^{l_ij} / (e^{s_h} + Σ_j e^{l_ij})`` sum to less than 1; the rest is the
    sink's ``p_sink,i = e^{s_h} / (e^{s_h} + Σ_j e^{l_ij}) = 1 − Σ_j p_ij``. A row with no key
    (all-zero weights, `row_is_attended` False) has no share: its entry is NaN, which
    `head_sink_share` skips.

    Args:
        weights: ``(B, H, L, S)`` or ``(layers, H, L, S)`` weights without the sink column (what
            ``return_weights=True``, ``need_weights=True``, `module_attentions` and
            transformers' ``output_attentions`` give).

    Returns:
        ``(…, H, L)`` in float32 (float64 for float64 weights).
    """
    w = _check_weights(weights)
    share = 1.0 - w.to(torch.float64).sum(-1)  # (…, H, L)
    return torch.where(row_is_attended(w), share, torch.nan).to(stat_dtype(w.dtype))


def head_sink_share(weights: Tensor) -> Tensor:
    """Mean `sink_share` of each head over its rows that have a key, ``(…, H)``."""
    return sink_share(weights).nanmean(dim=-1)


def differential_maps(weights: Tensor, lam: float | Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The two softmax maps of differential attention and their difference.

    `attnlab.modules.DifferentialAttention` (DiffLlama's layout) returns, with
    ``need_weights=True``, the first maps ``softmax(Q₁K₁ᵀ/√D)`` as heads ``0 … H/2 − 1`` and the
    second maps ``softmax(Q₂K₂ᵀ/√D)`` as heads ``H/2 … H − 1`` (pair h = heads h and h + H/2);
    the map that weighs the values is ``softmax(Q₁K₁ᵀ/√D) − λ·softmax(Q₂K₂ᵀ/√D)``.

    Args:
        weights: ``(…, H, L, S)`` with H even. lam: λ (`DifferentialAttention.lam()`).

    Returns:
        ``(first, second, difference)``, each ``(…, H/2, L, S)``.
    """
    w = _check_weights(weights)
    H = w.shape[-3]
    if H % 2:
        raise ValueError(f"weights must have an even number of heads (two maps), got H={H}")
    first, second = w[..., : H // 2, :, :], w[..., H // 2 :, :, :]  # (…, H/2, L, S)
    lam_t = torch.as_tensor(lam, dtype=w.dtype, device=w.device)
    if lam_t.dim() != 0:
        raise ValueError(f"lam must be a number or a 0-d tensor, got shape {tuple(lam_t.shape)}")
    return first, second, first - lam_t * second
