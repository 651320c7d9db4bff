"""attnlab: attention mechanisms in PyTorch — exact, fast on the machine at hand, easy to inspect.

Example:
    >>> import torch, attnlab
    >>> q, k, v = (torch.randn(1, 8, 128, 64) for _ in range(3))
    >>> out = attnlab.attention(q, k, v, mask=attnlab.masks.causal())
"""

import sys as _sys
import types as _types
from importlib.machinery import ModuleSpec as _ModuleSpec
from importlib.metadata import PackageNotFoundError, version

from . import analysis, checkpoint, functional, masks, models, positional, viz
from ._settings import refresh as refresh_settings
from .analysis import estimate
from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from .functional import (
    AttentionStats,
    Explanation,
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
from .viz.attention_view import show  # the attention viewer (inline in Jupyter); no matplotlib

# ``attnlab.pos`` and ``attnlab.linear`` are names, not files: both are registered in sys.modules,
# so ``import attnlab.pos as pos`` and ``from attnlab.linear import LinearAttention`` work.
# ``attnlab.pos`` is `attnlab.positional` itself (the same module object).
pos = positional
_sys.modules[__name__ + ".pos"] = positional


def _linear_namespace() -> _types.ModuleType:
    """``attnlab.linear``: the approximations and mixing layers, functions and modules together."""
    from .functional.fnet import fnet_mixing
    from .functional.hierarchical import hierarchical_attention
    from .functional.linear import FEATURE_MAPS, LinearAttentionState, linear_attention
    from .functional.performer import favor_attention, favor_features, favor_projection
    from .modules.fnet import FNetMixing
    from .modules.hierarchical import HierarchicalAttention
    from .modules.linear import LinearAttention, PerformerAttention

    members = {
        "FEATURE_MAPS": FEATURE_MAPS,
        "FNetMixing": FNetMixing,
        "HierarchicalAttention": HierarchicalAttention,
        "LinearAttention": LinearAttention,
        "LinearAttentionState": LinearAttentionState,
        "PerformerAttention": PerformerAttention,
        "favor_attention": favor_attention,
        "favor_features": favor_features,
        "favor_projection": favor_projection,
        "fnet_mixing": fnet_mixing,
        "hierarchical_attention": hierarchical_attention,
        "linear_attention": linear_attention,
    }
    name = __name__ + ".linear"
    module = _types.ModuleType(name, _LINEAR_DOC)
    module.__dict__.update(members, __all__=list(members), __package__=__name__)
    module.__spec__ = _ModuleSpec(name, None)
    _sys.modules[name] = module
    return module


_LINEAR_DOC = """Efficient approximations of attention: linear attention, Performer (FAVOR+), FNet
mixing and hierarchical attention — functions and thin modules in one namespace.

Each fast form equals an explicit quadratic definition in `attnlab.functional.reference`
(``linear_attention``, ``favor_attention``, ``fnet_mixing``, ``hierarchical_attention``).

Example:
    >>> import torch
    >>> from attnlab import linear, masks
    >>> q = k = v = torch.randn(1, 8, 16384, 64)
    >>> out = linear.linear_attention(q, k, v, mask=masks.causal())  # O(L) time and memory
    >>> approx = linear.PerformerAttention(head_dim=64, seed=0)(q, k, v)  # ≈ softmax attention
"""

linear = _linear_namespace()

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
    "Explanation",
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
    "refresh_settings",
    "save_checkpoint",
    "show",
    "viz",
]
