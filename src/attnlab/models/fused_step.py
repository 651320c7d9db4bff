"""A Transformer block's one-token decode step in one C++ call (``_ext/block_step.cpp``).

At one to eight rows a decode step is bound by streaming the weights, and on a small model the
~40 operator calls per block and the Python between them cost about as much again (measured:
docs/results).
`step` hands the block's parameters, its cache's buffers and the RoPE table to
``attnlab_block::step``, which calls the very operators the modules would call, in the same
order — the norms (``attnlab_nan::rms_norm`` / ``layer_norm``), the projections (attnlab's
streaming linear where `attnlab.functional.gemv.usable_rows` says the module would use it, else
``linear``), RoPE on the new key, the cache write, the decode backend's attention with q rotated
inside (``attnlab_nan::rope_decode_attend``: the NaN rule built in), the MLP and the residual
adds — so its output and the cache equal the modules' on the decode backend bit for bit:

    h = x + attn(norm1(x)),  y = h + mlp(norm2(h))     (pre-LN; post-LN as `TransformerBlock`)

`step` returns None, and the block runs its modules, unless all of these hold: no autograd
(``torch.no_grad``/``inference_mode``), eval mode, ``x`` is ``(B, 1, E)`` on the CPU with the
parameters' dtype; the block is a `TransformerBlock` of `RMSNorm` or ``nn.LayerNorm``, a
`MultiHeadAttention` with a fused q/k/v projection, no score bias (ALiBi), RoPE with static
frequencies or none, backend "auto" (decode first in its order) or "decode", and a `SwiGLU` or
`GeluMLP` of ``nn.Linear``/`StreamLinear` layers; no sliding window (``block.window``); no
forward hooks on those modules (nor global ones: a hook would not see its module run); the
cache is a plain `KVCache` with implied positions, a free row and keys stored after RoPE when
there is RoPE; the sizes fit the decode kernel (`attnlab.functional.decode.fused_step_fits`);
the C++ operators are built.
``ATTNLAB_BLOCK_STEP=off`` turns it off (the modules run every step).

Under "auto" the step takes the decode kernel even where auto would give a lone float32 call
with few keys to SDPA (`attnlab.functional.decode.DECODE_MIN_KEYS`): there the module path
rotates q with RoPE's tensor ops and applies the NaN rule around SDPA, which the fused call
does not need.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn.modules import module as _module

from .. import _ext, _settings
from .._shapes import stat_dtype
from ..functional import gemv, nan_rule
from ..functional.decode import fused_step_fits
from ..functional.request import SCORES
from ..modules import KVCache, MultiHeadAttention, StreamLinear
from ..positional import RoPE
from .layers import GeluMLP, RMSNorm, SwiGLU

ENV = _settings.BLOCK_STEP
EXT = "block_step"

_NORMS: dict[type, str] = {RMSNorm: "rms", nn.LayerNorm: "layer"}
_MLP_LINEARS: dict[type, tuple[str, ...]] = {
    SwiGLU: ("gate", "up", "down"),
    GeluMLP: ("fc1", "fc2"),
}
_LINEARS = (StreamLinear, nn.Linear)


def setting() -> str:
    """``$ATTNLAB_BLOCK_STEP``: ``auto`` (default) or ``off``.

    Raises:
        ValueError: the variable holds something else.
    """
    return _settings.choice("block_step", ("auto", "off"))


def _hooked(modules: tuple[nn.Module | None, ...]) -> bool:
    if _module._global_forward_hooks or _module._global_forward_pre_hooks:  # noqa: SLF001 (nn.Module keeps its hooks in these dicts)
        return True
    return any(m is not None and (m._forward_hooks or m._forward_pre_hooks) for m in modules)  # noqa: SLF001 (nn.Module keeps its hooks in these dicts)


def _params_ok(dtype: torch.dtype, tensors: tuple[Tensor | None, ...]) -> bool:
    return all(t is None or (t.dtype == dtype and t.is_cpu) for t in tensors)


class StepPlan:
    """What a block's fused step needs besides the new tokens and the cache: built once by
    `plan` (all the module checks), run for every step by `run` (only the cache is checked).

    A plan holds the block's parameters as they were when it was built: build a new one after
    changing the block (parameters, submodules, hooks, mode) or the environment variables.
    """

    __slots__ = ("B", "D", "H", "H_kv", "backend", "dtype", "rope", "static")

    def __init__(
        self, block: nn.Module, B: int, dtype: torch.dtype, static: tuple[object, ...]
    ) -> None:
        attn = block.attn
        self.B, self.dtype, self.static = B, dtype, static
        self.H, self.H_kv, self.D = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.backend, self.rope = attn.backend, attn.rope

    def run(self, x: Tensor, cache: KVCache) -> Tensor | None:
        """The block's output ``(B, 1, E)`` for ``x (B, 1, E)``, appending to ``cache``; None
        (nothing changed) when the cache does not fit the fused step (see the module)."""
        buffers = cache.contiguous_buffers() if type(cache) is KVCache else None
        if buffers is None:
            return None
        kc, vc = buffers
        n = len(cache)
        if x.shape != (self.B, 1, x.shape[2]) or x.dtype != self.dtype:
            return None
        if cache.seen != n or n >= kc.shape[2] or kc.dtype != self.dtype:
            return None
        if kc.shape != (self.B, self.H_kv, kc.shape[2], self.D) or vc.shape != kc.shape:
            return None
        if self.rope is not None and not cache.rotate_at_insert:
            return None
        if not fused_step_fits(self.backend, self.B, self.H, self.H_kv, n + 1, self.D, self.dtype):
            return None
        cos = sin = None
        if self.rope is not None:
            table_dtype = stat_dtype(self.dtype)
            cos, sin = self.rope.table(n + 1, x.device, table_dtype)
        y: Tensor = torch.ops.attnlab_block.step(x, kc, vc, n, cos, sin, *self.static)
        cache.appended_in_place(1)
        return y


def plan(block: nn.Module, B: int, dtype: torch.dtype) -> StepPlan | None:
    """A `StepPlan` for steps of ``B`` rows of ``dtype`` on the CPU through ``block``, or None
    when the block's modules, the mode or the settings rule the fused step out (see the module).
    """
    if torch.is_grad_enabled() or block.training or torch.compiler.is_compiling():
        return None
    if getattr(block, "window", None) is not None:  # a sliding layer: the kernel sees every key
        return None
    attn, norm1, norm2, mlp = block.attn, block.norm1, block.norm2, block.mlp
    norm = _NORMS.get(type(norm1))
    names = _MLP_LINEARS.get(type(mlp))
    if norm is None or type(norm2) is not type(norm1) or names is None:
        return None
    if type(attn) is not MultiHeadAttention or attn.qkv_proj is None or attn.bias_fn is not None:
        return None
    E = attn.embed_dim
    if norm == "layer" and not norm1.normalized_shape == norm2.normalized_shape == (E,):
        return None
    rope = attn.rope
    if rope is not None and (type(rope) is not RoPE or rope.depends_on_seq_len):
        return None
    linears = (attn.qkv_proj, attn.out_proj, *(getattr(mlp, name) for name in names))
    if any(type(lin) not in _LINEARS for lin in linears):
        return None
    norm_params = (norm1.weight, getattr(norm1, "bias", None))
    norm_params += (norm2.weight, getattr(norm2, "bias", None))
    weights = tuple(lin.weight for lin in linears)
    biases = tuple(lin.bias for lin in linears)
    if not _params_ok(dtype, norm_params + weights + biases):
        return None
    if _hooked((norm1, norm2, attn, rope, mlp, *linears)) or setting() == "off":
        return None
    probe = weights[0]  # a CPU tensor of the dtype (checked above)
    if not (nan_rule.ext_ready(probe) and _ext.load(EXT)):
        return None
    streamed = gemv.stream_mask(B, dtype, tuple(zip(weights, biases, strict=True)))
    for i, lin in enumerate(linears):
        if type(lin) is not StreamLinear:  # a plain nn.Linear runs torch's kernel
            streamed &= ~(1 << i)
    static = (
        *norm_params[:2],
        weights[0],
        biases[0],
        weights[1],
        biases[1],
        *norm_params[2:],
        list(weights[2:]),
        list(biases[2:]),
        False if rope is None else rope.interleaved,
        attn.num_heads,
        attn.num_kv_heads,
        norm,
        norm1.eps,
        norm2.eps,
        mlp.activation,
        block.prenorm,
        SCORES["dot"].default_scale(attn.head_dim),
        streamed,
        gemv.rows_per_pass(),
    )
    return StepPlan(block, B, dtype, static)


def step(block: nn.Module, x: Tensor, cache: KVCache) -> Tensor | None:
    """``block(x, cache=cache)`` for one new token per row in one C++ call, or None (see the
    module for when it applies; None leaves the cache untouched).

    Args:
        block: a `attnlab.models.TransformerBlock` in eval mode.
        x: ``(B, 1, E)``, the residual stream of the new tokens.
        cache: the block's `KVCache` holding the tokens before them (appended to when the
            step runs).

    Returns:
        ``y (B, 1, E)``, the block's output, or None.
    """
    if x.dim() != 3 or x.shape[1] != 1 or not x.is_cpu:
        return None
    p = plan(block, x.shape[0], x.dtype)
    return None if p is None else p.run(x, cache)


__all__ = ["ENV", "EXT", "StepPlan", "plan", "setting", "step"]
