"""Transformer building blocks: the pre-/post-LN `TransformerBlock` and the stack.

The norms, MLPs and activations (`NORMS`, `MLPS`, `ACTIVATIONS`: registries, so a new variant is
one entry, not a flag) live in `attnlab.models.layers` and are re-exported here. A block's
one-token decode step runs in one C++ call when `attnlab.models.fused_step` applies.

`run_blocks` runs a stack of blocks and is the one place that collects per-layer attention
weights (``need_weights``) and hidden states: `GPT`, `Encoder` and `BertEncoder` all use it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from .._shapes import check_int
from ..functional.request import BiasFn
from ..masks import CausalMask, Mask, from_tensor, sliding_window
from ..modules import KVCache, LocalGlobalAttention, MultiHeadAttention
from ..positional import (
    ALiBi,
    LearnedPositionalEmbedding,
    RoPE,
    SinusoidalEmbedding,
    T5RelativeBias,
)
from . import fused_step
from .config import TransformerConfig
from .layers import (
    ACTIVATIONS,
    ACTIVATIONS_INPLACE,
    MLPS,
    NORMS,
    GeluMLP,
    RMSNorm,
    SwiGLU,
    make_mlp,
    make_norm,
)


def _identity(x: Tensor) -> Tensor:
    return x


def make_attention(
    config: TransformerConfig, *, rope: nn.Module | None = None, bias_fn: BiasFn | None = None
) -> MultiHeadAttention:
    """The attention of a block: `MultiHeadAttention`, or `LocalGlobalAttention` (local heads
    within ``config.sliding_window``) when ``config.attention == "local_global"``."""
    kw = {
        "num_kv_heads": config.n_kv_heads,
        "dropout": config.dropout,
        "bias": config.bias,
        "rope": rope,
        "backend": config.attn_backend,
    }
    if config.attention == "local_global":
        if bias_fn is not None:
            raise ValueError("attention='local_global' takes no score bias (positional='alibi')")
        assert config.sliding_window is not None  # the config checked it
        return LocalGlobalAttention(
            config.d_model,
            config.n_heads,
            window=config.sliding_window,
            local_heads=config.local_head_count,
            **kw,
        )
    return MultiHeadAttention(config.d_model, config.n_heads, bias_fn=bias_fn, **kw)


def windowed(mask: Mask | Tensor | None, window: int) -> Mask:
    """``sliding_window(W) & mask`` (a causal mask or None is just the window: the window is
    causal and bottom-right aligned); a bool tensor becomes `masks.from_tensor` first."""
    band = sliding_window(window)
    if mask is None or type(mask) is CausalMask:
        return band
    return band & (from_tensor(mask) if isinstance(mask, Tensor) else mask)


class TransformerBlock(nn.Module):
    """One Transformer layer: attention then MLP, each a residual branch.

    Pre-LN (``config.prenorm``, GPT-2 and later)::

        h = x + drop(attn(norm1(x)));   y = h + drop(mlp(norm2(h)))

    Post-LN (the original Transformer, BERT)::

        h = norm1(x + drop(attn(x)));   y = norm2(h + drop(mlp(h)))

    Args:
        config: sizes and choices (norm and its ε, MLP and activation, heads, dropout, bias,
            attention backend).
        rope: a shared `attnlab.positional.RoPE` for the attention, or None.
        bias_fn: an additive score bias such as `attnlab.positional.ALiBi`, or None.
        layer: the block's index in its stack (0-based): a sliding layer of
            ``config.layer_types`` (or every layer, with ``config.sliding_window`` alone)
            attends causally to its last W keys (`window`).

    Attributes:
        window: W of a sliding layer, else None. A block with a window is causal: it attends
            with ``masks.sliding_window(W) & mask`` (bottom-right, so a decode step with a
            `KVCache` of any length sees its last W keys).
    """

    def __init__(
        self,
        config: TransformerConfig,
        *,
        rope: nn.Module | None = None,
        bias_fn: BiasFn | None = None,
        layer: int = 0,
    ) -> None:
        super().__init__()
        self.prenorm = config.prenorm
        self.norm1 = make_norm(config)
        self.window = config.layer_window(
            check_int("layer", layer, minimum=0, maximum=max(0, config.n_layers - 1))
        )
        self.attn = make_attention(config, rope=rope, bias_fn=bias_fn)
        self.norm2 = make_norm(config)
        self.mlp = make_mlp(config)
        self.drop = nn.Dropout(config.dropout)

    def forward(
        self,
        x: Tensor,
        *,
        mask: Mask | Tensor | None = None,
        cache: KVCache | None = None,
        need_weights: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """``(B, L, E) -> (B, L, E)``.

        Args:
            x: the residual stream ``(B, L, E)``.
            mask: attention mask (True = may attend), broadcastable to ``(B, H, L, S)``.
            cache: this layer's `KVCache` when decoding incrementally (one token per row runs
                in one C++ call when `attnlab.models.fused_step.step` applies).
            need_weights: also return the attention weights ``(B, H, L, S)`` of this very
                forward pass (the attention runs once, with ``need_weights=True``).

        Returns:
            ``y (B, L, E)``, or ``(y, weights)`` with ``need_weights=True``.
        """
        if self.window is not None:
            mask = windowed(mask, self.window)
        if cache is not None and not need_weights and (mask is None or type(mask) is CausalMask):
            y = fused_step.step(self, x, cache)  # one token per row: one C++ call, or None
            if y is not None:
                return y
        h = self.norm1(x) if self.prenorm else x
        a = self.attn(h, mask=mask, cache=cache, need_weights=need_weights)
        a, weights = a if need_weights else (a, None)  # (B, L, E), (B, H, L, S)
        drop = self.drop if self.training else _identity  # eval: no module call per step
        if self.prenorm:
            x = x + drop(a)
            y = x + drop(self.mlp(self.norm2(x)))
        else:
            x = self.norm1(x + drop(a))
            y = self.norm2(x + drop(self.mlp(x)))
        return (y, weights) if need_weights else y  # type: ignore[return-value]


class StackOutput(NamedTuple):
    """What `run_blocks` returns.

    Attributes:
        last_hidden_state: ``(B, L, E)``, the last block's output.
        hidden_states: with ``need_hidden_states``, N + 1 tensors ``(B, L, E)``: the input,
            then each block's output; else None.
        attentions: with ``need_weights``, N tensors ``(B, H, L, S)``, one per block, from the
            same forward pass; else None.
    """

    last_hidden_state: Tensor
    hidden_states: tuple[Tensor, ...] | None = None
    attentions: tuple[Tensor, ...] | None = None


def run_blocks(
    blocks: Sequence[nn.Module],
    x: Tensor,
    *,
    mask: Mask | Tensor | None = None,
    caches: Sequence[KVCache] | None = None,
    need_weights: bool = False,
    need_hidden_states: bool = False,
    checkpointing: bool = False,
) -> StackOutput:
    """``x_{n+1} = block_n(x_n)`` for every block, collecting what was asked for.

    Args:
        blocks: N `TransformerBlock`s.
        x: ``(B, L, E)``, the input of the first block.
        mask: the attention mask of every block (True = may attend).
        caches: one `KVCache` per block, or None.
        need_weights: collect each block's attention weights ``(B, H, L, S)``, computed by
            the blocks' own attention calls (no second pass).
        need_hidden_states: collect the input and every block's output.
        checkpointing: recompute each block in backward (`torch.utils.checkpoint`; no caches).

    Returns:
        A `StackOutput`.
    """
    hidden: list[Tensor] | None = [x] if need_hidden_states else None
    weights: list[Tensor] | None = [] if need_weights else None
    for i, block in enumerate(blocks):
        if caches is not None:
            y = block(x, mask=mask, cache=caches[i], need_weights=need_weights)
        elif checkpointing:
            y = checkpoint(block, x, mask=mask, need_weights=need_weights, use_reentrant=False)
        else:
            y = block(x, mask=mask, need_weights=need_weights)
        if weights is not None:
            x, w = y  # (B, L, E), (B, H, L, S)
            weights.append(w)
        else:
            x = y  # (B, L, E)
        if hidden is not None:
            hidden.append(x)
    return StackOutput(
        x,
        None if hidden is None else tuple(hidden),
        None if weights is None else tuple(weights),
    )


def positional_parts(
    config: TransformerConfig, *, causal: bool
) -> tuple[nn.Module | None, nn.Module | None, BiasFn | None]:
    """``(added, rope, bias_fn)`` for ``config.positional``; the unused two are None.

    ``added`` is a module mapping positions ``(L,)`` to ``(L, E)`` vectors that are added to the
    token embeddings ("learned", "sinusoidal"); ``rope`` rotates q and k inside every attention
    ("rope"); ``bias_fn`` is ALiBi, ``−slope·(i − j)`` when causal, ``−slope·|i − j|`` otherwise,
    or T5's relative bias ``W[bucket(j − i), h]`` ("t5": one learned table shared by every layer,
    as in T5; causal buckets when ``causal``). A bias function goes through `attnlab.attention`'s
    ``bias=`` (the flash path evaluates it per tile).

    Raises:
        ValueError: ``t5_max_distance`` not above T5's exact buckets (``t5_buckets // 2`` when
            causal, ``t5_buckets // 4`` otherwise).
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
    if kind == "t5":
        exact = config.t5_buckets // (2 if causal else 4)
        if exact and config.t5_max_distance <= exact:
            raise ValueError(
                f"t5_max_distance must be > {exact} (the exact buckets of t5_buckets="
                f"{config.t5_buckets}, {'causal' if causal else 'bidirectional'}), "
                f"got {config.t5_max_distance}"
            )
        t5 = T5RelativeBias(
            config.n_heads, config.t5_buckets, config.t5_max_distance, bidirectional=not causal
        )
        return None, None, t5
    return None, None, None


__all__ = [
    "ACTIVATIONS",
    "ACTIVATIONS_INPLACE",
    "MLPS",
    "NORMS",
    "GeluMLP",
    "RMSNorm",
    "StackOutput",
    "SwiGLU",
    "TransformerBlock",
    "make_attention",
    "make_mlp",
    "make_norm",
    "positional_parts",
    "run_blocks",
    "windowed",
]
