"""The tiled backend's eager computation with the NaN rule around it (`flash_run_marked`).

The tiles run on inputs whose non-finite entries are 0 (`nan_rule.clean_flagged`: on the C++
scan, finite inputs are not copied and, with no bias tensor, need no poisoning at all), and NaN is
added back where the rule puts it. A forward without autograd whose plan is only batched band
calls on attnlab's C++ kernel skips the scans: the kernel tests the entries it reads and a find
re-runs the call on the scanning path (`_run_band_checked`). Eager calls reach it through
`run.flash_run_lse`; compiled ones through the custom operator `ops.flash_fwd`.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from .. import nan_rule
from ..request import Request
from ..tiling import Plan
from . import band_kernel
from .autograd import needs_grad, run_clean
from .plan import flash_job, split_mask_bias
from .poison import poison_entries

_NAN = float("nan")


def flash_run_marked(req: Request, **options: object) -> tuple[Tensor, Tensor, bool | Tensor]:
    """`flash_run_lse`'s eager computation, and whether the NaN rule touched it:
    ``(out, lse, touched)``.

    ``touched`` is False when q, k and v were found finite and no value was poisoned — then
    ``out`` and ``lse`` are those of the clean computation on the inputs as given, which is what
    a backward needs (`ops.flash_bwd`). Otherwise True, or a 0-d bool tensor (a poisoning whose
    extent is a tensor: read it only where a host sync is allowed).
    """
    checked = _run_band_checked(req, options)
    if checked is not None:
        return (*checked, False)
    float_mask = isinstance(req.mask, Tensor) and req.mask.dtype != torch.bool
    (q, q_bad), (k, k_bad), (v, v_bad) = (nan_rule.clean_flagged(x) for x in (req.q, req.k, req.v))
    clean_req = replace(
        req,
        q=q,
        k=k,
        v=v,
        mask=nan_rule.clean_bias(req.mask) if float_mask else req.mask,  # type: ignore[arg-type]
        bias=nan_rule.clean_bias(req.bias) if isinstance(req.bias, Tensor) else req.bias,
    )
    job = flash_job(clean_req, **options)  # type: ignore[arg-type]
    out, lse = run_clean(job, clean_req)
    if not (q_bad or k_bad or v_bad or float_mask or isinstance(req.bias, Tensor)):
        # q, k, v are finite (scanned, `nan_rule.clean_flagged`) and no tensor holds a bias:
        # only a bias function can still poison rows, and its NaN/+inf shows in the clean lse
        if req.bias is None:
            return out, lse, False
        fn_bad = torch.isnan(lse) | torch.isposinf(lse)  # (B, H, L)
        out = nan_rule.add_nan(out, fn_bad.unsqueeze(-1))
        return out, torch.where(fn_bad, _NAN, lse), fn_bad.any()
    if req.bias is None and not isinstance(req.mask, Tensor):
        d = req.dims
        if req.mask is None:
            hi = torch.full((1, 1, 1), d.S, dtype=torch.long, device=req.q.device)
            interval = (None, hi)
        else:
            interval = req.mask.key_interval(d.L, d.S, device=req.q.device)
        if interval is not None and interval[0] is None:  # prefixes: one pass over out
            out, lse = nan_rule.poison_prefix(
                out, req.q, req.k, req.v, interval[1], lse=lse, own_out=True
            )
            return out, lse, True  # here q, k or v was cleaned
    original = replace(job.source, bias_tensors=split_mask_bias(req.mask, req.bias)[2])
    row_bad, bad = poison_entries(req, job.plan, original, lse)
    touched = True if q_bad or k_bad or v_bad else bad.any()
    return nan_rule.add_nan(out, bad), torch.where(row_bad, float("nan"), lse), touched


def band_kernel_covers(plan: Plan, q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Every row of the call is in a batched band call of attnlab's C++ kernel, once."""
    if plan.overlap or not band_kernel.runs_every_call(plan, q, k, v):
        return False
    calls = [c for g in plan.groups for c in g.calls]
    B, L = q.shape[0], q.shape[2]
    rows = sum((c.b1 - c.b0) * (c.r1 - c.r0) for c in calls)  # type: ignore[union-attr]
    return rows == B * L and all(c.r1 <= L for c in calls)  # type: ignore[union-attr]


def _run_band_checked(req: Request, options: dict[str, object]) -> tuple[Tensor, Tensor] | None:
    """The forward of a plan made only of batched band calls on attnlab's C++ kernel (sliding
    windows), without autograd, bias or tensor mask: the kernel tests the q, k and v entries it
    reads for NaN/±inf while packing them (`band_kernel.checking_inputs`) instead of the three
    scans of `nan_rule.clean_flagged` before the call (window 256, L = 16384, bf16 on a Xeon
    with AMX: 2.4–4.1 ms of a 17–20 ms call). Finite inputs give exactly the scanning path's
    result (the same job on the same tensors); None — run the scanning path — for any other
    plan, or when the kernel found a non-finite entry.
    """
    if req.bias is not None or isinstance(req.mask, Tensor):
        return None
    if any(needs_grad(x) for x in (req.q, req.k, req.v)):
        return None
    job = flash_job(req, **options)  # type: ignore[arg-type]
    if not band_kernel_covers(job.plan, req.q, req.k, req.v):
        return None
    with band_kernel.checking_inputs() as found:
        out, lse = run_clean(job, req)
    if not found or any(found):
        return None
    return out, lse


__all__ = ["band_kernel_covers", "flash_run_marked"]
