"""`GatedAttention`: attention with a sigmoid output gate, as Qwen3-Next's full-attention layers.

The definition is `functional.reference.gated_attention`: ``softmax(q·kᵀ/√D) v ⊙ sigmoid(gate)``
with the gate projected from the layer input together with the queries; the attention runs as one
call of `attnlab.attention` (any backend, tiled on CPU).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .._shapes import check_int, check_number
from ..functional.api import attention
from ..masks import Mask
from ..positional.rope import RoPE
from ._layer_mask import layer_mask, rotated_through_cache
from .kv_cache import KVCache


class OffsetRMSNorm(nn.Module):
    """``x / √(mean(x²) + eps) · (1 + w)`` over the last dim, computed in float32 or wider.

    The zero-centred weight of Qwen3-Next's RMSNorm (``w`` starts at 0, the identity scale);
    the product is taken before rounding back to x's dtype.

    Args:
        dim: the normalised (last) dimension. eps: added to the mean square.
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = check_number("eps", eps, positive=True)
        self.weight = nn.Parameter(torch.zeros(check_int("dim", dim, minimum=1)))

    def forward(self, x: Tensor) -> Tensor:
        """``(..., dim)`` → ``(..., dim)``, same dtype."""
        dtype = torch.promote_types(x.dtype, torch.float32)
        y = x.to(dtype)
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.to(dtype))).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class GatedAttention(nn.Module):
    """Multi-head attention with a per-head, per-channel sigmoid output gate (Qwen3-Next).

    The query projection gives each head its query and its gate logits (interleaved per head, as
    Qwen3-Next's ``q_proj``); q and k are RMS-normalised per head, rotated by partial RoPE, and::

        [q_h ‖ g_h] = x W_q^h                                      (B, L, 2D) per head
        o_h = softmax(rope(norm(q_h)) rope(norm(k_{g(h)}))ᵀ / √D) v_{g(h)} ⊙ sigmoid(g_h)
        out = W_o · concat_h o_h

    Args:
        embed_dim: E. num_heads: H. num_kv_heads: H_kv (divides H), default H.
        head_dim: D, default ``E / H``. bias: whether the projections have biases.
        rope_base: RoPE's θ. rotary_dim: rotate only the first dims (partial RoPE; even),
            default D. norm_eps: the q/k RMSNorm epsilon. causal: AND a causal mask.

    Example:
        >>> attn = GatedAttention(64, 4, num_kv_heads=2, rotary_dim=4)
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
        bias: bool = False,
        rope_base: float = 10000.0,
        rotary_dim: int | None = None,
        norm_eps: float = 1e-6,
        causal: bool = True,
    ) -> None:
        super().__init__()
        E = check_int("embed_dim", embed_dim, minimum=1)
        H = check_int("num_heads", num_heads, minimum=1)
        H_kv = check_int("num_kv_heads", H if num_kv_heads is None else num_kv_heads, minimum=1)
        if H % H_kv:
            raise ValueError(f"num_kv_heads={H_kv} must divide num_heads={H}")
        if head_dim is None and E % H:
            raise ValueError(f"embed_dim={E} must be divisible by num_heads={H} (or give head_dim)")
        D = check_int("head_dim", E // H if head_dim is None else head_dim, minimum=1)
        self.embed_dim, self.num_heads, self.num_kv_heads, self.head_dim = E, H, H_kv, D
        self.causal = bool(causal)
        self.q_proj = nn.Linear(E, H * D * 2, bias=bias)
        self.k_proj = nn.Linear(E, H_kv * D, bias=bias)
        self.v_proj = nn.Linear(E, H_kv * D, bias=bias)
        self.o_proj = nn.Linear(H * D, E, bias=bias)
        self.q_norm = OffsetRMSNorm(D, norm_eps)
        self.k_norm = OffsetRMSNorm(D, norm_eps)
        self.rope = RoPE(D, rope_base, rotary_dim=rotary_dim)

    def forward(
        self,
        x: Tensor,
        *,
        positions: Tensor | int | None = None,
        mask: Mask | Tensor | None = None,
        cache: KVCache | None = None,
    ) -> Tensor:
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

        Returns:
            ``(B, L, E)``.
        """
        if x.dim() != 3 or x.shape[-1] != self.embed_dim:
            raise ValueError(f"x must be (B, L, embed_dim={self.embed_dim}), got {tuple(x.shape)}")
        B, L, _ = x.shape
        H, H_kv, D = self.num_heads, self.num_kv_heads, self.head_dim
        q, gate = self.q_proj(x).view(B, L, H, 2 * D).chunk(2, dim=-1)  # (B, L, H, D) each
        q = self.q_norm(q).transpose(1, 2)  # (B, H, L, D)
        k = self.k_norm(self.k_proj(x).view(B, L, H_kv, D)).transpose(1, 2)  # (B, H_kv, L, D)
        v = self.v_proj(x).view(B, L, H_kv, D).transpose(1, 2)  # (B, H_kv, L, D)
        m = layer_mask(self.causal, mask)
        q, k, v, m = rotated_through_cache(
            self.rope, q, k, v, positions=positions, cache=cache, mask=m
        )
        o = self.attend(q, k, v, gate.transpose(1, 2), mask=m)  # (B, H, L, D)
        return self.o_proj(o.transpose(1, 2).reshape(B, L, H * D))  # (B, L, E)

    @staticmethod
    def attend(
        q: Tensor, k: Tensor, v: Tensor, gate: Tensor, *, mask: Mask | Tensor | None
    ) -> Tensor:
        """``attention(q, k, v) ⊙ sigmoid(gate)`` (`reference.gated_attention`).

        Args:
            q: ``(B, H, L, D)``. k: ``(B, H_kv, S, D)``. v: ``(B, H_kv, S, Dv)``.
            gate: logits broadcastable to ``(B, H, L, Dv)``. mask: as `attnlab.attention`'s.

        Returns:
            ``(B, H, L, Dv)``.
        """
        return attention(q, k, v, mask=mask, scale=q.shape[-1] ** -0.5) * torch.sigmoid(gate)

    @classmethod
    def from_hf(cls, hf_attention: nn.Module) -> GatedAttention:
        """The layer of a transformers ``Qwen3NextAttention`` (a full-attention layer).

        Args:
            hf_attention: ``model.model.layers[i].self_attn`` of a Qwen3-Next model whose
                ``config.layer_types[i]`` is ``"full_attention"``.

        Returns:
            A `GatedAttention` on the same device and dtype, equal to it.
        """
        if not all(hasattr(hf_attention, n) for n in ("q_norm", "k_norm", "q_proj", "config")):
            raise ValueError(
                "hf_attention must be a Qwen3NextAttention (a full-attention layer), got "
                f"{type(hf_attention).__name__}"
            )
        c = hf_attention.config
        rope = getattr(c, "rope_parameters", None) or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"rope_type must be 'default', got {rope.get('rope_type')!r}")
        D = hf_attention.head_dim
        w = hf_attention.q_proj.weight
        out = cls(
            c.hidden_size,
            c.num_attention_heads,
            num_kv_heads=c.num_key_value_heads,
            head_dim=D,
            bias=bool(c.attention_bias),
            rope_base=float(rope.get("rope_theta", 10000.0)),
            rotary_dim=int(D * rope.get("partial_rotary_factor", 1.0)),
            norm_eps=float(c.rms_norm_eps),
        ).to(device=w.device, dtype=w.dtype)
        out.load_state_dict(hf_attention.state_dict(), strict=True)
        return out

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, causal={self.causal}"
        )


__all__ = ["GatedAttention", "OffsetRMSNorm"]
