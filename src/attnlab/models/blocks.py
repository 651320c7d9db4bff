"""Transformer building blocks: norms, MLPs, the pre-/post-LN `TransformerBlock` and the stack.

Norms, MLPs and activations are registries (name -> constructor or function), so a new variant
is one entry, not a flag:

    NORMS["layernorm"]        LayerNorm: (x − mean) / sqrt(var + ε) · w + b
    NORMS["rmsnorm"]          RMSNorm:   x / sqrt(mean(x²) + ε) · w
    MLPS["gelu"]              W2 · act(W1 x), act = exact GELU by default   (GPT-2, BERT)
    MLPS["swiglu"]            W_d · (act(W_g x) ⊙ W_u x), act = SiLU by default  (PaLM, Llama)
    ACTIVATIONS["gelu"]       x · Φ(x) (erf);  "gelu_tanh": its tanh approximation;
    ACTIVATIONS["relu"]       max(x, 0);       "silu": x · sigmoid(x)

`run_blocks` runs a stack of blocks and is the one place that collects per-layer attention
weights (``need_weights``) and hidden states: `GPT`, `Encoder` and `BertEncoder` all use it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ..functional import nan_rule
from ..functional.request import BiasFn
from ..masks import Mask
from ..modules import KVCache, MultiHeadAttention, StreamLinear
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
        """``(..., E) -> (..., E)``.

        Without autograd on the CPU (a decode step: 2 calls per layer on a few rows) one C++
        operator call (``attnlab_nan::rms_norm``: the same formula and roundings in one pass,
        values equal up to the order of the sum) replaces torch's ~8 operator calls.
        """
        if x.dtype == self.weight.dtype and nan_rule.ext_ready(x, self.weight):
            return torch.ops.attnlab_nan.rms_norm(x, self.weight, self.eps)
        if x.dtype == self.weight.dtype and x.dtype in (torch.float32, torch.float64):
            # torch's fused op: the same formula in one call (a decode step runs 2 per layer)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)  # (..., E)
        return y.to(x.dtype) * self.weight

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def _identity(x: Tensor) -> Tensor:
    return x


def _layernorm(dim: int, eps: float = 1e-5, bias: bool = True) -> nn.Module:
    return nn.LayerNorm(dim, eps=eps, bias=bias)


NORMS: dict[str, Callable[..., nn.Module]] = {"layernorm": _layernorm, "rmsnorm": RMSNorm}


def make_norm(config: TransformerConfig) -> nn.Module:
    """The norm named by ``config.norm`` over ``d_model``."""
    return NORMS[config.norm](config.d_model, eps=config.norm_eps, bias=config.bias)


ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "gelu": F.gelu,
    "gelu_tanh": partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}


# The same functions writing into their input, for tensors no gradient is recorded for: a
# prefill's (B, L, F) hidden activations are fresh multi-MB allocations whose first touch pays a
# page fault per 4 KiB (SwiGLU's silu and product at B 4, L 128, F 1368 on a Xeon: 653 + 187 →
# ~90 + 60 µs per layer); the values are the same bits.
ACTIVATIONS_INPLACE: dict[str, Callable[[Tensor], Tensor]] = {
    "relu": torch.relu_,
    "silu": partial(F.silu, inplace=True),
}


def _activation(name: str) -> str:
    if name not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {name!r}")
    return name


class GeluMLP(nn.Module):
    """``y = W2 · act(W1 x + b1) + b2``, act = the exact (erf) GELU by default; E -> F -> E.

    Args:
        d_model: E. d_ff: F. bias: biases in both linear layers.
        activation: a name in `ACTIVATIONS` ("gelu", "gelu_tanh", "relu", "silu").
    """

    def __init__(
        self, d_model: int, d_ff: int, bias: bool = True, activation: str = "gelu"
    ) -> None:
        super().__init__()
        self.activation = _activation(activation)
        self.fc1 = StreamLinear(d_model, d_ff, bias=bias)
        self.fc2 = StreamLinear(d_ff, d_model, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        """``(B, L, E) -> (B, L, E)``."""
        return self.fc2(ACTIVATIONS[self.activation](self.fc1(x)))  # (B, L, F) -> (B, L, E)

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}"


class SwiGLU(nn.Module):
    """``y = W_d · (act(W_g x) ⊙ W_u x)``, act = SiLU by default (Shazeer, 2020); E -> F -> E.

    Without autograd (SiLU, ReLU) the activation and the product are written into ``gate``'s
    output (`ACTIVATIONS_INPLACE`, as ``nn.ReLU(inplace=True)``): a forward hook on ``gate``
    that keeps its output sees it overwritten.

    Args:
        d_model: E. d_ff: F. bias: biases in the three linear layers.
        activation: the gate's nonlinearity, a name in `ACTIVATIONS` ("gelu" gives GeGLU).
    """

    def __init__(
        self, d_model: int, d_ff: int, bias: bool = True, activation: str = "silu"
    ) -> None:
        super().__init__()
        self.activation = _activation(activation)
        self.gate = StreamLinear(d_model, d_ff, bias=bias)
        self.up = StreamLinear(d_model, d_ff, bias=bias)
        self.down = StreamLinear(d_ff, d_model, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        """``(B, L, E) -> (B, L, E)``."""
        inplace = ACTIVATIONS_INPLACE.get(self.activation)
        if inplace is not None and not torch.is_grad_enabled():
            # no autograd: the activation and the product written into the gate's output
            return self.down(inplace(self.gate(x)).mul_(self.up(x)))
        gate = ACTIVATIONS[self.activation](self.gate(x))  # (B, L, F)
        return self.down(gate * self.up(x))  # (B, L, F) -> (B, L, E)

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}"


MLPS: dict[str, Callable[..., nn.Module]] = {"gelu": GeluMLP, "swiglu": SwiGLU}


def make_mlp(config: TransformerConfig) -> nn.Module:
    """The MLP named by ``config.mlp`` (E -> ``ff_dim`` -> E) with ``config.activation``."""
    kwargs = {} if config.activation is None else {"activation": config.activation}
    return MLPS[config.mlp](config.d_model, config.ff_dim, bias=config.bias, **kwargs)


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
            backend=config.attn_backend,
        )
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
            cache: this layer's `KVCache` when decoding incrementally.
            need_weights: also return the attention weights ``(B, H, L, S)`` of this very
                forward pass (the attention runs once, with ``need_weights=True``).

        Returns:
            ``y (B, L, E)``, or ``(y, weights)`` with ``need_weights=True``.
        """
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
