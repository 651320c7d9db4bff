"""Attention for sequences sharded across processes and machines (torch.distributed)."""

from .ring import LAYOUTS, RingAttentionError, chunk_ids, ring_attention, shard, unshard
from .ring_mha import RingMultiHeadAttention

__all__ = [
    "LAYOUTS",
    "RingAttentionError",
    "RingMultiHeadAttention",
    "chunk_ids",
    "ring_attention",
    "shard",
    "unshard",
]
