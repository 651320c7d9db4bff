"""A bidirectional Transformer encoder with padding masks (BERT-shaped, without the heads)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..masks import from_tensor
from .blocks import TransformerBlock, make_norm, positional_parts
from .config import TransformerConfig
from .gpt import check_token_ids


class Encoder(nn.Module):
    """Bidirectional stack: ``h = norm(blocks(embed(idx)))`` where every token sees every real key.

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
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        if not isinstance(config, TransformerConfig):
            raise TypeError(f"config must be a TransformerConfig, got {type(config).__name__}")
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb, rope, bias_fn = positional_parts(config, causal=False)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(
            TransformerBlock(config, rope=rope, bias_fn=bias_fn) for _ in range(config.n_layers)
        )
        self.norm_f = make_norm(config) if config.prenorm else nn.Identity()

    def forward(self, idx: Tensor, *, padding_mask: Tensor | None = None) -> Tensor:
        """Contextual embeddings of every position.

        Args:
            idx: token ids ``(B, L)``, L <= max_seq_len.
            padding_mask: bool ``(B, L)``, True at real tokens; None = no padding.

        Returns:
            ``(B, L, E)``.
        """
        cfg = self.config
        idx = check_token_ids("idx", idx, cfg.vocab_size)
        B, L = idx.shape
        if cfg.max_seq_len < L:
            raise ValueError(f"idx has {L} positions, more than max_seq_len={cfg.max_seq_len}")
        mask = None
        if padding_mask is not None:
            if not isinstance(padding_mask, Tensor) or padding_mask.dtype != torch.bool:
                got = padding_mask.dtype if isinstance(padding_mask, Tensor) else type(padding_mask)
                raise TypeError(
                    f"padding_mask must be a bool tensor (True = real token), got {got}"
                )
            if tuple(padding_mask.shape) != (B, L):
                raise ValueError(
                    f"padding_mask must have shape (B, L) = {(B, L)}, got "
                    f"{tuple(padding_mask.shape)}"
                )
            mask = from_tensor(padding_mask[:, None, None, :].to(idx.device))  # (B, 1, 1, S)
        x = self.tok_emb(idx)  # (B, L, E)
        if self.pos_emb is not None:
            x = x + self.pos_emb(torch.arange(L, device=idx.device)).to(x.dtype)  # (B, L, E)
        x = self.drop(x)
        for block in self.blocks:
            x = block(x, mask=mask)
        return self.norm_f(x)  # (B, L, E)
