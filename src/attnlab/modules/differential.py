"""`DifferentialAttention`: the Differential Transformer's attention (Ye et al. 2024), as DiffLlama.

Two softmax maps over the same keys and values, one subtracted from the other with a learned λ,
then a per-head RMSNorm: the definition is `functional.reference.differential_attention`; the
two maps run as two calls of `attnlab.attention` (any backend, tiled on CPU).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .._shapes import check_int, check_number
from ..functional.api import attention
from ..masks import Mask
from ..positional.rope import RoPE
from ._layer_mask import layer_mask, rotated_through_cache
from .kv_cache import KVCache


def lambda_init_of(layer: int) -> float:
    """``λ_init = 0.8 − 0.6·exp(−0.3·(l − 1))`` for the 1-based layer number ``l``."""
    return 0.8 - 0.6 * math.exp(-0.3 * (layer - 1))


class DifferentialAttention(nn.Module):
    """Differential multi-head attention with the parameter layout of transformers' DiffLlama.

    With ``H`` query heads split into two halves (heads ``h`` and ``h + H/2`` form pair ``h``)
    and the value heads into two halves concatenated along the head dim (``Dv = 2D``)::

        v_h   = [v_{g(h)} ‖ v_{g(h) + H_kv/2}]                      (B, H_kv/2, S, 2D)
        o_h   = softmax(q_h k_{g(h)}ᵀ / √D) v_h − λ · softmax(q_{h+H/2} k_{g(h)+H_kv/2}ᵀ / √D) v_h
        λ     = exp(λ_q1·λ_k1) − exp(λ_q2·λ_k2) + λ_init,  λ_init = 0.8 − 0.6·exp(−0.3·(l − 1))
        out   = W_o · concat_h (1 − λ_init) · RMSNorm(o_h)          (RMSNorm over 2D, no weight)

    q and k are rotated by RoPE (rotate-half layout) before the maps; the mask (causal by
    default) applies to both maps.

    Args:
        embed_dim: E. num_heads: H (even). num_kv_heads: H_kv (even, divides H), default H.
        head_dim: D, default ``E / H``. layer: l, the 1-based layer number (sets λ_init).
        bias: whether the projections have biases. rope_base: RoPE's θ.
        norm_eps: the head RMSNorm's epsilon. causal: AND a causal mask into every call.
        lambda_std: standard deviation of the λ vectors' initialisation.

    Example:
        >>> attn = DifferentialAttention(64, 4, num_kv_heads=2, layer=3)
        >>> attn(torch.randn(2, 10, 64)).shape
        torch.Size([2, 10, 64])
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        layer: int = 1,
        bias: bool = False,
        rope_base: float = 10000.0,
        norm_eps: float = 1e-5,
        causal: bool = True,
        lambda_std: float = 0.1,
    ) -> None:
        super().__init__()
        E = check_int("embed_dim", embed_dim, minimum=1)
        H = check_int("num_heads", num_heads, minimum=2)
        H_kv = check_int("num_kv_heads", H if num_kv_heads is None else num_kv_heads, minimum=2)
        if H % 2 or H_kv % 2 or H % H_kv:
            raise ValueError(
                "num_heads and num_kv_heads must be even (two maps) and num_kv_heads must divide "
                f"num_heads, got num_heads={H}, num_kv_heads={H_kv}"
            )
        if head_dim is None and E % H:
            raise ValueError(f"embed_dim={E} must be divisible by num_heads={H} (or give head_dim)")
        D = check_int("head_dim", E // H if head_dim is None else head_dim, minimum=2)
        self.layer = check_int("layer", layer, minimum=1)
        self.norm_eps = check_number("norm_eps", norm_eps, positive=True)
        self.embed_dim, self.num_heads, self.num_kv_heads, self.head_dim = E, H, H_kv, D
        self.causal = bool(causal)
        self.lambda_init = lambda_init_of(layer)
        self.q_proj = nn.Linear(E, H * D, bias=bias)
        self.k_proj = nn.Linear(E, H_kv * D, bias=bias)
        self.v_proj = nn.Linear(E, H_kv * D, bias=bias)
        self.o_proj = nn.Linear(H * D, E, bias=bias)
        std = check_number("lambda_std", lambda_std, positive=True)
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            setattr(self, name, nn.Parameter(torch.randn(D) * std))
        self.rope = RoPE(D, rope_base)

    def lam(self) -> Tensor:
        """λ, a 0-d float32 (float64 for float64 parameters) tensor."""
        dtype = torch.promote_types(self.lambda_q1.dtype, torch.float32)
        d1 = (self.lambda_q1.to(dtype) * self.lambda_k1.to(dtype)).sum()
        d2 = (self.lambda_q2.to(dtype) * self.lambda_k2.to(dtype)).sum()
        return torch.exp(d1) - torch.exp(d2) + self.lambda_init

    def forward(
        self,
        x: Tensor,
        *,
        positions: Tensor | int | None = None,
        mask: Mask | Tensor | None = None,
        cache: KVCache | None = None,
        need_weights: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Applies the layer.

        Args:
            x: ``(B, L, E)``.
            positions: RoPE positions (`attnlab.positional.RoPE`): None = ``0..L−1`` (with a
                cache: its next positions), an int start, or integer ``(L,)`` / ``(B, L)``.
            mask: an extra mask (True = may attend, or a `Mask`) ANDed with the causal one,
                over ``(B, H, L, S)`` where S counts the cached keys too.
            cache: a `KVCache` (or `SlidingWindowCache`, `SinkCache`): the new keys and values
                (before RoPE) are appended and the queries attend to everything cached
                (decoding token by token equals one call on the whole sequence).
            need_weights: also return both maps' weights, ``(B, H, L, S)``: heads
                ``0 … H/2 − 1`` are ``softmax(Q₁K₁ᵀ/√D)``, heads ``H/2 … H − 1``
                ``softmax(Q₂K₂ᵀ/√D)`` (`attnlab.analysis.differential_maps` splits them and
                forms ``first − λ·second``), from the same two attention calls.

        Returns:
            ``(B, L, E)``, or ``(out, weights)`` with ``need_weights=True``.
        """
        if x.dim() != 3 or x.shape[-1] != self.embed_dim:
            raise ValueError(f"x must be (B, L, embed_dim={self.embed_dim}), got {tuple(x.shape)}")
        B, L, _ = x.shape
        H, H_kv, D = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_proj(x).view(B, L, H, D).transpose(1, 2)  # (B, H, L, D)
        k = self.k_proj(x).view(B, L, H_kv, D).transpose(1, 2)  # (B, H_kv, L, D)
        v = self.v_proj(x).view(B, L, H_kv, D).transpose(1, 2)  # (B, H_kv, L, D)
        m = layer_mask(self.causal, mask)
        q, k, v, m = rotated_through_cache(
            self.rope, q, k, v, positions=positions, cache=cache, mask=m
        )
        res = self.attend(q, k, v, mask=m, need_weights=need_weights)
        o, w = res if need_weights else (res, None)  # (B, H/2, L, 2D), (B, H, L, S)
        out = self.o_proj(o.transpose(1, 2).reshape(B, L, H * D))  # (B, L, E)
        return (out, w) if need_weights else out

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        mask: Mask | Tensor | None,
        need_weights: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """The differential maps and the head norm on rotated heads (no projections).

        Equals `reference.differential_attention(q[:, :H/2], k[:, :H_kv/2], q[:, H/2:],
        k[:, H_kv/2:], [v[:, :H_kv/2] ‖ v[:, H_kv/2:]], λ, lambda_init=λ_init)`.

        Args:
            q: ``(B, H, L, D)``. k, v: ``(B, H_kv, S, D)``. mask: as `attnlab.attention`'s.
            need_weights: also return the two maps' weights as ``(B, H, L, S)`` (first maps,
                then second maps; see `forward`).

        Returns:
            ``(B, H/2, L, 2D)``, or ``(o, weights)`` with ``need_weights=True``.
        """
        h, g, D = q.shape[1] // 2, k.shape[1] // 2, q.shape[-1]
        vp = torch.cat([v[:, :g], v[:, g:]], dim=-1)  # (B, H_kv/2, S, 2D)
        kw = dict(mask=mask, scale=D**-0.5, return_weights=need_weights)
        r1 = attention(q[:, :h], k[:, :g], vp, **kw)  # (B, H/2, L, 2D) [, (B, H/2, L, S)]
        r2 = attention(q[:, h:], k[:, g:], vp, **kw)
        (o1, w1), (o2, w2) = (r1, r2) if need_weights else ((r1, None), (r2, None))
        o = o1 - self.lam().to(q.dtype) * o2  # (B, H/2, L, 2D)
        o = (1 - self.lambda_init) * nn.functional.rms_norm(o, (2 * D,), eps=self.norm_eps)
        return (o, torch.cat([w1, w2], dim=1)) if need_weights else o  # weights (B, H, L, S)

    @classmethod
    def from_hf(cls, hf_attention: nn.Module) -> DifferentialAttention:
        """The layer of a transformers ``DiffLlamaAttention`` (its config and weights).

        Args:
            hf_attention: ``model.model.layers[i].self_attn`` of a DiffLlama model.

        Returns:
            A `DifferentialAttention` on the same device and dtype, equal to it.
        """
        if not all(hasattr(hf_attention, n) for n in ("lambda_q1", "q_proj", "config")):
            raise ValueError(
                f"hf_attention must be a DiffLlamaAttention, got {type(hf_attention).__name__}"
            )
        c = hf_attention.config
        rope = getattr(c, "rope_parameters", None) or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"rope_type must be 'default', got {rope.get('rope_type')!r}")
        w = hf_attention.q_proj.weight
        out = cls(
            c.hidden_size,
            c.num_attention_heads,
            num_kv_heads=c.num_key_value_heads,
            head_dim=hf_attention.head_dim,
            layer=hf_attention.layer_idx + 1,
            bias=bool(c.attention_bias),
            rope_base=float(rope.get("rope_theta", 10000.0)),
            norm_eps=float(c.rms_norm_eps),
        ).to(device=w.device, dtype=w.dtype)
        out.load_state_dict(
            {k: v for k, v in hf_attention.state_dict().items() if "rotary" not in k}, strict=True
        )
        return out

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, layer={self.layer}, "
            f"lambda_init={self.lambda_init:.4f}, causal={self.causal}"
        )


__all__ = ["DifferentialAttention", "lambda_init_of"]
