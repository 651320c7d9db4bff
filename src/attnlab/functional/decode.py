"""Few query rows against many keys (decoding) as two matrix products, with the NaN rule built in.

Defined to equal `reference.attention` (see that function for every argument and the NaN rule).
A decode step — ``L`` of 1 to a few query rows against ``S`` cached keys, no gradient — is bound
by reading K and V once; torch's fused CPU kernel spends more than that on it (about 1.2–1.4× in
float32, 5–8× in bfloat16 on the machines of docs/results). Here the query heads that
share a key/value head (GQA) are stacked into one ``(G·L) × D`` block, so each K and V head is
read by one matrix product, and the logits ``(B, H_kv, G·L, S)`` are small enough to inspect:

    s = (q · scale / T) kᵀ,   out = softmax(s) v,   row i poisoned iff min_j s_ij is NaN or −inf

(a +inf or NaN logit already makes softmax's row NaN; a −inf one — an infinite key — would be
dropped, so the row minimum catches it). With ``softcap``, ``s ← softcap·tanh(s / softcap)``
before the softmax, and row i is poisoned iff some ``s_ij`` was non-finite before capping (tanh
would turn ±inf into ±softcap). Half-precision inputs are computed in float32 (the
logits are never rounded to bfloat16) and the output is cast back. Masks must leave every row a
prefix of the keys known from Python ints (`request.key_prefixes`): other keys are sliced away, so
non-finite values in padding never reach a row. No host synchronisation.

Without autograd and with the C++ operators (`attnlab._ext`, ``_ext/nan_rule.cpp``) the unmasked
step runs as one kernel per (item, key/value head) instead of these tensor ops: the cached k and
v rows are read in place (a cache's views are not copied), each once for the G·L query rows,
in float32 (float64 for float64 inputs), with the same poisoned rows; ``tests/test_ext.py``
holds it to the tolerance rule with the tensor ops as the naive.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._shapes import stat_dtype
from . import nan_rule
from .reference import softcap_logits
from .registry import _AUTO_ORDER  # auto's order (read, never changed, here)
from .request import SCORES, Request, key_prefixes, prefix_views

DECODE_MAX_L = 8
"""At most this many query rows (one decode step, or a short speculative draft)."""

DECODE_MIN_S = 512
"""Auto prefers the fused kernel below this many keys in float64 (and any dtype not in
`DECODE_MIN_KEYS`): both cost little more than the call."""

DECODE_MIN_KEYS = {torch.float32: 256, torch.bfloat16: 1, torch.float16: 1}
"""Auto prefers the decode path from this many keys summed over the batch (B·S), per dtype, when
its steps run as tensor ops (the C++ step unavailable: ``ATTNLAB_EXT=0``, no compiler, compiled).
Measured (one query row, H = 8, H_kv = 2, D = 64, AMD EPYC without AVX512-FP16, 1 and 2
threads, median of 100; docs/results), SDPA's time over the decode path's: float32
B=1 0.62–0.86× at S = 64, 0.92–1.06× at 140, 1.09–1.13× at 300; B=4 1.08–1.25× at 64, 1.17–1.39×
at 140; bfloat16 1.0–2.0× at B=1, S=64 and 1.5–9.7× at every larger size; float16 2.1–8.4× (0.8–1.5×
at B=1, S=16): torch's fused CPU kernel runs half-precision decode steps far below its float32
speed, where the decode path's two float32 products do not care. The C++ step
(``attnlab_nan::decode_attend``) is faster than SDPA at every size in float32 and 16 bits
(1.7–2.5× at B = 1 and 4, S = 8…256, Zen 5 EPYC; docs/results): auto then takes it
for every float32/16-bit step. Its float64 loop is not vectorised: float64 keeps `DECODE_MIN_S`."""

DECODE_MAX_ELEMENTS = 1 << 25
"""Bound on the float32 logits (and upcast K/V for half inputs) one call may hold (128 MB)."""


def _needs_grad(req: Request) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in (req.q, req.k, req.v))


def _size_reason(
    B: int, H: int, H_kv: int, L: int, S: int, D: int, Dv: int, dtype: torch.dtype
) -> str | None:
    """Why the sizes rule the decode path out (too many query rows, too large), or None."""
    if L > DECODE_MAX_L:
        return f"it is for at most {DECODE_MAX_L} query rows (decoding)"
    held = B * H * L * S
    if dtype not in (torch.float32, torch.float64):
        held += B * H_kv * S * (D + Dv)  # float32 copies of k and v
    if held > DECODE_MAX_ELEMENTS:
        return f"the logits would exceed {DECODE_MAX_ELEMENTS} elements"
    return None


def decode_supports(req: Request) -> str | None:
    """None if the decode path runs the call, else why not (one clause)."""
    d = req.dims
    if req.return_weights:
        return "it does not return the attention weights (return_weights=True)"
    if req.dropout_p > 0:
        return "it has no dropout"
    if req.score != "dot":
        return f"it computes dot-product scores only (score={req.score!r})"
    if _needs_grad(req):
        return "it is inference-only (no backward) and an input requires grad"
    if d.L > DECODE_MAX_L:
        return f"it is for at most {DECODE_MAX_L} query rows (decoding)"
    if key_prefixes(req) is None and req.shared_keys is None:
        return "its query rows do not all attend the same keys (one row, or a mask over keys)"
    return _size_reason(d.B, d.H, d.H_kv, d.L, d.S, d.D, d.Dv, req.q.dtype)


def _declines(B: int, S: int, dtype: torch.dtype, step: bool) -> str | None:
    """Auto's size rule (`DECODE_MIN_KEYS`, `DECODE_MIN_S`): None to take the decode path.
    ``step``: the C++ step runs the call (then every float32/16-bit size takes it)."""
    least = DECODE_MIN_KEYS.get(dtype)
    if step and least is not None:
        return None
    if least is None:
        if S < DECODE_MIN_S:
            return f"fewer than {DECODE_MIN_S} keys: sdpa's fused call is as fast"
        return None
    if least > B * S:
        name = str(dtype).removeprefix("torch.")
        return f"fewer than {least} keys over the batch in {name}: sdpa's fused call is as fast"
    return None


def decode_declines(req: Request) -> str | None:
    """Auto's preference: None for enough keys (per dtype) or a mask (`Request.shared_keys`:
    sdpa would render it and run the NaN rule's passes over it), else why sdpa is as good."""
    if key_prefixes(req) is None:
        return None
    step = nan_rule.ext_ready(req.q, req.k, req.v)
    return _declines(req.dims.B, req.dims.S, req.q.dtype, step)


