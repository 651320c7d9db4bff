"""Stateless attention math on tensors: the reference definitions and the fast backends."""

from . import reference, varlen
from .api import attention, attention_stats, attention_weights, explain, flash_attention
from .explanation import Explanation
from .local_global import local_global_attention
from .merge import merge_partials
from .registry import Backend, backends, register_backend
from .request import SCORES, BiasFn, Request, Score, register_score
from .routing import routing_attention, routing_mask
from .selective_scan import selective_scan
from .sigmoid import sigmoid_attention
from .sinks import apply_sinks
from .stats import AttentionStats
from .topk import topk_attention
from .varlen import varlen_attn

__all__ = [
    "SCORES",
    "AttentionStats",
    "Backend",
    "BiasFn",
    "Explanation",
    "Request",
    "Score",
    "apply_sinks",
    "attention",
    "attention_stats",
    "attention_weights",
    "backends",
    "explain",
    "flash_attention",
    "local_global_attention",
    "merge_partials",
    "reference",
    "register_backend",
    "register_score",
    "routing_attention",
    "routing_mask",
    "selective_scan",
    "sigmoid_attention",
    "topk_attention",
    "varlen",
    "varlen_attn",
]
