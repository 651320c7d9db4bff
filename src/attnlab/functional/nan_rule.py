"""The NaN rule as tensor operations: clean the inputs, compute, then poison exactly what must be.

The rule (`reference.attention` defines it): row i's output, and every gradient through it, depends
only on ``q_i`` and the keys/values row i may attend. A non-finite ``q_i`` or attended ``k_j``, or
a NaN/+inf in an attended bias entry (−inf means masked), makes the whole row NaN; a non-finite
attended ``v_j[d]`` makes ``o_i[d]`` NaN and leaves the other columns exact; a non-finite value
anywhere else never reaches row i. A row that may attend nothing is zeros, even when ``q_i`` is NaN.

Every backend follows the same recipe, with no host synchronisation:

1. ``clean``: non-finite input entries become 0 (``nan_to_num``: one vectorised pass, and its
   gradient is 0 at those entries), so no kernel can spread NaN through ``0 · NaN`` or
   ``NaN + (−inf)`` at masked pairs;
2. the backend computes attention on the clean inputs;
3. `poison` adds NaN where the rule says and −0.0 elsewhere (``x + (−0.0) == x`` bit for bit).

Which rows and columns to poison needs, per query row, "does it attend a key whose k (or v[d]) is
non-finite": a reduction over the attended keys of 0/1 flags. Masks that give each row one key
interval (`Mask.key_interval`: causal, windows, padding, documents) answer it with a first-flag
index or prefix sums, O((S + L) · Dv); other masks use their dense rendering (``keep @ flags``).

Gradients are those of the clean computation (poison is a constant): finite for a finite
``dout``, and they reach only the inputs a row may attend.

Prefix masks without gradient (`poison_prefix`, and sdpa's prefix calls) run on two C++ operators
when they can be built (`attnlab._ext`, ``_ext/nan_rule.cpp``): they read q, k and v once and
write the output only where it becomes NaN, and ``sdpa_prefix`` copies k/v for cleaning only when
they hold a non-finite entry. Their results are bit-equal to the tensor-op path below, which runs
whenever they are unavailable (no compiler, ``ATTNLAB_EXT=0``), under ``torch.compile``, on
``meta`` and non-CPU tensors and with autograd. (One difference at the edge of the float range:
the tensor-op path detects a non-finite row by its float32 sum, so a finite row whose sum
overflows, |x| ≳ 1e36, counts as non-finite there; the operators test every entry.)
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _ext, _settings  # _ext loads nothing until `_ext.load` is called (never at import)
from .._shapes import stat_dtype

_NAN = float("nan")
_EXT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
# Whether each extension loaded, asked once per process (`attnlab._settings.forget`).
_LOADED: dict[str, bool] = {}
_settings.on_refresh(_LOADED.clear)


def ext_ready(*xs: Tensor) -> bool:
    """True if the C++ operators (``torch.ops.attnlab_nan``) may run on ``xs``: eager mode, CPU
    tensors of a float dtype that need no gradient, and the extension built (`attnlab._ext.load`:
    the first call on a machine compiles it)."""
    grad = torch.is_grad_enabled()
    for x in xs:
        if x.device.type != "cpu" or x.dtype not in _EXT_DTYPES or (grad and x.requires_grad):
            return False
    return not torch.compiler.is_compiling() and _loaded("nan_rule")


def _zeroed(x: Tensor) -> Tensor:
    """``x`` with NaN and ±inf replaced by 0.

    Eager: ``nan_to_num`` (one vectorised ATen kernel). Compiled: ``where(isfinite(x), x, 0)``,
    the same values, which Inductor vectorises and fuses into its neighbours (its C++ code for
    ``nan_to_num`` runs one element at a time; measured: docs/results,
    `benchmarks/bench_compile.py`).
    """
    if torch.compiler.is_compiling():
        return torch.where(torch.isfinite(x), x, 0.0)
    return torch.nan_to_num(x, 0.0, 0.0, 0.0)


class _Clean(torch.autograd.Function):
    """`_zeroed` whose backward is one compare and one select (``x == clean`` is False exactly
    at NaN/±inf), instead of the composite ``isfinite`` of torch's backward; compiled, the
    backward reads ``isfinite(x)`` (fused: nothing but x is saved)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor) -> Tensor:
        return _zeroed(x)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        if torch.compiler.is_compiling():
            ctx.save_for_backward(inputs[0])
        else:
            ctx.save_for_backward(inputs[0], output)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        saved = ctx.saved_tensors  # read once (activation checkpointing unpacks each once)
        if len(saved) == 1:
            return torch.where(torch.isfinite(saved[0]), grad, 0.0)
        x, c = saved
        return torch.where(x == c, grad, 0.0)


