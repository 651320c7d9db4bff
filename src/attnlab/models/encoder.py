"""A bidirectional Transformer encoder with padding masks (BERT-shaped, without the heads)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..masks import Mask, from_tensor
from ..positional import LearnedPositionalEmbedding
from .blocks import StackOutput, TransformerBlock, make_norm, positional_parts, run_blocks
from .config import TransformerConfig
from .gpt import check_token_ids


def check_padding_mask(padding_mask: object, B: int, T: int, dims: str) -> None:
    """Raises TypeError/ValueError unless ``padding_mask`` is a bool ``(B, T)`` tensor
    (True = real token); ``dims`` names the shape in the message, e.g. ``"(B, L)"``."""
    if not isinstance(padding_mask, Tensor) or padding_mask.dtype != torch.bool:
        got = padding_mask.dtype if isinstance(padding_mask, Tensor) else type(padding_mask)
        raise TypeError(f"padding_mask must be a bool tensor (True = real token), got {got}")
    if tuple(padding_mask.shape) != (B, T):
        raise ValueError(
            f"padding_mask must have shape {dims} = {(B, T)}, got {tuple(padding_mask.shape)}"
        )


class Encoder(nn.Module):
    """Bidirectional stack: ``h = norm(blocks(embed(idx)))`` where every token sees every real key.

    ``embed(idx) = drop(norm_e(W_tok[idx] + P[0..L−1] + W_type[types]))``: positions are added
    for "learned"/"sinusoidal" positionals (RoPE and ALiBi act inside the attention), token-type
    (segment) embeddings when ``config.type_vocab_size > 0`` (type 0 when not given), and
    ``norm_e`` is a norm when ``config.embed_norm`` (BERT), else the identity. The final
    ``norm`` is the identity for post-LN blocks.

    ``padding_mask[b, j] = True`` marks a real token (True = may attend, as everywhere in
    attnlab); padded keys are masked for every query, so the outputs at real positions do not
    depend on what the padded positions hold or how many there are (right padding: positions
    count from the start of the sequence). Outputs at padded positions are computed but
    meaningless. ALiBi uses its symmetric form ``−slope·|i − j|`` here.

    Example:
        >>> enc = Encoder(TransformerConfig(vocab_size=100, d_model=64, n_heads=4, n_layers=2))
        >>> idx = torch.randint(0, 100, (2, 12))
        >>> pad = torch.arange(12) < torch.tensor([[12], [7]])    # (2, 12): lengths 12 and 7
        >>> h = enc(idx, padding_mask=pad)                          # (2, 12, 64)
        >>> h, weights = enc(idx, padding_mask=pad, need_weights=True)  # 2 × (2, 4, 12, 12)
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        if not isinstance(config, TransformerConfig):
            raise TypeError(f"config must be a TransformerConfig, got {type(config).__name__}")
        if config.has_window:
            raise ValueError(
                "Encoder is bidirectional: sliding_window / layer_types / "
                "attention='local_global' are causal-LM (GPT) options, got "
                f"sliding_window={config.sliding_window}, attention={config.attention!r}"
            )
        self.config = config
        self.tok_emb = nn.Embedding(
            config.vocab_size, config.d_model, padding_idx=config.pad_token_id
        )
        self.pos_emb, rope, bias_fn = positional_parts(config, causal=False)
        self.type_emb = (
            nn.Embedding(config.type_vocab_size, config.d_model) if config.type_vocab_size else None
        )
        self.emb_norm = make_norm(config) if config.embed_norm else None
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(
            TransformerBlock(config, rope=rope, bias_fn=bias_fn) for _ in range(config.n_layers)
        )
        self.norm_f = make_norm(config) if config.prenorm else nn.Identity()

    def forward(
        self,
        idx: Tensor,
        *,
        padding_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        need_weights: bool = False,
    ) -> Tensor | tuple[Tensor, tuple[Tensor, ...]]:
        """Contextual embeddings of every position.

        Args:
            idx: token ids ``(B, L)``, L <= max_seq_len.
            padding_mask: bool ``(B, L)``, True at real tokens; None = no padding.
            token_type_ids: integer ``(B, L)`` segment ids in ``[0, type_vocab_size)`` (needs
                ``config.type_vocab_size > 0``); None = all 0.
            need_weights: also return every block's attention weights ``(B, H, L, L)``, from
                this forward pass.

        Returns:
            ``(B, L, E)``, or ``(h, weights)`` with ``need_weights=True`` (a tuple of
            ``n_layers`` tensors).
        """
        cfg = self.config
        idx = check_token_ids("idx", idx, cfg.vocab_size)
        B, L = idx.shape
        if cfg.max_seq_len < L:
            raise ValueError(f"idx has {L} positions, more than max_seq_len={cfg.max_seq_len}")
        mask = None
        if padding_mask is not None:
            check_padding_mask(padding_mask, B, L, "(B, L)")
            mask = from_tensor(padding_mask[:, None, None, :].to(idx.device))  # (B, 1, 1, S)
        if token_type_ids is not None:
            if self.type_emb is None:
                raise ValueError(
                    "token_type_ids given but config.type_vocab_size = 0 (no token-type table)"
                )
            if not isinstance(token_type_ids, Tensor) or token_type_ids.dtype not in (
                torch.int64,
                torch.int32,
            ):
                got = (
                    token_type_ids.dtype
                    if isinstance(token_type_ids, Tensor)
                    else type(token_type_ids).__name__
                )
                raise TypeError(f"token_type_ids must be an int64 or int32 tensor, got {got}")
            if tuple(token_type_ids.shape) != (B, L):
                raise ValueError(
                    f"token_type_ids must have shape (B, L) = {(B, L)}, got "
                    f"{tuple(token_type_ids.shape)}"
                )
        out = self.encode(idx, mask=mask, token_type_ids=token_type_ids, need_weights=need_weights)
        if need_weights:
            assert out.attentions is not None
            return out.last_hidden_state, out.attentions
        return out.last_hidden_state

    def embed(self, idx: Tensor, token_type_ids: Tensor | None = None) -> Tensor:
        """``drop(norm_e(W_tok[idx] + P[0..L−1] + W_type[types]))``: ``(B, L)`` -> ``(B, L, E)``.

        No input checks (`forward` makes them); no host synchronisation.
        """
        L = idx.shape[-1]
        x = self.tok_emb(idx)  # (B, L, E)
        add: Tensor | None = None  # what every row gets: positions (and type 0), (L, E)
        if isinstance(self.pos_emb, LearnedPositionalEmbedding):
            add = self.pos_emb.weight[:L]  # (L, E): a slice, no range check to read back
        elif self.pos_emb is not None:
            add = self.pos_emb(torch.arange(L, device=idx.device))  # (L, E)
        if add is not None:
            add = add.to(x.dtype)
        if self.type_emb is not None and token_type_ids is None:
            # One (L, E) table instead of a second (B, L, E) sum.
            type0 = self.type_emb.weight[0]  # (E,)
            add = type0.expand(L, -1) if add is None else add + type0  # (L, E)
        if add is not None:
            x = x + add  # (B, L, E)
        if token_type_ids is not None and self.type_emb is not None:
            x = x + self.type_emb(token_type_ids)  # (B, L, E)
        if self.emb_norm is not None:
            x = self.emb_norm(x)
        return self.drop(x)

    def encode(
        self,
        idx: Tensor,
        *,
        mask: Mask | Tensor | None = None,
        token_type_ids: Tensor | None = None,
        need_weights: bool = False,
        need_hidden_states: bool = False,
    ) -> StackOutput:
        """`embed`, the blocks and the final norm, without input checks (`forward` makes them).

        Args:
            idx: token ids ``(B, L)``.
            mask: the attention mask of every block, broadcastable to ``(B, H, L, L)`` (True =
                may attend), e.g. a bool ``(B, 1, 1, L)`` padding mask.
            token_type_ids: ``(B, L)`` segment ids, or None (all 0).
            need_weights: collect every block's attention weights ``(B, H, L, L)``.
            need_hidden_states: collect the embeddings and every block's output.

        Returns:
            A `StackOutput` whose ``last_hidden_state`` is ``norm(x_N)`` ``(B, L, E)``.
        """
        x = self.embed(idx, token_type_ids)  # (B, L, E)
        out = run_blocks(
            self.blocks,
            x,
            mask=mask,
            need_weights=need_weights,
            need_hidden_states=need_hidden_states,
        )
        return out._replace(last_hidden_state=self.norm_f(out.last_hidden_state))  # (B, L, E)
