"""nn.Module wrappers: projections and state around the functional math, no new math."""

from .adaptive_span import AdaptiveSpan, AdaptiveSpanAttention
from .additive import AdditiveAttention
from .differential import DifferentialAttention
from .fnet import FNetMixing
from .gated import GatedAttention, OffsetRMSNorm
from .hierarchical import HierarchicalAttention
from .kv_cache import (
    CacheOverflowError,
    CacheView,
    KVCache,
    LatentCache,
    LatentView,
    SinkCache,
    SlidingWindowCache,
)
from .linear import LinearAttention, PerformerAttention
from .local_global import LocalGlobalAttention
from .mha import MultiHeadAttention
from .mla import MultiHeadLatentAttention, absorbed_latent_attention
from .shaw import ShawRelativeAttention
from .ssm import SelectiveSSM
from .stream_linear import StreamLinear
from .topk import RoutedAttention, TopKAttention
from .torch_compat import deprecated_alias as _deprecated_alias

# The drop-in for torch.nn.MultiheadAttention is attnlab.nn.MultiheadAttention; the old
# spelling attnlab.modules.MultiheadAttention stays one release, with a FutureWarning.


def __getattr__(name: str) -> object:
    if name == "MultiheadAttention":
        return _deprecated_alias(__name__ + ".MultiheadAttention")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AdaptiveSpan",
    "AdaptiveSpanAttention",
    "AdditiveAttention",
    "CacheOverflowError",
    "CacheView",
    "DifferentialAttention",
    "FNetMixing",
    "GatedAttention",
    "HierarchicalAttention",
    "KVCache",
    "LatentCache",
    "LatentView",
    "LinearAttention",
    "LocalGlobalAttention",
    "MultiHeadAttention",
    "MultiHeadLatentAttention",
    "OffsetRMSNorm",
    "PerformerAttention",
    "RoutedAttention",
    "SelectiveSSM",
    "ShawRelativeAttention",
    "SinkCache",
    "SlidingWindowCache",
    "StreamLinear",
    "TopKAttention",
    "absorbed_latent_attention",
]
