"""`ShawRelativeAttention`: `MultiHeadAttention` with Shaw et al.'s relative key/value tables.

The tables and the math live in `attnlab.positional.shaw` (positional sits above modules in the
layering); this file only wires them into the multi-head projections.
"""

from __future__ import annotations

from torch import Tensor

from .._shapes import check_bool
from ..functional.request import BiasFn
from ..masks import Mask
from ..positional.shaw import ShawRelativePositions
from .kv_cache import KVCache
from .mha import MultiHeadAttention


class ShawRelativeAttention(MultiHeadAttention):
    """Multi-head attention with Shaw et al.'s relative key and value representations.

    ``out = W_o · concat_h shaw(x W_q^h, x W_k^{g(h)}, x W_v^{g(h)}; a^K, a^V)`` — the
    projections, GQA and parameter names of `attnlab.MultiHeadAttention` (a subclass: its
    ``state_dict`` is an MHA's plus ``relative.rel_k`` and ``relative.rel_v``). Why a module and
    not ``MultiHeadAttention(bias_fn=...)``: a function bias sees only the indices (b, h, i, j),
    but the key term ``q_i·a^K[r_ij]`` depends on q and the value term ``Σ_j α_ij a^V[r_ij]`` is
    added to the output, so neither is a bias. The relative terms replace absolute positions
    (no RoPE). No dropout, and only a plain `KVCache`: attention runs through the dense
    `shaw_attention`.

    Args:
        embed_dim: E. num_heads: H (head dim ``D = E / H``). max_distance: K.
        num_kv_heads: H_kv (GQA), default H.
        per_head_tables: False (the paper): one ``a^K``/``a^V`` pair shared by every head.
        bias: whether the projections have biases.
        bias_fn: an extra additive function bias (e.g. ALiBi), as in MultiHeadAttention.

    Example:
        >>> mha = ShawRelativeAttention(64, 4, max_distance=8)
        >>> mha(torch.randn(2, 10, 64), mask=attnlab.masks.causal()).shape
        torch.Size([2, 10, 64])
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        max_distance: int,
        *,
        num_kv_heads: int | None = None,
        per_head_tables: bool = False,
        bias: bool = True,
        bias_fn: BiasFn | None = None,
    ) -> None:
        check_bool("per_head_tables", per_head_tables)
        super().__init__(
            embed_dim, num_heads, num_kv_heads=num_kv_heads, bias=bias, bias_fn=bias_fn
        )
        self.relative = ShawRelativePositions(
            max_distance, self.head_dim, num_heads=self.num_heads if per_head_tables else None
        )

    def forward(  # type: ignore[override]
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        *,
        mask: Mask | Tensor | None = None,
        cache: KVCache | None = None,
        need_weights: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Attends from ``query (B, L, E)`` to ``key``/``value`` (self-attention if key is None).

        Args:
            query: ``(B, L, E)``. key, value: ``(B, S, E)``.
            mask: `Mask`, bool (True = may attend) or additive float, broadcastable to
                ``(B, H, L, S)``; bottom-right aligned (also for the relative distances).
            cache: a plain `KVCache` (self-attention): the new keys/values are appended and the
                queries attend to everything cached. The cache holds positions 0…S−1 in order,
                so bottom-right alignment gives the true distances. Evicting caches
                (`SlidingWindowCache`, `SinkCache`) raise TypeError: their keys are not
                consecutive positions.
            need_weights: also return the weights ``(B, H, L, S)``.

        Returns:
            ``(B, L, E)``, or ``(out, weights)``.
        """
        self._check(query, key, value)
        if cache is not None:
            if type(cache) is not KVCache:
                raise TypeError(
                    f"cache must be a plain KVCache (consecutive key positions), got "
                    f"{type(cache).__name__}"
                )
            if key is not None:
                raise ValueError("cache is for self-attention: call with key=None")
        q, k, v = self.project(query, key, value)  # (B, H, L, D), (B, H_kv, S, D) x2
        B, _, L, _ = q.shape
        if cache is not None:
            view = cache.update(k, v)  # keys 0…S−1, the new queries are the last L
            k, v = view.k, view.v  # (B, H_kv, S, D)
        result = self.relative(q, k, v, mask=mask, bias=self.bias_fn, return_weights=need_weights)
        out, weights = result if need_weights else (result, None)
        out = out.transpose(1, 2).reshape(B, L, self.num_heads * self.head_dim)  # (B, L, H D)
        out = self.out_proj(out)  # (B, L, E)
        return (out, weights) if need_weights else out

    def prune_heads(self, heads: object) -> None:
        """Refused (ValueError): the relative tables and the projections would have to be pruned
        together, which this module does not do; prune a plain `MultiHeadAttention`."""
        raise ValueError(
            "prune_heads: ShawRelativeAttention's relative tables would have to be pruned with the "
            f"projections, which it does not do (heads {heads!r} left in place)"
        )
