"""The tiled backend as ``torch.library`` custom operators, for ``torch.compile`` and export.

Under ``torch.compile`` the flash backend cannot be traced line by line: its tiling plan is built
in Python from the mask's block map (values read on the host). So compiled code calls two opaque
operators instead — ``attnlab::flash_fwd`` (`run.forward_marked`: the NaN rule included) and
``attnlab::flash_bwd`` (its registered gradient, `run.backward_marked`) — which rebuild the
request from tensors plus the mask's structure string (`Mask.spec`). Plans are built when the
graph RUNS, from the tensors it is given, so masks holding tensors (padding lengths, document
ids, bool tensors) stay correct from call to call. Supported under compile: masks with a
`Mask.spec` (every built-in mask, not `from_fn`), bool/float mask tensors and bias tensors
without gradient, and relative bias functions (``fn.relative = True``: ALiBi, T5) whose values
need no gradient, which travel as their table per offset (`engines.offset_table`). Other bias
functions and `from_fn` masks run on sdpa (`run.flash_supports` says so).

Imported on first use by the registry (`Backend.traced`: calls traced by ``torch.compile`` and
calls on ``meta`` tensors), so ``import attnlab`` registers no operator it may never need.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..._shapes import Dims, stat_dtype
from ...masks import from_spec
from ..registry import Backend
from ..request import Request, logit_qk
from .engines import OffsetTable, offset_table
from .plan import flash_options
from .run import FlashCall, backward_marked, flash_supports, forward_marked


def _request(
    q: Tensor, k: Tensor, v: Tensor, extra: tuple, touched: Tensor | None = None
) -> FlashCall:
    """The `FlashCall` an operator stands for: ``extra = (mask_tensors, float_mask, bias,
    mask_spec, scale, softcap, rel_bias)`` — the mask rebuilt from its spec and tensors, a
    relative bias function from its table (`engines.OffsetTable`)."""
    mask_tensors, float_mask, bias, mask_spec, scale, softcap, rel_bias = extra
    B, H, L, D = q.shape
    H_kv, S, Dv = k.shape[1], k.shape[2], v.shape[-1]
    mask = from_spec(mask_spec, list(mask_tensors)) if mask_spec else None
    req = Request(
        q=q,
        k=k,
        v=v,
        dims=Dims(B, H, H_kv, L, S, D, Dv, False),
        mask=float_mask if float_mask is not None else mask,
        bias=OffsetTable(rel_bias, S) if rel_bias is not None else bias,
        scale=scale,
        temperature=1.0,
        score="dot",
        dropout_p=0.0,
        return_weights=False,
        softcap=softcap,
    )
    return FlashCall(req, flash_options(), (), None, False if touched is None else bool(touched))


@torch.library.custom_op("attnlab::flash_fwd", mutates_args=())
def flash_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask_tensors: list[Tensor],
    float_mask: Tensor | None,
    bias: Tensor | None,
    mask_spec: str,
    scale: float,
    softcap: float | None,
    rel_bias: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:
    extra = (mask_tensors, float_mask, bias, mask_spec, scale, softcap, rel_bias)
    out, lse, touched = forward_marked(_request(q, k, v, extra))
    return out.contiguous(), lse.contiguous(), torch.tensor(bool(touched))


@flash_fwd.register_fake
def _(q, k, v, *_extra):  # noqa: ARG001 (a fake kernel takes the op's arguments)
    B, H, L, _ = q.shape
    stats = q.new_empty(B, H, L, dtype=stat_dtype(q.dtype))
    return q.new_empty(B, H, L, v.shape[-1]), stats, q.new_empty((), dtype=torch.bool)


@torch.library.custom_op("attnlab::flash_bwd", mutates_args=())
def flash_bwd(
    dout: Tensor,
    dlse: Tensor | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    touched: Tensor,
    mask_tensors: list[Tensor],
    float_mask: Tensor | None,
    bias: Tensor | None,
    mask_spec: str,
    scale: float,
    softcap: float | None,
    rel_bias: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:
    extra = (mask_tensors, float_mask, bias, mask_spec, scale, softcap, rel_bias)
    call = _request(q, k, v, extra, touched)
    if dlse is not None and not bool(torch.where(torch.isnan(lse), 0.0, dlse).any()):
        # a compiled graph passes zeros for an lse nobody differentiates (eager autograd passes
        # None): the job's dS path would replace its C++ kernels (82x slower, sliding window
        # 256, L = 4096, benchmarks/bench_compile.py). A host read inside the kernel, never traced.
        dlse = None
    return backward_marked(call, dout, dlse, (q, k, v, out, lse))  # type: ignore[return-value]


@flash_bwd.register_fake
def _(dout, dlse, q, k, v, *_rest):  # noqa: ARG001 (a fake kernel takes the op's arguments)
    # contiguous whatever the inputs' layout, as the real kernel returns them
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def setup_context(ctx, inputs, output) -> None:
    q, k, v, mask_tensors, float_mask, bias, mask_spec, scale, softcap, rel_bias = inputs
    ctx.save_for_backward(q, k, v, *output, float_mask, bias, rel_bias, *mask_tensors)
    ctx.mask_spec, ctx.scale, ctx.softcap = mask_spec, scale, softcap


def backward(ctx, dout: Tensor, dlse: Tensor, _touched: Tensor | None):
    q, k, v, out, lse, touched, float_mask, bias, rel, *tensors = ctx.saved_tensors
    rest = (tensors, float_mask, bias, ctx.mask_spec, ctx.scale, ctx.softcap, rel)
    dq, dk, dv = flash_bwd(dout, dlse, q, k, v, out, lse, touched, *rest)
    return dq, dk, dv, [None] * len(tensors), None, None, None, None, None, None


flash_fwd.register_autograd(backward, setup_context=setup_context)


def compiled_flash(req: Request) -> tuple[Tensor, Tensor]:
    """`run.flash_run_lse` as one custom operator (`flash_fwd`, its gradient `flash_bwd`)."""
    terms = req.terms
    mask, float_mask, bias = terms.structured, terms.float_mask, terms.bias_tensor
    spec = ("", []) if mask is None else mask.spec()
    if spec is None:
        if not req.q.is_meta:  # pragma: no cover - flash_supports declines these under compile
            raise ValueError(f"flash under torch.compile needs a mask with a spec, got {mask!r}")
        # meta tensors hold no values: the outputs' shapes do not depend on the mask (bias
        # functions are likewise not evaluated), so a mask without a spec needs no operator
        spec = ("", [])
    table = None
    if terms.bias_fn is not None:  # a relative function (`flash_supports` checked)
        d = req.dims
        table = offset_table(terms.bias_fn, d.H, d.L, d.S, req.q.device)
    # non-finite rows stay non-finite under scoring: the rule sees the same rows
    q, k, scale = logit_qk(req)
    # AOTInductor passes an empty Tensor[] to an operator as None (torch 2.13: its proxy executor
    # cannot tell [] from an absent list); `from_spec` ignores tensors past the spec's, so a
    # spec without tensors travels with one empty placeholder
    tensors = spec[1] or [req.q.new_empty(0)]
    extra = (tensors, float_mask, bias, spec[0], scale, req.softcap, table)
    out, lse, _ = flash_fwd(q, k, req.v, *extra)
    return out, lse


def _traced_run(req: Request) -> tuple[Tensor, None]:
    return compiled_flash(req)[0], None


def _traced_run_lse(req: Request) -> tuple[Tensor, None, Tensor]:
    out, lse = compiled_flash(req)
    return out, None, lse


TRACED = Backend(
    "flash",
    _traced_run,
    flash_supports,
    "tiled exact attention as custom operators (torch.compile, meta tensors)",
    tiled=True,
    run_lse=_traced_run_lse,
    softcap=True,
)
"""The flash backend as the registry runs it under ``torch.compile`` (`Backend.traced`)."""

__all__ = ["TRACED", "compiled_flash", "flash_bwd", "flash_fwd"]
