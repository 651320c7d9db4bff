"""Attention sinks on the tiled backend: folded into the C++ kernel's normalisation, with the
fused kernels' backward.

Forward. Where attnlab's C++ kernel writes every row of the call once (`run.folds_sinks`:
one causal or full segment, merge-free band calls of sliding windows, packed documents) the
sink joins each row's denominator where the kernel finalises it (``o /= l``):
``out'_i = Σ_j e^{l_ij − m_i} v_j / (e^{s_h − m_i} + Σ_j e^{l_ij − m_i})`` and
``lse'_i = log(e^{s_h} + Σ_j e^{l_ij})`` (`band_kernel`), so the sinks cost no pass over the
output. Other plans (merged partials, the torch engine, inputs the NaN rule touches) run plain
and apply ``out' = o · σ(lse − s)``, ``lse' = logaddexp(lse, s)`` after (`functional.sinks`).

Backward. The generic path (`functional.sinks.apply_sinks` on flash's differentiable ``(out, lse)``)
sends an lse gradient to flash's backward, which the fused kernels cannot take (they never
expose dS), so the torch tile engine runs instead. But with the sinks' results
``out' = o · σ(lse − s)`` and ``lse' = logaddexp(lse, s)``, the weights ``e^{l_ij − lse'_i}``
are the sink-inclusive weights ``P'`` and ``δ'_i = dout_i · out'_i``, so the plain backward on
``(out', lse')`` gives ``dl = P' ∘ (dout·vᵀ − δ')`` — the gradient of attention with sinks —
without any lse gradient. The sinks' own gradient: ``lse'_i`` depends on ``s_h`` through
``∂lse'_i/∂s_h = e^{s_h − lse'_i} = p_sink_i`` (the sink's weight in row i), and
``out'_i = Σ_j P'_ij v_j`` with ``P'_ij = e^{l_ij − lse'_i}``, so
``∂out'_i/∂s_h = −p_sink_i · out'_i``; hence

    ``ds_h = Σ_{b,i} p_sink_i (dlse'_i − dout_i · out'_i)``

(``−Σ p_sink_i · (dout_i · out'_i)`` without an lse gradient): one reduction over the output.

Eager only (`flash_run_sinks`); compiled calls take the generic path on flash's operators.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from .. import nan_rule
from ..request import Request, logit_qk
from ..sinks import apply_sinks, sink_outputs
from .plan import flash_job, flash_options
from .run import FlashCall, _cleaned, _run_job, backward_marked, forward_marked, needs_grad


def _clean_outputs(
    call: FlashCall, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor
) -> tuple[Tensor, Tensor]:
    """The clean ``(out', lse')`` of a call the NaN rule touched, with NaN/+inf sinks read as 0
    (what its backward recomputes): folded into the kernel again when the forward folded."""
    req = replace(call.req, q=q, k=k, v=v)
    req = _cleaned(req, *(nan_rule.clean(x) for x in (q, k, v)))
    job = flash_job(req, options=call.options, forward_only=False)
    if call.folded:  # (the NaN rule touched no input: only sinks were poisoned)
        assert call.sinks is not None
        job.sinks = torch.where(_bad_heads(call.sinks), 0.0, call.sinks)
        return _run_job(job, req)
    return sink_outputs(*_run_job(job, req), sinks)[:2]


class _FlashSinks(torch.autograd.Function):
    """``(out', lse')`` of attention with sinks on flash; backward on the kernels (module doc)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor, call: FlashCall, *biases):  # noqa: ARG004 (autograd.Function's signature: the inputs autograd tracks)
        out, lse, _ = forward_marked(call)
        ctx.call = call
        ctx.set_materialize_grads(False)
        if call.folded:  # the kernel's out' and lse' (NaN rows of a NaN/+inf sink: `backward`)
            ctx.save_for_backward(q, k, v, sinks, out, lse, lse)
            return out, lse
        scaled, new_lse, bad = sink_outputs(out, lse, sinks)  # clean: the sink read as 0
        poison = torch.where(bad, float("nan"), -0.0).unsqueeze(-1).to(scaled.dtype)
        lse_p = torch.where(bad, float("nan"), new_lse)
        ctx.save_for_backward(q, k, v, sinks, scaled, new_lse, lse_p)
        return scaled + poison, lse_p

    @staticmethod
    def backward(ctx, dout: Tensor | None, dlse: Tensor | None):
        q, k, v, sinks, out, lse, lse_p = ctx.saved_tensors
        call = ctx.call
        with torch.no_grad():
            # the NaN rule poisoned the plain results, or the kernel the rows of a NaN/+inf
            # sink: the gradients are those of the clean results (the sink read as 0)
            if bool(call.touched) or (call.folded and bool(_bad_heads(sinks).any())):
                out, lse = _clean_outputs(call, q, k, v, sinks)
            if dout is None:
                dout = torch.zeros_like(out)
            if dlse is not None:  # poisoned rows pass no lse gradient
                dlse = torch.where(torch.isnan(lse_p), 0.0, dlse)
            want_ds = ctx.needs_input_grad[3]
            # δ_i = dout_i · out'_i from the C++ backward where it runs every row (NaN: not
            # written), instead of a pass over dout and out (`_sinks_grad`)
            call.delta = (
                torch.full_like(lse, float("nan"), dtype=torch.float32) if want_ds else None
            )
            grads = backward_marked(call, dout, dlse, (q, k, v, out, lse))
            ds = _sinks_grad(sinks, out, lse, dout, dlse, call.delta) if want_ds else None
            call.delta = None
        return (*grads[:3], ds, None, *grads[3:])


