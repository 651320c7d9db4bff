"""Registers the built-in backends. Importing this module fills the registry."""

from __future__ import annotations

from .reference_backend import reference_run
from .registry import Backend, register_backend
from .sdpa import sdpa_run, sdpa_supports

register_backend(
    Backend(
        "reference",
        reference_run,
        lambda req: None,
        "the explicit definition in functional/reference.py (float64-capable, returns weights)",
    ),
    auto_rank=0,
)
register_backend(
    Backend(
        "sdpa",
        sdpa_run,
        sdpa_supports,
        "torch.nn.functional.scaled_dot_product_attention (fused; CPU flash kernel)",
        tiled=True,
    ),
    auto_rank=0,
)
