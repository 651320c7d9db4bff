"""Three readings of attention from the texts, as functions that compute them exactly.

- `bilinear_metric`: a head's score is a bilinear form, ``s_ij = x_iᵀ M_h x_j / √D`` (plus
  bias terms) with ``M_h = W_Q,hᵀ W_K,h`` — an E × E matrix of rank at most D.
- `score_decomposition`: with absolute positions added to the input, ``x = e + p``, each logit
  splits into content–content, content–position, position–content and position–position terms
  (plus the projection biases' terms); they sum to the module's logits.
- `nadaraya_watson`: Gaussian kernel regression ``f(x) = Σ_i K(x, x_i) y_i / Σ_i K(x, x_i)``,
  ``K = exp(−‖x − x_i‖² / 2h²)``, IS softmax attention with ``q = x``, ``k = x_i``, ``v = y_i``,
  scale ``1/h²`` and the bias ``−‖x_i‖² / 2h²`` (the ``−‖x‖²/2h²`` term is constant in a row
  and cancels) — computed here through `attnlab.attention`.
- `gibbs`: softmax weights are a Boltzmann distribution over keys with energies ``E_j = −s_j``
  at temperature T: ``p = exp(−E/T) / Z``; internal energy ``U = Σ p E``, free energy
  ``F = −T log Z`` and entropy ``S = −Σ p log p`` satisfy ``F = U − T S``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

from .._shapes import check_number


def _projections(
    mha: nn.Module,
) -> tuple[tuple[Tensor, Tensor | None], tuple[Tensor, Tensor | None]]:
    if not hasattr(mha, "projection_weights") or not hasattr(mha, "head_dim"):
        raise TypeError(f"mha must be an attnlab.MultiHeadAttention, got {type(mha).__name__}")
    (wq, bq), (wk, bk), _ = mha.projection_weights()
    return (wq, bq), (wk, bk)


def bilinear_metric(mha: nn.Module) -> Tensor:
    """Each head's bilinear form ``M_h = W_Q,hᵀ W_K,h`` of a `MultiHeadAttention`.

    For self-attention without biases and positions, ``logit_h(i, j) = x_iᵀ M_h x_j / √D``.
    Under GQA a query head uses its group's key projection.

    Args:
        mha: an `attnlab.MultiHeadAttention` (kdim = embed_dim).

    Returns:
        ``(H, E, E)`` in the weights' dtype; each slice has rank at most D = head_dim.
    """
    (wq, _), (wk, _) = _projections(mha)
    H, H_kv, D = mha.num_heads, mha.num_kv_heads, mha.head_dim
    q = wq.reshape(H, D, -1)  # (H, D, E)
    k = wk.reshape(H_kv, D, -1).repeat_interleave(H // H_kv, dim=0)  # (H, D, Ek)
    return q.transpose(1, 2) @ k  # (H, E, Ek)


class ScoreTerms(NamedTuple):
    """The parts of ``logits = (W_q x + b_q)·(W_k x + b_k) / √D`` for ``x = e + p``, each
    ``(B, H, L, L)``: content–content, content–position, position–content, position–position,
    and everything that involves a projection bias."""

    content_content: Tensor
    content_position: Tensor
    position_content: Tensor
    position_position: Tensor
    bias: Tensor

    def total(self) -> Tensor:
        """Their sum: the module's logits (before any mask)."""
        return sum(self[1:], self[0])