def _attend(
    req: Request, q: Tensor, k: Tensor, v: Tensor, want_lse: bool
) -> tuple[Tensor, Tensor | None]:
    """Unmasked attention of ``q (b, H, L, D)`` over ``k, v (b, H_kv, n, ·)``.

    Returns ``out (b, H, L, Dv)`` in the compute dtype and, if asked, ``lse (b, H, L)``.
    """
    if not want_lse and nan_rule.ext_ready(q, k, v):
        # the C++ kernel: k and v read in place, once per k/v head (the rule, same NaN rows)
        cap = req.softcap or 0.0
        return torch.ops.attnlab_nan.decode_attend(q, k, v, req.logit_scale, softcap=cap), None
    b, H, L, D = q.shape
    H_kv, n, Dv = k.shape[1], k.shape[2], v.shape[-1]
    c = stat_dtype(q.dtype)
    # (b, H, L, D) → (b·H_kv, G·L, D): the G query heads sharing one k/v head, stacked (a view)
    qg = q.reshape(b * H_kv, (H // H_kv) * L, D)
    kk, vv = k.reshape(b * H_kv, n, D), v.reshape(b * H_kv, n, Dv)
    if q.dtype != c:
        qg, kk, vv = qg.to(c), kk.to(c), vv.to(c)
    s = torch.bmm(qg, kk.transpose(1, 2)).mul_(req.logit_scale)  # (b·H_kv, G·L, n)
    if req.softcap is None:
        low = s.amin(dim=-1, keepdim=True)  # NaN or −inf iff the row has such a logit
        poison = low - low  # +0.0, or NaN
    else:
        # tanh maps ±inf to ±1, so the row check reads the logits BEFORE capping: s·0 is NaN
        # exactly for a non-finite logit (a +inf one too: the cap would hide it from softmax)
        flag = nan_rule.nan_flags(s).sum(dim=-1, keepdim=True)  # ±0.0, or NaN
        poison = flag - flag  # +0.0, or NaN
        s = softcap_logits(s, req.softcap)
    out = torch.bmm(torch.softmax(s, dim=-1), vv).sub_(poison)  # x − (+0.0) == x
    if not want_lse:
        return out.view(b, H, L, Dv), None
    lse = torch.logsumexp(s, dim=-1, keepdim=True).add_(poison)
    return out.view(b, H, L, Dv), lse.view(b, H, L)


def _attend_keys(req: Request, keep: Tensor, want_lse: bool) -> tuple[Tensor, Tensor | None]:
    """`_attend` of the whole request over the keys ``keep (B|1, S)`` allows (tensor ops).

    Masked logits are −inf and masked values 0 (a non-finite entry there never reaches a row);
    a row is poisoned iff an attended logit is non-finite, and a row with no key is zeros
    (lse −inf) whatever its q.
    """
    q, k, v = req.q, req.k, req.v
    B, H, L, D = q.shape
    H_kv, S, Dv = k.shape[1], k.shape[2], v.shape[-1]
    c = stat_dtype(q.dtype)
    vv = torch.where(keep.view(-1, 1, S, 1), v, 0).reshape(B * H_kv, S, Dv).to(c)
    allowed = keep.view(-1, 1, 1, S).expand(B, H_kv, 1, S).reshape(B * H_kv, 1, S)
    qg = q.reshape(B * H_kv, (H // H_kv) * L, D).to(c)
    s = torch.bmm(qg, k.reshape(B * H_kv, S, D).to(c).transpose(1, 2)).mul_(req.logit_scale)
    # x − x: +0.0 for a finite logit, NaN otherwise (read before capping: tanh hides ±inf)
    poison = torch.where(allowed, s - s, 0.0).sum(dim=-1, keepdim=True)
    if req.softcap is not None:
        s = softcap_logits(s, req.softcap)
    s = s.masked_fill(~allowed, float("-inf"))
    some = allowed.any(dim=-1, keepdim=True)  # (B·H_kv, 1, 1)
    out = torch.bmm(torch.softmax(s, dim=-1), vv).add_(poison)
    out = torch.where(some, out, 0.0).view(B, H, L, Dv)
    if not want_lse:
        return out, None
    lse = torch.where(some, torch.logsumexp(s, dim=-1, keepdim=True) + poison, float("-inf"))
    return out, lse.view(B, H, L)


def _run_keys(req: Request, want_lse: bool) -> tuple[Tensor, Tensor | None]:
    """A call whose rows share their keys (`Request.shared_keys`): the C++ step reads only the
    attended keys in place (one run: no copy) when it can run; else `_attend_keys`."""
    keep = req.shared_keys
    assert keep is not None  # decode_supports
    if not want_lse and nan_rule.ext_ready(req.q, req.k, req.v):
        cap = req.softcap or 0.0
        out = torch.ops.attnlab_nan.decode_attend(req.q, req.k, req.v, req.logit_scale, keep, cap)
        return out.to(req.q.dtype), None
    out, lse = _attend_keys(req, keep, want_lse)
    return out.to(req.q.dtype), lse


def _run(req: Request, want_lse: bool) -> tuple[Tensor, Tensor | None]:
    d = req.dims
    prefixes = key_prefixes(req)
    if prefixes is None:
        return _run_keys(req, want_lse)
    if not want_lse and all(n == d.S for n in prefixes):  # one call on the whole batch
        return _attend(req, req.q, req.k, req.v, False)[0].to(req.q.dtype), None
    c = stat_dtype(req.q.dtype)
    outs, lses = [], []
    for views in prefix_views(req, prefixes):
        if views is None:  # nothing to attend: zeros, lse −inf
            outs.append(req.q.new_zeros(1, d.H, d.L, d.Dv, dtype=c))
            lses.append(req.q.new_full((1, d.H, d.L), float("-inf"), dtype=c))
            continue
        out, lse = _attend(req, *views, want_lse)
        outs.append(out)
        lses.append(lse)
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    if not want_lse:
        return out.to(req.q.dtype), None
    return out.to(req.q.dtype), lses[0] if len(lses) == 1 else torch.cat(lses)


def decode_step_ready(backend: str, q: Tensor, k: Tensor, v: Tensor, dropout_p: float) -> bool:
    """Whether ``attention(q, k, v, dropout_p=dropout_p, backend=backend)`` — no mask, bias,
    weights or soft-capping, the default scale — runs on the decode backend's C++ step, decided
    from shapes, dtypes and devices without building its `Request` (a decode step's fixed cost).

    True exactly when `registry.select` would give the decode backend to that request (explicitly
    named, or auto with "decode" first in its order: `decode_supports` and `decode_declines` on
    the same sizes) and the operators can run (`nan_rule.ext_ready`: built, eager, CPU, no
    gradient). False sends the caller to the general path, which decides again (and raises
    what `select` raises). ``tests/test_mha_fast_path.py`` checks the agreement with `select`.
    """
    if backend == "auto":
        if not _AUTO_ORDER or _AUTO_ORDER[0] != "decode":
            return False
    elif backend != "decode":
        return False
    if dropout_p > 0:
        return False
    B, H, L, D = q.shape
    H_kv, S, Dv = k.shape[1], k.shape[2], v.shape[3]
    if 0 in (B, H, L, S):  # the reference path runs empty calls
        return False
    if _size_reason(B, H, H_kv, L, S, D, Dv, q.dtype) is not None:
        return False
    if not nan_rule.ext_ready(q, k, v):  # (gradient: it refuses inputs that require grad)
        return False
    return backend != "auto" or _declines(B, S, q.dtype, step=True) is None


def fused_step_fits(backend: str, B: int, H: int, H_kv: int, S: int, D: int, dtype) -> bool:
    """Whether a block's fused one-token step (`attnlab.models.fused_step`) may run its attention
    on the decode kernel: ``backend`` is "decode", or "auto" with the decode backend first in
    auto's order, and the sizes fit (`_size_reason`; S counts the new key).

    Auto's preference for SDPA on a lone float32 call with few keys (`DECODE_MIN_KEYS`) is not
    applied: inside the fused step the decode kernel also rotates q, where SDPA would need RoPE's
    tensor ops and the NaN rule's around it.
    """
    if backend == "auto":
        if not _AUTO_ORDER or _AUTO_ORDER[0] != "decode":
            return False
    elif backend != "decode":
        return False
    return _size_reason(B, H, H_kv, 1, S, D, D, dtype) is None


def decode_step_run(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float | None = None,
    keys: Tensor | None = None,
    softcap: float | None = None,
) -> Tensor:
    """``attention(q, k, v, scale=scale, mask=keys, softcap=softcap)`` on the decode backend's
    C++ step, for calls `decode_step_ready` accepts: `decode_run` of their request without
    building it.

    ``scale``: None for the default ``1/√D`` (`trusted_request`'s). ``keys``: None (every key),
    or the keys every row attends, bool ``(B|1, S)`` (`Mask.key_mask`: a decoding step's mask
    rendered once for all layers of a model). ``softcap``: None, or logit soft-capping
    ``softcap·tanh(s / softcap)`` (Gemma 2)."""
    if scale is None:
        scale = SCORES["dot"].default_scale(q.shape[-1])
    out = torch.ops.attnlab_nan.decode_attend(q, k, v, scale, keys, softcap or 0.0)
    return out.to(q.dtype)


def rope_decode_run(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cos: Tensor,
    sin: Tensor,
    q_start: int,
    k_start: int | None,
    rotary_dim: int,
    interleaved: bool,
) -> Tensor:
    """A decode step whose q and k are given BEFORE RoPE (the module's cached step), in one call.

    Equals ``attention(rope(q, q_start), rope(k, k_start), v)`` on the decode backend (``k``
    unchanged for ``k_start=None``: keys rotated when they were cached), ``rope`` being
    `attnlab.positional.RoPE`'s eager table path, bit for bit: the C++ operator
    ``attnlab_nan::rope_decode_attend`` rotates in one pass with the same roundings as RoPE's
    tensor ops and then runs decode_attend's kernel, without a Python round trip per call.
    Only for calls `decode_step_ready` accepts.

    Args:
        q: ``(B, H, L, D)``; k: ``(B, H_kv, S, D)``; v: ``(B, H_kv, S, Dv)``.
        cos, sin: the RoPE tables ``(N, rotary_dim/2)`` for positions ``0…N−1`` (float32, or
            float64 for float64 inputs), ``N >= q_start + L`` and ``N >= k_start + S``.
        q_start: position of the first query row; k_start: of the first key (or None).
        rotary_dim: R, the rotated leading dims of D; interleaved: the pairwise layout.

    Returns:
        ``out (B, H, L, Dv)`` in ``q.dtype``, with the default scale ``1/√D``.
    """
    out = torch.ops.attnlab_nan.rope_decode_attend(
        q,
        k,
        v,
        cos,
        sin,
        q_start,
        0 if k_start is None else k_start,
        k_start is not None,
        rotary_dim,
        interleaved,
        SCORES["dot"].default_scale(q.shape[-1]),  # `trusted_request`'s scale
    )
    return out.to(q.dtype)


def decode_run_sinks(req: Request, sinks: Tensor) -> Tensor | None:
    """``out (B, H, L, Dv)`` of attention with sinks ``(H,)`` on the C++ step, or None where it
    does not run the call (then the caller applies the sinks to the plain output and lse).

    The sink joins each row's denominator where the step finalises it (``_ext/nan_rule.cpp``'s
    ``sink_inverse``): ``out_i = Σ_j e^{l_ij} v_j / (e^{s_h} + Σ_j e^{l_ij})`` at no extra pass
    (`reference.attention` with ``sinks=``); a NaN/+inf sink makes its head's rows with a key
    NaN, a row with no key stays zeros. It runs where `decode_run` runs the C++ step (every row
    attends all keys, or the keys every row shares), float32 and 16-bit inputs, and no gradient
    is asked of the sinks (the step has no backward; q, k and v already: `decode_supports`).
    """
    q, k, v = req.q, req.k, req.v
    if q.dtype == torch.float64 or not nan_rule.ext_ready(q, k, v):
        return None
    if torch.is_grad_enabled() and sinks.requires_grad:
        return None
    prefixes = key_prefixes(req)
    if prefixes is not None and any(n != req.dims.S for n in prefixes):
        return None
    keys = req.shared_keys if prefixes is None else None
    s32 = sinks.detach().to(torch.float32).contiguous()  # what the step reads
    cap = req.softcap or 0.0
    out = torch.ops.attnlab_nan.decode_attend(q, k, v, req.logit_scale, keys, cap, s32)
    return out.to(q.dtype)


def decode_run(req: Request) -> tuple[Tensor, None]:
    """``(out (B, H, L, Dv), None)``; rows of an item with ``n_b = 0`` are zeros."""
    return _run(req, want_lse=False)[0], None


def decode_run_lse(req: Request) -> tuple[Tensor, None, Tensor]:
    """``(out, None, lse (B, H, L))``, lse float32 (float64 for float64 inputs), −inf for an
    item with ``n_b = 0``."""
    out, lse = _run(req, want_lse=True)
    assert lse is not None
    return out, None, lse
