"""T5's relative position bias (Raffel et al., 2020): learned scalars per head and bucket."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .._shapes import check_bool, check_head_index, check_int
from ._grid import dense_bias


def _check_buckets(num_buckets: int, max_distance: int, bidirectional: bool) -> None:
    check_int("num_buckets", num_buckets, minimum=1)
    check_int("max_distance", max_distance, minimum=1)
    check_bool("bidirectional", bidirectional)
    per_direction = num_buckets // 2 if bidirectional else num_buckets
    max_exact = per_direction // 2
    if max_exact and max_distance <= max_exact:
        raise ValueError(
            f"max_distance must be > {max_exact} (the exact buckets of num_buckets={num_buckets}), "
            f"got {max_distance}"
        )


def t5_bucket(
    relative_position: Tensor,
    *,
    num_buckets: int = 32,
    max_distance: int = 128,
    bidirectional: bool = True,
) -> Tensor:
    """T5's bucket of each relative position ``rel = j − i`` (key minus query).

    Bidirectional: half the buckets for ``rel <= 0``, the other half (offset by num_buckets/2)
    for ``rel > 0``.
    Causal: ``rel > 0`` (future keys) all land in bucket 0. Within a direction with n buckets,
    distances below n/2 get one bucket each; larger ones are log-spaced up to ``max_distance``::

        bucket(d) = n/2 + ⌊log(d / (n/2)) / log(max_distance / (n/2)) · (n − n/2)⌋, clipped to n − 1

    computed in float32 exactly like Mesh TensorFlow and HF transformers, so boundaries agree.
    Distances at or beyond ``max_distance`` land in the last bucket. ``num_buckets=1`` puts every
    distance in bucket 0.

    Args:
        relative_position: integer tensor of ``j − i`` values, any shape.
        num_buckets: total number of buckets.
        max_distance: distance from which everything shares the last bucket.
        bidirectional: False for decoders (causal attention).

    Returns:
        Long tensor of the same shape with values in ``[0, num_buckets)``.
    """
    _check_buckets(num_buckets, max_distance, bidirectional)
    rel = relative_position.to(torch.long)
    bucket = torch.zeros_like(rel)
    n = num_buckets
    if bidirectional:
        n //= 2
        bucket = bucket + (rel > 0).to(torch.long) * n
        distance = rel.abs()
    else:
        distance = (-rel).clamp_min(0)
    max_exact = n // 2
    if max_exact == 0:  # one bucket (or none) per direction: everything in it
        return bucket
    # Clamped so that log() never sees 0; where() discards those lanes anyway.
    far = distance.clamp_min(max_exact).float()
    large = max_exact + (
        torch.log(far / max_exact) / math.log(max_distance / max_exact) * (n - max_exact)
    ).to(torch.long)
    large = large.clamp_max(n - 1)
    return bucket + torch.where(distance < max_exact, distance, large)


class T5RelativeBias(nn.Module):
    """T5 relative bias as a function bias: ``bias[h, i, j] = W[bucket(j − i), h]``.

    Use it as ``attnlab.attention(q, k, v, bias=t5)``. It is evaluated on the index tensors of the
    call (``i`` = query position aligned bottom-right to the keys, ``j`` = key position) and
    depends only on their values, so a tiled backend evaluates it per tile and never builds the
    ``(H, L, S)`` matrix. Gradients flow into ``weight``.

    Args:
        num_heads: H, the number of query heads.
        num_buckets: number of distance buckets (T5: 32).
        max_distance: distance from which all positions share the last bucket (T5: 128).
        bidirectional: True for encoders, False for decoders.
        init_std: standard deviation of the normal initialisation of ``weight``.

    Attributes:
        weight: ``(num_buckets, H)`` learned scalars (HF's ``relative_attention_bias.weight``).
        relative: True: the bias depends only on the head and ``j − i`` (`is_relative_bias`), so
            the flash backend shares one bias tile across all query blocks of a window offset.

    Example:
        >>> t5 = T5RelativeBias(num_heads=8)
        >>> q = k = v = torch.randn(1, 8, 16, 32)
        >>> out = attnlab.attention(q, k, v, bias=t5)
    """

    relative = True

    def __init__(
        self,
        num_heads: int,
        num_buckets: int = 32,
        max_distance: int = 128,
        bidirectional: bool = True,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        self.num_heads = check_int("num_heads", num_heads, minimum=1)
        _check_buckets(num_buckets, max_distance, bidirectional)
        self.num_buckets = num_buckets
        self.max_distance = max_distance
        self.bidirectional = bidirectional
        self.weight = nn.Parameter(torch.empty(num_buckets, self.num_heads))
        nn.init.normal_(self.weight, std=init_std)

    def bucket(self, relative_position: Tensor) -> Tensor:
        """`t5_bucket` with this module's settings; ``relative_position = j − i``."""
        return t5_bucket(
            relative_position,
            num_buckets=self.num_buckets,
            max_distance=self.max_distance,
            bidirectional=self.bidirectional,
        )

    def forward(self, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:  # noqa: ARG002 (a bias function is fn(b, h, i, j))
        """The bias on broadcastable Long index tensors.

        Args:
            b: batch index ``(B, 1, 1, 1)`` (unused).
            h: head index ``(1, H, 1, 1)``.
            i: query position aligned to key coordinates ``(1, 1, L, 1)``.
            j: key position ``(1, 1, 1, S)``.

        Returns:
            ``(1, H, L, S)`` in the dtype of ``weight``.
        """
        check_head_index("T5RelativeBias", self.num_heads, h)
        buckets = self.bucket(j - i).to(self.weight.device)  # (1, 1, L, S)
        return self.weight[buckets, h.to(self.weight.device)]  # (1, H, L, S)

    def matrix(
        self, L: int, S: int | None = None, *, device: torch.device | str | None = None
    ) -> Tensor:
        """Dense bias ``(H, L, S)`` aligned bottom-right (``i = row + S − L``), for pictures."""
        device = self.weight.device if device is None else device
        return dense_bias(self, self.num_heads, L, S, device)

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, num_buckets={self.num_buckets}, "
            f"max_distance={self.max_distance}, bidirectional={self.bidirectional}"
        )
