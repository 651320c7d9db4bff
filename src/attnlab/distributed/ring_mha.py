"""`RingMultiHeadAttention`: `MultiHeadAttention` whose attention runs as ring attention."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from .._shapes import check_int
from ..masks import Mask
from ..modules.mha import MultiHeadAttention
from .ring import ring_attention
from .ring_layout import LAYOUTS, chunk_ids, rank_and_world


class RingMultiHeadAttention(MultiHeadAttention):
    """Context-parallel multi-head attention: each rank passes its shard ``(B, L_local, E)``.

    The parameters and state dict are those of `attnlab.MultiHeadAttention`, so a model can swap
    one for the other; RoPE uses the shard's *global* positions.

    Args:
        embed_dim, num_heads, num_kv_heads, bias, rope: as in `MultiHeadAttention`.
        group: the process group (default: the world).
        layout: ``"contiguous"`` or ``"zigzag"`` — how the caller sharded the sequence.
        timeout: seconds to wait for a peer at each exchange, the metadata handshake included.
        pieces: pieces per layout chunk that blocks stream in (see `ring_attention`): more
            pieces, less memory per rank, more messages.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        group: dist.ProcessGroup | None = None,
        layout: str = "contiguous",
        timeout: float | None = None,
        pieces: int = 2,
        **kwargs: object,
    ) -> None:
        for name in ("dropout", "bias_fn", "kdim", "vdim"):
            if kwargs.get(name) not in (None, 0.0):
                raise ValueError(f"RingMultiHeadAttention does not take {name}={kwargs[name]!r}")
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        super().__init__(embed_dim, num_heads, **kwargs)  # type: ignore[arg-type]
        self.group, self.layout, self.timeout = group, layout, timeout
        self.pieces = check_int("pieces", pieces, minimum=1)

    def global_positions(self, L_local: int, device: torch.device | None = None) -> Tensor:
        """Global positions ``(L_local,)`` of this rank's tokens under the layout."""
        rank, world = rank_and_world(self.group)
        ids = chunk_ids(rank, world, self.layout)
        C = L_local // len(ids)
        return torch.cat([torch.arange(c * C, (c + 1) * C, device=device) for c in ids])

    def forward(self, x: Tensor, *, mask: Mask | None = None) -> Tensor:  # type: ignore[override]
        """Self-attention of this rank's shard ``x (B, L_local, E)`` over the global sequence.

        ``mask`` is any `attnlab.masks.Mask` over global positions (``masks.causal()`` for a
        causal model), as in `ring_attention`.
        """
        self._check(x, None, None)
        q, k, v = self.project(x)  # (B, H, L_local, D), (B, H_kv, L_local, D) ×2
        B, _, L, _ = q.shape
        if self.rope is not None:
            pos = self.global_positions(L, x.device)
            N = L * rank_and_world(self.group)[1]
            q, k = self.rope(q, pos, seq_len=N), self.rope(k, pos, seq_len=N)
        out = ring_attention(
            q,
            k,
            v,
            group=self.group,
            mask=mask,
            layout=self.layout,
            timeout=self.timeout,
            pieces=self.pieces,
        )
        out = out.transpose(1, 2).reshape(B, L, self.num_heads * self.head_dim)  # (B, L, H D)
        return self.out_proj(out)
