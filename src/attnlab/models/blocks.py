"""Transformer building blocks: norms, MLPs and the pre-/post-LN `TransformerBlock`.

Norms and MLPs are registries (name -> constructor), so a new variant is one entry, not a flag:

    NORMS["layernorm"]  LayerNorm: (x − mean) / sqrt(var + ε) · w + b
    NORMS["rmsnorm"]    RMSNorm:   x / sqrt(mean(x²) + ε) · w
    MLPS["gelu"]        W2 · gelu(W1 x)                 (GPT-2, BERT)
    MLPS["swiglu"]      W_d · (silu(W_g x) ⊙ W_u x)    (PaLM, Llama)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from ..functional.request import BiasFn
from ..masks import Mask
from ..modules import KVCache, MultiHeadAttention
from ..positional import ALiBi, LearnedPositionalEmbedding, RoPE, SinusoidalEmbedding
from .config import TransformerConfig


class RMSNorm(nn.Module):
    """Root-mean-square norm: ``y = x / sqrt(mean(x², -1) + ε) · w`` (statistics in float32+).

    Args:
        dim: E, the normalised (last) dimension.
        eps: ε.
        bias: unused (RMSNorm has no bias); accepted so every norm has one signature.
    """

    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        """``(..., E) -> (..., E)``."""
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)  # (..., E)
        return y.to(x.dtype) * self.weight

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def _layernorm(dim: int, eps: float = 1e-5, bias: bool = True) -> nn.Module:
    return nn.LayerNorm(dim, eps=eps, bias=bias)


NORMS: dict[str, Callable[..., nn.Module]] = {"layernorm": _layernorm, "rmsnorm": RMSNorm}


def make_norm(config: TransformerConfig) -> nn.Module:
    """The norm named by ``config.norm`` over ``d_model``."""
    return NORMS[config.norm](config.d_model, eps=config.norm_eps, bias=config.bias)


class GeluMLP(nn.Module):
    """``y = W2 · gelu(W1 x + b1) + b2`` with the exact (erf) GELU; width E -> F -> E."""

    def __init__(self, d_model: int, d_ff: int, bias: bool = True) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_model, d_ff, bias=bias)
        self.fc2 = nn.Linear(d_ff, d_model, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        """``(B, L, E) -> (B, L, E)``."""
        return self.fc2(nn.functional.gelu(self.fc1(x)))  # (B, L, F) -> (B, L, E)


class SwiGLU(nn.Module):
    """``y = W_d · (silu(W_g x) ⊙ W_u x)`` (Shazeer, 2020); width E -> F -> E."""

    def __init__(self, d_model: int, d_ff: int, bias: bool = True) -> None:
        super().__init__()
        self.gate = nn.Linear(d_model, d_ff, bias=bias)
        self.up = nn.Linear(d_model, d_ff, bias=bias)
        self.down = nn.Linear(d_ff, d_model, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        """``(B, L, E) -> (B, L, E)``."""
        return self.down(nn.functional.silu(self.gate(x)) * self.up(x))  # (B, L, F) -> (B, L, E)


MLPS: dict[str, Callable[..., nn.Module]] = {"gelu": GeluMLP, "swiglu": SwiGLU}


class TransformerBlock(nn.Module):
    """One Transformer layer: attention then MLP, each a residual branch.

    Pre-LN (``config.prenorm``, GPT-2 and later)::

        h = x + drop(attn(norm1(x)));   y = h + drop(mlp(norm2(h)))

    Post-LN (the original Transformer, BERT)::

        h = norm1(x + drop(attn(x)));   y = norm2(h + drop(mlp(h)))

    Args:
        config: sizes and choices (norm, MLP, heads, dropout, bias).
        rope: a shared `attnlab.positional.RoPE` for the attention, or None.
        bias_fn: an additive score bias such as `attnlab.positional.ALiBi`, or None.
    """

    def __init__(
        self,
        config: TransformerConfig,
        *,
        rope: nn.Module | None = None,
        bias_fn: BiasFn | None = None,
    ) -> None:
        super().__init__()
        self.prenorm = config.prenorm
        self.norm1 = make_norm(config)
        self.attn = MultiHeadAttention(
            config.d_model,
            config.n_heads,
            num_kv_heads=config.n_kv_heads,
            dropout=config.dropout,
            bias=config.bias,
            rope=rope,
            bias_fn=bias_fn,
        )
        self.norm2 = make_norm(config)
        self.mlp = MLPS[config.mlp](config.d_model, config.ff_dim, bias=config.bias)
        self.drop = nn.Dropout(config.dropout)

    def forward(
        self,
        x: Tensor,
        *,
        mask: Mask | Tensor | None = None,
        cache: KVCache | None = None,
    ) -> Tensor:
        """``(B, L, E) -> (B, L, E)``.

        Args:
            x: the residual stream ``(B, L, E)``.
            mask: attention mask (True = may attend), broadcastable to ``(B, H, L, S)``.
            cache: this layer's `KVCache` when decoding incrementally.
        """
        if self.prenorm:
            x = x + self.drop(self.attn(self.norm1(x), mask=mask, cache=cache))
            return x + self.drop(self.mlp(self.norm2(x)))
        x = self.norm1(x + self.drop(self.attn(x, mask=mask, cache=cache)))
        return self.norm2(x + self.drop(self.mlp(x)))


def positional_parts(
    config: TransformerConfig, *, causal: bool
) -> tuple[nn.Module | None, nn.Module | None, BiasFn | None]:
    """``(added, rope, bias_fn)`` for ``config.positional``; the unused two are None.

    ``added`` is a module mapping positions ``(L,)`` to ``(L, E)`` vectors that are added to the
    token embeddings ("learned", "sinusoidal"); ``rope`` rotates q and k inside every attention
    ("rope"); ``bias_fn`` is ALiBi, ``−slope·(i − j)`` when causal, ``−slope·|i − j|`` otherwise.
    """
    kind = config.positional
    if kind == "learned":
        return LearnedPositionalEmbedding(config.max_seq_len, config.d_model), None, None
    if kind == "sinusoidal":
        return SinusoidalEmbedding(config.d_model), None, None
    if kind == "rope":
        return None, RoPE(config.head_dim, config.rope_base, config.rope_scaling), None
    if kind == "alibi":
        return None, None, ALiBi(config.n_heads, causal=causal)
    return None, None, None
