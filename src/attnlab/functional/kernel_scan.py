"""The blockwise causal scan of kernelised attention, forward and backward (issue #19 item 4).

``out_i = Σ_{j ≤ i} (φq_i · φk_j) v_j / Σ_{j ≤ i} φq_i · φk_j`` (bottom-right causal) by chunks of
C aligned tokens: the masked ``C × C`` kernel block inside a chunk is explicit, earlier chunks
enter through the running state ``Σ φ(k) [v | 1]ᵀ``. Chunks are scanned in blocks of about
`BLOCK_BYTES`, each block's features made on demand by a `BlockSource` (slices of given features,
linear attention's fused maps, FAVOR+'s random features), so nothing grows with L but the inputs,
the output and their gradients, and the time stays linear where L-sized temporaries would be
page-faulted in afresh on every call.

Without autograd `scan_forward` writes each block into the output and fills a `Tape`: the state
before each block and each row's ``den + eps``. `scan_backward` runs the blocks in reverse from
that tape, recomputing each block's features, chunk states and in-chunk scores, and hands the
features' gradients to the source block by block. With autograd enabled `scan_forward` runs
through the block ops instead (what a scan's backward differentiates under
``create_graph=True``, `recomputed_grads`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

#: Bytes of one block's widest intermediate in the causal scan (`block_tokens`): small enough to
#: stay in cache and be reused by the allocator at any L, large enough that per-block work
#: outweighs Python's per-call overhead.
BLOCK_BYTES = 1 << 21

__all__ = [
    "BLOCK_BYTES",
    "BlockSource",
    "ScanShape",
    "Tape",
    "block_sizes",
    "block_tokens",
    "chunk_states",
    "full_backward",
    "full_forward",
    "normalise",
    "recomputed_grads",
    "scan_backward",
    "scan_block",
    "scan_block_backward",
    "scan_forward",
    "with_ones",
]


class ScanShape(NamedTuple):
    """Sizes of a causal scan: ``B, H_kv, G`` (query heads per key head), L queries, S keys, F
    features, Dv value columns, C tokens per chunk (given; capped at the aligned tokens)."""

    B: int
    H_kv: int
    G: int
    L: int
    S: int
    F: int
    Dv: int
    C: int

    @property
    def P(self) -> int:
        """Keys before the first query (S > L): they form the initial state."""
        return max(self.S - self.L, 0)

    @property
    def dead(self) -> int:
        """Queries before the first key (L > S): they see no key and output zeros."""
        return max(self.L - self.S, 0)

    @property
    def T(self) -> int:
        """Aligned tokens: query ``dead + t`` sees keys ``j <= P + t``."""
        return self.L - self.dead

    @property
    def chunk(self) -> int:
        """Tokens per chunk: C, at most the aligned tokens."""
        return min(self.C, max(self.T, 1))

    def block(self, dtype: torch.dtype) -> int:
        """Tokens per block of the scan in ``dtype`` (`block_tokens`)."""
        width = max(self.F, self.Dv + 1, self.chunk)
        return block_tokens(
            self.B * self.H_kv * self.G, width, torch.finfo(dtype).bits // 8, self.chunk
        )


class BlockSource(Protocol):
    """Features of blocks of queries and keys, in the scan's compute dtype, and where their
    gradients go. ``a`` counts queries from 0 to L, keys from 0 to S."""

    def queries(self, a: int, m: int) -> Tensor:
        """``φ(q)`` of queries ``[a, a + m)``: ``(B, H_kv, G, m, F)``."""
        ...

    def keys(self, a: int, m: int) -> tuple[Tensor, Tensor]:
        """``φ(k)`` ``(B, H_kv, m, F)`` (zero at padded keys) and ``[v | 1]`` ``(B, H_kv, m,
        Dv + 1)`` of keys ``[a, a + m)``."""
        ...

    def query_grad(self, a: int, m: int, fq: Tensor, dfq: Tensor) -> None:
        """Takes the gradient ``dfq`` of the features ``fq`` of queries ``[a, a + m)``."""
        ...

    def key_grad(self, a: int, m: int, fk: Tensor, dfk: Tensor, dva: Tensor) -> None:
        """Takes the gradients of ``φ(k)`` and of ``[v | 1]`` of keys ``[a, a + m)``."""
        ...


class Tape:
    """What a scan keeps for its backward besides its inputs: the block size, the feature size,
    the state before each block and each block's ``den + eps``, and (for sources that want them)
    one entry per key block."""

    def __init__(self) -> None:
        self.n = 0
        self.Fd = 0
        self.states: list[Tensor] = []  # (B, H_kv, 1, F, Dv + 1) per block
        self.finite: list[tuple[bool, bool, bool]] = []  # q, k, v known finite, per key block
        self.dens: list[Tensor] = []  # (B, H_kv, G, n, 1) per block


def block_tokens(rows: int, width: int, itemsize: int, chunk: int) -> int:
    """Tokens per block of the causal scan: a multiple of ``chunk`` whose ``(rows, n, width)``
    intermediates take about `BLOCK_BYTES` (at least one chunk)."""
    n = BLOCK_BYTES // max(rows * width * itemsize, 1)
    return max(chunk, n // chunk * chunk)


def block_sizes(total: int, n: int) -> list[int]:
    """``total`` split into pieces of ``n`` (the last one shorter)."""
    return [n] * (total // n) + ([total % n] if total % n else [])


def _block_starts(total: int, n: int) -> list[tuple[int, int]]:
    """``(start, size)`` of the pieces of `block_sizes`."""
    return [(i * n, m) for i, m in enumerate(block_sizes(total, n))]


def dead_rows(den: Tensor) -> Tensor:
    """Rows whose ``den + eps`` underflowed: below the dtype's smallest normal number (0
    included). They output zeros and pass no gradient: a row with no key weight, or one whose
    weights all underflowed (a subnormal denominator has lost its precision, and ``g / den``
    would overflow in the backward)."""
    return den < torch.finfo(den.dtype).tiny


def normalise(num: Tensor, den: Tensor, eps: float, poison: Tensor | None = None) -> Tensor:
    """``poison + num / (den + eps)``, 0 in the `dead_rows` (no key weight, or underflow)."""
    den = den + eps
    den = torch.where(dead_rows(den), torch.inf, den)  # num / inf = 0 in the dead rows
    if poison is None:
        return num / den
    return torch.addcdiv(poison, num, den)  # poison + num / den in one pass


def with_ones(v: Tensor) -> Tensor:
    """``[v | 1]``: ``(B, H_kv, n, Dv + 1)``, so one product carries Σ φ(k) vᵀ and Σ φ(k)."""
    return torch.cat([v, v.new_ones(*v.shape[:-1], 1)], dim=-1)


def _running_sums(x: Tensor, start: Tensor, *, reverse: bool = False) -> Tensor:
    """Exclusive running sums over the chunks: ``out[c] = start + Σ_{c' < c} x[c']`` (reverse:
    ``c' > c``), one in-place add per chunk into one output (a product with a triangle of ones
    costs N² and ran far below the machine's rate on such flat shapes).

    Args:
        x: ``(B, H_kv, N, F, W)``. start: ``(B, H_kv, 1, F, W)``.

    Returns:
        ``(B, H_kv, N, F, W)``.
    """
    out = torch.empty_like(x)
    N = x.shape[2]
    order = range(N - 1, -1, -1) if reverse else range(N)
    total, last = start.squeeze(2), None
    for c in order:
        now = out[:, :, c].copy_(total)  # in place (no temporary; autograd and compile follow)
        if last is not None:
            now.add_(last)
        total, last = now, x[:, :, c]
    return out


def _sum_groups(x: Tensor) -> Tensor:
    """``x (B, H_kv, G, ...)`` summed over the G query heads that share a key head."""
    return x.squeeze(2) if x.shape[2] == 1 else x.sum(2)  # G = 1: a view, no copy


def chunk_states(kc: Tensor, vc: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """``Σ φ(k) [v | 1]ᵀ`` before each chunk of a block and after the block.

    ``before[c] = state + Σ_{c' < c} kc[c']ᵀ vc[c']``: an exclusive prefix sum over the chunks
    (contiguous, unlike a slice of an inclusive ``cumsum``, so the products that read it need no
    copy).

    Args:
        kc: ``(B, H_kv, N, C, F)``. vc: ``(B, H_kv, N, C, W)``. state: ``(B, H_kv, 1, F, W)``.

    Returns:
        ``(before (B, H_kv, N, F, W), after (B, H_kv, 1, F, W))``.
    """
    per_chunk = kc.transpose(-1, -2) @ vc  # (B, H_kv, N, F, W)
    before = _running_sums(per_chunk, state)
    return before, before[:, :, -1:] + per_chunk[:, :, -1:]


def _chunked(C: int, *xs: Tensor) -> tuple[int, list[Tensor]]:
    """Pads ``x (..., n, ·)`` with zero tokens to whole chunks (causally invisible) and splits
    the token dim into ``(N, C)``; one contiguous copy of a block sliced out of L-long tensors
    instead of one per batched product (which flattens the batch dims a slice cannot view)."""
    n = xs[0].shape[-2]
    N = -(-n // C)
    pad = N * C - n
    out = [(F.pad(x, (0, 0, 0, pad)) if pad else x.contiguous()).unflatten(-2, (N, C)) for x in xs]
    return N, out


def scan_block(fq: Tensor, fk: Tensor, va: Tensor, state: Tensor, C: int) -> tuple[Tensor, Tensor]:
    """One block of the causal scan: chunks of C tokens on top of the running state.

    ``acc_t = φq_tᵀ (state + Σ_{earlier chunks of the block} φK_cᵀ Va_c) + Σ_{j <= t in its
    chunk} (φq_t · φk_j) va_j``; the block's last chunk may be shorter.

    Args:
        fq: ``(B, H_kv, G, n, F)``. fk: ``(B, H_kv, n, F)``. va: ``(B, H_kv, n, Dv + 1)`` (values
            with a column of ones). state: ``(B, H_kv, 1, F, Dv + 1)``, Σ φ(k) vaᵀ before the block.
        C: tokens per chunk.

    Returns:
        ``(acc (B, H_kv, G, n, Dv + 1), state after the block (B, H_kv, 1, F, Dv + 1))``.
    """
    n = fk.shape[2]
    _, (qc, kc, vc) = _chunked(C, fq, fk, va)  # (B, H_kv, [G,] N, C, ·)
    before, after = chunk_states(kc, vc, state)  # (B, H_kv, N | 1, F, Dv + 1)
    scores = (qc @ kc.unsqueeze(2).transpose(-1, -2)).tril_()  # (B, H_kv, G, N, C, C)
    acc = scores @ vc.unsqueeze(2)  # (B, H_kv, G, N, C, Dv + 1): inside the chunk
    acc = acc.add_(qc @ before.unsqueeze(2))  # + earlier chunks and blocks
    return acc.flatten(3, 4)[:, :, :, :n], after


def scan_block_backward(
    fq: Tensor,
    fk: Tensor,
    va: Tensor,
    state: Tensor,
    den: Tensor,
    grad: Tensor,
    d_next: Tensor,
    C: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients of one block of `scan_block` followed by the normalisation ``acc_v / den``.

    Recomputes the chunk states and the in-chunk scores (two products) instead of keeping them;
    the output's ``num`` is never needed: with ``t = g / den``, ``g · num / den = Σ_j s_ij
    (t_i · v_j) + φq_i · (run t_i)``, row sums of the two products the gradient forms anyway.
    ``dacc = [t, −(g · num) / den²]``, then the chunk products backwards and a reverse prefix
    sum of the state gradients (``d_next``: the gradient of the state after the block).

    Args:
        fq: ``(B, H_kv, G, n, F)``. fk: ``(B, H_kv, n, F)``. va: ``(B, H_kv, n, Dv + 1)``.
        state: ``(B, H_kv, 1, F, Dv + 1)`` before the block. den: ``(B, H_kv, G, n, 1)``, the
            forward's ``den + eps``. grad: ``(B, H_kv, G, n, Dv)`` of the block's output.
        d_next: ``(B, H_kv, 1, F, Dv + 1)``. C: tokens per chunk.

    Returns:
        ``(dfq (B, H_kv, G, n, F), dfk (B, H_kv, n, F), dva (B, H_kv, n, Dv + 1), d_state)``.
    """
    n, Dv = fk.shape[2], grad.shape[-1]
    zero = dead_rows(den)  # the forward output 0 there: no gradient
    t = grad / torch.where(zero, torch.inf, den)
    N, (qc, kc, vc, tc) = _chunked(C, fq, fk, va, t)  # (B, H_kv, [G,] N, C, ·)
    den = F.pad(den, (0, 0, 0, N * C - n), value=1.0).unflatten(-2, (N, C))
    zero = F.pad(zero, (0, 0, 0, N * C - n)).unflatten(-2, (N, C))  # (B, H_kv, G, N, C, 1)
    kc, vc = kc.unsqueeze(2), vc.unsqueeze(2)  # (B, H_kv, 1, N, C, ·)
    run = chunk_states(kc.squeeze(2), vc.squeeze(2), state)[0].unsqueeze(2)  # (.., 1, N, F, W)
    scores = (qc @ kc.transpose(-1, -2)).tril_()  # (B, H_kv, G, N, C, C)
    tv = tc @ vc[..., :Dv].transpose(-1, -2)  # (B, H_kv, G, N, C, C): t_i · v_j
    tr = tc @ run[..., :Dv].transpose(-1, -2)  # (B, H_kv, G, N, C, F): run_v t_i
    g_num = (scores * tv).sum(-1, keepdim=True) + (qc * tr).sum(-1, keepdim=True)
    d_den = torch.where(zero, 0.0, -g_num / den)
    d_acc = torch.cat([tc, d_den], dim=-1)  # (B, H_kv, G, N, C, Dv + 1)
    d_scores = tv.add_(d_den).tril_()  # the ones column of va carries d_den to every j <= i
    d_qc = (d_scores @ kc).add_(tr).addcmul_(d_den, run[..., Dv].unsqueeze(-2))
    d_run = _sum_groups(qc.transpose(-1, -2) @ d_acc)  # (B, H_kv, N, F, Dv + 1)
    # run[m] = state + Σ_{c<m} per_chunk[c] and the state after is state + Σ_c per_chunk[c]:
    # per_chunk[c] collects the d_run after it, the state all of them
    d_per = _running_sums(d_run, d_next, reverse=True)
    d_state = d_run.sum(2, keepdim=True).add_(d_next)
    # the key side: in-chunk terms summed over the group, plus the later states' (in place)
    d_kc = _sum_groups(d_scores.transpose(-1, -2) @ qc).flatten(0, 2)  # (B·H_kv·N, C, F)
    d_kc.baddbmm_(vc.squeeze(2).flatten(0, 2), d_per.flatten(0, 2).mT)
    d_vc = _sum_groups(scores.transpose(-1, -2) @ d_acc).flatten(0, 2)  # (B·H_kv·N, C, Dv + 1)
    d_vc.baddbmm_(kc.squeeze(2).flatten(0, 2), d_per.flatten(0, 2))
    keys = d_run.shape[:3]  # (B, H_kv, N)
    return (
        d_qc.flatten(3, 4)[:, :, :, :n],
        d_kc.unflatten(0, keys).flatten(2, 3)[:, :, :n],
        d_vc.unflatten(0, keys).flatten(2, 3)[:, :, :n],
        d_state,
    )


def _key_state(
    src: BlockSource, shape: ScanShape, count: int, n: int, dtype: torch.dtype, device: torch.device
) -> Tensor:
    """``Σ φ(k) [v | 1]ᵀ`` of the first ``count`` keys, block by block:
    ``(B, H_kv, 1, F, Dv + 1)``."""
    state = torch.zeros(shape.B, shape.H_kv, 1, shape.F, shape.Dv + 1, dtype=dtype, device=device)
    for a, m in _block_starts(count, n):
        fk, va = src.keys(a, m)
        state = state + (fk.transpose(-1, -2) @ va).unsqueeze(2)
    return state


class _Rows:
    """A pass's output, written block by block: into one tensor without autograd (no block
    outputs pile up), concatenated through the block ops with it. Each block's accumulator
    ``[num | den]`` is normalised (plus its poison) and its ``den + eps`` put on the tape."""

    def __init__(
        self,
        shape: ScanShape,
        out_dtype: torch.dtype,
        device: torch.device,
        eps: float,
        poison: Callable[[int, int], Tensor | None] | None,
        tape: Tape | None,
    ) -> None:
        B, H_kv, G, L, Dv = shape.B, shape.H_kv, shape.G, shape.L, shape.Dv
        self.eps, self.poison, self.tape, self.Dv, self.dtype = eps, poison, tape, Dv, out_dtype
        self.whole = None
        if not torch.is_grad_enabled():
            self.whole = torch.empty(B, H_kv, G, L, Dv, dtype=out_dtype, device=device)
        self.blocks = [torch.zeros(B, H_kv, G, 0, Dv, dtype=out_dtype, device=device)]

    def zeros(self, m: int) -> None:
        """The first m rows see no key: zeros."""
        if self.whole is not None:
            self.whole[:, :, :, :m].zero_()
        else:
            self.blocks.append(self.blocks[0].new_zeros(*self.blocks[0].shape[:3], m, self.Dv))

    def add(self, a: int, acc: Tensor) -> None:
        """Rows ``[a, a + m)`` from their accumulator ``(B, H_kv, G, m, Dv + 1)``."""
        num, den = acc[..., : self.Dv], acc[..., self.Dv :]
        if self.tape is not None:
            self.tape.dens.append(den + self.eps)
        out = normalise(num, den, self.eps, self.poison and self.poison(a, acc.shape[3]))
        if self.whole is not None:
            self.whole[:, :, :, a : a + acc.shape[3]] = out
        else:
            self.blocks.append(out.to(self.dtype))

    def result(self) -> Tensor:
        return self.whole if self.whole is not None else torch.cat(self.blocks, dim=3)


def scan_forward(
    src: BlockSource,
    shape: ScanShape,
    *,
    dtype: torch.dtype,
    out_dtype: torch.dtype,
    device: torch.device,
    eps: float,
    poison: Callable[[int, int], Tensor | None] | None = None,
    tape: Tape | None = None,
) -> Tensor:
    """The causal scan of ``src``'s features: ``(B, H_kv, G, L, Dv)`` in ``out_dtype``.

    Keys before the first query form the initial state; queries before the first key output
    zeros. Without autograd each block is written into the output as it is done (no block
    outputs pile up); with autograd the blocks are concatenated through the block ops.

    Args:
        src: the features. shape: the sizes. dtype: the compute dtype (the features').
        out_dtype: the output's. device: where it lives. eps: added to the denominators.
        poison: ``(a, m) ->`` the NaN rule's NaN/−0.0 ``(B, H_kv, G|1, m, Dv)`` of queries
            ``[a, a + m)`` added to their output, or None.
        tape: filled with what `scan_backward` needs (states per block, ``den + eps`` per row).
    """
    P, dead, T, C = shape.P, shape.dead, shape.T, shape.chunk
    n = shape.block(dtype)
    if tape is not None:
        tape.n, tape.Fd = n, shape.F
    state = _key_state(src, shape, P, n, dtype, device)  # the keys before the first query
    rows = _Rows(shape, out_dtype, device, eps, poison, tape)
    rows.zeros(dead)
    for a, m in _block_starts(T, n):
        fq, (fk, va) = src.queries(dead + a, m), src.keys(P + a, m)
        if tape is not None:
            tape.states.append(state)
        acc, state = scan_block(fq, fk, va, state, C)  # (B, H_kv, G, m, Dv + 1)
        rows.add(dead + a, acc)
    return rows.result()


def scan_backward(src: BlockSource, shape: ScanShape, tape: Tape, grad_out: Tensor) -> None:
    """Runs the blocks of `scan_forward` in reverse from its tape, handing each block's feature
    gradients to ``src``; the state's gradient is carried towards the start and finally into
    the keys before the first query.

    Args:
        src: the features, recomputed block by block. shape: the sizes. tape: the forward's.
        grad_out: ``(B, H_kv, G, L, Dv)``, the gradient of the output.
    """
    B, H_kv, _, _, _, Fd, Dv, _ = shape
    P, dead, T, C = shape.P, shape.dead, shape.T, shape.chunk
    state0 = tape.states[0] if tape.states else None
    dtype = state0.dtype if state0 is not None else grad_out.dtype
    d_state = grad_out.new_zeros(B, H_kv, 1, Fd, Dv + 1, dtype=dtype)
    for i, (a, m) in reversed(list(enumerate(_block_starts(T, tape.n)))):
        fq, (fk, va) = src.queries(dead + a, m), src.keys(P + a, m)
        g = grad_out[:, :, :, dead + a : dead + a + m].to(dtype)
        dfq, dfk, dva, d_state = scan_block_backward(
            fq, fk, va, tape.states[i], tape.dens[i], g, d_state, C
        )
        src.query_grad(dead + a, m, fq, dfq)
        src.key_grad(P + a, m, fk, dfk, dva)
    d_s = d_state.squeeze(2)  # (B, H_kv, F, Dv + 1): into the initial state Σ φ(k) [v | 1]ᵀ
    for a, m in _block_starts(P, tape.n):
        fk, va = src.keys(a, m)
        src.key_grad(a, m, fk, va @ d_s.transpose(-1, -2), fk @ d_s)


def full_forward(
    src: BlockSource,
    shape: ScanShape,
    *,
    dtype: torch.dtype,
    out_dtype: torch.dtype,
    device: torch.device,
    eps: float,
    poison: Callable[[int, int], Tensor | None] | None = None,
    tape: Tape | None = None,
) -> Tensor:
    """Non-causal kernelised attention of ``src``'s features, block by block: one state
    ``Σ_j φ(k_j) [v_j | 1]ᵀ`` over all key blocks, read by every query block:
    ``(B, H_kv, G, L, Dv)`` in ``out_dtype``. Arguments as in `scan_forward` (every query sees
    every key; ``shape.C`` is unused); the tape keeps the state and each row's ``den + eps``."""
    n = shape.block(dtype)
    state = _key_state(src, shape, shape.S, n, dtype, device)  # every key
    if tape is not None:
        tape.n, tape.Fd, tape.states = n, shape.F, [state]
    rows = _Rows(shape, out_dtype, device, eps, poison, tape)
    for a, m in _block_starts(shape.L, n):
        rows.add(a, src.queries(a, m) @ state)  # (B, H_kv, G, m, Dv + 1)
    return rows.result()


def full_backward(src: BlockSource, shape: ScanShape, tape: Tape, grad_out: Tensor) -> None:
    """The backward of `full_forward` from its tape: each query block's features and its
    numerator (one product with the state) are recomputed; the state's gradient, summed over
    the query blocks, then goes to every key block.

    Args:
        src: the features, recomputed block by block. shape: the sizes. tape: the forward's.
        grad_out: ``(B, H_kv, G, L, Dv)``, the gradient of the output.
    """
    L, S, Dv = shape.L, shape.S, shape.Dv
    (state,) = tape.states
    d_state = torch.zeros_like(state)  # (B, H_kv, 1, F, Dv + 1)
    for i, (a, m) in enumerate(_block_starts(L, tape.n)):
        fq = src.queries(a, m)  # (B, H_kv, G, m, F)
        den = tape.dens[i]  # (B, H_kv, G, m, 1)
        zero = dead_rows(den)  # the forward output 0 there: no gradient
        t = grad_out[:, :, :, a : a + m].to(state.dtype) / torch.where(zero, torch.inf, den)
        g_num = ((fq @ state[..., :Dv]) * t).sum(-1, keepdim=True)  # g · num / den
        d_acc = torch.cat([t, torch.where(zero, 0.0, -g_num / den)], dim=-1)
        src.query_grad(a, m, fq, d_acc @ state.transpose(-1, -2))
        d_state += _sum_groups(fq.transpose(-1, -2) @ d_acc).unsqueeze(2)
    d_s = d_state.squeeze(2)  # (B, H_kv, F, Dv + 1)
    for a, m in _block_starts(S, tape.n):
        fk, va = src.keys(a, m)
        src.key_grad(a, m, fk, va @ d_s.transpose(-1, -2), fk @ d_s)


def recomputed_grads(run: Callable[..., Tensor], inputs: tuple, grad_out: Tensor) -> tuple:
    """The gradients of ``run(*inputs)`` with respect to its tensor inputs that require grad, as
    differentiable functions of them: a scan's backward under ``create_graph=True`` runs the
    forward again through the block ops (autograd all the way) and differentiates that, so
    higher derivatives exist; None for the other inputs, zeros for inputs the output does not
    depend on."""
    wanted = [x for x in inputs if isinstance(x, Tensor) and x.requires_grad]
    with torch.enable_grad():
        out = run(*inputs)
        grads = torch.autograd.grad(
            out, wanted, grad_out, create_graph=True, allow_unused=True, materialize_grads=True
        )
    it = iter(grads)
    return tuple(next(it) if isinstance(x, Tensor) and x.requires_grad else None for x in inputs)
