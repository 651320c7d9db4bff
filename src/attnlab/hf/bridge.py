"""The attention function registered with transformers' ``AttentionInterface``, and `register`.

Every attention module of a transformers model calls
``attention_interface(module, query, key, value, attention_mask, dropout=..., scaling=..., **kw)``
with ``query (B, H, L, D)``, ``key (B, H_kv, S, D)``, ``value (B, H_kv, S, Dv)`` and expects
``(out (B, L, H, Dv), weights (B, H, L, S) or None)``. `attention_forward` answers with
``attnlab.attention``: the attnlab mask from `attnlab.hf.masking.hf_mask`, k/v shared by
``G = H / H_kv`` query heads without copies, the model's ``scaling``, its dropout in training, its
logit soft-capping, its attention sinks (GPT-OSS's ``s_aux``), and the exact weights when the
caller asked for ``output_attentions``.
"""

from __future__ import annotations

import functools
import inspect
import re
import sys

import torch
from torch import Tensor, nn

from ..functional.api import attention
from ..functional.decode import decode_step_ready, decode_step_run
from ..masks import Mask
from ..utils.extras import require
from .errors import UnsupportedAttentionError
from .masking import HFMask, hf_mask

NAME = "attnlab"
"""The ``attn_implementation`` name `register` gives attnlab."""

MIN_TRANSFORMERS = (5, 4)
"""The oldest transformers whose mask interface this bridge speaks: ``q_length``/``q_offset``
keywords (5.4 replaced ``cache_position``). Declared in the ``hf`` extra of pyproject.toml."""

# Keywords that change what attention computes and that attnlab does not implement: the call
# refuses them by name instead of returning a different answer.
_UNSUPPORTED = {
    "position_bias": "an additive position bias passed beside the mask (position_bias)",
    "indices": "sparse key selection (indices)",
    "block_indices": "block-sparse key selection (block_indices)",
}


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = re.match(r"(\d+)\.(\d+)", text)
    return (int(parts.group(1)), int(parts.group(2))) if parts else (0, 0)


@functools.cache
def _has_softcap() -> bool:
    return "softcap" in inspect.signature(attention).parameters


def _check_mask_interface(module: nn.Module) -> None:
    """Refuses a model whose attention name has no mask function (HF then passes no mask)."""
    impl = getattr(getattr(module, "config", None), "_attn_implementation", None)
    masking = sys.modules.get("transformers.masking_utils")
    if impl is None or masking is None:
        return
    if impl not in masking.AttentionMaskInterface._global_mapping:  # noqa: SLF001 (transformers' registry has no public lookup)
        raise UnsupportedAttentionError(
            f"attn_implementation={impl!r} reaches attnlab without a registered mask function, "
            "so transformers passes no mask and padding would be silently ignored: use "
            "attnlab.hf.register() and attn_implementation='attnlab'"
        )


def _one_step(
    q: Tensor, k: Tensor, v: Tensor, dropout: float, softcap: float | None, weights: bool
) -> bool:
    """Whether a call with a decoding step's key mask runs on the C++ decode step directly: what
    `attnlab.attention` would choose (`decode_step_ready`, auto) for a call without weights
    or dropout, with a positive soft-cap or none, on q, k, v of one dtype."""
    if weights or dropout or not q.dtype == k.dtype == v.dtype:
        return False
    if softcap is not None and not softcap > 0:
        return False  # (attention() raises what it raises for such a value)
    return q.shape[0] == k.shape[0] == v.shape[0] and decode_step_ready("auto", q, k, v, 0.0)


def attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: HFMask | Mask | Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    softcap: float | None = None,
    sliding_window: int | None = None,
    **kwargs: object,
) -> tuple[Tensor, Tensor | None]:
    """transformers' attention interface for ``attn_implementation="attnlab"``.

    ``out = softmax(cap·tanh(q·kᵀ·scaling / cap) masked) · v`` per head (no cap when
    ``softcap`` is None), computed by `attnlab.attention`.

    Args:
        module: the calling attention module (read: ``is_causal``, ``training`` via ``dropout``).
        query: ``(B, H, L, D)``.
        key: ``(B, H_kv, S, D)``, ``H % H_kv == 0`` (GQA: not repeated).
        value: ``(B, H_kv, S, Dv)``.
        attention_mask: the `HFMask` built by `attnlab.hf.masking.hf_mask` (its attnlab mask is
            used), an `attnlab.masks.Mask`, a user-supplied 4-D tensor (bool True = may attend,
            or additive float), or None (every key).
        dropout: dropout probability on the weights (HF passes 0.0 in eval mode).
        scaling: the logit scale; None gives ``1/√D``.
        is_causal: HF's hint; with ``attention_mask=None`` a causal call (L > 1) is refused,
            since the mask then never came from attnlab's mask function.
        softcap: logit soft-capping ``cap·tanh(s/cap)`` after scaling, before the mask (Gemma 2).
        sliding_window: the layer's window; the mask already holds it (checked present).
        **kwargs: the rest of HF's keywords; ``output_attentions`` asks for the weights,
            ``s_aux`` (or ``sinks``) is GPT-OSS's per-head sink logits ``(H,)``
            (`attnlab.attention`'s ``sinks=``), semantic keywords attnlab lacks
            (``position_bias``, ``indices``, ...) raise.

    Returns:
        ``(out (B, L, H, Dv) contiguous, weights (B, H, L, S) or None)``; the weights are
        attnlab's exact weights (zeros on rows that may attend nothing).

    Raises:
        UnsupportedAttentionError: (a ValueError) a keyword attnlab cannot compute, soft-capping
            with an attnlab that has no ``softcap``, a causal / sliding-window call without a
            mask, or a model whose attention name has no mask function registered (transformers
            would then pass no mask at all and ignore padding).
    """
    for name, what in _UNSUPPORTED.items():
        if kwargs.get(name) is not None:
            raise UnsupportedAttentionError(
                f"attn_implementation='attnlab' does not support {what}, which "
                f"{type(module).__name__} uses; load the model with attn_implementation='eager'"
            )
    if attention_mask is None:
        _check_mask_interface(module)
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", False)
        if (causal and query.shape[2] > 1) or sliding_window is not None:
            need = "causal" if causal else f"sliding-window ({sliding_window})"
            raise UnsupportedAttentionError(
                f"{type(module).__name__} called attnlab for {need} attention without a mask: "
                "its mask was not built by attnlab's mask function (call attnlab.hf.register() "
                "before loading, and pass a 2-D attention_mask, not a prepared 4-D one)"
            )
    S = key.shape[2]
    want_weights = bool(kwargs.get("output_attentions"))
    sinks = kwargs.get("s_aux", kwargs.get("sinks"))
    if isinstance(attention_mask, HFMask):
        # a static cache's unused buffer is never attended: eager calls skip it (compiled ones
        # keep one graph over the whole buffer, so `used`, which changes every step, is not read)
        used = None if torch.compiler.is_compiling() else attention_mask.used
        if used is not None:
            key, value = key[:, :, : used[0]], value[:, :, : used[0]]
        keys = None if torch.compiler.is_compiling() else attention_mask.step_keys
        one = sinks is None and _one_step(query, key, value, dropout, softcap, want_weights)
        if keys is not None and one:
            # a decoding step: the keys every layer attends were rendered once (`hf_mask`)
            out = decode_step_run(query, key, value, scaling, keys.contiguous(), softcap)
            return out.transpose(1, 2).contiguous(), None  # (B, L, H, Dv)
        attention_mask = attention_mask.mask if used is None else used[1]
    extra: dict[str, object] = {} if sinks is None else {"sinks": sinks}
    if softcap is not None:
        if not _has_softcap():
            raise UnsupportedAttentionError(
                f"{type(module).__name__} uses logit soft-capping (softcap={softcap}), which this "
                "attnlab's attention() does not implement"
            )
        extra["softcap"] = softcap
    result = attention(
        query,
        key,
        value,
        mask=attention_mask,
        scale=scaling,
        dropout_p=float(dropout),
        return_weights=want_weights,
        **extra,
    )
    out, weights = result if want_weights else (result, None)  # type: ignore[misc]
    if weights is not None and weights.shape[-1] < S:  # the unused keys' weights are 0
        weights = torch.nn.functional.pad(weights, (0, S - weights.shape[-1]))
    return out.transpose(1, 2).contiguous(), weights  # (B, L, H, Dv)


def register() -> None:
    """Registers ``attn_implementation="attnlab"`` with transformers (idempotent).

    Registers `attention_forward` with ``AttentionInterface`` and `hf_mask` with
    ``AttentionMaskInterface`` under the name ``"attnlab"`` — both are needed: without the mask
    function transformers builds no mask at all and padding would be silently ignored.

    Raises:
        MissingExtraError: transformers is not installed (``pip install "attnlab[hf]"``).
        ImportError: the installed transformers is older than 5.4 (its mask interface differs).
    """
    found = str(require("transformers", "hf", "attnlab.hf.register").__version__)
    if _version_tuple(found) < MIN_TRANSFORMERS:
        want = ".".join(map(str, MIN_TRANSFORMERS))
        raise ImportError(
            f"attnlab.hf.register needs transformers>={want}, found {found}: "
            'pip install "attnlab[hf]"'
        )
    modeling = require("transformers.modeling_utils", "hf", "attnlab.hf.register")
    masking = require("transformers.masking_utils", "hf", "attnlab.hf.register")
    modeling.AttentionInterface.register(NAME, attention_forward)
    masking.AttentionMaskInterface.register(NAME, hf_mask)


__all__ = ["MIN_TRANSFORMERS", "NAME", "attention_forward", "register"]
