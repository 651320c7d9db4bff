"""The recurrent baselines: Bahdanau's RNN encoder–decoder and a GRU/LSTM character LM.

`RNNSeq2Seq` is the textbook's own baseline (Bahdanau, Cho & Bengio 2015): a bidirectional GRU
encoder and a GRU decoder that, before each step, attends over the encoder states with
`attnlab.AdditiveAttention` (the query is the previous decoder state); the context is fed to the
GRU together with the previous token's embedding. It implements the seq2seq interface shared with
the Transformer (``forward``, ``greedy``, ``alignment``, ``config.to_dict``, `build_rnn_seq2seq`).

`RNNLM` is a stack of single-layer GRUs or LSTMs over character embeddings: the recurrent row
of Vaswani et al. (2017, Table 1): O(n·d²) work per layer, n sequential steps, and a path of
length n between distant positions, but O(1) work and O(d) state per generated token.

Example:
    >>> cfg = RNNSeq2SeqConfig(src_vocab_size=30, tgt_vocab_size=32)
    >>> model = build_rnn_seq2seq(cfg.to_dict())
    >>> logits = model(src, src_mask, tgt_in)                   # (B, T, 32)
    >>> out = model.greedy(src, src_mask, max_len=40, bos=1, eos=2)
    >>> lm = RNNLM(RNNLMConfig(vocab_size=65))
    >>> text_ids = lm.generate(torch.zeros(1, 1, dtype=torch.long), 100, top_k=10)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
from torch import Tensor, nn

from .._shapes import check_int, check_number, check_probability
from ..modules import AdditiveAttention
from .gpt import check_token_ids

CELLS = ("gru", "lstm")


def _from_dict(cls: type, data: object) -> Any:
    if not isinstance(data, dict):
        raise TypeError(f"config must be a dict, got {type(data).__name__}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown {cls.__name__} field(s) {unknown}; known: {sorted(known)}")
    return cls(**data)


# ------------------------------------------------------------------------- the seq2seq baseline
@dataclass
class RNNSeq2SeqConfig:
    """Sizes of `RNNSeq2Seq` (validated on creation).

    Attributes:
        src_vocab_size, tgt_vocab_size: token ids of each side.
        d_embed: E, the embedding width of both sides.
        d_encoder: H, the hidden width of each encoder direction (states are 2H wide).
        d_decoder: the decoder GRU's hidden width.
        d_attention: the tanh layer of the additive attention.
        d_output: the hidden layer before the output softmax (Bahdanau's deep output, tanh).
        dropout: dropout on embeddings and on the output layer's input (training only).
    """

    src_vocab_size: int = 64
    tgt_vocab_size: int = 64
    d_embed: int = 64
    d_encoder: int = 128
    d_decoder: int = 256
    d_attention: int = 128
    d_output: int = 256
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in (
            "src_vocab_size",
            "tgt_vocab_size",
            "d_embed",
            "d_encoder",
            "d_decoder",
            "d_attention",
            "d_output",
        ):
            check_int(name, getattr(self, name), minimum=1)
        check_probability("dropout", self.dropout)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; ``RNNSeq2SeqConfig.from_dict(c.to_dict()) == c``."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RNNSeq2SeqConfig:
        """The inverse of `to_dict`; unknown keys raise ValueError naming them."""
        return _from_dict(cls, data)


def _check_pair(src: object, src_mask: object) -> tuple[Tensor, Tensor]:
    if not isinstance(src, Tensor):
        raise TypeError(f"src must be a (B, S) integer tensor, got {type(src).__name__}")
    if not isinstance(src_mask, Tensor) or src_mask.dtype != torch.bool:
        got = src_mask.dtype if isinstance(src_mask, Tensor) else type(src_mask).__name__
        raise TypeError(f"src_mask must be a (B, S) bool tensor (True = real token), got {got}")
    if src.shape != src_mask.shape:
        raise ValueError(
            f"src and src_mask must both be (B, S), got src {tuple(src.shape)}, src_mask "
            f"{tuple(src_mask.shape)}"
        )
    return src, src_mask


class RNNSeq2Seq(nn.Module):
    """Bahdanau's RNN encoder–decoder with additive attention ("RNNsearch").

    Encoder: token embeddings, a forward and a backward GRU (a bidirectional GRU), states
    ``h_j = [h→_j; h←_j]`` (B, S, 2H). Padding is skipped exactly: each row's real tokens are
    gathered to the front (in order) before the GRUs run and the states are put back, so the
    states of a sentence do not depend on where or how much padding surrounds it. The decoder
    starts from ``s_0 = tanh(W_s h←_1)``; at step i::

        c_i = Σ_j α_ij h_j,   α_i = softmax_j(vᵀ tanh(W_q s_{i−1} + W_k h_j + b))   (padding: 0)
        s_i = GRU([emb(y_{i−1}); c_i], s_{i−1})
        logits_i = W_o tanh(W_t [s_i; c_i; emb(y_{i−1})])

    The attention is an `attnlab.AdditiveAttention` (``self.attention``: its parameters and its
    definition); the decoder projects the keys ``W_k h_j + b`` once per source (`project_keys`)
    and each step computes the module's result from them (`attend`, tested equal to calling the
    module), instead of projecting all S keys again at every step. ``forward`` (teacher forcing)
    and ``greedy`` (incremental) run the same step function, so greedy decoding equals the argmax
    of the teacher-forced logits on its own output.

    Example:
        >>> model = RNNSeq2Seq(RNNSeq2SeqConfig(src_vocab_size=30, tgt_vocab_size=32))
        >>> logits = model(src, src_mask, tgt_in)          # (B, T, 32)
        >>> weights = model.alignment(src, src_mask, tgt_in)  # (B, T, S), rows sum to 1
    """

    def __init__(self, config: RNNSeq2SeqConfig) -> None:
        super().__init__()
        if not isinstance(config, RNNSeq2SeqConfig):
            raise TypeError(f"config must be an RNNSeq2SeqConfig, got {type(config).__name__}")
        self.config = c = config
        self.src_emb = nn.Embedding(c.src_vocab_size, c.d_embed)
        self.tgt_emb = nn.Embedding(c.tgt_vocab_size, c.d_embed)
        self.enc_fwd = nn.GRU(c.d_embed, c.d_encoder, batch_first=True)
        self.enc_bwd = nn.GRU(c.d_embed, c.d_encoder, batch_first=True)
        self.init_state = nn.Linear(c.d_encoder, c.d_decoder)
        self.attention = AdditiveAttention(c.d_decoder, 2 * c.d_encoder, c.d_attention)
        self.decoder = nn.GRUCell(c.d_embed + 2 * c.d_encoder, c.d_decoder)
        self.pre_out = nn.Linear(c.d_decoder + 2 * c.d_encoder + c.d_embed, c.d_output)
        self.out = nn.Linear(c.d_output, c.tgt_vocab_size)
        self.drop = nn.Dropout(c.dropout)

    # ------------------------------------------------------------------------------- encoder
    def encode(self, src: Tensor, src_mask: Tensor) -> tuple[Tensor, Tensor]:
        """Encoder states and the decoder's initial state.

        Args:
            src: ``(B, S)`` token ids. src_mask: ``(B, S)`` bool, True = real token.

        Returns:
            ``(states (B, S, 2H), s0 (B, Dd))``: ``states`` in the original column order, zero at
            padded columns; ``s0 = tanh(W_s h←_1)`` (h←_1: the backward state at the first real
            token).
        """
        B, S = src.shape
        pos = torch.arange(S, device=src.device)  # (S,)
        # real tokens first, in order (a stable sort of the padding flags): sync-free compaction
        order = torch.argsort((~src_mask).to(torch.int8), dim=1, stable=True)  # (B, S)
        lengths = src_mask.sum(1, keepdim=True)  # (B, 1)
        x = self.drop(self.src_emb(src.gather(1, order)))  # (B, S, E)
        E = x.shape[-1]
        fwd, _ = self.enc_fwd(x)  # (B, S, H); padding sits after every real token
        # reverse each row within its length (an involution); padding stays at the end
        rev = torch.where(pos < lengths, lengths - 1 - pos, pos)  # (B, S)
        bwd, _ = self.enc_bwd(x.gather(1, rev[..., None].expand(B, S, E)))
        H = bwd.shape[-1]
        bwd = bwd.gather(1, rev[..., None].expand(B, S, H))  # (B, S, H) back in order
        s0 = torch.tanh(self.init_state(bwd[:, 0]))  # (B, Dd)
        packed = torch.cat([fwd, bwd], dim=-1)  # (B, S, 2H), compacted order
        inverse = torch.argsort(order, dim=1)  # (B, S)
        states = packed.gather(1, inverse[..., None].expand(B, S, 2 * H))  # original order
        return states * src_mask[..., None], s0

    # ------------------------------------------------------------------------------- decoder
    def project_keys(self, states: Tensor) -> Tensor:
        """``W_k h_j + b`` of the attention, ``(B, S, A)``: the same at every decoder step, so it
        is computed once per source (Bahdanau et al.'s own precomputation of ``U_a h_j``)."""
        return self.attention.key_proj(states)

    def attend(
        self, state: Tensor, keys: Tensor, states: Tensor, keep: Tensor
    ) -> tuple[Tensor, Tensor]:
        """``self.attention(state, states, mask=keep)`` with the keys already projected.

        ``α_j = softmax_j(vᵀ tanh(W_q s + keys_j))`` over the kept j (masked and fully masked
        entries exactly 0), ``c = Σ_j α_j h_j``: what the `AdditiveAttention` module computes
        (tests/test_rnn_seq2seq.py checks it), without projecting the S keys again at each step.

        Args:
            state: ``(B, Dd)`` the query s_{i−1}. keys: ``(B, S, A)`` from `project_keys`.
            states: ``(B, S, 2H)`` the values h_j. keep: ``(B, 1, S)`` bool, True = real token.

        Returns:
            ``(context (B, 2H), weights (B, S))``.
        """
        att = self.attention
        query = att.query_proj(state)[:, None, :]  # (B, 1, A)
        scores = torch.tanh(query + keys) @ att.v  # (B, S)
        kept = keep[:, 0, :]  # (B, S)
        # a finite floor (not −inf) keeps a fully masked row finite in backward; it is zeroed
        scores = scores.masked_fill(~kept, torch.finfo(scores.dtype).min)
        weights = torch.where(kept, torch.softmax(scores, dim=-1), 0.0)  # (B, S)
        if self.training and att.dropout > 0:
            weights = nn.functional.dropout(weights, att.dropout)
        return (weights[:, None, :] @ states)[:, 0], weights

    def step(
        self, y_prev: Tensor, state: Tensor, states: Tensor, keys: Tensor, keep: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """One decoder step.

        Args:
            y_prev: ``(B,)`` previous target ids. state: ``(B, Dd)`` s_{i−1}.
            states: ``(B, S, 2H)`` encoder states. keys: ``(B, S, A)`` from `project_keys`.
            keep: ``(B, 1, S)`` bool, True = real token.

        Returns:
            ``(logits (B, V), s_i (B, Dd), α_i (B, S))``.
        """
        e = self.drop(self.tgt_emb(y_prev))  # (B, E)
        context, weights = self.attend(state, keys, states, keep)  # (B, 2H), (B, S)
        state = self.decoder(torch.cat([e, context], dim=-1), state)  # (B, Dd)
        hidden = torch.tanh(self.pre_out(self.drop(torch.cat([state, context, e], dim=-1))))
        return self.out(hidden), state, weights

    def _teacher(self, src: Tensor, src_mask: Tensor, tgt_in: Tensor) -> tuple[Tensor, Tensor]:
        src, src_mask = _check_pair(src, src_mask)
        check_token_ids("src", src, self.config.src_vocab_size)
        check_token_ids("tgt_in", tgt_in, self.config.tgt_vocab_size)
        if tgt_in.shape[0] != src.shape[0]:
            raise ValueError(
                f"tgt_in must have the batch size of src ({src.shape[0]}), got shape "
                f"{tuple(tgt_in.shape)}"
            )
        states, s = self.encode(src, src_mask)
        keys, keep = self.project_keys(states), src_mask[:, None, :]  # (B, S, A), (B, 1, S)
        logits, weights = [], []
        for t in range(tgt_in.shape[1]):
            lg, s, w = self.step(tgt_in[:, t], s, states, keys, keep)
            logits.append(lg)
            weights.append(w)
        B, S = src.shape
        if not logits:
            empty = states.new_zeros(B, 0, self.config.tgt_vocab_size)
            return empty, states.new_zeros(B, 0, S)
        return torch.stack(logits, 1), torch.stack(weights, 1)

    def forward(self, src: Tensor, src_mask: Tensor, tgt_in: Tensor) -> Tensor:
        """Teacher-forced logits.

        Args:
            src: ``(B, S)`` source ids. src_mask: ``(B, S)`` bool, True = real token.
            tgt_in: ``(B, T)`` target ids starting with BOS.

        Returns:
            ``(B, T, V_tgt)``: ``logits[:, i]`` predicts the token after ``tgt_in[:, i]``.
        """
        return self._teacher(src, src_mask, tgt_in)[0]

    def alignment(self, src: Tensor, src_mask: Tensor, tgt_in: Tensor) -> Tensor:
        """The attention weights α (``(B, T, S)``) of the teacher-forced run: row i is what the
        decoder read to predict the token after ``tgt_in[:, i]``; rows sum to 1 over the real
        source tokens, padded columns are 0 (a row of a source without real tokens is 0)."""
        return self._teacher(src, src_mask, tgt_in)[1]

    @torch.no_grad()
    def greedy(self, src: Tensor, src_mask: Tensor, *, max_len: int, bos: int, eos: int) -> Tensor:
        """Greedy decoding, one step per token (the recurrent state is the cache).

        Args:
            src: ``(B, S)``. src_mask: ``(B, S)`` bool, True = real token.
            max_len: the most tokens produced (>= 1). bos, eos: target ids.

        Returns:
            ``(B, n)`` with n <= max_len (it stops when every row has produced EOS); BOS is not
            included and positions after a row's EOS hold EOS.
        """
        src, src_mask = _check_pair(src, src_mask)
        check_token_ids("src", src, self.config.src_vocab_size)
        check_int("max_len", max_len, minimum=1)
        V = self.config.tgt_vocab_size
        for name, value in (("bos", bos), ("eos", eos)):
            check_int(name, value, minimum=0)
            if value >= V:
                raise ValueError(f"{name} must be < tgt_vocab_size={V}, got {value}")
        was_training = self.training
        self.eval()
        try:
            states, s = self.encode(src, src_mask)
            keys, keep = self.project_keys(states), src_mask[:, None, :]
            y = torch.full((src.shape[0],), bos, dtype=torch.long, device=src.device)
            done = torch.zeros(src.shape[0], dtype=torch.bool, device=src.device)
            out = []
            for _ in range(max_len):
                logits, s, _ = self.step(y, s, states, keys, keep)
                y = torch.where(done, eos, logits.argmax(-1))  # (B,)
                out.append(y)
                done = done | (y == eos)
                if bool(done.all()):  # decoding loop (not a forward pass): one read per token
                    break
            return torch.stack(out, 1)
        finally:
            self.train(was_training)


def build_rnn_seq2seq(config: dict[str, Any]) -> RNNSeq2Seq:
    """The `RNNSeq2Seq` of a config dict (``model.config.to_dict()``)."""
    return RNNSeq2Seq(RNNSeq2SeqConfig.from_dict(config))


# ----------------------------------------------------------------------------- the character LM
@dataclass
class RNNLMConfig:
    """Sizes of `RNNLM` (validated on creation).

    Attributes:
        vocab_size: V. d_embed: the embedding width. d_hidden: each layer's state width.
        n_layers: stacked recurrent layers. cell: "gru" or "lstm".
        dropout: on the embeddings, between layers and before the head (training only).
    """

    vocab_size: int = 256
    d_embed: int = 256
    d_hidden: int = 256
    n_layers: int = 2
    cell: str = "gru"
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_embed", "d_hidden", "n_layers"):
            check_int(name, getattr(self, name), minimum=1)
        if self.cell not in CELLS:
            raise ValueError(f"cell must be one of {list(CELLS)}, got {self.cell!r}")
        check_probability("dropout", self.dropout)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; ``RNNLMConfig.from_dict(c.to_dict()) == c``."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RNNLMConfig:
        """The inverse of `to_dict`; unknown keys raise ValueError naming them."""
        return _from_dict(cls, data)


State = list[Tensor] | list[tuple[Tensor, Tensor]]


class RNNLM(nn.Module):
    """A character-level recurrent LM: ``logits = head(rnn_N(…rnn_1(embed(idx))))``.

    ``layers.i`` is a single-layer ``nn.GRU`` / ``nn.LSTM``; the state carried between calls is
    one ``h`` (GRU) or ``(h, c)`` (LSTM) of shape ``(1, B, d_hidden)`` per layer, so a generated
    token costs one step of every layer whatever the length of the context (O(d²) per layer).

    Example:
        >>> lm = RNNLM(RNNLMConfig(vocab_size=65, d_hidden=128))
        >>> logits = lm(torch.randint(0, 65, (4, 32)))           # (4, 32, 65)
        >>> logits, state = lm.run(idx)                           # keep the state
        >>> logits, state = lm.run(next_ids, state)               # continue
    """

    def __init__(self, config: RNNLMConfig) -> None:
        super().__init__()
        if not isinstance(config, RNNLMConfig):
            raise TypeError(f"config must be an RNNLMConfig, got {type(config).__name__}")
        self.config = c = config
        cell = nn.GRU if c.cell == "gru" else nn.LSTM
        self.embed = nn.Embedding(c.vocab_size, c.d_embed)
        self.layers = nn.ModuleList(
            cell(c.d_embed if i == 0 else c.d_hidden, c.d_hidden, batch_first=True)
            for i in range(c.n_layers)
        )
        self.drop = nn.Dropout(c.dropout)
        self.head = nn.Linear(c.d_hidden, c.vocab_size)

    def run(self, idx: Tensor, state: State | None = None) -> tuple[Tensor, State]:
        """Logits of every position and the state after the last one.

        Args:
            idx: ``(B, L)`` token ids. state: from a previous call (None = zeros).

        Returns:
            ``(logits (B, L, V), state)``.
        """
        idx = check_token_ids("idx", idx, self.config.vocab_size)
        if state is not None and (not isinstance(state, list) or len(state) != len(self.layers)):
            raise ValueError(
                f"state must be a list of {len(self.layers)} per-layer states (from run), "
                f"got {type(state).__name__}"
            )
        x = self.drop(self.embed(idx))  # (B, L, E)
        new_state = []
        for i, layer in enumerate(self.layers):
            x, s = layer(x, None if state is None else state[i])  # (B, L, Dh)
            x = self.drop(x)
            new_state.append(s)
        return self.head(x), new_state

    def forward(self, idx: Tensor) -> Tensor:
        """``(B, L)`` ids -> ``(B, L, V)`` next-token logits (from a zero state)."""
        return self.run(idx)[0]

    @torch.no_grad()
    def generate(
        self,
        idx: Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        *,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Samples ``max_new_tokens`` tokens after the prompt ``idx`` (eval mode): the prompt is
        read once, then each token is one step of every layer from the carried state.

        Args:
            idx: prompt ``(B, L)``, L >= 1. max_new_tokens: >= 0.
            temperature: logits are divided by it (> 0). top_k: sample among the k most likely
                (``top_k=1`` is greedy). generator: torch RNG for sampling.

        Returns:
            ``(B, L + max_new_tokens)``.
        """
        idx = check_token_ids("idx", idx, self.config.vocab_size)
        if idx.shape[1] < 1:
            raise ValueError(f"idx must hold at least one token per row, got {tuple(idx.shape)}")
        check_int("max_new_tokens", max_new_tokens, minimum=0)
        check_number("temperature", temperature, positive=True)
        if top_k is not None:
            check_int("top_k", top_k, minimum=1)
        was_training = self.training
        self.eval()
        try:
            out = [idx]
            logits, state = self.run(idx)
            for _ in range(max_new_tokens):
                last = logits[:, -1].float() / temperature  # (B, V)
                if top_k is not None and top_k < last.shape[-1]:
                    kth = torch.topk(last, top_k, dim=-1).values[:, -1:]
                    last = last.masked_fill(last < kth, -math.inf)
                if top_k == 1:
                    nxt = last.argmax(-1, keepdim=True)
                else:
                    probs = torch.softmax(last, dim=-1)
                    nxt = torch.multinomial(probs, 1, generator=generator)  # (B, 1)
                out.append(nxt)
                logits, state = self.run(nxt, state)
            return torch.cat(out, 1)
        finally:
            self.train(was_training)


def build_rnn_lm(config: dict[str, Any]) -> RNNLM:
    """The `RNNLM` of a config dict (``model.config.to_dict()``)."""
    return RNNLM(RNNLMConfig.from_dict(config))


__all__ = [
    "CELLS",
    "RNNLM",
    "RNNLMConfig",
    "RNNSeq2Seq",
    "RNNSeq2SeqConfig",
    "build_rnn_lm",
    "build_rnn_seq2seq",
]
