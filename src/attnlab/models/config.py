"""`TransformerConfig`: every size and choice of the small Transformer, validated once."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from .._fit import ConfigRule
from .._shapes import check_int, check_number, check_probability

NORMS = ("layernorm", "rmsnorm")
MLPS = ("gelu", "swiglu")
ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "silu")
POSITIONALS = ("rope", "learned", "sinusoidal", "alibi", "t5", None)
#: The largest ``max_seq_len`` a checkpoint may store when no tensor sizes it (RoPE, ALiBi,
#: sinusoidal or no positions; "learned" positions are a table of exactly that many rows):
#: 2**24 = 16,777,216 tokens, above the longest context any released model was trained for.
MAX_UNSIZED_SEQ_LEN = 1 << 24
#: The most T5 buckets a checkpoint without a T5 table may store (its table sizes them otherwise).
MAX_T5_BUCKETS = 1 << 16


def _choice(name: str, value: object, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


@dataclass
class TransformerConfig:
    """Sizes and choices of `GPT` and `Encoder` (nanoGPT-style: one screen, validated on creation).

    Attributes:
        vocab_size: V, number of token ids.
        d_model: E, the residual width.
        n_layers: number of blocks (`TransformerBlock`).
        n_heads: H, query heads (``d_model % n_heads == 0``; head dim ``D = E / H``).
        n_kv_heads: H_kv key/value heads (GQA; None = H; ``H % H_kv == 0``).
        d_ff: hidden width of the MLP (None = 4·E for "gelu", the multiple of 8 nearest
            8·E/3 for "swiglu", which keeps the parameter count of a 4·E GELU MLP).
        max_seq_len: the longest sequence (prompt + cache) the model accepts.
        dropout: dropout on embeddings, attention weights and residual branches (training only).
        norm: "layernorm" or "rmsnorm".
        norm_eps: ε of the norms.
        prenorm: True for pre-LN blocks ``x + f(norm(x))``, False for post-LN ``norm(x + f(x))``.
        mlp: "gelu" (``W2 · gelu(W1 x)``) or "swiglu" (``W_d · (silu(W_g x) ⊙ W_u x)``).
        activation: the MLP's nonlinearity: "gelu" (exact, erf), "gelu_tanh" (tanh
            approximation), "relu" or "silu"; None = the MLP's own (exact GELU for "gelu", SiLU
            for "swiglu").
        positional: "rope", "learned", "sinusoidal", "alibi", "t5" (T5's bucketed relative
            bias, one learned table ``(t5_buckets, H)`` shared by every layer) or None (NoPE).
        rope_base: θ of RoPE. rope_scaling: an HF-style RoPE scaling dict, or None.
        t5_buckets: the number of distance buckets of ``positional="t5"`` (T5: 32).
        t5_max_distance: the distance from which every key shares T5's last bucket (T5: 128).
        bias: biases in the linear layers and the LayerNorms.
        tie_embeddings: the output projection shares the token embedding matrix (GPT).
        type_vocab_size: number of token types (segments) whose embeddings `Encoder` adds to the
            token embeddings (BERT); 0 = none.
        embed_norm: a norm on the summed embeddings before the first block (BERT).
        pad_token_id: the padding token id (its embedding row starts at zero and gets no
            gradient), or None.
        attn_backend: the `attnlab.attention` backend of every attention layer.
    """

    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None
    d_ff: int | None = None
    max_seq_len: int = 256
    dropout: float = 0.0
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    prenorm: bool = True
    mlp: str = "gelu"
    positional: str | None = "rope"
    rope_base: float = 10000.0
    rope_scaling: dict[str, Any] | None = field(default=None)
    t5_buckets: int = 32
    t5_max_distance: int = 128
    bias: bool = True
    tie_embeddings: bool = True
    activation: str | None = None
    type_vocab_size: int = 0
    embed_norm: bool = False
    pad_token_id: int | None = None
    attn_backend: str = "auto"

    def __post_init__(self) -> None:
        check_int("vocab_size", self.vocab_size, minimum=1)
        check_int("d_model", self.d_model, minimum=1)
        check_int("n_layers", self.n_layers, minimum=0)
        check_int("n_heads", self.n_heads, minimum=1)
        check_int("max_seq_len", self.max_seq_len, minimum=1)
        check_int("type_vocab_size", self.type_vocab_size, minimum=0)
        check_int("t5_buckets", self.t5_buckets, minimum=1)
        check_int("t5_max_distance", self.t5_max_distance, minimum=1)
        if self.pad_token_id is not None:
            check_int("pad_token_id", self.pad_token_id, minimum=0)
            if self.pad_token_id >= self.vocab_size:
                raise ValueError(
                    f"pad_token_id must be < vocab_size={self.vocab_size}, got {self.pad_token_id}"
                )
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
        if self.n_kv_heads is not None:
            check_int("n_kv_heads", self.n_kv_heads, minimum=1)
            if self.n_heads % self.n_kv_heads:
                raise ValueError(
                    f"n_heads={self.n_heads} must be divisible by n_kv_heads={self.n_kv_heads}"
                )
        if self.d_ff is not None:
            check_int("d_ff", self.d_ff, minimum=1)
        check_number("dropout", self.dropout)
        check_probability("dropout", self.dropout)
        check_number("norm_eps", self.norm_eps, positive=True)
        check_number("rope_base", self.rope_base, greater=1.0)
        _choice("norm", self.norm, NORMS)
        _choice("mlp", self.mlp, MLPS)
        _choice("positional", self.positional, POSITIONALS)
        if self.activation is not None:
            _choice("activation", self.activation, ACTIVATIONS)
        if self.attn_backend != "auto":
            from ..functional.registry import backends

            _choice("attn_backend", self.attn_backend, tuple(backends()))
        for name in ("prenorm", "bias", "tie_embeddings", "embed_norm"):
            if not isinstance(getattr(self, name), bool):
                value = getattr(self, name)
                raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
        if self.positional == "rope" and self.head_dim % 2:
            raise ValueError(
                f"positional='rope' needs an even head dim, got d_model/n_heads = "
                f"{self.d_model}/{self.n_heads} = {self.head_dim}"
            )
        if self.positional == "sinusoidal" and self.d_model % 2:
            raise ValueError(f"positional='sinusoidal' needs an even d_model, got {self.d_model}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, dict):
            raise TypeError(
                f"rope_scaling must be a dict or None, got {type(self.rope_scaling).__name__}"
            )

    @property
    def head_dim(self) -> int:
        """D = d_model / n_heads."""
        return self.d_model // self.n_heads

    @property
    def ff_dim(self) -> int:
        """The MLP hidden width actually used (see ``d_ff``)."""
        if self.d_ff is not None:
            return self.d_ff
        if self.mlp == "swiglu":
            return max(8, 8 * round(8 * self.d_model / 3 / 8))
        return 4 * self.d_model

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; ``TransformerConfig.from_dict(c.to_dict()) == c``."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TransformerConfig:
        """The inverse of `to_dict`; unknown keys raise ValueError naming them."""
        if not isinstance(data, dict):
            raise TypeError(f"config must be a dict, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"unknown TransformerConfig field(s) {unknown}; known: {sorted(known)}"
            )
        return cls(**data)


def checkpoint_rules(field_root: str = "", tensor_root: str = "") -> tuple[ConfigRule, ...]:
    """How a checkpoint's tensors justify a stored `TransformerConfig` (`GPT` or `Encoder`).

    The layer count is the number of ``blocks.<i>`` in the file; ``vocab_size`` and
    ``d_model`` are the token table's shape; ``max_seq_len`` is the learned position table's
    rows, or at most `MAX_UNSIZED_SEQ_LEN` without one; ``t5_buckets`` is the T5 bias table's
    rows, or at most `MAX_T5_BUCKETS` without one; ``type_vocab_size`` is the token-type
    table's rows, or 0 without one (a `GPT` has none); ``d_ff`` is the MLP's hidden width; the
    other integer fields are type-checked. For `attnlab._fit.justify_config`.

    Args:
        field_root: where the config sits in the stored config (e.g. ``"encoder."``).
        tensor_root: where the model's tensors sit below the loader's prefix (e.g.
            ``"encoder."``).
    """
    f, t = field_root, tensor_root
    mlp = (f"{t}blocks.0.mlp.fc1.weight", f"{t}blocks.0.mlp.up.weight")
    return (
        ConfigRule(f"{f}n_layers", layers=f"{t}blocks"),
        ConfigRule(f"{f}vocab_size", low=1, tensor=f"{t}tok_emb.weight", dim=0),
        ConfigRule(f"{f}d_model", low=1, tensor=f"{t}tok_emb.weight", dim=1),
        ConfigRule(f"{f}n_heads", low=1),
        ConfigRule(f"{f}n_kv_heads", low=1, optional=True),
        ConfigRule(f"{f}d_ff", low=1, tensor=mlp, dim=0, optional=True),
        ConfigRule(
            f"{f}max_seq_len",
            low=1,
            tensor=f"{t}pos_emb.weight",
            dim=0,
            limit=MAX_UNSIZED_SEQ_LEN,
        ),
        ConfigRule(f"{f}type_vocab_size", tensor=f"{t}type_emb.weight", dim=0, absent=0),
        ConfigRule(f"{f}pad_token_id", optional=True),
        ConfigRule(
            f"{f}t5_buckets",
            low=1,
            tensor=f"{t}blocks.0.attn.bias_fn.weight",
            dim=0,
            limit=MAX_T5_BUCKETS,
        ),
        ConfigRule(f"{f}t5_max_distance", low=1, limit=MAX_UNSIZED_SEQ_LEN),
    )
