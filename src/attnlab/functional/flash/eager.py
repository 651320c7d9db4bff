"""The tiled backend's eager computation: the NaN rule around a differentiable `FlashJob` run.

`flash_run_marked` is what both entries run — the eager call (`run.flash_run_lse`) and the
custom operator of compiled code (`ops.flash_fwd`): the tiles run on inputs whose non-finite
entries are 0 (`nan_rule.clean_flagged`: on the C++ scan, finite inputs are not copied and, with
no bias tensor, need no poisoning at all), and NaN is added back where the rule puts it. A forward
without autograd whose plan is only batched band calls on attnlab's C++ kernel skips the scans:
the kernel tests the entries it reads and a find re-runs the call on the scanning path
(`_run_band_checked`).

`run_clean` is the differentiable entry, ``(out, lse)`` of a request whose inputs are finite. Its
forward runs a `FlashJob`; its backward recomputes it and is itself an autograd function
(`_FlashBackward`), so it can be vmapped (e.g. ``torch.autograd.grad(..., is_grads_batched=True)``);
differentiating it raises.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from .. import nan_rule
from ..request import Request
from . import band_kernel
from .engines import Residuals, TileSource
from .job import FlashJob
from .plan import FlashOptions, flash_job, flash_options, prepare_inputs
from .tiling import CALL_CAUSAL, Plan

# ---------------------------------------------------------------- eager, with the NaN rule
_NAN = float("nan")


def flash_run_marked(req: Request, **options: object) -> tuple[Tensor, Tensor, bool | Tensor]:
    """`flash_run_lse`'s eager computation, and whether the NaN rule touched it:
    ``(out, lse, touched)``.

    ``touched`` is False when q, k and v were found finite and no value was poisoned — then
    ``out`` and ``lse`` are those of the clean computation on the inputs as given, which is what
    a backward needs (`ops.flash_bwd`). Otherwise True, or a 0-d bool tensor (a poisoning whose
    extent is a tensor: read it only where a host sync is allowed).
    """
    opts = flash_options(**options)  # type: ignore[arg-type]  # the settings, read once
    checked = _run_band_checked(req, opts)
    if checked is not None:
        return (*checked, False)
    terms = req.terms
    scan = nan_rule.flash_ext_ready(req.q)  # asked once: q, k and v share device and dtype
    (q, q_bad), (k, k_bad), (v, v_bad) = (
        nan_rule.clean_flagged(x, scan) for x in (req.q, req.k, req.v)
    )
    clean_req = replace(
        req,
        q=q,
        k=k,
        v=v,
        mask=req.mask if terms.float_mask is None else nan_rule.clean_bias(terms.float_mask),
        bias=req.bias if terms.bias_tensor is None else nan_rule.clean_bias(terms.bias_tensor),
    )
    job = flash_job(clean_req, options=opts)
    out, lse = run_clean(job, clean_req)
    if not (q_bad or k_bad or v_bad or terms.additive):
        # q, k, v are finite (scanned, `nan_rule.clean_flagged`) and no tensor holds a bias:
        # only a bias function can still poison rows, and its NaN/+inf shows in the clean lse
        if req.bias is None:
            return out, lse, False
        fn_bad = torch.isnan(lse) | torch.isposinf(lse)  # (B, H, L)
        out = nan_rule.add_nan(out, fn_bad.unsqueeze(-1))
        return out, torch.where(fn_bad, _NAN, lse), fn_bad.any()
    if kernel_checks_inputs(req):
        d = req.dims
        if terms.structured is None:
            hi = torch.full((1, 1, 1), d.S, dtype=torch.long, device=req.q.device)
            interval = (None, hi)
        else:
            interval = terms.structured.key_interval(d.L, d.S, device=req.q.device)
        if interval is not None and interval[0] is None:  # prefixes: one pass over out
            out, lse = nan_rule.poison_prefix(
                out, req.q, req.k, req.v, interval[1], lse=lse, own_out=True
            )
            return out, lse, True  # here q, k or v was cleaned
    original = replace(job.source, bias_tensors=terms.additive)
    row_bad, bad = poison_entries(req, job.plan, original, lse)
    touched = True if q_bad or k_bad or v_bad else bad.any()
    return nan_rule.add_nan(out, bad), torch.where(row_bad, float("nan"), lse), touched


def kernel_checks_inputs(req: Request) -> bool:
    """No bias and no mask tensor: a plan of band calls may leave the NaN checks to attnlab's
    band kernel (`_run_band_checked`)."""
    t = req.terms
    return req.bias is None and t.bool_mask is None and t.float_mask is None


def band_kernel_covers(plan: Plan, q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Every row of the call is in a batched band call of attnlab's C++ kernel, once."""
    if plan.overlap or not band_kernel.runs_every_call(plan, q, k, v):
        return False
    calls = [c for g in plan.groups for c in g.calls]
    B, L = q.shape[0], q.shape[2]
    rows = sum((c.b1 - c.b0) * (c.r1 - c.r0) for c in calls)  # type: ignore[union-attr]
    return rows == B * L and all(c.r1 <= L for c in calls)  # type: ignore[union-attr]


