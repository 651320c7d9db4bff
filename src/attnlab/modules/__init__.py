"""nn.Module wrappers: projections and state around the functional math, no new math."""

from .additive import AdditiveAttention
from .kv_cache import CacheOverflowError, CacheView, KVCache, SinkCache, SlidingWindowCache
from .mha import MultiHeadAttention
from .torch_compat import MultiheadAttention

__all__ = [
    "AdditiveAttention",
    "CacheOverflowError",
    "CacheView",
    "KVCache",
    "MultiHeadAttention",
    "MultiheadAttention",
    "SinkCache",
    "SlidingWindowCache",
]
