"""Block-routed attention (MoBA / NSA selection) on the tiled backend, without host syncs.

Defined to equal `functional.reference.routing_attention`. The selection
(`reference.routing_select`: each query cell scores the key blocks by ``q̄_c · k̄_J``, keeps its
own block and the ``k_blocks − 1`` best candidates) is a small ``(B, H, n_cells, n_blocks)``
tensor computed on the device — sorting, no ``.item()`` — and reaches the kernel as a
`masks.BlockTableMask`, intersected with the causal mask and the caller's mask. The attention
is `attnlab.attention` on the flash backend, whose block map skips every tile no cell selected:
the work is ``O(L · k_blocks · block)`` instead of ``O(L · S)``. Under ``torch.compile`` the mask
travels into flash's custom operators as its spec (the table is a graph tensor).

No gradient flows through the selection (it is a constant of the attention, as in MoBA's gate);
q, k and v get the gradients of attention over the selected keys.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._shapes import check_bool, check_int, check_number, check_qkv
from ..masks import BlockTableMask, Mask
from ..masks import causal as causal_mask
from .api import attention
from .reference import routing_select
from .topk import check_mask_4d


def routing_mask(
    q: Tensor,
    k: Tensor,
    *,
    block: int,
    k_blocks: int,
    causal: bool = True,
    query_block: int | None = None,
) -> BlockTableMask:
    """The selection of `reference.routing_select` as a mask for ``(B, H, L, D)`` queries and
    ``(B, H_kv, S, D)`` keys (without the causal mask: `routing_attention` adds it)."""
    qb = block if query_block is None else query_block
    with torch.no_grad():
        table = routing_select(
            q, k, block=block, k_blocks=k_blocks, causal=causal, query_block=qb
        )  # (B, H, n_cells, n_blocks)
    return BlockTableMask(table, block, qb, q.shape[2], k.shape[2])


def check_blocks(block: object, k_blocks: object, query_block: object) -> int:
    """The routing arguments checked (ints >= 1, ``query_block`` dividing ``block``): the rows
    per cell, ``block`` when ``query_block`` is None."""
    check_int("block", block, minimum=1)
    check_int("k_blocks", k_blocks, minimum=1)
    if query_block is None:
        return block  # type: ignore[return-value]
    qb = check_int("query_block", query_block, minimum=1)
    if block % qb:  # type: ignore[operator]
        raise ValueError(
            f"query_block must divide block (a cell lies in one key block), got "
            f"query_block={qb}, block={block}"
        )
    return qb


def routing_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    block: int = 64,
    k_blocks: int = 4,
    causal: bool = True,
    query_block: int | None = None,
    mask: Mask | Tensor | None = None,
    scale: float | None = None,
) -> Tensor:
    """Block-routed attention: each query cell attends its own and its top-scoring key blocks.

    ``out_i = softmax(q_i·K_{T_i}ᵀ·scale) V_{T_i}``, ``T_i`` the keys of the blocks cell ``c_i``
    selects: its own block plus the ``k_blocks − 1`` blocks ``J`` with the largest
    ``q̄_c · k̄_J`` (mean query of the cell, mean key of the block; with ``causal`` only blocks
    before the own one, and the causal mask inside it), ties to the lowest block. Defined to
    equal `attnlab.functional.reference.routing_attention`; runs on attnlab's flash backend,
    skipping unselected tiles, with no host sync. The selection passes no gradient.

    Args:
        q: ``(B, H, L, D)`` or ``(B, L, D)``. k: ``(B, H_kv, S, D)`` or ``(B, S, D)``.
            v: ``(B, H_kv, S, Dv)`` or ``(B, S, Dv)``; ``H % H_kv == 0``; ``L, S >= 1``.
        block: keys per block (an int >= 1). k_blocks: blocks per cell, the own one included.
        causal: bottom-right causal attention with past-only routing (MoBA, NSA).
        query_block: rows per cell, dividing ``block``; None means ``block`` (one selection
            per query block, NSA-like); 1 routes every row alone (MoBA's per-token gate).
        mask: a further `attnlab.masks.Mask` or bool tensor (True = may attend), or None.
        scale: logit scale; None means ``1/√D``.

    Returns:
        ``(B, H, L, Dv)`` (``(B, L, Dv)`` for 3-D inputs) in q's dtype.

    Raises:
        TypeError / ValueError: bad tensors or arguments, naming them, before any work.

    Example:
        >>> q, k, v = (torch.randn(1, 2, 256, 16) for _ in range(3))
        >>> out = routing_attention(q, k, v, block=32, k_blocks=3)  # (1, 2, 256, 16)
    """
    dims = check_qkv(q, k, v)
    qb = check_blocks(block, k_blocks, query_block)
    check_bool("causal", causal)
    if dims.L < 1 or dims.S < 1:
        raise ValueError(f"routing needs L >= 1 and S >= 1, got L={dims.L}, S={dims.S}")
    user = check_mask_4d(mask, dims)
    if scale is not None:
        check_number("scale", scale)
    three_d = dims.three_d
    q4, k4 = (q.unsqueeze(1), k.unsqueeze(1)) if three_d else (q, k)
    m: Mask = routing_mask(q4, k4, block=block, k_blocks=k_blocks, causal=causal, query_block=qb)
    if causal:
        m = causal_mask() & m
    if user is not None:
        m = m & user
    if three_d:  # attnlab.attention's 3-D call: the mask over one head
        out = attention(q4, k4, v.unsqueeze(1), mask=m, scale=scale, backend="flash")
        return out.squeeze(1)  # type: ignore[union-attr]
    return attention(q, k, v, mask=m, scale=scale, backend="flash")  # type: ignore[return-value]


__all__ = ["check_blocks", "routing_attention", "routing_mask"]
