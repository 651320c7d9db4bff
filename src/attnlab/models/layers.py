"""Norms, MLPs and activations of a Transformer block, as registries (name -> constructor or
function), so a new variant is one entry, not a flag:

    NORMS["layernorm"]        LayerNorm: (x − mean) / sqrt(var + ε) · w + b
    NORMS["rmsnorm"]          RMSNorm:   x / sqrt(mean(x²) + ε) · w
    MLPS["gelu"]              W2 · act(W1 x), act = exact GELU by default   (GPT-2, BERT)
    MLPS["swiglu"]            W_d · (act(W_g x) ⊙ W_u x), act = SiLU by default  (PaLM, Llama)
    ACTIVATIONS["gelu"]       x · Φ(x) (erf);  "gelu_tanh": its tanh approximation;
    ACTIVATIONS["relu"]       max(x, 0);       "silu": x · sigmoid(x)

`attnlab.models.blocks` assembles them into `TransformerBlock` (and re-exports them).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._shapes import stat_dtype
from ..functional import nan_rule
from ..modules import StreamLinear
from .config import TransformerConfig


class RMSNorm(nn.Module):
    """Root-mean-square norm: ``y = x / sqrt(mean(x², -1) + ε) · w`` (statistics in float32+).

    Args:
        dim: E, the normalised (last) dimension.
        eps: ε.
        bias: unused (RMSNorm has no bias); accepted so every norm has one signature.
    """

    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = False) -> None:  # noqa: ARG002 (the norms share one signature)
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
        xf = x.to(stat_dtype(x.dtype))
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