def _run_band_checked(req: Request, options: FlashOptions) -> tuple[Tensor, Tensor] | None:
    """The forward of a plan made only of batched band calls on attnlab's C++ kernel (sliding
    windows), without autograd, bias or tensor mask: the kernel tests the q, k and v entries it
    reads for NaN/±inf while packing them (`band_kernel.checking_inputs`) instead of the three
    scans of `nan_rule.clean_flagged` before the call (measured: benchmarks/RESULTS.md). Finite
    inputs give exactly the scanning path's result (the same job on the same tensors); None —
    run the scanning path — for any other plan, or when the kernel found a non-finite entry.
    """
    if not kernel_checks_inputs(req) or any(needs_grad(x) for x in (req.q, req.k, req.v)):
        return None
    job = flash_job(req, options=options)
    if not band_kernel_covers(job.plan, req.q, req.k, req.v):
        return None
    with band_kernel.checking_inputs() as found:
        out, lse = run_clean(job, req)
    if not found or any(found):
        return None
    return out, lse


# ---------------------------------------------------------------- autograd
def needs_grad(x: Tensor) -> bool:
    """True when autograd records ``x`` (grad mode on and ``x.requires_grad``)."""
    return torch.is_grad_enabled() and x.requires_grad


def run_clean(job: FlashJob, req: Request) -> tuple[Tensor, Tensor]:
    """``(out (B, H, L, Dv), lse (B, H, L))`` of a request with finite inputs, differentiable.

    Bias tensors that require grad get their gradient (dS summed over broadcast dims).
    """
    q, k, v, Dv = prepare_inputs(req, job.engine)  # the scale's sign is in q: job.scale > 0
    biases = job.source.bias_tensors
    job.grad_biases = tuple(i for i, t in enumerate(biases) if needs_grad(t))
    out, lse = _FlashFunction.apply(q, k, v, job, *(biases[i] for i in job.grad_biases))
    if out.shape[-1] != Dv:
        out = out[..., :Dv]
    return out, lse


class _FlashFunction(torch.autograd.Function):
    """``(out, lse)`` of a job; its backward is `_FlashBackward` (so it can be vmapped)."""

    @staticmethod
    def forward(q: Tensor, k: Tensor, v: Tensor, job: FlashJob, *biases: Tensor):  # noqa: ARG004 (autograd.Function's signature)
        # biases: the bias tensors that need gradients (also held, in order, by job.source)
        return job.forward(q, k, v)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        q, k, v, job, *biases = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse, *biases)
        ctx.job = job
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, dout: Tensor | None, dlse: Tensor | None):
        q, k, v, out, lse, *biases = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        grads = _FlashBackward.apply(dout, dlse, q, k, v, out, lse, ctx.job, *biases)
        dq, dk, dv, *dbias = grads
        return (dq, dk, dv, None, *dbias)


_DOUBLE_BACKWARD = (
    "flash attention's backward is not differentiable: double backward (higher-order "
    "gradients, e.g. a gradient penalty) is not supported; use backend='reference'"
)


class _FlashBackward(torch.autograd.Function):
    """The recomputing backward of a job as a function of ``dout`` (and ``dlse``).

    Differentiating it raises (no double backward). Under `torch.vmap` — e.g.
    ``torch.autograd.grad(..., is_grads_batched=True)`` — it runs once per vmapped slice.
    """

    @staticmethod
    def forward(dout, dlse, q, k, v, out, lse, job: FlashJob, *biases):
        if torch._C._functorch.is_legacy_batchedtensor(dout):  # noqa: SLF001 (torch's legacy vmap has no public API)
            # autograd's is_grads_batched vmaps the backward graph with the legacy batching,
            # which bypasses `vmap` below: unwrap dout, run per slice, batch the results.
            level = torch._C._vmapmode_increment_nesting() - 1  # the innermost vmap level  # noqa: SLF001 (torch's legacy vmap has no public API)
            torch._C._vmapmode_decrement_nesting()  # noqa: SLF001 (torch's legacy vmap has no public API)
            plain = torch._remove_batch_dim(dout, level, 1, 0)  # (N, B, H, L, Dv)  # noqa: SLF001 (torch's legacy vmap has no public API)
            parts = [
                _FlashBackward.forward(plain[i], dlse, q, k, v, out, lse, job, *biases)
                for i in range(plain.shape[0])
            ]
            return tuple(
                torch._add_batch_dim(torch.stack(col), 0, level)  # noqa: SLF001 (as above)
                for col in zip(*parts, strict=True)
            )
        with torch.no_grad():
            res = Residuals(dout=dout.contiguous(), q=q, k=k, v=v, out=out, lse=lse)
            dq, dk, dv = job.backward(res, dlse)
            dbias = [
                g.to(job.source.bias_tensors[i].dtype).reshape(job.source.bias_tensors[i].shape)
                for g, i in zip(job.bias_grads, job.grad_biases, strict=True)
            ]
        return (dq, dk, dv, *dbias)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        pass

    @staticmethod
    def backward(ctx, *grads):  # noqa: ARG004 (autograd.Function's signature)
        raise RuntimeError(_DOUBLE_BACKWARD)

    @staticmethod
    def vmap(info, in_dims, dout, dlse, q, k, v, out, lse, job, *biases):
        args = (dout, dlse, q, k, v, out, lse)

        def pick(x, dim, i):
            return x if dim is None or x is None else x.select(dim, i)

        parts = [
            _FlashBackward.forward(
                *(pick(x, d, i) for x, d in zip(args, in_dims[:7], strict=True)),
                job,
                *(pick(b, d, i) for b, d in zip(biases, in_dims[8:], strict=True)),
            )
            for i in range(info.batch_size)
        ]
        stacked = tuple(torch.stack(col) for col in zip(*parts, strict=True))
        return stacked, (0,) * len(stacked)


