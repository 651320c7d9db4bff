"""attnlab: attention mechanisms in PyTorch — exact, fast on the machine at hand, easy to inspect.

Example:
    >>> import torch, attnlab
    >>> q, k, v = (torch.randn(1, 8, 128, 64) for _ in range(3))
    >>> out = attnlab.attention(q, k, v, mask=attnlab.masks.causal())
"""

from importlib.metadata import PackageNotFoundError, version

from . import analysis, checkpoint, functional, linear, masks, models, pos, positional, viz
from .analysis import estimate
from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from .functional import (
    AttentionStats,
    attention,
    attention_stats,
    attention_weights,
    backends,
    explain,
    merge_partials,
)
from .masks import Mask
from .modules import (
    AdditiveAttention,
    CacheOverflowError,
    KVCache,
    MultiHeadAttention,
    MultiheadAttention,
    SinkCache,
    SlidingWindowCache,
)
from .positional import ALiBi, LearnedPositionalEmbedding, RoPE, SinusoidalEmbedding, T5RelativeBias

try:
    __version__ = version("attnlab")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0+unknown"

__all__ = [
    "ALiBi",
    "AdditiveAttention",
    "AttentionStats",
    "CacheOverflowError",
    "CheckpointError",
    "KVCache",
    "LearnedPositionalEmbedding",
    "Mask",
    "MultiHeadAttention",
    "MultiheadAttention",
    "RoPE",
    "SinkCache",
    "SinusoidalEmbedding",
    "SlidingWindowCache",
    "T5RelativeBias",
    "__version__",
    "analysis",
    "attention",
    "attention_stats",
    "attention_weights",
    "backends",
    "checkpoint",
    "estimate",
    "explain",
    "functional",
    "linear",
    "load_checkpoint",
    "masks",
    "merge_partials",
    "models",
    "pos",
    "positional",
    "save_checkpoint",
    "viz",
]
