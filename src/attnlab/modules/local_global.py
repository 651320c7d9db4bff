"""`LocalGlobalAttention`: multi-head attention whose first heads attend within a window and
whose other heads attend globally, outputs concatenated over heads, then ``W_o``.

The text's ``HierarchicalAttention(Q, K, V) = Concat(LocalAttention(Q, K, V),
GlobalAttention(Q, K, V))`` (seed 003 §4.3) as a layer; its math is
`attnlab.functional.local_global.local_global_attention` (defined by
`attnlab.functional.reference.local_global_attention`). The block-summary scheme of seed 002
§8.4.4 (local attention, then global attention over n/k block summaries) is
`attnlab.modules.HierarchicalAttention`.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import Tensor, nn

from .._shapes import check_bool, check_int
from ..functional.local_global import local_global_attention, split_heads
from ..masks import Mask
from .mha import MultiHeadAttention


class LocalGlobalAttention(MultiHeadAttention):
    """``out = W_o · concat(o_0 … o_{H_l − 1}, o_{H_l} … o_{H − 1})``: H_l local heads, the
    rest global.

    Every head is a `MultiHeadAttention` head (projections, GQA, RoPE, `KVCache`); query head
    h < H_l keeps only keys in its window ``0 <= p − j < W`` (``causal_window``) or
    ``|p − j| < W``, on top of the caller's mask M; the other heads keep M::

        o_h = softmax(q_h k_g(h)ᵀ / √D, masked by band ∧ M) v_g(h)    h <  H_l  (local)
        o_h = softmax(q_h k_g(h)ᵀ / √D, masked by M)        v_g(h)    h >= H_l  (global)

    With a cache the local heads still see W keys at every decode step (the cache keeps every
    key for the global heads).

    Args:
        embed_dim: E. num_heads: H. window: W >= 1.
        local_heads: H_l, a multiple of ``H / H_kv`` in ``[0, H]``; default the largest such
            multiple <= H / 2.
        causal_window: the local band looks back only (``p − W < j <= p``, a decoder's) or both
            ways (``|p − j| < W``, an encoder's).
        num_kv_heads, dropout, bias, kdim, vdim, rope, backend: as `MultiHeadAttention`
            (no ``bias_fn`` or ``sinks``: their heads would not line up with the split).

    Example:
        >>> attn = LocalGlobalAttention(64, 4, window=8)
        >>> y = attn(torch.randn(2, 20, 64), mask=masks.causal())   # (2, 20, 64)
    """

    unmasked_fast_path = False  # the local heads always need their band

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        window: int,
        local_heads: int | None = None,
        causal_window: bool = True,
        num_kv_heads: int | None = None,
        dropout: float = 0.0,
        bias: bool = True,
        kdim: int | None = None,
        vdim: int | None = None,
        rope: nn.Module | None = None,
        backend: str = "auto",
    ) -> None:
        super().__init__(
            embed_dim,
            num_heads,
            num_kv_heads=num_kv_heads,
            dropout=dropout,
            bias=bias,
            kdim=kdim,
            vdim=vdim,
            rope=rope,
            backend=backend,
        )
        H, H_kv = self.num_heads, self.num_kv_heads
        G = H // H_kv
        default = (H // 2) // G * G
        self.local_heads = split_heads(default if local_heads is None else local_heads, H, H_kv)
        self.window = check_int("window", window, minimum=1)
        self.causal_window = check_bool("causal_window", causal_window)

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Mask | Tensor | None,
        dropout_p: float,
        need_weights: bool,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """`local_global_attention` of rotated q ``(B, H, L, D)``, k/v ``(B, H_kv, S, ·)``."""
        return local_global_attention(
            q,
            k,
            v,
            local_heads=self.local_heads,
            window=self.window,
            mask=mask,
            causal_window=self.causal_window,
            dropout_p=dropout_p,
            backend=self.backend,
            return_weights=need_weights,
        )

    def prune_heads(self, heads: Iterable[int]) -> None:
        """`MultiHeadAttention.prune_heads`, keeping the split: the pruned local heads leave
        ``local_heads`` (the remaining heads keep their kind and their outputs)."""
        heads = [int(h) for h in heads]
        local_left = self.local_heads - len({h for h in heads if 0 <= h < self.local_heads})
        super().prune_heads(heads)
        self.local_heads = split_heads(local_left, self.num_heads, self.num_kv_heads)

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
            f"num_kv_heads={self.num_kv_heads}, local_heads={self.local_heads}, "
            f"window={self.window}, causal_window={self.causal_window}"
        )


__all__ = ["LocalGlobalAttention"]
