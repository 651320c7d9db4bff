"""attnlab: attention mechanisms in PyTorch — exact, fast on the machine at hand, easy to inspect.

Example:
    >>> import torch, attnlab
    >>> q, k, v = (torch.randn(1, 8, 128, 64) for _ in range(3))
    >>> out = attnlab.attention(q, k, v, mask=attnlab.masks.causal())
"""

import importlib as _importlib
import sys as _sys
import types as _types
from importlib.abc import Loader as _Loader
from importlib.abc import MetaPathFinder as _MetaPathFinder
from importlib.machinery import ModuleSpec as _ModuleSpec
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

# ``import attnlab`` loads no torch: every public name below is imported on first use (PEP 562),
# so the ``attnlab`` command's ``--help`` answers at once. The names, and where each lives:
_SUBMODULES = ("analysis", "checkpoint", "functional", "masks", "models", "positional", "viz")
_NAMES = {
    "refresh_settings": ("_settings", "refresh"),
    "estimate": ("analysis", "estimate"),
    **dict.fromkeys(("CheckpointError", "load_checkpoint", "save_checkpoint"), ("checkpoint", "")),
    **dict.fromkeys(
        (
            "AttentionStats",
            "Explanation",
            "attention",
            "attention_stats",
            "attention_weights",
            "backends",
            "explain",
            "local_global_attention",
            "merge_partials",
            "routing_attention",
            "selective_scan",
            "sigmoid_attention",
            "topk_attention",
            "varlen_attn",
        ),
        ("functional", ""),
    ),
    "Mask": ("masks", ""),
    **dict.fromkeys(
        (
            "AdditiveAttention",
            "CacheOverflowError",
            "DifferentialAttention",
            "GatedAttention",
            "KVCache",
            "LatentCache",
            "LocalGlobalAttention",
            "MultiHeadAttention",
            "MultiHeadLatentAttention",
            "RoutedAttention",
            "SelectiveSSM",
            "SinkCache",
            "SlidingWindowCache",
            "TopKAttention",
        ),
        ("modules", ""),
    ),
    **dict.fromkeys(
        ("ALiBi", "LearnedPositionalEmbedding", "RoPE", "SinusoidalEmbedding", "T5RelativeBias"),
        ("positional", ""),
    ),
    "show": ("viz.attention_view", ""),  # the attention viewer (inline in Jupyter); no matplotlib
}

if TYPE_CHECKING:  # what type checkers and editors see: the same names, imported eagerly
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
        local_global_attention,
        merge_partials,
        routing_attention,
        selective_scan,
        sigmoid_attention,
        topk_attention,
        varlen_attn,
    )
    from .masks import Mask
    from .modules import (
        AdditiveAttention,
        CacheOverflowError,
        DifferentialAttention,
        GatedAttention,
        KVCache,
        LatentCache,
        LocalGlobalAttention,
        MultiHeadAttention,
        MultiHeadLatentAttention,
        RoutedAttention,
        SelectiveSSM,
        SinkCache,
        SlidingWindowCache,
        TopKAttention,
    )
    from .positional import (
        ALiBi,
        LearnedPositionalEmbedding,
        RoPE,
        SinusoidalEmbedding,
        T5RelativeBias,
    )
    from .viz.attention_view import show


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
    module = _types.ModuleType(__name__ + ".linear", _LINEAR_DOC)
    module.__dict__.update(members, __all__=list(members), __package__=__name__)
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


def _nn_namespace() -> _types.ModuleType:
    """``attnlab.nn``: the drop-ins for ``torch.nn`` classes, under torch's names."""
    from .modules.torch_compat import MultiheadAttention

    members = {"MultiheadAttention": MultiheadAttention}
    module = _types.ModuleType(__name__ + ".nn", _NN_DOC)
    module.__dict__.update(members, __all__=list(members), __package__=__name__)
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


_NAMESPACES = {"linear": _linear_namespace, "nn": _nn_namespace}


class _Names(_MetaPathFinder, _Loader):
    """Imports the names that are not files: ``attnlab.pos`` — `attnlab.positional` itself, the same
    module object, and ``attnlab.pos.X`` its submodule ``X`` — and the namespaces
    ``attnlab.linear`` and ``attnlab.nn``, each built when first imported."""

    def __init__(self) -> None:
        self.specs: dict[int, _ModuleSpec] = {}  # a real module's own spec, by id, while aliased

    def find_spec(self, fullname: str, _path: object = None, _target: object = None):
        parts = fullname.split(".")
        if parts[0] != __name__ or len(parts) < 2:
            return None
        if parts[1] == "pos" or (len(parts) == 2 and parts[1] in _NAMESPACES):
            return _ModuleSpec(fullname, self)
        return None

    def create_module(self, spec: _ModuleSpec) -> _types.ModuleType:
        head, _, rest = spec.name.removeprefix(__name__ + ".").partition(".")
        if head in _NAMESPACES:
            return _NAMESPACES[head]()
        real = _importlib.import_module(".".join((__name__, "positional", rest)).rstrip("."))
        self.specs[id(real)] = real.__spec__  # the import system sets the alias's spec on it
        return real

    def exec_module(self, module: _types.ModuleType) -> None:
        spec = self.specs.pop(id(module), None)
        if spec is not None:  # an alias of a real module keeps its own spec
            module.__spec__ = spec


if not any(isinstance(f, _Names) for f in _sys.meta_path):
    _sys.meta_path.insert(0, _Names())  # before the path finder, which would load pos's files twice


def __getattr__(name: str) -> object:
    if name in _SUBMODULES or name in ("pos", "linear", "nn"):
        return _importlib.import_module(f"{__name__}.{name}")
    if name in _NAMES:
        where, attr = _NAMES[name]
        value = getattr(_importlib.import_module(f"{__name__}.{where}"), attr or name)
        globals()[name] = value  # found once; later reads are plain attribute reads
        return value
    if name == "MultiheadAttention":
        from .modules.torch_compat import deprecated_alias

        return deprecated_alias(__name__ + ".MultiheadAttention")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


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
    "DifferentialAttention",
    "Explanation",
    "GatedAttention",
    "KVCache",
    "LatentCache",
    "LearnedPositionalEmbedding",
    "LocalGlobalAttention",
    "Mask",
    "MultiHeadAttention",
    "MultiHeadLatentAttention",
    "RoPE",
    "RoutedAttention",
    "SelectiveSSM",
    "SinkCache",
    "SinusoidalEmbedding",
    "SlidingWindowCache",
    "T5RelativeBias",
    "TopKAttention",
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
    "local_global_attention",
    "masks",
    "merge_partials",
    "models",
    "nn",
    "pos",
    "positional",
    "refresh_settings",
    "routing_attention",
    "save_checkpoint",
    "selective_scan",
    "show",
    "sigmoid_attention",
    "topk_attention",
    "varlen_attn",
    "viz",
]
