"""The tiled backend's computation: the registry's hooks, and the NaN rule around a `FlashJob`
with its gradient, as one forward and one backward that every caller runs.

- `forward_marked` runs a job on inputs whose non-finite entries are 0 (`nan_rule.clean_flagged`:
  on the C++ scan finite inputs are not copied and, with no bias tensor, need no poisoning at
  all) and adds NaN back where the rule puts it (`job.poison_entries`). A forward whose plan is
  only batched band calls on attnlab's C++ kernel skips the scans: the kernel tests the entries
  it reads and a find re-runs the call on the scanning path.
- `backward_marked` gives the gradients of that computation: those of the clean computation,
  the poison a constant added to ``out`` (poisoned rows pass no lse gradient, a cleaned entry
  gets 0). An
  untouched call runs the job's backward on the saved ``out`` and ``lse``; a touched one cleans
  the inputs and recomputes the clean forward first.

Eager calls run them as one autograd function (`_Flash`, whose backward `_FlashBackward` can be
vmapped and raises on double backward); compiled code as the custom operators of
`functional.flash.ops`, which call the same two functions. Both see q and k as the logits read
them (`request.logit_qk`: scored, the sign of the scale in q), so the scale is always > 0.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from .. import nan_rule
from ..request import Request, is_relative_bias, logit_qk
from ..sinks import sink_outputs
from . import band_kernel
from .calls import BandCall, SegmentCall
from .engines import Residuals
from .job import FlashJob, poison_entries
from .plan import FlashOptions, flash_job, flash_options, prepare_inputs

_NAN = float("nan")


# ---------------------------------------------------------------- the registry's hooks
def _compile_declines(req: Request) -> str | None:
    """What flash cannot run under torch.compile (see the module)."""
    terms = req.terms
    if terms.bias_fn is not None and not is_relative_bias(terms.bias_fn):
        return (
            "under torch.compile flash takes bias tensors and relative bias functions "
            "(fn.relative = True: ALiBi, T5), not other bias functions"
        )
    if terms.structured is not None and terms.structured.spec() is None:
        return "under torch.compile flash needs a mask with a spec (not from_fn)"
    if any(needs_grad(t) for t in terms.additive):
        return "under torch.compile flash computes no gradient for mask/bias tensors"
    return None


def flash_supports(req: Request) -> str | None:
    """None if the tiled backend computes this request, else the reason it does not."""
    if req.return_weights:
        return (
            "flash never materialises the (B, H, L, S) weights (return_weights=True); use "
            "attention(..., return_lse=True) and attention_weights(q, k, lse, rows=...)"
        )
    if req.dropout_p > 0:
        return f"flash does not implement dropout (dropout_p={req.dropout_p})"
    if torch.compiler.is_compiling():
        why = _compile_declines(req)
        if why is not None:
            return why
    fn = req.terms.bias_fn
    if fn is not None and torch.is_grad_enabled():
        d = req.dims
        one = torch.zeros((1, 1, 1, 1), dtype=torch.long, device=req.q.device)
        probe = fn(one, one, one + (d.S - d.L), one)
        if isinstance(probe, Tensor) and probe.requires_grad:
            return "flash computes no gradient for a bias function whose values require grad"
    return None


def flash_run(req: Request) -> tuple[Tensor, None]:
    """The registry's ``run``: output only."""
    return flash_run_lse(req)[0], None


def needs_grad(x: Tensor) -> bool:
    """True when autograd records ``x`` (grad mode on and ``x.requires_grad``)."""
    return torch.is_grad_enabled() and x.requires_grad