def clean(x: Tensor) -> Tensor:
    """``x`` with NaN and ±inf replaced by 0 (a copy; gradient 0 at replaced entries)."""
    if x.requires_grad and torch.is_grad_enabled():
        return _Clean.apply(x)
    return _zeroed(x)


def flash_ext_ready(x: Tensor) -> bool:
    """True if ``attnlab_flash.clean_copy`` (``_ext/flash_rule.cpp``) may scan ``x``: eager mode,
    a CPU tensor of a float dtype, and the extension built (`_loaded`)."""
    if x.device.type != "cpu" or x.dtype not in _EXT_DTYPES or torch.compiler.is_compiling():
        return False
    return _loaded("flash_rule")


def _loaded(name: str) -> bool:
    """`attnlab._ext.load` of ``name``, asked once per process (`attnlab._settings.forget`)."""
    answer = _LOADED.get(name)
    if answer is None:
        answer = _LOADED[name] = _ext.load(name)
    return answer


def clean_flagged(x: Tensor, ready: bool | None = None) -> tuple[Tensor, bool]:
    """``(clean(x), may_be_bad)``: `clean` that copies only when ``x`` holds a NaN/±inf entry.

    On the C++ operator (``attnlab_flash.clean_copy``) a finite ``x`` costs one read and comes
    back as ``x`` itself with ``may_be_bad = False`` (the operator answers with an empty tensor,
    so the decision is read from a shape, never from a tensor value: no host sync). Without the
    operator (no compiler, ``ATTNLAB_EXT=0``, under ``torch.compile``, meta/non-CPU tensors) this
    is ``(clean(x), True)``. Gradients are those of `clean` either way (the identity where ``x``
    is finite). ``ready``: `flash_ext_ready`'s answer for ``x``, when the caller asked already
    (q, k and v of one call share device and dtype: asked once).
    """
    if x.numel() == 0 or not (flash_ext_ready(x) if ready is None else ready):
        return clean(x), x.numel() != 0
    with torch.no_grad():
        copy = torch.ops.attnlab_flash.clean_copy(x.detach())
    if copy.numel() == 0:
        return x, False
    if x.requires_grad and torch.is_grad_enabled():
        return _Clean.apply(x), True
    return copy, True


def known_finite(x: Tensor) -> bool:
    """True when ``x`` is known to hold no NaN/±inf, so the NaN rule's flags may be skipped.

    ``attnlab_flash.clean_copy`` reads ``x`` once, in place whatever its strides (a block
    ``x[:, :, a:b]`` of a ``(B, H, L, D)`` tensor, transformers' ``(B, L, H, D)`` transposed),
    and answers with an empty tensor when every entry is finite: the answer is a shape, not a
    tensor value (no host sync). False whenever
    the operator cannot run (no compiler, ``ATTNLAB_EXT=0``, under ``torch.compile``, meta and
    non-CPU tensors): the caller then takes the path that handles non-finite entries.
    """
    if not flash_ext_ready(x):
        return False
    if x.numel() == 0:
        return True
    with torch.no_grad():
        return torch.ops.attnlab_flash.clean_copy(x.detach()).numel() == 0


def clean_bias(bias: Tensor) -> Tensor:
    """An additive bias with NaN and +inf replaced by 0; −inf (masked) stays."""
    return torch.nan_to_num(bias, nan=0.0, posinf=0.0, neginf=float("-inf"))