def score_decomposition(mha: nn.Module, content: Tensor, positions: Tensor) -> ScoreTerms:
    """Splits a self-attention layer's logits for inputs ``x = content + positions``.

    ``q = W_q e + W_q p + b_q`` and ``k = W_k e + W_k p + b_k``, so
    ``q·k = e·e + e·p + p·e + p·p + (bias terms)`` with ``a·b = (W_q a)·(W_k b)`` (Shaw et al.
    and Transformer-XL's analysis of absolute positions). Scaled by ``1/√D``.

    Args:
        mha: an `attnlab.MultiHeadAttention` without RoPE (rotary positions are not additive).
        content: ``(B, L, E)`` token embeddings.
        positions: ``(B|1, L, E)`` or ``(L, E)`` absolute position encodings.

    Returns:
        `ScoreTerms`, each ``(B, H, L, L)``; ``.total()`` equals the module's logits.

    Raises:
        TypeError: not an attnlab MultiHeadAttention. ValueError: a RoPE module or mismatched
            shapes.
    """
    (wq, bq), (wk, bk) = _projections(mha)
    if getattr(mha, "rope", None) is not None:
        raise ValueError("score_decomposition needs additive positions; this module uses RoPE")
    if content.dim() != 3 or content.shape[-1] != mha.embed_dim:
        raise ValueError(
            f"content must be (B, L, embed_dim={mha.embed_dim}), got {tuple(content.shape)}"
        )
    p = positions if positions.dim() == 3 else positions.unsqueeze(0)
    if p.shape[-2:] != content.shape[-2:]:
        raise ValueError(
            f"positions must be (L, E) = {tuple(content.shape[-2:])} or (B|1, L, E), got "
            f"{tuple(positions.shape)}"
        )
    H, H_kv, D = mha.num_heads, mha.num_kv_heads, mha.head_dim
    scale = D**-0.5

    def heads(x: Tensor, w: Tensor, n: int) -> Tensor:
        y = x @ w.T  # (B, L, n D)
        return y.unflatten(-1, (n, D)).transpose(1, 2).repeat_interleave(H // n, dim=1)

    qe, qp = heads(content, wq, H), heads(p, wq, H)  # (B|1, H, L, D)
    ke, kp = heads(content, wk, H_kv), heads(p, wk, H_kv)

    def dot(a: Tensor, b: Tensor) -> Tensor:
        return (a @ b.transpose(-1, -2)) * scale

    cc, cp, pc, pp = dot(qe, ke), dot(qe, kp), dot(qp, ke), dot(qp, kp)
    B, L = content.shape[0], content.shape[1]
    bias = torch.zeros(B, H, L, L, dtype=cc.dtype, device=cc.device)
    if bq is not None or bk is not None:
        q_full, k_full = qe + qp, ke + kp
        bq_h = None if bq is None else bq.view(1, H, 1, D)
        bk_h = None if bk is None else bk.view(H_kv, D).repeat_interleave(H // H_kv, 0)
        bk_h = None if bk_h is None else bk_h.view(1, H, 1, D)
        if bq_h is not None:
            bias = bias + dot(bq_h.expand_as(q_full), k_full)
        if bk_h is not None:
            bias = bias + dot(q_full, bk_h.expand_as(k_full))
        if bq_h is not None and bk_h is not None:
            bias = bias + ((bq_h * bk_h).sum(-1, keepdim=True) * scale)
    return ScoreTerms(cc, cp.expand_as(cc), pc.expand_as(cc), pp.expand_as(cc), bias)


def nadaraya_watson(x: Tensor, x_train: Tensor, y_train: Tensor, bandwidth: float) -> Tensor:
    """Gaussian-kernel (Nadaraya–Watson) regression, computed as softmax attention.

    ``f(x) = Σ_i exp(−‖x − x_i‖²/2h²) y_i / Σ_i exp(−‖x − x_i‖²/2h²)``
    ``= attention(q=x, k=x_i, v=y_i, scale=1/h², bias=−‖x_i‖²/2h²)``.

    Args:
        x: ``(N, d)`` query points. x_train: ``(M, d)``. y_train: ``(M, c)`` targets.
        bandwidth: h > 0.

    Returns:
        ``(N, c)`` predictions.
    """
    from ..functional import attention

    check_number("bandwidth", bandwidth, positive=True)
    if x.dim() != 2 or x_train.dim() != 2 or y_train.dim() != 2:
        raise ValueError(
            f"x, x_train, y_train must be 2-D (N, d), (M, d), (M, c), got {tuple(x.shape)}, "
            f"{tuple(x_train.shape)}, {tuple(y_train.shape)}"
        )
    if x.shape[1] != x_train.shape[1] or x_train.shape[0] != y_train.shape[0]:
        raise ValueError(
            f"shapes do not fit: x {tuple(x.shape)}, x_train {tuple(x_train.shape)}, "
            f"y_train {tuple(y_train.shape)}"
        )
    h2 = float(bandwidth) ** 2
    bias = (-(x_train * x_train).sum(-1) / (2 * h2)).expand(x.shape[0], -1)  # (N, M)
    out = attention(x[None], x_train[None], y_train[None], scale=1.0 / h2, bias=bias[None])
    return out[0]


class Gibbs(NamedTuple):
    """Softmax as a Boltzmann distribution (`gibbs`); tensors over the leading dims."""

    probs: Tensor
    energy: Tensor
    free_energy: Tensor
    entropy: Tensor


def gibbs(logits: Tensor, temperature: float = 1.0) -> Gibbs:
    """The statistical-physics reading of ``softmax(logits / T)``.

    Energies ``E_j = −logits_j``; ``p = exp(−E/T)/Z``; ``U = Σ_j p_j E_j``; ``F = −T log Z``;
    ``S = −Σ_j p_j log p_j`` (nats). Always ``F = U − T·S``; ``T → 0`` gives the ground state
    (one-hot, S → 0), ``T → ∞`` the uniform distribution (S → log n).

    Args:
        logits: ``(..., n)``. temperature: T > 0.

    Returns:
        `Gibbs` with ``probs (..., n)`` and ``energy``, ``free_energy``, ``entropy`` ``(...)``.
    """
    t = check_number("temperature", temperature, positive=True)
    logz = torch.logsumexp(logits / t, dim=-1)
    logp = logits / t - logz.unsqueeze(-1)
    p = logp.exp()
    energy = (p * -logits).sum(-1)
    entropy = -(p * torch.where(p > 0, logp, 0.0)).sum(-1)
    return Gibbs(p, energy, -t * logz, entropy)


__all__ = [
    "Gibbs",
    "ScoreTerms",
    "bilinear_metric",
    "gibbs",
    "nadaraya_watson",
    "score_decomposition",
]
