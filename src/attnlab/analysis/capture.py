"""Attention weights captured from a model's attnlab `MultiHeadAttention` modules."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn


def module_attentions(model: nn.Module, run: Callable[[], Any]) -> Tensor:
    """Every attnlab `MultiHeadAttention`'s weights during ``run()``, stacked in call order.

    A forward hook on each `attnlab.modules.MultiHeadAttention` of ``model`` calls the module
    again with the same inputs and ``need_weights=True``; the model's own outputs are
    unchanged. Run the model in eval mode without KV caches (the hook refuses a cache, which the
    second call would extend twice).

    Args:
        model: a module built from attnlab's attention (e.g. `attnlab.models.GPT`).
        run: runs one forward pass of ``model`` on a batch of one sequence.

    Returns:
        ``(calls, heads, L, S)``: one row per attention call (= per layer for one pass).

    Raises:
        ValueError: the model has no attnlab `MultiHeadAttention`, or ``run`` did not call one.
    """
    from ..modules import MultiHeadAttention

    modules = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
    if not modules:
        raise ValueError(
            f"model ({type(model).__name__}) has no attnlab MultiHeadAttention modules to read "
            "weights from"
        )
    captured: list[Tensor] = []

    def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if kwargs.get("cache") is not None:
            raise ValueError("module_attentions cannot read weights from a call with a KV cache")
        _, weights = module.forward(*args, **{**kwargs, "need_weights": True})  # (B, H, L, S)
        captured.append(weights.detach()[0])  # (H, L, S)

    handles = [m.register_forward_hook(hook, with_kwargs=True) for m in modules]
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    if not captured:
        raise ValueError("run() did not call any attnlab MultiHeadAttention of the model")
    return torch.stack(captured)  # (calls, H, L, S)


__all__ = ["module_attentions"]