def nan_flags(x: Tensor) -> Tensor:
    """0 where ``x`` is finite, NaN where it is not, in x's dtype (sums of them are NaN exactly
    when a summand's entry is non-finite).

    Written with ``isfinite``, not as ``x · 0``: Inductor folds a product with the integer 0
    into the constant 0 (torch 2.13's constant-folding peephole; ``tests/test_inductor.py``
    keeps the reproducer), which would drop every NaN the rule must see.
    """
    nan = torch.full((), _NAN, dtype=x.dtype, device=x.device)
    return torch.where(torch.isfinite(x), torch.zeros((), dtype=x.dtype, device=x.device), nan)


def flags(x: Tensor) -> Tensor:
    """1.0 where ``x`` is non-finite, else 0, in float32."""
    return (~torch.isfinite(x)).to(torch.float32)


def row_flags(x: Tensor) -> Tensor:
    """1.0 where a row (last dim) of ``x`` holds a non-finite entry, else 0; float32 ``(...)``."""
    return (~torch.isfinite(x)).any(-1).to(torch.float32)


def _grouped(t: Tensor, H_kv: int) -> Tensor:
    """``(B|1, H|1, L, ·)`` → ``(B|1, H_kv|1, G|1, L, ·)``."""
    if t.shape[1] == 1:
        return t.unsqueeze(2)
    return t.unflatten(1, (H_kv, t.shape[1] // H_kv))


def any_in_interval(ind: Tensor, lo: Tensor | None, hi: Tensor) -> Tensor:
    """``any_{lo_i <= j < hi_i} ind[j, c]``: ind ``(B, H_kv, S, C)``; lo/hi ``(B|1, 1, L)``."""
    B, H_kv, S, C = ind.shape
    if lo is None:  # first flagged key per column, S if none: any ⟺ first < hi
        w = torch.arange(S, 0, -1, device=ind.device, dtype=torch.float32).view(S, 1)
        first = S - (ind * w).amax(dim=2)  # (B, H_kv, C)
        return first.unsqueeze(2) < hi.view(hi.shape[0], 1, -1, 1).to(first.dtype)
    zero = ind.new_zeros(B, H_kv, 1, C)
    prefix = torch.cat([zero, ind.cumsum(dim=2)], dim=2)  # (B, H_kv, S + 1, C); exact counts
    L = hi.shape[-1]

    def at(idx: Tensor) -> Tensor:
        idx = idx.reshape(idx.shape[0], 1, L, 1).expand(B, H_kv, L, C)
        return prefix.gather(2, idx)  # (B, H_kv, L, C)

    return (at(hi.clamp(min=0)) - at(lo)) > 0


def any_dense(ind: Tensor, keep: Tensor) -> Tensor:
    """``any_j keep[i, j] · ind[j, c]``: ind ``(B, H_kv, S, C)``, keep ``(B|1, H|1, L, S)``."""
    H_kv, S = ind.shape[1], ind.shape[2]
    # 0/1 entries are exact in bfloat16, and a positive count never rounds to 0
    kg = _grouped(keep.expand(*keep.shape[:-1], S), H_kv).to(torch.bfloat16)
    return (kg @ ind.to(torch.bfloat16).unsqueeze(2)) > 0  # (B, H_kv, G|1, L, C)


def bad_entries(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    keep: Tensor | None = None,
    interval: tuple[Tensor | None, Tensor] | None = None,
    bias: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Where the NaN rule makes the output non-finite.

    Args:
        q: ``(B, H, L, D)``, k: ``(B, H_kv, S, D)``, v: ``(B, H_kv, S, Dv)``: the original inputs.
        keep: bool broadcastable to ``(B, H, L, S)``: the pairs that may attend (mask and bias
            −inf applied); None with ``interval`` None means every pair.
        interval: ``(lo, hi)`` from `Mask.key_interval`, instead of ``keep``.
        bias: the original additive bias (NaN/+inf at an attended pair poisons the row), or None.

    Returns:
        ``(row_bad (B, H, L), bad (B, H, L, Dv))`` bool: whole rows, and every output entry.
    """
    B, H, L = q.shape[0], q.shape[1], q.shape[2]
    Dv = v.shape[-1]
    H_kv, S = k.shape[1], k.shape[2]
    G = H // H_kv if H_kv else 1
    ind = torch.cat([row_flags(k).unsqueeze(-1), flags(v)], dim=-1)  # (B, H_kv, S, 1 + Dv)
    if interval is not None:
        lo, hi = interval
        hi = hi.expand(hi.shape[0], 1, L)
        if lo is not None:
            lo, hi = torch.broadcast_tensors(lo.expand(lo.shape[0], 1, L), hi)
        hit = any_in_interval(ind, lo, hi)  # (B, H_kv, L, 1 + Dv)
        hit = hit.unsqueeze(2).expand(B, H_kv, G, L, 1 + Dv).flatten(1, 2)
        alive = (hi > (0 if lo is None else lo)).expand(B, 1, L) if S else None
    elif keep is not None:
        hit = any_dense(ind, keep).expand(B, H_kv, G, L, 1 + Dv).flatten(1, 2)
        alive = keep.any(dim=-1)  # (B|1, H|1, L)
    else:
        hit = (ind.amax(dim=2) > 0) if S else ind.new_zeros(B, H_kv, 1 + Dv, dtype=torch.bool)
        hit = hit.view(B, H_kv, 1, 1, 1 + Dv).expand(B, H_kv, G, L, 1 + Dv).flatten(1, 2)
        alive = None
    row_bad = (row_flags(q) > 0) | hit[..., 0]  # (B, H, L)
    if bias is not None:
        b = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))
        bad_b = torch.isnan(b) | torch.isposinf(b)
        if keep is not None:
            bad_b = bad_b & keep
        row_bad = row_bad | bad_b.any(dim=-1)
    if S == 0:
        row_bad = torch.zeros_like(row_bad)
    elif alive is not None:
        row_bad = row_bad & alive
    return row_bad, row_bad.unsqueeze(-1) | hit[..., 1:]  # (B, H, L), (B, H, L, Dv)


def poison(
    out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    keep: Tensor | None = None,
    interval: tuple[Tensor | None, Tensor] | None = None,
    bias: Tensor | None = None,
    weights: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Applies the NaN rule to ``out (B, H, L, Dv)`` computed on `clean` inputs.

    Args are as in `bad_entries` (the ORIGINAL q, k, v, bias), plus ``weights (B, H, L, S)`` to
    poison alike (rows of attended pairs), or None.

    Returns:
        ``(out, weights)`` with NaN where the rule says (``out + (−0.0)`` elsewhere: bit-exact).
    """
    row_bad, bad = bad_entries(q, k, v, keep=keep, interval=interval, bias=bias)
    if weights is not None:
        wbad = row_bad.unsqueeze(-1)
        if keep is not None:
            wbad = wbad & keep
        weights = torch.where(wbad, _NAN, weights)
    return add_nan(out, bad), weights


def add_nan(out: Tensor, bad: Tensor) -> Tensor:
    """``out`` with NaN where ``bad`` (broadcastable) is True, bit-exact elsewhere (adds −0.0)."""
    nan = torch.tensor(_NAN, dtype=out.dtype, device=out.device)
    zero = torch.zeros((), dtype=out.dtype, device=out.device).neg()
    return out + torch.where(bad, nan, zero)


def first_nonfinite(x: Tensor, block: int = 16) -> Tensor:
    """Index along dim 2 of the first non-finite entry of each column of ``x (B, H, S, C)``.

    ``S`` where a column is finite. Reads x once (sums of ``block`` rows; a block of finite values
    whose sum overflows, |x| ~ 1e36, counts as non-finite), then looks inside the first bad
    block of each column only: no x-sized temporary.
    """
    B, Hk, S, C = x.shape
    acc = stat_dtype(x.dtype)
    if torch.compiler.is_compiling():
        # Inductor fuses the test into the reduction (no x-sized temporary either), and nothing
        # branches on S, symbolic under dynamic shapes and export (a branch would guard it)
        return _first_true(~torch.isfinite(x), 2)
    nfull = S // block
    parts = []
    if nfull:
        head = x[:, :, : nfull * block].reshape(B, Hk, nfull, block, C)
        parts.append(head.sum(dim=3, dtype=acc))  # (B, Hk, nfull, C)
    if S % block:
        parts.append(x[:, :, nfull * block :].sum(dim=2, keepdim=True, dtype=acc))
    sums = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)  # (B, Hk, nb, C)
    first_block = _first_true(~torch.isfinite(sums), 2)  # (B, Hk, C); nb if none
    rows = first_block.unsqueeze(2) * block + torch.arange(block, device=x.device).view(block, 1)
    inside = x.gather(2, rows.clamp(max=max(S - 1, 0)))  # (B, Hk, block, C)
    bad = ~torch.isfinite(inside) & (rows < S)
    return torch.where(first_block < sums.shape[2], _first_true(bad, 2) + first_block * block, S)


def _first_true(x: Tensor, dim: int) -> Tensor:
    """Index of the first True along ``dim``, or its size when there is none (int64).

    ``min_j (j if x_j else n)``: one integer reduction. (``torch.max`` of a bool tensor with its
    index is what one would write, but Inductor's C++ code for it does not compile when the
    reduction leaves a vector tail, torch 2.13: ``tests/test_inductor.py`` keeps the reproducer.)
    """
    n = x.shape[dim]
    shape = [1] * x.dim()
    shape[dim] = n
    pos = torch.arange(n, device=x.device).view(shape)
    return torch.where(x, pos, n).amin(dim=dim)


def poison_prefix(
    out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    hi: Tensor,
    *,
    own_out: bool = False,
    lse: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """The NaN rule when every row attends a prefix of the keys, ``[0, hi_i)`` (causal, padding).

    Row i is NaN in column d iff the first key whose ``k`` (any entry) or ``v[d]`` is non-finite
    lies below ``hi_i``, or ``q_i`` is non-finite and ``hi_i > 0``. Costs one read of k and of
    v (`first_nonfinite`) and ONE pass over ``out``.

    Args:
        out: ``(B, H, L, Dv)`` computed on clean inputs. q, k, v: the original inputs.
        hi: ``(B|1, 1, L|1)`` int64, the end of each row's keys (from `Mask.key_interval`).
        own_out: ``out`` is the caller's own fresh tensor: without gradient it is filled in
            place (no out-sized temporary).
        lse: ``(B, H, L)`` log-sum-exp to poison alike (NaN on rows the rule poisons whole).

    Returns:
        ``out`` with NaN where the rule says (gradients pass to ``out`` unchanged); with ``lse``
        given, ``(out, lse)``.
    """
    if own_out and ext_ready(out, q, k, v) and (lse is None or lse.dtype in _EXT_DTYPES[:2]):
        # C++: reads q, k, v once and writes only the entries that become NaN
        lse = None if lse is None else lse.clone()
        torch.ops.attnlab_nan.poison_prefix_(out, q, k, v, hi, lse)
        return out if lse is None else (out, lse)
    B, H, L, Dv = out.shape
    H_kv, S = k.shape[1], k.shape[2]
    G = H // H_kv if H_kv else 1
    acc = stat_dtype(q.dtype)
    # a row of k (or q) is bad iff its sum is non-finite (a finite row overflows only at ~1e37)
    k_bad = ~torch.isfinite(k.sum(dim=-1, dtype=acc))  # (B, H_kv, S)
    first = torch.minimum(first_nonfinite(v), _first_true(k_bad, -1).unsqueeze(-1))
    q_bad = ~torch.isfinite(q.sum(dim=-1, dtype=acc))  # (B, H, L)
    hi = hi.expand(hi.shape[0], 1, L)
    hi_eff = torch.where(q_bad & (hi > 0), S + 1, hi)  # (B, H, L): a bad q poisons all columns
    cond = first.view(B, H_kv, 1, 1, Dv) < hi_eff.reshape(B, H_kv, G, L, 1)
    cond = cond.view(B, H, L, Dv)
    if torch.is_grad_enabled() and out.requires_grad:
        out = add_nan(out, cond)  # the gradient passes to out, as in `poison`
    else:
        out = out.masked_fill_(cond, _NAN) if own_out else torch.where(cond, _NAN, out)
    if lse is None:
        return out
    first_k = _first_true(k_bad, -1).view(B, H_kv, 1, 1)
    row_bad = (first_k < hi_eff.reshape(B, H_kv, G, L)).view(B, H, L)
    return out, torch.where(row_bad, _NAN, lse)