@dataclass
class FlashCall:
    """One call of `forward_marked` and `backward_marked`: the scored request (q and k as the
    logits read them, scale > 0), its options, the indices of the bias tensors that need
    gradients, and — set by the forward — its job and NaN-rule mark."""

    req: Request
    options: FlashOptions
    grad_biases: tuple[int, ...]
    job: FlashJob | None = None
    touched: bool | Tensor = False
    forward_only: bool = False  # no gradient will be asked (`flash_run_lse` knows)
    sinks: Tensor | None = None  # attention sinks (`flash.sinks`): the backward reads out', lse'
    folded: bool = False  # set by the forward: its out and lse include the sinks (`fold_sinks`)
    delta: Tensor | None = None  # (B, H, L): where the C++ backward writes δ (`Residuals`)


def flash_run_lse(req: Request, **options: object) -> tuple[Tensor, Tensor]:
    """Runs a validated request on the tiled backend: ``(out (B, H, L, Dv), lse (B, H, L))``.

    ``options`` are `flash_options`'s knobs (block_q, block_k, band_block, engine). q and k
    are scored here, differentiably (`request.logit_qk`); then `forward_marked` runs, through
    `_Flash` when something needs a gradient. Eager only: under ``torch.compile`` and on
    ``meta`` tensors the registry runs `ops.compiled_flash` instead (`Backend.traced`).
    """
    q, k, scale = logit_qk(req)
    if q is not req.q or k is not req.k or scale != req.scale or req.temperature != 1.0:
        req = replace(req, q=q, k=k, scale=scale, temperature=1.0, score="dot")
    call = FlashCall(req, flash_options(**options), ())  # type: ignore[arg-type]
    biases = req.terms.additive
    call.grad_biases = tuple(i for i, t in enumerate(biases) if needs_grad(t))
    if not call.grad_biases and not any(needs_grad(x) for x in (q, k, req.v)):
        call.forward_only = True
        return forward_marked(call)[:2]
    grad = (biases[i] for i in call.grad_biases)
    return _Flash.apply(q, k, req.v, call, *grad)


# ---------------------------------------------------------------- forward, with the NaN rule
def forward_marked(call: FlashCall) -> tuple[Tensor, Tensor, bool | Tensor]:
    """``(out, lse, touched)`` of a scored request (no autograd), the NaN rule included.

    ``touched`` is False when q, k and v were found finite and no value was poisoned — then
    ``out`` and ``lse`` are those of the clean computation on the inputs as given, which is what
    `backward_marked` reuses. Otherwise True, or a 0-d bool tensor (a poisoning whose extent is
    a tensor: read it only where a host sync is allowed). Sets ``call.job`` and ``call.touched``.
    """
    req, opts = call.req, call.options
    checked = _run_band_checked(call)
    if checked is not None:
        return (*checked, False)
    terms = req.terms
    scan = nan_rule.flash_ext_ready(req.q)  # asked once: q, k and v share device and dtype
    (q, q_bad), (k, k_bad), (v, v_bad) = (
        nan_rule.clean_flagged(x, scan) for x in (req.q, req.k, req.v)
    )
    clean_req = _cleaned(req, q, k, v)
    if call.job is None or clean_req is not req:  # (the band check's job serves an uncleaned call)
        call.job = flash_job(clean_req, options=opts, forward_only=call.forward_only)
    finite = scan and not (q_bad or k_bad or v_bad or terms.additive) and req.bias is None
    fold_sinks(call, clean_req, finite)  # only where nothing below touches out and lse
    out, lse = _run_job(call.job, clean_req)
    # without the C++ scan every input was copied: whether one held NaN/±inf is a tensor
    call.touched = True if scan else _nonfinite(req.q, req.k, req.v)
    if not (q_bad or k_bad or v_bad or terms.additive):
        # q, k, v are finite (scanned, `nan_rule.clean_flagged`) and no tensor holds a bias:
        # only a bias function can still poison rows, and its NaN/+inf shows in the clean lse
        if req.bias is None:
            call.touched = False
            return out, lse, False
        fn_bad = torch.isnan(lse) | torch.isposinf(lse)  # (B, H, L)
        call.touched = fn_bad.any()
        out = nan_rule.add_nan(out, fn_bad.unsqueeze(-1))
        return out, torch.where(fn_bad, _NAN, lse), call.touched
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
            return out, lse, call.touched  # here q, k or v was cleaned
    original = replace(call.job.source, bias_tensors=terms.additive)
    row_bad, bad = poison_entries(req, call.job.plan, original, lse)
    if not (scan and (q_bad or k_bad or v_bad)):
        call.touched = bad.any() if scan else call.touched | bad.any()
    return nan_rule.add_nan(out, bad), torch.where(row_bad, _NAN, lse), call.touched


