"""torch's fused ``scaled_dot_product_attention`` kernel as an attnlab backend.

Defined to equal `reference.attention` (see that function for the meaning of every argument and
for the NaN rule).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .._shapes import stat_dtype, static_bool
from ..masks import CausalMask
from . import nan_rule
from .reference import keep_mask
from .request import Request, get_score, key_prefixes, prefix_views, request_dense, request_interval


def sdpa_supports(req: Request) -> str | None:
    """SDPA computes everything but the weights and soft-capped logits."""
    if req.return_weights:
        return "torch's fused kernel does not return the attention weights (return_weights=True)"
    if req.softcap is not None:
        return (
            f"torch's scaled_dot_product_attention has no logit soft-capping "
            f"(softcap={req.softcap}): its fused kernel cannot apply tanh to the logits"
        )
    return None


def _needs_grad(*xs: Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in xs)


_HALF_DTYPES = (torch.bfloat16, torch.float16)


def _widens(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None) -> bool:
    """A float16/bfloat16 CPU call with gradient: the kernel runs on float32 copies.

    torch's CPU flash kernel (the fused path for D == Dv without dropout) backpropagates 16-bit
    inputs in their own dtype: it rounds the probabilities and dS to it for its products, adds
    each block of 32-256 query rows into the 16-bit dk/dv (each block of 512 keys into dq), and
    forms ``δ_i = Σ dout_i · out_i`` from the rounded output — every partial sum keeps 8 bits of
    mantissa (bfloat16). Keys many rows attend (global tokens) collect several ulps: dv 0.23
    for bfloat16, D = 256, L = 200, S = 77, ``global_local`` (issue 38), up to 1.8× the
    tolerance rule's bound at L = 767. Widened, the probabilities, the sums and δ stay float32
    and each gradient is rounded once, as on torch's math path (which widens 16-bit inputs
    itself). Costs the float32 kernel (slower than the 16-bit forward + backward; measured:
    docs/results) and float32 copies of q, k, v; calls without gradient keep the 16-bit
    kernel, whose forward accumulates in float32.
    """
    return (
        q.dtype in _HALF_DTYPES
        and q.device.type == "cpu"
        and _needs_grad(q, k, v, attn_mask if isinstance(attn_mask, Tensor) else None)
    )


def _kernel(req: Request, q: Tensor, k: Tensor, v: Tensor, attn_mask, is_causal: bool) -> Tensor:
    dtype = q.dtype
    if _widens(q, k, v, attn_mask):
        q, k, v = (x.to(torch.float32) for x in (q, k, v))
        if isinstance(attn_mask, Tensor) and attn_mask.is_floating_point():
            attn_mask = attn_mask.to(torch.float32)
    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=attn_mask,
        dropout_p=req.dropout_p,
        is_causal=static_bool(is_causal),
        scale=req.logit_scale,
        enable_gqa=static_bool(req.dims.H_kv != req.dims.H),
    )
    return out.to(dtype)  # the output itself when nothing was widened


def _unmasked(req: Request, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Every row attends every key of ``k``, ``v``; no bias, no gradient (e.g. decoding).

    Nothing can leak between rows, and the kernel itself propagates a non-finite ``v_j[d]`` into
    column d. It hides two cases that the rule makes non-finite — a row whose logits are all NaN
    (non-finite ``q_i``, or every key non-finite) comes back as 0, and a key whose logit is −inf
    is dropped — so rows with a non-finite ``q_i`` or any non-finite key of their head group are
    set to NaN: one sum over q and one over k, no copy of k or v. (A float32 sum over a head's
    keys that overflows — |k| entries near 1e34 — also counts as non-finite.)
    """
    d = req.dims
    out = _kernel(req, q, k, v, None, False)
    # one float per row (B, H_kv, G, L) and per head (B, H_kv); x − x is +0.0 for a finite sum
    # and NaN for a non-finite one
    acc = stat_dtype(q.dtype)
    B, L = q.shape[0], q.shape[2]  # (a batch slice of the request, see `_sliced`)
    s = q.sum(dim=-1, dtype=acc).view(B, d.H_kv, d.H // d.H_kv, L) + k.sum(
        dim=(2, 3), dtype=acc
    ).view(B, d.H_kv, 1, 1)
    poison = (s - s).view(B, d.H, L, 1)  # +0.0 or NaN
    return out.sub_(poison)  # x − (+0.0) == x bit for bit; the kernel's output is ours


