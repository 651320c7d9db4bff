"""Attention statistics of a transformers model's forward pass, without any L×S tensor.

`attention_stats` runs a model loaded with ``attn_implementation="attnlab"`` once and, for every
attention call (each layer's self-attention, and an encoder–decoder's cross-attention), computes
`attnlab.attention_stats` on the very q, k, v, mask and scaling that call received: per head and
query row the entropy ``−Σ_j p_ij log p_ij``, the max weight, the sink mass ``p_i0`` (weight on the
first key) and the mean attention distance ``Σ_j p_ij |i' − j|``. The statistics stream over the
tiles of the tiled backend, so memory is O(B·H·L) per call plus one tile: they work at lengths
whose weights could never be stored (16K tokens and beyond).

The capture swaps transformers' ``"attnlab"`` attention function for a recording one in the
``ALL_ATTENTION_FUNCTIONS`` instance of ``transformers.modeling_utils`` for the duration of the
call only (restored on exit, also on errors); the outputs are those of the ordinary forward.

Example:
    >>> import tempfile, torch, transformers, attnlab.hf
    >>> attnlab.hf.register()
    >>> config = transformers.LlamaConfig(
    ...     vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    ...     num_attention_heads=4, num_key_value_heads=2)
    >>> folder = tempfile.mkdtemp()
    >>> transformers.LlamaForCausalLM(config).save_pretrained(folder)
    >>> model = transformers.AutoModelForCausalLM.from_pretrained(
    ...     folder, attn_implementation="attnlab")
    >>> run = attnlab.hf.attention_stats(model, {"input_ids": torch.tensor([[1, 2, 3, 4]])})
    >>> [layer.name for layer in run.layers]
    ['model.layers.0.self_attn', 'model.layers.1.self_attn']
    >>> run.layers[0].per_head()["entropy"].shape  # (H,)
    torch.Size([4])
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ..functional.api import attention_stats as _attention_stats
from ..functional.stats import AttentionStats
from ..utils.extras import require
from .bridge import NAME, attention_forward
from .errors import UnsupportedAttentionError
from .masking import HFMask

STATISTICS = ("entropy", "max_weight", "sink_mass", "mean_distance")
"""The per-row statistics each `CallStats` holds (besides ``lse``)."""


@dataclass(frozen=True)
class CallStats:
    """The statistics of one attention call: one layer's self- or cross-attention.

    Attributes:
        name: the attention module's qualified name in the model (``model.layers.0.self_attn``).
        stats: `attnlab.AttentionStats` of ``(B, H, L)`` tensors (float32; float64 for a float64
            model); rows that may attend no key (left padding) have every statistic 0 and lse −inf.
        keys: S, the number of keys of the call (L != S for cross-attention).
    """

    name: str
    stats: AttentionStats
    keys: int

    def per_head(self) -> dict[str, Tensor]:
        """Each statistic's mean over the query rows that attend at least one key, per head.

        ``mean_h = Σ_{b,i: lse_bhi > −inf} s_bhi / #{b,i: lse_bhi > −inf}`` (0 for a head whose
        rows all attend nothing). NaN rows (the NaN rule) make the head's mean NaN.

        Returns:
            ``{statistic: (H,) tensor}`` for the statistics in `STATISTICS`.
        """
        has_key = (self.stats.lse != float("-inf")).to(self.stats.lse.dtype)  # (B, H, L)
        count = has_key.sum(dim=(0, 2)).clamp_min(1)  # (H,)
        return {
            name: (getattr(self.stats, name) * has_key).sum(dim=(0, 2)) / count
            for name in STATISTICS
        }


@dataclass
class ModelStats:
    """What `attention_stats` returns: every attention call's statistics and the model's output.

    Attributes:
        layers: one `CallStats` per attention call, in call order (an encoder–decoder: the
            encoder's layers, then per decoder layer its self- and cross-attention).
        output: what the model's forward returned.
    """

    layers: list[CallStats] = field(default_factory=list)
    output: Any = None

    def per_head(self) -> dict[str, Tensor]:
        """`CallStats.per_head` of every call stacked: ``{statistic: (calls, H)}``.

        Raises:
            ValueError: the calls have different head counts (stack `CallStats.per_head`
                yourself).
        """
        heads = {c.stats.lse.shape[1] for c in self.layers}
        if len(heads) > 1:
            raise ValueError(f"attention calls have different head counts {sorted(heads)}")
        per = [c.per_head() for c in self.layers]
        return {name: torch.stack([p[name] for p in per]) for name in STATISTICS}


def _stats_accepts_softcap() -> bool:
    return "softcap" in inspect.signature(_attention_stats).parameters


def _recorder(model: nn.Module, record: list[CallStats]) -> Any:
    """An attention function that answers like `attention_forward` and records statistics."""
    names = {id(m): name for name, m in model.named_modules()}

    def recording_forward(
        module: nn.Module,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Any,
        dropout: float = 0.0,
        scaling: float | None = None,
        is_causal: bool | None = None,
        softcap: float | None = None,
        sliding_window: int | None = None,
        **kwargs: object,
    ) -> tuple[Tensor, Tensor | None]:
        if kwargs.get("s_aux", kwargs.get("sinks")) is not None:
            raise UnsupportedAttentionError(
                f"{type(module).__name__} uses attention sinks (s_aux), which "
                "attnlab.attention_stats does not include in its statistics"
            )
        result = attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            softcap=softcap,
            sliding_window=sliding_window,
            **kwargs,
        )
        extra: dict[str, Any] = {}
        if softcap is not None:
            if not _stats_accepts_softcap():
                raise UnsupportedAttentionError(
                    f"{type(module).__name__} uses logit soft-capping (softcap={softcap}), which "
                    "attnlab.attention_stats does not implement"
                )
            extra["softcap"] = softcap
        mask = attention_mask.mask if isinstance(attention_mask, HFMask) else attention_mask
        with torch.no_grad():
            st = _attention_stats(query, key, value, mask=mask, scale=scaling, **extra)
        record.append(CallStats(names.get(id(module), type(module).__name__), st, key.shape[2]))
        return result

    return recording_forward


@contextlib.contextmanager
def _swapped(function: Any) -> Iterator[None]:
    """``ALL_ATTENTION_FUNCTIONS["attnlab"] = function`` (the instance's local mapping) for the
    block; the previous local entry (usually none) is restored afterwards."""
    modeling = require("transformers.modeling_utils", "hf", "attnlab.hf.attention_stats")
    table = modeling.ALL_ATTENTION_FUNCTIONS
    local = table._local_mapping  # noqa: SLF001 (restores transformers' exact previous entry)
    had, before = NAME in local, local.get(NAME)
    local[NAME] = function
    try:
        yield
    finally:
        if had:
            local[NAME] = before
        else:
            local.pop(NAME, None)


def attention_stats(
    model: nn.Module, inputs: Mapping[str, Any] | Tensor, **forward_kwargs: Any
) -> ModelStats:
    """Runs ``model(**inputs)`` once and returns every attention call's statistics (no L×S).

    Per call, head and query row: ``entropy = −Σ_j p_ij log p_ij``, ``max_weight``,
    ``sink_mass = p_i0`` and ``mean_distance = Σ_j p_ij |i' − j|`` (``i' = i + S − L``), from
    `attnlab.attention_stats` on the q, k, v, mask and scaling the call received.

    Args:
        model: a transformers model loaded with ``attn_implementation="attnlab"`` (after
            `attnlab.hf.register`).
        inputs: keyword inputs of the forward (a tokenizer's ``BatchEncoding`` or a dict), or the
            ``input_ids`` tensor ``(B, L)``.
        **forward_kwargs: more keywords for the forward (e.g. ``decoder_input_ids``).

    Returns:
        `ModelStats`: ``layers`` (one `CallStats` per attention call, in order) and ``output``.

    Raises:
        TypeError: ``model`` is not an ``nn.Module`` or ``inputs`` is neither a mapping nor a
            tensor.
        ValueError: the model does not use ``attn_implementation="attnlab"``, or asks for
            ``output_attentions`` (the point is not to form the weights).
        UnsupportedAttentionError: a call attnlab cannot compute (see `attention_forward`).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a transformers model (nn.Module), got {type(model)}")
    if isinstance(inputs, Tensor):
        kwargs: dict[str, Any] = {"input_ids": inputs}
    elif isinstance(inputs, Mapping):
        kwargs = dict(inputs)
    else:
        raise TypeError(
            f"inputs must be a mapping of forward keywords or an input_ids tensor, got "
            f"{type(inputs).__name__}"
        )
    kwargs.update(forward_kwargs)
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl != NAME:
        raise ValueError(
            f"model must be loaded with attn_implementation={NAME!r} (after "
            f"attnlab.hf.register()), got attn_implementation={impl!r}"
        )
    if kwargs.get("output_attentions"):
        raise ValueError(
            "output_attentions=True forms every L×S weight matrix; attention_stats computes "
            "the statistics without them: drop output_attentions"
        )
    record: list[CallStats] = []
    with _swapped(_recorder(model, record)), torch.no_grad():
        output = model(**kwargs)
    return ModelStats(record, output)


__all__ = ["STATISTICS", "CallStats", "ModelStats", "attention_stats"]
