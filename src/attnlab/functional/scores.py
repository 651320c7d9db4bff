"""Score functions: how a query and a key become a logit before scaling.

Every score here reduces to a dot product of *prepared* queries and keys, so that the fused kernels
can run it: ``score(q, k) = prepare_q(q) · prepare_k(k)``. A score is a registry entry, not a flag.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

_COSINE_EPS = 1e-12


@dataclass(frozen=True)
class Score:
    """A score function ``s(q, k) = prepare(q) · prepare(k)`` and its default scale.

    Attributes:
        name: registry name.
        prepare: maps q ``(…, L, D)`` or k ``(…, S, D)`` to the vectors that are dot-multiplied.
        default_scale: scale used when the caller passes ``scale=None``, as a function of D.
    """

    name: str
    prepare: Callable[[Tensor], Tensor]
    default_scale: Callable[[int], float]


def _identity(x: Tensor) -> Tensor:
    return x


def _unit(x: Tensor) -> Tensor:
    # x / max(‖x‖, eps): a zero vector has cosine 0 with everything.
    return x / x.norm(dim=-1, keepdim=True).clamp_min(_COSINE_EPS)


def _inv_sqrt(d: int) -> float:
    return 1.0 / math.sqrt(d) if d > 0 else 1.0


SCORES: dict[str, Score] = {
    # s = q·k, scaled by 1/√D (Vaswani et al.: logit variance ≈ 1 for unit-variance inputs).
    "dot": Score("dot", _identity, _inv_sqrt),
    # s = cos(q, k) = q·k / (‖q‖‖k‖) in [−1, 1]; default scale 1 (sharpen via scale/temperature).
    "cosine": Score("cosine", _unit, lambda _d: 1.0),
}


def get_score(name: object) -> Score:
    """Looks up a score by name; raises ValueError listing the known names."""
    if not isinstance(name, str) or name not in SCORES:
        raise ValueError(f"score must be one of {sorted(SCORES)}, got {name!r}")
    return SCORES[name]


def register_score(
    name: str, prepare: Callable[[Tensor], Tensor], default_scale: Callable[[int], float]
) -> None:
    """Adds a dot-reducible score ``s(q, k) = prepare(q) · prepare(k)`` to the registry."""
    if name in SCORES:
        raise ValueError(f"score {name!r} is already registered")
    SCORES[name] = Score(name, prepare, default_scale)


__all__ = ["SCORES", "Score", "get_score", "register_score"]
