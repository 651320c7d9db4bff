"""Self-attention layers whose range depends on the content: exact top-k and block routing.

`TopKAttention` runs `functional.topk.topk_attention` (each row keeps its ``k_top`` largest
logits), `RoutedAttention` runs `functional.routing.routing_attention` (each query cell attends
its own and its best-scoring key blocks, MoBA / NSA): projections around the functional math,
no new math.
"""

from __future__ import annotations

from torch import Tensor, nn

from .._shapes import check_bool, check_int
from ..functional.routing import check_blocks, routing_attention
from ..functional.topk import topk_attention
from ..masks import Mask
from ._layer_mask import layer_mask


class _Projected(nn.Module):
    """q, k, v and output projections with grouped key/value heads."""

    def __init__(
        self, embed_dim: int, num_heads: int, num_kv_heads: int | None, bias: bool, causal: bool
    ) -> None:
        super().__init__()
        E = check_int("embed_dim", embed_dim, minimum=1)
        H = check_int("num_heads", num_heads, minimum=1)
        H_kv = check_int("num_kv_heads", H if num_kv_heads is None else num_kv_heads, minimum=1)
        if H % H_kv:
            raise ValueError(f"num_kv_heads={H_kv} must divide num_heads={H}")
        if E % H:
            raise ValueError(f"embed_dim={E} must be divisible by num_heads={H}")
        D = E // H
        self.embed_dim, self.num_heads, self.num_kv_heads, self.head_dim = E, H, H_kv, D
        self.causal = check_bool("causal", causal)
        self.q_proj = nn.Linear(E, H * D, bias=bias)
        self.k_proj = nn.Linear(E, H_kv * D, bias=bias)
        self.v_proj = nn.Linear(E, H_kv * D, bias=bias)
        self.o_proj = nn.Linear(H * D, E, bias=bias)

    def _heads(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        if x.dim() != 3 or x.shape[-1] != self.embed_dim:
            raise ValueError(f"x must be (B, L, embed_dim={self.embed_dim}), got {tuple(x.shape)}")
        B, L, _ = x.shape
        H, H_kv, D = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_proj(x).view(B, L, H, D).transpose(1, 2)  # (B, H, L, D)
        k = self.k_proj(x).view(B, L, H_kv, D).transpose(1, 2)  # (B, H_kv, L, D)
        v = self.v_proj(x).view(B, L, H_kv, D).transpose(1, 2)  # (B, H_kv, L, D)
        return q, k, v

    def _out(self, o: Tensor) -> Tensor:
        B, H, L, D = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(B, L, H * D))  # (B, L, E)


class TopKAttention(_Projected):
    """Multi-head self-attention where each query keeps its ``k_top`` largest logits.

    ``o_h = softmax_{T_i}(q_h k_{g(h)}ᵀ / √D) v_{g(h)}``, ``T_i`` row i's ``k_top`` largest allowed
    logits (`functional.topk.topk_attention`); ``out = W_o · concat_h o_h``.

    Args:
        embed_dim: E. num_heads: H. k_top: keys kept per query (>= 1).
        num_kv_heads: H_kv (divides H), default H. bias: projection biases.
        causal: AND a causal mask.

    Example:
        >>> attn = TopKAttention(32, 4, k_top=8)
        >>> attn(torch.randn(2, 50, 32)).shape
        torch.Size([2, 50, 32])
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        k_top: int,
        num_kv_heads: int | None = None,
        bias: bool = False,
        causal: bool = True,
    ) -> None:
        super().__init__(embed_dim, num_heads, num_kv_heads, bias, causal)
        self.k_top = check_int("k_top", k_top, minimum=1)

    def forward(self, x: Tensor, *, mask: Mask | Tensor | None = None) -> Tensor:
        """``(B, L, E)`` → ``(B, L, E)``; ``mask`` (True = may attend, or a `Mask`) is ANDed
        with the causal one."""
        q, k, v = self._heads(x)
        o = topk_attention(q, k, v, k_top=self.k_top, mask=layer_mask(self.causal, mask))
        return self._out(o)

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
            f"num_kv_heads={self.num_kv_heads}, k_top={self.k_top}, causal={self.causal}"
        )


class RoutedAttention(_Projected):
    """Multi-head self-attention routed to key blocks (MoBA, Lu et al. 2025; NSA's selection).

    Each query cell (``query_block`` rows) attends its own block of ``block`` keys and the
    ``k_blocks − 1`` blocks whose mean key best matches its mean query
    (`functional.routing.routing_attention`, on the flash backend); ``out = W_o · concat_h o_h``.

    Args:
        embed_dim: E. num_heads: H. block: keys per block. k_blocks: blocks per cell.
        query_block: rows per cell (divides ``block``), default ``block``; 1 = MoBA's
            per-token gate.
        num_kv_heads: H_kv (divides H), default H. bias: projection biases.
        causal: causal attention with past-only routing.

    Example:
        >>> attn = RoutedAttention(32, 4, block=16, k_blocks=2)
        >>> attn(torch.randn(2, 50, 32)).shape
        torch.Size([2, 50, 32])
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        block: int = 64,
        k_blocks: int = 4,
        query_block: int | None = None,
        num_kv_heads: int | None = None,
        bias: bool = False,
        causal: bool = True,
    ) -> None:
        super().__init__(embed_dim, num_heads, num_kv_heads, bias, causal)
        self.query_block = check_blocks(block, k_blocks, query_block)
        self.block, self.k_blocks = block, k_blocks

    def forward(self, x: Tensor, *, mask: Mask | Tensor | None = None) -> Tensor:
        """``(B, L, E)`` → ``(B, L, E)``; ``mask`` (True = may attend, or a `Mask`) is ANDed
        with the routed one."""
        q, k, v = self._heads(x)
        o = routing_attention(
            q,
            k,
            v,
            block=self.block,
            k_blocks=self.k_blocks,
            query_block=self.query_block,
            causal=self.causal,
            mask=mask,
        )
        return self._out(o)  # type: ignore[arg-type]

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
            f"num_kv_heads={self.num_kv_heads}, block={self.block}, k_blocks={self.k_blocks}, "
            f"query_block={self.query_block}, causal={self.causal}"
        )


__all__ = ["RoutedAttention", "TopKAttention"]
