"""Head importance for any model built from attnlab attention modules.

Two measures (Michel et al., 2019, "Are Sixteen Heads Really Better than One?"):

- ``output_norm``: the Frobenius norm of each head's slice of the output projection
  ``‖W_o[:, h·D:(h+1)·D]‖_F`` — what the head *can* contribute;
- ``head_mask_gradient``: ``|∂ loss / ∂ ξ_h|`` where every head's output is multiplied by a gate
  ``ξ_h = 1`` — the first-order estimate of the loss increase when the head is masked out.

``ablation`` (optional) measures that increase exactly: ``loss(ξ_h = 0) − loss(ξ = 1)``.
Gates act on query heads, so grouped-query (GQA) models work unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from ..modules import MultiHeadAttention
from ..modules.torch_compat import MultiheadAttention


def attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The attnlab attention modules of a model, in registration order, with their names."""
    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, (MultiHeadAttention, MultiheadAttention))
    ]


def _heads(m: nn.Module) -> tuple[int, int]:
    return m.num_heads, m.head_dim


@contextmanager
def head_gates(model: nn.Module, gates: list[Tensor]) -> Iterator[None]:
    """Multiplies head h of attention module l by ``gates[l][h]`` for the duration of the block.

    The gate acts on the input of the output projection, i.e. on each head's output.
    """
    mods = attention_modules(model)
    if len(gates) != len(mods):
        raise ValueError(
            f"expected {len(mods)} gate vectors (one per attention module), got {len(gates)}"
        )
    handles = []
    for (name, m), g in zip(mods, gates, strict=True):
        H, D = _heads(m)
        if g.shape != (H,):
            raise ValueError(f"gates for {name!r} must have shape ({H},), got {tuple(g.shape)}")

        def hook(_mod, args, g=g, H=H, D=D):
            x = args[0]
            gated = (x.unflatten(-1, (H, D)) * g.to(x.dtype).unsqueeze(-1)).flatten(-2)  # (…, H·D)
            return (gated, *args[1:])

        handles.append(m.out_proj.register_forward_pre_hook(hook))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def output_norm(model: nn.Module) -> Tensor:
    """``‖W_o[:, h·D:(h+1)·D]‖_F`` per head, ``(modules, H)`` (requires equal head counts)."""
    rows = []
    for _, m in attention_modules(model):
        H, D = _heads(m)
        w = m.out_proj.weight.detach()  # (E, H·D)
        rows.append(w.unflatten(1, (H, D)).pow(2).sum(dim=(0, 2)).sqrt())  # (H,)
    return _stack(rows)


def _stack(rows: list[Tensor]) -> Tensor:
    """``(modules, max H)`` on the first row's device; modules with fewer heads (pruned) are
    padded with NaN."""
    if not rows:
        raise ValueError("the model has no attnlab attention modules")
    width = max(r.numel() for r in rows)
    out = torch.full((len(rows), width), torch.nan, dtype=rows[0].dtype, device=rows[0].device)
    for i, r in enumerate(rows):
        out[i, : r.numel()] = r.detach()
    return out


def head_importance(
    model: nn.Module,
    batch: object,
    loss_fn: Callable[[nn.Module, object], Tensor],
    *,
    ablation: bool = False,
) -> dict[str, Tensor]:
    """Importance of every attention head of ``model`` on ``batch``.

    Args:
        model: any module containing `attnlab.MultiHeadAttention` / `attnlab.nn.MultiheadAttention`.
        batch: whatever ``loss_fn`` needs.
        loss_fn: ``loss_fn(model, batch) -> scalar loss``.
        ablation: also compute the exact loss increase of masking each head (one forward each).

    Returns:
        ``{"output_norm": (modules, H), "head_mask_gradient": (modules, H)}`` plus
        ``"ablation"`` if requested.
    """
    mods = attention_modules(model)
    if not mods:
        raise ValueError("the model has no attnlab attention modules")
    params = list(model.parameters())
    device = params[0].device if params else torch.device("cpu")
    gates = [torch.ones(_heads(m)[0], device=device, requires_grad=True) for _, m in mods]
    with head_gates(model, gates):
        loss = loss_fn(model, batch)
        grads = torch.autograd.grad(loss, gates)
    result = {
        "output_norm": output_norm(model),
        "head_mask_gradient": _stack([g.abs() for g in grads]),
    }
    if ablation:
        base = float(loss.detach())
        rows = []
        with torch.no_grad():
            for li in range(len(mods)):
                row = []
                for h in range(gates[li].numel()):
                    ones = [torch.ones_like(g) for g in gates]
                    ones[li][h] = 0.0
                    with head_gates(model, ones):
                        row.append(float(loss_fn(model, batch)) - base)
                rows.append(torch.tensor(row, dtype=torch.float64))
        result["ablation"] = _stack(rows)
    return result
