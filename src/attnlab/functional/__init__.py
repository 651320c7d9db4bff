"""Stateless attention math on tensors: the reference definitions and the fast backends."""

from . import reference
from .api import attention, explain
from .registry import Backend, backends, register_backend
from .request import BiasFn, Request
from .scores import SCORES, Score, register_score

__all__ = [
    "SCORES",
    "Backend",
    "BiasFn",
    "Request",
    "Score",
    "attention",
    "backends",
    "explain",
    "reference",
    "register_backend",
    "register_score",
]
