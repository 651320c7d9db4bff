"""The error the transformers bridge raises for a model it cannot run exactly."""

from __future__ import annotations


class UnsupportedAttentionError(ValueError):
    """A transformers model asks attnlab for an attention feature it does not implement.

    Raised at the first forward call, naming the feature (e.g. a ``position_bias``), so a
    model never gets a silently different answer; use ``attn_implementation="eager"`` for it.
    """


__all__ = ["UnsupportedAttentionError"]
