"""Positional encodings: sinusoidal, learned, T5 relative bias, ALiBi and RoPE (+ scaling registry).

Absolute encodings (`sinusoidal`, `SinusoidalEmbedding`, `LearnedPositionalEmbedding`) are added to
the token embeddings. `T5RelativeBias` and `ALiBi` are function biases for
``attnlab.attention(..., bias=fn)``. `RoPE` rotates q and k before attention; its frequency
scaling (linear, ntk, dynamic, yarn, llama3, longrope) is the registry `rope_scaling.ROPE_SCALING`.
`ConcatPositionalEncoding` concatenates an encoding to the embeddings instead of adding it.
`ShawRelativePositions` / `shaw_attention` are Shaw et al.'s clipped relative key and value
tables (not a bias: a dense attention path of their own).

Example:
    >>> import torch, attnlab
    >>> from attnlab.positional import ALiBi, RoPE
    >>> q, k, v = (torch.randn(1, 8, 32, 64) for _ in range(3))
    >>> rope = RoPE(64)
    >>> out = attnlab.attention(rope(q), rope(k), v, mask=attnlab.masks.causal())
    >>> out = attnlab.attention(q, k, v, mask=attnlab.masks.causal(), bias=ALiBi(8))
"""

from . import rope_scaling
from ._grid import dense_bias
from .alibi import ALiBi, alibi_slopes
from .concat import ConcatPositionalEncoding
from .learned import LearnedPositionalEmbedding
from .rope import RoPE
from .rope_scaling import ROPE_SCALING, compute_rope_parameters, register_rope_scaling
from .shaw import ShawRelativePositions, shaw_attention
from .sinusoidal import SinusoidalEmbedding, sinusoidal, sinusoidal_shift
from .t5 import T5RelativeBias, t5_bucket

__all__ = [
    "ROPE_SCALING",
    "ALiBi",
    "ConcatPositionalEncoding",
    "LearnedPositionalEmbedding",
    "RoPE",
    "ShawRelativePositions",
    "SinusoidalEmbedding",
    "T5RelativeBias",
    "alibi_slopes",
    "compute_rope_parameters",
    "dense_bias",
    "register_rope_scaling",
    "rope_scaling",
    "shaw_attention",
    "sinusoidal",
    "sinusoidal_shift",
    "t5_bucket",
]
