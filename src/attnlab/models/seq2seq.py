"""The encoder–decoder Transformer (Vaswani et al., 2017) built from attnlab's parts.

Encoder: `TransformerBlock`s (self-attention under the source padding mask). Decoder: pre-LN blocks
of causal self-attention (`attnlab.MultiHeadAttention` with a `KVCache` when decoding), cross-
attention to the encoder output, and an MLP::

    m = Enc(src)                                          (B, S, E)
    h = h + SelfAttn(norm1(h), causal)                    (B, T, E)
    h = h + CrossAttn(norm2(h), K = m W_k, V = m W_v)     K, V: computed once per source
    h = h + MLP(norm3(h));   logits = norm(h) W_out       (B, T, V)

Decoding computes the cross-attention keys/values of every layer once per source
(`Seq2SeqTransformer.start`) and reuses them at every step; greedy and beam search run with the
caches (``use_cache=True``) or recompute the whole prefix each step (``use_cache=False``), and both
give the same tokens. Beam search reorders the self-attention caches per beam with
``index_select`` on the batch dimension.

The seq2seq interface shared with the RNN baseline: ``config.to_dict()``, a module-level
``build_seq2seq_transformer(config_dict)``, ``forward(src, src_mask, tgt_in) -> logits``,
``greedy(src, src_mask, *, max_len, bos, eos)`` and ``alignment(src, src_mask, tgt_in)``.

Example:
    >>> cfg = Seq2SeqConfig(src_vocab_size=40, tgt_vocab_size=40)
    >>> model = Seq2SeqTransformer(cfg)
    >>> logits = model(src, src != 0, tgt_in)                     # (B, T, 40)
    >>> out = model.greedy(src, src != 0, max_len=50, bos=1, eos=2)
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._shapes import check_int
from ..functional import attention
from ..functional.registry import check_backend_name
from ..masks import Mask, PaddingMask, causal, padding
from ..modules import KVCache, MultiHeadAttention
from ..positional import RoPE, SinusoidalEmbedding
from .blocks import TransformerBlock, make_mlp, make_norm
from .config import TransformerConfig

POSITIONALS = ("sinusoidal", "rope")


@dataclass
class Seq2SeqConfig:
    """Sizes and choices of `Seq2SeqTransformer`.

    Attributes:
        src_vocab_size, tgt_vocab_size: token ids of each side.
        d_model: E. n_heads: H (``E % H == 0``). enc_layers, dec_layers: block counts.
        d_ff: the MLP's hidden width (None = 4·E).
        dropout: on embeddings, attention weights and residual branches (training only).
        positional: "sinusoidal" (added to the embeddings) or "rope" (rotates q and k of the
            self-attentions; cross-attention has no positions).
        tie_embeddings: one table for source, target and the output projection (needs
            ``src_vocab_size == tgt_vocab_size``); False = three separate matrices.
        norm: "layernorm" or "rmsnorm". pad_id: the padding id (its embedding row is zero).
        attn_backend: the `attnlab.attention` backend of every attention in ``forward``.
        decode_backend: the backend while decoding (`greedy`, `beam_search`); "auto" picks the
            single-row "decode" path there, faster than "reference" (measured:
            docs/results).
    """

    src_vocab_size: int = 64
    tgt_vocab_size: int = 64
    d_model: int = 192
    n_heads: int = 4
    enc_layers: int = 3
    dec_layers: int = 3
    d_ff: int | None = None
    dropout: float = 0.0
    positional: str = "sinusoidal"
    tie_embeddings: bool = True
    norm: str = "layernorm"
    pad_id: int = 0
    attn_backend: str = "auto"
    decode_backend: str = "auto"

    def __post_init__(self) -> None:
        for name in ("src_vocab_size", "tgt_vocab_size", "d_model", "n_heads"):
            check_int(name, getattr(self, name), minimum=1)
        check_int("enc_layers", self.enc_layers, minimum=1)
        check_int("dec_layers", self.dec_layers, minimum=1)
        if self.d_ff is not None:
            check_int("d_ff", self.d_ff, minimum=1)
        check_int("pad_id", self.pad_id, minimum=0)
        if self.pad_id >= min(self.src_vocab_size, self.tgt_vocab_size):
            raise ValueError(f"pad_id must be a token id of both vocabularies, got {self.pad_id}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
        if self.positional == "sinusoidal" and self.d_model % 2:
            raise ValueError(f"sinusoidal positions need an even d_model, got {self.d_model}")
        if self.positional == "rope" and (self.d_model // self.n_heads) % 2:
            raise ValueError(f"rope needs an even head dim, got {self.d_model // self.n_heads}")
        if self.positional not in POSITIONALS:
            raise ValueError(
                f"positional must be one of {list(POSITIONALS)}, got {self.positional!r}"
            )
        if not isinstance(self.tie_embeddings, bool):
            raise TypeError(f"tie_embeddings must be a bool, got {self.tie_embeddings!r}")
        if self.tie_embeddings and self.src_vocab_size != self.tgt_vocab_size:
            raise ValueError(
                "tie_embeddings needs one vocabulary: src_vocab_size="
                f"{self.src_vocab_size} != tgt_vocab_size={self.tgt_vocab_size}"
            )
        if not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")
        check_backend_name(self.attn_backend)
        check_backend_name(self.decode_backend)
        # the norm name is checked by the block config below
        self.block_config()

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def block_config(self) -> TransformerConfig:
        """The `TransformerConfig` of the encoder blocks and the decoder's norms and MLPs."""
        return TransformerConfig(
            vocab_size=self.src_vocab_size,
            d_model=self.d_model,
            n_layers=self.enc_layers,
            n_heads=self.n_heads,
            d_ff=self.d_ff,
            dropout=float(self.dropout),
            norm=self.norm,
            prenorm=True,
            positional=self.positional,
            attn_backend=self.attn_backend,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Seq2SeqConfig:
        """The config from `to_dict`'s output (unknown keys raise ValueError naming them)."""
        if not isinstance(d, dict):
            raise TypeError(f"config must be a dict, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"config has unknown fields {unknown}")
        return cls(**d)


class CrossAttention(nn.Module):
    """Multi-head attention from decoder queries to encoder keys/values.

    ``out = W_o · concat_h softmax(q_h K_hᵀ/√D + mask) V_h`` with ``K, V = memory · W_kv``
    computed by `memory_kv` once per source and passed to every decoding step.

    Args:
        d_model: E. n_heads: H. dropout: on the weights (training). backend: the attention
            backend.
    """

    def __init__(self, d_model: int, n_heads: int, dropout: float, backend: str) -> None:
        super().__init__()
        self.n_heads, self.head_dim = n_heads, d_model // n_heads
        self.dropout, self.backend = dropout, backend
        self.q_proj = nn.Linear(d_model, d_model)
        self.kv_proj = nn.Linear(d_model, 2 * d_model)
        self.out_proj = nn.Linear(d_model, d_model)

    def memory_kv(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        """``(B, S, E) -> (k, v)``, each ``(B, H, S, D)``."""
        B, S, _ = memory.shape
        kv = self.kv_proj(memory).view(B, S, 2, self.n_heads, self.head_dim)  # (B, S, 2, H, D)
        k, v = kv.permute(2, 0, 3, 1, 4).unbind(0)  # (B, H, S, D) each
        return k, v

    def forward(
        self,
        x: Tensor,
        kv: tuple[Tensor, Tensor],
        mask: Tensor | Mask,
        need_weights: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """``x (B, T, E)``, ``kv`` from `memory_kv`, ``mask (B, 1, 1, S)`` True = real source
        token (or the equivalent `padding` mask, `source_mask`) -> ``(B, T, E)`` (and the
        weights ``(B, H, T, S)`` with need_weights)."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B,H,T,D)
        res = attention(
            q,
            *kv,
            mask=mask,
            dropout_p=self.dropout if self.training else 0.0,
            backend=self.backend,
            return_weights=need_weights,
        )
        out, w = res if need_weights else (res, None)
        out = self.out_proj(out.transpose(1, 2).reshape(B, T, -1))  # (B, T, E)
        return (out, w) if need_weights else out


class DecoderBlock(nn.Module):
    """Pre-LN decoder layer: causal self-attention, cross-attention, MLP (each residual)."""

    def __init__(self, config: Seq2SeqConfig, rope: nn.Module | None) -> None:
        super().__init__()
        bc = config.block_config()
        self.norm1, self.norm2, self.norm3 = make_norm(bc), make_norm(bc), make_norm(bc)
        self.self_attn = MultiHeadAttention(
            config.d_model,
            config.n_heads,
            dropout=float(config.dropout),
            rope=rope,
            backend=config.attn_backend,
        )
        self.cross_attn = CrossAttention(
            config.d_model, config.n_heads, float(config.dropout), config.attn_backend
        )
        self.mlp = make_mlp(bc)
        self.drop = nn.Dropout(config.dropout)

    def forward(
        self,
        x: Tensor,
        kv: tuple[Tensor, Tensor],
        src_mask: Tensor | Mask,
        *,
        cache: KVCache | None = None,
        need_weights: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """``x (B, T, E)`` -> ``(B, T, E)`` (and the cross-attention weights ``(B, H, T, S)``)."""
        x = x + self.drop(self.self_attn(self.norm1(x), mask=causal(), cache=cache))
        c = self.cross_attn(self.norm2(x), kv, src_mask, need_weights)
        c, w = c if need_weights else (c, None)
        x = x + self.drop(c)
        x = x + self.drop(self.mlp(self.norm3(x)))
        return (x, w) if need_weights else x


def reorder_cache(cache: KVCache, index: Tensor) -> None:
    """Reorders a `KVCache`'s batch rows in place: row b becomes old row ``index[b]``."""
    cache.reorder(index)


def source_mask(src_mask: Tensor) -> Tensor | Mask:
    """The cross-attention mask of a source mask ``(B, S)`` for decoding: a `padding` mask
    (lengths ``Σ_j src_mask[b, j]``) when every row is True on a prefix (right padding, as
    `attnlab.data.numbers.collate` pads), else the dense ``(B, 1, 1, S)`` tensor.

    Both mask the same pairs. The padding mask lets `attnlab.attention` apply the NaN rule per
    key interval instead of cleaning the whole memory at every step (the same tokens, faster;
    measured: docs/results). Reads the mask on the host once (decoding
    only: `greedy` and `beam_search` already read ``done`` every step).
    """
    S = src_mask.shape[-1]
    lengths = src_mask.sum(-1)  # (B,)
    prefix = torch.arange(S, device=src_mask.device) < lengths[:, None]
    if src_mask.shape[0] and bool(torch.equal(prefix, src_mask)):
        return padding(lengths)
    return src_mask[:, None, None, :]


class DecodeState:
    """Everything a decoding step needs: the cross-attention keys/values of every layer
    (computed once per source), the source mask (``(B, 1, 1, S)`` or a `padding` mask, see
    `source_mask`), the self-attention caches (None when decoding without caches) and the number
    of target tokens fed so far."""

    def __init__(
        self,
        kv: list[tuple[Tensor, Tensor]],
        mask: Tensor | Mask,
        caches: list[KVCache] | None,
    ) -> None:
        self.kv, self.mask, self.caches, self.t = kv, mask, caches, 0

    def select(self, index: Tensor) -> None:
        """Keeps batch rows ``index`` (beam reordering): caches, keys/values and mask."""
        self.kv = [(k.index_select(0, index), v.index_select(0, index)) for k, v in self.kv]
        if isinstance(self.mask, PaddingMask):
            self.mask = padding(self.mask.lengths.index_select(0, index))
        else:
            self.mask = self.mask.index_select(0, index)  # type: ignore[union-attr]
        for c in self.caches or []:
            reorder_cache(c, index)


class Seq2SeqTransformer(nn.Module):
    """The encoder–decoder Transformer; see the module docstring.

    Args:
        config: a `Seq2SeqConfig`.
    """

    def __init__(self, config: Seq2SeqConfig) -> None:
        super().__init__()
        if not isinstance(config, Seq2SeqConfig):
            raise TypeError(f"config must be a Seq2SeqConfig, got {type(config).__name__}")
        self.config = c = config
        E = c.d_model
        self.src_embed = nn.Embedding(c.src_vocab_size, E, padding_idx=c.pad_id)
        self.tgt_embed = (
            self.src_embed
            if c.tie_embeddings
            else nn.Embedding(c.tgt_vocab_size, E, padding_idx=c.pad_id)
        )
        self.positions = SinusoidalEmbedding(E) if c.positional == "sinusoidal" else None
        rope = RoPE(c.head_dim) if c.positional == "rope" else None
        bc = c.block_config()
        self.encoder = nn.ModuleList(TransformerBlock(bc, rope=rope) for _ in range(c.enc_layers))
        self.enc_norm = make_norm(bc)
        self.decoder = nn.ModuleList(DecoderBlock(c, rope) for _ in range(c.dec_layers))
        self.dec_norm = make_norm(bc)
        self.out = None if c.tie_embeddings else nn.Linear(E, c.tgt_vocab_size, bias=False)
        self.drop = nn.Dropout(c.dropout)
        self._init()

    def _init(self) -> None:
        std = self.config.d_model**-0.5
        for emb in {self.src_embed, self.tgt_embed}:
            nn.init.normal_(emb.weight, std=std)
            with torch.no_grad():
                emb.weight[self.config.pad_id].zero_()
        if self.out is not None:
            nn.init.normal_(self.out.weight, std=std)

    @contextmanager
    def _decoding(self) -> Iterator[None]:
        """Every attention runs on ``config.decode_backend`` inside the block."""
        mods = [m for m in self.modules() if isinstance(m, (MultiHeadAttention, CrossAttention))]
        saved = [m.backend for m in mods]
        for m in mods:
            m.backend = self.config.decode_backend
        try:
            yield
        finally:
            for m, b in zip(mods, saved, strict=True):
                m.backend = b

    # ------------------------------------------------------------------ parts
    def _embed(self, table: nn.Embedding, ids: Tensor, start: int = 0) -> Tensor:
        x = table(ids) * math.sqrt(self.config.d_model)  # (B, L, E)
        if self.positions is not None:
            pos = torch.arange(start, start + ids.shape[1], device=ids.device)
            x = x + self.positions(pos).to(x.dtype)
        return self.drop(x)

    def _check(self, src: Tensor, src_mask: Tensor, tgt: Tensor | None = None) -> None:
        if not isinstance(src, Tensor) or src.dim() != 2 or src.dtype != torch.long:
            got = f"{src.dtype} {tuple(src.shape)}" if isinstance(src, Tensor) else type(src)
            raise ValueError(f"src must be a LongTensor (B, S), got {got}")
        if not isinstance(src_mask, Tensor) or src_mask.dtype != torch.bool:
            got = src_mask.dtype if isinstance(src_mask, Tensor) else type(src_mask).__name__
            raise TypeError(f"src_mask must be a bool tensor (B, S), got {got}")
        if src_mask.shape != src.shape:
            raise ValueError(
                f"src_mask must have src's shape {tuple(src.shape)}, got {tuple(src_mask.shape)}"
            )
        if tgt is not None and (
            not isinstance(tgt, Tensor)
            or tgt.dim() != 2
            or tgt.dtype != torch.long
            or tgt.shape[0] != src.shape[0]
        ):
            got = f"{tgt.dtype} {tuple(tgt.shape)}" if isinstance(tgt, Tensor) else type(tgt)
            raise ValueError(f"tgt_in must be a LongTensor (B={src.shape[0]}, T), got {got}")

    def encode(self, src: Tensor, src_mask: Tensor) -> Tensor:
        """``src (B, S)``, ``src_mask (B, S)`` -> the memory ``(B, S, E)``."""
        x = self._embed(self.src_embed, src)
        mask = src_mask[:, None, None, :]  # (B, 1, 1, S)
        for block in self.encoder:
            x = block(x, mask=mask)
        return self.enc_norm(x)

    def start(self, src: Tensor, src_mask: Tensor, *, use_cache: bool = True) -> DecodeState:
        """Encodes the source and computes every layer's cross-attention keys/values once."""
        self._check(src, src_mask)
        memory = self.encode(src, src_mask)
        kv = [block.cross_attn.memory_kv(memory) for block in self.decoder]
        caches = [KVCache() for _ in self.decoder] if use_cache else None
        return DecodeState(kv, src_mask[:, None, None, :], caches)

    def decode(
        self, state: DecodeState, tgt: Tensor, *, need_weights: bool = False
    ) -> Tensor | tuple[Tensor, list[Tensor]]:
        """Runs the decoder on ``tgt (B, T)`` -> logits ``(B, T, V)``.

        With caches, ``tgt`` holds the next tokens only (they are appended at position
        ``state.t``); without, the whole prefix from BOS.
        """
        start = state.t if state.caches is not None else 0
        x = self._embed(self.tgt_embed, tgt, start)
        weights = []
        for i, block in enumerate(self.decoder):
            cache = None if state.caches is None else state.caches[i]
            y = block(x, state.kv[i], state.mask, cache=cache, need_weights=need_weights)
            if need_weights:
                x, w = y
                weights.append(w)
            else:
                x = y
        state.t = start + tgt.shape[1]
        x = self.dec_norm(x)
        w_out = self.tgt_embed.weight if self.out is None else self.out.weight
        logits = F.linear(x, w_out)  # (B, T, V)
        return (logits, weights) if need_weights else logits

    # ------------------------------------------------------------------ the interface
    def forward(self, src: Tensor, src_mask: Tensor, tgt_in: Tensor) -> Tensor:
        """Teacher forcing: ``src (B, S)``, ``src_mask (B, S)`` (True = real), ``tgt_in (B, T)``
        (from BOS) -> logits ``(B, T, V_tgt)``."""
        self._check(src, src_mask, tgt_in)
        state = self.start(src, src_mask, use_cache=False)
        return self.decode(state, tgt_in)  # type: ignore[return-value]

    @torch.no_grad()
    def alignment(
        self, src: Tensor, src_mask: Tensor, tgt_in: Tensor, *, layer: int | None = None
    ) -> Tensor:
        """Cross-attention weights ``(B, T, S)`` averaged over heads (and over layers when
        ``layer`` is None): row t sums to 1 over the real source tokens, padded columns are 0."""
        self._check(src, src_mask, tgt_in)
        state = self.start(src, src_mask, use_cache=False)
        _, weights = self.decode(state, tgt_in, need_weights=True)  # type: ignore[misc]
        if layer is not None:
            return weights[layer].float().mean(1)  # (B, T, S)
        return torch.stack(weights).float().mean((0, 2))  # (B, T, S)

    @torch.no_grad()
    def cross_attention_weights(self, src: Tensor, src_mask: Tensor, tgt_in: Tensor) -> Tensor:
        """Every decoder layer's cross-attention weights ``(layers, B, H, T, S)``."""
        self._check(src, src_mask, tgt_in)
        state = self.start(src, src_mask, use_cache=False)
        _, weights = self.decode(state, tgt_in, need_weights=True)  # type: ignore[misc]
        return torch.stack(weights).float()

    @torch.no_grad()
    def greedy(
        self,
        src: Tensor,
        src_mask: Tensor,
        *,
        max_len: int,
        bos: int,
        eos: int,
        use_cache: bool = True,
    ) -> Tensor:
        """Greedy decoding -> ``(B, <= max_len)`` token ids (BOS excluded, EOS after the end).

        ``y_t = argmax p(y | y_<t, src)``; stops when every row has produced EOS.
        """
        check_int("max_len", max_len, minimum=1)
        with self._decoding():
            return self._greedy(src, src_mask, max_len, bos, eos, use_cache)

    def _greedy(
        self, src: Tensor, src_mask: Tensor, max_len: int, bos: int, eos: int, use_cache: bool
    ) -> Tensor:
        state = self.start(src, src_mask, use_cache=use_cache)
        state.mask = source_mask(src_mask)
        B = src.shape[0]
        prefix = torch.full((B, 1), bos, dtype=torch.long, device=src.device)
        done = torch.zeros(B, dtype=torch.bool, device=src.device)
        out = []
        for _ in range(max_len):
            feed = prefix[:, -1:] if use_cache else prefix
            logits = self.decode(state, feed)[:, -1]  # type: ignore[index]
            tok = logits.argmax(-1).masked_fill(done, eos)  # (B,)
            out.append(tok)
            done = done | (tok == eos)
            prefix = torch.cat([prefix, tok[:, None]], 1)
            if bool(done.all()):  # host read once per step: stop when every row ended
                break
        return torch.stack(out, 1)

    @torch.no_grad()
    def beam_search(
        self,
        src: Tensor,
        src_mask: Tensor,
        *,
        beam: int,
        max_len: int,
        bos: int,
        eos: int,
        use_cache: bool = True,
    ) -> tuple[Tensor, Tensor]:
        """Beam search with ``beam`` hypotheses per source; the score is the sum of the token
        log-probabilities ``Σ_t log p(y_t | y_<t, src)`` (a finished hypothesis keeps its score).

        Returns:
            ``(tokens (B, <= max_len), scores (B,))`` of the best hypothesis per source (BOS
            excluded, EOS after the end). ``beam=1`` is greedy decoding.
        """
        check_int("beam", beam, minimum=1)
        check_int("max_len", max_len, minimum=1)
        with self._decoding():
            return self._beam(src, src_mask, beam, max_len, bos, eos, use_cache)

    def _beam(
        self,
        src: Tensor,
        src_mask: Tensor,
        beam: int,
        max_len: int,
        bos: int,
        eos: int,
        use_cache: bool,
    ) -> tuple[Tensor, Tensor]:
        B, K = src.shape[0], beam
        dev = src.device
        state = self.start(src, src_mask, use_cache=use_cache)
        state.mask = source_mask(src_mask)
        state.select(torch.arange(B, device=dev).repeat_interleave(K))  # (B·K) rows
        scores = torch.full((B, K), float("-inf"), device=dev)
        scores[:, 0] = 0.0
        prefix = torch.full((B * K, 1), bos, dtype=torch.long, device=dev)
        done = torch.zeros(B * K, dtype=torch.bool, device=dev)
        base = (torch.arange(B, device=dev) * K)[:, None]  # (B, 1)
        for _ in range(max_len):
            feed = prefix[:, -1:] if use_cache else prefix
            logp = self.decode(state, feed)[:, -1].float().log_softmax(-1)  # (B·K, V)
            V = logp.shape[-1]
            ended = torch.full_like(logp, float("-inf"))
            ended[:, eos] = 0.0
            logp = torch.where(done[:, None], ended, logp)
            total = (scores.reshape(B * K, 1) + logp).view(B, K * V)
            scores, idx = total.topk(K, dim=-1)  # (B, K), sorted best first
            rows = (base + idx // V).reshape(-1)  # (B·K,) the hypotheses extended
            tok = (idx % V).reshape(-1)
            prefix = torch.cat([prefix.index_select(0, rows), tok[:, None]], 1)
            done = done.index_select(0, rows) | (tok == eos)
            if use_cache:
                for c in state.caches or []:
                    reorder_cache(c, rows)
            if bool(done.all()):
                break
        best = prefix.view(B, K, -1)[:, 0, 1:]  # (B, T)
        return best, scores[:, 0]


def build_seq2seq_transformer(config: dict[str, Any]) -> Seq2SeqTransformer:
    """The model of a `Seq2SeqConfig.to_dict` dictionary."""
    return Seq2SeqTransformer(Seq2SeqConfig.from_dict(config))


__all__ = [
    "CrossAttention",
    "DecodeState",
    "DecoderBlock",
    "Seq2SeqConfig",
    "Seq2SeqTransformer",
    "build_seq2seq_transformer",
    "reorder_cache",
    "source_mask",
]
