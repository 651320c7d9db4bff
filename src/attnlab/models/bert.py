"""A BERT-family encoder: attnlab's `Encoder`, loadable from a Hugging Face checkpoint.

BERT is the one Transformer stack of `attnlab.models` with BERT's choices: this module only
translates. `BertConfig.transformer_config` maps a Hugging Face ``config.json`` to a
`TransformerConfig` (post-LN blocks, LayerNorm ε, the MLP activation, learned positions,
token-type embeddings and an embedding LayerNorm), and `load_bert_state_dict` maps the
checkpoint's tensor names to the `Encoder`'s (BERT's separate query/key/value weights become the
fused ``qkv_proj`` of `attnlab.MultiHeadAttention`). ``BertEncoder.from_pretrained(path)`` reads
``config.json`` + ``model.safetensors`` (never a pickle file); the layers compute
``x = LN(x + MHA(x)); x = LN(x + W_2 act(W_1 x))``.

Example:
    >>> enc = BertEncoder.from_pretrained("path/to/bert-dir")
    >>> out = enc(input_ids, attention_mask)       # out.last_hidden_state: (B, L, E)
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from .._files import read_config_json
from .._fit import build_on_meta, check_fit, file_in_folder
from .._shapes import check_int
from ..checkpoint import PICKLE_SUFFIXES, CheckpointError, Header, read_header, read_safetensors
from .blocks import StackOutput
from .config import TransformerConfig
from .encoder import Encoder

# ---------------------------------------------------------------------------------- config

# Hugging Face ``hidden_act`` -> the `attnlab.models.blocks.ACTIVATIONS` name.
_ACTIVATIONS = {
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",
}


@dataclass(frozen=True)
class BertConfig:
    """The fields of a BERT ``config.json`` that define the encoder.

    Attributes:
        vocab_size: V, rows of the word embedding.
        hidden_size: E, the model dimension.
        num_hidden_layers: N, encoder layers.
        num_attention_heads: H; ``E % H == 0``, head dim ``D = E / H``.
        intermediate_size: F, width of the feed-forward layer.
        hidden_act: ``"gelu"`` (erf), ``"gelu_new"``/``"gelu_pytorch_tanh"`` (tanh), ``"relu"``,
            ``"silu"``.
        max_position_embeddings: P, the longest sequence (learned absolute positions).
        type_vocab_size: number of token types (segments).
        layer_norm_eps: epsilon of every LayerNorm.
        pad_token_id: id of the padding token.
    """

    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "int":
                check_int(f"BertConfig.{f.name}", value)
        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "max_position_embeddings",
            "type_vocab_size",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"BertConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.pad_token_id < 0 or self.pad_token_id >= self.vocab_size:
            raise ValueError(
                f"BertConfig.pad_token_id must be in [0, vocab_size={self.vocab_size}), got "
                f"{self.pad_token_id}"
            )
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"BertConfig.hidden_size={self.hidden_size} must be divisible by "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if not isinstance(self.hidden_act, str) or self.hidden_act not in _ACTIVATIONS:
            raise ValueError(
                f"BertConfig.hidden_act must be one of {sorted(_ACTIVATIONS)}, got "
                f"{self.hidden_act!r}"
            )
        eps = self.layer_norm_eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
            raise ValueError(f"BertConfig.layer_norm_eps must be in (0, 1), got {eps!r}")

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, source: str = "config") -> BertConfig:
        """Builds a config from a Hugging Face ``config.json`` dict (other keys are ignored).

        Raises:
            ValueError: a model type or position-embedding type that this encoder cannot run.
        """
        if not isinstance(d, dict):
            raise TypeError(f"{source} must hold a JSON object, got {type(d).__name__}")
        model_type = d.get("model_type", "bert")
        if model_type != "bert":
            raise ValueError(f"{source}: model_type must be 'bert', got {model_type!r}")
        pos = d.get("position_embedding_type", "absolute")
        if pos != "absolute":
            raise ValueError(f"{source}: position_embedding_type must be 'absolute', got {pos!r}")
        if d.get("is_decoder") or d.get("add_cross_attention"):
            raise ValueError(f"{source}: decoder / cross-attention BERT is not supported")
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in names}
        if kwargs.get("pad_token_id") is None:
            kwargs.pop("pad_token_id", None)
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{source}: {e}") from None

    @classmethod
    def from_json(cls, path: str | Path) -> BertConfig:
        """Reads a ``config.json`` file (FileNotFoundError naming the path if it is absent).

        The file is read bounded (`attnlab._files.read_config_json`: a regular file of at
        most `MAX_CONFIG_BYTES`, nesting bounded) and every field is type-checked.
        """
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"BERT config file not found: {path}")
        return cls.from_dict(read_config_json(path), source=str(path))

    def transformer_config(self, *, backend: str = "auto") -> TransformerConfig:
        """The `TransformerConfig` of the same network (dropout off: an inference encoder).

        Post-LN LayerNorm blocks with ε = ``layer_norm_eps``, a two-layer MLP of width
        ``intermediate_size`` with ``hidden_act``, learned absolute positions, token-type
        embeddings and a LayerNorm on the summed embeddings, biases everywhere.
        """
        return TransformerConfig(
            vocab_size=self.vocab_size,
            d_model=self.hidden_size,
            n_layers=self.num_hidden_layers,
            n_heads=self.num_attention_heads,
            d_ff=self.intermediate_size,
            max_seq_len=self.max_position_embeddings,
            dropout=0.0,
            norm="layernorm",
            norm_eps=float(self.layer_norm_eps),
            prenorm=False,
            mlp="gelu",
            activation=_ACTIVATIONS[self.hidden_act],
            positional="learned",
            bias=True,
            tie_embeddings=False,
            type_vocab_size=self.type_vocab_size,
            embed_norm=True,
            pad_token_id=self.pad_token_id,
            attn_backend=backend,
        )


# ---------------------------------------------------------------------------------- modules


class BertOutput(NamedTuple):
    """What `BertEncoder.forward` returns.

    Attributes:
        last_hidden_state: ``(B, L, E)``, the output of the last layer.
        pooler_output: ``(B, E)`` = ``tanh(W h_[CLS] + b)`` if the encoder has a pooler, else None.
        hidden_states: with ``need_hidden_states``, N + 1 tensors ``(B, L, E)`` (the embeddings,
            then each layer's output), else None.
        attentions: with ``need_weights``, N tensors ``(B, H, L, L)``, else None.
    """

    last_hidden_state: Tensor
    pooler_output: Tensor | None = None
    hidden_states: tuple[Tensor, ...] | None = None
    attentions: tuple[Tensor, ...] | None = None


class BertPooler(nn.Module):
    """``p = tanh(W h_0 + b)`` on the first ([CLS]) token: ``(B, L, E)`` → ``(B, E)``."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, hidden: Tensor) -> Tensor:
        """``(B, L, E)`` → ``(B, E)``."""
        return torch.tanh(self.dense(hidden[:, 0]))


class BertEncoder(nn.Module):
    """A BERT encoder: attnlab's `Encoder` with `BertConfig.transformer_config`, and a pooler.

    ``x_0 = LN(W_word[ids] + W_pos[0..L−1] + W_type[types])``; ``x_{n+1} = Block_n(x_n)`` for
    n < N, post-LN `TransformerBlock`s ``h = LN_1(x + MHA(x)); y = LN_2(h + W_2 act(W_1 h))``.

    Args:
        config: the architecture (`BertConfig`).
        pooler: add BERT's ``tanh`` pooler over the [CLS] token.
        backend: the `attnlab.attention` backend of every layer.

    Attributes:
        config: the `BertConfig`.
        transformer: the `Encoder` (its ``config`` is the translated `TransformerConfig`).
        layers: the blocks (`TransformerBlock`, ``transformer.blocks``).
        pooler: the `BertPooler`, or None.

    Example:
        >>> enc = BertEncoder(BertConfig(hidden_size=64, num_attention_heads=4,
        ...                              num_hidden_layers=2, intermediate_size=128))
        >>> enc(torch.tensor([[101, 7592, 102]])).last_hidden_state.shape
        torch.Size([1, 3, 64])
    """

    def __init__(self, config: BertConfig, *, pooler: bool = False, backend: str = "auto") -> None:
        super().__init__()
        if not isinstance(config, BertConfig):
            raise TypeError(f"config must be a BertConfig, got {type(config).__name__}")
        self.config = config
        self.transformer = Encoder(config.transformer_config(backend=backend))
        self.pooler = BertPooler(config) if pooler else None

    @property
    def layers(self) -> nn.ModuleList:
        """The N post-LN blocks (`TransformerBlock`)."""
        return self.transformer.blocks

    @property
    def word_embeddings(self) -> nn.Embedding:
        """The ``(V, E)`` token embedding table."""
        return self.transformer.tok_emb

    # ------------------------------------------------------------------ forward
    def _check_inputs(
        self, input_ids: object, attention_mask: object, token_type_ids: object
    ) -> None:
        c = self.config
        if not isinstance(input_ids, Tensor) or input_ids.dim() != 2:
            got = tuple(input_ids.shape) if isinstance(input_ids, Tensor) else type(input_ids)
            raise ValueError(f"input_ids must be a (B, L) tensor, got {got}")
        if input_ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"input_ids must be int64 or int32, got {input_ids.dtype}")
        L = input_ids.shape[1]
        if c.max_position_embeddings < L:
            raise ValueError(
                f"input_ids has length L={L}, more than max_position_embeddings="
                f"{c.max_position_embeddings}; truncate the input"
            )
        if input_ids.numel() and not (torch.compiler.is_compiling() or input_ids.is_meta):
            lo, hi = (int(t) for t in torch.aminmax(input_ids))  # the one host read (eager only)
            if lo < 0 or hi >= c.vocab_size:
                raise ValueError(
                    f"input_ids must be in [0, vocab_size={c.vocab_size}), got values in "
                    f"[{lo}, {hi}]"
                )
        for name, t in (("attention_mask", attention_mask), ("token_type_ids", token_type_ids)):
            if t is None:
                continue
            if not isinstance(t, Tensor) or t.shape != input_ids.shape:
                got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
                raise ValueError(
                    f"{name} must have the shape of input_ids {tuple(input_ids.shape)}, got {got}"
                )
        if attention_mask is not None and attention_mask.is_floating_point():  # type: ignore[union-attr]
            raise TypeError(
                "attention_mask must be bool or integer (1/True = real token), got "
                f"{attention_mask.dtype}"  # type: ignore[union-attr]
            )
        if token_type_ids is not None and (
            token_type_ids.dtype not in (torch.int64, torch.int32)  # type: ignore[union-attr]
        ):
            raise TypeError(
                f"token_type_ids must be int64 or int32, got {token_type_ids.dtype}"  # type: ignore[union-attr]
            )

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        *,
        need_weights: bool = False,
        need_hidden_states: bool = False,
    ) -> BertOutput:
        """Encodes token ids.

        Args:
            input_ids: ``(B, L)`` int64 token ids, ``L <= max_position_embeddings``.
            attention_mask: ``(B, L)`` bool or 0/1 ints, True/1 = real token (keys that are
                False are never attended; their own rows are computed but meaningless).
            token_type_ids: ``(B, L)`` segment ids (default all 0).
            need_weights: also return every layer's attention weights ``(B, H, L, L)``.
            need_hidden_states: also return the embeddings and every layer's output.

        Returns:
            A `BertOutput`; ``last_hidden_state`` is ``(B, L, E)``. The attention weights are
            those of this forward pass (each layer's attention runs once).

        The token-id range check reads ``min``/``max`` back to the host in eager mode only
        (skipped under `torch.compile` and for ``meta`` tensors).
        """
        self._check_inputs(input_ids, attention_mask, token_type_ids)
        mask = None
        if attention_mask is not None:  # always passed: skipping an all-True one reads values
            mask = attention_mask.bool()[:, None, None, :]  # (B, 1, 1, L)
        out: StackOutput = self.transformer.encode(
            input_ids,
            mask=mask,
            token_type_ids=token_type_ids,
            need_weights=need_weights,
            need_hidden_states=need_hidden_states,
        )
        x = out.last_hidden_state  # (B, L, E)
        return BertOutput(
            last_hidden_state=x,
            pooler_output=None if self.pooler is None else self.pooler(x),
            hidden_states=out.hidden_states,
            attentions=out.attentions,
        )

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        dtype: torch.dtype | None = None,
        backend: str = "auto",
    ) -> BertEncoder:
        """Loads a BERT checkpoint directory: ``config.json`` + ``model.safetensors``.

        Keys may carry a ``bert.`` prefix (as in ``BertFor…`` checkpoints); the pooler is loaded
        when the checkpoint has one. HF's ``embeddings.position_ids`` / ``token_type_ids``
        buffers are ignored; any other key the encoder does not use is an error. Only
        safetensors are read: pickle checkpoints (``pytorch_model.bin``) are refused.

        The config must be justified by the file before anything is allocated: ``config.json``
        is read bounded and type-checked, then the safetensors header alone (no tensor data)
        must list exactly the tensors the config implies, with their shapes and one float
        dtype (the layer count is checked on the names first, so ``num_hidden_layers: 10**6``
        is refused at once), and the encoder built on the ``meta`` device must match it
        (`attnlab._fit.check_fit`). Only then is the file read (through the checked
        reader, which refuses a file whose header changed) and assigned to the encoder.

        Args:
            path: the model directory (or its ``model.safetensors`` file, with ``config.json``
                beside it).
            dtype: cast the parameters to this float dtype (default: the checkpoint's).
            backend: the `attnlab.attention` backend of every layer.

        Raises:
            FileNotFoundError: the config or weights file is missing (naming the path).
            CheckpointError: missing or unexpected keys, or a tensor whose shape or dtype does
                not fit the config (naming the tensor and the file); a directory whose
                ``model.safetensors`` is a link to a file outside it.
            ValueError: a pickle checkpoint, or a config this encoder cannot run.
        """
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
        config_path, weights_path = _resolve_paths(path)
        config = BertConfig.from_json(config_path)
        header, prefix, pooler = _checked_header(weights_path, config)
        model = build_on_meta(lambda: cls(config, pooler=pooler, backend=backend))
        specs = _meta_specs(header.tensors, prefix, config)
        check_fit(weights_path, model, specs, what="the BERT config")  # names, shapes, dtypes
        tensors = _read_checked(weights_path, header, prefix)  # allocation starts here
        model.load_state_dict(_to_attnlab_names(tensors, config), strict=True, assign=True)
        if dtype is not None:
            model = model.to(dtype)
        return model.eval()