def _sliced(req: Request) -> Tensor | None:
    """Calls whose rows attend key prefixes known from Python ints, without gradient.

    No mask, bottom-right causal with one query row, or a padding mask built from a list of ints
    (`request.key_prefixes`): each batch item runs `_unmasked` on a view of its keys — no mask
    tensor, no copies. Returns None for every other call.
    """
    d = req.dims
    prefixes = key_prefixes(req)
    if prefixes is None or req.score != "dot" or _needs_grad(req.q, req.k, req.v):
        return None
    outs = [
        req.q.new_zeros(1, d.H, d.L, d.Dv) if views is None else _unmasked(req, *views)
        for views in prefix_views(req, prefixes)
    ]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)


def _rows_may_be_empty(req: Request) -> bool:
    """True unless the call's shapes and mask kind alone prove that every query row attends at
    least one key (no mask, or bottom-right `causal()` with L <= S; S > 0 here, empty calls go to
    the reference). torch's kernel returns zeros for a row with no key only when its ``q_i`` is
    finite: a NaN ``q_i`` makes the row NaN, where the rule wants zeros whatever ``q_i``."""
    if req.bias is not None:
        return True
    return not (
        req.mask is None
        or (isinstance(req.mask, CausalMask) and static_bool(req.dims.L <= req.dims.S))
    )


def _prefix_ext(req: Request, is_causal: bool, clean_k: bool) -> Tensor | None:
    """Prefix calls (no mask, causal, padding, both) without bias or gradient, on the C++
    operator ``attnlab_nan::sdpa_prefix`` (`nan_rule.ext_ready`): one read of q, k, v, no copy
    of k/v unless they hold a non-finite entry, and the output written only where it becomes
    NaN. Bit-equal to the tensor-op path of `sdpa_run`; None when it does not apply."""
    if req.bias is not None or req.score != "dot" or req.dropout_p:
        return None
    if req.terms.bool_mask is not None or req.terms.float_mask is not None:
        return None
    if not nan_rule.ext_ready(req.q, req.k, req.v):  # before any tensor is made (meta, grad)
        return None
    d = req.dims
    if req.mask is None:
        hi = torch.full((1, 1, 1), d.S, dtype=torch.long)
    else:
        interval = request_interval(req)
        if interval is None or interval[0] is not None:
            return None
        hi = interval[1]
    if _rows_may_be_empty(req) and not nan_rule.known_finite(req.q):
        # the operator runs torch's kernel on q itself: a non-finite q_i of a row with no key
        # would come back NaN (the rule: zeros). Such calls take the tensor-op path, which
        # cleans q; a finite q costs one read (a shape answer, no host sync).
        return None
    allowed = None if is_causal or req.mask is None else request_dense(req)[0]
    return torch.ops.attnlab_nan.sdpa_prefix(
        req.q,
        req.k,
        req.v,
        allowed,
        hi,
        req.logit_scale,
        is_causal,
        d.H_kv != d.H,
        clean_k,
    )


def _finite(req: Request, is_causal: bool) -> Tensor | None:
    """Calls without gradient, bias, float mask, dropout or score transform whose q, k and v hold
    no NaN/±inf: torch's kernel with the bool mask is then already the rule's answer — a row
    that may attend nothing comes back zeros for a finite ``q_i`` (torch's CPU kernels since
    2.5; ``tests/test_sdpa_finite.py`` holds the installed torch to it). The C++ scan reads each
    input once and answers with a shape (`nan_rule.known_finite`: no host sync), so the call
    costs no copy and no poison pass (transformers' prefill with its padding mask). None when
    it does not apply (then `sdpa_run` cleans and poisons)."""
    if req.bias is not None or req.terms.float_mask is not None or req.score != "dot":
        return None
    if req.dropout_p or _needs_grad(req.q, req.k, req.v):
        return None
    if not all(nan_rule.known_finite(x) for x in (req.q, req.k, req.v)):
        return None
    allowed = None if is_causal else request_dense(req)[0]
    return _kernel(req, req.q, req.k, req.v, allowed, is_causal)


