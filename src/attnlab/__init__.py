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
    SinkCache,
    SlidingWindowCache,
)
from .positional import ALiBi, LearnedPositionalEmbedding, RoPE, SinusoidalEmbedding, T5RelativeBias
from .viz.attention_view import show  # the attention viewer (inline in Jupyter); no matplotlib

# ``attnlab.pos``, ``attnlab.linear`` and ``attnlab.nn`` are names, not files: all are registered
# in sys.modules, so ``import attnlab.pos as pos``, ``from attnlab.linear import LinearAttention``
# and ``from attnlab.nn import MultiheadAttention`` work.
# ``attnlab.pos`` is `attnlab.positional` itself (the same module object).
pos = positional
_sys.modules[__name__ + ".pos"] = positional
# Its submodules too (positional/__init__ imports every one), so ``import attnlab.pos.rope`` finds
# the module already loaded instead of running the file again as a second module with its own
# registries.
for _name, _module in list(_sys.modules.items()):
    if _name.startswith(positional.__name__ + "."):
        _sys.modules[__name__ + ".pos" + _name.removeprefix(positional.__name__)] = _module


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


def _nn_namespace() -> _types.ModuleType:
    """``attnlab.nn``: the drop-ins for ``torch.nn`` classes, under torch's names."""
    from .modules.torch_compat import MultiheadAttention

    members = {"MultiheadAttention": MultiheadAttention}
    name = __name__ + ".nn"
    module = _types.ModuleType(name, _NN_DOC)
    module.__dict__.update(members, __all__=list(members), __package__=__name__)
    module.__spec__ = _ModuleSpec(name, None)
    _sys.modules[name] = module
    return module


_NN_DOC = """Drop-in replacements for ``torch.nn`` classes, under torch's names, running on attnlab.

``attnlab.nn.X`` takes ``torch.nn.X``'s constructor, state dict, forward signature and mask
dialect, so swapping the import is the whole change. Today it holds ``MultiheadAttention``
(``key_padding_mask`` True = ignore, like torch; see `attnlab.modules.torch_compat`).

attnlab's own modules (``attnlab.MultiHeadAttention``, ``attnlab.AdditiveAttention``, the
caches…) do not live here, unlike torch.nn, which holds every module: this namespace promises
torch's contract, which they do not keep (True = may attend, bottom-right causal alignment), and
``MultiHeadAttention`` next to ``MultiheadAttention`` would again be two classes one capital
apart. They stay at ``attnlab.*`` and in `attnlab.modules`.

Example:
    >>> import torch
    >>> import attnlab.nn as ann
    >>> theirs = torch.nn.MultiheadAttention(64, 4, batch_first=True)
    >>> ours = ann.MultiheadAttention(64, 4, batch_first=True)
    >>> ours.load_state_dict(theirs.state_dict())
    <All keys matched successfully>
"""

nn = _nn_namespace()


def __getattr__(name: str) -> object:
    """The old spelling ``attnlab.MultiheadAttention``: one release, with a FutureWarning."""
    if name == "MultiheadAttention":
        from .modules.torch_compat import deprecated_alias

        return deprecated_alias(__name__ + ".MultiheadAttention")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    "nn",
    "pos",
    "positional",
    "refresh_settings",
    "save_checkpoint",
    "show",
    "viz",
]
