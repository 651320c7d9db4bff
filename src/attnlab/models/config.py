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
#: A layer's attention span in ``layer_types`` (transformers' names: Mistral, Gemma 2/3, Qwen 2).
LAYER_TYPES = ("full_attention", "sliding_attention")
#: The attention of every block: "softmax" (`MultiHeadAttention`) or "local_global"
#: (`attnlab.modules.LocalGlobalAttention`: local heads in a window, global heads over all keys).
ATTENTIONS = ("softmax", "local_global")
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
        sliding_window: W, the keys a sliding layer attends (Mistral's convention, the query
            itself included: query i sees keys ``i − W < j <= i``), and the local heads' window
            with ``attention="local_global"``; None = no window.
        layer_types: one of "sliding_attention" / "full_attention" per layer (transformers'
            ``layer_types``; Gemma 2/3-style interleaving, see `interleaved_layer_types`); None =
            every layer "sliding_attention" when ``sliding_window`` is set (Mistral), else
            "full_attention". Sliding layers need ``sliding_window``.
        attention: "softmax" (multi-head attention) or "local_global"
            (`attnlab.modules.LocalGlobalAttention` in every layer: ``local_heads`` heads attend
            within ``sliding_window``, the others to every key, outputs concatenated over heads).
        local_heads: with "local_global", the number of local heads (a multiple of
            ``H / H_kv``); None = the largest such multiple <= H / 2.
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
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    attention: str = "softmax"
    local_heads: int | None = None

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
        self._check_windows()

    def _check_windows(self) -> None:
        """Checks ``sliding_window``, ``layer_types``, ``attention`` and ``local_heads``."""
        if self.sliding_window is not None:
            check_int("sliding_window", self.sliding_window, minimum=1)
        _choice("attention", self.attention, ATTENTIONS)
        if self.layer_types is not None:
            if not isinstance(self.layer_types, (list, tuple)):
                raise TypeError(
                    f"layer_types must be a list of {list(LAYER_TYPES)} or None, got "
                    f"{type(self.layer_types).__name__}"
                )
            self.layer_types = list(self.layer_types)
            if len(self.layer_types) != self.n_layers:
                raise ValueError(
                    f"layer_types must name n_layers={self.n_layers} layers, got "
                    f"{len(self.layer_types)}: {self.layer_types}"
                )
            for i, kind in enumerate(self.layer_types):
                _choice(f"layer_types[{i}]", kind, LAYER_TYPES)
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise ValueError(
                    "layer_types has 'sliding_attention' layers but sliding_window is None: "
                    "give the window W"
                )
        if self.attention == "local_global":
            self._check_local_global()
        elif self.local_heads is not None:
            raise ValueError(
                f"local_heads={self.local_heads} is for attention='local_global', got "
                f"attention={self.attention!r}"
            )

    def _check_local_global(self) -> None:
        if self.sliding_window is None:
            raise ValueError("attention='local_global' needs sliding_window (the local window)")
        if self.layer_types is not None:
            raise ValueError(
                "attention='local_global' puts local and global heads in every layer: "
                f"layer_types must be None, got {self.layer_types}"
            )
        if self.positional == "alibi":
            raise ValueError(
                "attention='local_global' splits the heads in two calls: positional='alibi' "
                "(a per-head bias) is not supported with it"
            )
        G = self.n_heads // (self.n_kv_heads or self.n_heads)
        if self.local_heads is None:
            return
        check_int("local_heads", self.local_heads, minimum=0)
        if self.local_heads > self.n_heads or self.local_heads % G:
            raise ValueError(
                f"local_heads must be a multiple of n_heads / n_kv_heads = {G} in "
                f"[0, n_heads={self.n_heads}], got {self.local_heads}"
            )

    @property
    def local_head_count(self) -> int:
        """The local heads of ``attention="local_global"`` (``local_heads`` or its default)."""
        if self.local_heads is not None:
            return self.local_heads
        G = self.n_heads // (self.n_kv_heads or self.n_heads)
        return (self.n_heads // 2) // G * G

    def layer_window(self, layer: int) -> int | None:
        """W for a sliding layer ``layer`` (0-based), None for a full-attention layer (and for
        every layer with ``attention="local_global"``, whose heads hold the window)."""
        if self.sliding_window is None or self.attention != "softmax":
            return None
        if self.layer_types is None or self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    @property
    def has_window(self) -> bool:
        """Whether some layer or head attends within ``sliding_window`` (causal-LM options)."""
        return any(self.layer_window(i) is not None for i in range(self.n_layers)) or (
            self.attention == "local_global"
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


def interleaved_layer_types(n_layers: int, local_per_global: int) -> list[str]:
    """``layer_types`` with ``local_per_global`` sliding layers before each full one.

    Layer i is "full_attention" iff ``(i + 1) % (local_per_global + 1) == 0``: Gemma 2 is
    ``local_per_global=1`` (sliding, full, sliding, …), Gemma 3 is 5 (five sliding, one full).

    Example:
        >>> interleaved_layer_types(4, 1)
        ['sliding_attention', 'full_attention', 'sliding_attention', 'full_attention']
    """
    check_int("n_layers", n_layers, minimum=0)
    check_int("local_per_global", local_per_global, minimum=0)
    period = local_per_global + 1
    return [
        "full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(n_layers)
    ]


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
        ConfigRule(f"{f}sliding_window", low=1, optional=True),
        ConfigRule(f"{f}local_heads", optional=True),
        ConfigRule(
            f"{f}t5_buckets",
            low=1,
            tensor=f"{t}blocks.0.attn.bias_fn.weight",
            dim=0,
            limit=MAX_T5_BUCKETS,
        ),
        ConfigRule(f"{f}t5_max_distance", low=1, limit=MAX_UNSIZED_SEQ_LEN),
    )
