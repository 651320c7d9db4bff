"""A GPT-style causal language model built from attnlab parts (nanoGPT-like)."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .. import masks
from .._shapes import check_int, check_number
from ..modules import KVCache, SlidingWindowCache, StreamLinear
from . import fused_step
from .blocks import StackOutput, TransformerBlock, make_norm, positional_parts, run_blocks
from .config import TransformerConfig


def check_token_ids(name: str, idx: object, vocab_size: int) -> Tensor:
    """Checks an integer ``(B, L)`` tensor of ids in ``[0, vocab_size)``; returns it.

    Type and shape are always checked. The range check reads ``min``/``max`` of the ids back to
    the host, so it runs in eager mode only: under `torch.compile` / `torch.export`
    (``torch.compiler.is_compiling()``) and for ``meta`` tensors it is skipped, and an
    out-of-range id fails inside the embedding lookup instead.
    """
    if not isinstance(idx, Tensor):
        raise TypeError(f"{name} must be a (B, L) integer tensor, got {type(idx).__name__}")
    if idx.is_floating_point() or idx.is_complex() or idx.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor of token ids, got dtype {idx.dtype}")
    if idx.dim() != 2:
        raise ValueError(f"{name} must be (B, L), got shape {tuple(idx.shape)}")
    if torch.compiler.is_compiling() or idx.is_meta or not idx.numel():
        return idx
    lo, hi = torch.aminmax(idx)
    lo, hi = int(lo), int(hi)  # the one host read (eager only)
    if lo < 0 or hi >= vocab_size:
        raise ValueError(
            f"{name} holds token ids in [{lo}, {hi}], expected ids in [0, vocab_size={vocab_size})"
        )
    return idx


def context_start(total: int, start: int, window: int) -> int:
    """Where generation's context begins: unchanged while ``total − start <= window``.

    When the context would exceed ``window`` (= max_seq_len) it restarts from the last
    ``max(1, window // 2)`` tokens. Cached and uncached generation both use this rule, so they
    agree token for token at any length; the cache is rebuilt only once per window/2 tokens.
    """
    if total - start <= window:
        return start
    return total - max(1, window // 2)


class GPT(nn.Module):
    """Decoder-only causal LM: ``logits = head(norm(blocks(embed(idx))))``.

    Token embeddings (plus learned/sinusoidal positions, or RoPE/ALiBi inside attention) feed
    ``n_layers`` `TransformerBlock`s with a causal mask (bottom-right aligned, so the same mask
    serves prefill and single-token decoding with a `KVCache`). The output projection is tied to
    the token embedding when ``config.tie_embeddings``. Weights are initialised as in GPT-2:
    N(0, 0.02), and the projections into the residual stream N(0, 0.02/sqrt(2·n_layers)).

    Windows (``config.sliding_window``, ``config.layer_types``): a sliding layer attends to its
    last W keys, ``masks.sliding_window(W)`` (Mistral's mask: query i sees ``i − W < j <= i``;
    the tiled backend's band kernel once the sizes favour it), and decodes with a
    `SlidingWindowCache` of W keys; full layers attend causally. ``config.attention =
    "local_global"`` puts `attnlab.modules.LocalGlobalAttention` in every layer.

    Attributes:
        gradient_checkpointing: recompute each block in backward instead of storing its
            activations (training without caches only).

    Compile, export, meta: ``forward`` makes no host synchronisation (the token-id range check
    of `check_token_ids` runs in eager mode only and is skipped while compiling/exporting and
    for ``meta`` tensors), so ``torch.compile(model, fullgraph=True)`` traces it in one graph,
    with or without caches. For compiled decoding pass the caches as an argument
    (``step(idx_t, caches=caches)``) and preallocate them (``new_caches(max_seq_len)``, as
    `generate` does): one graph for the prefill, one shared by all later tokens.
    ``torch.export.export(model, (idx,))`` exports the uncached forward. ``model.to("meta")``
    with ``meta`` ids gives the logits' shape.

    Example:
        >>> model = GPT(TransformerConfig(vocab_size=65, d_model=64, n_layers=2, n_heads=4))
        >>> logits = model(torch.randint(0, 65, (2, 16)))            # (2, 16, 65)
        >>> out = model.generate(torch.zeros(1, 1, dtype=torch.long), 20, top_k=1)  # (1, 21)
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        if not isinstance(config, TransformerConfig):
            raise TypeError(f"config must be a TransformerConfig, got {type(config).__name__}")
        self.config = config
        self.gradient_checkpointing = False
        self.tok_emb = nn.Embedding(
            config.vocab_size, config.d_model, padding_idx=config.pad_token_id
        )
        self.pos_emb, rope, bias_fn = positional_parts(config, causal=True)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(
            TransformerBlock(config, rope=rope, bias_fn=bias_fn, layer=i)
            for i in range(config.n_layers)
        )
        # Post-LN blocks already end in a norm; pre-LN stacks need a final one.
        self.norm_f = make_norm(config) if config.prenorm else nn.Identity()
        self.lm_head = StreamLinear(config.d_model, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith(("attn.out_proj.weight", "mlp.fc2.weight", "mlp.down.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * max(1, config.n_layers)))
        if config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    def new_caches(self, capacity: int | None = None) -> list[KVCache]:
        """One empty `KVCache` per layer (``capacity`` preallocates, e.g. max_seq_len); a
        sliding layer (``block.window = W``) gets a `SlidingWindowCache` that keeps its last W
        keys (``capacity`` unused).

        With a RoPE whose frequencies do not depend on the sequence length the caches rotate
        each key once, when it is cached (``KVCache(rotate_at_insert=True)``: these caches never
        evict, so the rotated keys are the ones a re-rotation would make, bit for bit), and a
        decode step rotates only its query; with a seq-len dependent RoPE they hold keys before
        RoPE and every step re-rotates them at the current frequencies.
        """
        rope = self.blocks[0].attn.rope if len(self.blocks) else None
        static = rope is not None and getattr(rope, "depends_on_seq_len", True) is False
        return [
            KVCache(capacity, rotate_at_insert=static)
            if block.window is None
            else SlidingWindowCache(block.window)
            for block in self.blocks
        ]

    def forward(
        self,
        idx: Tensor,
        *,
        caches: list[KVCache] | None = None,
        need_weights: bool = False,
        mask: masks.Mask | None = None,
    ) -> Tensor | tuple[Tensor, tuple[Tensor, ...]]:
        """Next-token logits for every position.

        Args:
            idx: token ids ``(B, L)``.
            caches: None (the whole sequence is ``idx``), or one `KVCache` per layer holding the
                tokens before ``idx``; they are appended to (prefill, then one token at a time).
            need_weights: also return every layer's attention weights ``(B, H, L, S)`` (S counts
                the cached tokens too), computed by this forward pass's attention calls.
            mask: an attnlab `Mask` that restricts the causal attention further
                (``causal() & mask``): ``masks.document(ids)`` trains on packed documents, each
                token attending only earlier tokens of its own document. Not with ``caches``.

        Returns:
            logits ``(B, L, V)``, or ``(logits, weights)`` with ``need_weights=True`` (a tuple
            of ``n_layers`` tensors).

        Raises:
            TypeError / ValueError: non-integer ids, ids outside the vocabulary, more than
                ``max_seq_len`` positions (cached + new), a wrong number of caches, a ``mask``
                that is not a `Mask`, or a ``mask`` with ``caches``.
        """
        idx = check_token_ids("idx", idx, self.config.vocab_size)
        if mask is not None and not isinstance(mask, masks.Mask):
            raise TypeError(f"mask must be an attnlab Mask or None, got {type(mask).__name__}")
        if mask is not None and caches is not None:
            raise ValueError("mask restricts a whole sequence: pass it without caches")
        out = self._trunk(idx, caches, need_weights, mask)
        logits = self.lm_head(self.norm_f(out.last_hidden_state))  # (B, L, V)
        return (logits, out.attentions) if need_weights else logits  # type: ignore[return-value]

    def _trunk(
        self,
        idx: Tensor,
        caches: list[KVCache] | None,
        need_weights: bool = False,
        extra: masks.Mask | None = None,
    ) -> StackOutput:
        """The blocks' output for checked ids ``(B, L)``: ``last_hidden_state`` ``(B, L, E)``."""
        cfg = self.config
        offset = 0
        if caches is not None:
            if not isinstance(caches, (list, tuple)) or len(caches) != len(self.blocks):
                got = len(caches) if isinstance(caches, (list, tuple)) else type(caches).__name__
                raise ValueError(f"caches must be a list of {len(self.blocks)} KVCache, got {got}")
            offset = caches[0].seen if caches else 0
        L = idx.shape[1]
        if offset + L > cfg.max_seq_len:
            raise ValueError(
                f"sequence of {offset + L} positions ({offset} cached + {L} new) exceeds "
                f"max_seq_len={cfg.max_seq_len}"
            )
        x = self._embed(idx, offset)  # (B, L, E)
        # Bottom-right causal; a single new token (decoding) is the last query and sees every key.
        causal = masks.causal() if L > 1 else None
        if extra is not None:
            causal = extra if causal is None else causal & extra
        return run_blocks(
            self.blocks,
            x,
            mask=causal,
            caches=caches,
            need_weights=need_weights,
            checkpointing=(
                self.gradient_checkpointing and self.training and torch.is_grad_enabled()
            ),
        )

    def _embed(self, idx: Tensor, offset: int) -> Tensor:
        """Token (and added position) embeddings ``(B, L, E)`` of ids ``(B, L)`` at positions
        ``offset … offset + L − 1``."""
        x = self.tok_emb(idx)  # (B, L, E)
        if self.pos_emb is not None:
            pos = torch.arange(offset, offset + idx.shape[1], device=idx.device)  # (L,)
            x = x + self.pos_emb(pos).to(x.dtype)  # (B, L, E)
        if self.training:  # eval-mode dropout is the identity: skip the call (decode steps)
            x = self.drop(x)
        return x

    def _step_logits(
        self, idx: Tensor, caches: list[KVCache], plans: list[fused_step.StepPlan | None]
    ) -> Tensor:
        """`_next_logits` of one new token per row ``(B, 1)`` through the blocks' fused steps
        (`attnlab.models.fused_step`: plans made for this decode loop); a block without a plan,
        or whose plan declines the step, runs its modules."""
        x = self._embed(idx, caches[0].seen)  # (B, 1, E)
        for block, p, cache in zip(self.blocks, plans, caches, strict=True):
            y = None if p is None else p.run(x, cache)
            x = block(x, cache=cache) if y is None else y  # (B, 1, E)
        return self.lm_head(self.norm_f(x))[:, 0]  # (B, V)

    def _next_logits(self, idx: Tensor, caches: list[KVCache] | None) -> Tensor:
        """Logits ``(B, V)`` of the last position only, for ids `generate` already checked.

        The final norm and the output projection run on one position per row (a prompt of P
        tokens would otherwise cost P·E·V multiply-adds in the head for one used row). The norm
        is per position, so the values are those of ``self(idx)[:, -1]`` up to the rounding of
        a matrix product of another shape.
        """
        h = self._trunk(idx, caches).last_hidden_state[:, -1:]  # (B, 1, E)
        return self.lm_head(self.norm_f(h))[:, 0]  # (B, V)

    def generate(
        self,
        idx: Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        use_cache: bool = True,
        *,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Samples ``max_new_tokens`` tokens after the prompt ``idx``, in eval mode.

        With ``use_cache`` the prompt is prefilled once and each new token is one forward pass
        of length 1 against one `KVCache` per layer; without it every step recomputes the whole
        context. Both see the same context (see `context_start`: past ``max_seq_len`` it restarts
        from the last ``max_seq_len // 2`` tokens) and so produce the same tokens.

        Args:
            idx: prompt ``(B, L)``, L >= 1.
            max_new_tokens: number of tokens to append (>= 0).
            temperature: logits are divided by it (> 0).
            top_k: sample among the k most likely tokens; ``top_k=1`` is greedy (argmax).
            use_cache: decode with KV caches (fast) or recompute (the reference).
            generator: torch RNG for sampling (reproducible runs).

        Returns:
            ``(B, L + max_new_tokens)``: the prompt followed by the new tokens.
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
            # inference_mode (no autograd bookkeeping at all: ~10 % of a small model's decode
            # step); the result is cloned out of it so callers get an ordinary tensor.
            with torch.inference_mode():
                out = self._decode(idx, max_new_tokens, temperature, top_k, use_cache, generator)
            return out.clone()
        finally:
            self.train(was_training)

    def _decode(
        self,
        idx: Tensor,
        max_new_tokens: int,
        temperature: float,
        top_k: int | None,
        use_cache: bool,
        generator: torch.Generator | None,
    ) -> Tensor:
        """`generate`'s loop on checked arguments: ``(B, P) -> (B, P + max_new_tokens)``."""
        window = self.config.max_seq_len
        B, P = idx.shape
        total = P + max_new_tokens  # the caches never hold more (nor than window)
        # The prompt and every new token in one buffer (no torch.cat per token); the new tokens
        # come from argmax/sampling over the V logits, so they need no id check.
        out = idx.new_empty(B, total, dtype=torch.long)
        out[:, :P] = idx
        start, caches = 0, None
        # one fused C++ call per block and step where every block allows it (planned once: no
        # user code runs between the steps of this loop)
        plans = [fused_step.plan(b, B, self.tok_emb.weight.dtype) for b in self.blocks]
        # (a block without a plan, e.g. a sliding layer, runs its modules inside the loop)
        fused = None if all(p is None for p in plans) else plans
        for t in range(P, total):
            new_start = context_start(t, start, window)
            if not use_cache:
                start = new_start
                logits = self._next_logits(out[:, start:t], None)  # recompute: (B, V)
            elif caches is None or new_start != start:
                # Prefill, or the context is full: rebuild the caches from its tail.
                start, caches = new_start, self.new_caches(min(window, total - new_start))
                logits = self._next_logits(out[:, start:t], caches)  # (B, V)
            elif fused is not None:
                logits = self._step_logits(out[:, t - 1 : t], caches, fused)  # (B, V)
            else:
                logits = self._next_logits(out[:, t - 1 : t], caches)  # one token: (B, V)
            out[:, t : t + 1] = self._sample(logits, temperature, top_k, generator)
        return out

    @staticmethod
    def _sample(
        logits: Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None
    ) -> Tensor:
        """One token id per row ``(B, 1)`` from logits ``(B, V)``."""
        if top_k == 1:
            # argmax, the first index of the row's max (NaN counts as the max, as in argmax):
            # max(dim).indices is 2.7-4.5× faster than argmax on CPU at (4, 32000) (one thread:
            # fp32 170 → 56 µs, bf16 428 → 95 µs per step)
            return logits.max(dim=-1, keepdim=True).indices  # (B, 1)
        logits = logits.float() / temperature
        if top_k is not None and top_k < logits.shape[-1]:
            kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)  # (B, V)
        return torch.multinomial(probs, 1, generator=generator)  # (B, 1)