def _nonfinite(*xs: Tensor) -> Tensor:
    """0-d bool: whether any of ``xs`` holds a NaN/±inf entry."""
    return ~torch.stack([torch.isfinite(x).all() for x in xs]).all()


def _cleaned(req: Request, q: Tensor, k: Tensor, v: Tensor) -> Request:
    """``req`` on cleaned q, k, v, with NaN/+inf of its mask and bias tensors replaced by 0."""
    terms = req.terms
    if q is req.q and k is req.k and v is req.v and not terms.additive:
        return req
    mask = req.mask if terms.float_mask is None else nan_rule.clean_bias(terms.float_mask)
    bias = req.bias if terms.bias_tensor is None else nan_rule.clean_bias(terms.bias_tensor)
    return replace(req, q=q, k=k, v=v, mask=mask, bias=bias)


def _run_job(job: FlashJob, req: Request) -> tuple[Tensor, Tensor]:
    """``(out (B, H, L, Dv), lse (B, H, L))`` of a job on finite inputs (engine's layout in,
    the value width out)."""
    q, k, v, Dv = prepare_inputs(req, job.engine)
    out, lse = job.forward(q, k, v)
    return (out if out.shape[-1] == Dv else out[..., :Dv]), lse


def kernel_checks_inputs(req: Request) -> bool:
    """No bias and no mask tensor: a plan of band calls may leave the NaN checks to attnlab's
    band kernel (`_run_band_checked`)."""
    t = req.terms
    return req.bias is None and t.bool_mask is None and t.float_mask is None


