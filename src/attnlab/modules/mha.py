"""Multi-head attention with grouped-query heads, RoPE, function biases and a KV cache."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn

from .._shapes import check_int, check_probability, stat_dtype
from ..functional import attention, gemv, nan_rule
from ..functional.decode import decode_step_ready, decode_step_run, rope_decode_run
from ..functional.registry import check_backend_name, select
from ..functional.request import BiasFn, trusted_request
from ..masks import CausalMask, Mask, from_tensor
from ..positional.rope import RoPE
from .kv_cache import KVCache, check_cache_positions
from .stream_linear import StreamLinear


def _combine(user: Mask | Tensor | None, policy: Mask | None) -> Mask | Tensor | None:
    if policy is None:
        return user
    if user is None:
        return policy
    if isinstance(user, Tensor) and user.dtype != torch.bool:
        raise ValueError("a float (additive) mask cannot be combined with a cache's window mask")
    return policy & (user if isinstance(user, Mask) else from_tensor(user))


def _rotate_new_keys(rope: nn.Module, k: Tensor, positions: Tensor | int) -> Tensor:
    """``rope(k, positions)`` for a rotate-at-insert cache's new keys ``(B, H_kv, T, D)``.

    With a plain static `RoPE`, an int start and the C++ operators usable (eager, CPU, no
    gradient), one call rotates from the memoised table (``attnlab_nan::rope_rows``, bit-equal
    to `RoPE.forward`'s table path) instead of RoPE's Python checks and six tensor ops.
    """
    if (
        type(rope) is RoPE
        and not rope.depends_on_seq_len
        and type(positions) is int
        and positions >= 0
        and k.dim() == 4
        and nan_rule.ext_ready(k)
    ):
        dtype = stat_dtype(k.dtype)
        cos, sin = rope.table(positions + k.shape[2], k.device, dtype)
        return torch.ops.attnlab_nan.rope_rows(
            k, cos, sin, positions, rope.rotary_dim, rope.interleaved
        )
    return rope(k, positions)


class MultiHeadAttention(nn.Module):
    """Multi-head attention: ``out = W_o · concat_h attn(x W_q^h, x W_k^{g(h)}, x W_v^{g(h)})``.

    Query head ``h`` uses key/value head ``g(h) = h // G`` with ``G = num_heads / num_kv_heads``
    (GQA; MQA when ``num_kv_heads = 1``). Self-attention uses one fused QKV projection; with
    ``kdim``/``vdim`` different from ``embed_dim`` the projections are separate.

    Args:
        embed_dim: E, model dimension (inputs and outputs are batch-first ``(B, L, E)``).
        num_heads: H, query heads; ``E % H == 0`` and the head dim is ``D = E / H``.
        num_kv_heads: H_kv, key/value heads (default H); ``H % H_kv == 0``.
        dropout: dropout on the attention weights in training mode.
        bias: whether the projections have biases.
        kdim, vdim: feature sizes of key and value inputs for cross-attention (default E).
        rope: an `attnlab.positional.RoPE` applied to q and k (keys are cached before it, unless
            the cache was made with ``rotate_at_insert=True``).
        bias_fn: an additive bias ``fn(b, h, i, j)`` such as `attnlab.positional.ALiBi`.
        backend: the `attnlab.attention` backend.
        sinks: learn one attention-sink logit per query head (GPT-OSS), a parameter ``sinks``
            of shape ``(H,)`` initialised to 0: every row's softmax denominator gains
            ``e^{s_h}`` (``attnlab.attention(..., sinks=)``), with or without a cache.

    Compile, export, meta:
        ``forward`` makes no host synchronisation and branches only on shapes and Python state,
        so (with a sync-free attention backend, e.g. ``"sdpa"``):

        - ``torch.compile(mha, fullgraph=True)`` traces self-, cross-, GQA and RoPE attention,
          with or without a cache, in one graph (0 graph breaks), forward and backward.
        - Decoding with a cache: ``step = torch.compile(mha, fullgraph=True)`` then
          ``step(x_t, cache=cache)`` per token; pass the cache as an *argument* (its Python-int
          lengths then become dynamic). A preallocated ``KVCache(capacity)`` compiles one graph
          for the prefill and one shared by all later steps; a growing ``KVCache()`` recompiles
          a few times while its buffer first grows (16, 32 slots), then no more.
        - ``torch.export.export(mha, (query,))`` or ``(query, key, value)``, optionally with
          ``dynamic_shapes`` for B/L/S, and a mask given as a bool/float *tensor* input. A
          structured `Mask` (``masks.causal()``…) is not a pytree: build it inside the exported
          module's ``forward`` (a wrapper calling ``mha(query, mask=masks.causal())``).
          Caches are Python state, not inputs: export the uncached forward.
        - ``meta`` tensors (``mha.to("meta")``) give the output shapes, weights included.

        Decode steps: with a cache, no mask (or causal with one query), no bias and no weights,
        when auto picks the decode backend and RoPE is a plain `RoPE` with static frequencies,
        the rotation of q and of every cached key and the attention run in one C++ call
        (`attnlab.functional.decode.rope_decode_run`; bit-equal to rotating in Python and
        calling the decode backend, whose C++ kernel follows the tolerance rule against the
        tensor-op path that runs whenever the operators are unavailable, under compile, on meta
        tensors or with autograd).

        Eager-only host reads: RoPE scaling that depends on the sequence length (``dynamic``,
        ``longrope``) with caller-given position *tensors* reads ``max(positions) + 1`` (default
        and int positions, and the caches' own positions, are known on the host).

    Example:
        >>> mha = MultiHeadAttention(256, 8, num_kv_heads=2, rope=RoPE(32))
        >>> y = mha(torch.randn(2, 10, 256), mask=masks.causal())   # (2, 10, 256)
    """

    #: Unmasked calls without bias, sinks or weights skip `attend` (`_unmasked`).
    unmasked_fast_path = True

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        dropout: float = 0.0,
        bias: bool = True,
        kdim: int | None = None,
        vdim: int | None = None,
        rope: nn.Module | None = None,
        bias_fn: BiasFn | None = None,
        backend: str = "auto",
        sinks: bool = False,
    ) -> None:
        super().__init__()
        E = check_int("embed_dim", embed_dim, minimum=1)
        H = check_int("num_heads", num_heads, minimum=1)
        H_kv = H if num_kv_heads is None else check_int("num_kv_heads", num_kv_heads, minimum=1)
        if E % H:
            raise ValueError(f"embed_dim={E} must be divisible by num_heads={H}")
        if H % H_kv:
            raise ValueError(f"num_heads={H} must be divisible by num_kv_heads={H_kv}")
        self.embed_dim, self.num_heads, self.num_kv_heads = E, H, H_kv
        self.head_dim = E // H
        self.kdim = E if kdim is None else check_int("kdim", kdim, minimum=1)
        self.vdim = E if vdim is None else check_int("vdim", vdim, minimum=1)
        self.dropout = check_probability("dropout", dropout)
        self.backend = check_backend_name(backend)
        self.rope = rope
        self.bias_fn = bias_fn
        D = self.head_dim
        if self.kdim == E and self.vdim == E:
            self.qkv_proj: nn.Linear | None = StreamLinear(E, (H + 2 * H_kv) * D, bias=bias)
            self.q_proj = self.k_proj = self.v_proj = None
        else:
            self.qkv_proj = None
            self.q_proj = StreamLinear(E, H * D, bias=bias)
            self.k_proj = StreamLinear(self.kdim, H_kv * D, bias=bias)
            self.v_proj = StreamLinear(self.vdim, H_kv * D, bias=bias)
        self.out_proj = StreamLinear(H * D, E, bias=bias)
        if not isinstance(sinks, bool):
            raise TypeError(f"sinks must be a bool, got {type(sinks).__name__}")
        self.sinks = nn.Parameter(torch.zeros(H)) if sinks else None

    # ------------------------------------------------------------------ projections
    def projection_weights(self) -> tuple[tuple[Tensor, Tensor | None], ...]:
        """``((W_q, b_q), (W_k, b_k), (W_v, b_v))`` as views of the parameters."""
        if self.qkv_proj is None:
            return tuple((p.weight, p.bias) for p in (self.q_proj, self.k_proj, self.v_proj))  # type: ignore[union-attr]
        sizes = [self.num_heads * self.head_dim, *(2 * [self.num_kv_heads * self.head_dim])]
        ws = self.qkv_proj.weight.split(sizes)
        bs = self.qkv_proj.bias.split(sizes) if self.qkv_proj.bias is not None else (None,) * 3
        return tuple(zip(ws, bs, strict=True))

    def _heads(self, x: Tensor, n: int) -> Tensor:
        B, L, _ = x.shape
        return x.view(B, L, n, self.head_dim).transpose(1, 2)  # (B, n, L, D)

    def project(self, query: Tensor, key: Tensor | None = None, value: Tensor | None = None):
        """q ``(B, H, L, D)``, k ``(B, H_kv, S, D)``, v ``(B, H_kv, S, D)`` before RoPE."""
        H, H_kv = self.num_heads, self.num_kv_heads
        if key is None and self.qkv_proj is not None:
            qkv = self.qkv_proj(query)  # (B, L, (H + 2 H_kv) D)
            B, L, _ = qkv.shape
            heads = qkv.view(B, L, H + 2 * H_kv, self.head_dim).transpose(1, 2)
            # (B, H + 2 H_kv, L, D): the same views as splitting first, in three ops instead of 7
            q, k, v = heads.split([H, H_kv, H_kv], dim=1)
            return q, k, v
        (wq, bq), (wk, bk), (wv, bv) = self.projection_weights()
        key = query if key is None else key
        value = key if value is None else value
        q = gemv.linear(query, wq, bq)  # (B, L, H D)
        k = gemv.linear(key, wk, bk)  # (B, S, H_kv D)
        v = gemv.linear(value, wv, bv)  # (B, S, H_kv D)
        return self._heads(q, H), self._heads(k, H_kv), self._heads(v, H_kv)

    def _check(self, query: Tensor, key: Tensor | None, value: Tensor | None) -> None:
        def bad(t: object, dim: int) -> bool:
            return not isinstance(t, Tensor) or t.dim() != 3 or t.shape[-1] != dim

        if bad(query, self.embed_dim):
            got = tuple(query.shape) if isinstance(query, Tensor) else type(query).__name__
            raise ValueError(f"query must be (B, L, embed_dim={self.embed_dim}), got {got}")
        if key is not None and bad(key, self.kdim):
            got = tuple(key.shape) if isinstance(key, Tensor) else type(key).__name__
            raise ValueError(f"key must be (B, S, kdim={self.kdim}), got {got}")
        if value is not None and bad(value, self.vdim):
            got = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise ValueError(f"value must be (B, S, vdim={self.vdim}), got {got}")
        if key is None and value is not None:
            raise ValueError("value given without key")
        if key is None and (self.kdim != self.embed_dim or self.vdim != self.embed_dim):
            raise ValueError(
                f"self-attention needs kdim = vdim = embed_dim; this module has kdim={self.kdim}, "
                f"vdim={self.vdim}: pass key and value"
            )

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        *,
        mask: Mask | Tensor | None = None,
        cache: KVCache | None = None,
        need_weights: bool = False,
        positions: Tensor | int | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Attends from ``query`` to ``key``/``value`` (self-attention when key is None).

        Args:
            query: ``(B, L, E)``. key: ``(B, S, kdim)``. value: ``(B, S, vdim)`` (default key).
            mask: `Mask`, bool (True = may attend) or additive float, broadcastable to
                ``(B, H, L, S)`` where S counts cached keys too; bottom-right aligned.
            cache: a `KVCache` (self-attention): new keys/values are appended and the queries
                attend to everything cached, with the cache's eviction mask applied. ``L = 0``
                leaves the cache unchanged and returns ``(B, 0, E)``.
            need_weights: also return the weights ``(B, H, L, S)``.
            positions: RoPE positions of the queries (and keys, in self-attention): ``(L,)``,
                ``(B, L)`` or an int offset; default ``0…L−1``, or the cache's next positions.
                Integer tensors only with a cache (float positions raise ValueError: the cache
                stores int64 positions and would truncate them).

        Returns:
            ``(B, L, E)``, or ``(out, weights)`` with ``need_weights=True``.
        """
        self._check(query, key, value)
        if cache is not None and key is not None:
            raise ValueError("cache is for self-attention: call with key=None when passing a cache")
        rope = self.rope
        # a rotate-at-insert cache holds keys after RoPE: only the new keys are rotated
        rotated_cache = rope is not None and getattr(cache, "rotate_at_insert", False) is True
        if cache is not None:
            check_cache_positions(positions if isinstance(positions, Tensor) else None)
            if rotated_cache and getattr(rope, "depends_on_seq_len", True):
                raise ValueError(
                    "a rotate_at_insert KVCache needs a RoPE whose frequencies do not depend on "
                    f"the sequence length (got {rope!r}): use a cache of pre-RoPE keys"
                )
        q, k, v = self.project(query, key, value)
        B, _, L, _ = q.shape
        q_pos = k_pos = positions
        seq_len: int | None = None  # max(key position) + 1, only for seq-len dependent RoPE
        if cache is not None:
            if isinstance(positions, int) and not isinstance(positions, bool):
                positions = torch.arange(positions, positions + L, device=q.device)
            if rotated_cache:  # the new keys are rotated once, at their positions, and cached
                start = cache.seen if positions is None else positions
                k = _rotate_new_keys(rope, k, start)  # type: ignore[arg-type]
            view = cache.update(k, v, positions)
            k, v = view.k, view.v
            mask = _combine(mask, view.mask)
            if view.start is not None:  # positions start, start + 1, …: known on the host
                S = k.shape[2]
                k_pos, q_pos, seq_len = view.start, view.start + S - L, view.start + S
            else:
                k_pos, q_pos = view.k_positions, view.q_positions
        if L == 1 and isinstance(mask, CausalMask):
            mask = None  # bottom-right causal: a single query (a decode step) sees every key
        if rope is not None:
            if key is not None and positions is None:
                k_pos = None
            if (
                seq_len is None
                and isinstance(k_pos, Tensor)
                and getattr(rope, "depends_on_seq_len", True)
                and k_pos.numel()
            ):
                # Eager-only host read: dynamic/longrope scaling with caller-given position
                # tensors (default and int positions never get here).
                seq_len = int(k_pos.max()) + 1
        dropout_p = self.dropout if self.training else 0.0
        plain = self.bias_fn is None and self.sinks is None and self.unmasked_fast_path
        if mask is None and plain and not need_weights:
            # `attention(q, k, v, dropout_p=…, backend=…)` without re-checking what the
            # projections made consistent: the same request, backend choice and kernel
            out = self._unmasked(q, k, v, rope, q_pos, k_pos, seq_len, dropout_p, rotated_cache)
        else:
            if rope is not None:
                q = rope(q, q_pos, seq_len=seq_len)
                if not rotated_cache:
                    k = rope(k, k_pos, seq_len=seq_len)
            result = self.attend(q, k, v, mask, dropout_p, need_weights)
            out, weights = result if need_weights else (result, None)
        out = out.transpose(1, 2).reshape(B, L, self.num_heads * self.head_dim)  # (B, L, H D)
        out = self.out_proj(out)  # (B, L, E)
        return (out, weights) if need_weights else out

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Mask | Tensor | None,
        dropout_p: float,
        need_weights: bool,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """The heads' attention on rotated q ``(B, H, L, D)``, k/v ``(B, H_kv, S, ·)``:
        ``attention(q, k, v, mask=…, bias=bias_fn, sinks=…)``, ``(out, weights)`` with
        ``need_weights``. A subclass that attends differently overrides this (and sets
        ``unmasked_fast_path = False`` when even an unmasked call must come here)."""
        return attention(
            q,
            k,
            v,
            mask=mask,
            bias=self.bias_fn,
            dropout_p=dropout_p,
            backend=self.backend,
            return_weights=need_weights,
            sinks=self.sinks,
        )

    def _unmasked(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        rope: nn.Module | None,
        q_pos: Tensor | int | None,
        k_pos: Tensor | int | None,
        seq_len: int | None,
        dropout_p: float,
        keys_rotated: bool,
    ) -> Tensor:
        """``attention(rope(q, q_pos), rope(k, k_pos), v, dropout_p=…, backend=…)`` (no mask,
        bias or weights) for q ``(B, H, L, D)``, k/v ``(B, H_kv, S, ·)`` before RoPE (k as it is
        with ``keys_rotated``: a rotate-at-insert cache's keys).

        The request is built without re-validating the projections (`trusted_request`: the same
        fields, backend choice and kernel as `attention`). When the call goes to the decode
        backend's C++ step (`decode.decode_step_ready`, decided from shapes without a request)
        and RoPE reads rows of its eager table (a plain `RoPE` with static frequencies, int
        positions), the rotations and the step run in one C++ call (`decode.rope_decode_run`,
        bit-equal to rotating here and running the backend).
        """
        table_rope = (
            type(rope) is RoPE
            and not rope.depends_on_seq_len
            and type(q_pos) is int
            and q_pos >= 0
            and (keys_rotated or (type(k_pos) is int and k_pos >= 0))
        )
        if (rope is None or table_rope) and decode_step_ready(self.backend, q, k, v, dropout_p):
            if rope is None:
                return decode_step_run(q, k, v)
            # RoPE keeps shapes, dtypes and devices: the rotated q and k would get the decode
            # backend too, so rotating inside its step is the same computation
            n = q_pos + q.shape[2]
            k_start = None if keys_rotated else k_pos
            if k_start is not None:
                n = max(n, k_start + k.shape[2])
            dtype = stat_dtype(q.dtype)
            cos, sin = rope.table(n, q.device, dtype)  # rows 0…n−1 (at least), memoised
            return rope_decode_run(
                q, k, v, cos, sin, q_pos, k_start, rope.rotary_dim, rope.interleaved
            )
        if rope is not None:
            q = rope(q, q_pos, seq_len=seq_len)
            if not keys_rotated:
                k = rope(k, k_pos, seq_len=seq_len)
        req = trusted_request(q, k, v, dropout_p=dropout_p)
        return select(self.backend, req)[0].run(req)[0]

    # ------------------------------------------------------------------ pruning
    @torch.no_grad()
    def prune_heads(self, heads: Iterable[int]) -> None:
        """Removes query heads, shrinking the Q and O projections (and K/V, group-aware).

        Under GQA a key/value head is removed only when every query head of its group is pruned;
        the remaining heads' outputs are unchanged (bit-for-bit up to the matmul sizes).

        Raises:
            ValueError: an index outside ``[0, num_heads)``, or pruning every head.
        """
        H, H_kv, D = self.num_heads, self.num_kv_heads, self.head_dim
        drop = sorted(set(int(h) for h in heads))
        if any(h < 0 or h >= H for h in drop):
            raise ValueError(f"heads to prune must be in [0, {H}), got {drop}")
        if len(drop) == H:
            raise ValueError(f"cannot prune all {H} heads")
        if not drop:
            return
        if self.bias_fn is not None:
            raise ValueError(
                "prune_heads: this module has a per-head bias_fn whose heads would no longer line "
                "up; prune the bias's heads and set bias_fn again"
            )
        G = H // H_kv
        keep_q = [h for h in range(H) if h not in drop]
        keep_kv = sorted({h // G for h in keep_q})
        groups = [[h for h in keep_q if h // G == g] for g in keep_kv]
        if len({len(gr) for gr in groups}) != 1:
            raise ValueError(
                f"pruning {drop} would leave key/value groups of unequal sizes "
                f"{[len(gr) for gr in groups]}; GQA needs the same number of query heads per group"
            )

        (wq, bq), (wk, bk), (wv, bv) = self.projection_weights()

        def rows(idx: list[int]) -> Tensor:  # the weight rows of heads idx, on the weights' device
            return torch.cat([torch.arange(i * D, (i + 1) * D, device=wq.device) for i in idx])

        rq, rkv = rows(keep_q), rows(keep_kv)
        parts = [(wq[rq], None if bq is None else bq[rq])]
        parts += [(w[rkv], None if b is None else b[rkv]) for w, b in ((wk, bk), (wv, bv))]
        has_bias = parts[0][1] is not None
        if self.qkv_proj is not None:
            rows_out = sum(w.shape[0] for w, _ in parts)
            new = StreamLinear(
                self.embed_dim, rows_out, bias=has_bias, device=wq.device, dtype=wq.dtype
            )
            new.weight.copy_(torch.cat([w for w, _ in parts]))
            if has_bias:
                new.bias.copy_(torch.cat([b for _, b in parts]))  # type: ignore[misc]
            self.qkv_proj = new
        else:
            for name, (w, b) in zip(("q_proj", "k_proj", "v_proj"), parts, strict=True):
                lin = StreamLinear(
                    w.shape[1], w.shape[0], bias=has_bias, device=w.device, dtype=w.dtype
                )
                lin.weight.copy_(w)
                if has_bias:
                    lin.bias.copy_(b)  # type: ignore[arg-type]
                setattr(self, name, lin)
        w_out = self.out_proj.weight
        out = StreamLinear(
            len(keep_q) * D,
            self.embed_dim,
            bias=self.out_proj.bias is not None,
            device=w_out.device,
            dtype=w_out.dtype,
        )
        out.weight.copy_(self.out_proj.weight[:, rq])
        if self.out_proj.bias is not None:
            out.bias.copy_(self.out_proj.bias)
        self.out_proj = out
        if self.sinks is not None:
            self.sinks = nn.Parameter(self.sinks.detach()[keep_q].clone())
        self.num_heads, self.num_kv_heads = len(keep_q), len(keep_kv)
