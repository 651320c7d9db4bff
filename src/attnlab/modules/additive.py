"""Additive (Bahdanau) attention as an `nn.Module`."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .._shapes import Dims, check_bool, check_int, check_mask_tensor, check_probability
from ..functional import reference
from ..functional.request import BiasFn, dense_mask_and_bias
from ..masks import Mask


class AdditiveAttention(nn.Module):
    """Bahdanau attention: ``e_ij = vᵀ tanh(W_q q_i + W_k k_j + b)``, ``out = softmax(e) V``.

    Computes exactly `attnlab.functional.reference.additive_attention`. Masks follow the library's
    conventions (True = may attend, bottom-right alignment, zeros for fully masked rows).

    Args:
        query_dim: Dq, size of each query vector.
        key_dim: Dk, size of each key vector.
        hidden_dim: Hd, size of the tanh layer.
        dropout: dropout on the weights in training mode.
        bias: learn the bias ``b`` inside the tanh (default). ``bias=False`` is the textbooks'
            ``vᵀ tanh(W_q q + W_k k)`` with ``Hd·Dq + Hd·Dk + Hd`` parameters (``2d² + d`` for
            Dq = Dk = Hd = d); with the bias there are ``Hd`` more.

    Example:
        >>> attn = AdditiveAttention(query_dim=16, key_dim=32, hidden_dim=24)
        >>> out, w = attn(torch.randn(2, 5, 16), torch.randn(2, 7, 32))
        >>> out.shape, w.shape
        (torch.Size([2, 5, 32]), torch.Size([2, 5, 7]))
    """

    def __init__(
        self,
        query_dim: int,
        key_dim: int,
        hidden_dim: int,
        dropout: float = 0.0,
        *,
        bias: bool = True,
    ) -> None:
        super().__init__()
        check_bool("bias", bias)
        for name, value in (
            ("query_dim", query_dim),
            ("key_dim", key_dim),
            ("hidden_dim", hidden_dim),
        ):
            check_int(name, value, minimum=1)
        self.dropout = check_probability("dropout", dropout)
        self.query_proj = nn.Linear(query_dim, hidden_dim, bias=False)
        self.key_proj = nn.Linear(key_dim, hidden_dim, bias=bias)
        self.v = nn.Parameter(torch.empty(hidden_dim))
        nn.init.uniform_(self.v, -1.0 / math.sqrt(hidden_dim), 1.0 / math.sqrt(hidden_dim))

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor | None = None,
        *,
        mask: Mask | Tensor | None = None,
        bias: Tensor | BiasFn | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Attends from each query to the keys.

        Args:
            query: ``(B, L, Dq)``, or ``(B, Dq)`` for one query per batch item.
            key: ``(B, S, Dk)``.
            value: ``(B, S, Dv)``; defaults to ``key``.
            mask: `Mask`, bool (True = may attend) or additive float, broadcastable to (B, L, S).
            bias: additive float broadcastable to ``(B, L, S)`` or ``fn(b, h, i, j)``.

        Returns:
            ``(out (B, L, Dv), weights (B, L, S))``; ``(B, Dv)`` and ``(B, S)`` for 2-D queries.
        """
        value = key if value is None else value
        single = isinstance(query, Tensor) and query.dim() == 2
        if single:
            query = query.unsqueeze(1)  # (B, 1, Dq)
        dims = self._check(query, key, value)
        if isinstance(mask, Tensor):
            check_mask_tensor("mask", mask, query.dtype, dims)
        if isinstance(bias, Tensor):
            check_mask_tensor("bias", bias, query.dtype, dims)
        m4 = mask.unsqueeze(-3) if isinstance(mask, Tensor) and mask.dim() == 3 else mask
        b4 = bias.unsqueeze(-3) if isinstance(bias, Tensor) and bias.dim() == 3 else bias
        allowed, additive = dense_mask_and_bias(m4, b4, dims, query.dtype, query.device)
        out, weights = reference.additive_attention(
            query,
            key,
            value,
            w_q=self.query_proj.weight,
            w_k=self.key_proj.weight,
            b_k=self.key_proj.bias,
            w_v=self.v,
            mask=None if allowed is None else allowed.squeeze(1) if allowed.dim() == 4 else allowed,
            bias=None
            if additive is None
            else additive.squeeze(1)
            if additive.dim() == 4
            else additive,
            dropout_p=self.dropout if self.training else 0.0,
        )
        if single:
            return out.squeeze(1), weights.squeeze(1)  # (B, Dv), (B, S)
        return out, weights

    def _check(self, query: Tensor, key: Tensor, value: Tensor) -> Dims:
        for name, t in (("query", query), ("key", key), ("value", value)):
            if not isinstance(t, Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 3:
                raise ValueError(f"{name} must be (B, L|S, dim), got shape {tuple(t.shape)}")
        if not (query.dtype == key.dtype == value.dtype) or not query.is_floating_point():
            raise TypeError(
                f"query, key and value must share one float dtype, got {query.dtype}, {key.dtype}, "
                f"{value.dtype}"
            )
        dq, dk = self.query_proj.in_features, self.key_proj.in_features
        if query.shape[-1] != dq:
            raise ValueError(
                f"query last dim must be query_dim={dq}, got shape {tuple(query.shape)}"
            )
        if key.shape[-1] != dk:
            raise ValueError(f"key last dim must be key_dim={dk}, got shape {tuple(key.shape)}")
        if not (query.shape[0] == key.shape[0] == value.shape[0]) or key.shape[1] != value.shape[1]:
            raise ValueError(
                f"batch or length mismatch: query {tuple(query.shape)}, key {tuple(key.shape)}, "
                f"value {tuple(value.shape)}"
            )
        B, L, _ = query.shape
        S, Dv = key.shape[1], value.shape[-1]
        return Dims(B=B, H=1, H_kv=1, L=L, S=S, D=dq, Dv=Dv, three_d=True)