def _bad_heads(sinks: Tensor) -> Tensor:
    """``(H,)`` bool: the sinks the NaN rule reads as poison (NaN or +inf)."""
    return ~(sinks < float("inf"))  # (one op fewer than isnan | isposinf: ~(NaN < inf) too)


def _sinks_grad(
    sinks: Tensor,
    out: Tensor,
    lse: Tensor,
    dout: Tensor,
    dlse: Tensor | None,
    delta: Tensor | None = None,
) -> Tensor:
    """``ds_h = Σ_{b,i} e^{s_h − lse'_i} (dlse'_i − δ_i)``, ``δ_i = dout_i · out'_i`` (``delta``
    when the C++ backward wrote every row of it, else computed here), 0 for a NaN/+inf sink."""
    H = lse.shape[1]
    s = sinks.to(lse.dtype)
    good = s < float("inf")  # (H,): the NaN rule reads a NaN/+inf sink as 0 (gradient 0)
    share = torch.exp(torch.where(good, s, 0.0).view(1, H, 1) - lse)  # (B, H, L)
    if delta is None or bool(torch.isnan(delta).any()):  # (a row the kernel did not write)
        delta = torch.linalg.vecdot(dout.to(lse.dtype), out.to(lse.dtype))  # (B, H, L)
    term = delta.to(lse.dtype) if dlse is None else delta.to(lse.dtype) - dlse.to(lse.dtype)
    ds = torch.nan_to_num(share * term, 0.0, 0.0, 0.0).sum(dim=(0, 2))  # (H,): Σ share·(δ − dlse)
    return torch.where(good, -ds, 0.0).to(sinks.dtype)


def fused_sinks(backend: object, req: Request) -> bool:
    """Whether `flash_run_sinks` should run a call that flash runs: eager (``backend`` is not
    the traced form), and a dtype and logits the fused kernels take (not float64, whose torch
    engine takes the lse gradient as it is; no soft-cap)."""
    eager = getattr(backend, "traced", None) is not None
    return eager and req.q.dtype != torch.float64 and req.softcap is None


def flash_run_sinks(req: Request, sinks: Tensor) -> tuple[Tensor, Tensor]:
    """``(out', lse')`` of a validated request with sinks ``(H,)`` on the tiled backend, whose
    backward runs the fused kernels on ``(out', lse')`` (`_FlashSinks`). Eager only."""
    q, k, scale = logit_qk(req)
    if q is not req.q or k is not req.k or scale != req.scale or req.temperature != 1.0:
        req = replace(req, q=q, k=k, scale=scale, temperature=1.0, score="dot")
    s32 = sinks.detach().to(torch.float32).contiguous()  # what the C++ kernel reads
    call = FlashCall(req, flash_options(), (), sinks=s32)
    biases = req.terms.additive
    call.grad_biases = tuple(i for i, t in enumerate(biases) if needs_grad(t))
    if not call.grad_biases and not any(needs_grad(x) for x in (q, k, req.v, sinks)):
        call.forward_only = True  # nothing to differentiate
        out, lse, _ = forward_marked(call)
        return (out, lse) if call.folded else apply_sinks(out, lse, sinks)[:2]
    grad = (biases[i] for i in call.grad_biases)
    return _FlashSinks.apply(q, k, req.v, sinks, call, *grad)


__all__ = ["flash_run_sinks", "fused_sinks"]