# ---------------------------------------------------------------------------------- loading

_IGNORED_KEYS = ("embeddings.position_ids", "embeddings.token_type_ids")


def _resolve_paths(path: str | Path) -> tuple[Path, Path]:
    """``(config.json, model.safetensors)`` for a model directory or a safetensors file."""
    if not isinstance(path, (str, Path)):
        raise TypeError(f"path must be a str or Path, got {type(path).__name__}")
    p = Path(path)
    if p.suffix in PICKLE_SUFFIXES:
        raise ValueError(
            f"refusing to load {p}: pickle checkpoints can run arbitrary code; convert it to "
            "model.safetensors"
        )
    if p.is_file():
        if p.suffix != ".safetensors":
            raise ValueError(f"weights file must be a .safetensors file, got {p}")
        return p.parent / "config.json", p
    if not p.is_dir():
        raise FileNotFoundError(f"BERT model directory not found: {p}")
    config = p / "config.json"
    weights = p / "model.safetensors"
    if not config.exists():  # anything else there is refused by the bounded reader
        raise FileNotFoundError(f"BERT config file not found: {config}")
    if not weights.is_file():
        pickles = sorted(q.name for q in p.iterdir() if q.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise ValueError(
                f"{p} has no model.safetensors, only pickle checkpoint(s) {pickles}; refusing to "
                "unpickle them (they can run arbitrary code): convert to model.safetensors"
            )
        if (p / "model.safetensors.index.json").is_file():
            raise ValueError(f"{p} holds a sharded checkpoint; only one model.safetensors is read")
        raise FileNotFoundError(f"BERT weights file not found: {weights}")
    return config, file_in_folder(p, weights.name)  # a link out of the folder is refused


def bert_checkpoint_shapes(config: BertConfig, *, pooler: bool) -> dict[str, tuple[int, ...]]:
    """Every Hugging Face ``BertModel`` key the encoder reads, with its expected shape."""
    E, F_, V = config.hidden_size, config.intermediate_size, config.vocab_size
    shapes: dict[str, tuple[int, ...]] = {
        "embeddings.word_embeddings.weight": (V, E),
        "embeddings.position_embeddings.weight": (config.max_position_embeddings, E),
        "embeddings.token_type_embeddings.weight": (config.type_vocab_size, E),
        "embeddings.LayerNorm.weight": (E,),
        "embeddings.LayerNorm.bias": (E,),
    }
    for i in range(config.num_hidden_layers):
        p = f"encoder.layer.{i}."
        for name in ("query", "key", "value"):
            shapes[f"{p}attention.self.{name}.weight"] = (E, E)
            shapes[f"{p}attention.self.{name}.bias"] = (E,)
        shapes[f"{p}attention.output.dense.weight"] = (E, E)
        shapes[f"{p}attention.output.dense.bias"] = (E,)
        shapes[f"{p}attention.output.LayerNorm.weight"] = (E,)
        shapes[f"{p}attention.output.LayerNorm.bias"] = (E,)
        shapes[f"{p}intermediate.dense.weight"] = (F_, E)
        shapes[f"{p}intermediate.dense.bias"] = (F_,)
        shapes[f"{p}output.dense.weight"] = (E, F_)
        shapes[f"{p}output.dense.bias"] = (E,)
        shapes[f"{p}output.LayerNorm.weight"] = (E,)
        shapes[f"{p}output.LayerNorm.bias"] = (E,)
    if pooler:
        shapes["pooler.dense.weight"] = (E, E)
        shapes["pooler.dense.bias"] = (E,)
    return shapes


def _key_list(keys: list[str], limit: int = 6) -> str:
    shown = ", ".join(repr(k) for k in keys[:limit])
    return shown + (f", … ({len(keys)} in all)" if len(keys) > limit else "")


_LAYER_RE = re.compile(r"encoder\.layer\.(\d+)\.")
_PER_LAYER = 16  # tensors of one HF BertModel layer (see `bert_checkpoint_shapes`)


def _check_bert_header(
    path: Path, specs: Mapping[str, tuple[torch.dtype, tuple[int, ...]]], config: BertConfig
) -> tuple[str, bool]:
    """Checks the header's tensors against ``config``; returns ``(key prefix, pooler)``.

    Only names, shapes and dtypes are used (no tensor data). The layer count is checked on
    the names first, so a config claiming a million layers lists no million names.
    """
    stored = list(specs)
    prefix = "bert." if "bert.embeddings.word_embeddings.weight" in specs else ""
    by_key = {k[len(prefix) :]: k for k in stored if k.startswith(prefix)}
    pooler = "pooler.dense.weight" in by_key or "pooler.dense.bias" in by_key
    n = config.num_hidden_layers
    found = {int(m.group(1)) for k in by_key if (m := _LAYER_RE.match(k))}
    if n > len(found):  # name the first missing layer's tensors; count the rest
        first = min(i for i in range(len(found) + 1) if i not in found)
        small = replace(config, num_hidden_layers=first + 1)
        missing = [k for k in bert_checkpoint_shapes(small, pooler=pooler) if k not in by_key]
        total = len(missing) + _PER_LAYER * (n - first - 1)
        raise CheckpointError(
            path,
            f"checkpoint does not fit the BERT config ({n} layers): the file holds tensors of "
            f"{len(found)} layer(s); missing tensor(s) "
            f"{', '.join(repr(prefix + k) for k in missing[:6])}, … ({total} in all)",
        )
    want = bert_checkpoint_shapes(config, pooler=pooler)
    missing = [k for k in want if k not in by_key]
    unexpected = [k for k in stored if k.removeprefix(prefix) not in want]
    unexpected = [k for k in unexpected if k.removeprefix(prefix) not in _IGNORED_KEYS]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing tensor(s) {_key_list([prefix + k for k in missing])}")
        if unexpected:
            parts.append(f"unexpected tensor(s) {_key_list(unexpected)}")
        raise CheckpointError(
            path,
            f"checkpoint does not fit the BERT config ({n} layers): {'; '.join(parts)}",
        )
    ref_key = "embeddings.word_embeddings.weight"
    ref_dtype: torch.dtype | None = None
    for key in [ref_key, *(k for k in want if k != ref_key)]:
        name = by_key[key]
        dtype, shape = specs[name]
        if shape != want[key]:
            raise CheckpointError(
                path,
                f"tensor {name!r} has shape {shape}, expected "
                f"{want[key]} from the config (hidden_size={config.hidden_size}, "
                f"intermediate_size={config.intermediate_size}, "
                f"vocab_size={config.vocab_size})",
            )
        if not dtype.is_floating_point:
            raise CheckpointError(
                path, f"tensor {name!r} has dtype {dtype}, expected a float dtype"
            )
        if ref_dtype is None:
            ref_dtype = dtype
        elif dtype != ref_dtype:
            raise CheckpointError(
                path,
                f"tensor {name!r} has dtype {dtype}, expected {ref_dtype} "
                f"(the dtype of {by_key[ref_key]!r})",
            )
    return prefix, pooler


def _checked_header(path: Path, config: BertConfig) -> tuple[Header, str, bool]:
    """``(header, key prefix, pooler)``: the file's header, checked against ``config``."""
    try:
        header = read_header(path)
    except CheckpointError as e:
        raise CheckpointError(path, f"cannot read safetensors file: {e.cause}") from None
    prefix, pooler = _check_bert_header(path, header.tensors, config)
    return header, prefix, pooler


def _read_checked(path: Path, header: Header, prefix: str) -> dict[str, Tensor]:
    """The HF-named tensors of a file whose ``header`` was checked (it must not have changed)."""
    stored, _ = read_safetensors(path, header=header)
    return {
        k[len(prefix) :]: t
        for k, t in stored.items()
        if k.startswith(prefix) and k[len(prefix) :] not in _IGNORED_KEYS
    }


def load_bert_state_dict(path: str | Path, config: BertConfig) -> dict[str, Tensor]:
    """Reads a BERT safetensors file and returns a `BertEncoder` state dict.

    Validates every key, shape and dtype against ``config`` from the file's header alone
    (no tensor data is read before the config is justified by the file's tensors); the
    separate query/key/value weights of each layer are concatenated into the fused
    ``attn.qkv_proj`` of `attnlab.MultiHeadAttention` (rows ``[W_q; W_k; W_v]``, heads in
    order) and every other tensor is renamed (``_EMBEDDING_NAMES``, ``_LAYER_NAMES``).

    Raises:
        CheckpointError: missing or unexpected keys, or a tensor of the wrong shape or dtype.
    """
    path = Path(path)
    header, prefix, _ = _checked_header(path, config)
    return _to_attnlab_names(_read_checked(path, header, prefix), config)


def _meta_specs(
    specs: Mapping[str, tuple[torch.dtype, tuple[int, ...]]], prefix: str, config: BertConfig
) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The header's ``{name: (dtype, shape)}`` under `BertEncoder` names (q/k/v fused)."""
    t = {k[len(prefix) :]: v for k, v in specs.items() if k.startswith(prefix)}
    out = {ours: t[theirs] for theirs, ours in _EMBEDDING_NAMES.items() if theirs in t}
    for i in range(config.num_hidden_layers):
        p, q = f"encoder.layer.{i}.", f"transformer.blocks.{i}."
        for s in ("weight", "bias"):
            parts = [t[f"{p}attention.self.{n}.{s}"] for n in ("query", "key", "value")]
            dtype, shape = parts[0]
            out[f"{q}attn.qkv_proj.{s}"] = (dtype, (sum(x[1][0] for x in parts), *shape[1:]))
            for theirs, ours in _LAYER_NAMES.items():
                out[f"{q}{ours}.{s}"] = t[f"{p}{theirs}.{s}"]
    return out


# Hugging Face ``BertModel`` name -> `BertEncoder` name; ``{i}`` is the layer index. BERT's
# ``attention.self.{query,key,value}`` are fused into ``attn.qkv_proj`` (see `_to_attnlab_names`).
_EMBEDDING_NAMES = {
    "embeddings.word_embeddings.weight": "transformer.tok_emb.weight",
    "embeddings.position_embeddings.weight": "transformer.pos_emb.weight",
    "embeddings.token_type_embeddings.weight": "transformer.type_emb.weight",
    "embeddings.LayerNorm.weight": "transformer.emb_norm.weight",
    "embeddings.LayerNorm.bias": "transformer.emb_norm.bias",
    "pooler.dense.weight": "pooler.dense.weight",
    "pooler.dense.bias": "pooler.dense.bias",
}
_LAYER_NAMES = {
    "attention.output.dense": "attn.out_proj",
    "attention.output.LayerNorm": "norm1",
    "intermediate.dense": "mlp.fc1",
    "output.dense": "mlp.fc2",
    "output.LayerNorm": "norm2",
}


def _to_attnlab_names(t: dict[str, Tensor], config: BertConfig) -> dict[str, Tensor]:
    """Renames HF ``BertModel`` tensors to `BertEncoder` parameter names, fusing q/k/v."""
    sd = {ours: t[theirs] for theirs, ours in _EMBEDDING_NAMES.items() if theirs in t}
    for i in range(config.num_hidden_layers):
        p, q = f"encoder.layer.{i}.", f"transformer.blocks.{i}."
        qkv = [f"{p}attention.self.{n}" for n in ("query", "key", "value")]
        sd[f"{q}attn.qkv_proj.weight"] = torch.cat([t[f"{n}.weight"] for n in qkv])  # (3E, E)
        sd[f"{q}attn.qkv_proj.bias"] = torch.cat([t[f"{n}.bias"] for n in qkv])  # (3E,)
        for theirs, ours in _LAYER_NAMES.items():
            for s in ("weight", "bias"):
                sd[f"{q}{ours}.{s}"] = t[f"{p}{theirs}.{s}"]
    return sd


__all__ = [
    "BertConfig",
    "BertEncoder",
    "BertOutput",
    "BertPooler",
    "bert_checkpoint_shapes",
    "load_bert_state_dict",
]
