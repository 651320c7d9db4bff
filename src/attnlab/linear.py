"""Efficient approximations of attention: linear attention, Performer (FAVOR+), FNet mixing and
hierarchical attention — functions and thin modules in one namespace.

Each fast form equals an explicit quadratic definition in `attnlab.functional.reference`
(``linear_attention``, ``favor_attention``, ``fnet_mixing``, ``hierarchical_attention``).

Example:
    >>> import torch
    >>> from attnlab import linear
    >>> q = k = v = torch.randn(1, 8, 16384, 64)
    >>> out = linear.linear_attention(q, k, v, causal=True)        # O(L) time and memory
    >>> approx = linear.PerformerAttention(head_dim=64, seed=0)(q, k, v)  # ≈ softmax attention
"""

from .functional.fnet import fnet_mixing
from .functional.hierarchical import hierarchical_attention
from .functional.linear import FEATURE_MAPS, LinearAttentionState, linear_attention
from .functional.performer import favor_attention, favor_features, favor_projection
from .modules.fnet import FNetMixing
from .modules.hierarchical import HierarchicalAttention
from .modules.linear import LinearAttention, PerformerAttention

__all__ = [
    "FEATURE_MAPS",
    "FNetMixing",
    "HierarchicalAttention",
    "LinearAttention",
    "LinearAttentionState",
    "PerformerAttention",
    "favor_attention",
    "favor_features",
    "favor_projection",
    "fnet_mixing",
    "hierarchical_attention",
    "linear_attention",
]
