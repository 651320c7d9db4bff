"""nn.Module wrappers: projections and state around the functional math, no new math."""

from .adaptive_span import AdaptiveSpan, AdaptiveSpanAttention
from .additive import AdditiveAttention
from .fnet import FNetMixing
from .hierarchical import HierarchicalAttention
from .kv_cache import CacheOverflowError, CacheView, KVCache, SinkCache, SlidingWindowCache
from .linear import LinearAttention, PerformerAttention
from .mha import MultiHeadAttention
from .shaw import ShawRelativeAttention
from .stream_linear import StreamLinear
from .torch_compat import MultiheadAttention

__all__ = [
    "AdaptiveSpan",
    "AdaptiveSpanAttention",
    "AdditiveAttention",
    "CacheOverflowError",
    "CacheView",
    "FNetMixing",
    "HierarchicalAttention",
    "KVCache",
    "LinearAttention",
    "MultiHeadAttention",
    "MultiheadAttention",
    "PerformerAttention",
    "ShawRelativeAttention",
    "SinkCache",
    "SlidingWindowCache",
    "StreamLinear",
]