def band_kernel_covers(job: FlashJob, q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Every row of the call is in a batched band call of attnlab's C++ kernel, once."""
    plan = job.plan
    return job.own_kernel and plan.band_rows_once and band_kernel.runs_every_call(plan, q, k, v)


def _run_band_checked(call: FlashCall) -> tuple[Tensor, Tensor] | None:
    """The forward of a plan made only of batched band calls on attnlab's C++ kernel (sliding
    windows), without bias or tensor mask: the kernel tests the q, k and v entries it reads for
    NaN/±inf while packing them (`band_kernel.checking_inputs`) instead of the three scans of
    `nan_rule.clean_flagged` (measured: docs/results). Finite inputs give exactly the
    scanning path's result; None — run the scanning path — for any other plan, or when the
    kernel found a non-finite entry.
    """
    req = call.req
    if not kernel_checks_inputs(req):
        return None
    # (the scanning path may reuse the job)
    call.job = job = flash_job(req, options=call.options, forward_only=call.forward_only)
    if not band_kernel_covers(job, req.q, req.k, req.v):
        return None
    fold_sinks(call, req, True)
    with band_kernel.checking_inputs() as found:
        out, lse = _run_job(job, req)
    if not found or any(found):
        return None
    call.touched = False
    return out, lse


def folds_sinks(job: FlashJob, q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether ``job``'s forward can fold attention sinks into the C++ kernel's normalisation
    of each row (`band_kernel`: the sink joins the denominator where ``o /= l``): every row of
    the call is written once — one segment over the whole call, or merge-free band and segment
    calls of attnlab's C++ kernel covering every row, and plain calls of torch's kernel (a
    window's last rows, which get ``o · σ(lse − s)`` from the job) — with no merge, no torch
    engine, no row outside the plan (any dtype: a widened 16-bit forward folds on its float32
    run, and its backward reads that float32 output)."""
    plan = job.plan
    if job.engine != "kernel" or not job.own_kernel or job.rows is not None:
        return False
    if plan.single_call and not plan.biased:
        return plan.whole is not None and band_kernel.segments_usable(q, k, v, q.shape[2])
    if not (plan.covers_all and plan.merge_free):
        return False
    for c in (c for g in plan.groups for c in g.calls):
        if isinstance(c, SegmentCall):
            if not band_kernel.segments_usable(q, k, v, c.n):
                return False
        elif isinstance(c, BandCall):
            if not band_kernel.usable(q, k, v, c.bq):
                return False
        elif job.softcap is not None:  # a plain call (a window's last rows): torch's kernel,
            return False  # whose few rows the job gives the sinks after it (`apply_sinks`)
    return True


def fold_sinks(call: FlashCall, req: Request, allowed: bool) -> None:
    """Hands ``call.sinks`` to the call's job when ``allowed`` (the NaN rule will not touch the
    results) and `folds_sinks`: sets ``call.folded`` (else the caller applies the sinks to the
    plain ``out`` and ``lse``: `functional.sinks`)."""
    job = call.job
    assert job is not None
    call.folded = allowed and call.sinks is not None and folds_sinks(job, req.q, req.k, req.v)
    job.sinks = call.sinks if call.folded else None


# ---------------------------------------------------------------- backward
def backward_marked(
    call: FlashCall, dout: Tensor, dlse: Tensor | None, saved: tuple[Tensor, ...]
) -> tuple[Tensor, ...]:
    """``(dq, dk, dv, *dbias)`` of `forward_marked` (``saved = (q, k, v, out, lse)``, ``dbias``
    for ``call.grad_biases``), recomputed tile by tile.

    The gradients are those of the clean computation (the NaN rule adds its poison to ``out``
    as a constant; ``lse`` takes it by a select, so poisoned rows pass no lse gradient): an
    untouched call runs the job's backward on the inputs and the saved ``out`` and ``lse``; a
    touched one cleans the inputs and recomputes the clean forward first, and cleaned entries
    get 0.
    """
    q, k, v, out, lse = saved
    if dlse is not None:
        dlse = torch.where(torch.isnan(lse), 0.0, dlse)
    clean = bool(call.touched)
    req, job = call.req, call.job
    if clean or job is None or q is not req.q:
        req = replace(req, q=q, k=k, v=v)
        if clean:
            req = _cleaned(req, *(nan_rule.clean(x) for x in (q, k, v)))
        job = flash_job(req, options=call.options, forward_only=False)
    qp, kp, vp, Dv = prepare_inputs(req, job.engine)
    width = vp.shape[-1]
    if clean:  # the saved out/lse are poisoned: the clean ones, at the engine's width
        out, lse = job.forward(qp, kp, vp)
        if call.sinks is not None:
            out, lse, _ = sink_outputs(out, lse, call.sinks)
    elif width != Dv:  # the kernel engine ran on zero-padded values
        out = torch.nn.functional.pad(out, (0, width - Dv))
    if width != Dv:
        dout = torch.nn.functional.pad(dout, (0, width - Dv))
    job.grad_biases = call.grad_biases
    res = Residuals(dout.contiguous(), qp, kp, vp, out.contiguous(), lse, call.delta)
    dq, dk, dv = job.backward(res, dlse)
    grads = [dq[..., : q.shape[-1]], dk[..., : q.shape[-1]], dv[..., :Dv]]
    biases = call.req.terms.additive
    grads += [
        g.to(biases[i].dtype).reshape(biases[i].shape)
        for g, i in zip(job.bias_grads, call.grad_biases, strict=True)
    ]
    if clean:  # `nan_rule.clean`'s gradient: 0 at the entries it replaced
        raw = [q, k, v, *(biases[i] for i in call.grad_biases)]
        grads = [torch.where(torch.isfinite(x), g, 0.0) for x, g in zip(raw, grads, strict=True)]
    return tuple(g.contiguous() for g in grads)


class _Flash(torch.autograd.Function):
    """``(out, lse)`` of `forward_marked`; its backward is `_FlashBackward`."""

    @staticmethod
    def forward(q: Tensor, k: Tensor, v: Tensor, call: FlashCall, *biases: Tensor):  # noqa: ARG004 (autograd.Function's signature: the inputs autograd tracks)
        return forward_marked(call)[:2]

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        q, k, v, call, *biases = inputs
        ctx.save_for_backward(q, k, v, *output, *biases)
        ctx.call = call
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, dout: Tensor | None, dlse: Tensor | None):
        q, k, v, out, lse, *biases = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        grads = _FlashBackward.apply(dout, dlse, q, k, v, out, lse, ctx.call, *biases)
        return (*grads[:3], None, *grads[3:])


_DOUBLE_BACKWARD = (
    "flash attention's backward is not differentiable: double backward (higher-order "
    "gradients, e.g. a gradient penalty) is not supported; use backend='reference'"
)


class _FlashBackward(torch.autograd.Function):
    """`backward_marked` as a function of ``dout`` (and ``dlse``): differentiating it raises (no
    double backward); under `torch.vmap` — e.g. ``torch.autograd.grad(...,
    is_grads_batched=True)`` — it runs once per vmapped slice."""

    @staticmethod
    def forward(dout, dlse, q, k, v, out, lse, call: FlashCall, *biases):  # noqa: ARG004 (autograd.Function's signature)
        if torch._C._functorch.is_legacy_batchedtensor(dout):  # noqa: SLF001 (torch's legacy vmap has no public API)
            # autograd's is_grads_batched vmaps the backward graph with the legacy batching,
            # which bypasses `vmap` below: unwrap dout, run per slice, batch the results.
            level = torch._C._vmapmode_increment_nesting() - 1  # the innermost vmap level  # noqa: SLF001 (as above)
            torch._C._vmapmode_decrement_nesting()  # noqa: SLF001 (as above)
            plain = torch._remove_batch_dim(dout, level, 1, 0)  # (N, B, H, L, Dv)  # noqa: SLF001 (as above)
            parts = [
                backward_marked(call, plain[i], dlse, (q, k, v, out, lse))
                for i in range(plain.shape[0])
            ]
            return tuple(
                torch._add_batch_dim(torch.stack(col), 0, level)  # noqa: SLF001 (as above)
                for col in zip(*parts, strict=True)
            )
        with torch.no_grad():
            return backward_marked(call, dout, dlse, (q, k, v, out, lse))

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        pass

    @staticmethod
    def backward(ctx, *grads):  # noqa: ARG004 (autograd.Function's signature)
        raise RuntimeError(_DOUBLE_BACKWARD)

    @staticmethod
    def vmap(info, in_dims, dout, dlse, q, k, v, out, lse, call, *biases):  # noqa: ARG004 (autograd.Function's signature)
        def pick(x, dim, i):
            return x if dim is None or x is None else x.select(dim, i)

        saved = (q, k, v, out, lse)
        parts = [
            backward_marked(
                call,
                pick(dout, in_dims[0], i),
                pick(dlse, in_dims[1], i),
                tuple(pick(x, d, i) for x, d in zip(saved, in_dims[2:7], strict=True)),
            )
            for i in range(info.batch_size)
        ]
        stacked = tuple(torch.stack(col) for col in zip(*parts, strict=True))
        return stacked, (0,) * len(stacked)


__all__ = [
    "FlashCall",
    "backward_marked",
    "band_kernel_covers",
    "flash_run",
    "flash_run_lse",
    "flash_supports",
    "fold_sinks",
    "folds_sinks",
    "forward_marked",
    "kernel_checks_inputs",
    "needs_grad",
]
