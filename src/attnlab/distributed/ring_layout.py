"""Sequence layouts of ring attention: which chunks of the global sequence each rank holds.

- ``"contiguous"``: rank r holds positions ``[r·N/W, (r+1)·N/W)``.
- ``"zigzag"``: the sequence is cut into ``2W`` chunks and rank r holds chunks ``r`` and
  ``2W−1−r`` (concatenated), so under a causal mask every rank does the same amount of work.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

LAYOUTS = ("contiguous", "zigzag")


def rank_and_world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """``(rank, world size)`` in ``group``; raises RuntimeError without a process group."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "ring attention needs an initialised torch.distributed process group "
            "(dist.init_process_group(backend='gloo' on CPU, 'nccl' on GPU))"
        )
    return dist.get_rank(group), dist.get_world_size(group)


def chunk_ids(rank: int, world_size: int, layout: str) -> list[int]:
    """Global chunk indices a rank holds, in local order (chunks of ``N/W`` or ``N/2W``)."""
    if layout == "contiguous":
        return [rank]
    if layout == "zigzag":
        return [rank, 2 * world_size - 1 - rank]
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def num_chunks(world_size: int, layout: str) -> int:
    return world_size * len(chunk_ids(0, world_size, layout))


def shard(
    x: Tensor, group: dist.ProcessGroup | None = None, layout: str = "contiguous", dim: int = -2
) -> Tensor:
    """This rank's shard of a full sequence ``x`` (the sequence along ``dim``).

    Raises:
        ValueError: the sequence length is not divisible by the number of chunks (W or 2W).
    """
    rank, world = rank_and_world(group)
    n = num_chunks(world, layout)
    N = x.shape[dim]
    if N % n:
        raise ValueError(
            f"sequence length {N} must be divisible by {n} chunks (world size {world}, "
            f"layout {layout!r})"
        )
    chunks = x.chunk(n, dim=dim)
    return torch.cat([chunks[c] for c in chunk_ids(rank, world, layout)], dim=dim)


def unshard(
    x: Tensor, group: dist.ProcessGroup | None = None, layout: str = "contiguous", dim: int = -2
) -> Tensor:
    """Reassembles the full sequence from every rank's shard (an all-gather)."""
    _, world = rank_and_world(group)
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    per_rank = len(chunk_ids(0, world, layout))
    ordered: dict[int, Tensor] = {}
    for r, part in enumerate(parts):
        for c, piece in zip(
            chunk_ids(r, world, layout), part.chunk(per_rank, dim=dim), strict=True
        ):
            ordered[c] = piece
    return torch.cat([ordered[c] for c in sorted(ordered)], dim=dim)


__all__ = ["LAYOUTS", "chunk_ids", "num_chunks", "rank_and_world", "shard", "unshard"]
