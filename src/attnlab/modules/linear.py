"""Linear attention and Performer (FAVOR+) as `nn.Module`s: state around the functional math.

Both work on heads ``(B, H, L, D)`` (like `attnlab.attention`), so they can stand in for the
softmax core of a multi-head block; no projections, no new math.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .._shapes import check_bool, check_int, check_number
from ..functional.linear import (
    DEFAULT_CHUNK_SIZE,
    FeatureMap,
    LinearAttentionState,
    check_feature_map,
    linear_attention,
)
from ..functional.performer import favor_attention, favor_projection
from ..masks import Mask

__all__ = ["LinearAttention", "PerformerAttention"]


class LinearAttention(nn.Module):
    """Linear attention ``φ(Q) (φ(K)ᵀ V) / (φ(Q) φ(K)ᵀ 1 + eps)`` as a module (no parameters).

    Computes exactly `attnlab.functional.linear.linear_attention`; `new_state` gives the
    recurrent form for decoding one token at a time.

    Args:
        feature_map: ``"elu"`` (elu + 1), ``"relu"`` or a callable ``(..., D) -> (..., F)``.
        eps: added to each denominator.
        chunk_size: tokens per chunk of the causal form (speed only).

    Example:
        >>> attn = LinearAttention()
        >>> q = k = v = torch.randn(2, 4, 4096, 64)
        >>> attn(q, k, v, mask=masks.causal()).shape
        torch.Size([2, 4, 4096, 64])
    """

    def __init__(
        self,
        feature_map: str | FeatureMap = "elu",
        *,
        eps: float = 1e-6,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
    ) -> None:
        super().__init__()
        check_feature_map(feature_map)
        self.feature_map = feature_map
        self.eps = check_number("eps", eps, at_least=0)
        self.chunk_size = check_int("chunk_size", chunk_size, minimum=1)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, mask: Mask | None = None) -> Tensor:
        """q ``(B, H, L, D)``, k ``(B, H_kv, S, D)``, v ``(B, H_kv, S, Dv)`` → ``(B, H, L, Dv)``.

        mask: ``masks.causal()``, ``masks.padding(lengths)``, their ``&`` or None.
        """
        return linear_attention(
            q,
            k,
            v,
            feature_map=self.feature_map,
            mask=mask,
            eps=self.eps,
            chunk_size=self.chunk_size,
        )

    def new_state(self) -> LinearAttentionState:
        """An empty recurrent state with this module's feature map and eps."""
        return LinearAttentionState(self.feature_map, self.eps)

    def extra_repr(self) -> str:
        fm = self.feature_map if isinstance(self.feature_map, str) else "callable"
        return f"feature_map={fm!r}, eps={self.eps}"


class PerformerAttention(nn.Module):
    """Performer FAVOR+ attention with a fixed set of random features, redrawn on demand.

    Holds the projection W ``(M, D)`` as a buffer (saved in the state dict, moved by ``.to``)
    and computes `attnlab.functional.performer.favor_attention` with it; the output
    approximates ``softmax(Q Kᵀ / √D) V``, with an error that falls like 1/√M.

    Args:
        head_dim: D.
        num_features: M >= 1 random features.
        orthogonal: orthogonal random feature blocks.
        seed: seed of the draws (the initial one and every `redraw_features` without a
            generator continue one seeded stream); None uses torch's global RNG.

    Example:
        >>> attn = PerformerAttention(head_dim=64, num_features=256, seed=0)
        >>> q = k = v = torch.randn(1, 8, 2048, 64)
        >>> out = attn(q, k, v)  # (1, 8, 2048, 64)
        >>> attn.redraw_features()  # e.g. every few hundred training steps
    """

    projection: Tensor

    def __init__(
        self,
        head_dim: int,
        num_features: int = 256,
        *,
        orthogonal: bool = True,
        seed: int | None = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
    ) -> None:
        super().__init__()
        self.head_dim = check_int("head_dim", head_dim, minimum=1)
        self.num_features = check_int("num_features", num_features, minimum=1)
        self.orthogonal = check_bool("orthogonal", orthogonal)
        self.chunk_size = check_int("chunk_size", chunk_size, minimum=1)
        if seed is not None:
            check_int("seed", seed)
        self._generator = None if seed is None else torch.Generator().manual_seed(seed)
        self.register_buffer(
            "projection",
            favor_projection(
                num_features, head_dim, orthogonal=orthogonal, generator=self._generator
            ),
        )

    @torch.no_grad()
    def redraw_features(self, generator: torch.Generator | None = None) -> None:
        """Draws a new projection in place (same shape, dtype and device)."""
        w = favor_projection(
            self.num_features,
            self.head_dim,
            orthogonal=self.orthogonal,
            generator=generator if generator is not None else self._generator,
            dtype=self.projection.dtype,
            device=self.projection.device,
        )
        self.projection.copy_(w)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, mask: Mask | None = None) -> Tensor:
        """q ``(B, H, L, D)``, k ``(B, H_kv, S, D)``, v ``(B, H_kv, S, Dv)`` → ``(B, H, L, Dv)``.

        mask: ``masks.causal()``, ``masks.padding(lengths)``, their ``&`` or None.
        """
        return favor_attention(
            q,
            k,
            v,
            num_features=self.num_features,
            mask=mask,
            projection=self.projection,
            chunk_size=self.chunk_size,
        )

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, num_features={self.num_features}, "
            f"orthogonal={self.orthogonal}"
        )
