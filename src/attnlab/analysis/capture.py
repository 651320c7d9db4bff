"""Attention weights of any model built from attnlab's `MultiHeadAttention` (or
`DifferentialAttention`, whose weights are its two maps), from one pass.

`capture_attentions` turns on ``need_weights`` for the attention calls of a model while a block
runs and hands the caller only what it asked for: each attention runs exactly once (its own
call computes the weights, ``attention(..., return_weights=True)``), nothing runs a second time,
and the model sees the outputs it would see without the capture. `module_attentions` stacks the
weights of one forward pass, for models whose ``forward`` does not return them itself (models
that do — `attnlab.models.GPT`, `Encoder`, `BertEncoder` with ``need_weights=True`` — can be
asked directly).

Example:
    >>> model = GPT(TransformerConfig(vocab_size=65, n_layers=2)).eval()
    >>> w = module_attentions(model, lambda: model(idx))      # (2, H, L, L) for idx (1, L)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from ..modules import DifferentialAttention, MultiHeadAttention

#: The modules whose calls take ``need_weights=True`` and return ``(out, weights (B, H, L, S))``.
WEIGHTED = (MultiHeadAttention, DifferentialAttention)


def _attention_modules(model: nn.Module) -> list[nn.Module]:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    modules = [m for m in model.modules() if isinstance(m, WEIGHTED)]
    if not modules:
        raise ValueError(
            f"model ({type(model).__name__}) has no attnlab MultiHeadAttention (or "
            "DifferentialAttention) modules to read weights from"
        )
    return modules


@contextmanager
def capture_attentions(model: nn.Module) -> Iterator[list[tuple[str, Tensor]]]:
    """Collects ``(module name, weights (B, H, L, S))`` of every attention call in the block.

    A forward pre-hook on each attnlab `MultiHeadAttention` (and `DifferentialAttention`:
    its weights are its two maps, `attnlab.analysis.differential_maps`) of ``model`` sets
    ``need_weights=True`` on the call, and a forward hook takes the weights off the result
    again, so the caller receives exactly what it asked for (the output alone, or
    ``(output, weights)`` if it passed ``need_weights=True`` itself). Weights are detached and
    appended in call order. The hooks are removed when the block ends.

    Calls with a KV cache are refused before they run (ValueError): the weights of a cached
    call cover the cache too, and the capture is meant for plain forward passes.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: the model has no attnlab `MultiHeadAttention`; a call with a KV cache.
    """
    modules = _attention_modules(model)
    names = {id(m): n for n, m in model.named_modules()}
    captured: list[tuple[str, Tensor]] = []
    asked: list[bool] = []  # the caller's own need_weights, one entry per call in flight

    # torch's forward (pre-)hook signatures with_kwargs=True, called positionally
    def before(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if kwargs.get("cache") is not None:
            raise ValueError("module_attentions cannot read weights from a call with a KV cache")
        asked.append(kwargs.get("need_weights", False) is True)
        return args, {**kwargs, "need_weights": True}

    def after(module: nn.Module, _args: tuple, _kwargs: dict, output: Any) -> Any:
        out, weights = output  # (B, L, E), (B, H, L, S)
        captured.append((names.get(id(module), ""), weights.detach()))
        return output if asked.pop() else out

    handles = []
    try:
        for m in modules:
            handles.append(m.register_forward_pre_hook(before, with_kwargs=True))
            handles.append(m.register_forward_hook(after, with_kwargs=True))
        yield captured
    finally:
        for handle in handles:
            handle.remove()


def module_attentions(model: nn.Module, run: Callable[[], Any]) -> Tensor:
    """Every attnlab `MultiHeadAttention`'s (and `DifferentialAttention`'s) weights during
    ``run()``, stacked in call order.

    Each attention call of ``run()`` computes its weights itself (`capture_attentions` turns on
    its ``need_weights``): the attention runs once per call, and the model's own outputs are
    those of the same calls. Run the model in eval mode without KV caches (a call with a cache
    is refused).

    Args:
        model: a module built from attnlab's attention (e.g. `attnlab.models.GPT`).
        run: runs one forward pass of ``model`` on a batch of one sequence.

    Returns:
        ``(calls, heads, L, S)``: the weights of batch item 0 of each attention call (= one
        row per layer for one pass).

    Raises:
        ValueError: the model has no attnlab `MultiHeadAttention`, ``run`` did not call one, or
            called one with a KV cache.
    """
    with capture_attentions(model) as captured:
        run()
    if not captured:
        raise ValueError("run() did not call any attnlab MultiHeadAttention of the model")
    return torch.stack([w[0] for _, w in captured])  # (calls, H, L, S)


__all__ = ["capture_attentions", "module_attentions"]