# ---------------------------------------------------------------- where the rule puts NaN
def attended_hits(plan: Plan, source: TileSource, ind: Tensor) -> tuple[Tensor, Tensor]:
    """``any`` of the flags ``ind (B, H_kv, S, C)`` over each row's attended keys, tile by tile.

    Walks the plan's calls (EMPTY tiles are in none): calls without an additive tile reduce over
    their keys (FULL) or take the first flagged key (CAUSAL); the others multiply their keep tile
    (mask and bias −inf, from the ORIGINAL bias values) by the flags and also report rows with a
    NaN/+inf bias entry. Returns ``(hits (B, H, L, C), bias_bad (B, H, L))`` bool.
    """
    B, H, L = source.B, source.H, source.L
    H_kv, C = ind.shape[1], ind.shape[-1]
    G = H // H_kv
    hits = torch.zeros(B, H, L, C, dtype=torch.bool, device=ind.device)
    bias_bad = torch.zeros(B, H, L, dtype=torch.bool, device=ind.device)
    for c in plan.simple_calls():
        keys = c.key_index(ind.device)
        sub = ind[c.b0 : c.b1].index_select(2, keys)  # (nb, H_kv, K, C)
        R = c.r1 - c.r0
        rows = (slice(c.b0, c.b1), slice(None), slice(c.r0, c.r1))
        add = source.for_call(c)
        if add is None and c.kind == CALL_CAUSAL:
            hi = torch.arange(1, R + 1, device=ind.device).view(1, 1, R)
            hit = nan_rule.any_in_interval(sub, None, hi).repeat_interleave(G, dim=1)
        elif add is None:
            hit = (sub.amax(dim=2) > 0).unsqueeze(2).repeat_interleave(G, dim=1)
        else:
            hit = nan_rule.any_dense(sub, ~torch.isneginf(add)).flatten(1, 2)
            hit = hit.repeat_interleave(H // hit.shape[1], dim=1)  # (nb, H, R|1, C)
            bias_bad[rows] |= (torch.isnan(add) | torch.isposinf(add)).any(dim=-1)
        hits[rows] |= hit
    return hits, bias_bad


def poison_entries(
    req: Request, plan: Plan, source: TileSource, lse: Tensor
) -> tuple[Tensor, Tensor]:
    """Where the NaN rule puts NaN: ``(row_bad (B, H, L), bad (B, H, L, Dv))`` bool.

    ``req`` holds the ORIGINAL inputs and ``source`` evaluates the ORIGINAL additive terms. Which
    keys a row attends comes from the mask's `Mask.key_interval` when it has one, else from the
    plan's tiles. A bias *function* is not evaluated again: the clean run's lse is NaN/+inf
    exactly on rows where it returned NaN/+inf at an attended pair (the clean q, k, v are
    finite); its −inf entries are not removed from the attended keys of the k/v check.
    """
    d = req.dims
    tensor_bias = bool(source.bias_tensors)
    interval = None
    mask = req.terms.given_mask
    if mask is not None and not tensor_bias:
        interval = mask.key_interval(d.L, d.S, device=req.q.device)
    if not tensor_bias and (req.mask is None or interval is not None):
        row_bad, bad = nan_rule.bad_entries(req.q, req.k, req.v, interval=interval)
    else:
        if not tensor_bias:
            source = replace(source, bias_fn=None)  # the mask alone decides the attended keys
        ones = torch.ones(d.B, d.H_kv, d.S, 1, device=req.q.device)
        k_bad = nan_rule.row_flags(req.k).unsqueeze(-1)
        ind = torch.cat([ones, k_bad, nan_rule.flags(req.v)], dim=-1)  # (B, H_kv, S, 2 + Dv)
        hits, bias_bad = attended_hits(plan, source, ind)
        row_bad = hits[..., 0] & ((nan_rule.row_flags(req.q) > 0) | hits[..., 1] | bias_bad)
        bad = row_bad.unsqueeze(-1) | hits[..., 2:]
    if source.bias_fn is not None or (req.bias is not None and not tensor_bias):
        fn_bad = torch.isnan(lse) | torch.isposinf(lse)  # (B, H, L)
        row_bad = row_bad | fn_bad
        bad = bad | fn_bad.unsqueeze(-1)
    return row_bad, bad


__all__ = [
    "band_kernel_covers",
    "flash_run_marked",
    "kernel_checks_inputs",
    "needs_grad",
    "poison_entries",
    "run_clean",
]
