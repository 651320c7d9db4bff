"""Key/value caches for incremental decoding.

A cache stores keys *before* RoPE together with their positions, so that the attention module
rotates them at every step with the current frequencies. Evicting tokens (sliding windows,
attention sinks) and sequence-length dependent RoPE scaling (dynamic NTK) therefore stay
consistent — rotating keys once at insertion and caching the result is the bug class peers shipped.
`KVCache(rotate_at_insert=True)` opts into exactly that for the one case where it is correct —
static RoPE frequencies, no eviction — and saves the re-rotation of every cached key per step.

Every cache has one method, `update`, that appends the new keys/values and returns what the new
queries attend to: all keys, their positions, the positions of the new queries, and the mask the
cache's eviction policy requires (or None).

Compile-friendly by construction: the cache's state that decides shapes (how many tokens are
stored, how many were ever appended, where the positions end) is kept as Python ints updated as
tokens are appended, never read back from tensors, so `update` makes no host synchronisation and
has no value-dependent branches. Under `torch.compile` the stored tensors are marked dynamic along
the sequence dimension (`torch._dynamo.maybe_mark_dynamic`) so a growing cache does not recompile
at every decoding step; a preallocated cache (``capacity=``) keeps one buffer shape throughout.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._shapes import check_bool, check_int
from ..masks import Mask, causal, from_fn, sliding_window


class CacheOverflowError(ValueError):
    """Appending to a preallocated cache would exceed its capacity (it never wraps silently)."""

    def __init__(self, capacity: int, cached: int, requested: int) -> None:
        super().__init__(
            f"KV cache overflow: capacity is {capacity} positions, {cached} are cached and "
            f"{requested} more were appended ({cached + requested} > {capacity})"
        )
        self.capacity, self.cached, self.requested = capacity, cached, requested


class CacheView:
    """What the new queries attend to after an update.

    Attributes:
        k: keys before RoPE ``(B, H_kv, S, D)``.
        v: values ``(B, H_kv, S, Dv)``.
        k_positions: RoPE positions of the keys, ``(B|1, S)`` (built on first access when the
            cache assigned them).
        q_positions: RoPE positions of the new queries, ``(B|1, T)`` (the last T keys').
        mask: the mask the eviction policy needs on top of the caller's, or None.
        start: a host-side int when the key positions are ``start, start + 1, …, start + S − 1``
            (every position assigned by the cache), else None (caller-given position tensors:
            only the tensor knows). The module then rotates by int offsets: no position tensor
            is read, and ``start + S`` is the sequence length seq-len dependent RoPE needs.
    """

    __slots__ = ("_k_positions", "_q_positions", "k", "mask", "start", "t", "v")

    def __init__(
        self,
        k: Tensor,
        v: Tensor,
        k_positions: Tensor | None,
        q_positions: Tensor | None,
        mask: Mask | None,
        start: int | None = None,
        t: int = 0,
    ) -> None:
        if k_positions is None and start is None:
            raise ValueError("CacheView needs k_positions or a start position")
        self.k, self.v, self.mask, self.start, self.t = k, v, mask, start, t
        self._k_positions, self._q_positions = k_positions, q_positions

    @property
    def k_positions(self) -> Tensor:
        if self._k_positions is None:
            S = self.k.shape[2]
            start = self.start
            self._k_positions = torch.arange(start, start + S, device=self.k.device).view(1, S)
        return self._k_positions

    @property
    def q_positions(self) -> Tensor:
        if self._q_positions is None:
            S = self.k.shape[2]
            self._q_positions = self.k_positions[:, S - self.t :]
        return self._q_positions


def _check_kv(k: Tensor, v: Tensor) -> None:
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 4:
            got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"cache update: {name} must be (B, H_kv, T, ·), got {got}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"cache update: k {tuple(k.shape)} and v {tuple(v.shape)} disagree on (B, H_kv, T)"
        )


def check_cache_positions(positions: object) -> None:
    """Raises unless ``positions`` is None or an integer tensor (a cache stores int64 positions).

    Float positions (fractional RoPE positions) would be truncated by the cache, so they are
    refused rather than rounded silently.
    """
    if positions is None:
        return
    if not isinstance(positions, Tensor):
        raise TypeError(
            f"cache positions must be None or an integer tensor, got {type(positions).__name__}"
        )
    if positions.is_floating_point() or positions.is_complex() or positions.dtype == torch.bool:
        raise ValueError(
            f"positions must be an integer tensor when a KV cache is used (the cache stores int64 "
            f"positions and would truncate them), got dtype {positions.dtype}"
        )


def _positions(positions: Tensor | None, start: int, T: int, device: torch.device) -> Tensor:
    if positions is None:
        return torch.arange(start, start + T, device=device).view(1, T)  # (1, T)
    check_cache_positions(positions)
    p = positions.to(device=device, dtype=torch.long)
    p = p.view(1, -1) if p.dim() == 1 else p  # (B|1, T)
    if p.dim() != 2 or p.shape[-1] != T:
        raise ValueError(
            f"positions must be (T,) or (B, T) with T={T}, got {tuple(positions.shape)}"
        )
    return p


class KVCache:
    """A growing key/value cache; with ``capacity`` it is preallocated and never exceeds it.

    Args:
        capacity: None for a dynamic cache (amortised doubling), or the fixed number of positions
            to preallocate; appending beyond it raises `CacheOverflowError`.
        rotate_at_insert: False (default): keys are cached before RoPE and `MultiHeadAttention`
            re-rotates all of them at every step (right for every RoPE). True: the module
            rotates each new key once, at its position, and caches the result; a step then
            rotates only its queries. Only for RoPE whose frequencies do not depend on the
            sequence length (the module raises ValueError for ``dynamic``/``longrope``), and the
            cache must stay with the module (and RoPE) that filled it. The eviction caches
            (`SlidingWindowCache`, `SinkCache`) always keep pre-RoPE keys.

    Attributes:
        seen: tokens ever appended (the next default position), a Python int.
        capacity: the preallocated size, or None.
        rotate_at_insert: whether the cached keys are stored after RoPE.

    The number of stored tokens (``len(cache)``) and ``seen`` are host-side Python ints advanced
    by every `update`; `update` never reads a tensor's value. While the cache assigns positions
    itself they are implied (``seen − len … seen − 1``, reported as `CacheView.start`) and no
    position tensor is kept; the first caller-given positions switch to stored positions. An
    update with ``T = 0`` new tokens validates its arguments and leaves the cache unchanged.

    Example:
        >>> cache = KVCache()
        >>> out = mha(x_prompt, mask=masks.causal(), cache=cache)   # prefill
        >>> out = mha(x_next, mask=masks.causal(), cache=cache)     # one token at a time
    """

    def __init__(self, capacity: int | None = None, *, rotate_at_insert: bool = False) -> None:
        if capacity is not None:
            check_int("capacity", capacity, minimum=1)
        check_bool("rotate_at_insert", rotate_at_insert)
        self.capacity = capacity
        self.rotate_at_insert = rotate_at_insert
        self._k: Tensor | None = None
        self._v: Tensor | None = None
        self._pos: Tensor | None = None  # only once a caller passed positions (else implied)
        self._len = 0
        self.seen = 0  # tokens ever appended (the next default position)
        # True while every stored position was assigned by the cache (then they are contiguous:
        # seen - len(self) ... seen - 1); False once a caller passed explicit positions.
        self._contiguous = True

    def __len__(self) -> int:
        return self._len

    def __repr__(self) -> str:
        """``KVCache(B=1, H_kv=2, S=12, D=64, dtype=torch.float32, seen=12, capacity=16)``: the
        stored keys' layout (S = ``len(cache)``), dtype, tokens ever appended and the policy.
        Reads host ints and tensor metadata only (no value: no host sync, meta tensors print)."""
        state = [f"S={self._len}"]
        if self._k is not None and self._v is not None:
            B, H_kv, _, D = self._k.shape
            state = [f"B={B}", f"H_kv={H_kv}", f"S={self._len}", f"D={D}"]
            if self._v.shape[-1] != D:
                state.append(f"Dv={self._v.shape[-1]}")
            state.append(f"dtype={self._k.dtype}")
            if self._k.device.type != "cpu":
                state.append(f"device={self._k.device}")
        state.append(f"seen={self.seen}")
        if not self._contiguous:
            state.append("positions=stored")  # the caller passed positions: they are kept
        return f"{type(self).__name__}({', '.join([*state, *self._policy()])})"

    def _policy(self) -> list[str]:
        """The constructor's arguments, for `__repr__`."""
        out = [f"capacity={self.capacity}"]
        return [*out, "rotate_at_insert=True"] if self.rotate_at_insert else out

    def reset(self) -> None:
        """Forgets every cached token."""
        self.__init__(self.capacity, rotate_at_insert=self.rotate_at_insert)  # type: ignore[misc]

    def reorder(self, index: Tensor) -> None:
        """Reorders the batch rows in place: row b becomes old row ``index[b]`` (beam search)."""
        if self._k is not None:
            self._k = self._k.index_select(0, index)
            self._v = self._v.index_select(0, index)  # type: ignore[union-attr]
        if self._pos is not None and self._pos.shape[0] > 1:
            self._pos = self._pos.index_select(0, index)

    def contiguous_buffers(self) -> tuple[Tensor, Tensor] | None:
        """The preallocated key and value buffers ``(B, H_kv, capacity, D)`` for a kernel that
        appends in place (then `appended_in_place`), or None: nothing stored yet, or stored
        positions (a caller passed ``positions``)."""
        if not self._contiguous or self._k is None or self._v is None:
            return None
        return self._k, self._v

    def appended_in_place(self, T: int = 1) -> None:
        """Records ``T`` tokens that a kernel wrote into `contiguous_buffers` at ``len(self)``."""
        self._len += T
        self.seen += T

    def _check_against_cache(self, k: Tensor, v: Tensor, pos: Tensor | None) -> None:
        if self._k is None or self._v is None:
            return
        if k.shape[:2] != self._k.shape[:2] or k.shape[-1] != self._k.shape[-1]:
            raise ValueError(
                f"cache update: k of shape {tuple(k.shape)} does not match the cached "
                f"(B, H_kv, ·, D) = {tuple(self._k.shape[:2])} + (·, {self._k.shape[-1]})"
            )
        if v.shape[-1] != self._v.shape[-1]:
            raise ValueError(
                f"cache update: v of shape {tuple(v.shape)} does not match the cached value dim "
                f"Dv = {self._v.shape[-1]}"
            )
        if k.dtype != self._k.dtype or k.device != self._k.device:
            raise ValueError(
                f"cache update: k is {k.dtype} on {k.device}, the cache holds {self._k.dtype} on "
                f"{self._k.device}"
            )
        if (
            pos is not None
            and self._pos is not None
            and 1 != self._pos.shape[0] != pos.shape[0] != 1
        ):
            raise ValueError(
                f"cache update: positions for batch {pos.shape[0]} do not match the cached "
                f"positions' batch {self._pos.shape[0]}"
            )

    def _reserve(self, k: Tensor, v: Tensor, pos: Tensor | None, extra: int) -> None:
        need = self._len + extra
        if self.capacity is not None and need > self.capacity:
            raise CacheOverflowError(self.capacity, self._len, extra)
        have = 0 if self._k is None else self._k.shape[2]
        if need <= have:
            return
        size = self.capacity if self.capacity is not None else max(need, 2 * have, 16)
        B, H_kv, _, D = k.shape
        nk = k.new_empty(B, H_kv, size, D)
        nv = v.new_empty(B, H_kv, size, v.shape[-1])
        npos = None if pos is None else pos.new_zeros(pos.shape[0], size)
        if self._k is not None:
            nk[:, :, : self._len] = self._k[:, :, : self._len]
            nv[:, :, : self._len] = self._v[:, :, : self._len]  # type: ignore[index]
            if npos is not None and self._pos is not None:
                npos[:, : self._len] = self._pos[:, : self._len]
        self._k, self._v, self._pos = nk, nv, npos

    def _append(self, k: Tensor, v: Tensor, pos: Tensor | None) -> None:
        """Writes T new tokens; ``pos`` is None for cache-assigned (implied) positions."""
        self._check_against_cache(k, v, pos)
        T = k.shape[2]
        if self.capacity is not None and self._len + T > self.capacity:
            raise CacheOverflowError(self.capacity, self._len, T)  # before any change
        if pos is not None and self._contiguous:
            # First caller-given positions: from now on positions are stored explicitly.
            self._contiguous = False
            if self._k is not None:
                start = self.seen - self._len
                self._pos = torch.zeros(1, self._k.shape[2], dtype=torch.long, device=k.device)
                self._pos[:, : self._len] = torch.arange(start, self.seen, device=k.device)
        if pos is None and not self._contiguous:
            pos = torch.arange(self.seen, self.seen + T, device=k.device).view(1, T)
        if pos is not None and self._pos is not None and pos.shape[0] != self._pos.shape[0]:
            self._pos = self._pos.expand(max(pos.shape[0], self._pos.shape[0]), -1).clone()
            pos = pos.expand(self._pos.shape[0], -1)
        self._reserve(k, v, pos, T)
        assert self._k is not None and self._v is not None
        # narrow + copy_: the slice assignment without Python's indexing machinery (decode steps)
        self._k.narrow(2, self._len, T).copy_(k)
        self._v.narrow(2, self._len, T).copy_(v)
        if pos is not None:
            assert self._pos is not None
            self._pos[:, self._len : self._len + T] = pos
        self._len += T
        self.seen += T

    def _stored(self, like_k: Tensor, like_v: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """The stored ``(k, v, positions)`` (positions None while implied); empty, shaped like
        the update, when nothing is stored."""
        if self._k is None or self._v is None:
            B, H_kv, _, D = like_k.shape
            empty_pos = None if self._contiguous else like_k.new_zeros(1, 0, dtype=torch.long)
            return (
                like_k.new_empty(B, H_kv, 0, D),
                like_v.new_empty(B, H_kv, 0, like_v.shape[-1]),
                empty_pos,
            )
        n = self._len
        ps = None if self._pos is None else self._pos[:, :n]
        return _dynamic_len(self._k.narrow(2, 0, n)), _dynamic_len(self._v.narrow(2, 0, n)), ps

    def _view(self, k: Tensor, v: Tensor, pos: Tensor | None, mask: Mask | None) -> CacheView:
        """The view after appending ``k, v`` (``pos``: the caller's positions, or None)."""
        ks, vs, ps = self._stored(k, v)
        T = k.shape[2]
        if self._contiguous:
            return CacheView(ks, vs, None, None, mask, self.seen - self._len, T)
        assert ps is not None
        q_pos = pos if pos is not None else ps[:, ps.shape[1] - T :]
        return CacheView(ks, vs, ps, q_pos, mask, None, T)

    def update(self, k: Tensor, v: Tensor, positions: Tensor | None = None) -> CacheView:
        """Appends keys ``(B, H_kv, T, D)`` (before RoPE) and values; returns what queries see.

        Args:
            k, v: the new keys and values (``T = 0`` leaves the cache unchanged).
            positions: integer RoPE positions of the new tokens ``(T,)`` or ``(B, T)``; default
                the next ``T`` positions after everything appended so far. Float positions raise
                ValueError (they would be truncated).
        """
        _check_kv(k, v)
        T = k.shape[2]
        pos = None if positions is None else _positions(positions, self.seen, T, k.device)
        if T:
            self._append(k, v, pos)
        else:
            self._check_against_cache(k, v, pos)
        return self._view(k, v, pos, None)


def _dynamic_len(t: Tensor) -> Tensor:
    """Marks the sequence dimension of a cached tensor dynamic for `torch.compile` (eager only)."""
    if not torch.compiler.is_compiling():
        torch._dynamo.maybe_mark_dynamic(t, 2)  # noqa: SLF001 (maybe_mark_dynamic is only in torch._dynamo)
    return t


class SlidingWindowCache(KVCache):
    """Keeps only the last ``window`` positions (Mistral-style sliding-window attention).

    The view it returns carries ``sliding_window(window)``, so a multi-token update attends exactly
    as later single-token steps will.
    """

    def __init__(self, window: int) -> None:
        check_int("window", window, minimum=1)
        super().__init__(None)
        self.window = window

    def reset(self) -> None:
        self.__init__(self.window)  # type: ignore[misc]

    def _policy(self) -> list[str]:
        return [f"window={self.window}"]

    def update(self, k: Tensor, v: Tensor, positions: Tensor | None = None) -> CacheView:
        _check_kv(k, v)
        T = k.shape[2]
        pos = None if positions is None else _positions(positions, self.seen, T, k.device)
        if T:
            self._append(k, v, pos)
        else:
            self._check_against_cache(k, v, pos)
        view = self._view(k, v, pos, sliding_window(self.window))
        self._evict(keep_first=0)
        return view

    def _evict(self, keep_first: int) -> None:
        """Drops the oldest tokens after the first ``keep_first`` beyond ``window`` (by slicing)."""
        excess = self._len - keep_first - self.window
        if excess <= 0:
            return
        assert self._k is not None and self._v is not None
        n = self._len

        def keep(t: Tensor, dim: int) -> Tensor:
            head = t.narrow(dim, 0, keep_first)
            tail = t.narrow(dim, keep_first + excess, n - keep_first - excess)
            return torch.cat((head, tail), dim=dim)

        self._k, self._v = keep(self._k, 2), keep(self._v, 2)
        if self._pos is not None:
            self._pos = keep(self._pos, 1)
        self._len = n - excess


class SinkCache(SlidingWindowCache):
    """StreamingLLM: keeps the first ``sink_tokens`` tokens (the sinks) and the last ``window``.

    RoPE positions are positions *in the cache* (the sinks at 0…n−1, the window right after), as
    in StreamingLLM: keys are stored before RoPE and re-rotated at each step, so evicting tokens
    never leaves stale rotations behind. A single-token step evicts first and then attends to
    exactly the kept tokens. A multi-token update (a prompt) attends causally to the sinks plus
    the last ``window`` keys of each query over the concatenated keys, then evicts.
    """

    def __init__(self, sink_tokens: int, window: int) -> None:
        check_int("sink_tokens", sink_tokens, minimum=0)
        super().__init__(window)
        self.sink_tokens = sink_tokens

    def reset(self) -> None:
        self.__init__(self.sink_tokens, self.window)  # type: ignore[misc]

    def _policy(self) -> list[str]:
        return [f"sink_tokens={self.sink_tokens}", f"window={self.window}"]

    def update(self, k: Tensor, v: Tensor, positions: Tensor | None = None) -> CacheView:
        if positions is not None:
            raise ValueError(
                "SinkCache assigns positions itself (positions in the cache); pass None"
            )
        _check_kv(k, v)
        T = k.shape[2]
        n_sink = self.sink_tokens  # the first n_sink stored keys are always the sinks
        if T:
            self._append(k, v, None)
        else:
            self._check_against_cache(k, v, None)
        mask = None
        if T == 1:
            self._evict(keep_first=min(self.sink_tokens, self._len))
        elif T > 1:
            window = self.window

            def sink_or_window(_b: Tensor, _h: Tensor, i: Tensor, j: Tensor) -> Tensor:
                return (j <= i) & ((j < n_sink) | (i - j < window))

            mask = from_fn(sink_or_window)
        ks, vs, _ = self._stored(k, v)
        view = CacheView(ks, vs, None, None, mask, 0, T)  # positions in the cache: 0 … S − 1
        if T > 1:
            self._evict(keep_first=min(self.sink_tokens, self._len))
        return view


class LatentView:
    """What the new queries attend to after a `LatentCache` update.

    Attributes:
        joint: ``(B, S, C + R)`` every cached token's latent and rotary key, side by side (one
            buffer: the absorbed decode attends over it as one key of width C + R).
        latent: ``(B, S, C)`` the latents, a view of ``joint``.
        k_rope: ``(B, S, R)`` the rotated keys, a view of ``joint``.
        start: the position of the first cached token (a host int); the new queries are the
            last ``t`` tokens, at ``start + S − t … start + S − 1``.
        t: the number of tokens this update appended.
    """

    __slots__ = ("joint", "k_rope", "latent", "start", "t")

    def __init__(self, joint: Tensor, rank: int, start: int, t: int) -> None:
        self.joint, self.start, self.t = joint, start, t
        self.latent = joint[..., :rank]  # (B, S, C)
        self.k_rope = joint[..., rank:]  # (B, S, R)


class LatentCache:
    """The cache of multi-head latent attention: per token, one latent and one rotary key.

    DeepSeek-V2/V3's MLA keeps ``kv_lora_rank + qk_rope_head_dim`` numbers per token and layer
    (576 for DeepSeek-V3, against ``2 · H · 192``-ish for a per-head K/V cache): the latent
    ``(B, S, C)`` after its RMSNorm and the shared rotary key ``(B, S, R)`` after RoPE. No
    per-head key or value is ever stored. Both live in one buffer ``(B, ·, C + R)`` (see
    `LatentView`), grown by amortised doubling, or preallocated with ``capacity`` and never
    exceeded (`CacheOverflowError`).

    The rotary keys are stored rotated (RoPE at insertion), which is right for RoPE whose
    frequencies do not depend on the sequence length (default, YaRN: DeepSeek's); the module
    refuses the others. Token counts are host-side ints, so `update` makes no host sync.

    Args:
        capacity: None for a growing cache, or the fixed number of positions to preallocate.

    Attributes:
        seen: tokens ever appended (the next position), a Python int.
        capacity: the preallocated size, or None.

    Example:
        >>> cache = LatentCache()
        >>> out = mla(x_prompt, cache=cache)   # prefill
        >>> out = mla(x_next, cache=cache)     # one token at a time
    """

    def __init__(self, capacity: int | None = None) -> None:
        if capacity is not None:
            check_int("capacity", capacity, minimum=1)
        self.capacity = capacity
        self._buf: Tensor | None = None  # (B, size, C + R)
        self._rank = 0
        self._len = 0
        self.seen = 0

    def __len__(self) -> int:
        return self._len

    def __repr__(self) -> str:
        """``LatentCache(B=1, S=12, C=512, R=64, dtype=torch.float32, seen=12, capacity=16)``:
        the stored layout (S = ``len(cache)``, C the latent rank, R the rotary dim), dtype, tokens
        ever appended and the capacity. Reads host ints and tensor metadata only."""
        state = [f"S={self._len}"]
        if self._buf is not None:
            B, _, W = self._buf.shape
            state = [f"B={B}", f"S={self._len}", f"C={self._rank}", f"R={W - self._rank}"]
            state.append(f"dtype={self._buf.dtype}")
            if self._buf.device.type != "cpu":
                state.append(f"device={self._buf.device}")
        state += [f"seen={self.seen}", f"capacity={self.capacity}"]
        return f"{type(self).__name__}({', '.join(state)})"

    @property
    def nbytes(self) -> int:
        """Bytes the cache holds (its whole buffer, capacity included), 0 when empty."""
        return 0 if self._buf is None else self._buf.numel() * self._buf.element_size()

    def reset(self) -> None:
        """Forgets every cached token."""
        self.__init__(self.capacity)  # type: ignore[misc]

    def reorder(self, index: Tensor) -> None:
        """Reorders the batch rows in place: row b becomes old row ``index[b]`` (beam search)."""
        if self._buf is not None:
            self._buf = self._buf.index_select(0, index)

    def _check(self, latent: Tensor, k_rope: Tensor) -> None:
        for name, t in (("latent", latent), ("k_rope", k_rope)):
            if not isinstance(t, Tensor) or t.dim() != 3:
                got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
                raise ValueError(f"latent cache update: {name} must be (B, T, ·), got {got}")
        if latent.shape[:2] != k_rope.shape[:2]:
            raise ValueError(
                f"latent cache update: latent {tuple(latent.shape)} and k_rope "
                f"{tuple(k_rope.shape)} disagree on (B, T)"
            )
        if latent.dtype != k_rope.dtype or latent.device != k_rope.device:
            raise ValueError(
                f"latent cache update: latent is {latent.dtype} on {latent.device}, k_rope is "
                f"{k_rope.dtype} on {k_rope.device}"
            )
        if self._buf is None:
            return
        B, _, W = self._buf.shape
        got = (latent.shape[0], latent.shape[2], k_rope.shape[2])
        if got != (B, self._rank, W - self._rank):
            raise ValueError(
                f"latent cache update: (B, C, R) = {got} does not match the cached "
                f"{(B, self._rank, W - self._rank)}"
            )
        if latent.dtype != self._buf.dtype or latent.device != self._buf.device:
            raise ValueError(
                f"latent cache update: latent is {latent.dtype} on {latent.device}, the cache "
                f"holds {self._buf.dtype} on {self._buf.device}"
            )

    def _reserve(self, like: Tensor, width: int, extra: int) -> None:
        need = self._len + extra
        if self.capacity is not None and need > self.capacity:
            raise CacheOverflowError(self.capacity, self._len, extra)
        have = 0 if self._buf is None else self._buf.shape[1]
        if need <= have:
            return
        size = self.capacity if self.capacity is not None else max(need, 2 * have, 16)
        buf = like.new_empty(like.shape[0], size, width)  # (B, size, C + R)
        if self._buf is not None:
            buf[:, : self._len] = self._buf[:, : self._len]
        self._buf = buf

    def update(self, latent: Tensor, k_rope: Tensor) -> LatentView:
        """Appends latents ``(B, T, C)`` and rotated keys ``(B, T, R)``; returns every cached
        token (``T = 0`` leaves the cache unchanged).

        Raises:
            ValueError: shapes that disagree with each other or with the cache.
            CacheOverflowError: a preallocated cache would exceed its capacity.
        """
        self._check(latent, k_rope)
        T, C = latent.shape[1], latent.shape[2]
        if T:
            self._reserve(latent, C + k_rope.shape[2], T)
            self._rank = C
            assert self._buf is not None
            self._buf.narrow(1, self._len, T).narrow(2, 0, C).copy_(latent)
            self._buf.narrow(1, self._len, T).narrow(2, C, k_rope.shape[2]).copy_(k_rope)
            self._len += T
            self.seen += T
        if self._buf is None:
            joint = torch.cat((latent, k_rope), dim=-1)  # (B, 0, C + R)
            return LatentView(joint, C, self.seen, T)
        joint = self._buf.narrow(1, 0, self._len)  # (B, S, C + R)
        if not torch.compiler.is_compiling():
            torch._dynamo.maybe_mark_dynamic(joint, 1)  # noqa: SLF001 (only in torch._dynamo)
        return LatentView(joint, C, self.seen - self._len, T)


__all__ = [
    "CacheOverflowError",
    "CacheView",
    "KVCache",
    "LatentCache",
    "LatentView",
    "SinkCache",
    "SlidingWindowCache",
    "causal",
    "check_cache_positions",
]
