"""nn.Module wrappers: projections and state around the functional math, no new math."""

from .additive import AdditiveAttention

__all__ = ["AdditiveAttention"]