def sdpa_run(req: Request) -> tuple[Tensor, Tensor | None]:
    """Runs torch SDPA: bottom-right masks become dense masks, except plain causal with L == S.

    The NaN rule (`functional.nan_rule`): the kernel runs on inputs whose non-finite entries are
    0 — torch's kernel would zero a row whose logits are all NaN and spread ``0 · NaN`` from
    masked pairs — and NaN is added back exactly where the rule puts it. Calls without bias or
    gradient whose keys are a known prefix (decoding) skip the copies (`_sliced`), and so do
    calls without gradient on finite inputs (`_finite`). No host synchronisation.
    """
    s = get_score(req.score)
    # torch's is_causal path masks after scaling with -inf, so a negative scale turns the masked
    # logits into +inf (NaN output): use the dense mask then.
    is_causal = req.is_plain_causal and req.bias is None and req.logit_scale > 0
    # torch's fused CPU causal kernel skips masked logits (a NaN key cannot leak), so k is
    # cleaned there only for its gradient. Its math fallback (Dv != D, dropout, other devices)
    # adds −inf to q·k and NaN + (−inf) stays NaN: clean k then. v always (0 · NaN at masked
    # pairs).
    fused_causal = (
        is_causal and req.q.device.type == "cpu" and req.dims.Dv == req.dims.D and not req.dropout_p
    )
    # Whole-key calls with several query rows (prefill, no mask) go to the C++ scan first: one
    # read of q, k, v and the output left alone, where `_unmasked` reads q, k and the output
    # and writes the output again. Decoding (one row) and padding prefixes keep `_sliced`.
    ext_first = req.mask is None and req.dims.L > 1
    fast = _prefix_ext(req, is_causal, clean_k=not fused_causal) if ext_first else None
    if fast is None:
        fast = _sliced(req)
    if fast is None and not ext_first:
        fast = _prefix_ext(req, is_causal, clean_k=not fused_causal)
    if fast is None:
        fast = _finite(req, is_causal)
    if fast is not None:
        return fast, None
    allowed, additive = (None, None) if is_causal else request_dense(req)
    # A non-finite q_i only reaches row i, which is poisoned if it attends a key. q is cleaned
    # (a) when a row may attend nothing: torch's kernel zeros such a row only for a finite q_i,
    # and the rule wants zeros whatever q_i; (b) for any gradient: dq of course, and dk/dv too,
    # which the kernel's backward forms from q_i (0 · NaN = NaN even for a row with no key).
    if _rows_may_be_empty(req) or _needs_grad(req.q, req.k, req.v):
        q = nan_rule.clean(req.q)
    else:
        q = req.q
    k = req.k if fused_causal and not _needs_grad(req.k) else nan_rule.clean(req.k)
    v = nan_rule.clean(req.v)
    if req.score != "dot":
        q, k = s.prepare(q), s.prepare(k)
    attn_mask = allowed
    if additive is not None:
        clean_add = nan_rule.clean_bias(additive)
        attn_mask = clean_add if allowed is None else clean_add.masked_fill(~allowed, float("-inf"))
    out = _kernel(req, q, k, v, attn_mask, is_causal)
    interval = request_interval(req)
    if interval is not None and interval[0] is None:  # prefixes: causal, padding, both
        return nan_rule.poison_prefix(out, req.q, req.k, req.v, interval[1], own_out=True), None
    keep = None if interval is not None else keep_mask(allowed, additive)
    out, _ = nan_rule.poison(out, req.q, req.k, req.v, keep=keep, interval=interval, bias=additive)
    return out, None
